//! Mooncake's RDMA transport, over the verbs engine layer of
//! `backend-verbs` (feature `rdma`).
//!
//! The initiator half, [`RdmaTransport`], is a [`DataTransport`]: the batch
//! logic and the adapter above it are the ones the TCP transport has. Per
//! target segment it pairs [`QPS_PER_ENDPOINT`] RC queue pairs through the
//! P2P handshake's Connection exchange (see [`crate::proto::rdma`]), cuts
//! each task into [`SLICE_SIZE`] slices, posts each as one signaled WRITE
//! or READ under the key the segment's metadata gives for the device, and
//! reports the task once **every slice it posted has completed**: the
//! completion of the last one is the proof that the NIC will not touch the
//! task's memory again, so a failed slice fails the task only after the
//! others have completed or been flushed. No timer reports a task: a dead
//! peer ends the slices through the transport's own retries
//! (`retry_cnt`), which is a completion too.
//!
//! What a failure proves is kept apart (it decides whether an ABORT_ACK may
//! be sent for the task): a slice the target's NIC refused
//! (`REM_ACCESS_ERR`) was not placed, and its queue pair's responder went to
//! ERR with it, so the slices flushed behind it on that queue pair were not
//! placed either; those are posted again on a fresh pairing, **under the
//! key they had** (never one fetched since: that is the retry hazard of
//! DESIGN, "Peers that retry after a revocation"), and the task fails
//! [`TaskError::RemoteAccess`]. Any other error (the peer gone, retries run
//! out) moves the endpoint's queue pairs to ERR, and what was flushed then
//! proves nothing about packets already on the wire:
//! [`TaskError::Rdma`].
//!
//! One driver thread (`driver`) owns the queue pairs and the in-flight
//! table, so the lifecycle of a task and of each queue pair is an explicit
//! enum changed in one place.

mod driver;
mod target;

use driver::Driver;

pub use target::{GrantId, Publish, RdmaTarget, RdmaTargetConfig, MAX_PEERS, MAX_PEERS_PER_ADDR};

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use backend_verbs::Engine;
use kv_transfer_core::{MemoryKind, Region, RegionError};

use crate::error::{EngineError, TaskError};
#[cfg(doc)]
use crate::proto::rdma::{QPS_PER_ENDPOINT, SLICE_SIZE};
use crate::transport::{DataTransport, TransportWork};

/// Options of the RDMA transport.
#[derive(Debug, Clone)]
pub struct RdmaTransportConfig {
    /// Our segment name (`host:port` of our handshake server), the first
    /// half of our NIC path; [`RdmaTransport::set_local_segment`] sets it
    /// once the engine listens ([`rdma_engine`] does).
    pub local_segment: String,
    /// The verbs device the engine was opened on (`rxe_lo`), the second half.
    pub device: String,
    /// Path MTU offered (Mooncake: min(active, 4096)).
    pub mtu: u32,
    /// Handshake (Connection exchange) timeout.
    pub handshake_timeout: Duration,
    /// Work requests posted and not yet completed, per queue pair
    /// (Mooncake's max_wr is 256).
    pub max_wr_per_qp: usize,
    /// How long a drop of the transport waits for posted slices to
    /// complete (flushed) before it parks their tasks for good.
    pub drain_on_drop: Duration,
}

impl Default for RdmaTransportConfig {
    fn default() -> Self {
        Self {
            local_segment: String::new(),
            device: String::new(),
            mtu: 4096,
            handshake_timeout: Duration::from_secs(5),
            max_wr_per_qp: 256,
            drain_on_drop: Duration::from_secs(10),
        }
    }
}

/// The task's memory as the verbs engine registers it: the range the
/// caller vouched for when it registered it with the engine
/// ([`crate::MemoryRegion`]), held registered by the task's
/// [`crate::memory::RegionGuard`] until the last slice completed.
#[derive(Debug)]
struct VouchedRange {
    addr: u64,
    len: usize,
}

impl Region for VouchedRange {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        check(offset, dst.len(), self.len)?;
        // SAFETY: in range of memory the caller vouched for (see the module
        // docs of `memory`); a software NIC copies through here.
        unsafe {
            std::ptr::copy_nonoverlapping((self.addr as usize + offset) as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        check(offset, src.len(), self.len)?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (self.addr as usize + offset) as *mut u8, src.len()) };
        Ok(())
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        NonNull::new(self.addr as usize as *mut u8)
    }
}

fn check(offset: usize, len: usize, region_len: usize) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionError::OutOfBounds { offset, len, region_len }),
    }
}

#[derive(Debug, Default)]
struct Inbox {
    items: VecDeque<TransportWork>,
    forget: Vec<u64>,
    closed: bool,
}

struct Shared {
    engine: Arc<dyn Engine>,
    cfg: RdmaTransportConfig,
    /// Our segment name (known once the engine's handshake port is bound).
    local_segment: Mutex<String>,
    inbox: Mutex<Inbox>,
    wake: Condvar,
    /// Slices the target's NIC refused (`REM_ACCESS_ERR`).
    refused_slices: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

/// Mooncake's RDMA transport, initiator side (see the module docs).
#[derive(Debug)]
pub struct RdmaTransport {
    shared: Arc<Shared>,
    driver: Mutex<Option<JoinHandle<()>>>,
}

impl RdmaTransport {
    /// Starts the driver over `engine` (which this transport polls: give it
    /// an engine of its own).
    pub fn new(engine: Arc<dyn Engine>, cfg: RdmaTransportConfig) -> std::io::Result<Self> {
        let local_segment = Mutex::new(cfg.local_segment.clone());
        let shared = Arc::new(Shared {
            engine,
            cfg,
            local_segment,
            inbox: Mutex::default(),
            wake: Condvar::new(),
            refused_slices: Default::default(),
        });
        let sh = Arc::clone(&shared);
        let driver = std::thread::Builder::new().name("mc-rdma".into()).spawn(move || Driver::new(sh).run())?;
        Ok(Self { shared, driver: Mutex::new(Some(driver)) })
    }
}

impl RdmaTransport {
    /// Slices the target's NIC refused so far (`REM_ACCESS_ERR`: a key that
    /// ended, or a range it does not cover).
    pub fn refused_slices(&self) -> u64 {
        self.shared.refused_slices.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets our segment name (the engine's, once it listens).
    pub fn set_local_segment(&self, name: &str) {
        *lock(&self.shared.local_segment) = name.to_string();
    }
}

/// The verbs engines of one Mooncake engine over RDMA: the initiator's
/// transport polls its own; the target's queue pairs and memory regions live
/// on the other (both on one device, in practice).
#[derive(Clone)]
pub struct RdmaNics {
    /// For [`RdmaTransport`].
    pub initiator: Arc<dyn Engine>,
    /// For [`RdmaTarget`].
    pub target: Arc<dyn Engine>,
}

/// The two halves of Mooncake over RDMA, before an engine holds them.
#[derive(Debug)]
pub struct RdmaParts {
    /// The target half: give it to the engine as its
    /// [`target_hook`](crate::EngineConfig::target_hook) (and to the adapter
    /// as its keys, with [`Publish::Grants`]).
    pub target: Arc<RdmaTarget>,
    /// The initiator half: the engine's transport (behind a
    /// `gate::GatedTransport`, for races). Tell it
    /// the engine's segment name once the engine listens.
    pub transport: Arc<RdmaTransport>,
}

impl RdmaParts {
    /// Both halves on `nics`, on the device named `device` (the name peers
    /// see), the target publishing `publish`.
    pub fn new(
        nics: RdmaNics,
        device: &str,
        publish: Publish,
        handshake_timeout: Duration,
    ) -> Result<Self, EngineError> {
        Self::with_target_config(
            nics,
            RdmaTargetConfig { device: device.into(), publish, ..Default::default() },
            handshake_timeout,
        )
    }

    /// Both halves on `nics`, the target configured by `target` (its
    /// device the name peers see).
    pub fn with_target_config(
        nics: RdmaNics,
        target: RdmaTargetConfig,
        handshake_timeout: Duration,
    ) -> Result<Self, EngineError> {
        let device = target.device.clone();
        let target = RdmaTarget::new(nics.target, target);
        let tcfg = RdmaTransportConfig { device, handshake_timeout, ..Default::default() };
        let transport =
            Arc::new(RdmaTransport::new(nics.initiator, tcfg).map_err(|e| EngineError::io("start RDMA transport", e))?);
        Ok(Self { target, transport })
    }

    /// The engine over `transport` (these parts' own, or a wrapper of it),
    /// its target hook these parts' target.
    pub fn engine(
        &self,
        cfg: crate::EngineConfig,
        transport: Arc<dyn DataTransport>,
    ) -> Result<crate::MooncakeEngine, EngineError> {
        let hook: Arc<dyn crate::TargetHook> = self.target.clone();
        let engine =
            crate::MooncakeEngine::with_transport(crate::EngineConfig { target_hook: Some(hook), ..cfg }, transport)?;
        self.transport.set_local_segment(&crate::TransferEngine::local_segment_name(&engine));
        Ok(engine)
    }
}

/// A Mooncake engine that speaks RDMA both ways: our initiator over
/// [`RdmaTransport`], our target's Connection exchange and metadata through
/// [`RdmaTarget`] publishing `publish`, on the device named `device` (the
/// name peers see).
pub fn rdma_engine(
    cfg: crate::EngineConfig,
    nics: RdmaNics,
    device: &str,
    publish: Publish,
) -> Result<(crate::MooncakeEngine, Arc<RdmaTarget>), EngineError> {
    let parts = RdmaParts::new(nics, device, publish, cfg.handshake_timeout)?;
    let engine = parts.engine(cfg, parts.transport.clone())?;
    Ok((engine, parts.target))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        lock(&self.shared.inbox).closed = true;
        self.shared.wake.notify_all();
        if let Some(d) = lock(&self.driver).take() {
            let _ = d.join();
        }
    }
}

impl DataTransport for RdmaTransport {
    fn protocol(&self) -> &'static str {
        "rdma"
    }

    fn submit(&self, work: TransportWork) {
        let mut inbox = lock(&self.shared.inbox);
        if inbox.closed {
            drop(inbox);
            work.completion.finish(Err(TaskError::Dropped));
            return;
        }
        inbox.items.push_back(work);
        drop(inbox);
        self.shared.wake.notify_one();
    }

    fn forget_segment(&self, segment: u64) {
        lock(&self.shared.inbox).forget.push(segment);
        self.shared.wake.notify_one();
    }
}
