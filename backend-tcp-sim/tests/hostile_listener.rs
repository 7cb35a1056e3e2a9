//! Hostile peers on tcp-sim's listener (issue 29): 10x the per-address cap
//! of connections that send nothing or half a HELLO, held open from
//! 127.0.0.2; an honest NIC (127.0.0.1) still connects within a stated
//! bound, and the flood's connections past the cap are closed at once and
//! counted. Positive control: the serial listener (one handshake at a
//! time, no caps: the behaviour before) keeps the honest NIC waiting for
//! the flood's deadlines. Network only on loopback.

use netns_lab::{connect_from, rss_kib};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use backend_tcp_sim::wire::{self, Body};
use backend_tcp_sim::{ListenerLimits, NicConfig, NicStats, SimNic};

/// One run: a decode NIC with `limits` (2 s handshakes), `flood` idle or
/// half-HELLO connections from 127.0.0.2, then an honest NIC connects.
/// Whether it did, in how many ms, RSS before and during, the stats.
fn run(limits: ListenerLimits, flood: usize) -> (bool, u128, u64, u64, NicStats) {
    run_from(limits, flood, 1)
}

/// [`run`], the flood spread over `addresses` source addresses
/// (127.0.0.2 and up, in turn).
fn run_from(limits: ListenerLimits, flood: usize, addresses: u8) -> (bool, u128, u64, u64, NicStats) {
    let mut cfg = NicConfig::new("decode");
    cfg.listener = limits;
    cfg.handshake_timeout = Duration::from_secs(2);
    let decode = SimNic::start(cfg).expect("decode");
    let addr: SocketAddr = decode.endpoint().parse().expect("addr");
    // Half of the first handshake message (the peer handshake's HELLO).
    let hello = kv_transfer_core::auth::Dialer::start(kv_transfer_core::auth::DialerConfig {
        key: kv_transfer_core::auth::ClusterKey::from_env().expect("the deployment's cluster key"),
        context: wire::AUTH_CONTEXT.into(),
        me: kv_transfer_core::auth::Identity::new("idler", "127.0.0.2:9"),
        dialed: decode.endpoint().into(),
        expect_name: None,
    })
    .expect("hello")
    .1
    .encode();
    let before = rss_kib();
    let mut held = Vec::new();
    for i in 0..flood {
        let from = Ipv4Addr::new(127, 0, 0, 2 + (i % usize::from(addresses)) as u8);
        let mut s = connect_from(from, addr).expect("flood connection");
        if i % 2 == 0 {
            let _ = s.write_all(&hello[..hello.len() / 2]);
        }
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(100));
    let during = rss_kib();
    let mut pcfg = NicConfig::new("prefill");
    pcfg.handshake_timeout = Duration::from_secs(3);
    let prefill = SimNic::start(pcfg).expect("prefill");
    let t0 = Instant::now();
    let ok = prefill.connect(decode.endpoint()).is_ok()
        && decode.wait_for_peer("prefill", Duration::from_millis(500)).is_some();
    let ms = t0.elapsed().as_millis();
    let stats = decode.stats();
    // Closed first: a serial listener then reads EOF at once.
    drop(held);
    (ok, ms, before, during, stats)
}

/// Checks on: 20 idle or half-HELLO connections (10x the per-address cap
/// of 2); the honest NIC connects within 1 s; 18 refused and counted.
#[test]
fn hostile_idle_connections_do_not_shut_an_honest_nic_out_of_the_listener() {
    let limits = ListenerLimits { per_address: 2, ..ListenerLimits::default() };
    let (ok, ms, before, during, stats) = run(limits, 20);
    eprintln!("capped: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(ok, "the honest NIC could not connect: {stats:?}");
    assert!(ms < 1000, "connected after {ms} ms");
    assert_eq!(stats.handshakes_refused_per_address, 18, "{stats:?}");
}

/// Many addresses: 80 idle or half-HELLO connections from 40 addresses
/// (2 each, at the per-address cap; 10x the total of 8). The oldest
/// handshakes give way to newer connections, so the honest NIC connects
/// within 1 s and at most the total is held. Control (`evict_oldest` off,
/// refusal at the total): the flood holds all 8 places and the honest NIC
/// is refused.
#[test]
fn hostile_many_addresses_evict_the_oldest_handshake_and_never_fill_the_listener() {
    let limits = ListenerLimits { handshakes: 8, per_address: 2, ..ListenerLimits::default() };
    let (ok, ms, before, during, stats) = run_from(limits.clone(), 80, 40);
    eprintln!("evicting: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(ok, "the honest NIC could not connect: {stats:?}");
    assert!(ms < 1000, "connected after {ms} ms");
    assert!(stats.handshakes_evicted >= 72, "80 into 8 places, then the honest one: {stats:?}");
    assert_eq!(stats.handshakes_refused_busy, 0, "{stats:?}");
    let control = ListenerLimits { evict_oldest: false, ..limits };
    let (ok, ms, _, _, stats) = run_from(control, 80, 40);
    eprintln!("control: ok {ok}, {ms} ms; {stats:?}");
    assert!(!ok, "control: the flood from many addresses should hold the total: {stats:?}");
    assert!(stats.handshakes_refused_busy >= 72, "{stats:?}");
    assert_eq!(stats.handshakes_evicted, 0, "{stats:?}");
}

/// 20 completed handshakes from 127.0.0.2 (real HELLOs), one at a time;
/// the stats, whether the honest NIC then connected and in how many ms,
/// and RSS before and during.
fn connection_flood(limits: ListenerLimits) -> (NicStats, bool, u128, u64, u64) {
    let cap = limits.connections_per_address;
    let mut cfg = NicConfig::new("decode");
    cfg.listener = limits;
    let decode = SimNic::start(cfg).expect("decode");
    let addr: SocketAddr = decode.endpoint().parse().expect("addr");
    let before = rss_kib();
    let mut held = Vec::new();
    for i in 0..20 {
        let hello = wire::encode_head(&Body::Hello { name: format!("flood-{i}"), endpoint: "127.0.0.2:9".into() }, 0)
            .expect("hello");
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 2), addr).expect("flood connection");
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let name = format!("flood-{i}");
        let proven = wire::authenticate_dialed(
            &mut s,
            &kv_transfer_core::auth::ClusterKey::from_env().expect("the deployment's cluster key"),
            &name,
            "127.0.0.2:9",
            &addr.to_string(),
        );
        if proven.is_ok() {
            let _ = s.write_all(&hello);
        }
        held.push(s);
        // One at a time, so each sees the ones before established
        // (bounded: 1 s each).
        let deadline = Instant::now() + Duration::from_secs(1);
        let want = (i + 1).min(cap) as u64;
        while decode.stats().connections_accepted < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let during = rss_kib();
    let prefill = SimNic::start(NicConfig::new("prefill")).expect("prefill");
    let t0 = Instant::now();
    let ok = prefill.connect(decode.endpoint()).is_ok();
    let ms = t0.elapsed().as_millis();
    let stats = decode.stats();
    drop(held);
    (stats, ok, ms, before, during)
}

/// Checks on, the established-connection cap: 10x a cap of 2 completed
/// handshakes from 127.0.0.2; 2 are kept, 18 refused and counted; the
/// honest NIC connects within 1 s. Control (the default cap, 1,024): all
/// 20 kept, a sender and a receiver thread each.
#[test]
fn hostile_connection_flood_is_capped_per_address() {
    let limits = ListenerLimits { connections_per_address: 2, ..ListenerLimits::default() };
    let (stats, ok, ms, before, during) = connection_flood(limits);
    eprintln!("connections capped: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(ok && ms < 1000, "the honest NIC: ok {ok}, {ms} ms");
    assert_eq!(stats.connections_refused_per_address, 18, "{stats:?}");
    assert_eq!(stats.connections_accepted, 3, "{stats:?}");
    let (stats, ok, ms, before, during) = connection_flood(ListenerLimits::default());
    eprintln!("connections control: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert_eq!(stats.connections_accepted, 21, "control: every connection kept: {stats:?}");
}

/// Positive control: the serial listener (no caps, one handshake at a
/// time, 2 s each): the same idle flood keeps the honest NIC out past its
/// 3 s handshake timeout.
#[test]
fn hostile_idle_connections_positive_control_serial_listener_shuts_the_nic_out() {
    let (ok, ms, before, during, stats) = run(ListenerLimits::serial(), 20);
    eprintln!("serial: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {stats:?}");
    assert!(!ok, "positive control: the honest NIC should be shut out, connected in {ms} ms");
    assert!(ms >= 2000, "positive control: gave up after only {ms} ms");
}
