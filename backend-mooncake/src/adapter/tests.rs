//! Adapter tests against `MockTransferEngine`: the engine at its worst.

use super::*;
use crate::engine::{MockTransferEngine, SegmentInfo};
use crate::proto::SegmentDesc;
use crate::TaskStatus;
use kv_transfer_core::{HostRegion, Transfer, TransferOutcome};
use std::sync::atomic::AtomicU32;
use std::time::Instant;

const SLOT: usize = 4096;

fn desc(proto: u32) -> SegmentDesc {
    SegmentDesc {
        name: "127.0.0.1:1".into(),
        protocol: "tcp".into(),
        tcp_data_port: 2,
        tcp_proto_version: Some(proto),
        tcp_data_host: None,
        rdma_server_name: None,
        timestamp: None,
        buffers: vec![],
        devices: vec![],
        priority_matrix: None,
        kvt_notify_auth: None,
    }
}

fn status(s: TransferStatus) -> TaskStatus {
    TaskStatus { status: s, transferred_bytes: 0, error: None, proto: ProtoVersion::V2 }
}

/// A mock whose tasks report what `state` says: 0 TIMEOUT, 1 COMPLETED, 2
/// FAILED for an unknown reason, 3 FAILED with the target's rejection.
/// `inbox` is handed out once by `get_notifies`.
fn mock_with(
    state: Arc<AtomicU32>,
    frees: Arc<AtomicU32>,
    notifies: Arc<Mutex<Vec<String>>>,
    inbox: Arc<Mutex<Vec<crate::proto::NotifyDesc>>>,
) -> MockTransferEngine {
    let mut m = MockTransferEngine::new();
    m.expect_local_segment_name().returning(|| "127.0.0.1:9".into());
    m.expect_serve_exposed_only().returning(|| true);
    m.expect_set_notify_waker().returning(|_| false);
    m.expect_batch_hooks().returning(|| false);
    m.expect_expose_range().returning(|_, _, _| Ok(None));
    m.expect_unexpose_range().returning(|_| true);
    m.expect_register_memory().returning(|_| Ok(()));
    m.expect_unregister_memory().returning(|_| Ok(()));
    m.expect_open_segment().returning(|_| Ok(5));
    m.expect_segment_info().returning(|id| {
        Ok(SegmentInfo { id, desc: desc(2), proto: ProtoVersion::V2, data_addr: "127.0.0.1:2".parse().unwrap() })
    });
    m.expect_allocate_batch_id().returning(|_| Ok(11));
    m.expect_submit_transfer().returning(|_, r| Ok(0..r.len()));
    let st = state.clone();
    m.expect_wait_transfer().returning(move |_, _, wait| {
        let s = match st.load(Ordering::SeqCst) {
            0 => {
                std::thread::sleep(wait.min(Duration::from_millis(5)));
                TransferStatus::Timeout
            }
            1 => TransferStatus::Completed,
            3 => return Ok(TaskStatus { error: Some(TaskError::AddrRejected), ..status(TransferStatus::Failed) }),
            _ => TransferStatus::Failed,
        };
        Ok(status(s))
    });
    let st = state.clone();
    m.expect_free_batch_id().returning(move |b| {
        if st.load(Ordering::SeqCst) == 0 {
            Err(EngineError::BatchBusy { batch: b, unfinished: 1 })
        } else {
            frees.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    });
    m.expect_send_notify().returning(move |_, msg| {
        notifies.lock().unwrap().push(msg.to_string());
        Ok(())
    });
    m.expect_get_notifies().returning(move || std::mem::take(&mut *inbox.lock().unwrap()));
    m
}

fn mock(state: Arc<AtomicU32>, frees: Arc<AtomicU32>, notifies: Arc<Mutex<Vec<String>>>) -> MockTransferEngine {
    mock_with(state, frees, notifies, Arc::default())
}

fn remote(n: usize) -> RemoteSlots {
    RemoteSlots {
        endpoint: "127.0.0.1:1".into(),
        pool: PoolId(77),
        key: 0,
        slot_size: SLOT as u64,
        memory: Default::default(),
        token: Default::default(),
        slots: (0..n)
            .map(|i| kv_transfer_core::RemoteSlot {
                slot: kv_transfer_core::SlotId(i as u32),
                generation: kv_transfer_core::Generation(3),
                addr: 0x1000 + (i * SLOT) as u64,
                key: None,
            })
            .collect(),
    }
}

fn setup(state: &Arc<AtomicU32>) -> (MooncakeTransfer, SlotPool, Arc<AtomicU32>, Arc<Mutex<Vec<String>>>) {
    let frees = Arc::new(AtomicU32::new(0));
    let notes = Arc::new(Mutex::new(Vec::new()));
    let m = mock(state.clone(), frees.clone(), notes.clone());
    let a = MooncakeTransfer::new(
        Arc::new(m),
        AdapterConfig { wait_slice: Duration::from_millis(5), ..Default::default() },
    )
    .unwrap();
    let pool = a.register_pool(Arc::new(HostRegion::new(8 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    (a, pool, frees, notes)
}

fn poll_once(h: &mut TransferHandle) -> Option<Result<TransferOutcome, kv_transfer_core::Abandoned>> {
    kv_transfer_core::poll_until(std::pin::Pin::new(h), Duration::ZERO)
}

/// TIMEOUT forever: the handle never resolves, the batch is never freed, the
/// lease never returns; once the tasks finish, all three happen.
#[test]
fn timeout_is_not_terminal_and_dropped_handle_is_parked() {
    let state = Arc::new(AtomicU32::new(0));
    let (a, pool, frees, notes) = setup(&state);
    let mut h = block_on(a.write(pool.reserve(2).unwrap(), &remote(2), TransferOptions::default())).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert!(poll_once(&mut h).is_none(), "TIMEOUT must not resolve the handle");
    drop(h); // parked in the completer
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(pool.metrics().free, 6, "lease still held while TIMEOUT");
    assert_eq!(frees.load(Ordering::SeqCst), 0);
    assert!(a.metrics().timeouts_seen >= 1);
    assert!(notes.lock().unwrap().is_empty());
    state.store(1, Ordering::SeqCst);
    let t0 = Instant::now();
    while pool.metrics().free != 8 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(pool.metrics().free, 8, "returned after the terminal status");
    assert_eq!(frees.load(Ordering::SeqCst), 1);
    assert_eq!(decoded(&notes), [(ControlKind::Done, vec![t(0, 3), t(1, 3)])]);
    pool.check_invariants().unwrap();
}

/// FAILED: the handle resolves with an error, the lease comes back settled,
/// and no completion notify is sent.
#[test]
fn failure_never_notifies() {
    let state = Arc::new(AtomicU32::new(2));
    let (a, pool, frees, notes) = setup(&state);
    let h = block_on(a.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap();
    let out = block_on(h).unwrap();
    assert!(out.result.is_err());
    out.lease.release();
    assert_eq!(frees.load(Ordering::SeqCst), 1);
    assert!(notes.lock().unwrap().is_empty());
    assert_eq!(a.metrics().ops_failed, 1);
}

/// Bad posts hand the lease back unexposed.
#[test]
fn bad_posts_return_the_lease() {
    let state = Arc::new(AtomicU32::new(1));
    let (a, pool, _, _) = setup(&state);
    let e = block_on(a.write(pool.reserve(2).unwrap(), &remote(3), TransferOptions::default())).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Descriptor(_)));
    e.lease.release();
    let (other, _auth) = SlotPool::new(Arc::new(HostRegion::new(2 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let e = block_on(a.write(other.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap_err();
    assert_eq!(e.kind, PostErrorKind::ForeignPool);
    drop(e);
    assert_eq!(pool.metrics().free, 8);
    assert_eq!(other.metrics().free, 2);
}

/// A submit refused by the engine: nothing was queued, the lease comes back.
#[test]
fn submit_refused_returns_the_lease() {
    let mut m = MockTransferEngine::new();
    m.expect_local_segment_name().returning(|| "127.0.0.1:9".into());
    m.expect_serve_exposed_only().returning(|| true);
    m.expect_set_notify_waker().returning(|_| false);
    m.expect_batch_hooks().returning(|| false);
    m.expect_expose_range().returning(|_, _, _| Ok(None));
    m.expect_unexpose_range().returning(|_| true);
    m.expect_register_memory().returning(|_| Ok(()));
    m.expect_unregister_memory().returning(|_| Ok(()));
    m.expect_open_segment().returning(|_| Ok(5));
    m.expect_segment_info().returning(|id| {
        Ok(SegmentInfo { id, desc: desc(2), proto: ProtoVersion::V2, data_addr: "127.0.0.1:2".parse().unwrap() })
    });
    m.expect_allocate_batch_id().returning(|_| Ok(11));
    m.expect_submit_transfer().returning(|_, _| Err(EngineError::TargetOutOfRange { segment: 5, addr: 1, len: 1 }));
    m.expect_free_batch_id().returning(|_| Ok(()));
    m.expect_get_notifies().returning(Vec::new);
    let a = MooncakeTransfer::new(Arc::new(m), AdapterConfig::default()).unwrap();
    let pool = a.register_pool(Arc::new(HostRegion::new(2 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let e = block_on(a.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Engine(_)), "{:?}", e.kind);
    e.lease.release();
    assert_eq!(pool.metrics().free, 2);
    pool.check_invariants().unwrap();
}

fn t(slot: u32, generation: u64) -> kv_transfer_core::Tenancy {
    kv_transfer_core::Tenancy::new(kv_transfer_core::SlotId(slot), kv_transfer_core::Generation(generation))
}

/// The adapter's notifications, decoded (core's codec, text form).
fn decoded(notes: &Mutex<Vec<String>>) -> Vec<(ControlKind, Vec<kv_transfer_core::Tenancy>)> {
    notes
        .lock()
        .unwrap()
        .iter()
        .map(|n| {
            let m = ControlMessage::decode_text(n.as_bytes()).expect("a control message");
            assert_eq!((m.pool, m.token), (PoolId(77), remote(1).token), "names the exposure it was given");
            (m.kind, m.tenancies)
        })
        .collect()
}

fn abort_note() -> crate::proto::NotifyDesc {
    let m = ControlMessage::new(ControlKind::Abort, PoolId(77), remote(1).token, vec![t(0, 3)]);
    // Sealed by the peer: its name proven (a plain ABORT buys nothing).
    crate::proto::NotifyDesc { proven: true, ..crate::proto::NotifyDesc::new("127.0.0.1:1", &m.encode_text().unwrap()) }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(5), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// ABORT while the operation is in TIMEOUT: no ack until every task is
/// finished; posts to the aborted tenancy are refused; then W, then K.
#[test]
fn abort_acked_only_after_every_task_finished() {
    let state = Arc::new(AtomicU32::new(0));
    let (frees, notes, inbox) = (Arc::new(AtomicU32::new(0)), Arc::new(Mutex::new(Vec::new())), Arc::default());
    let m = mock_with(state.clone(), frees, notes.clone(), Arc::clone(&inbox));
    let cfg = AdapterConfig { wait_slice: Duration::from_millis(5), ..Default::default() };
    let a = MooncakeTransfer::new(Arc::new(m), cfg).unwrap();
    let pool = a.register_pool(Arc::new(HostRegion::new(8 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let h = block_on(a.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap();
    inbox.lock().unwrap().push(abort_note());
    wait_for("abort received", || a.metrics().aborts_received == 1);
    std::thread::sleep(Duration::from_millis(100));
    assert!(notes.lock().unwrap().is_empty(), "no ack while a task is in TIMEOUT");
    let e = block_on(a.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Descriptor(_)));
    drop(e);
    state.store(1, Ordering::SeqCst);
    let out = block_on(h).unwrap();
    out.result.unwrap();
    wait_for("ack", || a.metrics().abort_acks_sent == 1);
    assert_eq!(decoded(&notes), [(ControlKind::Done, vec![t(0, 3)]), (ControlKind::AbortAck, vec![t(0, 3)])]);
}

/// A task that FAILED for a reason that does not prove the target untouched
/// taints its tenancies: a later ABORT for them is never acked. A rejection
/// by the target does not taint.
#[test]
fn uncertain_failure_withholds_the_ack() {
    for (st, acked) in [(2u32, false), (3, true)] {
        let state = Arc::new(AtomicU32::new(st));
        let (frees, notes, inbox) = (Arc::new(AtomicU32::new(0)), Arc::new(Mutex::new(Vec::new())), Arc::default());
        let m = mock_with(state, frees, notes.clone(), Arc::clone(&inbox));
        let a = MooncakeTransfer::new(Arc::new(m), AdapterConfig::default()).unwrap();
        let pool = a.register_pool(Arc::new(HostRegion::new(8 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
        let out =
            block_on(block_on(a.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap())
                .unwrap();
        assert!(out.result.is_err());
        inbox.lock().unwrap().push(abort_note());
        wait_for("abort handled", || a.metrics().abort_acks_sent + a.metrics().abort_acks_withheld == 1);
        assert_eq!(a.metrics().abort_acks_sent == 1, acked, "state {st}: {:?}", a.metrics());
        let sent = decoded(&notes);
        assert_eq!(sent.iter().any(|(k, _)| *k == ControlKind::AbortAck), acked);
        assert!(!sent.iter().any(|(k, _)| *k == ControlKind::Done), "never a completion after a failure");
    }
}

/// Only a sealed ABORT buys abort state, and with
/// `aborts_only_from_known_peers` only one under the proven name of a
/// segment this side opened: a plain one under the peer's own name, and a
/// sealed one under a name this side never opened, are dropped and
/// counted; the peer's own sealed ABORT is answered.
#[test]
fn aborts_count_only_sealed_and_with_known_peers_only_under_a_name_this_side_opened() {
    let state = Arc::new(AtomicU32::new(1));
    let (frees, notes, inbox) = (Arc::new(AtomicU32::new(0)), Arc::new(Mutex::new(Vec::new())), Arc::default());
    let m = mock_with(state, frees, notes.clone(), Arc::clone(&inbox));
    let cfg = AdapterConfig { aborts_only_from_known_peers: true, ..Default::default() };
    let a = MooncakeTransfer::new(Arc::new(m), cfg).unwrap();
    let pool = a.register_pool(Arc::new(HostRegion::new(8 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    // A post opens the peer's segment ("127.0.0.1:1"): a peer this side chose.
    let out =
        block_on(block_on(a.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default())).unwrap()).unwrap();
    out.result.unwrap();
    out.lease.release();
    let plain = crate::proto::NotifyDesc { proven: false, ..abort_note() };
    let stranger = crate::proto::NotifyDesc { name: "127.0.0.9:5".into(), ..abort_note() };
    inbox.lock().unwrap().extend([plain, stranger, abort_note()]);
    wait_for("three ABORTs handled", || a.metrics().aborts_received == 3);
    wait_for("the sealed one answered", || a.metrics().abort_acks_sent == 1);
    let m = a.metrics();
    assert_eq!((m.aborts_unproven, m.aborts_from_strangers, m.abort_state_peers), (1, 1, 1), "{m:?}");
}
