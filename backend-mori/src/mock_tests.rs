//! The engine against mockall transports that behave as MORI does at its
//! worst, and the mock engine the adapter will use.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::transport::MockMoriTransport;
use crate::util::lock;
use crate::{
    EngineConfig, EngineDesc, EngineError, EngineKey, HostBuffer, InboundStatus, IoEngine, MemoryDesc, MemoryLocation,
    MemoryRegion, MockIoEngine, MockIoSession, MoriEngine, Notification, StatusCode, Tag, TransferStatus,
    TransportEvent,
};

const SHORT: Duration = Duration::from_millis(30);

fn peer_desc(key: &str, notif_seq_start: u32) -> EngineDesc {
    EngineDesc {
        key: EngineKey::new(key),
        hostname: "h".to_owned(),
        host: "127.0.0.1".to_owned(),
        port: 1,
        transport: "mock".to_owned(),
        transport_info: Vec::new(),
        notif_seq_start,
    }
}

/// A transport that accepts everything and never completes anything; `poll`
/// serves the scripted event batches once `gate` is open, then nothing.
fn scripted_transport(events: Vec<Vec<TransportEvent>>, gate: Arc<Mutex<bool>>) -> MockMoriTransport {
    let mut t = MockMoriTransport::new();
    t.expect_name().returning(|| "mock".to_owned());
    t.expect_attach().returning(|_| Ok(Vec::new()));
    // Notifications are sent by the engine, after the completion (MORI's way).
    t.expect_carries_notifications().returning(|| false);
    // Events come from `poll` (MORI has no push delivery).
    t.expect_set_event_sink().returning(|_| false);
    t.expect_connect().returning(|_| Ok(()));
    t.expect_disconnect().returning(|_| Ok(()));
    let next_rkey = Mutex::new(0u64);
    t.expect_register_memory().returning(move |_, _| {
        let mut k = lock(&next_rkey);
        *k += 1;
        Ok(*k)
    });
    t.expect_deregister_memory().returning(|_| Ok(()));
    t.expect_post().returning(|_| Ok(()));
    t.expect_notify().returning(|_, _| Ok(()));
    let script = Mutex::new(events.into_iter().collect::<VecDeque<_>>());
    t.expect_poll().returning(move |_, timeout| {
        let next = if *lock(&gate) { lock(&script).pop_front() } else { None };
        next.unwrap_or_else(|| {
            thread::sleep(timeout.min(Duration::from_millis(2)));
            Vec::new()
        })
    });
    t
}

fn open() -> Arc<Mutex<bool>> {
    Arc::new(Mutex::new(true))
}

fn notif(seq: u32, uid: u64, code: u32) -> TransportEvent {
    TransportEvent::Notification {
        from: EngineKey::new("peer"),
        notification: Notification { seq, uid, code, message: String::new(), tag: Tag::new(uid, 1) },
    }
}

fn pop_within(engine: &MoriEngine, uid: u64) -> Option<InboundStatus> {
    let deadline = Instant::now() + Duration::from_secs(10);
    for _ in 0..10_000 {
        if let Some(s) = engine.pop_inbound_status(&EngineKey::new("peer"), uid) {
            return Some(s);
        }
        if Instant::now() > deadline {
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    None
}

/// Waits (at most 10 s) for `f`; the assertions after it say what did not come.
fn wait_until(f: impl FnMut() -> bool) {
    let _ = kv_transfer_testkit::wait::wait_until(Duration::from_secs(10), f);
}

#[test]
fn in_progress_forever_keeps_memory_and_peer_registered() {
    let transport = Arc::new(scripted_transport(Vec::new(), open()));
    let engine = MoriEngine::new("me", EngineConfig::default(), transport).expect("engine");
    engine.register_remote_engine(&peer_desc("peer", 0)).expect("peer");
    let local = engine.register_memory(MemoryRegion::host(HostBuffer::zeroed(64))).expect("local");
    let mut remote = local.clone();
    remote.engine_key = EngineKey::new("peer");
    let uid = engine.allocate_transfer_unique_id();
    let status = engine.write(&local, 0, &remote, 0, 64, uid, Tag::new(1, 1));
    for _ in 0..3 {
        assert_eq!(status.wait_for(SHORT), StatusCode::InProgress);
    }
    assert!(!status.is_terminal());
    assert!(matches!(engine.deregister_memory(&local), Err(EngineError::MemoryBusy { in_flight: 1, .. })));
    assert!(matches!(engine.deregister_remote_engine(&EngineKey::new("peer")), Err(EngineError::PeerBusy { .. })));
    assert_eq!(engine.pending_transfers(), 1);
}

#[test]
fn unknown_inbound_code_is_an_error_not_success() {
    let transport = Arc::new(scripted_transport(vec![vec![notif(0, 5, 77)]], open()));
    let engine = MoriEngine::new("me", EngineConfig::default(), transport).expect("engine");
    let inbound = pop_within(&engine, 5).expect("filed");
    assert_eq!(inbound.code, StatusCode::Unknown(77));
    assert!(inbound.code.is_error());
    assert!(!inbound.code.is_success());
    assert!(!inbound.code.is_terminal());
}

#[test]
fn inbound_window_survives_wrap_and_drops_duplicates() {
    let start = u32::MAX - 3;
    // Reordered and duplicated across the wrap.
    let seqs = [start + 1, start, start + 1, 0, u32::MAX - 1, u32::MAX, 1, 0];
    let events = seqs.iter().map(|&s| vec![notif(s, u64::from(s.wrapping_sub(start)), 0)]).collect();
    // The script starts only once the peer is registered (that sets the window base).
    let gate = Arc::new(Mutex::new(false));
    let transport = Arc::new(scripted_transport(events, Arc::clone(&gate)));
    let engine = MoriEngine::new("me", EngineConfig::default(), transport).expect("engine");
    engine.register_remote_engine(&peer_desc("peer", start)).expect("peer");
    *lock(&gate) = true;

    for uid in 0..6u64 {
        let inbound = pop_within(&engine, uid).expect("every distinct notification is filed");
        assert_eq!(inbound.code, StatusCode::Success);
        assert_eq!(inbound.tag, Tag::new(uid, 1));
    }
    wait_until(|| engine.stats().notifications_duplicate >= 2);
    let stats = engine.stats();
    assert_eq!(stats.notifications_received, 6);
    assert_eq!(stats.notifications_duplicate, 2);
    assert_eq!(engine.pop_inbound_status(&EngineKey::new("peer"), 1), None, "the duplicate was not filed");
}

#[test]
fn stray_completion_is_counted_not_applied() {
    let completion = TransportEvent::Completion(crate::Completion { wr_id: 12345, result: Ok(()) });
    let transport = Arc::new(scripted_transport(vec![vec![completion]], open()));
    let engine = MoriEngine::new("me", EngineConfig::default(), transport).expect("engine");
    wait_until(|| engine.stats().stray_completions > 0);
    assert_eq!(engine.stats().stray_completions, 1);
}

/// What the adapter's tests will do: a mock engine as bad as MORI.
#[test]
fn mock_engine_behaves_as_mori_at_its_worst() {
    let mut engine = MockIoEngine::new();
    let next = Mutex::new(u64::MAX - 1);
    engine.expect_allocate_transfer_unique_id().returning(move || {
        let mut n = lock(&next);
        let uid = *n;
        *n = n.wrapping_add(1);
        uid
    });
    engine.expect_write().returning(|_, _, _, _, _, uid, tag| TransferStatus::in_progress_forever(uid, tag));
    engine.expect_pop_inbound_status().returning(|_, _| None);
    engine.expect_create_session().returning(|_, _| {
        let mut session = MockIoSession::new();
        session.expect_alive().return_const(true);
        session.expect_write().returning(|_, _, _, uid, tag| {
            TransferStatus::ready(uid, tag, StatusCode::from_raw(99), "engine spoke gibberish")
        });
        Ok(Box::new(session))
    });

    let uids: Vec<u64> = (0..3).map(|_| engine.allocate_transfer_unique_id()).collect();
    assert_eq!(uids, [u64::MAX - 1, u64::MAX, 0]);
    let desc = MemoryDesc {
        engine_key: EngineKey::new("me"),
        id: 0,
        device_id: -1,
        addr: 0,
        size: 64,
        loc: MemoryLocation::Cpu,
        rkey: 1,
    };
    let status = engine.write(&desc, 0, &desc, 0, 64, uids[2], Tag::new(3, 4));
    assert_eq!(status.wait_for(SHORT), StatusCode::InProgress);
    assert_eq!(engine.pop_inbound_status(&EngineKey::new("peer"), uids[2]), None);
    let session = engine.create_session(&desc, &desc).expect("session");
    assert!(session.alive());
    let code = session.write(0, 0, 8, 1, Tag::default()).wait_for(SHORT);
    assert!(code.is_error() && !code.is_terminal());
}

#[test]
fn failed_transfer_is_notified_with_code_and_tag() {
    // The transport fails every operation and loses every notification (it
    // returns Ok from notify and delivers nothing), as MORI does with failures.
    let posted = Arc::new(Mutex::new(Vec::new()));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let mut t = MockMoriTransport::new();
    t.expect_name().returning(|| "mock".to_owned());
    t.expect_attach().returning(|_| Ok(Vec::new()));
    // Notifications are sent by the engine, after the completion (MORI's way).
    t.expect_carries_notifications().returning(|| false);
    // Events come from `poll` (MORI has no push delivery).
    t.expect_set_event_sink().returning(|_| false);
    t.expect_connect().returning(|_| Ok(()));
    t.expect_register_memory().returning(|_, _| Ok(1));
    t.expect_deregister_memory().returning(|_| Ok(()));
    let p = Arc::clone(&posted);
    t.expect_post().returning(move |wr| {
        lock(&p).push(wr.wr_id);
        Ok(())
    });
    let s = Arc::clone(&sent);
    t.expect_notify().returning(move |to, n| {
        lock(&s).push((to.clone(), n));
        Ok(())
    });
    let p = Arc::clone(&posted);
    t.expect_poll().returning(move |_, timeout| {
        let ids: Vec<u64> = lock(&p).drain(..).collect();
        if ids.is_empty() {
            thread::sleep(timeout.min(Duration::from_millis(2)));
        }
        ids.into_iter()
            .map(|wr_id| {
                TransportEvent::Completion(crate::Completion {
                    wr_id,
                    result: Err(crate::TransportError::Remote("retry exceeded".to_owned())),
                })
            })
            .collect()
    });
    let engine = MoriEngine::new("me", EngineConfig::default(), Arc::new(t)).expect("engine");
    engine.register_remote_engine(&peer_desc("peer", 0)).expect("peer");
    let local = engine.register_memory(MemoryRegion::host(HostBuffer::zeroed(64))).expect("local");
    let mut remote = local.clone();
    remote.engine_key = EngineKey::new("peer");
    let uid = engine.allocate_transfer_unique_id();
    let segs = [crate::Segment::new(0, 0, 32), crate::Segment::new(32, 32, 32)];
    let req = crate::BatchRequest { local: local.clone(), remote, segments: segs.to_vec(), uid, tag: Tag::new(17, 3) };
    let status = engine.batch_write(&[req]).remove(0);
    assert_eq!(status.wait_for(Duration::from_secs(10)), StatusCode::RdmaOp);
    let sent = lock(&sent).clone();
    assert_eq!(sent.len(), 1, "one notification per transfer, after both operations");
    let (to, n) = &sent[0];
    assert_eq!(to, &EngineKey::new("peer"));
    assert_eq!((n.uid, n.tag, n.status_code()), (uid, Tag::new(17, 3), StatusCode::RdmaOp));
    engine.deregister_memory(&local).expect("terminal: the memory can go");
}
