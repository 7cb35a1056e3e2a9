use super::*;
use std::sync::Arc;

fn key(s: &[u8]) -> ClusterKey {
    ClusterKey::from_secret(s).unwrap()
}

fn decode_cfg(k: &ClusterKey) -> AcceptorConfig {
    AcceptorConfig::new(k.clone(), "test", Identity::new("decode", "127.0.0.1:7000"))
}

fn dialer_cfg(k: &ClusterKey, name: &str, dialed: &str) -> DialerConfig {
    DialerConfig {
        key: k.clone(),
        context: "test".into(),
        me: Identity::new(name, "127.0.0.1:7100"),
        dialed: dialed.into(),
        expect_name: None,
    }
}

/// Runs a whole handshake in memory: (dialer's end, acceptor's end).
fn run(d: DialerConfig, a: &AcceptorConfig) -> (Result<Established, AuthError>, Result<Established, AuthError>) {
    let (dialer, hello) = Dialer::start(d).unwrap();
    let (acceptor, challenge) = match Acceptor::on_hello(a, hello, None) {
        Ok(x) => x,
        Err(e) => return (Err(AuthError::Refused(RefusalCode::of(&e))), Err(e)),
    };
    match dialer.on_challenge(challenge) {
        Ok((est, finish)) => (Ok(est), acceptor.on_finish(finish)),
        Err(e) => (Err(e), Err(AuthError::Refused(RefusalCode::Other))),
    }
}

#[test]
fn one_key_gives_one_session_with_both_names_bound() {
    let k = key(b"0123456789abcdef-cluster");
    let (d, a) = run(dialer_cfg(&k, "prefill", "127.0.0.1:7000"), &decode_cfg(&k));
    let (mut d, mut a) = (d.unwrap(), a.unwrap());
    assert_eq!(d.peer.identity, Identity::new("decode", "127.0.0.1:7000"));
    assert_eq!(a.peer.identity, Identity::new("prefill", "127.0.0.1:7100"));
    assert!(d.peer.authenticated && a.peer.authenticated);
    assert_eq!(d.session.id(), a.session.id());
    for i in 0..3u8 {
        let t = d.session.seal(&[i]);
        a.session.open(&[i], &t).unwrap();
        let t = a.session.seal(&[i, i]);
        d.session.open(&[i, i], &t).unwrap();
    }
}

#[test]
fn hostile_wrong_key_is_refused_at_both_ends_and_counted() {
    let (good, bad) = (key(b"the deployment's own secret"), key(b"an attacker's guess at it!!"));
    // Positive control: the same handshake under one key establishes.
    assert!(run(dialer_cfg(&good, "prefill", "127.0.0.1:7000"), &decode_cfg(&good)).1.is_ok());
    // A dialer without the key: it cannot check the acceptor's proof, and
    // it cannot make one the acceptor accepts.
    let (d, _) = run(dialer_cfg(&bad, "prefill", "127.0.0.1:7000"), &decode_cfg(&good));
    assert!(matches!(d, Err(AuthError::WrongKey)), "{d:?}");
    // Its FINISH, whatever it sends, is refused: here a proof under its own key.
    let (dialer, hello) = Dialer::start(dialer_cfg(&bad, "prefill", "127.0.0.1:7000")).unwrap();
    let (acceptor, _challenge) = Acceptor::on_hello(&decode_cfg(&good), hello, None).unwrap();
    let (_, own_challenge) =
        Acceptor::on_hello(&decode_cfg(&bad), Dialer::start(dialer_cfg(&bad, "p", "127.0.0.1:7000")).unwrap().1, None)
            .unwrap();
    let forged = dialer
        .on_challenge(own_challenge)
        .map(|(_, f)| f)
        .unwrap_or(Frame { kind: FrameKind::Finish, body: vec![7; MAC_LEN] });
    let counters = AuthCounters::default();
    let r = acceptor.on_finish(forged);
    assert!(matches!(r, Err(AuthError::WrongKey)));
    counters.count(&r);
    assert_eq!(counters.snapshot().wrong_key, 1);
}

#[test]
fn hostile_replayed_transcript_is_refused_typed() {
    let k = key(b"0123456789abcdef-cluster");
    let acc = decode_cfg(&k);
    let (dialer, hello) = Dialer::start(dialer_cfg(&k, "prefill", "127.0.0.1:7000")).unwrap();
    let (acceptor, challenge) = Acceptor::on_hello(&acc, hello.clone(), None).unwrap();
    let (_, finish) = dialer.on_challenge(challenge).unwrap();
    acceptor.on_finish(finish.clone()).unwrap();
    // The recorded HELLO again: refused by its nonce.
    assert!(matches!(Acceptor::on_hello(&acc, hello.clone(), None), Err(AuthError::Replayed)));
    // Past the replay cache (a listener restarted, or its window passed):
    // the acceptor's nonce is new, so the recorded FINISH proves nothing.
    let fresh = AcceptorConfig { replay: Arc::new(ReplayCache::new(1)), ..acc };
    let (acceptor, _) = Acceptor::on_hello(&fresh, hello, None).unwrap();
    assert!(matches!(acceptor.on_finish(finish), Err(AuthError::WrongKey)));
}

#[test]
fn hostile_relayed_nonce_is_refused_because_the_dialed_address_is_bound() {
    let k = key(b"0123456789abcdef-cluster");
    let decode = decode_cfg(&k);
    // M (no key) gets honest B to dial M's address for "decode" and relays
    // B's HELLO to the decode under B's name.
    let (b, hello) = Dialer::start(dialer_cfg(&k, "B", "127.0.0.66:7000")).unwrap();
    let r = Acceptor::on_hello(&decode, hello.clone(), None);
    assert!(matches!(r, Err(AuthError::AddressMismatch { ref dialed }) if dialed == "127.0.0.66:7000"), "{r:?}");
    // Positive control: an acceptor that does not bind the dialed address
    // (it "answers" to M's address too) completes the relayed handshake,
    // and M's connection would be B's.
    let unbound = AcceptorConfig { addresses: vec!["127.0.0.66:7000".into()], ..decode_cfg(&k) };
    let (acceptor, challenge) = Acceptor::on_hello(&unbound, hello, None).unwrap();
    let (_, finish) = b.on_challenge(challenge).unwrap();
    assert_eq!(acceptor.on_finish(finish).unwrap().peer.identity.name, "B");
    // M rewrites the dialed field instead: the decode answers, but B's
    // check of the decode's proof (over what B sent) fails, so B never
    // sends a FINISH, and M cannot make one.
    let (b, hello) = Dialer::start(dialer_cfg(&k, "B", "127.0.0.66:7000")).unwrap();
    let mut body = hello.body.clone();
    let at = body.len() - "127.0.0.66:7000".len();
    body.truncate(at - 2);
    body.extend_from_slice(&("127.0.0.1:7000".len() as u16).to_le_bytes());
    body.extend_from_slice(b"127.0.0.1:7000");
    let (acceptor, challenge) = Acceptor::on_hello(&decode, Frame { kind: FrameKind::Hello, body }, None).unwrap();
    assert!(matches!(b.on_challenge(challenge), Err(AuthError::WrongKey)));
    assert!(matches!(
        acceptor.on_finish(Frame { kind: FrameKind::Finish, body: vec![0; MAC_LEN] }),
        Err(AuthError::WrongKey)
    ));
}

#[test]
fn hostile_a_session_bound_to_another_address_or_protocol_is_refused() {
    let k = key(b"0123456789abcdef-cluster");
    let other_port = run(dialer_cfg(&k, "prefill", "127.0.0.1:7001"), &decode_cfg(&k)).1;
    assert!(matches!(other_port, Err(AuthError::AddressMismatch { .. })));
    let mut other_proto = dialer_cfg(&k, "prefill", "127.0.0.1:7000");
    other_proto.context = "verbs".into();
    assert!(matches!(run(other_proto, &decode_cfg(&k)).1, Err(AuthError::ContextMismatch { .. })));
    let mut wants = dialer_cfg(&k, "prefill", "127.0.0.1:7000");
    wants.expect_name = Some("decode-2".into());
    assert!(matches!(run(wants, &decode_cfg(&k)).0, Err(AuthError::NameMismatch { .. })));
}

#[test]
fn a_session_message_counts_once_in_order_and_only_from_its_own_session() {
    let k = key(b"0123456789abcdef-cluster");
    let (d1, a1) = run(dialer_cfg(&k, "prefill", "127.0.0.1:7000"), &decode_cfg(&k));
    let (d2, _) = run(dialer_cfg(&k, "prefill", "127.0.0.1:7000"), &decode_cfg(&k));
    let (mut d1, mut a1, mut d2) = (d1.unwrap(), a1.unwrap(), d2.unwrap());
    assert_ne!(d1.session.id(), d2.session.id());
    let from_other = d2.session.seal(b"ABORT");
    assert!(matches!(a1.session.open(b"ABORT", &from_other), Err(AuthError::BadTag)));
    let t0 = d1.session.seal(b"one");
    let t1 = d1.session.seal(b"two");
    assert!(a1.session.open(b"two", &t1).is_err(), "out of order");
    a1.session.open(b"one", &t0).unwrap();
    assert!(a1.session.open(b"TWO", &t1).is_err(), "altered");
    a1.session.open(b"two", &t1).unwrap();
    // A tag goes one way only: the dialer's tag is no good coming back.
    let t = d1.session.seal(b"x");
    assert!(d1.session.open(b"x", &t).is_err());
}

#[test]
fn the_driver_runs_a_handshake_over_a_socket_pair_and_counts_refusals() {
    use std::os::unix::net::UnixStream;
    let k = key(b"0123456789abcdef-cluster");
    let (counters_d, counters_a) = (Arc::new(AuthCounters::default()), Arc::new(AuthCounters::default()));
    for (dialer_key, ok) in [(k.clone(), true), (key(b"not the cluster's secret"), false)] {
        let (mut s1, mut s2) = UnixStream::pair().unwrap();
        let acc = decode_cfg(&k);
        let ca = Arc::clone(&counters_a);
        let t = std::thread::spawn(move || accept(&mut s2, &acc, None, &ca).map(|e| e.peer.identity.name));
        let d = dial(&mut s1, dialer_cfg(&dialer_key, "prefill", "127.0.0.1:7000"), &counters_d);
        let a = t.join().unwrap();
        assert_eq!(d.is_ok(), ok);
        assert_eq!(a.is_ok(), ok, "{a:?}");
        if ok {
            assert_eq!(a.unwrap(), "prefill");
        } else {
            // The dialer found the acceptor's proof wrong and said so: the
            // acceptor's error is typed, not a bare EOF.
            assert!(matches!(a, Err(AuthError::Refused(RefusalCode::WrongKey))), "{a:?}");
        }
    }
    assert_eq!(counters_d.snapshot().established, 1);
    assert_eq!(counters_d.snapshot().wrong_key, 1);
    assert_eq!(counters_a.snapshot().refused_by_peer, 1);
}

#[test]
fn frames_are_size_checked_before_anything_is_read_and_garbage_never_panics() {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(b"KVTA");
    h[4] = 1;
    h[5] = 1;
    h[6..8].copy_from_slice(&u16::MAX.to_le_bytes());
    assert!(matches!(Frame::check_header(&h), Err(AuthError::Malformed(_))));
    h[4] = 9;
    assert!(matches!(Frame::check_header(&h), Err(AuthError::Version(9))));
    let k = key(b"0123456789abcdef-cluster");
    let acc = decode_cfg(&k);
    let (_, hello) = Dialer::start(dialer_cfg(&k, "prefill", "127.0.0.1:7000")).unwrap();
    // Every truncation and every one-byte change of a HELLO: a typed
    // refusal or (a change inside a field's text) a handshake, never a panic.
    for cut in 0..hello.body.len() {
        let f = Frame { kind: FrameKind::Hello, body: hello.body[..cut].to_vec() };
        assert!(Acceptor::on_hello(&acc, f, None).is_err());
    }
    let mut x: u32 = 0x9e37_79b9;
    for _ in 0..2000 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let mut body = hello.body.clone();
        let i = x as usize % body.len();
        body[i] ^= (x >> 8) as u8 | 1;
        let _ = Acceptor::on_hello(&acc, Frame { kind: FrameKind::Hello, body }, None);
        let _ = Frame::decode(&hello.encode()[..(x as usize % (HEADER_LEN + hello.body.len()))]);
    }
    let empty = Frame { kind: FrameKind::Hello, body: Vec::new() };
    assert!(matches!(Acceptor::on_hello(&acc, empty, None), Err(AuthError::Malformed(_))));
}

#[test]
fn keys_come_from_the_deployment_and_never_show_in_debug() {
    assert!(matches!(ClusterKey::from_secret(b"too short"), Err(KeyError::Length(9))));
    let dir = std::env::temp_dir().join(format!("kvt-key-{}", std::process::id()));
    std::fs::write(&dir, b"0123456789abcdef0123\n").unwrap();
    let from_file = ClusterKey::from_file(&dir).unwrap();
    let _ = std::fs::remove_file(&dir);
    let given = ClusterKey::from_secret(b"0123456789abcdef0123").unwrap();
    assert_eq!(from_file.fingerprint(), given.fingerprint(), "the trailing newline is not part of the secret");
    assert!(matches!(from_file.source(), KeySource::File(_)));
    let shown = format!("{given:?}");
    assert!(!shown.contains("0123456789"), "{shown}");
    let single = ClusterKey::single_host();
    assert!(!single.authenticates());
    assert_ne!(single.fingerprint(), given.fingerprint());
    // Single-host mode still runs the whole handshake (names, addresses,
    // freshness); its peers are marked unauthenticated.
    let (_, a) = run(dialer_cfg(&single, "prefill", "127.0.0.1:7000"), &decode_cfg(&single));
    assert!(!a.unwrap().peer.authenticated);
}
