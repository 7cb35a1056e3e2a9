//! Attack 11 on MORI on verbs' side channel (issue 29): 10x the
//! per-address cap of connections that send nothing or half a hello,
//! held open from 127.0.0.2; an honest dialer from 127.0.0.1 (the public
//! wire form: an offer with the acceptor's ticket, its own ticket, READY)
//! is still answered within a bound. Positive control: the serial acceptor
//! (one handshake at a time, as before) leaves it unanswered.
//!
//! Every raw connection here starts with core's handshake under the cluster
//! key ([`ClusterKey::from_env`], as the transports under test), as an
//! honest dialer's does; a half hello is half of that handshake's HELLO.
//!
//! Attack 12 (issue: the side channel under the cluster key): a dialer
//! under another cluster key is refused (typed, counted), and so is an
//! honest dialer's handshake relayed by a TCP proxy at another address
//! (address mismatch); positive controls: the same key connects, and an
//! acceptor that takes the relay's address as its own
//! ([`VerbsTransportConfig::positive_control_addresses`]) lets it through.

use netns_lab::{connect_from, rss_kib};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use backend_verbs::{Endpoint, FakeFabric, Gid};

use kv_transfer_core::auth::{AuthError, Dialer, RefusalCode};

use super::handshake::{Offer, READY};
use super::*;
use crate::AuthRefusal;

/// The cluster key the transports under test resolve (their config's is `None`).
fn env_key() -> ClusterKey {
    ClusterKey::from_env().expect("cluster key")
}

/// A handshake as `name` (at `me`) to the side channel at `addr`, under `key`.
fn auth_cfg(key: ClusterKey, name: &str, me: &str, addr: SocketAddr) -> DialerConfig {
    DialerConfig {
        key,
        context: AUTH_CONTEXT.into(),
        me: Identity::new(name, me),
        dialed: addr.to_string(),
        expect_name: Some("decode".into()),
    }
}

/// Core's handshake on a raw connection (bounded by its read timeout).
fn auth_dial(s: &mut TcpStream, name: &str, addr: SocketAddr) -> Result<(), AuthError> {
    let me = s.local_addr().map(|a| a.to_string()).unwrap_or_default();
    kv_transfer_core::auth::dial(s, auth_cfg(env_key(), name, &me, addr), &AuthCounters::default()).map(|_| ())
}

/// One run: a decode transport with `limits`, `flood` idle or half-hello
/// connections from 127.0.0.2, then an honest handshake from 127.0.0.1.
/// Whether it was answered, in how many ms, RSS before and during, stats.
fn run(limits: SideChannelLimits, flood: usize) -> (bool, u128, u64, u64, VerbsTransportStats) {
    run_from(limits, flood, 1)
}

/// [`run`], the flood spread over `addresses` source addresses
/// (127.0.0.2 and up, in turn).
fn run_from(limits: SideChannelLimits, flood: usize, addresses: u8) -> (bool, u128, u64, u64, VerbsTransportStats) {
    let fabric = FakeFabric::new(11);
    let cfg = VerbsTransportConfig { side_channel: limits, qps: 1, ..VerbsTransportConfig::default() };
    let t = VerbsTransport::new(cfg, Arc::new(fabric.fake_nic())).expect("transport");
    let desc = t.attach(&EngineKey::new("decode")).expect("attach");
    let d = parse_descriptor(&desc).expect("descriptor");
    let addr: SocketAddr = d.addr.parse().expect("addr");
    let ep = Endpoint { qpn: 0x300, psn: 1, gid: Gid([0; 16]), mtu: 1024 };
    let offer = |key: &str| Offer { key: key.into(), endpoints: vec![ep], ticket: d.ticket }.encode().expect("offer");
    let before = rss_kib();
    let mut held = Vec::new();
    for i in 0..flood {
        let from = Ipv4Addr::new(127, 0, 0, 2 + (i % usize::from(addresses)) as u8);
        let mut s = connect_from(from, addr).expect("flood connection");
        if i % 2 == 0 {
            let (_, h) = Dialer::start(auth_cfg(env_key(), "idler", "127.0.0.2:0", addr)).expect("hello");
            let h = h.encode();
            let _ = s.write_all(&h[..h.len() / 2]);
        }
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(100));
    let during = rss_kib();
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).expect("honest connection");
    let mut hello = offer("prefill");
    hello.extend_from_slice(&[5u8; 16]);
    s.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
    let answered = auth_dial(&mut s, "prefill", addr).is_ok()
        && s.write_all(&hello).is_ok()
        && Offer::read_from(&mut s).is_ok()
        && s.write_all(&[READY]).is_ok();
    let ms = t0.elapsed().as_millis();
    if answered {
        // Bounded: the acceptor records the connection once READY is read.
        let deadline = Instant::now() + Duration::from_secs(2);
        while t.stats().connections == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let stats = t.stats();
    drop(held);
    let mut b = [0u8; 1];
    let _ = s.set_read_timeout(Some(Duration::from_millis(1)));
    let _ = s.read(&mut b);
    drop(s);
    (answered && stats.connections == 1, ms, before, during, stats)
}

/// Checks on: 20 idle or half-hello connections (10x the per-address cap
/// of 2); the honest dialer is answered within 1 s and the 18 past the cap
/// are closed at once and counted.
#[test]
fn hostile_idle_side_channel_connections_do_not_hold_an_honest_handshake() {
    let limits = SideChannelLimits { per_address: 2, ..SideChannelLimits::default() };
    let (ok, ms, before, during, stats) = run(limits, 20);
    eprintln!("capped: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(ok, "the honest dialer was not answered: {stats:?}");
    assert!(ms < 1000, "answered after {ms} ms");
    assert_eq!(stats.handshakes_per_address, 18, "{stats:?}");
}

/// Many addresses: 80 idle or half-hello connections from 40 addresses (2
/// each, at the per-address cap; 10x the total of 8). The oldest
/// handshakes give way, so the honest dialer is answered within 1 s.
/// Control (`evict_oldest` off): the flood holds the total and the honest
/// dialer is refused.
#[test]
fn hostile_many_addresses_evict_the_oldest_side_channel_handshake() {
    let limits = SideChannelLimits { handshakes: 8, per_address: 2, ..SideChannelLimits::default() };
    let (ok, ms, before, during, stats) = run_from(limits.clone(), 80, 40);
    eprintln!("evicting: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(ok, "the honest dialer was not answered: {stats:?}");
    assert!(ms < 1000, "answered after {ms} ms");
    assert!(stats.handshakes_evicted >= 72, "{stats:?}");
    assert_eq!(stats.handshakes_busy, 0, "{stats:?}");
    let (ok, ms, _, _, stats) = run_from(SideChannelLimits { evict_oldest: false, ..limits }, 80, 40);
    eprintln!("control: ok {ok}, {ms} ms; {stats:?}");
    assert!(!ok, "control: the flood from many addresses should hold the total: {stats:?}");
    assert!(stats.handshakes_busy >= 72, "{stats:?}");
}

/// Positive control: the serial acceptor (2 s per handshake, as before):
/// the same flood leaves the honest dialer unanswered past its 3 s.
#[test]
fn hostile_idle_side_channel_positive_control_serial_acceptor_holds_the_honest_handshake() {
    let (ok, ms, before, during, stats) = run(SideChannelLimits::serial(Duration::from_secs(2)), 20);
    eprintln!("serial: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(!ok, "positive control: the honest dialer should be held out, answered in {ms} ms");
    assert!(ms >= 2000, "positive control: gave up after only {ms} ms");
}

/// Completes `n` handshakes from `src` under made-up engine names (none
/// registered: each connection stays up, bound to nothing); returns the
/// streams (the lifelines) and how many were answered.
fn claims(addr: SocketAddr, ticket: Ticket, src: Ipv4Addr, n: usize) -> (Vec<TcpStream>, usize) {
    let ep = Endpoint { qpn: 0x400, psn: 1, gid: Gid([0; 16]), mtu: 1024 };
    let mut held = Vec::new();
    let mut answered = 0;
    for i in 0..n {
        let Ok(mut s) = connect_from(src, addr) else { continue };
        let mut hello = Offer { key: format!("claim-{i}"), endpoints: vec![ep], ticket }.encode().expect("offer");
        hello.extend_from_slice(&[9u8; 16]);
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if auth_dial(&mut s, &format!("claim-{i}"), addr).is_ok()
            && s.write_all(&hello).is_ok()
            && Offer::read_from(&mut s).is_ok()
            && s.write_all(&[READY]).is_ok()
        {
            answered += 1;
        }
        held.push(s);
    }
    (held, answered)
}

/// Rule 9 for connections bound to no engine: 10x a per-address cap of 2
/// completed handshakes from 127.0.0.2 under made-up names. Checks on: 2
/// kept, 18 refused and counted, and an honest dialer from 127.0.0.1 is
/// still answered within 1 s. Control (cap raised): all 20 kept, each with
/// its queue pair, receive buffers and lifeline thread.
#[test]
fn hostile_unbound_connection_flood_is_capped_per_address() {
    let mut rss = Vec::new();
    for capped in [true, false] {
        let fabric = FakeFabric::new(12);
        let limits = SideChannelLimits {
            claims_per_address: if capped { 2 } else { usize::MAX },
            ..SideChannelLimits::default()
        };
        let cfg = VerbsTransportConfig { side_channel: limits, qps: 1, ..VerbsTransportConfig::default() };
        let t = VerbsTransport::new(cfg, Arc::new(fabric.fake_nic())).expect("transport");
        let d = parse_descriptor(&t.attach(&EngineKey::new("decode")).expect("attach")).expect("descriptor");
        let addr: SocketAddr = d.addr.parse().expect("addr");
        let before = rss_kib();
        let (held, answered) = claims(addr, d.ticket, Ipv4Addr::new(127, 0, 0, 2), 20);
        // Bounded: each answered claim is recorded once READY is read.
        let deadline = Instant::now() + Duration::from_secs(2);
        while t.stats().connections < answered as u64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let during = rss_kib();
        rss.push((capped, before, during, t.stats().connections));
        if capped {
            let stats = t.stats();
            assert_eq!((answered, stats.claims_refused), (2, 18), "{stats:?}");
            let t0 = Instant::now();
            let (honest, ok) = claims(addr, d.ticket, Ipv4Addr::LOCALHOST, 1);
            let ms = t0.elapsed().as_millis();
            assert!(ok == 1 && ms < 1000, "the honest dialer: answered {ok}, {ms} ms");
            drop(honest);
        } else {
            assert_eq!(answered, 20, "control: every connection kept");
        }
        drop(held);
    }
    eprintln!("unbound flood (capped, RSS before KiB, during KiB, connections): {rss:?}");
}

fn key(secret: &[u8]) -> ClusterKey {
    ClusterKey::from_secret(secret).expect("key")
}

/// A transport on `fabric`'s NIC under `key`, attached as `name`, with its
/// descriptor.
fn transport(
    fabric: &FakeFabric,
    name: &str,
    key: ClusterKey,
    relays: Vec<String>,
) -> (Arc<VerbsTransport>, Descriptor) {
    let cfg = VerbsTransportConfig {
        qps: 1,
        cluster_key: Some(key),
        positive_control_addresses: relays,
        ..VerbsTransportConfig::default()
    };
    let t = VerbsTransport::new(cfg, Arc::new(fabric.fake_nic())).expect("transport");
    let d = parse_descriptor(&t.attach(&EngineKey::new(name)).expect("attach")).expect("descriptor");
    (t, d)
}

/// `d` as an engine descriptor (its address replaced by `via`, a relay's, if given).
fn engine_desc(d: &Descriptor, via: Option<&str>) -> EngineDesc {
    let d = Descriptor { addr: via.map_or_else(|| d.addr.clone(), str::to_owned), ..d.clone() };
    EngineDesc {
        key: EngineKey::new(&d.name),
        hostname: String::new(),
        host: String::new(),
        port: 0,
        transport: RDMA.into(),
        transport_info: d.encode().into_bytes(),
        notif_seq_start: 0,
    }
}

/// Waits (bounded) until `t` counts `n` connections.
fn connections(t: &VerbsTransport, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(2);
    while t.stats().connections < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    t.stats().connections
}

/// A dialer under another cluster key: refused before any offer, typed
/// (`WrongKey` at the dialer, which checks the acceptor's proof first),
/// counted on both sides (`auth_wrong_key`, `auth_refused_by_peer`), no
/// connection. Positive control: the same key connects.
#[test]
fn hostile_side_channel_under_another_cluster_key_is_refused() {
    let fabric = FakeFabric::new(13);
    let ours = key(b"the deployment's own secret, 32 bytes+");
    let (decode, dd) = transport(&fabric, "decode", ours.clone(), Vec::new());
    let (stranger, _) = transport(&fabric, "prefill", key(b"another deployment's secret, 32 bytes"), Vec::new());
    let r = stranger.connect(&engine_desc(&dd, None));
    assert!(matches!(r, Err(TransportError::Auth { refusal: AuthRefusal::WrongKey, .. })), "another key: {r:?}");
    assert_eq!((stranger.auth_stats().wrong_key, stranger.stats().connections), (1, 0), "{:?}", stranger.stats());
    // Bounded: the acceptor counts the refusal once the dialer's REFUSED is read.
    let deadline = Instant::now() + Duration::from_secs(2);
    while decode.stats().refused_hellos == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = decode.stats();
    assert_eq!((s.auth.refused_by_peer, s.auth.established, s.refused_hellos, s.connections), (1, 0, 1, 0), "{s:?}");
    assert!(stranger.queue_pairs(&EngineKey::new("decode")).is_empty());

    // Positive control: the same key.
    let (honest, _) = transport(&fabric, "prefill-2", ours, Vec::new());
    honest.connect(&engine_desc(&dd, None)).expect("the same key connects");
    assert_eq!(honest.auth_stats().established, 1);
    assert_eq!(connections(&decode, 1), 1, "{:?}", decode.stats());
    assert_eq!(decode.auth_stats().established, 1, "{:?}", decode.stats());
    assert_eq!(honest.queue_pairs(&EngineKey::new("decode")).len(), 1);
}

/// A TCP relay at `listener`'s address forwarding every connection to `to`
/// (both ways, until either side closes).
fn relay(listener: std::net::TcpListener, to: SocketAddr) {
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(a) = s else { return };
            let Ok(b) = TcpStream::connect(to) else { continue };
            for (mut r, mut w) in [(a.try_clone(), b.try_clone()), (b.try_clone(), a.try_clone())]
                .into_iter()
                .filter_map(|(r, w)| Some((r.ok()?, w.ok()?)))
            {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut r, &mut w);
                    let _ = w.shutdown(std::net::Shutdown::Both);
                    let _ = r.shutdown(std::net::Shutdown::Both);
                });
            }
        }
    });
}

/// An honest dialer (the same key) made to dial a relay (a TCP proxy at
/// another address forwarding to the acceptor): its handshake names the
/// relay's address, so the acceptor refuses it (`auth_address_mismatch`;
/// typed at the dialer: the peer refused, `AddressMismatch`). Positive
/// control: an acceptor that takes the relay's address as its own lets the
/// same relayed connection through.
#[test]
fn hostile_side_channel_relayed_handshake_is_refused() {
    for bound in [true, false] {
        let fabric = FakeFabric::new(14);
        let k = key(b"the deployment's own secret, 32 bytes+");
        let proxy = std::net::TcpListener::bind("127.0.0.1:0").expect("relay");
        let via = proxy.local_addr().expect("relay address").to_string();
        let relays = if bound { Vec::new() } else { vec![via.clone()] };
        let (decode, dd) = transport(&fabric, "decode", k.clone(), relays);
        relay(proxy, dd.addr.parse().expect("addr"));
        let (prefill, _) = transport(&fabric, "prefill", k, Vec::new());
        let r = prefill.connect(&engine_desc(&dd, Some(&via)));
        if bound {
            // The acceptor counts its refusal after sending it: the dialer
            // can see the refusal first.
            let deadline = Instant::now() + Duration::from_secs(2);
            while decode.stats().auth.address_mismatch == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let s = decode.stats();
        if bound {
            assert!(
                matches!(
                    r,
                    Err(TransportError::Auth { refusal: AuthRefusal::RefusedByPeer(RefusalCode::AddressMismatch), .. })
                ),
                "relayed: {r:?}"
            );
            assert_eq!((s.auth.address_mismatch, s.auth.established, s.connections), (1, 0, 0), "{s:?}");
            assert_eq!(prefill.auth_stats().refused_by_peer, 1);
        } else {
            r.expect("positive control: the relay's address taken as the acceptor's own");
            assert_eq!(connections(&decode, 1), 1, "{:?}", decode.stats());
            assert_eq!(decode.auth_stats().address_mismatch, 0);
        }
    }
}
