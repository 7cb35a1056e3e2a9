//! The Mooncake adapter's harness: our [`MooncakeTransfer`] on both sides,
//! over our pure-Rust [`MooncakeEngine`], on one of three data paths
//! ([`Wire`]): loopback TCP (protocol v2, the `mooncake` column), and
//! Mooncake's RDMA transport with a key per tenancy, on `backend-verbs`'
//! software NIC (`mooncake-rdma-fake`) or a verbs device
//! (`mooncake-rdma`, in `scripts/rdma-lab`'s guest).
//!
//! - Decode side: a `MooncakeTransfer` target with the decode pool; it
//!   exposes leases to the prefill side's segment (over RDMA with keys from
//!   `rdma::RdmaTarget` publishing grants).
//! - Prefill side: a `MooncakeTransfer` initiator with its own pool, whose
//!   engine runs its transport behind a gate ([`GatedTransport`]) that can
//!   hold posted tasks before their bytes reach the wire.
//!
//! What the adapter can and cannot do, as the scenarios see it:
//!
//! | capability | TCP | RDMA | why |
//! | --- | --- | --- | --- |
//! | hold writes | yes | yes | at the initiator's transport: a held task is posted and not terminal |
//! | revoke ([`Behaviour::can_revoke`](crate::harness::Behaviour::can_revoke)) | **no** | yes | TCP has no access key per tenancy (the address is the key); over RDMA each exposure's key is its own, and the ladder ends it |
//! | retry shadows ([`Behaviour::shadows_revoked_slots`](crate::harness::Behaviour::shadows_revoked_slots)) | no | yes | a revoked slot is refused to the peer that may retry into it, until its ack |
//! | fence ([`Behaviour::can_fence`](crate::harness::Behaviour::can_fence)) | **no** | **no** | a peer can always reconnect and pair again |
//! | raw one-sided access | **no** | **no** | TCP checks only that a request lies in registered memory; over RDMA the NIC sends whole messages |
//! | malformed frame | yes | yes | a bad request header on the data port is rejected and the connection closed (over RDMA every TCP data request is) |
//! | raw peer (notifications) | yes | yes | a bare engine (of the same wire) sends hand-made `kvt1` notifications |
//! | stalled peer | yes | no | a raw TCP data connection sends half a WRITE and stalls; the RDMA engine refuses TCP data |
//! | out-of-process prefill | no | no | runs in this process; its crash strikes its engine dead (nothing more leaves it), then drops it |
//!
//! So over TCP an aborted exposure settles only by the peer's ABORT_ACK (or
//! its completion notification); a peer that never acks leaves the slots
//! quarantined to the end of the ladder, counted as stuck (DESIGN rule 2).
//! Over RDMA the ladder's revocation settles it too.
//!
//! The real Mooncake engine (`mooncake-transfer-engine`) is exercised by
//! `backend-mooncake/tests/interop.rs` and (over RDMA) `tests/rdma_real.rs`,
//! not here: this rig needs nothing outside the workspace.

use crate::ensure;
use crate::harness::{
    expose_to, fail, Backend, Behaviour, Exposure, Failure, Faults, PrefillSide, Provides, RawPeer, Rig, RigConfig,
    StalledExposure,
};
use backend_mooncake::adapter::TenancyKeys;
use backend_mooncake::gate::GatedTransport;
use backend_mooncake::proto::NotifyDesc;
use backend_mooncake::proto::{RequestHeader, TcpOpcode, HEADER_LEN};
use backend_mooncake::{
    AdapterConfig, BatchId, DataTransport, EngineConfig, EngineError, MemoryRegion, MooncakeEngine, MooncakeTransfer,
    SegmentId, SegmentInfo, TaskStatus, TcpTransportConfig, TransferEngine, TransferRequest,
};
use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{ExposeErrorKind, PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, Target, Tenancy};
use std::any::Any;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Which data path a Mooncake rig runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// Mooncake TCP (protocol v2) on loopback.
    Tcp,
    /// Mooncake RDMA on `backend-verbs`' software NIC, a key per tenancy
    /// (feature `mooncake-rdma`).
    #[cfg(feature = "mooncake-rdma")]
    RdmaFake,
    /// Mooncake RDMA on a verbs device (Soft-RoCE in `scripts/rdma-lab`'s
    /// guest), a key per tenancy (features `mooncake-rdma` and `verbs`).
    #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
    RdmaDevice,
}

impl Wire {
    fn keyed(self) -> bool {
        self != Wire::Tcp
    }
}

/// The Mooncake adapter, target and initiator both ours, on one data path.
/// TCP and the software NIC are always available (pure Rust).
#[derive(Clone, Copy, Debug)]
pub struct MooncakeBackend {
    /// The data path.
    pub wire: Wire,
}

/// The Mooncake backends compiled in.
pub fn backend() -> Vec<Box<dyn Backend>> {
    #[allow(unused_mut)]
    let mut v: Vec<Box<dyn Backend>> = vec![Box::new(MooncakeBackend { wire: Wire::Tcp })];
    #[cfg(feature = "mooncake-rdma")]
    v.push(Box::new(MooncakeBackend { wire: Wire::RdmaFake }));
    #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
    v.push(Box::new(MooncakeBackend { wire: Wire::RdmaDevice }));
    v
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
    // A crash stops what the engine sends and reads; the tasks it had
    // running end as they would, and their hooks run.
    fn batch_hooks(&self) -> bool {
        self.inner.batch_hooks()
    }
    fn on_batch_finished(&self, batch: BatchId, hook: backend_mooncake::BatchHook) -> Result<(), EngineError> {
        self.inner.on_batch_finished(batch, hook)
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
    // The data server's exposure filter is the inner engine's (a crash
    // changes nothing about what it may serve).
    fn serve_exposed_only(&self) -> bool {
        self.inner.serve_exposed_only()
    }
    fn expose_range(
        &self,
        addr: u64,
        len: u64,
        access: backend_mooncake::RangeAccess,
    ) -> Result<Option<backend_mooncake::RangeId>, EngineError> {
        self.inner.expose_range(addr, len, access)
    }
    fn unexpose_range(&self, id: backend_mooncake::RangeId) -> bool {
        self.inner.unexpose_range(id)
    }
}

/// The prefill side, as the faults reach it (its adapter and pool are the
/// rig's, which lets go of them once it crashed).
struct Prefill {
    engine: Arc<CrashableEngine>,
    /// For its counters: weak, so that a crash drops the adapter.
    transfer: Weak<MooncakeTransfer>,
    gate: Arc<GatedTransport>,
}

/// Where a rig's engines come from.
enum Engines {
    Tcp,
    #[cfg(feature = "mooncake-rdma")]
    Rdma {
        nics: Box<dyn Fn() -> Result<backend_mooncake::rdma::RdmaNics, Failure>>,
        device: String,
    },
}

impl Engines {
    fn of(wire: Wire) -> Self {
        match wire {
            Wire::Tcp => Engines::Tcp,
            #[cfg(feature = "mooncake-rdma")]
            Wire::RdmaFake => {
                let fabric = backend_verbs::FakeFabric::new(0x6d63 ^ u64::from(std::process::id()));
                let nics =
                    move || Ok(backend_mooncake::rdma::RdmaNics { initiator: fabric.nic(), target: fabric.nic() });
                Engines::Rdma { nics: Box::new(nics), device: "fake0".into() }
            }
            #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
            Wire::RdmaDevice => {
                let env = backend_verbs::LabEnv::from_env();
                let device = env.device.clone();
                let nics = move || {
                    let open = || {
                        backend_verbs::DeviceEngine::open(&env.device, 1, env.gid_index)
                            .map(|e| e as Arc<dyn backend_verbs::Engine>)
                            .map_err(|e| fail("verbs device")(&e))
                    };
                    Ok(backend_mooncake::rdma::RdmaNics { initiator: open()?, target: open()? })
                };
                Engines::Rdma { nics: Box::new(nics), device }
            }
        }
    }

    /// An engine for a target: with the key-per-tenancy hook over RDMA.
    fn target(&self) -> Result<(MooncakeEngine, Option<Arc<dyn TenancyKeys>>), Failure> {
        match self {
            Engines::Tcp => Ok((MooncakeEngine::new(engine_config()).map_err(|e| fail("engine")(&e))?, None)),
            #[cfg(feature = "mooncake-rdma")]
            Engines::Rdma { nics, device } => {
                use backend_mooncake::rdma::{rdma_engine, Publish};
                let (e, target) =
                    rdma_engine(engine_config(), nics()?, device, Publish::Grants).map_err(|e| fail("engine")(&e))?;
                Ok((e, Some(target as Arc<dyn TenancyKeys>)))
            }
        }
    }

    /// An initiator's engine, its data transport behind a gate.
    fn gated(&self) -> Result<(MooncakeEngine, Arc<GatedTransport>), Failure> {
        match self {
            Engines::Tcp => {
                let ecfg = engine_config();
                let gate = Arc::new(GatedTransport::new(ecfg.tcp.clone()).map_err(|e| fail("prefill transport")(&e))?);
                let e = MooncakeEngine::with_transport(ecfg, gate.clone() as Arc<dyn DataTransport>)
                    .map_err(|e| fail("prefill engine")(&e))?;
                Ok((e, gate))
            }
            #[cfg(feature = "mooncake-rdma")]
            Engines::Rdma { nics, device } => {
                use backend_mooncake::rdma::{Publish, RdmaParts};
                let ecfg = engine_config();
                let parts = RdmaParts::new(nics()?, device, Publish::Grants, ecfg.handshake_timeout)
                    .map_err(|e| fail("prefill parts")(&e))?;
                let gate = Arc::new(GatedTransport::over(parts.transport.clone()));
                let e = parts
                    .engine(ecfg, gate.clone() as Arc<dyn DataTransport>)
                    .map_err(|e| fail("prefill engine")(&e))?;
                Ok((e, gate))
            }
        }
    }
}

impl Backend for MooncakeBackend {
    fn name(&self) -> &'static str {
        match self.wire {
            Wire::Tcp => "mooncake",
            #[cfg(feature = "mooncake-rdma")]
            Wire::RdmaFake => "mooncake-rdma-fake",
            #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
            Wire::RdmaDevice => "mooncake-rdma",
        }
    }
    fn provides(&self) -> Provides {
        Provides {
            // Over RDMA every exposure has a key of its own; TCP has none.
            revoke: self.wire.keyed(),
            fence: false,
            raw_access: false,
            // Over RDMA a WRITE is the NIC's whole message.
            stalled_peer: !self.wire.keyed(),
            // TCP stages device slots through host buffers; an RDMA NIC
            // needs them registered (dma-buf).
            fake_device: if self.wire.keyed() { Err(crate::verbs::DMABUF) } else { Ok(()) },
            cuda: if self.wire.keyed() { Err(crate::verbs::DMABUF) } else { Ok(()) },
            ..Provides::default()
        }
    }
    /// Over the software NIC, 2,000: under `naive` every aborted slot
    /// leaves a key granted and published, so its metadata grows with the run.
    fn race_requests(&self) -> Option<u64> {
        #[cfg(feature = "mooncake-rdma")]
        if self.wire == Wire::RdmaFake {
            return Some(2_000);
        }
        None
    }
    fn race(&self) -> Result<crate::harness::RaceRunner, &'static str> {
        match self.wire {
            Wire::Tcp => Ok(kv_transfer_examples::race::mooncake::run_mooncake_race),
            #[cfg(feature = "mooncake-rdma")]
            Wire::RdmaFake => Ok(kv_transfer_examples::race::mooncake::run_mooncake_rdma_race),
            #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
            Wire::RdmaDevice => Ok(kv_transfer_examples::race::mooncake::run_mooncake_rdma_device_race),
        }
    }
    fn available(&self) -> Result<(), String> {
        match self.wire {
            #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
            Wire::RdmaDevice => crate::verbs::Nic::Device.available(),
            _ => Ok(()),
        }
    }
    fn runs_elsewhere_in_ci(&self) -> bool {
        match self.wire {
            #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
            Wire::RdmaDevice => crate::verbs::Nic::Device.runs_elsewhere_in_ci(),
            _ => false,
        }
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        if cfg.prefill_process {
            return Err(Failure("the Mooncake rig has no out-of-process prefill side".into()));
        }
        let engines = Engines::of(self.wire);
        let (decode_engine, keys) = engines.target()?;
        let decode_engine = Arc::new(decode_engine);
        let decode = MooncakeTransfer::new(
            decode_engine.clone(),
            AdapterConfig { release_policy: cfg.policy, keys, ..AdapterConfig::default() },
        )
        .map_err(|e| fail("decode adapter")(&e))?;
        let decode = Arc::new(decode);
        let region = cfg.region(cfg.decode_slots)?;
        let decode_pool = decode
            .register_pool(region, PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder))
            .map_err(|e| fail("decode pool")(&e))?;
        let (pengine, gate) = engines.gated()?;
        let engine = Arc::new(CrashableEngine { inner: pengine, dead: AtomicBool::new(false) });
        let transfer =
            MooncakeTransfer::new(engine.clone(), AdapterConfig::default()).map_err(|e| fail("prefill adapter")(&e))?;
        let transfer = Arc::new(transfer);
        let region = cfg.region(cfg.prefill_slots)?;
        let pool =
            transfer.register_pool(region, PoolConfig::new(cfg.slot_size)).map_err(|e| fail("prefill pool")(&e))?;
        let prefill_peer = decode.add_peer(transfer.segment_name()).map_err(|e| fail("decode add_peer")(&e))?;
        // Over RDMA every exposure has a key of its own, which the ladder
        // can end (and a revoked slot is shadowed for its peer); Mooncake
        // TCP has none. Mooncake cannot fence.
        let keyed = self.wire.keyed();
        Ok(Rig {
            faults: Box::new(MooncakeFaults {
                wire: self.wire,
                engines,
                decode_engine,
                decode: decode.clone(),
                prefill: Some(Prefill { engine, transfer: Arc::downgrade(&transfer), gate }),
                can_hold: cfg.can_hold,
                slot_size: cfg.slot_size,
                raw: Mutex::new(None),
                raw_name: Mutex::new(None),
            }),
            backend: self.name(),
            behaviour: Behaviour {
                can_revoke: keyed,
                shadows_revoked_slots: keyed,
                can_fence: false,
                ..Behaviour::default()
            },
            decode,
            decode_pool,
            prefill_peer,
            prefill: Some(PrefillSide { transfer, pool }),
        })
    }
}

/// What a Mooncake rig stages: writes held at the prefill side's
/// transport, its engine struck dead, bare engines as raw and stalled peers.
struct MooncakeFaults {
    wire: Wire,
    /// Where raw peers' engines come from (they speak the rig's wire).
    engines: Engines,
    decode_engine: Arc<MooncakeEngine>,
    decode: Arc<MooncakeTransfer>,
    /// `None` once crashed.
    prefill: Option<Prefill>,
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
        let n = backend_mooncake::proto::NotifyDesc::new(&self.name, &done_text(remote, tenancies)?);
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

impl MooncakeFaults {
    fn data_addr(&self) -> Result<SocketAddr, Failure> {
        self.decode_engine.data_addr().ok_or_else(|| Failure("the decode engine has no data listener".into()))
    }

    fn raw_engine(&self) -> Result<(MooncakeEngine, PeerId), Failure> {
        let (engine, _) = self.engines.target()?;
        let peer = self.decode.add_peer(&engine.local_segment_name()).map_err(|e| fail("decode add_peer")(&e))?;
        Ok((engine, peer))
    }
}

impl Drop for MooncakeFaults {
    fn drop(&mut self) {
        self.release_writes();
    }
}

impl Faults for MooncakeFaults {
    fn diagnostics(&self) -> String {
        let p = match self.prefill.as_ref().and_then(|p| p.transfer.upgrade()) {
            Some(t) => format!("{:?}", t.metrics()),
            None => "crashed".into(),
        };
        format!(
            "decode adapter {:?}; decode target {:?}; prefill adapter {p}",
            self.decode.metrics(),
            self.decode_engine.target_stats()
        )
    }
    fn expose(&self, decode: &dyn Target, prefill: PeerId, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        // With keys, a revoked slot is refused to the peer that may retry
        // into it until that peer's ack (typed, the lease back): a serving
        // engine waits for it or picks another slot. Bounded.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut lease = lease;
        loop {
            match decode.expose(lease, prefill) {
                Ok(x) => return Ok(x),
                Err(e) if matches!(e.kind, ExposeErrorKind::RetryShadow(_)) && Instant::now() < deadline => {
                    lease = e.lease;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(Failure(format!("expose: {}; {}", e.kind, self.diagnostics()))),
            }
        }
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
    fn crash_prefill(&mut self) -> Result<(), Failure> {
        if let Some(p) = self.prefill.take() {
            // Struck dead first, so no goodbye (ABORT_ACK, completion) leaves
            // it; held tasks never reach the wire; then (as the rig lets go
            // of its adapter) the adapter stops and the engine tears its
            // connections down.
            p.engine.dead.store(true, Ordering::Release);
            p.gate.crash();
            drop(p);
        }
        Ok(())
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
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        let Some(peer) = *lock(&self.raw) else {
            return Err(Failure("no raw peer connected".into()));
        };
        expose_to(self.decode.as_ref(), lease, peer)
    }
    fn expose_to_stalled_peer(&self, lease: SlotLease<Reserved>) -> Option<Result<StalledExposure, Failure>> {
        if self.wire.keyed() {
            // Over RDMA a WRITE is the NIC's whole message, and the TCP data
            // port refuses everything (the lease goes back to the pool).
            return None;
        }
        Some((|| {
            // The peer: a bare engine (it receives the ABORT and never acks).
            let (engine, peer) = self.raw_engine()?;
            let (exposed, remote) = expose_to(self.decode.as_ref(), lease, peer)?;
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
