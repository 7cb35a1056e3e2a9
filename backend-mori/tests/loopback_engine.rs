//! The engine over the loopback transport: bytes, statuses, notifications,
//! refusals and wrap-around. Every wait is bounded.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use backend_mori::loopback::{LoopbackFabric, LoopbackTransport};
use backend_mori::{
    wait_all, BatchRequest, EngineConfig, EngineDesc, EngineError, EngineKey, HostBuffer, InboundStatus, IoEngine,
    MemoryDesc, MemoryLocation, MemoryRegion, MoriEngine, Segment, StatusCode, Tag,
};

const LONG: Duration = Duration::from_secs(10);

struct Pair {
    a: MoriEngine,
    b: MoriEngine,
    ta: Arc<LoopbackTransport>,
}

fn pair_with(config: EngineConfig) -> Pair {
    let fabric = LoopbackFabric::new();
    let ta = fabric.transport();
    let tb = fabric.transport();
    let a = MoriEngine::new("prefill", config.clone(), ta.clone()).expect("engine a");
    let b = MoriEngine::new("decode", config, tb).expect("engine b");
    a.register_remote_engine(&b.engine_desc()).expect("a knows b");
    b.register_remote_engine(&a.engine_desc()).expect("b knows a");
    Pair { a, b, ta }
}

fn pair() -> Pair {
    pair_with(EngineConfig::default())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn reg(engine: &MoriEngine, buf: &HostBuffer) -> MemoryDesc {
    engine.register_memory(MemoryRegion::host(buf.clone())).expect("register")
}

/// Pops an inbound status, retrying for at most `LONG`.
fn pop_within(engine: &MoriEngine, from: &EngineKey, uid: u64) -> Option<InboundStatus> {
    let deadline = Instant::now() + LONG;
    for _ in 0..10_000 {
        if let Some(s) = engine.pop_inbound_status(from, uid) {
            return Some(s);
        }
        if Instant::now() > deadline {
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
fn write_moves_bytes_and_notifies_target() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(4096, 1));
    let dst = HostBuffer::zeroed(8192);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 1024, &d, 4096, 2048, uid, Tag::new(5, 9));
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    assert!(status.is_terminal() && status.succeeded());
    let got = dst.to_vec();
    assert_eq!(&got[4096..6144], &pattern(4096, 1)[1024..3072]);
    assert!(got[..4096].iter().all(|&b| b == 0));
    assert!(got[6144..].iter().all(|&b| b == 0));

    let inbound = pop_within(&p.b, &p.a.key(), uid).expect("target learns of the write");
    assert_eq!(inbound.code, StatusCode::Success);
    assert_eq!(inbound.tag, Tag::new(5, 9));
    assert_eq!(inbound.uid, uid);
    assert_eq!(inbound.remote, p.a.key());
    assert_eq!(p.b.pop_inbound_status(&p.a.key(), uid), None, "popped once");
}

#[test]
fn read_moves_bytes() {
    let p = pair();
    let local = HostBuffer::zeroed(1000);
    let remote = HostBuffer::from_vec(pattern(1000, 7));
    let l = reg(&p.a, &local);
    let r = reg(&p.b, &remote);
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.read(&l, 10, &r, 500, 300, uid, Tag::new(1, 1));
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    assert_eq!(&local.to_vec()[10..310], &pattern(1000, 7)[500..800]);
    assert_eq!(pop_within(&p.b, &p.a.key(), uid).map(|s| s.code), Some(StatusCode::Success));
}

#[test]
fn batch_write_and_read() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(4096, 3));
    let dst1 = HostBuffer::zeroed(4096);
    let dst2 = HostBuffer::zeroed(4096);
    let s = reg(&p.a, &src);
    let d1 = reg(&p.b, &dst1);
    let d2 = reg(&p.b, &dst2);
    let requests: Vec<BatchRequest> = [(&d1, 1u64), (&d2, 2u64)]
        .into_iter()
        .map(|(d, slot)| BatchRequest {
            local: s.clone(),
            remote: d.clone(),
            segments: vec![Segment::new(0, 0, 512), Segment::new(1024, 2048, 512), Segment::new(3000, 3584, 512)],
            uid: p.a.allocate_transfer_unique_id(),
            tag: Tag::new(slot, 4),
        })
        .collect();
    let statuses = p.a.batch_write(&requests);
    assert_eq!(statuses.len(), 2);
    assert_eq!(wait_all(&statuses, LONG), StatusCode::Success);
    let want = pattern(4096, 3);
    for dst in [&dst1, &dst2] {
        let got = dst.to_vec();
        assert_eq!(&got[0..512], &want[0..512]);
        assert_eq!(&got[2048..2560], &want[1024..1536]);
        assert_eq!(&got[3584..4096], &want[3000..3512]);
        assert!(got[512..2048].iter().all(|&b| b == 0));
    }
    for req in &requests {
        let inbound = pop_within(&p.b, &p.a.key(), req.uid).expect("notified");
        assert_eq!((inbound.code, inbound.tag), (StatusCode::Success, req.tag));
    }

    // Read both back into a fresh local buffer, one request per remote region.
    let back = HostBuffer::zeroed(1024);
    let bk = reg(&p.a, &back);
    let reads = vec![
        BatchRequest {
            local: bk.clone(),
            remote: d1.clone(),
            segments: vec![Segment::new(0, 0, 512)],
            uid: p.a.allocate_transfer_unique_id(),
            tag: Tag::default(),
        },
        BatchRequest {
            local: bk,
            remote: d2,
            segments: vec![Segment::new(512, 2048, 512)],
            uid: p.a.allocate_transfer_unique_id(),
            tag: Tag::default(),
        },
    ];
    assert_eq!(wait_all(&p.a.batch_read(&reads), LONG), StatusCode::Success);
    let got = back.to_vec();
    assert_eq!(&got[..512], &want[..512]);
    assert_eq!(&got[512..], &want[1024..1536]);
}

#[test]
fn session_calls() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(2048, 11));
    let dst = HostBuffer::zeroed(2048);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let session = p.a.create_session(&s, &d).expect("session");
    assert!(session.alive());
    assert_eq!(session.local(), s);
    assert_eq!(session.remote(), d);

    let uid = session.allocate_transfer_unique_id();
    assert_eq!(session.write(0, 0, 256, uid, Tag::new(1, 2)).wait_for(LONG), StatusCode::Success);
    let uid2 = session.allocate_transfer_unique_id();
    assert_ne!(uid, uid2);
    let segs = [Segment::new(256, 1024, 128), Segment::new(512, 1536, 128)];
    assert_eq!(session.batch_write(&segs, uid2, Tag::new(1, 3)).wait_for(LONG), StatusCode::Success);
    let got = dst.to_vec();
    let want = pattern(2048, 11);
    assert_eq!(&got[..256], &want[..256]);
    assert_eq!(&got[1024..1152], &want[256..384]);
    assert_eq!(&got[1536..1664], &want[512..640]);
    assert_eq!(pop_within(&p.b, &p.a.key(), uid2).map(|s| s.tag), Some(Tag::new(1, 3)));

    // Read back through the session into another part of the local buffer.
    src.fill(0);
    let uid3 = session.allocate_transfer_unique_id();
    assert_eq!(session.read(0, 0, 256, uid3, Tag::default()).wait_for(LONG), StatusCode::Success);
    let uid4 = session.allocate_transfer_unique_id();
    let segs = [Segment::new(1000, 1024, 128)];
    assert_eq!(session.batch_read(&segs, uid4, Tag::default()).wait_for(LONG), StatusCode::Success);
    assert_eq!(&src.to_vec()[..256], &want[..256]);
    assert_eq!(&src.to_vec()[1000..1128], &want[256..384]);

    // A bad range is a typed error on the status, as with the engine calls.
    let uid5 = session.allocate_transfer_unique_id();
    assert_eq!(session.write(2000, 0, 100, uid5, Tag::default()).code(), StatusCode::InvalidArgs);

    p.a.deregister_memory(&s).expect("nothing in flight");
    assert!(!session.alive());
    let uid6 = session.allocate_transfer_unique_id();
    assert_eq!(session.write(0, 0, 1, uid6, Tag::default()).code(), StatusCode::NotFound);
}

#[test]
fn wait_for_timeout_returns_in_progress_and_transfer_goes_on() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(512, 5));
    let dst = HostBuffer::zeroed(512);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.hold();
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 512, uid, Tag::new(8, 8));
    assert_eq!(status.wait_for(Duration::from_millis(50)), StatusCode::InProgress);
    assert_eq!(status.wait_for_ms(10), StatusCode::InProgress);
    assert!(!status.is_terminal());
    assert_eq!(p.b.pop_inbound_status(&p.a.key(), uid), None, "nothing before the data");
    assert!(dst.to_vec().iter().all(|&b| b == 0));
    p.ta.release();
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    assert_eq!(dst.to_vec(), pattern(512, 5));
    assert_eq!(pop_within(&p.b, &p.a.key(), uid).map(|s| s.code), Some(StatusCode::Success));
}

#[test]
fn failure_is_notified_to_target() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(1024, 2));
    let dst = HostBuffer::zeroed(1024);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.fail_next_ops(1);
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 1024, uid, Tag::new(42, 7));
    assert_eq!(status.wait_for(LONG), StatusCode::RdmaOp);
    assert!(status.failed());
    assert!(!status.message().is_empty());
    let inbound = pop_within(&p.b, &p.a.key(), uid).expect("target told of the failure");
    assert_eq!(inbound.code, StatusCode::RdmaOp);
    assert_eq!(inbound.tag, Tag::new(42, 7));
    assert!(inbound.code.is_terminal() && inbound.code.is_error());
}

#[test]
fn partial_failure_is_terminal_only_after_every_segment() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(1024, 2));
    let dst = HostBuffer::zeroed(1024);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    // The first segment fails at once; the second is delayed behind it.
    p.ta.fail_next_ops(1);
    p.ta.set_delay(Duration::from_millis(30));
    let uid = p.a.allocate_transfer_unique_id();
    let segs = vec![Segment::new(0, 0, 512), Segment::new(512, 512, 512)];
    let req = BatchRequest { local: s.clone(), remote: d, segments: segs, uid, tag: Tag::new(1, 1) };
    let status = p.a.batch_write(std::slice::from_ref(&req)).remove(0);
    assert_eq!(status.wait_for(LONG), StatusCode::RdmaOp);
    // When it turned terminal, both operations had completed (the second landed).
    assert_eq!(p.ta.ops_completed(), 2);
    assert_eq!(&dst.to_vec()[512..], &pattern(1024, 2)[512..]);
    p.a.deregister_memory(&s).expect("terminal: memory is free");
}

#[test]
fn refused_post_mid_transfer_fails_after_posted_ops_complete() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(1024, 9));
    let dst = HostBuffer::zeroed(1024);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.refuse_next_posts(1);
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 1024, uid, Tag::new(2, 2));
    assert!(status.wait_for(LONG).is_error());
    let inbound = pop_within(&p.b, &p.a.key(), uid).expect("notified");
    assert!(inbound.code.is_error());
    assert_eq!(p.a.pending_transfers(), 0);
}

#[test]
fn lost_notification_means_target_never_learns() {
    // MORI at its worst: nothing arrives. The target must not invent a status.
    let p = pair();
    let src = HostBuffer::from_vec(pattern(64, 1));
    let dst = HostBuffer::zeroed(64);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.set_drop_notifications(true);
    p.ta.fail_next_ops(1);
    let uid = p.a.allocate_transfer_unique_id();
    assert_eq!(p.a.write(&s, 0, &d, 0, 64, uid, Tag::default()).wait_for(LONG), StatusCode::RdmaOp);
    let deadline = Instant::now() + LONG;
    for _ in 0..10_000 {
        if p.ta.notifications_dropped() > 0 || Instant::now() > deadline {
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(p.ta.notifications_dropped(), 1);
    assert_eq!(p.b.pop_inbound_status(&p.a.key(), uid), None);
    assert_eq!(p.b.wait_inbound_status(&p.a.key(), uid, Duration::from_millis(20)), None);
}

#[test]
fn deregister_refused_while_in_flight() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(256, 4));
    let dst = HostBuffer::zeroed(256);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.hold();
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 256, uid, Tag::default());
    assert_eq!(status.code(), StatusCode::InProgress);
    match p.a.deregister_memory(&s) {
        Err(e @ EngineError::MemoryBusy { in_flight: 1, .. }) => assert_eq!(e.code(), StatusCode::BadState),
        other => panic!("expected MemoryBusy, got {other:?}"),
    }
    // The target's region is busy too: the loopback NIC still holds it.
    assert!(matches!(p.b.deregister_memory(&d), Err(EngineError::MemoryBusy { .. })));
    assert!(matches!(p.a.deregister_remote_engine(&p.b.key()), Err(EngineError::PeerBusy { in_flight: 1, .. })));
    p.ta.release();
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    p.a.deregister_memory(&s).expect("terminal: deregistered");
    p.b.deregister_memory(&d).expect("no operation left");
    assert!(matches!(p.a.deregister_memory(&s), Err(EngineError::NotFound(_))));
    p.a.deregister_remote_engine(&p.b.key()).expect("nothing pending");
}

#[test]
fn uid_and_notification_index_wrap_around() {
    let config = EngineConfig { uid_start: u64::MAX - 3, notif_seq_start: u32::MAX - 3, ..EngineConfig::default() };
    let p = pair_with(config);
    let src = HostBuffer::from_vec(pattern(64, 6));
    let dst = HostBuffer::zeroed(64 * 10);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let mut uids = Vec::new();
    for i in 0..10u64 {
        let uid = p.a.allocate_transfer_unique_id();
        uids.push(uid);
        let status = p.a.write(&s, 0, &d, i * 64, 64, uid, Tag::new(i, 1));
        assert_eq!(status.wait_for(LONG), StatusCode::Success);
    }
    assert_eq!(uids[..5], [u64::MAX - 3, u64::MAX - 2, u64::MAX - 1, u64::MAX, 0]);
    let mut seqs = Vec::new();
    for (i, uid) in uids.iter().enumerate() {
        let inbound = pop_within(&p.b, &p.a.key(), *uid).expect("every notification arrives across the wrap");
        assert_eq!(inbound.tag, Tag::new(i as u64, 1));
        seqs.push(inbound.seq);
    }
    assert_eq!(seqs[..5], [u32::MAX - 3, u32::MAX - 2, u32::MAX - 1, u32::MAX, 0]);
    let stats = p.b.stats();
    assert_eq!(stats.notifications_received, 10);
    assert_eq!(stats.notifications_duplicate, 0);
    assert_eq!(stats.notifications_skipped, 0);
}

#[test]
fn invalid_args_are_typed() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(128, 1));
    let dst = HostBuffer::zeroed(128);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let t = Tag::new(9, 9);
    let uid = || p.a.allocate_transfer_unique_id();

    assert_eq!(p.a.write(&s, 0, &d, 0, 0, uid(), t).code(), StatusCode::InvalidArgs, "size 0");
    assert_eq!(p.a.write(&s, 100, &d, 0, 29, uid(), t).code(), StatusCode::InvalidArgs, "local overrun");
    assert_eq!(p.a.write(&s, 0, &d, 120, 9, uid(), t).code(), StatusCode::InvalidArgs, "remote overrun");
    assert_eq!(p.a.write(&s, u64::MAX, &d, 0, 2, uid(), t).code(), StatusCode::InvalidArgs, "offset overflow");
    assert_eq!(p.a.write(&d, 0, &d, 0, 8, uid(), t).code(), StatusCode::InvalidArgs, "local desc of another engine");
    let empty = BatchRequest { local: s.clone(), remote: d.clone(), segments: vec![], uid: uid(), tag: t };
    assert_eq!(p.a.batch_write(&[empty])[0].code(), StatusCode::InvalidArgs, "no segments");

    let mut stale = s.clone();
    stale.rkey ^= 1;
    assert_eq!(p.a.write(&stale, 0, &d, 0, 8, uid(), t).code(), StatusCode::NotFound, "stale local desc");
    let mut stranger = d.clone();
    stranger.engine_key = EngineKey::new("nobody");
    let u = uid();
    let status = p.a.write(&s, 0, &stranger, 0, 8, u, t);
    assert_eq!(status.code(), StatusCode::NotFound, "unknown remote engine");
    assert!(status.is_terminal());

    // A pending uid towards the same peer is refused.
    p.ta.hold();
    let u = uid();
    let first = p.a.write(&s, 0, &d, 0, 8, u, t);
    assert_eq!(p.a.write(&s, 8, &d, 8, 8, u, t).code(), StatusCode::BadState, "uid pending");
    p.ta.release();
    assert_eq!(first.wait_for(LONG), StatusCode::Success);

    // A rejected transfer with a known peer is notified to it as a failure.
    let u = uid();
    assert_eq!(p.a.write(&s, 0, &d, 0, 0, u, t).code(), StatusCode::InvalidArgs);
    let inbound = pop_within(&p.b, &p.a.key(), u).expect("rejection notified");
    assert_eq!((inbound.code, inbound.tag), (StatusCode::InvalidArgs, t));

    // Registration errors.
    assert!(matches!(p.a.register_memory(MemoryRegion::host(HostBuffer::zeroed(0))), Err(EngineError::InvalidArgs(_))));
    // SAFETY: the loopback never dereferences external memory; it refuses it.
    let gpu = unsafe { MemoryRegion::external(0x1000, 4096, MemoryLocation::Gpu, 0) };
    let err = p.a.register_memory(gpu).expect_err("loopback has no GPU path");
    assert_eq!(err.code(), StatusCode::GpuOp);
    assert!(matches!(p.a.create_session(&s, &stranger), Err(EngineError::NotFound(_))));
    assert!(matches!(p.a.create_session(&d, &s), Err(EngineError::InvalidArgs(_))));
    assert_eq!(p.a.stats().transfers_pending, 0);
}

#[test]
fn unknown_status_code_is_an_error() {
    for raw in [3u32, 10, 16, 99, u32::MAX] {
        let code = StatusCode::from_raw(raw);
        assert!(code.is_error(), "{raw}");
        assert!(!code.is_success(), "{raw}");
        assert!(!code.is_terminal(), "{raw} proves nothing");
    }
}

#[test]
fn descriptors_serialize() {
    let p = pair();
    let desc = p.a.engine_desc();
    let json = serde_json::to_string(&desc).expect("ser");
    let back: EngineDesc = serde_json::from_str(&json).expect("de");
    assert_eq!(back, desc);
    let m = reg(&p.a, &HostBuffer::zeroed(16));
    let back: MemoryDesc = serde_json::from_str(&serde_json::to_string(&m).expect("ser")).expect("de");
    assert_eq!(back, m);
    assert_eq!(m.loc, MemoryLocation::Cpu);
    assert_eq!(m.size, 16);
    // Registering the same descriptor twice is idempotent.
    p.a.register_remote_engine(&p.b.engine_desc()).expect("idempotent");
}

#[test]
fn three_engines_and_concurrent_writers() {
    let fabric = LoopbackFabric::new();
    let target = MoriEngine::new("decode", EngineConfig::default(), fabric.transport()).expect("target");
    let dst = HostBuffer::zeroed(4 * 1024);
    let d = reg(&target, &dst);
    let handles: Vec<_> = (0..2u8)
        .map(|w| {
            let engine = MoriEngine::new(format!("prefill-{w}"), EngineConfig::default(), fabric.transport())
                .expect("initiator");
            target.register_remote_engine(&engine.engine_desc()).expect("target knows it");
            engine.register_remote_engine(&target.engine_desc()).expect("knows target");
            let d = d.clone();
            thread::spawn(move || {
                let src = HostBuffer::from_vec(pattern(1024, w));
                let s = engine.register_memory(MemoryRegion::host(src)).expect("register");
                let mut uids = Vec::new();
                for i in 0..2u64 {
                    let uid = engine.allocate_transfer_unique_id();
                    let off = (u64::from(w) * 2 + i) * 1024;
                    assert_eq!(
                        engine.write(&s, 0, &d, off, 1024, uid, Tag::new(off, 0)).wait_for(LONG),
                        StatusCode::Success
                    );
                    uids.push(uid);
                }
                (engine, uids)
            })
        })
        .collect();
    for h in handles {
        let (engine, uids) = h.join().expect("writer");
        for uid in uids {
            assert_eq!(pop_within(&target, &engine.key(), uid).map(|s| s.code), Some(StatusCode::Success));
        }
    }
    let got = dst.to_vec();
    for w in 0..2u8 {
        for i in 0..2usize {
            let off = (usize::from(w) * 2 + i) * 1024;
            assert_eq!(&got[off..off + 1024], &pattern(1024, w)[..]);
        }
    }
}

#[test]
fn initiator_fence_flushes_pending_transfer() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(256, 4));
    let dst = HostBuffer::zeroed(256);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.hold();
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 256, uid, Tag::new(1, 1));
    p.a.fence_remote_engine(&p.b.key()).expect("loopback can fence");
    let uid2 = p.a.allocate_transfer_unique_id();
    assert_eq!(p.a.write(&s, 0, &d, 0, 256, uid2, Tag::default()).code(), StatusCode::BadState, "fenced peer");
    p.ta.release();
    assert_eq!(status.wait_for(LONG), StatusCode::RdmaOp, "flushed, not success");
    assert!(dst.to_vec().iter().all(|&b| b == 0), "no byte landed after the fence");
    p.a.deregister_memory(&s).expect("terminal after flush");

    // Registering the peer again reconnects.
    p.a.register_remote_engine(&p.b.engine_desc()).expect("reconnect");
    p.b.register_remote_engine(&p.a.engine_desc()).expect("reconnect");
    let s = reg(&p.a, &src);
    let uid3 = p.a.allocate_transfer_unique_id();
    assert_eq!(p.a.write(&s, 0, &d, 0, 256, uid3, Tag::new(2, 2)).wait_for(LONG), StatusCode::Success);
    assert_eq!(dst.to_vec(), pattern(256, 4));
    assert_eq!(pop_within(&p.b, &p.a.key(), uid3).map(|i| i.tag), Some(Tag::new(2, 2)));
}

#[test]
fn target_fence_stops_inbound_writes() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(256, 8));
    let dst = HostBuffer::zeroed(256);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    p.ta.hold();
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 256, uid, Tag::new(1, 1));
    // The target fences the initiator: from now on nothing of it can land.
    p.b.fence_remote_engine(&p.a.key()).expect("loopback can fence");
    p.ta.release();
    assert_eq!(status.wait_for(LONG), StatusCode::RdmaOp);
    assert!(dst.to_vec().iter().all(|&b| b == 0));
}

/// A panic in a user hook (here the target's inbound hook) is caught on the
/// thread that ran it: counted, the peer it was about is fenced (its next
/// WRITE cannot land), and the engine goes on instead of losing its
/// progress thread (a status listener's panic is caught the same way).
#[test]
fn hostile_a_panicking_hook_fences_its_peer_and_the_engine_goes_on() {
    let p = pair();
    p.b.set_inbound_hook(Some(Arc::new(|_| panic!("a user hook panics"))));
    let src = HostBuffer::from_vec(pattern(64, 1));
    let dst = HostBuffer::zeroed(64);
    let (s, d) = (reg(&p.a, &src), reg(&p.b, &dst));
    let status = p.a.write(&s, 0, &d, 0, 64, p.a.allocate_transfer_unique_id(), Tag::new(1, 1));
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    let deadline = Instant::now() + LONG;
    while p.b.stats().hook_panics == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.b.stats().hook_panics, 1, "the panic was not caught and counted");
    p.b.set_inbound_hook(None);
    // The fence runs on a thread of its own: bounded wait until the peer's
    // writes are refused.
    let before = p.b.stats().notifications_received;
    let fenced = (0..500).any(|_| {
        let w = p.a.write(&s, 0, &d, 0, 64, p.a.allocate_transfer_unique_id(), Tag::new(2, 2));
        let code = w.wait_for(LONG);
        code != StatusCode::Success || {
            std::thread::sleep(Duration::from_millis(2));
            false
        }
    });
    assert!(fenced, "the peer whose status a panicking hook got was not fenced");
    assert!(p.b.stats().notifications_received >= before);
    // A panicking status listener: caught, the next listener still runs.
    let panics = backend_mori::listener_panics();
    let (st, up) = backend_mori::TransferStatus::pending(9, Tag::default());
    let (tx, rx) = std::sync::mpsc::channel();
    st.on_complete(|_| panic!("a listener panics"));
    st.on_complete(move |c| tx.send(c).unwrap());
    up.set(StatusCode::Success, "");
    assert_eq!(rx.recv_timeout(LONG), Ok(StatusCode::Success));
    assert_eq!(backend_mori::listener_panics(), panics + 1);
}

#[test]
fn target_waits_for_inbound_and_hook_fires() {
    let p = pair();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    // The hook sees the status first and hands it back: it is filed too.
    p.b.set_inbound_hook(Some(Arc::new(move |st: backend_mori::InboundStatus| {
        let _ = tx.lock().map(|tx| tx.send((st.remote.clone(), st.uid, st.tag)));
        Some(st)
    })));
    let src = HostBuffer::from_vec(pattern(128, 3));
    let dst = HostBuffer::zeroed(128);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let uid = p.a.allocate_transfer_unique_id();
    assert_eq!(p.b.wait_inbound_status(&p.a.key(), uid, Duration::from_millis(20)), None, "nothing yet");
    p.ta.set_delay(Duration::from_millis(20));
    let status = p.a.write(&s, 0, &d, 0, 128, uid, Tag::new(4, 5));
    let inbound = p.b.wait_inbound_status(&p.a.key(), uid, LONG).expect("arrives");
    assert_eq!((inbound.code, inbound.tag), (StatusCode::Success, Tag::new(4, 5)));
    assert_eq!(dst.to_vec(), pattern(128, 3), "data landed before the notification");
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    assert_eq!(rx.recv_timeout(LONG).expect("hook"), (p.a.key(), uid, Tag::new(4, 5)));
    // A hook that takes the status: nothing is filed.
    p.b.set_inbound_hook(Some(Arc::new(|_| None)));
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 128, uid, Tag::new(6, 7));
    assert_eq!(status.wait_for(LONG), StatusCode::Success);
    assert_eq!(p.b.wait_inbound_status(&p.a.key(), uid, Duration::from_millis(100)), None, "taken by the hook");
    let deadline = std::time::Instant::now() + LONG;
    while p.b.stats().notifications_received < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.b.stats().notifications_received, 2);
    assert_eq!(p.b.inbound_len(), 0, "nothing filed");
    p.b.set_inbound_hook(None);

    // External host memory: the loopback cannot reach it; a typed error, not GPU_OP.
    // SAFETY: never dereferenced; the loopback refuses external regions.
    let ext = unsafe { MemoryRegion::external(0x2000, 64, MemoryLocation::Cpu, -1) };
    assert_eq!(p.a.register_memory(ext).expect_err("refused").code(), StatusCode::InvalidArgs);
}

#[test]
fn wait_all_failure_wins_only_after_all_terminal() {
    let (failed, f) = backend_mori::TransferStatus::pending(1, Tag::default());
    let (pending, u) = backend_mori::TransferStatus::pending(2, Tag::default());
    f.set(StatusCode::RdmaOp, "x");
    u.set(StatusCode::InProgress, "");
    let both = [failed, pending];
    assert_eq!(wait_all(&both, Duration::from_millis(20)), StatusCode::InProgress);
    u.set(StatusCode::Success, "");
    assert_eq!(wait_all(&both, LONG), StatusCode::RdmaOp);
    assert_eq!(wait_all(&[], LONG), StatusCode::Success);
}

#[test]
fn dropping_the_engine_does_not_abandon_pending_transfers() {
    let p = pair();
    let src = HostBuffer::from_vec(pattern(256, 1));
    let dst = HostBuffer::zeroed(256);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let session = p.a.create_session(&s, &d).expect("session");
    p.ta.hold();
    let uid = p.a.allocate_transfer_unique_id();
    let status = p.a.write(&s, 0, &d, 0, 256, uid, Tag::new(6, 6));
    let a_key = p.a.key();
    drop(p.a);
    assert!(!session.alive());
    assert_eq!(session.write(0, 0, 8, uid.wrapping_add(1), Tag::default()).code(), StatusCode::BadState);
    assert_eq!(status.wait_for(Duration::from_millis(20)), StatusCode::InProgress);
    p.ta.release();
    assert_eq!(status.wait_for(LONG), StatusCode::Success, "the progress thread drains before it exits");
    assert_eq!(dst.to_vec(), pattern(256, 1));
    assert_eq!(pop_within(&p.b, &a_key, uid).map(|i| i.tag), Some(Tag::new(6, 6)));
}

#[test]
fn many_concurrent_transfers_all_complete_and_notify() {
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 50;
    const SLOT: u64 = 64;
    let p = Arc::new(pair());
    p.ta.set_delay(Duration::from_micros(200));
    let src = HostBuffer::from_vec(pattern((THREADS * PER_THREAD * SLOT) as usize, 13));
    let dst = HostBuffer::zeroed((THREADS * PER_THREAD * SLOT) as usize);
    let s = reg(&p.a, &src);
    let d = reg(&p.b, &dst);
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (p, s, d) = (Arc::clone(&p), s.clone(), d.clone());
            thread::spawn(move || {
                let mut out = Vec::new();
                for i in 0..PER_THREAD {
                    let slot = t * PER_THREAD + i;
                    let uid = p.a.allocate_transfer_unique_id();
                    let off = slot * SLOT;
                    out.push((uid, slot, p.a.write(&s, off, &d, off, SLOT, uid, Tag::new(slot, 1))));
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.join().expect("worker"));
    }
    let statuses: Vec<_> = all.iter().map(|(_, _, st)| st.clone()).collect();
    assert_eq!(wait_all(&statuses, LONG), StatusCode::Success);
    assert_eq!(dst.to_vec(), src.to_vec());
    for (uid, slot, _) in &all {
        let inbound = p.b.wait_inbound_status(&p.a.key(), *uid, LONG).expect("notified");
        assert_eq!(inbound.tag, Tag::new(*slot, 1));
    }
    assert_eq!(p.b.inbound_len(), 0);
    assert_eq!(p.a.stats().transfers_succeeded, THREADS * PER_THREAD);
    assert_eq!(p.b.stats().notifications_duplicate, 0);
}
