//! Mooncake over RDMA, ours to ours, on backend-verbs' software NIC: the
//! Connection exchange pairs queue pairs, tasks are cut into 64 KiB slices,
//! and a task is reported only once every slice it posted has completed.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use backend_mooncake::proto::rdma::{ConnectionDesc, QPS_PER_ENDPOINT};
use backend_mooncake::proto::{HandshakeFrame, HandshakeType, MAX_HANDSHAKE_LEN};
use backend_mooncake::rdma::{rdma_engine, Publish, RdmaNics};
use backend_mooncake::{
    EngineConfig, MemoryRegion, MooncakeEngine, TaskError, TaskStatus, TcpOpcode, TransferEngine, TransferRequest,
    TransferStatus,
};
use backend_verbs::FakeFabric;

const WAIT: Duration = Duration::from_secs(10);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn register(e: &dyn TransferEngine, buf: &mut [u8]) {
    // SAFETY: every buffer outlives its engine (declared before it) and is
    // read only after the transfers touching it finished.
    e.register_memory(unsafe { MemoryRegion::new(buf.as_mut_ptr() as u64, buf.len() as u64) }).unwrap();
}

fn engine(fabric: &FakeFabric) -> MooncakeEngine {
    engine_with(fabric, EngineConfig::default())
}

fn engine_with(fabric: &FakeFabric, cfg: EngineConfig) -> MooncakeEngine {
    let nics = RdmaNics { initiator: fabric.nic(), target: fabric.nic() };
    rdma_engine(cfg, nics, "fake0", Publish::Registrations).unwrap().0
}

fn run(e: &dyn TransferEngine, reqs: &[TransferRequest]) -> Vec<TaskStatus> {
    let b = e.allocate_batch_id(reqs.len()).unwrap();
    let r = e.submit_transfer(b, reqs).unwrap();
    let out = r.map(|t| e.wait_transfer(b, t, WAIT).unwrap()).collect();
    e.free_batch_id(b).unwrap();
    out
}

fn req(opcode: TcpOpcode, source: u64, target_id: u64, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode, source, target_id, target_offset, length }
}

#[test]
fn rdma_write_and_read_through_the_connection_exchange_are_byte_exact() {
    const LEN: usize = (1 << 20) + 12_345; // 17 slices, the last one short
    let mut tbuf = vec![0u8; 2 * LEN];
    let mut ibuf = pattern(2 * LEN, 5);
    let fabric = FakeFabric::new(7);
    let target = engine(&fabric);
    let init = engine(&fabric);
    register(&target, &mut tbuf);
    register(&init, &mut ibuf);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let desc = init.segment_info(seg).unwrap().desc;
    assert_eq!(desc.protocol, "rdma");
    assert_eq!(desc.devices.len(), 1);
    assert_eq!(desc.buffers[0].rkey.len(), 1, "one key per device");
    let (ia, ta) = (ibuf.as_ptr() as u64, tbuf.as_ptr() as u64);

    let s = run(&init, &[req(TcpOpcode::Write, ia, seg, ta + 3, LEN as u64)]);
    assert_eq!(s[0].status, TransferStatus::Completed, "{s:?}");
    assert_eq!(s[0].transferred_bytes, LEN as u64);
    let s = run(&init, &[req(TcpOpcode::Read, ia + LEN as u64, seg, ta + 3, LEN as u64)]);
    assert_eq!(s[0].status, TransferStatus::Completed, "{s:?}");
    drop(init);
    drop(target);
    assert!(tbuf[3..3 + LEN] == ibuf[..LEN], "WRITE landed byte for byte");
    assert!(ibuf[LEN..] == ibuf[..LEN], "READ brought the same bytes back");
    // One endpoint: our QPs paired with as many of the target's.
    let paired = fabric.queue_pairs().iter().filter(|(_, _, to)| to.is_some()).count();
    assert_eq!(paired, 2 * QPS_PER_ENDPOINT);
}

/// Rule: a failed slice fails its task only after every slice the task
/// posted has completed (the rest are flushed), so FAILED means the NIC is
/// done with the task's memory; the next task pairs anew.
#[test]
fn rdma_a_refused_key_fails_the_task_after_all_its_slices_completed_and_pairs_anew() {
    const LEN: usize = 1 << 20;
    let mut tbuf = vec![0u8; LEN];
    let mut other = vec![0u8; LEN];
    let mut ibuf = pattern(LEN, 9);
    let fabric = FakeFabric::new(11);
    let target = engine(&fabric);
    let init = engine(&fabric);
    register(&target, &mut tbuf);
    register(&init, &mut ibuf);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let ta = tbuf.as_ptr() as u64;
    // The target unregisters: its key no longer grants anything, but the
    // initiator still holds the old metadata.
    target.unregister_memory(ta).unwrap();
    let s = run(&init, &[req(TcpOpcode::Write, ibuf.as_ptr() as u64, seg, ta, LEN as u64)]);
    assert_eq!(s[0].status, TransferStatus::Failed);
    assert!(matches!(s[0].error, Some(TaskError::RemoteAccess)), "{s:?}");
    let stats = fabric.stats();
    assert!(stats.rejected_access >= 1, "{stats:?}");

    // A new buffer, fresh metadata: a new endpoint carries it.
    register(&target, &mut other);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let s = run(&init, &[req(TcpOpcode::Write, ibuf.as_ptr() as u64, seg, other.as_ptr() as u64, LEN as u64)]);
    assert_eq!(s[0].status, TransferStatus::Completed, "{s:?}");
    drop(init);
    drop(target);
    assert!(tbuf.iter().all(|b| *b == 0), "nothing landed under the revoked key");
    assert!(other == ibuf);
}

#[test]
fn rdma_a_range_no_remote_key_covers_is_refused_before_anything_is_posted() {
    let mut tbuf = vec![0u8; 4096];
    let mut ibuf = pattern(8192, 1);
    let fabric = FakeFabric::new(3);
    let target = engine(&fabric);
    // Without the engine's own bounds check, so that the transport's runs.
    let init = engine_with(&fabric, EngineConfig { check_remote_bounds: false, ..EngineConfig::default() });
    register(&target, &mut tbuf);
    register(&init, &mut ibuf);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let ta = tbuf.as_ptr() as u64;
    let s = run(&init, &[req(TcpOpcode::Write, ibuf.as_ptr() as u64, seg, ta, 8192)]);
    assert_eq!(s[0].status, TransferStatus::Failed, "{s:?}");
    assert!(matches!(s[0].error, Some(TaskError::NoRemoteKey { .. })), "{s:?}");
    assert_eq!(fabric.stats().writes_placed, 0, "nothing was posted");
    drop(init);
    drop(target);
    assert!(tbuf.iter().all(|b| *b == 0));
}

/// A hostile peer's Connection messages (malformed, QP numbers no QP can
/// have, too many, a bad GID) are answered with a refusal (`reply_msg`),
/// pair nothing, and leave the target serving honest peers.
#[test]
fn rdma_hostile_connection_messages_are_refused_and_pair_nothing() {
    let fabric = FakeFabric::new(5);
    let target = engine(&fabric);
    let addr: std::net::SocketAddr = target.local_segment_name().parse().unwrap();
    let good = ConnectionDesc {
        local_gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:7f:00:00:01".into(),
        local_lid: 0,
        local_nic_path: "127.0.0.1:1@x".into(),
        payload: String::new(),
        peer_nic_path: format!("{}@fake0", target.local_segment_name()),
        qp_num: vec![17, 18],
        ready_ack: Some(false),
        reply_msg: String::new(),
    };
    let mut bodies: Vec<Vec<u8>> = vec![b"{".to_vec(), b"[]".to_vec(), b"{\"qp_num\":[0]}".to_vec()];
    bodies.push(ConnectionDesc { qp_num: vec![1; 65], ..good.clone() }.to_json());
    bodies.push(ConnectionDesc { qp_num: vec![], ..good.clone() }.to_json());
    bodies.push(ConnectionDesc { local_gid: "nope".into(), ..good.clone() }.to_json());
    for body in bodies {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&HandshakeFrame::new(HandshakeType::Connection, body.clone()).encode()).unwrap();
        match HandshakeFrame::read_from(&mut s, MAX_HANDSHAKE_LEN) {
            // Only a body that is not JSON at all closes the connection; every
            // other one gets a typed refusal.
            Err(_) => assert_eq!(body, b"{", "no refusal for {}", String::from_utf8_lossy(&body)),
            Ok(reply) => {
                let r = ConnectionDesc::from_json(&reply.json).unwrap();
                assert!(!r.reply_msg.is_empty(), "{} was not refused", String::from_utf8_lossy(&body));
                assert!(r.qp_num.is_empty());
            }
        }
    }
    assert!(fabric.queue_pairs().iter().all(|(_, _, to)| to.is_none()), "nothing paired");
    // Still serving: an honest peer pairs and moves bytes.
    let mut tbuf = vec![0u8; 4096];
    let mut ibuf = pattern(4096, 2);
    register(&target, &mut tbuf);
    let init = engine(&fabric);
    register(&init, &mut ibuf);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let s = run(&init, &[req(TcpOpcode::Write, ibuf.as_ptr() as u64, seg, tbuf.as_ptr() as u64, 4096)]);
    assert_eq!(s[0].status, TransferStatus::Completed, "{s:?}");
    drop(init);
    drop(target);
    assert!(tbuf == ibuf);
}

/// A raw TCP WRITE by address into `e`'s data port: what a peer that
/// ignores the metadata can put on the wire. Returns the status word, if any.
fn raw_tcp_write(e: &MooncakeEngine, addr: u64, data: &[u8]) -> Option<[u8; 4]> {
    use backend_mooncake::proto::{RequestHeader, TcpOpcode as Op};
    use std::io::Read;
    let mut s = TcpStream::connect_timeout(&e.data_addr().unwrap(), WAIT).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let h = RequestHeader { size: data.len() as u64, addr, opcode: Op::Write, v2: true };
    s.write_all(&h.encode()).unwrap();
    let _ = s.write_all(data);
    let mut w = [0u8; 4];
    s.read_exact(&mut w).ok().map(|()| w)
}

/// The keys per tenancy live on the RDMA path; TCP carries none. So an
/// engine whose target half is RDMA refuses every request on its TCP data
/// port (counted), and the memory is unchanged. Positive control: a TCP
/// engine places the same request.
#[test]
fn rdma_target_refuses_tcp_data_requests_which_would_bypass_its_keys() {
    const LEN: usize = 4096;
    let fabric = FakeFabric::new(77);
    let mut mem = vec![0x11u8; LEN];
    let target = engine(&fabric);
    register(&target, &mut mem);
    let addr = mem.as_ptr() as u64;
    let before = target.target_stats().rejected;
    let _ = raw_tcp_write(&target, addr, &[0xee; LEN]);
    assert_eq!(target.target_stats().rejected, before + 1, "{:?}", target.target_stats());
    drop(target);
    assert!(mem.iter().all(|b| *b == 0x11), "a TCP WRITE reached memory behind RDMA keys");

    // Positive control: Mooncake TCP places it.
    let mut open = vec![0x11u8; LEN];
    let tcp = MooncakeEngine::new(EngineConfig::default()).unwrap();
    register(&tcp, &mut open);
    let status = raw_tcp_write(&tcp, open.as_ptr() as u64, &[0xee; LEN]);
    assert!(status.is_some(), "no status word from the TCP engine");
    drop(tcp);
    assert!(open.iter().all(|b| *b == 0xee), "the positive control's TCP WRITE did not land");
}

/// A bind that fails (its queue pair in ERR) fails that grant, typed, and
/// the next grant binds on a fresh queue pair pair: one broken queue pair
/// does not end every later exposure.
#[test]
fn rdma_grant_after_a_failed_bind_binds_on_a_fresh_queue_pair() {
    use backend_mooncake::rdma::{RdmaTarget, RdmaTargetConfig};
    use backend_mooncake::TargetHook;
    use backend_verbs::{Engine, QpId};
    let fabric = FakeFabric::new(91);
    let nic = fabric.fake_nic();
    let target = RdmaTarget::new(
        std::sync::Arc::new(nic.clone()),
        RdmaTargetConfig { device: "fake0".into(), publish: Publish::Grants, ..Default::default() },
    );
    let mut mem = vec![0u8; 8192];
    let addr = mem.as_mut_ptr() as u64;
    target.registered(addr, mem.len() as u64).unwrap();
    target.grant("peer", addr, 4096).unwrap();
    // The binder's queue pairs are the only ones on this NIC: break them.
    let ours: Vec<u32> = fabric.queue_pairs().into_iter().filter(|q| q.1 == nic.id()).map(|q| q.0).collect();
    assert_eq!(ours.len(), 2, "{ours:?}");
    for q in &ours {
        nic.to_error(QpId(*q)).unwrap();
    }
    assert!(target.grant("peer", addr + 4096, 4096).is_err(), "a bind on a queue pair in ERR succeeded");
    let (_, key) = target.grant("peer", addr + 4096, 4096).expect("the next grant, on a fresh pair");
    assert_ne!(key, 0);
    drop(target);
    drop(mem);
}

/// Device memory over RDMA would need the NIC to register it (dma-buf): the
/// engine refuses a staged region by name instead of handing its address to
/// the NIC, where the CPU-side software NIC would touch it.
#[test]
fn rdma_engine_refuses_device_memory_it_cannot_register() {
    let fabric = FakeFabric::new(7);
    let e = engine(&fabric);
    let region = std::sync::Arc::new(kv_transfer_core::FakeDeviceRegion::new(1 << 16).unwrap());
    match e.register_memory(MemoryRegion::staged(region)) {
        Err(backend_mooncake::EngineError::StagingUnsupported { protocol }) => assert_eq!(protocol, "rdma"),
        other => panic!("expected StagingUnsupported, got {other:?}"),
    }
}
