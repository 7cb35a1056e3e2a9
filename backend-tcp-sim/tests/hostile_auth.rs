//! Issue 46: a peer is what the handshake proves. Each test performs the
//! attack through the public API and wire format, with its positive control.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use backend_tcp_sim::{NicConfig, NicError, SimNic};
use kv_transfer_core::auth::{AuthError, ClusterKey, RefusalCode};

fn key(s: &str) -> ClusterKey {
    ClusterKey::from_secret(s.as_bytes()).unwrap()
}

fn nic(name: &str, k: &ClusterKey) -> SimNic {
    SimNic::start(NicConfig::new(name).with_cluster_key(k.clone())).unwrap()
}

/// A NIC under another cluster key cannot connect: refused at both ends,
/// typed and counted; the same NICs under one key connect (positive control).
#[test]
fn hostile_a_nic_with_another_cluster_key_is_refused_typed_and_counted() {
    let k = key("the deployment's own secret");
    let decode = nic("decode", &k);
    let honest = nic("prefill", &k);
    honest.connect(decode.endpoint()).expect("one key: connected");
    let intruder = nic("intruder", &key("a guess at the deployment's secret"));
    let err = intruder.connect(decode.endpoint()).unwrap_err();
    assert!(matches!(err, NicError::Auth(AuthError::WrongKey)), "{err:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while decode.auth_stats().refused_by_peer + decode.auth_stats().wrong_key == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = decode.auth_stats();
    assert_eq!(s.established, 1, "{s:?}");
    assert_eq!(s.refused_by_peer, 1, "the intruder said why it gave up: {s:?}");
    assert_eq!(intruder.auth_stats().wrong_key, 1);
    assert!(decode.peer_by_name("intruder").is_none());
    assert!(decode.peer_by_name("prefill").is_some());
}

/// Forwards bytes both ways between `a` and `b` until either closes.
fn splice(a: TcpStream, b: TcpStream) {
    let pipe = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let mut buf = [0u8; 16384];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 || to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        })
    };
    let (a2, b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
    pipe(a, b);
    pipe(b2, a2);
}

/// One relay: M listens at its own address; honest B (same key as the
/// decode) is made to dial M for the decode; M forwards every byte to the
/// decode. Returns whether B's connect succeeded, the name the decode now
/// has a connection under, and the decode's handshake counts.
fn relay(answers_to_relay: bool) -> (Result<(), String>, bool, kv_transfer_core::auth::AuthStats) {
    let k = key("the deployment's own secret");
    let m = TcpListener::bind("127.0.0.1:0").unwrap();
    let m_addr = m.local_addr().unwrap().to_string();
    let mut cfg = NicConfig::new("decode").with_cluster_key(k.clone());
    if answers_to_relay {
        cfg.answers_to = vec![m_addr.clone()];
    }
    let decode = SimNic::start(cfg).unwrap();
    let decode_ep = decode.endpoint().to_string();
    let relay = std::thread::spawn(move || {
        let (from_b, _) = m.accept().unwrap();
        let to_decode = TcpStream::connect(&decode_ep).unwrap();
        splice(from_b, to_decode);
    });
    let b = nic("B", &k);
    let r = b.connect(&m_addr).map(|_| ()).map_err(|e| e.to_string());
    relay.join().unwrap();
    let relayed = decode.wait_for_peer("B", Duration::from_millis(300)).is_some();
    (r, relayed, decode.auth_stats())
}

/// Attack 3's mechanism on the simulator: a relayed handshake. Checked:
/// the decode refuses it (B dialed the relay's address, which the
/// handshake binds), typed and counted, and has no connection under B's
/// name. Positive control: a decode that answers to the relay's address
/// takes the relayed connection as B's.
#[test]
fn hostile_a_relayed_handshake_is_refused_because_the_dialed_address_is_bound() {
    let (r, relayed, stats) = relay(true);
    assert!(r.is_ok() && relayed, "positive control: the relay passes when its address is the decode's: {r:?}");
    let (r, relayed, stats2) = relay(false);
    eprintln!("relay: answers_to the relay {stats:?}; bound {stats2:?}: {r:?}");
    assert!(r.unwrap_err().contains("AddressMismatch"), "B is told why");
    assert!(!relayed, "the decode took the relayed connection as B's");
    assert_eq!(stats2.address_mismatch, 1, "{stats2:?}");
    assert_eq!(stats2.established, 0);
}

/// A recorded handshake replayed: the HELLO's nonce was seen, so the
/// decode refuses it at once (typed, counted); the recorded FINISH would
/// not verify against the decode's new nonce anyway. Positive control: the
/// first, live run of the same HELLO is answered with a CHALLENGE.
#[test]
fn hostile_a_replayed_handshake_is_refused_typed_and_counted() {
    use kv_transfer_core::auth::{read_frame, Dialer, DialerConfig, FrameKind, Identity};
    let k = key("the deployment's own secret");
    let decode = nic("decode", &k);
    let (_, hello) = Dialer::start(DialerConfig {
        key: k.clone(),
        context: backend_tcp_sim::wire::AUTH_CONTEXT.into(),
        me: Identity::new("prefill", "127.0.0.1:9"),
        dialed: decode.endpoint().into(),
        expect_name: None,
    })
    .unwrap();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(decode.endpoint()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(&hello.encode()).unwrap();
        answers.push(read_frame(&mut s).unwrap());
    }
    assert_eq!(answers[0].kind, FrameKind::Challenge, "positive control: the live HELLO is answered");
    assert_eq!(answers[1].kind, FrameKind::Refused);
    assert_eq!(answers[1].body, vec![RefusalCode::Replayed as u8]);
    // Counted once the handshake's thread returns (bounded: 5 s).
    let deadline = Instant::now() + Duration::from_secs(5);
    while decode.auth_stats().replayed == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(decode.auth_stats().replayed, 1);
}
