//! The Mooncake adapter's harness: our [`MooncakeTransfer`] on both sides,
//! over our pure-Rust [`MooncakeEngine`] on loopback TCP (protocol v2).
//!
//! - Decode side: a `MooncakeTransfer` target with the decode pool; it
//!   exposes leases to the prefill side's segment.
//! - Prefill side: a `MooncakeTransfer` initiator with its own pool, whose
//!   engine runs the TCP transport behind a gate ([`GatedTransport`]) that
//!   can hold posted tasks before their bytes reach the wire.
//!
//! What the adapter can and cannot do, as the scenarios see it:
//!
//! | capability | here | why |
//! | --- | --- | --- |
//! | hold writes | yes, at the initiator's transport | the target's data server has no hook; a held task is posted and not terminal, which is all "in flight" means without revocation |
//! | revoke | **no** ([`Rig::can_revoke`]) | Mooncake TCP has no access key per tenancy: the address is the key |
//! | fence | **no** ([`Rig::can_fence`]) | a data connection carries no peer identity and a peer can always reconnect |
//! | raw one-sided access | **no** ([`Rig::raw_write`] is `None`) | the target checks only that a request lies in registered memory: no key, slot or generation to reject |
//! | malformed frame | yes | a bad request header makes the data server reject it and close the connection |
//! | raw peer (notifications) | yes | a bare engine sends hand-made `kvt1` notifications |
//! | stalled peer | yes | a raw data connection sends half a WRITE and stalls |
//! | out-of-process prefill | no | runs in this process; its crash strikes its engine dead (nothing more leaves it), then drops it |
//!
//! So an aborted exposure settles only by the peer's ABORT_ACK (or its
//! completion notification); a peer that never acks leaves the slots
//! quarantined to the end of the ladder, counted as stuck (DESIGN rule 2).
//!
//! The real Mooncake engine (`mooncake-transfer-engine`) is exercised by
//! `backend-mooncake/tests/interop.rs`, not here: this rig needs nothing
//! outside the workspace.

use crate::ensure;
use crate::harness::{fail, Backend, Failure, RawPeer, RawSpec, Rig, RigConfig, StalledExposure};
use crate::sim::post_tagged;
use backend_mooncake::gate::GatedTransport;
use backend_mooncake::proto::NotifyDesc;
use backend_mooncake::proto::{RequestHeader, TcpOpcode, HEADER_LEN};
use backend_mooncake::{
    AdapterConfig, BatchId, DataTransport, EngineConfig, EngineError, MemoryRegion, MooncakeEngine, MooncakeTransfer,
    SegmentId, SegmentInfo, TaskStatus, TcpTransportConfig, TransferEngine, TransferRequest,
};
use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{
    Exposed, HostRegion, PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotPool, Tenancy, Transfer,
    TransferError, TransferHandle,
};
use std::any::Any;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The Mooncake adapter, target and initiator both ours, on loopback.
/// Always available: the engine is pure Rust.
#[derive(Clone, Copy, Debug, Default)]
pub struct MooncakeBackend;

/// The mooncake harness.
pub fn backend() -> Option<Box<dyn Backend>> {
    Some(Box::new(MooncakeBackend))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An engine on loopback with a small transport (the suite runs many rigs).
fn engine_config() -> EngineConfig {
    EngineConfig {
        local_host: "127.0.0.1".into(),
        tcp: TcpTransportConfig { workers: 2, ..TcpTransportConfig::default() },
        ..EngineConfig::default()
    }
}

/// The prefill side's engine, which can be struck dead: from then on
/// nothing it would send (ABORT_ACK, completion notifications) leaves it,
/// and nothing sent to it is read, as when its process is killed.
struct CrashableEngine {
    inner: MooncakeEngine,
    dead: AtomicBool,
}

impl CrashableEngine {
    fn alive(&self) -> Result<(), EngineError> {
        if self.dead.load(Ordering::Acquire) {
            Err(EngineError::Shutdown)
        } else {
            Ok(())
        }
    }
}

impl TransferEngine for CrashableEngine {
    fn local_segment_name(&self) -> String {
        self.inner.local_segment_name()
    }
    fn register_memory(&self, region: MemoryRegion) -> Result<(), EngineError> {
        self.inner.register_memory(region)
    }
    fn unregister_memory(&self, addr: u64) -> Result<(), EngineError> {
        self.inner.unregister_memory(addr)
    }
    fn open_segment(&self, name: &str) -> Result<SegmentId, EngineError> {
        self.alive()?;
        self.inner.open_segment(name)
    }
    fn segment_info(&self, id: SegmentId) -> Result<SegmentInfo, EngineError> {
        self.inner.segment_info(id)
    }
    fn close_segment(&self, id: SegmentId) -> Result<(), EngineError> {
        self.inner.close_segment(id)
    }
    fn allocate_batch_id(&self, batch_size: usize) -> Result<BatchId, EngineError> {
        self.alive()?;
        self.inner.allocate_batch_id(batch_size)
    }
    fn submit_transfer(&self, batch: BatchId, requests: &[TransferRequest]) -> Result<Range<usize>, EngineError> {
        self.alive()?;
        self.inner.submit_transfer(batch, requests)
    }
    fn get_transfer_status(&self, batch: BatchId, task: usize) -> Result<TaskStatus, EngineError> {
        self.inner.get_transfer_status(batch, task)
    }
    fn wait_transfer(&self, batch: BatchId, task: usize, wait: Duration) -> Result<TaskStatus, EngineError> {
        self.inner.wait_transfer(batch, task, wait)
    }
    fn free_batch_id(&self, batch: BatchId) -> Result<(), EngineError> {
        self.inner.free_batch_id(batch)
    }
    fn send_notify(&self, target: SegmentId, msg: &str) -> Result<(), EngineError> {
        self.alive()?;
        self.inner.send_notify(target, msg)
    }
    fn get_notifies(&self) -> Vec<NotifyDesc> {
        match self.alive() {
            Ok(()) => self.inner.get_notifies(),
            Err(_) => Vec::new(),
        }
    }
}

struct Prefill {
    engine: Arc<CrashableEngine>,
    transfer: MooncakeTransfer,
    pool: SlotPool,
    gate: Arc<GatedTransport>,
}

impl Backend for MooncakeBackend {
    fn name(&self) -> &'static str {
        "mooncake"
    }
    fn race(&self) -> Option<crate::harness::RaceRunner> {
        Some(kv_transfer_examples::race::mooncake::run_mooncake_race)
    }
    fn available(&self) -> Result<(), String> {
        Ok(())
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Box<dyn Rig>, Failure> {
        if cfg.prefill_process {
            eprintln!(
                "[mooncake] no out-of-process prefill worker: the prefill side runs in this process \
                 and its crash drops its engine without goodbyes"
            );
        }
        let decode_engine = Arc::new(MooncakeEngine::new(engine_config()).map_err(|e| fail("decode engine")(&e))?);
        let decode = MooncakeTransfer::new(
            decode_engine.clone(),
            AdapterConfig { release_policy: cfg.policy, ..AdapterConfig::default() },
        )
        .map_err(|e| fail("decode adapter")(&e))?;
        let region = HostRegion::new(cfg.decode_slots * cfg.slot_size).map_err(|e| fail("decode region")(&e))?;
        let dpool = decode
            .register_pool(Arc::new(region), PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder))
            .map_err(|e| fail("decode pool")(&e))?;
        let ecfg = engine_config();
        let gate = Arc::new(GatedTransport::new(ecfg.tcp.clone()).map_err(|e| fail("prefill transport")(&e))?);
        let pengine = MooncakeEngine::with_transport(ecfg, gate.clone() as Arc<dyn DataTransport>)
            .map_err(|e| fail("prefill engine")(&e))?;
        let engine = Arc::new(CrashableEngine { inner: pengine, dead: AtomicBool::new(false) });
        let transfer =
            MooncakeTransfer::new(engine.clone(), AdapterConfig::default()).map_err(|e| fail("prefill adapter")(&e))?;
        let region = HostRegion::new(cfg.prefill_slots * cfg.slot_size).map_err(|e| fail("prefill region")(&e))?;
        let pool = transfer
            .register_pool(Arc::new(region), PoolConfig::new(cfg.slot_size))
            .map_err(|e| fail("prefill pool")(&e))?;
        let prefill_peer = decode.add_peer(transfer.segment_name()).map_err(|e| fail("decode add_peer")(&e))?;
        Ok(Box::new(MooncakeRig {
            decode_engine,
            decode,
            dpool,
            prefill: Some(Prefill { engine, transfer, pool, gate }),
            prefill_peer,
            can_hold: cfg.can_hold,
            slot_size: cfg.slot_size,
            raw: Mutex::new(None),
            raw_name: Mutex::new(None),
        }))
    }
}

/// A Mooncake rig: our adapter as decode target and as prefill initiator,
/// connected on 127.0.0.1.
pub struct MooncakeRig {
    decode_engine: Arc<MooncakeEngine>,
    decode: MooncakeTransfer,
    dpool: SlotPool,
    /// `None` once crashed.
    prefill: Option<Prefill>,
    /// The prefill side as the decode adapter numbers it.
    prefill_peer: PeerId,
    can_hold: bool,
    slot_size: usize,
    /// The last raw peer, as the decode adapter numbers it.
    raw: Mutex<Option<PeerId>>,
    /// Its segment name (what an impostor writes into its notifies).
    raw_name: Mutex<Option<String>>,
}

/// A third party that writes the raw peer's segment name into the notify it
/// sends from a connection of its own (Mooncake's notify carries the name
/// its sender declares).
struct MooncakeImpostor {
    name: String,
    decode: SocketAddr,
}

impl RawPeer for MooncakeImpostor {
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        let n =
            backend_mooncake::proto::NotifyDesc { name: self.name.clone(), notify_msg: done_text(remote, tenancies)? };
        backend_mooncake::client::send_notify(self.decode, &n, Duration::from_secs(5))
            .map_err(|e| fail("impostor notify")(&e))
    }
}

/// A bare engine that sends hand-made adapter notifications to the decode side.
struct MooncakeRawPeer {
    engine: MooncakeEngine,
    decode: SegmentId,
}

impl RawPeer for MooncakeRawPeer {
    /// Sends a DONE (core's codec, text form) for the exposure's pool and
    /// token. Mooncake TCP has no access key (`key` is 0 in every exposure).
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        self.engine.send_notify(self.decode, &done_text(remote, tenancies)?).map_err(|e| fail("raw notify")(&e))
    }
}

/// A DONE for `tenancies` of `remote` (its pool and token), core's codec in
/// its text form, as the adapter's notifies carry it.
fn done_text(remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<String, Failure> {
    let msg = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, tenancies.to_vec());
    msg.encode_text().map_err(|e| fail("encode")(&e))
}

impl MooncakeRig {
    fn data_addr(&self) -> Result<SocketAddr, Failure> {
        self.decode_engine.data_addr().ok_or_else(|| Failure("the decode engine has no data listener".into()))
    }

    fn raw_engine(&self) -> Result<(MooncakeEngine, PeerId), Failure> {
        let engine = MooncakeEngine::new(engine_config()).map_err(|e| fail("raw engine")(&e))?;
        let peer = self.decode.add_peer(&engine.local_segment_name()).map_err(|e| fail("decode add_peer")(&e))?;
        Ok((engine, peer))
    }
}

impl Drop for MooncakeRig {
    fn drop(&mut self) {
        self.release_writes();
    }
}

impl Rig for MooncakeRig {
    fn backend(&self) -> &'static str {
        "mooncake"
    }
    fn diagnostics(&self) -> String {
        let p = match &self.prefill {
            Some(p) => format!("{:?}", p.transfer.metrics()),
            None => "crashed".into(),
        };
        format!(
            "decode adapter {:?}; decode target {:?}; prefill adapter {p}",
            self.decode.metrics(),
            self.decode_engine.target_stats()
        )
    }
    fn decode_pool(&self) -> &SlotPool {
        &self.dpool
    }
    fn prefill_pool(&self) -> Option<&SlotPool> {
        self.prefill.as_ref().map(|p| &p.pool)
    }
    fn prefill_transfer(&self) -> Option<&dyn Transfer> {
        self.prefill.as_ref().map(|p| &p.transfer as &dyn Transfer)
    }
    fn expose(&self, lease: SlotLease<Reserved>) -> Result<(SlotLease<Exposed>, RemoteSlots), Failure> {
        self.decode.expose(lease, self.prefill_peer).map_err(|e| Failure(format!("expose: {}", e.kind)))
    }
    fn write_tagged(&self, remote: &RemoteSlots, request: u64) -> Result<Option<TransferHandle>, Failure> {
        let Some(p) = &self.prefill else { return Err(Failure("the prefill side is dead".into())) };
        post_tagged(&p.transfer, &p.pool, remote, request).map(Some)
    }
    fn hold_writes(&self) -> bool {
        self.can_hold && self.prefill.as_ref().is_some_and(|p| p.gate.hold())
    }
    fn release_writes(&self) {
        if let Some(p) = &self.prefill {
            p.gate.open();
        }
    }
    fn wait_held(&self, timeout: Duration) -> bool {
        self.prefill.as_ref().is_some_and(|p| p.gate.wait_held(timeout))
    }
    fn can_revoke(&self) -> bool {
        false
    }
    fn can_fence(&self) -> bool {
        false
    }
    fn crash_prefill(&mut self) -> Result<(), Failure> {
        if let Some(p) = self.prefill.take() {
            // Struck dead first, so no goodbye (ABORT_ACK, completion) leaves
            // it; held tasks never reach the wire; then the adapter stops
            // and the engine tears its connections down.
            p.engine.dead.store(true, Ordering::Release);
            p.gate.crash();
            drop(p);
        }
        Ok(())
    }
    fn raw_write(&self, _spec: RawSpec, _data: Vec<u8>) -> Option<Result<(), TransferError>> {
        None
    }
    fn send_malformed(&self) -> Option<Result<(), Failure>> {
        Some((|| {
            let before = self.decode_engine.target_stats().rejected;
            let mut s = TcpStream::connect_timeout(&self.data_addr()?, Duration::from_secs(5))
                .map_err(|e| fail("raw connect")(&e))?;
            s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| fail("timeout")(&e))?;
            // An unknown opcode (0x7f, v2 flag set) and an address no region holds.
            s.write_all(&[0xffu8; HEADER_LEN]).map_err(|e| fail("garbage")(&e))?;
            // The server answers with a rejection status word and closes: read to EOF (bounded).
            let mut buf = [0u8; 64];
            let t0 = Instant::now();
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => return Err(fail("the decode side did not close the connection")(&e)),
                }
                ensure!(t0.elapsed() < Duration::from_secs(5), "the decode side kept the connection open");
            }
            ensure!(
                self.decode_engine.target_stats().rejected > before,
                "the malformed request was not counted as rejected: {:?}",
                self.decode_engine.target_stats()
            );
            Ok(())
        })())
    }
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let (engine, peer) = self.raw_engine()?;
            let decode = engine.open_segment(self.decode.segment_name()).map_err(|e| fail("raw open_segment")(&e))?;
            *lock(&self.raw) = Some(peer);
            *lock(&self.raw_name) = Some(engine.local_segment_name());
            Ok(Box::new(MooncakeRawPeer { engine, decode }) as Box<dyn RawPeer>)
        })())
    }
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = lock(&self.raw_name).clone().ok_or_else(|| Failure("no raw peer to impersonate".into()))?;
            let decode = backend_mooncake::client::resolve_segment(self.decode.segment_name())
                .map_err(|e| fail("resolve the decode segment")(&e))?;
            Ok(Box::new(MooncakeImpostor { name, decode }) as Box<dyn RawPeer>)
        })())
    }
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<(SlotLease<Exposed>, RemoteSlots), Failure> {
        let Some(peer) = *lock(&self.raw) else {
            return Err(Failure("no raw peer connected".into()));
        };
        self.decode.expose(lease, peer).map_err(|e| Failure(format!("expose: {}", e.kind)))
    }
    fn expose_to_stalled_peer(&self, lease: SlotLease<Reserved>) -> Option<Result<StalledExposure, Failure>> {
        Some((|| {
            // The peer: a bare engine (it receives the ABORT and never acks).
            let (engine, peer) = self.raw_engine()?;
            let (exposed, remote) =
                self.decode.expose(lease, peer).map_err(|e| Failure(format!("expose: {}", e.kind)))?;
            // Its data connection: a v2 WRITE of the whole slot, half sent.
            let mut s = TcpStream::connect_timeout(&self.data_addr()?, Duration::from_secs(5))
                .map_err(|e| fail("stalled connect")(&e))?;
            let slot = remote.slots.first().ok_or_else(|| Failure("an exposure without slots".into()))?;
            let h = RequestHeader { size: self.slot_size as u64, addr: slot.addr, opcode: TcpOpcode::Write, v2: true };
            s.write_all(&h.encode()).map_err(|e| fail("stalled write")(&e))?;
            s.write_all(&vec![0x5a; self.slot_size / 2]).map_err(|e| fail("stalled write")(&e))?;
            Ok((exposed, Box::new((s, engine)) as Box<dyn Any>))
        })())
    }
}
