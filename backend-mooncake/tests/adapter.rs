//! The adapter over our own engine on both sides (loopback TCP).

use kv_transfer_core::drain::{ControlKind, ControlMessage};
use std::sync::Arc;
use std::time::Duration;

use backend_mooncake::adapter::block_on;
use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer, ProtoVersion, TransferEngine};
use kv_transfer_core::{
    AdmissionError, EscalationLadder, HostRegion, PoolConfig, PostErrorKind, Region, SlotPool, Transfer,
    TransferOptions,
};

struct Side {
    a: MooncakeTransfer,
    pool: SlotPool,
    region: Arc<HostRegion>,
}

fn side_with(ecfg: EngineConfig, slots: usize, slot: usize, ladder: EscalationLadder) -> Side {
    let e = MooncakeEngine::new(ecfg).unwrap();
    let a = MooncakeTransfer::new(Arc::new(e), AdapterConfig::default()).unwrap();
    let region = Arc::new(HostRegion::new(slots * slot).unwrap());
    let pool = a.register_pool(region.clone(), PoolConfig::new(slot).with_ladder(ladder)).unwrap();
    Side { a, pool, region }
}

fn side(slots: usize, slot: usize) -> Side {
    side_with(EngineConfig::default(), slots, slot, EscalationLadder::default())
}

use kv_transfer_testkit::wait::wait_for as wait_until;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 9) as u8)).collect()
}

/// WRITE and READ through both adapters, byte-checked; the target's
/// exposures settle from the initiator's notifications only.
#[test]
fn write_and_read_settle_by_notification() {
    const SLOT: usize = 64 << 10;
    let prefill = side(4, SLOT);
    let decode = side(4, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    assert_eq!(decode.a.peer_proto(peer), Some(ProtoVersion::V2));

    // WRITE: prefill's 3 slots into decode's 3 exposed slots.
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(3).unwrap(), peer).unwrap();
    let mut src = prefill.pool.reserve(3).unwrap();
    let data: Vec<Vec<u8>> = (0..3).map(|i| pattern(SLOT, i as u8 + 1)).collect();
    for (i, d) in data.iter().enumerate() {
        src.write_at(i, 0, d).unwrap();
    }
    let h = block_on(prefill.a.write(src, &remote, TransferOptions::default())).unwrap();
    let out = block_on(h).unwrap();
    out.result.unwrap();
    out.lease.release();
    let settled = block_on(exposed.settled());
    assert_eq!(settled.bytes().unwrap(), data.concat(), "decode holds prefill's bytes");
    assert_eq!(decode.a.metrics().settled_by_peer, 3);

    // READ: decode's settled bytes pulled back by prefill from a new exposure.
    let mut keep = settled.into_reserved();
    keep.write_at(0, 0, &pattern(SLOT, 99)).unwrap();
    let (exposed, remote) = decode.a.expose(keep, peer).unwrap();
    let h = block_on(prefill.a.read(prefill.pool.reserve(3).unwrap(), &remote, TransferOptions::default())).unwrap();
    let out = block_on(h).unwrap();
    out.result.unwrap();
    let mut expect = data.concat();
    expect[..SLOT].copy_from_slice(&pattern(SLOT, 99));
    assert_eq!(out.lease.bytes().unwrap(), expect);
    block_on(exposed.settled()).release();

    // A replayed notification for the old generation is stale: counted, ignored.
    let stale_before = decode.pool.metrics().stale_rejected;
    let seg = prefill.a.engine().open_segment(decode.a.segment_name()).unwrap();
    let old = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, vec![remote.slots[0].tenancy()]);
    prefill.a.engine().send_notify(seg, &old.encode_text().unwrap()).unwrap();
    prefill.a.engine().send_notify(seg, "kvt2 garbage").unwrap();
    prefill.a.engine().send_notify(seg, "hello app").unwrap();
    wait_until("stale and malformed counted", Duration::from_secs(5), || {
        decode.pool.metrics().stale_rejected > stale_before
            && decode.a.metrics().notifies_malformed == 1
            && decode.a.metrics().notifies_foreign == 1
    });
    assert_eq!(decode.a.metrics().notifies_foreign, 1);
    assert_eq!(decode.pool.metrics().free, 4);
    decode.pool.check_invariants().unwrap();
    prefill.pool.check_invariants().unwrap();
}

/// A DONE settles its exposure as soon as it arrives: our engine wakes the
/// decode's control thread on each notification queued. Here that thread
/// would otherwise sleep 30 s (`idle_wait`, `poll_interval`): a decode that
/// still polled, or an engine that forgot to wake it, keeps the slot that long
/// and the bounded wait below gives up.
#[test]
fn a_notification_wakes_the_control_thread_instead_of_a_poll() {
    const SLOT: usize = 4096;
    let prefill = side(1, SLOT);
    let sleepy = AdapterConfig {
        idle_wait: Duration::from_secs(30),
        poll_interval: Duration::from_secs(30),
        ..AdapterConfig::default()
    };
    let decode =
        MooncakeTransfer::new(Arc::new(MooncakeEngine::new(EngineConfig::default()).unwrap()), sleepy).unwrap();
    let pool = decode.register_pool(Arc::new(HostRegion::new(SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let peer = decode.add_peer(prefill.a.segment_name()).unwrap();
    let (exposed, remote) = decode.expose(pool.reserve(1).unwrap(), peer).unwrap();
    // Let the control thread go back to sleep after the set-up woke it.
    std::thread::sleep(Duration::from_millis(200));
    let h = block_on(prefill.a.write(prefill.pool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap();
    let out = block_on(h).unwrap();
    out.result.unwrap();
    out.lease.release();
    let mut settled = Box::pin(exposed.settled());
    let settled = kv_transfer_core::poll_until(settled.as_mut(), Duration::from_secs(5))
        .expect("the DONE did not settle the exposure within 5 s: nothing woke the control thread");
    settled.release();
    assert_eq!(decode.metrics().settled_by_peer, 1);
    assert_eq!(pool.metrics().free, 1);
}

/// An operation settles only once every task finished, whoever sees it
/// finish: the engine's completion hook (on its thread, for an operation
/// without a DONE), or a waiter thread (an operation with a DONE, or
/// `engine_hooks` off). Bytes, settlement and counters agree either way.
#[test]
fn operations_settle_alike_by_the_engines_hook_and_by_a_waiter() {
    const SLOT: usize = 16 << 10;
    for hooks in [true, false] {
        let acfg = AdapterConfig { engine_hooks: hooks, ..AdapterConfig::default() };
        let e = MooncakeEngine::new(EngineConfig::default()).unwrap();
        let prefill = MooncakeTransfer::new(Arc::new(e), acfg).unwrap();
        let ppool = prefill.register_pool(Arc::new(HostRegion::new(2 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
        let decode = side(2, SLOT);
        let peer = decode.a.add_peer(prefill.segment_name()).unwrap();
        for (round, notify) in [false, true, false].into_iter().enumerate() {
            let (exposed, remote) = decode.a.expose(decode.pool.reserve(2).unwrap(), peer).unwrap();
            let mut src = ppool.reserve(2).unwrap();
            let data = [pattern(SLOT, round as u8), pattern(SLOT, round as u8 + 50)];
            src.write_at(0, 0, &data[0]).unwrap();
            src.write_at(1, 0, &data[1]).unwrap();
            let h = block_on(prefill.write(src, &remote, TransferOptions::notify(notify))).unwrap();
            let out = block_on(h).unwrap();
            out.result.unwrap();
            out.lease.release();
            if notify {
                block_on(exposed.settled()).release();
            } else {
                // No DONE: the decode side settles it by its ladder's ABORT,
                // which our initiator acks (every task is finished).
                drop(exposed);
            }
            wait_until("decode's slots back", Duration::from_secs(10), || decode.pool.metrics().free == 2);
            // The slots the exposure named (a pool hands slots out in any order).
            let got: Vec<u8> = remote
                .slots
                .iter()
                .flat_map(|r| {
                    let mut b = vec![0u8; SLOT];
                    decode.region.read(r.slot.0 as usize * SLOT, &mut b).unwrap();
                    b
                })
                .collect();
            assert_eq!(got, data.concat(), "hooks {hooks}, round {round}: the target holds the prefill's bytes");
        }
        let m = prefill.metrics();
        assert_eq!((m.ops_completed, m.ops_failed, m.ops_abandoned), (3, 0, 0), "hooks {hooks}");
        assert_eq!(m.ops_settled_by_engine, if hooks { 2 } else { 0 }, "hooks {hooks}: who settled");
        assert_eq!(ppool.metrics().free, 2);
        ppool.check_invariants().unwrap();
    }
}

/// A write outside the target's buffers is a typed error before anything is
/// sent, and the lease comes back.
#[test]
fn write_outside_target_is_typed() {
    const SLOT: usize = 4096;
    let prefill = side(2, SLOT);
    let decode = side(2, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let (exposed, mut remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    remote.slots[0].addr = decode.region.addr() + 2 * SLOT as u64; // just past the region
    let e =
        block_on(prefill.a.write(prefill.pool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Engine(_)), "{:?}", e.kind);
    e.lease.release();
    assert_eq!(prefill.pool.metrics().free, 2);
    exposed.abort();
}

/// Abort while a large WRITE is in flight: the slot stays quarantined (no new
/// tenant can get it) until the initiator drained and acked; posts to the
/// aborted tenancy are refused afterwards; no foreign byte reaches the next
/// tenant.
#[test]
fn abort_drains_then_acks() {
    const SLOT: usize = 64 << 20;
    let prefill = side(1, SLOT);
    let decode = side(1, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &vec![0xA5u8; SLOT]).unwrap();
    // No completion notification: only the ABORT_ACK can settle the slot.
    let h = block_on(prefill.a.write(src, &remote, TransferOptions::notify(false))).unwrap();
    drop(h); // the completer parks the lease until the terminal status
    exposed.abort();
    assert_eq!(decode.pool.metrics().quarantined, 1);
    assert!(matches!(decode.pool.reserve(1), Err(AdmissionError::OverCapacity { .. })));
    wait_until("ABORT_ACK reclaims the slot", Duration::from_secs(20), || decode.pool.metrics().free == 1);
    wait_until("ack counted", Duration::from_secs(5), || prefill.a.metrics().abort_acks_sent == 1);
    let m = prefill.a.metrics();
    assert_eq!((m.aborts_received, m.ops_completed, m.done_sent), (1, 1, 0), "{m:?}");
    assert_eq!(decode.a.metrics().settled_by_peer, 1);
    // The write finished before the ack; the new tenant sees none of its bytes.
    let mut next = decode.pool.reserve(1).unwrap();
    next.write_at(0, 0, &vec![0x11u8; SLOT]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut got = vec![0u8; SLOT];
    decode.region.read(0, &mut got).unwrap();
    assert_eq!(got.iter().filter(|&&b| b != 0x11).count(), 0, "foreign bytes in the new tenant");
    next.release();
    // Posting to the aborted tenancy is refused.
    let e =
        block_on(prefill.a.write(prefill.pool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Descriptor(_)), "{:?}", e.kind);
    assert_eq!(prefill.a.metrics().posts_to_aborted, 1);
    drop(e);
    wait_until("prefill lease back", Duration::from_secs(5), || prefill.pool.metrics().free == 1);
    decode.pool.check_invariants().unwrap();
}

/// Protocol v1, either way round: nothing settles from a completion, the
/// adapter says so in its metrics, and an aborted exposure stays quarantined
/// (settling only by a fence, which Mooncake TCP cannot give).
#[test]
fn v1_peers_never_settle_by_notification() {
    const SLOT: usize = 4096;
    let fast = EscalationLadder {
        drain: Duration::from_millis(50),
        revoke: Duration::from_millis(50),
        fence: Duration::from_millis(50),
    };
    let v1 = EngineConfig { advertised_tcp_proto_version: 1, ..Default::default() };
    // (a) The target advertises v1: our initiator's tasks run under v1 and it
    // sends no completion notification.
    let prefill = side(1, SLOT);
    let decode = side_with(v1.clone(), 1, SLOT, fast);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    let out =
        block_on(block_on(prefill.a.write(prefill.pool.reserve(1).unwrap(), &remote, Default::default())).unwrap())
            .unwrap();
    out.result.unwrap();
    out.lease.release();
    assert_eq!(prefill.a.metrics().v1_ops, 1);
    assert_eq!(prefill.a.metrics().done_sent, 0);
    exposed.abort();
    wait_until("ladder exhausted", Duration::from_secs(5), || decode.pool.metrics().quarantine_stuck == 1);
    assert_eq!(prefill.a.metrics().abort_acks_withheld, 1);
    assert_eq!(prefill.a.metrics().abort_acks_sent, 0, "no ack towards a v1 target");
    assert_eq!(decode.a.metrics().v1_exposures, 1);
    assert_eq!(decode.pool.metrics().quarantined, 1, "stays quarantined");
    // Revoke and fence are not in this backend's ladder: drain, then stuck.
    let m = decode.a.metrics();
    assert!(m.aborts_sent >= 1 && m.exhausted >= 1, "{m:?}");

    // (b) The initiator is a v1 peer: the target warns, counts, and ignores
    // its completion notifications.
    let prefill = side_with(v1, 1, SLOT, EscalationLadder::default());
    let decode = side(1, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    assert_eq!(decode.a.metrics().v1_peers, 1);
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    assert_eq!(decode.a.metrics().v1_exposures, 1);
    let out =
        block_on(block_on(prefill.a.write(prefill.pool.reserve(1).unwrap(), &remote, Default::default())).unwrap())
            .unwrap();
    out.result.unwrap();
    wait_until("v1 completion ignored", Duration::from_secs(5), || decode.a.metrics().v1_completions_ignored == 1);
    let exposed = exposed.try_settled().expect_err("a v1 peer's word settles nothing");
    exposed.abort();
    assert_eq!(decode.pool.metrics().quarantined, 1);
}

/// A completion for a tenancy exposed to someone else settles nothing.
#[test]
fn completion_from_another_peer_is_dropped() {
    const SLOT: usize = 4096;
    let decode = side(1, SLOT);
    let p = side(1, SLOT);
    let q = side(1, SLOT);
    let pid = decode.a.add_peer(p.a.segment_name()).unwrap();
    decode.a.add_peer(q.a.segment_name()).unwrap();
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), pid).unwrap();
    // Q writes into P's exposure (it got the descriptor somehow) and notifies.
    let out = block_on(block_on(q.a.write(q.pool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap())
        .unwrap();
    out.result.unwrap();
    out.lease.release();
    wait_until("wrong peer counted", Duration::from_secs(5), || decode.a.metrics().wrong_peer == 1);
    let exposed = exposed.try_settled().expect_err("Q's word settles nothing exposed to P");
    // P's own completion settles it.
    let out = block_on(block_on(p.a.write(p.pool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap())
        .unwrap();
    out.result.unwrap();
    block_on(exposed.settled()).release();
}

/// The reusable bench runs the full safe cycle and reports figures.
#[cfg(feature = "testing")]
#[test]
fn bench_runs_and_reports() {
    let cfg = backend_mooncake::bench::BenchConfig {
        duration: Duration::from_millis(300),
        threads: 2,
        batch: 4,
        block: 64 << 10,
        workers: 2,
        drivers: 2,
        ..Default::default()
    };
    let r = backend_mooncake::bench::run(&cfg).unwrap();
    assert!(r.bytes > 0 && r.gbps > 0.0 && r.latency.count > 0, "{r}");
    assert_eq!(r.bytes, r.latency.count * 4 * (64 << 10));
    assert_eq!(r.proto, ProtoVersion::V2);
}

/// Rule 8 on Mooncake (a notification's sender is only the name it
/// declares): a third engine that sends DONE and ABORT_ACK under the exposed
/// peer's segment name, for the right pool and tenancies but without the
/// exposure's token, settles nothing and lifts no quarantine; the honest
/// peer's own DONE still settles.
#[test]
fn hostile_a_done_or_ack_without_the_token_under_the_peers_name_settles_nothing() {
    const SLOT: usize = 4096;
    let prefill = side(2, SLOT);
    let decode = side(2, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    // A second peer that never answers (a bare engine): its aborted exposure
    // stays quarantined unless something forged lifts it.
    let silent = MooncakeEngine::new(EngineConfig::default()).unwrap();
    let silent_peer = decode.a.add_peer(&silent.local_segment_name()).unwrap();
    let (aborted, remote2) = decode.a.expose(decode.pool.reserve(1).unwrap(), silent_peer).unwrap();
    aborted.abort();
    // The forger: its own engine, sending as if it were the prefill peer
    // (Mooncake's notify carries the name the sender writes into it).
    let to = backend_mooncake::client::resolve_segment(decode.a.segment_name()).unwrap();
    let guesses = [
        kv_transfer_core::drain::ExposureToken::default(),
        kv_transfer_core::drain::ExposureToken::from_bytes([7; 16]),
    ];
    for token in guesses {
        let done = ControlMessage::new(ControlKind::Done, remote.pool, token, remote.tenancies());
        let ack = ControlMessage::new(ControlKind::AbortAck, remote2.pool, token, remote2.tenancies());
        for (m, name) in [(done, prefill.a.segment_name().to_string()), (ack, silent.local_segment_name())] {
            let n = backend_mooncake::proto::NotifyDesc::new(&name, &m.encode_text().unwrap());
            backend_mooncake::client::send_notify(to, &n, Duration::from_secs(5)).unwrap();
        }
    }
    wait_until("forgeries counted", Duration::from_secs(5), || decode.pool.metrics().forged_rejected >= 4);
    let exposed = exposed.try_settled().expect_err("a forged DONE settled a live exposure");
    assert_eq!(decode.pool.metrics().quarantined, 1, "a forged ABORT_ACK lifted a quarantine");
    // The honest peer writes and its DONE settles.
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &pattern(SLOT, 3)).unwrap();
    let out = block_on(block_on(prefill.a.write(src, &remote, TransferOptions::default())).unwrap()).unwrap();
    out.result.unwrap();
    out.lease.release();
    let settled = block_on(exposed.settled());
    assert_eq!(settled.bytes().unwrap(), pattern(SLOT, 3));
    settled.release();
}

/// Rule 8, trust fixed at exposure: an exposure made to a peer speaking TCP
/// protocol v1 (whose completions prove nothing) is not settled by that
/// peer's genuine DONE after it restarts as v2 under the same segment name
/// and is added again. The control: the same restarted peer's DONE settles
/// an exposure made after the refresh, so only the recorded trust stopped it.
#[test]
fn hostile_a_v1_exposure_is_not_upgraded_by_the_peer_restarting_as_v2() {
    const SLOT: usize = 4096;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let at = |proto: u32| EngineConfig {
        local_host: "127.0.0.1".into(),
        handshake_port: port,
        advertised_tcp_proto_version: proto,
        ..Default::default()
    };
    let decode = side(2, SLOT);
    let v1 = side_with(at(1), 1, SLOT, EscalationLadder::default());
    let name = v1.a.segment_name().to_string();
    let peer = decode.a.add_peer(&name).unwrap();
    assert_eq!(decode.a.peer_proto(peer), Some(ProtoVersion::V1));
    let (old, old_remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    // The peer restarts, as v2, under the same name, and is added again.
    drop(v1);
    let v2 = side_with(at(2), 1, SLOT, EscalationLadder::default());
    assert_eq!(v2.a.segment_name(), name, "the restarted peer must reuse the name");
    let peer = decode.a.add_peer(&name).unwrap();
    assert_eq!(decode.a.peer_proto(peer), Some(ProtoVersion::V2));
    let write = |remote: &kv_transfer_core::RemoteSlots, seed: u8| {
        let mut src = v2.pool.reserve(1).unwrap();
        src.write_at(0, 0, &pattern(SLOT, seed)).unwrap();
        let out = block_on(block_on(v2.a.write(src, remote, TransferOptions::default())).unwrap()).unwrap();
        out.result.unwrap();
        out.lease.release();
    };
    // Its genuine DONE for the v1-era exposure (it holds the token): looked
    // at, and refused as the word of a peer the exposure does not trust.
    write(&old_remote, 1);
    wait_until("the DONE refused", Duration::from_secs(5), || decode.a.metrics().v1_completions_ignored == 1);
    let (new, new_remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    write(&new_remote, 2);
    let settled = block_on(new.settled());
    assert_eq!(settled.bytes().unwrap(), pattern(SLOT, 2));
    settled.release();
    let old = old.try_settled().expect_err("a v1 exposure was upgraded by the peer's restart as v2");
    old.abort();
    assert_eq!(decode.pool.metrics().quarantined, 1);
}
