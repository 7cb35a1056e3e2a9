//! Hostile peers on the side channel, on the software NIC (issue 29,
//! attacks 7 and 11), each with its positive control:
//!
//! - **name squatting**: a holder of the decode's descriptor dials first
//!   under the honest prefill's name. Checks on, the decode's `add_peer` of
//!   the prefill's descriptor returns the prefill's own connection (its
//!   owner confirms it, asked at the descriptor's address): the squatter,
//!   though handed the exposure's descriptor and keys, reads 0 bytes and
//!   lands 0; the prefill writes and settles. Positive control
//!   (`PeerIdentity::DeclaredName`): the squatter reads the previous
//!   tenant's bytes and writes into the exposure, the prefill is refused.
//! - **claim floods**: unconfirmed claims under a name are capped per
//!   address; the control (caps raised) keeps every one, with a queue pair
//!   and control rings each.
//! - **idle handshakes**: 10x the per-address cap of connections that
//!   never finish a hello; an honest `add_peer` from another address still
//!   succeeds within a bound. Positive control (serial handshakes, the old
//!   acceptor): it fails.
//!
//! Network only on loopback; the flooding address is 127.0.0.2 (all of
//! 127/8 is loopback on Linux).

use netns_lab::{connect_from, rss_kib};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_verbs::adapter::{Hello, PeerIdentity, SideChannelLimits};
use backend_verbs::{Endpoint, FakeFabric, Gid, VerbsConfig, VerbsTransfer};
use kv_transfer_core::TransferOptions;
use kv_transfer_core::{block_on, poll_until, EscalationLadder, HostRegion, PoolConfig, SlotPool, Transfer};

const WAIT: Duration = Duration::from_secs(5);
const SLOT: usize = 4096;
const PREVIOUS: u8 = 0x77;
const SQUAT: u8 = 0xee;
const HONEST: u8 = 0xbb;

struct Side {
    t: VerbsTransfer,
    pool: SlotPool,
}

fn quiet() -> EscalationLadder {
    EscalationLadder { drain: WAIT * 6, revoke: WAIT * 6, fence: WAIT * 6 }
}

fn side(fabric: &FakeFabric, name: &str, tune: impl FnOnce(&mut VerbsConfig)) -> Side {
    let mut cfg = VerbsConfig::new(name, "fake", 1);
    cfg.timeout = Duration::from_secs(3);
    tune(&mut cfg);
    let t = VerbsTransfer::with_engine(cfg, Arc::new(fabric.fake_nic())).expect("adapter");
    let region = Arc::new(HostRegion::new(4 * SLOT).expect("region"));
    let pool = t.register_pool(region, PoolConfig::new(SLOT).with_ladder(quiet())).expect("pool");
    Side { t, pool }
}

fn addr_of(t: &VerbsTransfer) -> SocketAddr {
    let d = t.descriptor();
    let (_, rest) = d.rsplit_once('@').expect("name@");
    rest.split_once('#').expect("#ticket").0.parse().expect("host:port")
}

fn ticket_of(t: &VerbsTransfer) -> [u8; 16] {
    backend_verbs::adapter::parse_descriptor(t.descriptor().as_bytes()).expect("descriptor").ticket
}

/// What one name-squatting run showed.
#[derive(Debug)]
struct Squat {
    /// Previous tenant's bytes the squatter READ out of the exposure.
    read_previous: usize,
    /// Squatter's bytes found in the exposed slot after its WRITE.
    landed: usize,
    /// The honest prefill's WRITE succeeded and its DONE settled the slot.
    honest_served: bool,
    /// Foreign bytes in the settled slot (not the honest prefill's).
    foreign: usize,
    /// From the decode's `add_peer` of the prefill to the settled slot.
    honest_ms: u128,
}

/// The squatter dials first under the prefill's name; the decode adds the
/// prefill's descriptor and exposes a slot (holding the previous tenant's
/// bytes) to what `add_peer` returned; the squatter, handed the
/// exposure's descriptor, READs and WRITEs it; then the prefill WRITEs.
fn squat(identity: PeerIdentity) -> Squat {
    let fabric = FakeFabric::new(29);
    let decode = side(&fabric, "decode", |c| c.identity = identity);
    let prefill = side(&fabric, "prefill-b", |_| {});
    let squatter = side(&fabric, "prefill-b", |_| {});
    let mut previous = decode.pool.reserve(1).expect("reserve");
    previous.write_at(0, 0, &[PREVIOUS; SLOT]).expect("previous tenant");
    let slot = previous.tenancies()[0].slot.0 as usize;
    previous.release();

    squatter.t.add_peer(decode.t.descriptor()).expect("the squatter dials the decode under the prefill's name");
    prefill.t.add_peer(decode.t.descriptor()).expect("the prefill dials the decode");
    let t0 = Instant::now();
    let peer = decode.t.add_peer(prefill.t.descriptor()).expect("the decode adds the prefill");
    let (exposed, remote) = decode.t.expose(decode.pool.reserve(1).expect("reserve"), peer).expect("expose");
    assert_eq!(remote.slots[0].slot.0 as usize, slot, "LIFO: the previous tenant's slot");

    // The squatter READs the exposure (it was handed everything: address,
    // key, token).
    let dst = squatter.pool.reserve(1).expect("reserve");
    let read_previous = match block_on(squatter.t.read(dst, &remote, TransferOptions::notify(false))) {
        Ok(mut h) => {
            let out = poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").expect("an outcome");
            let mut buf = vec![0u8; SLOT];
            let at = out.lease.tenancies()[0].slot.0 as usize * SLOT;
            squatter.pool.region().read(at, &mut buf).expect("read");
            out.lease.release();
            buf.iter().filter(|b| **b == PREVIOUS).count()
        }
        Err(e) => {
            e.lease.release();
            0
        }
    };
    let mut src = squatter.pool.reserve(1).expect("reserve");
    src.write_at(0, 0, &[SQUAT; SLOT]).expect("fill");
    if let Ok(mut h) = block_on(squatter.t.write(src, &remote, TransferOptions::notify(false))) {
        if let Some(Ok(out)) = poll_until(std::pin::Pin::new(&mut h), WAIT) {
            out.lease.release();
        }
    } else {
        // A post refused hands the lease back (dropped here: reserved, free).
    }
    let mut buf = vec![0u8; SLOT];
    decode.pool.region().read(slot * SLOT, &mut buf).expect("read");
    let landed = buf.iter().filter(|b| **b == SQUAT).count();

    // The honest prefill WRITEs and notifies.
    let mut src = prefill.pool.reserve(1).expect("reserve");
    src.write_at(0, 0, &[HONEST; SLOT]).expect("fill");
    let wrote = match block_on(prefill.t.write(src, &remote, TransferOptions::notify(true))) {
        Ok(mut h) => match poll_until(std::pin::Pin::new(&mut h), WAIT) {
            Some(Ok(out)) => {
                let ok = out.result.is_ok();
                out.lease.release();
                ok
            }
            _ => false,
        },
        Err(_) => false,
    };
    let deadline = Instant::now() + WAIT;
    let mut exposed = exposed;
    let settled = loop {
        exposed = match exposed.try_settled() {
            Ok(s) => break Some(s),
            Err(l) => l,
        };
        if !wrote || Instant::now() >= deadline {
            exposed.abort();
            break None;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let honest_ms = t0.elapsed().as_millis();
    let (honest_served, foreign) = match settled {
        Some(s) => {
            let bytes = s.bytes().expect("the settled slot");
            s.release();
            (true, bytes.iter().filter(|b| **b != HONEST).count())
        }
        None => (false, SLOT),
    };
    let r = Squat { read_previous, landed, honest_served, foreign, honest_ms };
    eprintln!("{identity:?}: {r:?}; decode {:?}", decode.t.counters());
    r
}

/// Attack 7, checks on: knowing the decode's descriptor is not enough to
/// be taken for the prefill. The squatter reads 0 bytes, lands 0; the
/// prefill is served within 2 s of the decode's `add_peer`, 0 foreign bytes.
#[test]
fn hostile_name_squatter_dialing_first_gets_nothing_of_the_peer_it_names() {
    let r = squat(PeerIdentity::Confirmed);
    assert_eq!(r.read_previous, 0, "the squatter read the previous tenant's bytes: {r:?}");
    assert_eq!(r.landed, 0, "the squatter's bytes landed: {r:?}");
    assert!(r.honest_served, "the prefill was refused: {r:?}");
    assert_eq!(r.foreign, 0, "{r:?}");
    assert!(r.honest_ms < 2000, "the prefill was served after {} ms", r.honest_ms);
}

/// Attack 7's positive control: with the declared name taken as identity
/// (the old behaviour), `add_peer` returns the squatter's connection; it
/// reads all of the previous tenant's bytes and writes the whole slot, and
/// the prefill is refused.
#[test]
fn hostile_name_squatting_positive_control_declared_name_reads_and_writes() {
    let r = squat(PeerIdentity::DeclaredName);
    assert_eq!(r.read_previous, SLOT, "positive control: the squatter should read the previous tenant: {r:?}");
    assert_eq!(r.landed, SLOT, "positive control: the squatter's WRITE should land: {r:?}");
    assert!(!r.honest_served, "positive control: the prefill should be refused: {r:?}");
}

/// Raw claims to `name` from `src`: a hello with the decode's ticket and
/// a nonce, each answered (a claim recorded) or closed (refused). Returns
/// how many were answered.
fn claim_flood(decode: &VerbsTransfer, src: Ipv4Addr, name: &str, n: usize) -> usize {
    let (addr, ticket) = (addr_of(decode), ticket_of(decode));
    let mut answered = 0;
    let mut held = Vec::new();
    for i in 0..n {
        let Ok(mut s) = connect_from(src, addr) else { continue };
        let endpoint = Endpoint { qpn: 0x100 + i as u32, psn: 1, gid: Gid([0; 16]), mtu: 1024 };
        let mut b = Hello { name: name.into(), endpoint, ticket }.encode().expect("hello");
        b.extend_from_slice(&[i as u8; 16]);
        if s.write_all(&b).is_err() {
            continue;
        }
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if Hello::read_from(&mut s).is_ok() {
            answered += 1;
        }
        held.push(s);
    }
    answered
}

/// Rule 9 for claims: 10x the per-address cap of unconfirmed claims under
/// the prefill's name, from one address. Checks on: the cap's worth is
/// kept, the rest refused and counted, and the prefill (another address)
/// is still confirmed and served within 2 s. Control (caps raised): every
/// claim is kept, a queue pair and its control rings each.
#[test]
fn hostile_claim_flood_is_capped_per_address_and_the_named_peer_still_connects() {
    const CAP: usize = 2;
    let mut rss = Vec::new();
    for capped in [true, false] {
        let fabric = FakeFabric::new(30);
        let decode = side(&fabric, "decode", |c| {
            // No probes: the flood's claims name no real queue pair, and a
            // failed probe would fence them (freeing room) mid-flood.
            c.heartbeat = Duration::ZERO;
            if capped {
                c.side_channel.claims_per_address = CAP;
            } else {
                c.side_channel.claims_per_address = usize::MAX;
                c.side_channel.claims = usize::MAX;
            }
        });
        let before = rss_kib();
        let answered = claim_flood(&decode.t, Ipv4Addr::new(127, 0, 0, 2), "prefill-b", 10 * CAP);
        let after = rss_kib();
        rss.push((capped, before, after));
        if !capped {
            assert_eq!(answered, 10 * CAP, "control: every claim is kept");
            continue;
        }
        assert_eq!(answered, CAP, "capped: only the cap's worth of claims kept");
        assert_eq!(decode.t.counter("claims_refused"), (9 * CAP) as u64);
        let prefill = side(&fabric, "prefill-b", |_| {});
        let t0 = Instant::now();
        prefill.t.add_peer(decode.t.descriptor()).expect("the prefill dials");
        let peer = decode.t.add_peer(prefill.t.descriptor()).expect("the decode adds the prefill");
        let (exposed, remote) = decode.t.expose(decode.pool.reserve(1).expect("reserve"), peer).expect("expose");
        let mut src = prefill.pool.reserve(1).expect("reserve");
        src.write_at(0, 0, &[HONEST; SLOT]).expect("fill");
        let mut h = block_on(prefill.t.write(src, &remote, TransferOptions::notify(true))).expect("post");
        let out = poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").expect("outcome");
        assert!(out.result.is_ok(), "{:?}", out.result);
        out.lease.release();
        let s = poll_until(std::pin::Pin::new(&mut Box::pin(exposed.settled())), WAIT).expect("settled");
        assert!(s.bytes().expect("bytes").iter().all(|b| *b == HONEST));
        s.release();
        let ms = t0.elapsed().as_millis();
        assert!(ms < 2000, "the prefill was served after {ms} ms");
    }
    eprintln!("claim flood RSS (capped, before KiB, after KiB): {rss:?}");
}

/// Holds `n` connections from `src` to `to` open: odd ones idle, even
/// ones after half a hello (with the right ticket).
fn idle_flood(to: &VerbsTransfer, src: Ipv4Addr, n: usize) -> Vec<TcpStream> {
    let (addr, ticket) = (addr_of(to), ticket_of(to));
    let endpoint = Endpoint { qpn: 0x200, psn: 1, gid: Gid([0; 16]), mtu: 1024 };
    let hello = Hello { name: "idler".into(), endpoint, ticket }.encode().expect("hello");
    let mut held = Vec::new();
    for i in 0..n {
        let Ok(mut s) = connect_from(src, addr) else { continue };
        if i % 2 == 0 {
            let _ = s.write_all(&hello[..hello.len() / 2]);
        }
        held.push(s);
    }
    held
}

/// One run of attack 11: 10x the per-address cap of idle and half-hello
/// connections held open from 127.0.0.2, then the prefill (127.0.0.1)
/// connects both ways. Returns whether it did, how long it took, and the
/// RSS (KiB) before and while the flood was held.
fn idle_handshakes(limits: SideChannelLimits, flood: usize) -> (bool, u128, u64, u64, Vec<(&'static str, u64)>) {
    let fabric = FakeFabric::new(31);
    let decode = side(&fabric, "decode", |c| c.side_channel = limits);
    let prefill = side(&fabric, "prefill-b", |_| {});
    let before = rss_kib();
    let held = idle_flood(&decode.t, Ipv4Addr::new(127, 0, 0, 2), flood);
    assert_eq!(held.len(), flood, "the flood's connections");
    // Let the acceptor take them all in.
    std::thread::sleep(Duration::from_millis(100));
    let during = rss_kib();
    let t0 = Instant::now();
    let ok = prefill.t.add_peer(decode.t.descriptor()).is_ok() && decode.t.add_peer(prefill.t.descriptor()).is_ok();
    let ms = t0.elapsed().as_millis();
    // Closed before the adapters drop: a serial acceptor then reads EOF
    // on each at once instead of waiting out their deadlines.
    drop(held);
    (ok, ms, before, during, decode.t.counters())
}

/// Attack 11, checks on: 20 idle or half-hello connections (10x the
/// per-address cap of 2) held open; the prefill, from another address,
/// connects both ways within 1 s, and the flood's connections past the cap
/// are closed at once and counted.
#[test]
fn hostile_idle_handshakes_do_not_delay_an_honest_add_peer() {
    const CAP: usize = 2;
    let limits = SideChannelLimits { per_address: CAP, ..SideChannelLimits::default() };
    let (ok, ms, before, during, counters) = idle_handshakes(limits, 10 * CAP);
    eprintln!("capped: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {counters:?}");
    assert!(ok, "the prefill could not connect: {counters:?}");
    assert!(ms < 1000, "the prefill connected after {ms} ms");
    let refused = counters.iter().find(|(n, _)| *n == "side_channel_per_address").map_or(0, |c| c.1);
    assert_eq!(refused, (9 * CAP) as u64, "{counters:?}");
}

/// Attack 11's positive control: the old acceptor (one handshake at a
/// time, 2 s each, no caps): the same flood shuts the prefill out (its 3 s
/// handshake timeout passes first).
#[test]
fn hostile_idle_handshakes_positive_control_serial_acceptor_shuts_the_peer_out() {
    let (ok, ms, before, during, counters) = idle_handshakes(SideChannelLimits::serial(Duration::from_secs(2)), 20);
    eprintln!("serial: ok {ok}, {ms} ms, RSS {before} -> {during} KiB; {counters:?}");
    assert!(!ok, "positive control: the prefill should be shut out, connected in {ms} ms");
    assert!(ms >= 2000, "positive control: refused after only {ms} ms");
}

/// Claims whose queue pairs answer nothing are fenced by the heartbeat,
/// and a fenced record nobody names is dropped with its control rings, so
/// a peer that keeps opening and losing claims keeps at most the cap's
/// worth (Rule 9; the cap alone would count only live claims, and each
/// fenced record kept its rings for good).
#[test]
fn fenced_claims_are_dropped_with_their_rings() {
    let fabric = FakeFabric::new(32);
    let decode = side(&fabric, "decode", |c| {
        c.heartbeat = Duration::from_millis(2);
        c.side_channel.claims_per_address = 2;
    });
    let mut kept = 0;
    for _ in 0..10 {
        kept += claim_flood(&decode.t, Ipv4Addr::new(127, 0, 0, 2), "prefill-b", 2);
        // Bounded: until both are fenced and dropped.
        let deadline = Instant::now() + WAIT;
        while decode.t.counter("peers") > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let c = decode.t.counters();
    eprintln!("churn: {kept} claims kept over 10 rounds; {c:?}");
    assert_eq!(decode.t.counter("peers"), 0, "{c:?}");
    assert_eq!(decode.t.counter("records_dropped"), kept as u64, "{c:?}");
    assert!(kept > 2, "the claims came back once fenced: {kept}");
}
