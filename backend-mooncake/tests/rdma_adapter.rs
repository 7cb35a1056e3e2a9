//! The adapter over Mooncake's RDMA transport with a key per tenancy, on
//! backend-verbs' software NIC: every exposure its own key granted to its
//! peer only, every settlement ends it, the ladder revokes, and a revoked
//! slot is kept away from the peer that may retry it (DESIGN, "Peers that
//! retry after a revocation").

use std::sync::Arc;
use std::time::Duration;

use backend_mooncake::adapter::{block_on, TenancyKeys};
use backend_mooncake::rdma::{rdma_engine, Publish, RdmaNics};
use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeTransfer, ProtoVersion, ReleasePolicy};
use backend_verbs::{FakeFabric, FakeNic};
use kv_transfer_core::{
    EscalationLadder, ExposeErrorKind, HostRegion, PeerId, PoolConfig, Region, SlotPool, Transfer, TransferHandle,
    TransferOptions,
};

struct Side {
    a: MooncakeTransfer,
    pool: SlotPool,
    region: Arc<HostRegion>,
    /// The NIC its initiator posts on.
    nic: FakeNic,
}

const FAST: EscalationLadder = EscalationLadder {
    drain: Duration::from_millis(50),
    revoke: Duration::from_millis(50),
    fence: Duration::from_millis(50),
};

fn side(fabric: &FakeFabric, slots: usize, slot: usize) -> Side {
    side_with(fabric, slots, slot, ReleasePolicy::Safe)
}

fn side_with(fabric: &FakeFabric, slots: usize, slot: usize, release_policy: ReleasePolicy) -> Side {
    let nic = fabric.fake_nic();
    let nics = RdmaNics { initiator: Arc::new(nic.clone()), target: fabric.nic() };
    let (engine, target) = rdma_engine(EngineConfig::default(), nics, "fake0", Publish::Grants).unwrap();
    let keys: Arc<dyn TenancyKeys> = target;
    let a = MooncakeTransfer::new(
        Arc::new(engine),
        AdapterConfig { keys: Some(keys), release_policy, ..Default::default() },
    )
    .unwrap();
    let region = Arc::new(HostRegion::new(slots * slot).unwrap());
    let pool = a.register_pool(region.clone(), PoolConfig::new(slot).with_ladder(FAST)).unwrap();
    Side { a, pool, region, nic }
}

use kv_transfer_testkit::wait::wait_for as wait_until;

fn initiator_qps(fabric: &FakeFabric, nic: &FakeNic) -> Vec<u32> {
    fabric.queue_pairs().into_iter().filter(|(_, n, to)| *n == nic.id() && to.is_some()).map(|(q, _, _)| q).collect()
}

/// Pairs prefill's endpoint with one clean round, holds its queue pairs,
/// and posts a WRITE of `0xA5` into a fresh exposure of decode's slot, held
/// at the NIC; then aborts that exposure. Returns the write's handle and
/// the held queue pairs.
fn held_write_then_abort(
    fabric: &FakeFabric,
    prefill: &Side,
    decode: &Side,
    peer: PeerId,
    slot: usize,
) -> (TransferHandle, Vec<u32>) {
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    let out =
        block_on(block_on(prefill.a.write(prefill.pool.reserve(1).unwrap(), &remote, Default::default())).unwrap())
            .unwrap();
    out.result.unwrap();
    out.lease.release();
    block_on(exposed.settled()).release();
    let qps = initiator_qps(fabric, &prefill.nic);
    assert!(!qps.is_empty());
    for q in &qps {
        fabric.hold(*q);
    }
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &vec![0xA5u8; slot]).unwrap();
    let h = block_on(prefill.a.write(src, &remote, TransferOptions::notify(false))).unwrap();
    wait_until("slices posted", Duration::from_secs(5), || qps.iter().map(|q| fabric.posted(*q)).sum::<usize>() > 0);
    exposed.abort();
    (h, qps)
}

#[test]
fn rdma_keys_a_write_settles_by_done_and_its_keys_end_with_the_settlement() {
    const SLOT: usize = 256 << 10;
    let fabric = FakeFabric::new(21);
    let prefill = side(&fabric, 2, SLOT);
    let decode = side(&fabric, 2, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    assert_eq!(decode.a.peer_proto(peer), Some(ProtoVersion::V2), "an RC completion proves placement");
    let (exposed, remote) = decode.a.expose(decode.pool.reserve(2).unwrap(), peer).unwrap();
    let mut src = prefill.pool.reserve(2).unwrap();
    src.write_at(0, 0, &vec![7u8; SLOT]).unwrap();
    src.write_at(1, 0, &vec![9u8; SLOT]).unwrap();
    let out = block_on(block_on(prefill.a.write(src, &remote, TransferOptions::default())).unwrap()).unwrap();
    out.result.unwrap();
    out.lease.release();
    let settled = block_on(exposed.settled());
    assert_eq!(settled.bytes().unwrap(), [vec![7u8; SLOT], vec![9u8; SLOT]].concat());
    settled.release();
    // Its keys ended with the settlement: the metadata that peer fetches
    // now holds nothing (and the NIC refuses an ended key:
    // `rdma_fake::rdma_a_refused_key_fails_the_task_after_all_its_slices_completed_and_pairs_anew`).
    let e = prefill.a.engine();
    let desc = e.segment_info(e.open_segment(decode.a.segment_name()).unwrap()).unwrap().desc;
    assert!(desc.buffers.is_empty(), "{:?}", desc.buffers);
    let m = decode.a.metrics();
    assert_eq!((m.settled_by_peer, m.revoked, m.shadowed), (2, 0, 0), "{m:?}");
}

/// The ladder with keys: an aborted exposure whose WRITE is held at the
/// initiator's NIC is asked to drain (no ack: the write has not ended),
/// then revoked: the slot comes back `Revoked`, shadowed for that peer. The
/// held WRITE, released, is refused at the NIC and lands nothing; the slot
/// is refused to that peer and exposed to another; the peer's ABORT_ACK
/// (its write ended with REM_ACCESS_ERR) clears the shadow.
#[test]
fn rdma_keys_revoke_settles_an_abort_and_shadows_the_slot_for_that_peer_until_its_ack() {
    const SLOT: usize = 128 << 10;
    let fabric = FakeFabric::new(33);
    let prefill = side(&fabric, 1, SLOT);
    let other = side(&fabric, 1, SLOT);
    let decode = side(&fabric, 1, SLOT);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let other_peer = decode.a.add_peer(other.a.segment_name()).unwrap();

    let (h, qps) = held_write_then_abort(&fabric, &prefill, &decode, peer, SLOT);
    wait_until("revoked", Duration::from_secs(10), || decode.a.metrics().revoked == 1);
    wait_until("slot back", Duration::from_secs(5), || decode.pool.metrics().free == 1);
    assert_eq!(decode.a.metrics().shadowed, 1);
    assert!(decode.a.metrics().aborts_sent >= 1, "drained first");

    // The next tenant writes its bytes. While the peer's write may still
    // run (held), the slot is refused to that peer (typed, lease back);
    // another peer takes it.
    let mut next = decode.pool.reserve(1).unwrap();
    next.write_at(0, 0, &vec![0x11u8; SLOT]).unwrap();
    let back = match decode.a.expose(next, peer) {
        Err(e) => {
            assert!(matches!(e.kind, ExposeErrorKind::RetryShadow(_)), "{:?}", e.kind);
            e.lease
        }
        Ok(_) => panic!("a shadowed slot was exposed to the peer that may retry it"),
    };
    assert_eq!(decode.a.metrics().shadow_refusals, 1);
    let (exposed, _) = decode.a.expose(back, other_peer).unwrap();

    // The held WRITE is released: refused at the NIC, nothing lands.
    let refused = fabric.stats().rejected_access;
    for q in &qps {
        fabric.release(*q);
    }
    let out = block_on(h).unwrap();
    assert!(out.result.is_err(), "the held write under a revoked key succeeded");
    out.lease.release();
    assert!(fabric.stats().rejected_access > refused);
    let mut got = vec![0u8; SLOT];
    decode.region.read(0, &mut got).unwrap();
    assert_eq!(got.iter().filter(|b| **b != 0x11).count(), 0, "old bytes in the next tenant");

    // The peer's write ended with REM_ACCESS_ERR (nothing more of it lands),
    // so it acks the ABORT it received: that clears the shadow.
    wait_until("shadow cleared", Duration::from_secs(10), || decode.a.metrics().shadowed == 0);
    exposed.abort();
    assert_eq!(decode.a.metrics().shadows_cleared, 1);
}

/// The positive control of the test above: the naive policy frees the
/// aborted slot without ending its key, and the held WRITE, released, lands
/// in the next tenant (exposed to another peer under a key of its own).
#[test]
fn rdma_keys_positive_control_naive_release_lets_the_held_write_into_the_next_tenant() {
    const SLOT: usize = 128 << 10;
    let fabric = FakeFabric::new(35);
    let prefill = side(&fabric, 1, SLOT);
    let other = side(&fabric, 1, SLOT);
    let decode = side_with(&fabric, 1, SLOT, ReleasePolicy::Naive);
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    let other_peer = decode.a.add_peer(other.a.segment_name()).unwrap();
    let (h, qps) = held_write_then_abort(&fabric, &prefill, &decode, peer, SLOT);
    wait_until("naive release", Duration::from_secs(5), || decode.pool.metrics().free == 1);
    let mut next = decode.pool.reserve(1).unwrap();
    next.write_at(0, 0, &vec![0x11u8; SLOT]).unwrap();
    let (exposed, _) = decode.a.expose(next, other_peer).unwrap();
    for q in &qps {
        fabric.release(*q);
    }
    let out = block_on(h).unwrap();
    out.lease.release();
    let mut got = vec![0u8; SLOT];
    decode.region.read(0, &mut got).unwrap();
    let foreign = got.iter().filter(|b| **b == 0xA5).count();
    assert!(foreign > 0, "the positive control showed no corruption");
    assert_eq!(decode.a.metrics().revoked, 0);
    exposed.abort();
}
