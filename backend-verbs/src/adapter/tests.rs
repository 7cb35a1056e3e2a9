//! The adapter against mockall's `MockEngine`: exact sequences of what a
//! NIC may answer (a refused post, a failed bind, completions of nothing
//! we posted, a failing poll), each checked for a typed error and a whole
//! pool. The mock completes each accepted request at once, with the status
//! the test says.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_transfer_core::drain::ReleasePolicy;
use kv_transfer_core::{
    block_on, poll_until, HostRegion, PoolConfig, SlotPool, Transfer, TransferError, TransferOptions,
};

use super::{VerbsConfig, VerbsTransfer};
use crate::engine::MockEngine;
use crate::error::VerbsError;
use crate::work::{Completion, Endpoint, Gid, MrId, MrInfo, MwId, QpState, WcKind, WcStatus, WorkRequest};

const WAIT: Duration = Duration::from_secs(5);

/// What the mock answers to one post: refuse it, or complete it with a status.
type Verdict = fn(&WorkRequest) -> Result<WcStatus, VerbsError>;

fn all_succeed(_: &WorkRequest) -> Result<WcStatus, VerbsError> {
    Ok(WcStatus::Success)
}

/// A mock NIC with queue pair `qpn`: posts are answered by `verdict`, and
/// each accepted one (RECVs aside) completes at the next poll; `script`
/// is what the first polls return, before those completions.
fn mock(qpn: u32, verdict: Verdict, script: Vec<Result<Vec<Completion>, VerbsError>>) -> Arc<MockEngine> {
    let done: Arc<Mutex<VecDeque<Completion>>> = Arc::default();
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    let mut m = MockEngine::new();
    m.expect_register().returning(|r, _| Ok(MrInfo { id: MrId(1), addr: r.addr(), rkey: 0x77 }));
    m.expect_deregister().return_const(());
    m.expect_alloc_window().returning(|| Ok(MwId(1)));
    m.expect_free_window().return_const(());
    m.expect_create_qp().returning(move |mtu| Ok(Endpoint { qpn, psn: 1, gid: Gid::default(), mtu }));
    m.expect_connect().returning(|_, _| Ok(()));
    m.expect_to_error().returning(|_| Ok(()));
    m.expect_qp_state().returning(|_| Ok(QpState::ReadyToSend));
    let d = Arc::clone(&done);
    m.expect_post().returning(move |qp, wr_id, wr| {
        if matches!(wr, WorkRequest::Recv { .. }) {
            return Ok(None);
        }
        let status = verdict(&wr)?;
        let kind = match wr {
            WorkRequest::Write { .. } | WorkRequest::Heartbeat => WcKind::Write,
            WorkRequest::Read { .. } => WcKind::Read,
            WorkRequest::Send { .. } => WcKind::Send,
            WorkRequest::Bind { .. } => WcKind::Bind,
            WorkRequest::Invalidate { .. } => WcKind::LocalInv,
            WorkRequest::Recv { .. } => WcKind::Recv,
        };
        d.lock().unwrap().push_back(Completion { wr_id, qp_num: qp.0, status, kind, byte_len: 0 });
        Ok(matches!(wr, WorkRequest::Bind { .. }).then_some(0x1234_5601))
    });
    m.expect_poll().returning(move |max| {
        if let Some(next) = script.lock().unwrap().pop_front() {
            return next;
        }
        let mut q = done.lock().unwrap();
        let n = q.len().min(max);
        Ok(q.drain(..n).collect())
    });
    Arc::new(m)
}

fn adapter(name: &str, engine: Arc<MockEngine>, policy: ReleasePolicy) -> (VerbsTransfer, SlotPool) {
    let mut cfg = VerbsConfig::new(name, "mock", 1);
    cfg.release_policy = policy;
    cfg.timeout = Duration::from_secs(2);
    let t = VerbsTransfer::with_engine(cfg, engine).expect("adapter");
    let pool =
        t.register_pool(Arc::new(HostRegion::new(4 * 4096).expect("region")), PoolConfig::new(4096)).expect("pool");
    (t, pool)
}

/// A decode and a prefill adapter on their mocks, connected: the decode
/// side's id for the prefill side.
fn connected(decode: &VerbsTransfer, prefill: &VerbsTransfer) -> kv_transfer_core::PeerId {
    prefill.add_peer(decode.descriptor()).expect("peer");
    decode.add_peer(prefill.descriptor()).expect("the same connection")
}

/// A one-slot WRITE from `prefill` into `remote`, awaited (bounded).
fn write_one(
    prefill: &VerbsTransfer,
    ppool: &SlotPool,
    remote: &kv_transfer_core::RemoteSlots,
) -> kv_transfer_core::TransferOutcome {
    let src = ppool.reserve(1).expect("reserve");
    let mut h = block_on(prefill.write(src, remote, TransferOptions::notify(false))).expect("post");
    poll_until(std::pin::Pin::new(&mut h), WAIT).expect("terminal").expect("outcome")
}

fn whole(pool: &SlotPool) -> bool {
    let m = pool.metrics();
    m.quarantined == 0 && m.free == m.capacity
}

/// A WRITE the NIC refuses to post fails the operation with a transport
/// error, and the local lease comes back whole (nothing reached the NIC).
#[test]
fn a_write_the_nic_refuses_to_post_fails_with_a_typed_error_and_the_lease_comes_back() {
    fn refuse_writes(wr: &WorkRequest) -> Result<WcStatus, VerbsError> {
        match wr {
            WorkRequest::Write { .. } => Err(VerbsError::invalid("post WRITE", "send queue full")),
            _ => Ok(WcStatus::Success),
        }
    }
    let (decode, dpool) = adapter("decode", mock(0x101, all_succeed, vec![]), ReleasePolicy::Naive);
    let (prefill, ppool) = adapter("prefill", mock(0x102, refuse_writes, vec![]), ReleasePolicy::Safe);
    let peer = connected(&decode, &prefill);
    let (exposed, remote) = decode.expose(dpool.reserve(1).expect("reserve"), peer).expect("expose");
    let out = write_one(&prefill, &ppool, &remote);
    assert!(
        matches!(out.result, Err(TransferError::Transport(ref m)) if m.contains("send queue full")),
        "{:?}",
        out.result
    );
    out.lease.release();
    assert!(whole(&ppool), "{:?}", ppool.metrics());
    exposed.abort();
}

/// A window bind the NIC fails (`MW_BIND_ERR`) refuses the exposure: the
/// lease comes back unexposed, typed, and the pool is whole.
#[test]
fn a_window_bind_the_nic_fails_refuses_the_exposure_and_hands_the_lease_back() {
    fn fail_binds(wr: &WorkRequest) -> Result<WcStatus, VerbsError> {
        Ok(match wr {
            WorkRequest::Bind { .. } => WcStatus::MemoryManagement(6),
            _ => WcStatus::Success,
        })
    }
    let (decode, dpool) = adapter("decode", mock(0x201, fail_binds, vec![]), ReleasePolicy::Safe);
    let (prefill, _ppool) = adapter("prefill", mock(0x202, all_succeed, vec![]), ReleasePolicy::Safe);
    let peer = connected(&decode, &prefill);
    let e = decode.expose(dpool.reserve(2).expect("reserve"), peer).expect_err("the bind failed");
    assert!(matches!(e.kind, kv_transfer_core::ExposeErrorKind::Engine(_)), "{:?}", e.kind);
    e.lease.release();
    assert!(whole(&dpool), "{:?}", dpool.metrics());
}

/// Completions of requests nobody posted, and polls that fail, are logged
/// and dropped: the driver goes on and the next operation completes.
#[test]
fn completions_of_unknown_requests_and_failing_polls_leave_the_driver_running() {
    let junk =
        Completion { wr_id: 0xdead_beef, qp_num: 0x999, status: WcStatus::Success, kind: WcKind::Write, byte_len: 0 };
    let script = vec![
        Err(VerbsError::invalid("ibv_poll_cq", "injected")),
        Ok(vec![junk]),
        Err(VerbsError::invalid("ibv_poll_cq", "injected")),
    ];
    let (decode, dpool) = adapter("decode", mock(0x301, all_succeed, vec![]), ReleasePolicy::Naive);
    let (prefill, ppool) = adapter("prefill", mock(0x302, all_succeed, script), ReleasePolicy::Safe);
    let peer = connected(&decode, &prefill);
    let (exposed, remote) = decode.expose(dpool.reserve(1).expect("reserve"), peer).expect("expose");
    let out = write_one(&prefill, &ppool, &remote);
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    assert!(whole(&ppool));
    exposed.abort();
}
