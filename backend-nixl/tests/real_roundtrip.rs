//! Two agents in one process over UCX on host memory, through `NixlEngine`:
//! metadata exchange, 1 MiB WRITE and READ, notification with the exact message,
//! and the engine's guards.

mod common;

use std::time::Duration;

use backend_nixl::engine::{
    create_and_post, AgentConfig, EngineConfig, EngineError, HostBuffer, NixlEngine, RealNixlEngine, XferOp, XferSpec,
    XferState,
};

const MIB: usize = 1 << 20;

/// UCX over TCP needs the target's worker to make progress; the target runs
/// NIXL's progress thread (as a decode worker would).
fn cfg(prefix: &str) -> EngineConfig {
    let mut c = EngineConfig::ucx(common::unique(prefix));
    c.agent = AgentConfig { progress_thread: true, ..AgentConfig::default() };
    c
}

fn poll_done(e: &RealNixlEngine, id: backend_nixl::ReqId) -> XferState {
    common::bounded(2_000_000, Duration::from_secs(30), || match e.xfer_status(id).expect("transfer failed") {
        XferState::Done => Some(XferState::Done),
        XferState::InProgress => None,
    })
    .unwrap_or(XferState::InProgress)
}

fn wait_notif(e: &RealNixlEngine, from: &str, msg: &[u8]) -> bool {
    common::bounded(200_000, Duration::from_secs(20), || {
        let n = e.get_notifs().expect("get_notifs");
        n.iter().any(|n| n.agent == from && n.msg == msg).then_some(())
    })
    .is_some()
}

#[test]
fn write_read_notify_1mib() {
    let Some(lib) = common::library_or_skip("write_read_notify_1mib") else {
        return;
    };
    // Buffers first: locals drop in reverse order, so the engines go before them.
    let mut src = HostBuffer::new(MIB).unwrap();
    let mut dst = HostBuffer::new(MIB).unwrap();
    let ini = RealNixlEngine::with_library(&lib, cfg("ini")).expect("initiator");
    let tgt = RealNixlEngine::with_library(&lib, cfg("tgt")).expect("target");
    let a = common::pattern(MIB, 7);
    src.write(0, &a).unwrap();
    dst.fill(0xEE);
    // SAFETY: both buffers are declared before the engines, so they outlive them.
    let src_reg = unsafe { ini.register_mem(&[src.region()]) }.expect("register src");
    // SAFETY: as above.
    let dst_reg = unsafe { tgt.register_mem(&[dst.region()]) }.expect("register dst");

    let tgt_md = tgt.local_metadata().expect("target md");
    assert!(!tgt_md.is_empty());
    let tgt_name = ini.load_remote_metadata(&tgt_md).expect("load target md");
    assert_eq!(tgt_name, tgt.agent_name());
    let ini_md = ini.local_metadata().expect("initiator md");
    let ini_name = tgt.load_remote_metadata(&ini_md).expect("load initiator md");
    assert_eq!(ini_name, ini.agent_name());

    // WRITE 1 MiB with a notification.
    let msg = b"kv slot 3 gen 17 written".to_vec();
    let spec = XferSpec {
        op: XferOp::Write,
        local: vec![src.region()],
        remote: vec![dst.region()],
        remote_agent: tgt_name.clone(),
        notif: Some(msg.clone()),
    };
    let (id, _) = create_and_post(&ini, &spec).expect("post write");
    assert_eq!(poll_done(&ini, id), XferState::Done, "write never completed");
    assert!(wait_notif(&tgt, &ini_name, &msg), "notification not received");
    assert_eq!(dst.to_vec(), a, "WRITE bytes differ");
    ini.release_xfer(id).expect("release write");
    assert!(matches!(ini.xfer_status(id), Err(EngineError::UnknownRequest(_))));

    // READ 1 MiB back into the initiator after the target changes its bytes.
    let b = common::pattern(MIB, 99);
    dst.write(0, &b).unwrap();
    src.fill(0);
    let spec = XferSpec { op: XferOp::Read, notif: None, ..spec };
    let (id, _) = create_and_post(&ini, &spec).expect("post read");
    assert_eq!(poll_done(&ini, id), XferState::Done, "read never completed");
    assert_eq!(src.to_vec(), b, "READ bytes differ");
    ini.release_xfer(id).expect("release read");

    // gen_notif in the other direction.
    tgt.gen_notif(&ini_name, b"ack gen 17").expect("gen_notif");
    assert!(wait_notif(&ini, &tgt_name, b"ack gen 17"), "gen_notif lost");

    ini.deregister(src_reg).expect("deregister src");
    tgt.deregister(dst_reg).expect("deregister dst");
    ini.invalidate_remote_metadata(&tgt_name).expect("invalidate");
    drop(ini);
    drop(tgt);
    drop(src);
    drop(dst);
}

#[test]
fn guards_refuse_unsafe_teardown() {
    let Some(lib) = common::library_or_skip("guards_refuse_unsafe_teardown") else {
        return;
    };
    let len = 64 * MIB;
    let mut src = HostBuffer::new(len).unwrap();
    let dst = HostBuffer::new(len).unwrap();
    let pat = common::pattern(len, 3);
    src.write(0, &pat).unwrap();
    let ini = RealNixlEngine::with_library(&lib, cfg("gini")).unwrap();
    let tgt = RealNixlEngine::with_library(&lib, cfg("gtgt")).unwrap();
    // SAFETY: buffers are dropped after the engines.
    let sreg = unsafe { ini.register_mem(&[src.region()]) }.unwrap();
    // SAFETY: as above.
    let _dreg = unsafe { tgt.register_mem(&[dst.region()]) }.unwrap();
    let name = ini.load_remote_metadata(&tgt.local_metadata().unwrap()).unwrap();
    tgt.load_remote_metadata(&ini.local_metadata().unwrap()).unwrap();

    // A mismatched spec is refused before any C call.
    let bad = XferSpec {
        op: XferOp::Write,
        local: vec![src.region()],
        remote: vec![],
        remote_agent: name.clone(),
        notif: None,
    };
    assert!(matches!(ini.create_xfer(&bad), Err(EngineError::InvalidArgument(_))));
    // An unknown peer is a NIXL error, not success.
    let unknown = XferSpec { remote: vec![dst.region()], remote_agent: "nobody".into(), ..bad.clone() };
    let e = ini.create_xfer(&unknown).unwrap_err();
    assert!(e.status().is_some(), "{e:?}");

    let spec = XferSpec { remote: vec![dst.region()], ..bad };
    let (id, st) = create_and_post(&ini, &spec).unwrap();
    if st == XferState::InProgress {
        // Release, deregister and invalidate are refused while the request may run.
        match ini.release_xfer(id) {
            Err(EngineError::StillInProgress(r)) => assert_eq!(r, id),
            // It completed between post and release (release re-polls): then every
            // byte must already be there.
            Ok(()) => {
                assert!(dst.to_vec() == pat, "released before the data landed");
                eprintln!("guards: transfer finished before release; guard not exercised");
                ini.deregister(sreg).unwrap();
                return;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    if ini.live_requests() > 0 {
        assert!(matches!(ini.deregister(sreg), Err(EngineError::Busy { .. })));
        assert!(matches!(ini.invalidate_remote_metadata(&name), Err(EngineError::Busy { .. })));
    }
    assert_eq!(poll_done(&ini, id), XferState::Done);
    assert!(dst.to_vec() == pat, "bytes differ after Done");
    ini.release_xfer(id).unwrap();
    ini.deregister(sreg).unwrap();
    drop(ini);
    drop(tgt);
}
