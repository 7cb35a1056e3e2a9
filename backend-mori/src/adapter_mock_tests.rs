//! The adapter against a mockall engine that behaves as MORI does at its
//! worst: `IN_PROGRESS` forever, no failure notice, unknown codes,
//! wrap-around of transfer ids. Every wait is bounded.

use kv_transfer_core::drain::{ControlKind, ControlMessage};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kv_transfer_core::{
    EscalationLadder, Generation, HostRegion, MetricsSnapshot, PoolConfig, PoolId, RemoteSlot, RemoteSlots, SlotId,
    SlotPool, Transfer, TransferError, TransferHandle, TransferOptions, TransferOutcome,
};

use crate::adapter::MoriTransfer;
use crate::util::lock;
use crate::{
    EngineDesc, EngineError, EngineKey, InboundHook, InboundStatus, MemoryDesc, MemoryLocation, MessageHook,
    MockIoEngine, StatusCode, StatusUpdater, Tag, TransferStatus, TransportError,
};

const SLOT: usize = 1024;
const LONG: Duration = Duration::from_secs(10);

fn peer_desc() -> EngineDesc {
    EngineDesc {
        key: EngineKey::new("peer"),
        hostname: "h".into(),
        host: "127.0.0.1".into(),
        port: 1,
        transport: "mock".into(),
        transport_info: Vec::new(),
        notif_seq_start: 0,
    }
}

#[derive(Default)]
struct Captured {
    inbound: Mutex<Option<InboundHook>>,
    message: Mutex<Option<MessageHook>>,
    sent: Mutex<Vec<Vec<u8>>>,
    fences: AtomicUsize,
}

/// A mock engine with the plumbing every test needs; `f` adds the rest.
fn engine(cap: &Arc<Captured>, uid_start: u64, f: impl FnOnce(&mut MockIoEngine)) -> Arc<MockIoEngine> {
    let mut e = MockIoEngine::new();
    e.expect_key().returning(|| EngineKey::new("me"));
    let c = cap.clone();
    e.expect_set_inbound_hook().returning(move |h| *lock(&c.inbound) = h);
    let c = cap.clone();
    e.expect_set_message_hook().returning(move |h| *lock(&c.message) = h);
    e.expect_set_peer_lost_hook().returning(|_| ());
    e.expect_register_memory().returning(|r| {
        Ok(MemoryDesc {
            engine_key: EngineKey::new("me"),
            id: 0,
            device_id: -1,
            addr: r.addr(),
            size: r.len(),
            loc: MemoryLocation::Cpu,
            rkey: 7,
        })
    });
    e.expect_register_remote_engine().returning(|_| Ok(()));
    let uid = AtomicU64::new(uid_start);
    e.expect_allocate_transfer_unique_id().returning(move || uid.fetch_add(1, Ordering::Relaxed));
    e.expect_grant_access().returning(|_, _, _, _| Ok(None));
    e.expect_withdraw_access().returning(|_, _, _| Ok(()));
    let c = cap.clone();
    e.expect_send_message().returning(move |_, b| {
        lock(&c.sent).push(b);
        Ok(())
    });
    f(&mut e);
    Arc::new(e)
}

fn setup(
    e: Arc<MockIoEngine>,
    slots: usize,
    ladder: EscalationLadder,
) -> (MoriTransfer, SlotPool, kv_transfer_core::PeerId) {
    let t = MoriTransfer::new(e, kv_transfer_core::drain::Capabilities { drain: true, revoke: false, fence: true })
        .expect("adapter");
    let region = Arc::new(HostRegion::new(slots * SLOT).unwrap());
    let pool = t.register_pool(region, PoolConfig::new(SLOT).with_ladder(ladder)).expect("pool");
    let peer = t.add_peer(&peer_desc()).expect("peer");
    (t, pool, peer)
}

/// The kind of a control message the adapter sent (core's codec).
fn kind_of(bytes: &[u8]) -> ControlKind {
    ControlMessage::decode(bytes).expect("a control message").kind
}

/// A descriptor of `n` slots of the peer's memory (id 3, key 5).
fn remote(n: usize) -> RemoteSlots {
    RemoteSlots {
        endpoint: format!("mori:peer/3/4096/{}/-1/cpu", 64 * SLOT),
        pool: PoolId(999),
        key: 5,
        slot_size: SLOT as u64,
        memory: Default::default(),
        token: Default::default(),
        slots: (0..n)
            .map(|i| RemoteSlot {
                slot: SlotId(i as u32),
                generation: Generation(1),
                addr: 4096 + (i * SLOT) as u64,
                key: None,
            })
            .collect(),
    }
}

fn poll_for(h: &mut TransferHandle, timeout: Duration) -> Option<TransferOutcome> {
    kv_transfer_core::poll_until(Pin::new(h), timeout).map(|out| out.expect("not abandoned"))
}

fn wait_metrics(pool: &SlotPool, timeout: Duration, f: impl Fn(&MetricsSnapshot) -> bool) -> MetricsSnapshot {
    let deadline = Instant::now() + timeout;
    loop {
        let m = pool.metrics();
        if f(&m) || Instant::now() >= deadline {
            return m;
        }
        thread::sleep(Duration::from_millis(2));
    }
}

fn slow() -> EscalationLadder {
    EscalationLadder { drain: LONG, revoke: LONG, fence: LONG }
}

fn fast() -> EscalationLadder {
    EscalationLadder {
        drain: Duration::from_millis(40),
        revoke: Duration::from_millis(40),
        fence: Duration::from_millis(80),
    }
}

#[test]
fn in_progress_forever_never_resolves_and_keeps_the_slots() {
    let cap = Arc::new(Captured::default());
    let e = engine(&cap, 0, |e| {
        e.expect_batch_write()
            .returning(|reqs| reqs.iter().map(|r| TransferStatus::in_progress_forever(r.uid, r.tag)).collect());
    });
    let (t, pool, _) = setup(e, 4, slow());
    let mut h =
        futures_lite_block(t.write(pool.reserve(2).unwrap(), &remote(2), TransferOptions::default())).expect("post");
    assert!(poll_for(&mut h, Duration::from_millis(300)).is_none(), "IN_PROGRESS is not terminal");
    let m = pool.metrics();
    assert_eq!((m.leased, m.free), (2, 2));
    drop(h);
    thread::sleep(Duration::from_millis(50));
    let m = pool.metrics();
    assert_eq!((m.leased, m.free, m.quarantined), (2, 2, 0), "the drain table keeps the lease");
    assert_eq!(t.stats().ops_draining, 1);

    // The target asks to abort: no ack while the transfers are IN_PROGRESS.
    let abort = crate::adapter::tests_support::abort_bytes(remote(1).pool, &remote(2).tenancies());
    let hook = lock(&cap.message).clone().expect("message hook");
    hook(EngineKey::new("peer"), abort);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(t.stats().aborts_received, 1);
    assert!(lock(&cap.sent).is_empty(), "no ABORT_ACK before the transfers are terminal");
    // And no new post to those tenancies.
    let err = futures_lite_block(t.write(pool.reserve(2).unwrap(), &remote(2), TransferOptions::default()))
        .expect_err("tombstoned");
    err.lease.release();
}

#[test]
fn late_terminal_statuses_complete_across_uid_wrap_and_ack_the_abort() {
    let cap = Arc::new(Captured::default());
    let updaters: Arc<Mutex<Vec<StatusUpdater>>> = Arc::default();
    let seen_uids: Arc<Mutex<Vec<u64>>> = Arc::default();
    let (u, s) = (updaters.clone(), seen_uids.clone());
    let e = engine(&cap, u64::MAX - 1, move |e| {
        e.expect_batch_write().returning(move |reqs| {
            reqs.iter()
                .map(|r| {
                    lock(&s).push(r.uid);
                    let (st, up) = TransferStatus::pending(r.uid, r.tag);
                    up.set(StatusCode::InProgress, "");
                    lock(&u).push(up);
                    st
                })
                .collect()
        });
    });
    let (t, pool, _) = setup(e, 4, slow());
    let mut h =
        futures_lite_block(t.write(pool.reserve(4).unwrap(), &remote(4), TransferOptions::default())).expect("post");
    assert_eq!(*lock(&seen_uids), vec![u64::MAX - 1, u64::MAX, 0, 1]);
    let hook = lock(&cap.message).clone().expect("message hook");
    hook(EngineKey::new("peer"), crate::adapter::tests_support::abort_bytes(remote(1).pool, &remote(4).tenancies()));
    thread::sleep(Duration::from_millis(50));
    // Complete in reverse order; the handle resolves only after the last.
    let ups: Vec<StatusUpdater> = lock(&updaters).drain(..).collect();
    for (i, up) in ups.iter().enumerate().rev() {
        assert!(poll_for(&mut h, Duration::from_millis(5)).is_none());
        let code = if i == 2 { StatusCode::RdmaOp } else { StatusCode::Success };
        up.set(code, if i == 2 { "boom" } else { "" });
    }
    let out = poll_for(&mut h, LONG).expect("terminal");
    assert!(
        matches!(&out.result, Err(TransferError::Engine { code: 13, .. })),
        "a failure is never success: {:?}",
        out.result
    );
    out.lease.release();
    assert_eq!(pool.metrics().free, 4);
    let deadline = Instant::now() + LONG;
    while lock(&cap.sent).is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(lock(&cap.sent).len(), 1, "ABORT_ACK once every transfer is terminal");
    assert_eq!(kind_of(&lock(&cap.sent)[0]), ControlKind::AbortAck);
}

#[test]
fn unknown_code_fences_the_peer_and_failed_fence_keeps_it_parked() {
    for fence_ok in [true, false] {
        let cap = Arc::new(Captured::default());
        let c = cap.clone();
        let e = engine(&cap, 0, move |e| {
            // A one-slot post takes MORI's single-transfer call.
            e.expect_write()
                .returning(|_, _, _, _, _, uid, tag| TransferStatus::ready(uid, tag, StatusCode::Unknown(99), "?"));
            e.expect_fence_remote_engine().returning(move |_| {
                c.fences.fetch_add(1, Ordering::SeqCst);
                if fence_ok {
                    Ok(())
                } else {
                    Err(EngineError::Transport(TransportError::Unsupported("no fence".into())))
                }
            });
        });
        let (t, pool, _) = setup(e, 2, slow());
        let mut h = futures_lite_block(t.write(pool.reserve(1).unwrap(), &remote(1), TransferOptions::default()))
            .expect("post");
        if fence_ok {
            let out = poll_for(&mut h, LONG).expect("fenced");
            assert!(matches!(out.result, Err(TransferError::Engine { code: 99, .. })), "{:?}", out.result);
            out.lease.release();
            let m = pool.metrics();
            assert_eq!((m.free, m.settled_fenced), (2, 1));
        } else {
            assert!(poll_for(&mut h, Duration::from_millis(300)).is_none(), "unknown proves nothing");
            assert_eq!(pool.metrics().leased, 1);
        }
        assert_eq!(cap.fences.load(Ordering::SeqCst), 1);
        assert_eq!(t.stats().transfers_unknown, 1);
    }
}

#[test]
fn no_failure_notice_goes_up_the_ladder_and_never_frees_on_a_timer() {
    for fence_ok in [true, false] {
        let cap = Arc::new(Captured::default());
        let c = cap.clone();
        let e = engine(&cap, 0, move |e| {
            e.expect_revoke_access()
                .returning(|_, _, _| Err(EngineError::Transport(TransportError::Unsupported("mori".into()))));
            e.expect_fence_remote_engine().returning(move |_| {
                c.fences.fetch_add(1, Ordering::SeqCst);
                if fence_ok {
                    Ok(())
                } else {
                    Err(EngineError::Transport(TransportError::Unsupported("no fence".into())))
                }
            });
        });
        let (t, pool, peer) = setup(e, 4, fast());
        let (exposed, _remote) = t.expose(pool.reserve(2).unwrap(), peer).expect("expose");
        // The initiator failed and said nothing (MORI): nothing settles.
        thread::sleep(Duration::from_millis(100));
        let exposed = exposed.try_settled().expect_err("no notice, no proof");
        exposed.abort();
        if fence_ok {
            let m = wait_metrics(&pool, LONG, |m| m.free == 4);
            assert_eq!((m.free, m.settled_fenced, m.quarantined), (4, 2, 0), "{m:?}");
        } else {
            let m = wait_metrics(&pool, LONG, |m| m.quarantine_stuck == 2);
            assert_eq!(m.quarantine_stuck, 2, "{m:?}");
            thread::sleep(Duration::from_millis(200));
            let m = pool.metrics();
            assert_eq!((m.free, m.quarantined), (2, 2), "the ladder is exhausted and nothing was freed");
        }
        // One ABORT on the ladder; once it is exhausted (the fence failed)
        // core asks again (re-sent ABORTs), and still nothing is freed.
        if !fence_ok {
            let deadline = std::time::Instant::now() + LONG;
            while lock(&cap.sent).len() < 2 && std::time::Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(pool.metrics().free, 2, "asking again freed something");
        }
        let sent = lock(&cap.sent).clone();
        if fence_ok {
            assert_eq!(sent.len(), 1, "one ABORT");
        } else {
            assert!(sent.len() >= 2, "the stuck exposure's ABORT was not re-sent: {} sent", sent.len());
        }
        assert!(sent.iter().all(|m| kind_of(m) == ControlKind::Abort));
        assert_eq!(cap.fences.load(Ordering::SeqCst), 1);
    }
}

#[test]
fn inbound_statuses_settle_only_current_terminal_tenancies() {
    let cap = Arc::new(Captured::default());
    let e = engine(&cap, 0, |_| {});
    let (t, pool, peer) = setup(e, 4, slow());
    let (exposed, remote) = t.expose(pool.reserve(3).unwrap(), peer).expect("expose");
    let ts = remote.tenancies();
    let tag = |slot: u32, gen: u64, settle: bool| Tag::new(if settle { 1 << 63 } else { 0 } | u64::from(slot), gen);
    let status = |uid: u64, code: StatusCode, tag: Tag| InboundStatus {
        remote: EngineKey::new("peer"),
        uid,
        code,
        message: String::new(),
        tag,
        seq: uid as u32,
    };
    let cases = [
        (u64::MAX, StatusCode::Success, tag(ts[0].slot.0, ts[0].generation.0, true)), // settles
        (0, StatusCode::RdmaOp, tag(ts[1].slot.0, ts[1].generation.0, true)),         // failure: terminal, settles
        (1, StatusCode::Unknown(77), tag(ts[2].slot.0, ts[2].generation.0, true)),    // proves nothing
        (2, StatusCode::Success, tag(ts[2].slot.0, ts[2].generation.0 - 1, true)),    // stale generation
        (3, StatusCode::Success, tag(ts[2].slot.0, ts[2].generation.0, false)),       // no settle asked
    ];
    let hook = lock(&cap.inbound).clone().expect("inbound hook");
    for (uid, code, tag) in cases {
        assert!(hook(status(uid, code, tag)).is_none(), "the adapter takes every inbound status");
    }
    let deadline = Instant::now() + LONG;
    let handled =
        |s: crate::AdapterStats| s.inbound_settled + s.inbound_unknown + s.inbound_stale + s.inbound_no_settle;
    while handled(t.stats()) < 5 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    let s = t.stats();
    assert_eq!((s.inbound_settled, s.inbound_unknown, s.inbound_stale, s.inbound_no_settle), (2, 1, 1, 1));
    assert_eq!(s.inbound_failed, 1);
    assert!(!t.settled_by_failure(&pool, ts[0]));
    assert!(t.settled_by_failure(&pool, ts[1]), "settled, but its transfer failed");
    assert!(pool.metrics().stale_rejected >= 1);
    let exposed = exposed.try_settled().expect_err("slot 2 is not proven");
    // The last one settles with its own status.
    let uid = 4;
    let last = tag(ts[2].slot.0, ts[2].generation.0, true);
    assert!(hook(status(uid, StatusCode::Success, last)).is_none());
    let deadline = Instant::now() + LONG;
    let mut exposed = exposed;
    let settled = loop {
        match exposed.try_settled() {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                exposed = e;
                thread::sleep(Duration::from_millis(2));
            }
            Err(_) => panic!("not settled"),
        }
    };
    settled.release();
    assert_eq!(pool.metrics().free, 4);
}

/// Runs an `async` post to completion (posts return at once).
fn futures_lite_block<F: Future>(f: F) -> F::Output {
    kv_transfer_core::block_on(f)
}
