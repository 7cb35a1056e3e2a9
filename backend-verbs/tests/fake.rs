//! The adapter on `FakeFabric`, the software NIC that misbehaves as
//! hardware does: each test stages one sequence a device gives only by
//! chance (a WRITE held past its abort, an ABORT_ACK arriving while the
//! revoke is in flight, a link dying with requests posted, completions
//! interleaved across queue pairs). Runs on any host: no device, no root.

use std::sync::Arc;
use std::time::Duration;

use backend_verbs::{FakeFabric, FakeNic, VerbsConfig, VerbsTransfer};
use kv_transfer_core::drain::ReleasePolicy;
use kv_transfer_core::{
    block_on, poll_until, EscalationLadder, HostRegion, PeerId, PoolConfig, RejectReason, SlotPool, Transfer,
    TransferError, TransferOptions,
};

const WAIT: Duration = Duration::from_secs(5);
const SLOT: usize = 4096;

/// Calls `cond` until it holds or `WAIT` passes.
fn eventually(cond: impl FnMut() -> bool) -> bool {
    kv_transfer_testkit::wait::wait_until(WAIT, cond)
}

struct Side {
    t: VerbsTransfer,
    pool: SlotPool,
    nic: usize,
}

fn side(fabric: &FakeFabric, name: &str, policy: ReleasePolicy, ladder: EscalationLadder) -> Side {
    let nic: FakeNic = fabric.fake_nic();
    let id = nic.id();
    let mut cfg = VerbsConfig::new(name, "fake", 1);
    cfg.release_policy = policy;
    let t = VerbsTransfer::with_engine(cfg, Arc::new(nic)).expect("adapter");
    let region = Arc::new(HostRegion::new(8 * SLOT).expect("region"));
    let pool = t.register_pool(region, PoolConfig::new(SLOT).with_ladder(ladder)).expect("pool");
    Side { t, pool, nic: id }
}

fn ladder(drain_ms: u64) -> EscalationLadder {
    EscalationLadder {
        drain: Duration::from_millis(drain_ms),
        revoke: Duration::from_secs(30),
        fence: Duration::from_secs(30),
    }
}

/// `prefill` dials `decode`, and the decode side adds it (its owner
/// confirms the connection); the decode side's id for it.
fn connect(decode: &Side, prefill: &Side) -> PeerId {
    prefill.t.add_peer(decode.t.descriptor()).expect("add peer");
    decode.t.add_peer(prefill.t.descriptor()).expect("decode adds prefill");
    let name = prefill.t.descriptor().rsplit_once('@').map(|(n, _)| n.to_owned()).unwrap_or_default();
    let mut peer = None;
    assert!(eventually(|| {
        peer = decode.t.peer_named(&name);
        peer.is_some()
    }));
    peer.expect("the decode side recorded the peer")
}

/// The connected queue pair of NIC `nic` (one connection each in these
/// tests), waiting for it (bounded). A queue pair made for a handshake
/// attempt that did not complete (a slow machine can time one out and try
/// again) has no remote end and is not the one the transfers use: the
/// newest connected one is.
fn qp_of(fabric: &FakeFabric, nic: usize) -> u32 {
    let mut found = None;
    eventually(|| {
        found = fabric.queue_pairs().into_iter().filter(|q| q.1 == nic && q.2.is_some()).map(|q| q.0).max();
        found.is_some()
    });
    found.expect("a connected queue pair")
}

fn whole(pool: &SlotPool) -> bool {
    eventually(|| {
        let m = pool.metrics();
        m.quarantined == 0 && m.free == m.capacity
    })
}

/// The reported hazard on the fake NIC: a WRITE held past its abort, the
/// slot revoked and handed to a new tenant, then the WRITE goes. Safe: the
/// NIC refuses the old window's key and the new tenant's bytes stay. Naive
/// (the positive control): the old bytes land in the new tenant's slot.
#[test]
fn a_write_after_its_window_was_invalidated_is_refused_and_memory_is_unchanged() {
    for policy in [ReleasePolicy::Safe, ReleasePolicy::Naive] {
        let fabric = FakeFabric::new(3);
        let decode = side(&fabric, "decode", policy, ladder(1));
        let prefill = side(&fabric, "prefill", ReleasePolicy::Safe, ladder(1));
        let peer = connect(&decode, &prefill);
        let pqp = qp_of(&fabric, prefill.nic);
        let (exposed, remote) = decode.t.expose(decode.pool.reserve(2).expect("reserve"), peer).expect("expose");
        fabric.hold(pqp);
        let mut src = prefill.pool.reserve(2).expect("reserve");
        for i in 0..2 {
            src.write_at(i, 0, &[0xab; SLOT]).expect("fill");
        }
        let mut h = block_on(prefill.t.write(src, &remote, TransferOptions::notify(false))).expect("post");
        assert!(eventually(|| fabric.posted_transfers(pqp) == 2), "the WRITEs are held");
        exposed.abort();
        assert!(eventually(|| decode.pool.metrics().quarantined == 0), "{policy:?}: the aborted slots came back");
        let mut next = decode.pool.reserve(2).expect("the same slots, next tenant");
        let mut slots: Vec<u32> = next.tenancies().iter().map(|t| t.slot.0).collect();
        slots.sort_unstable();
        let mut old: Vec<u32> = remote.slots.iter().map(|s| s.slot.0).collect();
        old.sort_unstable();
        assert_eq!(slots, old, "LIFO: the same slots");
        for i in 0..2 {
            next.write_at(i, 0, &[0x11; SLOT]).expect("the next tenant's bytes");
        }
        fabric.release(pqp);
        let out = poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").expect("an outcome");
        let mut buf = vec![0u8; 2 * SLOT];
        for (i, s) in slots.iter().enumerate() {
            decode.pool.region().read(*s as usize * SLOT, &mut buf[i * SLOT..(i + 1) * SLOT]).expect("read");
        }
        if policy == ReleasePolicy::Safe {
            {
                assert_eq!(out.result, Err(TransferError::Rejected(RejectReason::StaleGeneration)));
                assert!(buf.iter().all(|b| *b == 0x11), "safe: a stale byte landed");
                assert_eq!(fabric.stats().rejected_access, 1);
            }
        } else {
            {
                assert_eq!(out.result, Ok(()), "naive: the key still granted the slot");
                assert!(buf.iter().all(|b| *b == 0xab), "positive control: the old bytes must land");
            }
        }
        out.lease.release();
        next.release();
        assert!(whole(&decode.pool), "{policy:?}: {:?}", decode.pool.metrics());
    }
}

/// The ladder's revoke and the peer's ABORT_ACK race: the ACK arrives while
/// the revoke's `LOCAL_INV` is posted and not complete. The ACK's
/// invalidation joins the one in flight, and its completion settles the
/// slots (before the fix, the second was dropped and both slots stayed
/// quarantined until a fence).
#[test]
fn an_abort_ack_arriving_while_the_revoke_is_in_flight_settles_the_slots() {
    let fabric = FakeFabric::new(5);
    let decode = side(&fabric, "decode", ReleasePolicy::Safe, ladder(50));
    let prefill = side(&fabric, "prefill", ReleasePolicy::Safe, ladder(50));
    let peer = connect(&decode, &prefill);
    let (pqp, dqp) = (qp_of(&fabric, prefill.nic), qp_of(&fabric, decode.nic));
    let (exposed, remote) = decode.t.expose(decode.pool.reserve(2).expect("reserve"), peer).expect("expose");
    fabric.hold(pqp);
    let src = prefill.pool.reserve(2).expect("reserve");
    let mut h = block_on(prefill.t.write(src, &remote, TransferOptions::notify(false))).expect("post");
    assert!(eventually(|| fabric.posted_transfers(pqp) == 2));
    exposed.abort();
    // The drain: ABORT reaches the initiator, whose WRITEs are in flight.
    assert!(eventually(|| prefill.t.counter("messages_received") >= 1), "the ABORT arrived");
    fabric.hold(dqp);
    // The drain's budget runs out: the revoke's invalidations, held.
    assert!(eventually(|| fabric.posted(dqp) >= 2), "the revoke was posted");
    fabric.release(pqp);
    let out = poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").expect("an outcome");
    assert_eq!(out.result, Ok(()), "the windows were still valid");
    out.lease.release();
    assert!(eventually(|| decode.t.counter("messages_received") >= 1), "the ABORT_ACK arrived");
    assert_eq!(decode.pool.metrics().quarantined, 2, "nothing settles before the invalidations complete");
    fabric.release(dqp);
    assert!(whole(&decode.pool), "the ACK's settlement was lost: {:?}", decode.pool.metrics());
}

/// A link that dies with requests posted (an async event on a device): both
/// ends in ERR, every request flushed; the initiator's operation proves
/// nothing (its lease comes back with its own fence), the target fences the
/// peer and the exposed lease settles by the fence.
#[test]
fn a_link_that_dies_with_requests_posted_flushes_them_and_fences_both_sides() {
    let fabric = FakeFabric::new(9);
    let decode = side(&fabric, "decode", ReleasePolicy::Safe, ladder(50));
    let prefill = side(&fabric, "prefill", ReleasePolicy::Safe, ladder(50));
    let peer = connect(&decode, &prefill);
    let pqp = qp_of(&fabric, prefill.nic);
    let (exposed, remote) = decode.t.expose(decode.pool.reserve(2).expect("reserve"), peer).expect("expose");
    let before = {
        let mut b = vec![0u8; 2 * SLOT];
        decode.pool.region().read(0, &mut b).expect("read");
        b
    };
    fabric.hold(pqp);
    let mut src = prefill.pool.reserve(2).expect("reserve");
    src.write_at(0, 0, &[0x5a; SLOT]).expect("fill");
    let mut h = block_on(prefill.t.write(src, &remote, TransferOptions::default())).expect("post");
    assert!(
        eventually(|| fabric.posted_transfers(pqp) == 3),
        "two WRITEs and the DONE behind them: {} posted on {pqp}; queue pairs {:?}",
        fabric.posted_transfers(pqp),
        fabric.queue_pairs()
    );
    fabric.break_link(pqp);
    assert!(poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").is_err(), "flushed: abandoned");
    let mut settled = Box::pin(exposed.settled());
    let s = poll_until(settled.as_mut(), WAIT).expect("the fence settles the exposure");
    let mut after = vec![0u8; 2 * SLOT];
    decode.pool.region().read(0, &mut after).expect("read");
    assert_eq!(before, after, "a flushed WRITE changed memory");
    s.release();
    assert!(fabric.stats().flushed >= 3, "{:?}", fabric.stats());
    assert!(whole(&decode.pool), "{:?}", decode.pool.metrics());
    assert!(whole(&prefill.pool), "the prefill lease came back with its fence: {:?}", prefill.pool.metrics());
    // A fence counts once it is confirmed (its QP flushed), on each side's
    // own driver tick: the prefill side's may come a tick after the decode's.
    assert!(
        eventually(|| decode.t.counter("fences") >= 1 && prefill.t.counter("fences") >= 1),
        "fences: decode {}, prefill {}",
        decode.t.counter("fences"),
        prefill.t.counter("fences")
    );
}

/// Completions of one NIC's queue pairs come interleaved (the fake shuffles
/// them, as hardware gives no order across queue pairs): each still reaches
/// the operation that posted it, and every byte lands where it was sent.
#[test]
fn completions_interleaved_across_queue_pairs_reach_the_operations_that_posted_them() {
    let fabric = FakeFabric::new(11);
    let prefill = side(&fabric, "prefill", ReleasePolicy::Safe, ladder(50));
    let decodes: Vec<Side> =
        (0..2).map(|i| side(&fabric, &format!("decode-{i}"), ReleasePolicy::Safe, ladder(50))).collect();
    let peers: Vec<PeerId> = decodes.iter().map(|d| connect(d, &prefill)).collect();
    for round in 0..20u8 {
        let mut ops = Vec::new();
        for (d, p) in decodes.iter().zip(&peers) {
            let (exposed, remote) = d.t.expose(d.pool.reserve(1).expect("reserve"), *p).expect("expose");
            let mut src = prefill.pool.reserve(1).expect("reserve");
            let byte = round.wrapping_mul(2).wrapping_add(d.nic as u8);
            src.write_at(0, 0, &[byte; SLOT]).expect("fill");
            let h = block_on(prefill.t.write(src, &remote, TransferOptions::default())).expect("post");
            ops.push((exposed, h, byte));
        }
        for (exposed, mut h, byte) in ops {
            let out = poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").expect("outcome");
            assert_eq!(out.result, Ok(()));
            out.lease.release();
            let mut f = Box::pin(exposed.settled());
            let s = poll_until(f.as_mut(), WAIT).expect("the DONE settles it");
            let mut buf = vec![0u8; SLOT];
            s.read_at(0, 0, &mut buf).expect("read");
            assert!(buf.iter().all(|b| *b == byte), "round {round}: foreign bytes");
            s.release();
        }
    }
    for d in &decodes {
        assert!(whole(&d.pool));
    }
}
