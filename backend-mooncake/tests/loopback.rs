//! Our initiator against our target, plus target-side robustness.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backend_mooncake::proto::{HandshakeFrame, HandshakeType, RequestHeader, StatusWord, MAX_HANDSHAKE_LEN};
use backend_mooncake::transport::TransportWork;
use backend_mooncake::{
    DataTransport, EngineConfig, EngineError, MemoryRegion, MooncakeEngine, ProtoVersion, TaskError, TcpOpcode,
    TransferEngine, TransferRequest, TransferStatus,
};

const WAIT: Duration = Duration::from_secs(10);

struct Buf(Vec<u8>);
impl Buf {
    fn new(len: usize, seed: u8) -> Self {
        Buf((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect())
    }
    fn addr(&mut self) -> u64 {
        self.0.as_mut_ptr() as u64
    }
    fn register(&mut self, e: &dyn TransferEngine) {
        // SAFETY: the Vec outlives the engine in every test (declared before
        // it, dropped after it) and is only read after transfers finished.
        e.register_memory(unsafe { MemoryRegion::new(self.addr(), self.0.len() as u64) }).unwrap();
    }
}

fn engine() -> MooncakeEngine {
    MooncakeEngine::new(EngineConfig::default()).unwrap()
}

fn run(e: &dyn TransferEngine, reqs: &[TransferRequest]) -> Vec<backend_mooncake::TaskStatus> {
    let b = e.allocate_batch_id(reqs.len()).unwrap();
    let r = e.submit_transfer(b, reqs).unwrap();
    let out = r.map(|t| e.wait_transfer(b, t, WAIT).unwrap()).collect();
    e.free_batch_id(b).unwrap();
    out
}

#[test]
fn write_then_read_back() {
    let mut tbuf = Buf::new(4 << 20, 0);
    let mut ibuf = Buf::new(4 << 20, 7);
    let target = engine();
    let init = engine();
    tbuf.register(&target);
    ibuf.register(&init);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let info = init.segment_info(seg).unwrap();
    assert_eq!(info.proto, ProtoVersion::V2);
    assert_eq!(info.desc.buffers.len(), 1);
    let (ia, ta) = (ibuf.addr(), tbuf.addr());
    // 8 writes of 256 KiB to scattered offsets.
    let reqs: Vec<_> = (0..8u64)
        .map(|i| TransferRequest {
            opcode: TcpOpcode::Write,
            source: ia + i * (256 << 10),
            target_id: seg,
            target_offset: ta + (1 << 20) + i * (256 << 10),
            length: 256 << 10,
        })
        .collect();
    for s in run(&init, &reqs) {
        assert_eq!(s.status, TransferStatus::Completed, "{s:?}");
        assert_eq!(s.transferred_bytes, 256 << 10);
    }
    assert!(tbuf.0[1 << 20..3 << 20] == ibuf.0[..2 << 20]);
    // Read it back into another local range.
    let rd = [TransferRequest {
        opcode: TcpOpcode::Read,
        source: ia + (2 << 20),
        target_id: seg,
        target_offset: ta + (1 << 20),
        length: 2 << 20,
    }];
    assert_eq!(run(&init, &rd)[0].status, TransferStatus::Completed);
    assert!(ibuf.0[2 << 20..4 << 20] == ibuf.0[..2 << 20]);
    drop(init);
    drop(target);
}

#[test]
fn out_of_range_is_typed_and_changes_nothing() {
    let mut tbuf = Buf::new(1 << 20, 3);
    let mut ibuf = Buf::new(1 << 20, 9);
    let before = tbuf.0.clone();
    let target = engine();
    let init = MooncakeEngine::new(EngineConfig { check_remote_bounds: false, ..Default::default() }).unwrap();
    let checked = engine();
    tbuf.register(&target);
    ibuf.register(&init);
    ibuf.register(&checked);
    let ta = tbuf.addr();
    let ia = ibuf.addr();
    // Checked at submit time.
    let seg_c = checked.open_segment(&target.local_segment_name()).unwrap();
    let b = checked.allocate_batch_id(1).unwrap();
    let bad = TransferRequest {
        opcode: TcpOpcode::Write,
        source: ia,
        target_id: seg_c,
        target_offset: ta + (1 << 20) - 10,
        length: 20,
    };
    assert!(matches!(checked.submit_transfer(b, &[bad]), Err(EngineError::TargetOutOfRange { .. })));
    // Unregistered local source.
    let bad_src = TransferRequest { source: 0x1000, target_offset: ta, ..bad };
    assert!(matches!(checked.submit_transfer(b, &[bad_src]), Err(EngineError::SourceNotRegistered { .. })));
    assert!(matches!(
        checked.submit_transfer(b, &[TransferRequest { length: 0, ..bad }]),
        Err(EngineError::ZeroLength)
    ));
    // Unchecked: the target rejects with status word 1.
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let st = run(&init, &[TransferRequest { target_id: seg, ..bad }]);
    assert_eq!(st[0].status, TransferStatus::Failed);
    assert_eq!(st[0].error, Some(TaskError::AddrRejected));
    let st = run(&init, &[TransferRequest { target_id: seg, opcode: TcpOpcode::Read, ..bad }]);
    assert_eq!(st[0].error, Some(TaskError::AddrRejected));
    // The connection was closed by the target; the next request reconnects.
    let ok = TransferRequest { target_id: seg, target_offset: ta, length: 16, ..bad };
    assert_eq!(run(&init, &[ok])[0].status, TransferStatus::Completed);
    drop((init, checked, target));
    assert!(tbuf.0[16..] == before[16..], "target changed beyond the good write");
    assert_eq!(&tbuf.0[..16], &ibuf.0[..16]);
}

#[test]
fn notify_and_probe_roundtrip() {
    let a = engine();
    let b = engine();
    let seg = a.open_segment(&b.local_segment_name()).unwrap();
    a.send_notify(seg, "hello").unwrap();
    a.send_notify(seg, "world").unwrap();
    let n = b.get_notifies();
    assert_eq!(n.len(), 2);
    assert_eq!(n[0].notify_msg, "hello");
    assert_eq!(n[0].name, a.local_segment_name());
    assert!(b.get_notifies().is_empty());
    backend_mooncake::client::probe(b.handshake_addr().unwrap(), WAIT).unwrap();
}

#[test]
fn handshake_server_survives_garbage() {
    let t = engine();
    let addr = t.handshake_addr().unwrap();
    let junk: Vec<Vec<u8>> = vec![
        vec![],
        vec![1, 2, 3],
        u64::MAX.to_le_bytes().to_vec(),
        (MAX_HANDSHAKE_LEN + 1).to_le_bytes().to_vec(),
        0u64.to_le_bytes().to_vec(),
        HandshakeFrame::new(HandshakeType::Metadata, b"{not json".to_vec()).encode(),
        HandshakeFrame::new(HandshakeType::Notify, b"[1,2]".to_vec()).encode(),
    ];
    for j in junk {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let _ = s.write_all(&j);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        assert!(out.is_empty(), "garbage answered: {out:?}");
    }
    // Old protocol (no type byte) is answered untyped, as Mooncake does.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    HandshakeFrame::new(HandshakeType::OldProtocol, b"{}".to_vec()).write_to(&mut s).unwrap();
    let f = HandshakeFrame::read_from(&mut s, MAX_HANDSHAKE_LEN).unwrap();
    assert_eq!(f.kind, HandshakeType::OldProtocol);
    drop(s);
    let d = backend_mooncake::client::fetch_metadata(addr, &t.local_descriptor(), WAIT).unwrap();
    assert_eq!(d.name, t.local_segment_name());
}

#[test]
fn data_server_speaks_v1_and_v2_on_one_connection() {
    let mut tbuf = Buf::new(4096, 1);
    let t = engine();
    tbuf.register(&t);
    let ta = tbuf.addr();
    let mut s = TcpStream::connect(t.data_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    // v1 WRITE: no status word.
    let h = RequestHeader { size: 4, addr: ta, opcode: TcpOpcode::Write, v2: false };
    s.write_all(&h.encode()).unwrap();
    s.write_all(b"abcd").unwrap();
    // v2 READ of the same bytes: status word, then bytes.
    let h = RequestHeader { size: 4, addr: ta, opcode: TcpOpcode::Read, v2: true };
    s.write_all(&h.encode()).unwrap();
    let mut st = [0u8; 8];
    s.read_exact(&mut st).unwrap();
    assert_eq!(StatusWord::decode(&st).unwrap(), StatusWord::Ok);
    let mut got = [0u8; 4];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"abcd");
    // v2 WRITE: status after apply.
    let h = RequestHeader { size: 2, addr: ta + 4, opcode: TcpOpcode::Write, v2: true };
    s.write_all(&h.encode()).unwrap();
    s.write_all(b"zz").unwrap();
    s.read_exact(&mut st).unwrap();
    assert_eq!(StatusWord::decode(&st).unwrap(), StatusWord::Ok);
    // size 0 is rejected and the connection closed.
    let h = RequestHeader { size: 0, addr: ta, opcode: TcpOpcode::Write, v2: true };
    s.write_all(&h.encode()).unwrap();
    s.read_exact(&mut st).unwrap();
    assert_eq!(StatusWord::decode(&st).unwrap(), StatusWord::AddrRejected);
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    // Unknown opcode with the v2 flag: rejected too.
    let mut s = TcpStream::connect(t.data_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut raw = RequestHeader { size: 1, addr: ta, opcode: TcpOpcode::Write, v2: true }.encode();
    raw[16] = 0x85;
    s.write_all(&raw).unwrap();
    s.read_exact(&mut st).unwrap();
    assert_eq!(StatusWord::decode(&st).unwrap(), StatusWord::AddrRejected);
    drop(t);
    assert_eq!(&tbuf.0[..6], b"abcdzz");
}

/// A transport that never runs anything until told: the engine at its worst.
#[derive(Debug, Default)]
struct StuckTransport(Mutex<Vec<TransportWork>>);
impl DataTransport for StuckTransport {
    fn protocol(&self) -> &'static str {
        "tcp"
    }
    fn submit(&self, work: TransportWork) {
        self.0.lock().unwrap().push(work);
    }
}

#[test]
fn busy_batches_and_regions_are_refused_and_timeout_is_not_terminal() {
    let mut tbuf = Buf::new(4096, 1);
    let mut ibuf = Buf::new(4096, 2);
    let target = engine();
    tbuf.register(&target);
    let stuck = Arc::new(StuckTransport::default());
    let cfg = EngineConfig { transfer_timeout: Some(Duration::from_millis(20)), ..Default::default() };
    let init = MooncakeEngine::with_transport(cfg, stuck.clone()).unwrap();
    ibuf.register(&init);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let b = init.allocate_batch_id(2).unwrap();
    let r = TransferRequest {
        opcode: TcpOpcode::Write,
        source: ibuf.addr(),
        target_id: seg,
        target_offset: tbuf.addr(),
        length: 64,
    };
    assert_eq!(init.submit_transfer(b, &[r]).unwrap(), 0..1);
    assert_eq!(init.submit_transfer(b, &[r]).unwrap(), 1..2);
    assert!(matches!(init.submit_transfer(b, &[r]), Err(EngineError::BatchFull { .. })));
    assert_eq!(init.get_transfer_status(b, 0).unwrap().status, TransferStatus::Waiting);
    assert!(matches!(init.free_batch_id(b), Err(EngineError::BatchBusy { unfinished: 2, .. })));
    assert!(matches!(init.unregister_memory(ibuf.addr()), Err(EngineError::RegionBusy { inflight: 2, .. })));
    assert!(matches!(init.close_segment(seg), Err(EngineError::SegmentBusy(_))));
    std::thread::sleep(Duration::from_millis(40));
    let s = init.wait_transfer(b, 0, Duration::from_millis(5)).unwrap();
    assert_eq!(s.status, TransferStatus::Timeout);
    assert!(!s.status.is_finished());
    assert!(init.free_batch_id(b).is_err());
    // Finish one, drop the other unreported: FAILED(Dropped).
    let mut works = std::mem::take(&mut *stuck.0.lock().unwrap());
    let w1 = works.pop().unwrap();
    let w0 = works.pop().unwrap();
    let TransportWork { completion, local, remote, .. } = w0;
    completion.finish(Ok(64));
    drop(w1);
    assert_eq!(init.get_transfer_status(b, 0).unwrap().status, TransferStatus::Completed);
    let s1 = init.get_transfer_status(b, 1).unwrap();
    assert_eq!((s1.status, s1.error), (TransferStatus::Failed, Some(TaskError::Dropped)));
    assert!(init.unregister_memory(ibuf.addr()).is_err(), "w0's guard still alive");
    drop((local, remote));
    init.unregister_memory(ibuf.addr()).unwrap();
    init.free_batch_id(b).unwrap();
    assert!(matches!(init.get_transfer_status(b, 0), Err(EngineError::UnknownBatch(_))));
    init.close_segment(seg).unwrap();
}

#[test]
fn v1_target_gets_v1_framing_and_stats_show_it() {
    let mut tbuf = Buf::new(1 << 20, 4);
    let mut ibuf = Buf::new(1 << 20, 5);
    let target = MooncakeEngine::new(EngineConfig { advertised_tcp_proto_version: 1, ..Default::default() }).unwrap();
    let v2_target = engine();
    let init = engine();
    tbuf.register(&target);
    let mut t2buf = Buf::new(4096, 0);
    t2buf.register(&v2_target);
    ibuf.register(&init);
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    assert_eq!(init.segment_info(seg).unwrap().proto, ProtoVersion::V1);
    let (ia, ta) = (ibuf.addr(), tbuf.addr());
    let w =
        TransferRequest { opcode: TcpOpcode::Write, source: ia, target_id: seg, target_offset: ta, length: 512 << 10 };
    let st = run(&init, &[w]);
    assert_eq!((st[0].status, st[0].proto), (TransferStatus::Completed, ProtoVersion::V1));
    // The v1 hazard itself: COMPLETED only meant "left our socket"; the bytes
    // may not be applied yet (a READ on another pooled connection can overtake
    // them). Only the target knows; wait for it, bounded.
    let deadline = std::time::Instant::now() + WAIT;
    while target.target_stats().bytes_written < 512 << 10 {
        assert!(std::time::Instant::now() < deadline, "v1 write never applied");
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = TransferRequest { opcode: TcpOpcode::Read, source: ia + (512 << 10), length: 512 << 10, ..w };
    assert_eq!(run(&init, &[r])[0].status, TransferStatus::Completed);
    assert!(ibuf.0[512 << 10..] == ibuf.0[..512 << 10]);
    // The server counts a READ after its last byte left; bounded wait.
    while target.target_stats().bytes_read < 512 << 10 {
        assert!(std::time::Instant::now() < deadline, "read not counted");
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = target.target_stats();
    assert_eq!((s.v1_requests, s.v2_requests, s.rejected), (2, 0, 0));
    assert_eq!((s.bytes_written, s.bytes_read), (512 << 10, 512 << 10));
    // Against v2 the same engine uses v2.
    let seg2 = init.open_segment(&v2_target.local_segment_name()).unwrap();
    let w2 = TransferRequest { target_id: seg2, target_offset: t2buf.addr(), length: 16, ..w };
    assert_eq!(run(&init, &[w2])[0].proto, ProtoVersion::V2);
    assert_eq!(v2_target.target_stats().v2_requests, 1);
    drop((init, target, v2_target));
    assert!(tbuf.0[..512 << 10] == ibuf.0[..512 << 10]);
}

/// Device memory on both sides (core's `FakeDeviceRegion`: its addresses
/// fault on any CPU access): the TCP transport stages every byte through host
/// buffers and the region's copies, WRITE and READ, byte-exact. A path that
/// dereferenced a device address would crash the test (or fail its syscall).
#[test]
fn tcp_stages_device_memory_through_host_buffers() {
    use kv_transfer_core::{FakeDeviceRegion, Region};
    const LEN: usize = 1 << 20;
    let pattern: Vec<u8> = Buf::new(LEN, 3).0;
    let target = engine();
    let init = engine();
    let treg = Arc::new(FakeDeviceRegion::new(2 * LEN).unwrap());
    let ireg = Arc::new(FakeDeviceRegion::new(2 * LEN).unwrap());
    ireg.write(0, &pattern).unwrap();
    target.register_memory(MemoryRegion::staged(treg.clone())).unwrap();
    init.register_memory(MemoryRegion::staged(ireg.clone())).unwrap();
    let seg = init.open_segment(&target.local_segment_name()).unwrap();
    let (ia, ta) = (ireg.addr(), treg.addr());
    let wr = [TransferRequest {
        opcode: TcpOpcode::Write,
        source: ia,
        target_id: seg,
        target_offset: ta,
        length: LEN as u64,
    }];
    assert_eq!(run(&init, &wr)[0].status, TransferStatus::Completed);
    let mut landed = vec![0u8; LEN];
    treg.read(0, &mut landed).unwrap();
    assert!(landed == pattern, "the staged WRITE did not land byte-exact");
    let rd = [TransferRequest {
        opcode: TcpOpcode::Read,
        source: ia + LEN as u64,
        target_id: seg,
        target_offset: ta,
        length: LEN as u64,
    }];
    assert_eq!(run(&init, &rd)[0].status, TransferStatus::Completed);
    let mut back = vec![0u8; LEN];
    ireg.read(LEN, &mut back).unwrap();
    assert!(back == pattern, "the staged READ did not come back byte-exact");
    drop((init, target));
}
