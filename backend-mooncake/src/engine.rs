//! The batch engine: a trait shaped like Mooncake's `TransferEngine` and its
//! implementation [`MooncakeEngine`].

use kv_transfer_core::auth::{AuthStats, ClusterKey};
use kv_transfer_core::hash::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::batch::{BatchHook, BatchMap, BatchState, TaskStatus};
use crate::client;
use crate::error::EngineError;
use crate::exposed::{ExposedRanges, RangeAccess, RangeId, TcpServe};
use crate::limits::{ConnLimits, NotifyLimits};
use crate::memory::{MemoryRegion, MemoryRegistry};
use crate::proto::{NotifyDesc, ProtoVersion, SegmentDesc, TcpOpcode};
use crate::server::{self, Listener, ServerShared, TargetHook, TargetStats};
use crate::transport::{Completion, DataTransport, RemoteSegment, TcpTransport, TcpTransportConfig, TransportWork};

/// Engine-local handle of an opened remote segment (Mooncake `SegmentHandle`).
pub type SegmentId = u64;
/// Batch id (Mooncake `BatchID`).
pub type BatchId = u64;

/// One transfer request (Mooncake `TransferRequest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    /// READ (remote → local) or WRITE (local → remote).
    pub opcode: TcpOpcode,
    /// Local address; `[source, source+length)` must lie in one registered region.
    pub source: u64,
    /// Target segment, from [`TransferEngine::open_segment`].
    pub target_id: SegmentId,
    /// Remote virtual address (for host segments, as in Mooncake).
    pub target_offset: u64,
    /// Length in bytes (> 0).
    pub length: u64,
}

/// What is known about an opened segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Segment id.
    pub id: SegmentId,
    /// The descriptor the peer sent.
    pub desc: SegmentDesc,
    /// Framing version it speaks (V1: completions prove nothing remotely).
    pub proto: ProtoVersion,
    /// Data address used.
    pub data_addr: SocketAddr,
}

/// What an engine calls when a notification is queued ([`TransferEngine::set_notify_waker`]).
pub type NotifyWaker = Arc<dyn Fn() + Send + Sync>;

/// Mooncake Transfer Engine semantics. Every method is non-blocking except
/// `open_segment`, `send_notify` (network round trips) and `wait_transfer`.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait TransferEngine: Send + Sync {
    /// Our segment name (`host:handshake_port`), what peers pass to `open_segment`.
    fn local_segment_name(&self) -> String;
    /// Registers local memory (zero length and overlaps are rejected). Remote
    /// peers may READ/WRITE it from now on.
    fn register_memory(&self, region: MemoryRegion) -> Result<(), EngineError>;
    /// Unregisters the region starting at `addr`. Refused with
    /// [`EngineError::RegionBusy`] while any local task or remote request holds
    /// it; `Ok` means the engine will never touch it again.
    fn unregister_memory(&self, addr: u64) -> Result<(), EngineError>;
    /// Fetches a peer's descriptor (handshake Metadata) and returns its handle;
    /// opening the same name again refreshes the descriptor, same id.
    fn open_segment(&self, name: &str) -> Result<SegmentId, EngineError>;
    /// Descriptor and protocol version of an opened segment.
    fn segment_info(&self, id: SegmentId) -> Result<SegmentInfo, EngineError>;
    /// Forgets a segment; refused with [`EngineError::SegmentBusy`] while tasks
    /// to it are unfinished.
    fn close_segment(&self, id: SegmentId) -> Result<(), EngineError>;
    /// Allocates a batch able to hold `batch_size` tasks.
    fn allocate_batch_id(&self, batch_size: usize) -> Result<BatchId, EngineError>;
    /// Submits requests (all or nothing); returns the task indices they got.
    /// Each request is checked before anything is queued: registered local
    /// range, non-zero length, known segment, and (unless disabled) that the
    /// remote range lies in one advertised buffer.
    fn submit_transfer(
        &self,
        batch: BatchId,
        requests: &[TransferRequest],
    ) -> Result<std::ops::Range<usize>, EngineError>;
    /// Current status of one task (TIMEOUT is reported for a task past the
    /// configured transfer timeout; it is not terminal).
    fn get_transfer_status(&self, batch: BatchId, task: usize) -> Result<TaskStatus, EngineError>;
    /// Blocks up to `wait` for the task to finish; returns its status then.
    fn wait_transfer(&self, batch: BatchId, task: usize, wait: Duration) -> Result<TaskStatus, EngineError>;
    /// Frees a batch; refused with [`EngineError::BatchBusy`] while any task
    /// is not COMPLETED or FAILED.
    fn free_batch_id(&self, batch: BatchId) -> Result<(), EngineError>;
    /// Whether [`on_batch_finished`](Self::on_batch_finished) works. The
    /// default (an engine without completion hooks) says `false`: its user
    /// waits for each task ([`wait_transfer`](Self::wait_transfer)).
    fn batch_hooks(&self) -> bool {
        false
    }
    /// Has `hook` run once every task submitted to `batch` so far is
    /// COMPLETED or FAILED (TIMEOUT is not finished), with each task's final
    /// status: from the engine thread that finished the last task, or in
    /// this call when they all are already. The engine frees the batch just
    /// before (its id is unknown afterwards: no `free_batch_id`). A hook must
    /// not block: it runs on the engine's transport threads. If the engine
    /// is dropped first, the hook is dropped unrun. Refused (the hook
    /// dropped unrun) for an unknown batch, one with a hook already, or by
    /// an engine without hooks ([`batch_hooks`](Self::batch_hooks)).
    fn on_batch_finished(&self, batch: BatchId, hook: BatchHook) -> Result<(), EngineError> {
        drop(hook);
        Err(EngineError::UnknownBatch(batch))
    }
    /// Sends a notification to an opened segment's handshake port; `Ok` only
    /// when the peer queued it.
    fn send_notify(&self, target: SegmentId, msg: &str) -> Result<(), EngineError>;
    /// Takes the notifications received so far (oldest first).
    fn get_notifies(&self) -> Vec<NotifyDesc>;
    /// Has `wake` called each time a notification is queued, so a reader
    /// can sleep until one comes instead of polling [`get_notifies`](Self::get_notifies);
    /// whether the engine will (the default, an engine that cannot: `false`,
    /// and the reader polls). A later call replaces the waker.
    fn set_notify_waker(&self, _wake: NotifyWaker) -> bool {
        false
    }
    /// From now on the TCP data server serves only ranges opened with
    /// [`expose_range`](Self::expose_range), if the engine's
    /// [`TcpServe`] allows (`Auto`); whether it does now. The adapter calls
    /// it when it takes the engine. The default (an engine without such a
    /// server) says `false`.
    fn serve_exposed_only(&self) -> bool {
        false
    }
    /// Opens `[addr, addr+len)` of registered memory to remote requests of
    /// `access` (while [`serve_exposed_only`](Self::serve_exposed_only)
    /// holds, nothing else is served). Refused if it overlaps an open range.
    /// `Ok(None)`: the engine does not filter by exposure.
    fn expose_range(&self, _addr: u64, _len: u64, _access: RangeAccess) -> Result<Option<RangeId>, EngineError> {
        Ok(None)
    }
    /// Closes an exposed range: once this returns, no remote request touches
    /// it (requests inside it have had their connections shut down).
    /// `false`: unknown id, or a request did not leave in time (logged).
    fn unexpose_range(&self, _id: RangeId) -> bool {
        true
    }
}

/// Engine options.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Host/IP we listen on and advertise (segment name host).
    pub local_host: String,
    /// Handshake port; 0 picks a free one.
    pub handshake_port: u16,
    /// Data port; 0 picks a free one.
    pub data_port: u16,
    /// Timeout of handshake round trips (and handshake server reads).
    pub handshake_timeout: Duration,
    /// A task unfinished after this long is reported TIMEOUT (not terminal).
    pub transfer_timeout: Option<Duration>,
    /// Reject requests outside the target's advertised buffers at submit time.
    /// Disable only to exercise the target's own rejection (status word 1).
    pub check_remote_bounds: bool,
    /// Budgets of the notification queue, in all and per source address
    /// (refused beyond, never evicting another's; [`NotifyLimits::legacy`]
    /// restores the old drop-oldest queue).
    pub notify_limits: NotifyLimits,
    /// What the TCP data server serves: any registered byte, or only ranges
    /// exposed now ([`TcpServe`]; `Auto`: restricted once an adapter takes
    /// the engine).
    pub serve: TcpServe,
    /// Connection caps and deadlines of the data port.
    pub data_limits: ConnLimits,
    /// Connection caps and deadlines of the handshake port.
    pub handshake_limits: ConnLimits,
    /// `tcp_proto_version` our descriptor advertises (2; set 1 to make peers,
    /// including our own initiator, speak the legacy framing, for tests).
    pub advertised_tcp_proto_version: u32,
    /// TCP transport options.
    pub tcp: TcpTransportConfig,
    /// The target side of another transport (RDMA: `rdma::RdmaTarget`);
    /// `None` serves TCP only.
    pub target_hook: Option<Arc<dyn TargetHook>>,
    /// The cluster key that seals notifications between two kv-transfer
    /// engines ([`crate::sealed`]); `None`: the deployment's
    /// ([`ClusterKey::from_env`]: `KV_TRANSFER_CLUSTER_KEY` or its file,
    /// else the logged single-host key).
    pub cluster_key: Option<ClusterKey>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            local_host: "127.0.0.1".into(),
            handshake_port: 0,
            data_port: 0,
            handshake_timeout: Duration::from_secs(5),
            transfer_timeout: None,
            check_remote_bounds: true,
            notify_limits: NotifyLimits::default(),
            serve: TcpServe::Auto,
            data_limits: ConnLimits::DATA,
            handshake_limits: ConnLimits::HANDSHAKE,
            advertised_tcp_proto_version: 2,
            tcp: TcpTransportConfig::default(),
            target_hook: None,
            cluster_key: None,
        }
    }
}

/// The engine: handshake server, data server, TCP transport and batches.
///
/// Dropping it tears down every data connection and joins every thread, after
/// which no registered memory is touched any more.
#[derive(Debug)]
pub struct MooncakeEngine {
    cfg: EngineConfig,
    shared: Arc<ServerShared>,
    registry: Arc<MemoryRegistry>,
    segments: RwLock<HashMap<SegmentId, Arc<RemoteSegment>>>,
    names: Mutex<HashMap<String, SegmentId>>,
    batches: Arc<BatchMap>,
    next_id: AtomicU64,
    transport: Option<Arc<dyn DataTransport>>,
    handshake: Option<Listener>,
    data: Option<Listener>,
}

impl MooncakeEngine {
    /// Starts an engine with the TCP transport.
    pub fn new(cfg: EngineConfig) -> Result<Self, EngineError> {
        let t = TcpTransport::new(cfg.tcp.clone()).map_err(|e| EngineError::io("start transport", e))?;
        Self::with_transport(cfg, Arc::new(t))
    }

    /// Starts an engine with a given data transport (the servers still speak TCP).
    pub fn with_transport(cfg: EngineConfig, transport: Arc<dyn DataTransport>) -> Result<Self, EngineError> {
        let ip: IpAddr = client::resolve_segment(&format!("{}:0", cfg.local_host))?.ip();
        let data_l =
            TcpListener::bind(SocketAddr::new(ip, cfg.data_port)).map_err(|e| EngineError::io("bind data port", e))?;
        let data_port = data_l.local_addr().map_err(|e| EngineError::io("local_addr", e))?.port();
        // Bind the handshake port first so the segment name is known.
        let hs_l = TcpListener::bind(SocketAddr::new(ip, cfg.handshake_port))
            .map_err(|e| EngineError::io("bind handshake port", e))?;
        let hs_addr = hs_l.local_addr().map_err(|e| EngineError::io("local_addr", e))?;
        drop(hs_l);
        let registry = Arc::new(MemoryRegistry::default());
        let segment_name = format!("{}:{}", cfg.local_host, hs_addr.port());
        let auth = crate::sealed::NotifyAuth::new(crate::sealed::key_or_env(&cfg.cluster_key)?, &segment_name);
        let shared = Arc::new(ServerShared {
            registry: registry.clone(),
            notifies: Mutex::default(),
            notify_waker: Default::default(),
            notify_limits: cfg.notify_limits,
            segment_name,
            data_host: cfg.local_host.clone(),
            data_port,
            data_limits: cfg.data_limits,
            handshake_limits: cfg.handshake_limits,
            stop: AtomicBool::new(false),
            advertised_version: cfg.advertised_tcp_proto_version.max(1),
            stats: Default::default(),
            hook: cfg.target_hook.clone(),
            ranges: ExposedRanges::new(cfg.serve),
            auth,
            chosen: Mutex::default(),
        });
        let handshake = server::start_handshake(hs_addr, shared.clone())?;
        let data = server::start_data(data_l, shared.clone())?;
        tracing::info!(segment = %shared.segment_name, data_port, "mooncake engine listening");
        Ok(Self {
            cfg,
            shared,
            registry,
            segments: RwLock::default(),
            names: Mutex::default(),
            batches: Arc::default(),
            next_id: AtomicU64::new(1),
            transport: Some(transport),
            handshake: Some(handshake),
            data: Some(data),
        })
    }

    /// Handshake listening address.
    pub fn handshake_addr(&self) -> Option<SocketAddr> {
        self.handshake.as_ref().map(Listener::local_addr)
    }

    /// Data listening address.
    pub fn data_addr(&self) -> Option<SocketAddr> {
        self.data.as_ref().map(Listener::local_addr)
    }

    /// Target-side counters (which framing initiators use, rejections, bytes).
    pub fn target_stats(&self) -> TargetStats {
        let mut s = self.shared.stats.snapshot();
        s.ranges_exposed = self.shared.ranges.len() as u64;
        s.notify_bytes_queued = self.shared.notifies.lock().unwrap_or_else(|e| e.into_inner()).bytes() as u64;
        s
    }

    /// What sealed notifications' handshakes proved and refused, both ways
    /// ([`crate::sealed`]).
    pub fn auth_stats(&self) -> AuthStats {
        self.shared.auth.stats()
    }

    /// Our descriptor as a Metadata handshake from an anonymous peer
    /// returns it.
    pub fn local_descriptor(&self) -> SegmentDesc {
        self.shared.published(None, None)
    }

    fn transport(&self) -> Result<&Arc<dyn DataTransport>, EngineError> {
        self.transport.as_ref().ok_or(EngineError::Shutdown)
    }

    fn batch(&self, id: BatchId) -> Result<Arc<BatchState>, EngineError> {
        self.batches.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned().ok_or(EngineError::UnknownBatch(id))
    }

    fn segment(&self, id: SegmentId) -> Result<Arc<RemoteSegment>, EngineError> {
        self.segments.read().unwrap_or_else(|e| e.into_inner()).get(&id).cloned().ok_or(EngineError::UnknownSegment(id))
    }
}

impl Drop for MooncakeEngine {
    fn drop(&mut self) {
        // Servers first (fence remote access), then the transport (joins workers).
        self.handshake.take();
        self.data.take();
        self.transport.take();
    }
}

impl TransferEngine for MooncakeEngine {
    fn local_segment_name(&self) -> String {
        self.shared.segment_name.clone()
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<(), EngineError> {
        // Only the TCP transport stages device memory through host buffers;
        // an RDMA NIC would need the device memory registered (dma-buf).
        let protocol = self.transport()?.protocol();
        if region.is_staged() && (protocol != "tcp" || self.cfg.target_hook.is_some()) {
            return Err(EngineError::StagingUnsupported { protocol: protocol.to_string() });
        }
        let (addr, len) = (region.addr(), region.len());
        self.registry.register(region)?;
        if let Some(hook) = &self.cfg.target_hook {
            if let Err(e) = hook.registered(addr, len) {
                let _ = self.registry.unregister(addr);
                return Err(e);
            }
        }
        Ok(())
    }

    fn unregister_memory(&self, addr: u64) -> Result<(), EngineError> {
        self.registry.unregister(addr)?;
        // Before returning: once it returns the caller may free the memory.
        if let Some(hook) = &self.cfg.target_hook {
            hook.unregistered(addr);
        }
        Ok(())
    }

    fn open_segment(&self, name: &str) -> Result<SegmentId, EngineError> {
        let hs = client::resolve_segment(name)?;
        let desc = client::fetch_metadata(hs, &self.shared.published(Some(name), None), self.cfg.handshake_timeout)?;
        let ours = self.transport()?.protocol();
        if desc.protocol != ours {
            return Err(crate::proto::ProtoError::InvalidDescriptor(format!(
                "segment {name} speaks {:?}, this engine's transport {ours:?}",
                desc.protocol
            ))
            .into());
        }
        let data_addr = SocketAddr::new(hs.ip(), desc.tcp_data_port);
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let id = match names.get(name) {
            Some(id) => *id,
            None => {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                names.insert(name.to_string(), id);
                // A peer this side chose: its address is no stranger's at accept.
                self.shared.choose(hs.ip(), true);
                id
            }
        };
        let proto = desc.proto_version();
        tracing::debug!(name, id, ?proto, buffers = desc.buffers.len(), "opened segment");
        let seg = Arc::new(RemoteSegment { id, desc, data_addr, proto });
        self.segments.write().unwrap_or_else(|e| e.into_inner()).insert(id, seg);
        Ok(id)
    }

    fn segment_info(&self, id: SegmentId) -> Result<SegmentInfo, EngineError> {
        let s = self.segment(id)?;
        Ok(SegmentInfo { id, desc: s.desc.clone(), proto: s.proto, data_addr: s.data_addr })
    }

    fn close_segment(&self, id: SegmentId) -> Result<(), EngineError> {
        let mut segs = self.segments.write().unwrap_or_else(|e| e.into_inner());
        let s = segs.get(&id).ok_or(EngineError::UnknownSegment(id))?;
        if Arc::strong_count(s) > 1 {
            return Err(EngineError::SegmentBusy(id));
        }
        let ip = client::resolve_segment(&s.desc.name).ok().map(|a| a.ip());
        segs.remove(&id);
        drop(segs);
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let before = names.len();
        names.retain(|_, v| *v != id);
        if names.len() < before {
            if let Some(ip) = ip {
                self.shared.choose(ip, false);
            }
        }
        drop(names);
        if let Ok(t) = self.transport() {
            t.forget_segment(id);
        }
        Ok(())
    }

    fn allocate_batch_id(&self, batch_size: usize) -> Result<BatchId, EngineError> {
        if batch_size == 0 {
            return Err(EngineError::ZeroBatchSize);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.batches.lock().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::new(BatchState::new(id, batch_size)));
        Ok(id)
    }

    fn submit_transfer(
        &self,
        batch: BatchId,
        requests: &[TransferRequest],
    ) -> Result<std::ops::Range<usize>, EngineError> {
        let transport = self.transport()?.clone();
        let b = self.batch(batch)?;
        let mut prepared = Vec::with_capacity(requests.len());
        for r in requests {
            if r.length == 0 {
                return Err(EngineError::ZeroLength);
            }
            let mut seg = self.segment(r.target_id)?;
            if self.cfg.check_remote_bounds && seg.desc.buffer_containing(r.target_offset, r.length).is_none() {
                // An RDMA target publishes a key per exposure: what it
                // granted since we fetched its metadata is in a fresh copy.
                if transport.protocol() == "rdma" && self.open_segment(&seg.desc.name).is_ok() {
                    seg = self.segment(r.target_id)?;
                }
            }
            if self.cfg.check_remote_bounds && seg.desc.buffer_containing(r.target_offset, r.length).is_none() {
                return Err(EngineError::TargetOutOfRange {
                    segment: r.target_id,
                    addr: r.target_offset,
                    len: r.length,
                });
            }
            let local = self
                .registry
                .acquire(r.source, r.length)
                .ok_or(EngineError::SourceNotRegistered { addr: r.source, len: r.length })?;
            prepared.push((r, seg, local));
        }
        let protos: Vec<ProtoVersion> = prepared.iter().map(|(_, s, _)| s.proto).collect();
        let first = b.reserve(&protos)?;
        for (i, (r, seg, local)) in prepared.into_iter().enumerate() {
            transport.submit(TransportWork {
                opcode: r.opcode,
                local,
                local_addr: r.source,
                remote: seg,
                remote_addr: r.target_offset,
                len: r.length,
                completion: Completion::new(b.clone(), first + i),
            });
        }
        Ok(first..first + requests.len())
    }

    fn get_transfer_status(&self, batch: BatchId, task: usize) -> Result<TaskStatus, EngineError> {
        self.batch(batch)?.status(task, self.cfg.transfer_timeout)
    }

    fn wait_transfer(&self, batch: BatchId, task: usize, wait: Duration) -> Result<TaskStatus, EngineError> {
        self.batch(batch)?.wait(task, wait, self.cfg.transfer_timeout)
    }

    fn batch_hooks(&self) -> bool {
        true
    }

    fn on_batch_finished(&self, batch: BatchId, hook: BatchHook) -> Result<(), EngineError> {
        self.batch(batch)?.on_finished(hook, Arc::downgrade(&self.batches))
    }

    fn free_batch_id(&self, batch: BatchId) -> Result<(), EngineError> {
        let mut map = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        let b = map.get(&batch).ok_or(EngineError::UnknownBatch(batch))?;
        b.try_free().map_err(|unfinished| EngineError::BatchBusy { batch, unfinished })?;
        map.remove(&batch);
        Ok(())
    }

    fn send_notify(&self, target: SegmentId, msg: &str) -> Result<(), EngineError> {
        let seg = self.segment(target)?;
        let hs = client::resolve_segment(&seg.desc.name).or_else(|_| {
            let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            let n = names.iter().find(|(_, v)| **v == target).map(|(k, _)| k.clone());
            drop(names);
            n.ok_or(EngineError::UnknownSegment(target)).and_then(|n| client::resolve_segment(&n))
        })?;
        // Sealed to another kv-transfer engine, so its adapter knows who
        // sent it; plain to a real Mooncake engine, whose wire it must stay.
        if seg.desc.kvt_notify_auth.is_some() {
            return self.shared.auth.send(hs, &seg.desc.name, msg, self.cfg.handshake_timeout);
        }
        client::send_notify(hs, &NotifyDesc::new(&self.shared.segment_name, msg), self.cfg.handshake_timeout)
    }

    fn get_notifies(&self) -> Vec<NotifyDesc> {
        self.shared.notifies.lock().unwrap_or_else(|e| e.into_inner()).drain()
    }

    fn set_notify_waker(&self, wake: NotifyWaker) -> bool {
        self.shared.notify_waker.set(wake);
        true
    }

    fn serve_exposed_only(&self) -> bool {
        self.shared.ranges.restrict()
    }

    fn expose_range(&self, addr: u64, len: u64, access: RangeAccess) -> Result<Option<RangeId>, EngineError> {
        self.shared.ranges.open(addr, len, access).map(Some)
    }

    fn unexpose_range(&self, id: RangeId) -> bool {
        self.shared.ranges.close(id)
    }
}

#[cfg(test)]
mod mock_tests {
    use super::*;
    use crate::batch::TransferStatus;

    /// The mock can play the real engine at its worst: TIMEOUT forever and
    /// free refused, which an adapter must survive without releasing memory.
    #[test]
    fn mock_engine_timeout_forever() {
        let mut m = MockTransferEngine::new();
        m.expect_allocate_batch_id().returning(|_| Ok(7));
        m.expect_submit_transfer().returning(|_, r| Ok(0..r.len()));
        m.expect_get_transfer_status().returning(|_, _| {
            Ok(TaskStatus {
                status: TransferStatus::Timeout,
                transferred_bytes: 0,
                error: None,
                proto: ProtoVersion::V2,
            })
        });
        m.expect_free_batch_id().returning(|b| Err(EngineError::BatchBusy { batch: b, unfinished: 1 }));
        let e: &dyn TransferEngine = &m;
        let b = e.allocate_batch_id(1).unwrap();
        let req = TransferRequest { opcode: TcpOpcode::Write, source: 1, target_id: 1, target_offset: 1, length: 1 };
        assert_eq!(e.submit_transfer(b, &[req]).unwrap(), 0..1);
        for _ in 0..100 {
            assert!(!e.get_transfer_status(b, 0).unwrap().status.is_finished());
        }
        assert!(matches!(e.free_batch_id(b), Err(EngineError::BatchBusy { .. })));
    }
}
