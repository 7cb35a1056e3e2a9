//! Hostile peers against the initiator side's abort state (rule 9), with
//! only Mooncake's public wire format: a notification names its sender, so a
//! third party can send ABORTs under the decode's segment name.
//!
//! Attack 1 of the second round: the decode aborts an exposure before the
//! prefill posted, the prefill acks and tombstones it, the slot goes to the
//! next tenant; a flood of ABORTs for made-up tenancies (10x the cap) then
//! used to push the real tombstone out of one shared FIFO, and the prefill's
//! late WRITE of the old descriptor landed in the next tenant's slot. Since
//! ABORTs count only sealed (issue 46), the flood there comes from a key
//! holder that proves the decode's name: what is left to prove is that a
//! peer's own flood never evicts its tombstones.
//!
//! Attack 2 of the third round: plain ABORTs under the decode's name filled
//! its share of early aborts, and the decode's own early ABORT then went
//! unanswered for good. Now a plain ABORT buys nothing, and a sealed one
//! under another key, relayed or replayed is refused, typed and counted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mooncake::adapter::block_on;
use backend_mooncake::proto::NotifyDesc;
use backend_mooncake::sealed::NotifyAuth;
use backend_mooncake::{AdapterConfig, EngineConfig, EngineError, MooncakeEngine, MooncakeTransfer, ReleasePolicy};
use kv_transfer_core::auth::{AuthError, ClusterKey, RefusalCode};
use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken};
use kv_transfer_core::{
    Generation, HostRegion, PoolConfig, Region, SlotId, SlotPool, Tenancy, Transfer, TransferOptions,
};

const SLOT: usize = 4096;
const CAP: usize = 64;

struct Side {
    e: Arc<MooncakeEngine>,
    a: MooncakeTransfer,
    pool: SlotPool,
    region: Arc<HostRegion>,
}

/// The cluster's key, given to both honest engines.
fn cluster_key() -> ClusterKey {
    ClusterKey::from_secret(b"hostile-aborts test cluster key, 32+ bytes long").unwrap()
}

fn side(cfg: AdapterConfig) -> Side {
    let e = MooncakeEngine::new(EngineConfig { cluster_key: Some(cluster_key()), ..EngineConfig::default() }).unwrap();
    let e = Arc::new(e);
    let a = MooncakeTransfer::new(e.clone(), cfg).unwrap();
    let region = Arc::new(HostRegion::new(SLOT).unwrap());
    let pool = a.register_pool(region.clone(), PoolConfig::new(SLOT)).unwrap();
    Side { e, a, pool, region }
}

use kv_transfer_testkit::wait::wait_for as wait_until;

fn made_up(i: u64) -> ExposureToken {
    let mut b = [0x3c; 16];
    b[..8].copy_from_slice(&i.to_le_bytes());
    ExposureToken::from_bytes(b)
}

struct Outcome {
    /// Bytes of the aborted request found in the next tenant's slot.
    foreign: usize,
    /// The late post was admitted.
    admitted: bool,
    /// The honest WRITE into the next tenancy settled, and how long it took.
    honest: Duration,
    prefill: Side,
}

fn attack(policy: ReleasePolicy) -> Outcome {
    let prefill = side(AdapterConfig { max_aborted: CAP, release_policy: policy, ..AdapterConfig::default() });
    let decode = side(AdapterConfig::default());
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    // The aborted request: exposed, aborted before the prefill posted.
    let (exposed, old) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    exposed.abort();
    wait_until("the prefill's ABORT_ACK frees the slot", Duration::from_secs(10), || decode.pool.metrics().free == 1);
    // The next tenant's exposure of the same slot, live.
    let (next, new) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    decode.region.write(0, &[0u8; SLOT]).unwrap();
    // The flood, under the decode's name, sealed by a key holder at the
    // decode's address (what proves the decode's name: the worst case).
    let to: SocketAddr = prefill.a.segment_name().parse().unwrap();
    let before = prefill.a.metrics().aborts_received;
    let impostor = NotifyAuth::new(cluster_key(), decode.a.segment_name());
    for i in 0..(10 * CAP) as u64 {
        let t = Tenancy::new(SlotId(1000 + i as u32), Generation(1));
        let abort = ControlMessage::new(ControlKind::Abort, old.pool, made_up(i), vec![t]);
        let msg = abort.encode_text().unwrap();
        let _ = impostor.send(to, prefill.a.segment_name(), &msg, Duration::from_secs(2));
    }
    wait_until("the flood is handled", Duration::from_secs(20), || {
        prefill.a.metrics().aborts_received >= before + (10 * CAP) as u64
    });
    // The prefill's late WRITE of the aborted request's descriptor.
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &[0xAB; SLOT]).unwrap();
    let admitted = match block_on(prefill.a.write(src, &old, TransferOptions::notify(false))) {
        Ok(h) => {
            let out = block_on(h).expect("not abandoned");
            eprintln!("late write: {:?}", out.result);
            out.lease.release();
            true
        }
        Err(e) => {
            e.lease.release();
            false
        }
    };
    let mut slot = vec![0u8; SLOT];
    decode.region.read(0, &mut slot).unwrap();
    let foreign = slot.iter().filter(|b| **b == 0xAB).count();
    // The honest WRITE of the next tenant settles it.
    let t0 = Instant::now();
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &[0x11; SLOT]).unwrap();
    let h = block_on(prefill.a.write(src, &new, TransferOptions::default())).expect("honest post");
    block_on(h).expect("not abandoned").lease.release();
    let settled = block_on(next.settled());
    let honest = t0.elapsed();
    if foreign == 0 {
        assert_eq!(settled.bytes().unwrap(), vec![0x11; SLOT]);
    }
    settled.release();
    Outcome { foreign, admitted, honest, prefill }
}

#[test]
fn hostile_abort_flood_under_the_decodes_name_never_evicts_a_real_tombstone() {
    let o = attack(ReleasePolicy::Safe);
    assert!(!o.admitted, "the late post of an aborted tenancy was admitted after the flood");
    assert_eq!(o.foreign, 0, "foreign bytes in the next tenant's slot");
    assert!(o.honest < Duration::from_secs(5), "the honest write took {:?}", o.honest);
    let m = o.prefill.a.metrics();
    assert!(m.aborts_received >= (10 * CAP) as u64, "{m:?}");
}

#[test]
fn hostile_abort_flood_positive_control_the_shared_fifo_lets_the_late_write_land() {
    let o = attack(ReleasePolicy::Naive);
    assert!(o.admitted, "positive control: the flood should evict the tombstone");
    assert_eq!(o.foreign, SLOT, "positive control: the aborted request's bytes in the next tenant's slot");
}

/// Round three, attack 2: `n` early ABORTs for made-up tenancies under the
/// decode's name, sent plain (Mooncake's wire: the JSON names the sender),
/// then the decode's own early ABORT. Returns how long the decode's aborted
/// slot took to come back (`None`: not within `limit`) and the prefill.
fn spend_the_decodes_share(cfg: AdapterConfig, n: usize, limit: Duration) -> (Option<Duration>, Side, usize) {
    let prefill = side(AdapterConfig { max_aborted: CAP, ..cfg });
    let decode = side(AdapterConfig::default());
    let to: SocketAddr = prefill.a.segment_name().parse().unwrap();
    let before = prefill.a.metrics().aborts_received;
    for i in 0..n as u64 {
        let t = Tenancy::new(SlotId(1000 + i as u32), Generation(1));
        let abort = ControlMessage::new(ControlKind::Abort, kv_transfer_core::PoolId(1), made_up(i), vec![t]);
        let n = NotifyDesc::new(decode.a.segment_name(), &abort.encode_text().unwrap());
        let _ = backend_mooncake::client::send_notify(to, &n, Duration::from_secs(2));
    }
    wait_until("the flood is handled", Duration::from_secs(20), || {
        prefill.a.metrics().aborts_received >= before + n as u64
    });
    let held = prefill.a.metrics().abort_state_entries as usize;
    // The decode's own early ABORT (the prefill never posted to it).
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let (exposed, _) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    let t0 = Instant::now();
    exposed.abort();
    let mut back = None;
    while t0.elapsed() < limit {
        if decode.pool.metrics().free == 1 {
            back = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    (back, prefill, held)
}

/// How long the decode's aborted slot may take to come back under the
/// flood (alone it takes milliseconds: one sealed round trip each way).
const HONEST_BOUND: Duration = Duration::from_secs(2);

#[test]
fn hostile_plain_aborts_under_the_decodes_name_buy_nothing_and_its_own_abort_is_answered() {
    // The no-attack control, in the same run.
    let (alone, _, _) = spend_the_decodes_share(AdapterConfig::default(), 0, HONEST_BOUND);
    let alone = alone.expect("without a flood the decode's early ABORT is answered");
    let (flooded, prefill, held) = spend_the_decodes_share(AdapterConfig::default(), 10 * CAP, HONEST_BOUND);
    let flooded = flooded.expect("the decode's own early ABORT went unanswered after a plain flood under its name");
    eprintln!("early ABORT answered in {alone:?} alone, {flooded:?} after {} forged ones", 10 * CAP);
    assert_eq!(held, 0, "forged plain ABORTs bought abort state");
    let m = prefill.a.metrics();
    assert_eq!(m.aborts_unproven, (10 * CAP) as u64, "{m:?}");
    assert!(prefill.e.target_stats().sealed_notifies >= 1, "the decode's own ABORT came sealed");
}

#[test]
fn hostile_plain_aborts_positive_control_accepted_unproven_they_spend_the_decodes_share() {
    let cfg = AdapterConfig { accept_unproven_aborts: true, ..AdapterConfig::default() };
    let (flooded, _, held) = spend_the_decodes_share(cfg, 10 * CAP, HONEST_BOUND);
    assert_eq!(held, CAP, "positive control: the flood fills the decode's share");
    assert_eq!(flooded, None, "positive control: the decode's own early ABORT should go unanswered");
}

/// A listener that relays each connection to `to`, recording what the
/// dialer sent.
fn relay(to: SocketAddr) -> (SocketAddr, std::sync::mpsc::Receiver<Vec<u8>>) {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let Ok((mut a, _)) = l.accept() else { return };
        let mut b = std::net::TcpStream::connect(to).unwrap();
        let (mut a2, mut b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut b2, &mut a2);
            let _ = a2.shutdown(std::net::Shutdown::Write);
        });
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        while let Ok(n) = a.read(&mut buf) {
            if n == 0 || b.write_all(&buf[..n]).is_err() {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        let _ = b.shutdown(std::net::Shutdown::Write);
        let _ = back.join();
        let _ = tx.send(seen);
    });
    (at, rx)
}

fn abort_text() -> String {
    let t = Tenancy::new(SlotId(7), Generation(1));
    ControlMessage::new(ControlKind::Abort, kv_transfer_core::PoolId(1), made_up(7), vec![t]).encode_text().unwrap()
}

#[test]
fn hostile_sealed_aborts_with_another_key_relayed_or_replayed_are_refused_typed_and_counted() {
    let prefill = side(AdapterConfig::default());
    let to: SocketAddr = prefill.a.segment_name().parse().unwrap();
    let name = prefill.a.segment_name().to_string();
    let stats = || prefill.e.auth_stats();
    let t = Duration::from_secs(5);

    // Another key: the prefill's proof does not verify at the dialer.
    let stranger =
        NotifyAuth::new(ClusterKey::from_secret(b"another cluster's key, 32 bytes or more").unwrap(), "127.0.0.1:9");
    let e = stranger.send(to, &name, &abort_text(), t).unwrap_err();
    assert!(matches!(e, EngineError::PeerAuth(AuthError::WrongKey)), "{e:?}");
    assert_eq!(stranger.stats().wrong_key, 1);

    // A relay: the dialer dialed the relay, the prefill is not what it dialed.
    let (relay_at, _) = relay(to);
    let honest = NotifyAuth::new(cluster_key(), "127.0.0.1:9");
    let e = honest.send(relay_at, &relay_at.to_string(), &abort_text(), t).unwrap_err();
    assert!(matches!(e, EngineError::PeerAuth(AuthError::Refused(RefusalCode::AddressMismatch))), "{e:?}");
    wait_until("the relay counted", t, || stats().address_mismatch == 1);

    // A replay: an honest sealed notification recorded on its way, sent again.
    let (rec_at, recorded) = relay(to);
    // The honest sender's connection goes through the recorder (the
    // address it dialed is the prefill's, so the prefill accepts it).
    let base = prefill.a.metrics().aborts_received;
    let recorded_sender = NotifyAuth::new(cluster_key(), "127.0.0.1:9");
    let sent = recorded_sender.send(rec_at, &name, &abort_text(), t);
    assert!(sent.is_ok(), "the recorded notification itself is accepted: {sent:?}");
    // Dropped, it closes the connection it kept: the recording ends.
    drop(recorded_sender);
    let bytes = recorded.recv_timeout(t).unwrap();
    wait_until("the recorded ABORT delivered once", t, || prefill.a.metrics().aborts_received == base + 1);
    let before = base + 1;
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(to).unwrap();
        s.set_read_timeout(Some(t)).unwrap();
        s.write_all(&bytes).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    wait_until("the replay counted", t, || stats().replayed == 1);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(prefill.a.metrics().aborts_received, before, "a replayed ABORT was delivered");

    // The positive control: the right key, dialed direct, is accepted.
    honest.send(to, &name, &abort_text(), t).unwrap();
    wait_until("a sealed ABORT delivered", t, || prefill.a.metrics().aborts_received == before + 1);
    let m = prefill.a.metrics();
    assert_eq!(m.aborts_unproven, 0, "{m:?}");
}

/// A request's DONEs (its KV pages', its aux row's) end at once on two
/// threads. Each sealed notification must find a kept connection rather
/// than dial a new handshake (three round trips and a thread at the
/// target): with one connection kept per target, every request paid one
/// handshake (SGLang's time to first token, issue 46).
#[test]
fn sealed_notifications_sent_at_once_to_one_target_reuse_kept_connections() {
    let prefill = side(AdapterConfig::default());
    let to: SocketAddr = prefill.a.segment_name().parse().unwrap();
    let name = prefill.a.segment_name().to_string();
    let sender = NotifyAuth::new(cluster_key(), "127.0.0.1:9");
    let t = Duration::from_secs(5);
    const ROUNDS: usize = 20;
    for _ in 0..ROUNDS {
        let gate = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    gate.wait();
                    sender.send(to, &name, "not for the adapter", t).unwrap();
                });
            }
        });
    }
    let dialed = sender.stats().established;
    // Two at once need two connections; every later round reuses them (a
    // third only if a round's two overlap with neither kept yet).
    assert!(dialed <= 3, "{dialed} handshakes for {ROUNDS} rounds of two notifications at once");
    wait_until("every notification delivered", t, || prefill.a.metrics().notifies_foreign == 2 * ROUNDS as u64);
}
