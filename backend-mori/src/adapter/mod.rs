//! [`MoriTransfer`]: kv-transfer's [`Transfer`] over an [`IoEngine`].
//!
//! # Initiator
//!
//! [`Transfer::post`] checks shapes, takes the lease only if its pool was
//! registered here ([`MoriTransfer::register_pool`]), exposes it locally to
//! the peer and posts **one MORI transfer per slot** (`write` / `read` for a
//! one-slot lease, else one `batch_write` / `batch_read` call) with the
//! [`Tag`] of the *remote* tenancy. MORI has no
//! cancel, so there is none here: [`TransferHandle::cancel`] is recorded and
//! ignored, and the operation is drained. Every status gets an
//! [`TransferStatus::on_complete`] callback (no thread waits, nothing spins);
//! when every status of the operation is terminal the adapter mints
//! `Completed` for the local lease and completes the handle, with `Ok` only if
//! every status was `SUCCESS`. `IN_PROGRESS` is never terminal: such an
//! operation stays in the adapter's drain table (its lease with it) for as
//! long as it takes. A status with a code the engine does not know
//! ([`StatusCode::Unknown`]) proves nothing, so the adapter fences the peer
//! and completes the operation with a `Fenced` proof and an error; if the
//! fence fails, the operation stays parked. A dropped [`TransferHandle`]
//! changes nothing: the [`kv_transfer_core::Completer`] lives in the drain
//! table and returns the lease to the pool when the proof arrives.
//!
//! # Target
//!
//! [`MoriTransfer::expose`] grants the peer access per slot and generation
//! (a no-op on MORI, a binding at the simulated NIC over
//! [`crate::sim::SimTransport`]) and describes the slots. Exposures settle
//! from inbound statuses (the engine's notifications, success **and**
//! failure, carrying the tag): the tag names memory, slot and generation; a
//! tenancy that is not exposed to that peer under that generation is dropped
//! and counted (`stale_rejected` in the pool's metrics).
//!
//! A *failed* inbound status settles too (`Completed`): the engine sends it
//! only after it observed every operation of that transfer terminal, error
//! completions included, and an error completion is terminal (the operation
//! no longer touches memory). The adapter posts at most one transfer per
//! remote tenancy at a time and refuses a second post to a tenancy whose
//! transfer asked the target to settle or that the target aborted, so no
//! other operation of this initiator can still be aimed at it. An inbound
//! status with an unknown code settles nothing. Settlement is about memory
//! safety, not data: a slot settled from a failure does not hold the peer's
//! bytes, and [`MoriTransfer::settled_by_failure`] says so (and
//! [`AdapterStats::inbound_failed`] counts it).
//!
//! # Escalation
//!
//! The pool's quarantine hook wakes the adapter's driver thread, which walks
//! core's ladder and never frees on a timer:
//!
//! - `RequestDrain`: ABORT(tenancies) to the peer as a control message. The
//!   peer's adapter tombstones the tenancies (no new post to them), waits
//!   until its transfers on them are terminal and answers ABORT_ACK; the ack
//!   settles them (`Completed`).
//! - `Revoke`: [`IoEngine::revoke_access`] per tenancy; `Revoked` for those
//!   the transport confirmed (the simulator's NIC does; MORI cannot).
//! - `Fence`: [`IoEngine::fence_remote_engine`]; on success `Fenced` for
//!   every exposure to the peer, in every pool of this adapter. After a
//!   fence, call [`MoriTransfer::add_peer`] again to reconnect.
//! - `Exhausted`: logged; the slots stay quarantined (a leak, never a reuse).
//!
//! # Layout
//!
//! This file holds the public types ([`MoriTransfer`], [`AdapterStats`],
//! [`AdapterError`]), construction, the management calls, and the
//! [`PostNow`] / [`Target`] impls. The rest lives in one module per job:
//! `wire` (tags and endpoint strings), `state` (the shared tables and
//! their lookups), `post` (the initiator: posting and per-op status
//! tracking), `target` (settlement from inbound statuses, control
//! messages, escalation) and `driver` (the driver thread and its queue).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread;

use kv_transfer_core::drain::{Capabilities, Driver, ExposureToken, ReleasePolicy, Trust};
use kv_transfer_core::{
    BackendError, Exposed, Op, PeerId, PoolConfig, PoolError, PostError, PostNow, Region, RemoteSlots, Reserved,
    SlotLease, SlotPool, Target, Tenancy, TransferHandle, TransferOptions,
};
// Named in the docs; the impl comes from `impl_transfer_via_post_now!`.
#[cfg(doc)]
use kv_transfer_core::Transfer;

use crate::engine::IoEngine;
use crate::error::EngineError;
// Named in the docs.
use crate::types::{EngineDesc, EngineKey, InboundStatus, MemoryDesc, MemoryLocation, MemoryRegion};
use crate::util::lock;
#[cfg(doc)]
use crate::{
    status::{StatusCode, TransferStatus},
    types::Tag,
};

mod driver;
mod post;
mod state;
mod target;
#[cfg(test)]
mod tests;
mod wire;

use driver::{driver_loop, Job, Jobs};
use post::OpTable;
use state::{inc, Counters, Inner, OpHub, PeerTable, PoolEntry, Routes};
#[cfg(feature = "sim")]
pub(crate) use wire::pack_tag;
use wire::{encode_endpoint, TAG_SETTLE};

/// Name of this backend in [`Transfer::backend`].
pub const BACKEND: &str = "mori";
/// Tombstoned remote tenancies remembered (oldest forgotten first).
const TOMBSTONES: usize = 1 << 16;

/// Counters of a [`MoriTransfer`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdapterStats {
    /// Operations posted (handles returned).
    pub posts: u64,
    /// MORI transfers submitted (one per slot).
    pub transfers: u64,
    /// Transfers that ended in `SUCCESS`.
    pub transfers_succeeded: u64,
    /// Transfers that ended in a known error.
    pub transfers_failed: u64,
    /// Transfers whose code was unknown (not terminal; the peer was fenced).
    pub transfers_unknown: u64,
    /// Operations completed.
    pub ops_completed: u64,
    /// Operations still draining (not every status terminal yet).
    pub ops_draining: u64,
    /// Target: inbound statuses that settled an exposure.
    pub inbound_settled: u64,
    /// Target: inbound statuses dropped as stale (tenancy not exposed to that
    /// peer under that generation, or already settled).
    pub inbound_stale: u64,
    /// Target: inbound statuses with an unknown code (settle nothing).
    pub inbound_unknown: u64,
    /// Target: of the settled ones, those whose transfer failed (the slot is
    /// settled, its bytes are not the peer's data; see [`MoriTransfer::settled_by_failure`]).
    pub inbound_failed: u64,
    /// Target: inbound statuses of transfers posted without `notify`.
    pub inbound_no_settle: u64,
    /// Target: ABORT messages sent.
    pub aborts_sent: u64,
    /// Target: ABORT_ACK messages received.
    pub abort_acks_received: u64,
    /// Initiator: ABORT messages received.
    pub aborts_received: u64,
    /// Initiator: ABORT_ACK messages sent.
    pub abort_acks_sent: u64,
    /// Target: tenancies settled by a confirmed revocation.
    pub revoked: u64,
    /// Peers fenced (escalation or unknown status).
    pub fences: u64,
    /// Peers whose connection the transport reported lost (settled `Fenced`).
    pub peers_lost: u64,
    /// Posts refused because the remote tenancy was tombstoned or busy.
    pub posts_refused_tombstone: u64,
}

/// Why [`MoriTransfer::expose`] refused (core's one type; the lease comes back unexposed).
pub use kv_transfer_core::{ExposeError, ExposeErrorKind};

/// Errors of adapter management calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterError {
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The engine refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The region is not host memory or has no host pointer.
    #[error("unsupported region: {0}")]
    Region(String),
}

/// kv-transfer's [`Transfer`] over a MORI-shaped [`IoEngine`]; see the
/// [module docs](self). Cheap to clone; the driver thread stops when the last
/// clone is dropped.
#[derive(Clone)]
pub struct MoriTransfer {
    inner: Arc<Inner>,
    _owner: Arc<Owner>,
}

struct Owner {
    inner: Arc<Inner>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.inner.engine.set_inbound_hook(None);
        self.inner.engine.set_message_hook(None);
        self.inner.engine.set_peer_lost_hook(None);
        lock(&self.inner.hub.jobs.m).shutdown = true;
        self.inner.hub.jobs.cv.notify_all();
    }
}

impl fmt::Debug for MoriTransfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MoriTransfer").field("engine", &self.inner.engine.key()).finish()
    }
}

impl MoriTransfer {
    /// An adapter over `engine`, whose transport can prove `caps` (the
    /// simulator's: [`crate::sim::CAPABILITIES`]; real MORI over RDMA has
    /// none beyond drain and ack). Installs the engine's inbound and message
    /// hooks and starts the driver thread (inbound settlement, ABORT /
    /// ABORT_ACK, escalation). The pools' ladders hold only `caps`' steps.
    pub fn new(engine: Arc<dyn IoEngine>, caps: Capabilities) -> Result<Self, AdapterError> {
        let jobs = Arc::new(Jobs::default());
        let drain = Driver::new(caps, ReleasePolicy::Safe);
        let drain_counters = drain.counters();
        let inner = Arc::new(Inner {
            routes: RwLock::new(Routes { peers: PeerTable { next: 1, ..PeerTable::default() }, ..Routes::default() }),
            failed: Mutex::default(),
            engine,
            hub: Arc::new(OpHub {
                ops: Mutex::new(OpTable::default()),
                jobs: jobs.clone(),
                counters: Counters::default(),
            }),
            drain: Mutex::new(drain),
            drain_counters,
            caps,
        });
        let j = jobs.clone();
        let hub = inner.hub.clone();
        inner.engine.set_inbound_hook(Some(Arc::new(move |st: InboundStatus| {
            if st.tag.slot & TAG_SETTLE == 0 {
                // Nothing to settle: counted here, on the engine's thread
                // (no lock, no blocking), instead of waking the driver.
                inc(&hub.counters.inbound_no_settle);
            } else {
                j.push(Job::Filed(st));
            }
            None
        })));
        let j = jobs.clone();
        inner.engine.set_message_hook(Some(Arc::new(move |from, bytes| j.push(Job::Message(from, bytes)))));
        let j = jobs.clone();
        inner.engine.set_peer_lost_hook(Some(Arc::new(move |peer| j.push(Job::PeerLost(peer)))));
        let weak = Arc::downgrade(&inner);
        thread::Builder::new()
            .name(format!("mori-adapter-{}", inner.engine.key()))
            .spawn(move || driver_loop(weak, jobs))
            .map_err(|e| AdapterError::Engine(EngineError::BadState(format!("cannot start driver: {e}"))))?;
        Ok(Self { _owner: Arc::new(Owner { inner: inner.clone() }), inner })
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<dyn IoEngine> {
        &self.inner.engine
    }

    /// Registers `region` with the engine (host memory as external memory,
    /// device memory through its own copies, with the slot size declared)
    /// and builds its pool. The adapter keeps the pool's settlement
    /// authority. A transport that cannot reach device memory (the loopback)
    /// refuses it.
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        let slot_size = config.slot_size as u64;
        let (pool, authority) = SlotPool::new(region.clone(), config.with_capabilities(self.inner.caps))?;
        let mem = if region.host_ptr().is_some() {
            // SAFETY: `region` is kept alive by the pool, which this adapter
            // keeps while the memory is registered (registrations are never
            // removed while the adapter lives), and the pool's leases keep the
            // application away from bytes an operation may touch.
            // The registration keeps the region allocated for as long as a NIC
            // binds it, whatever is dropped first (rule 8).
            let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(region.clone());
            unsafe { MemoryRegion::external(region.addr(), region.len() as u64, MemoryLocation::Cpu, -1) }
                .with_owner(owner)
        } else {
            MemoryRegion::of_region(region.clone())
        }
        .with_slot_size(slot_size);
        let desc = self.inner.engine.register_memory(mem)?;
        let jobs = self.inner.hub.jobs.clone();
        authority.on_quarantine(move || jobs.kick());
        lock(&self.inner.drain).add_pool(authority.clone());
        let entry = Arc::new(PoolEntry { pool: pool.clone(), authority, desc, slot_size });
        self.inner.routes_mut().pools.push(entry);
        Ok(pool)
    }

    /// The engine's descriptor of a pool's memory.
    pub fn memory_desc(&self, pool: &SlotPool) -> Option<MemoryDesc> {
        self.inner.pool_entry(pool.id()).map(|e| e.desc.clone())
    }

    /// Registers a peer engine (connects the transport) and numbers it.
    /// Calling it again for the same key (after a fence) reconnects and keeps
    /// the number.
    pub fn add_peer(&self, desc: &EngineDesc) -> Result<PeerId, AdapterError> {
        self.inner.engine.register_remote_engine(desc)?;
        let mut routes = self.inner.routes_mut();
        let peers = &mut routes.peers;
        if let Some(p) = peers.by_key.get(&desc.key) {
            return Ok(*p);
        }
        let id = PeerId(peers.next);
        peers.next += 1;
        peers.by_key.insert(desc.key.clone(), id);
        peers.by_id.insert(id, desc.key.clone());
        Ok(id)
    }

    /// The number of a peer added earlier.
    pub fn peer_id(&self, key: &EngineKey) -> Option<PeerId> {
        self.inner.peer_id(key)
    }

    /// Target side: grants `peer` access to the lease's slots under their
    /// generations and exposes the lease to it. The descriptor's endpoint
    /// names this engine's memory; hand it to the peer.
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let Some(entry) = self.inner.pool_entry(lease.pool().id()) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ForeignPool });
        };
        let Some(key) = self.inner.peer_key(peer) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::UnknownPeer(peer) });
        };
        let ts = lease.tenancies().to_vec();
        // Each tenancy's own key, where the transport keys them (verbs: a
        // memory window per tenancy).
        let mut keys = Vec::with_capacity(ts.len());
        for (i, t) in ts.iter().enumerate() {
            match self.inner.engine.grant_access(&entry.desc, &key, t.slot.0, t.generation.0) {
                Ok(k) => keys.push(k),
                Err(e) => {
                    for u in &ts[..i] {
                        let _ = self.inner.engine.withdraw_access(&entry.desc, u.slot.0, u.generation.0);
                    }
                    return Err(ExposeError { lease, kind: ExposeErrorKind::Engine(e.to_string()) });
                }
            }
        }
        // The pool's mark first, the drain table's record after (see
        // `Driver::expose_with`): the driver may be handling this peer's
        // loss right now, and its fence must either cover the mark or find
        // the record.
        let token = ExposureToken::random();
        let (exposed, mut remote) =
            entry.authority.expose(lease, peer, entry.desc.rkey, encode_endpoint(&entry.desc), token);
        lock(&self.inner.drain).expose_with(entry.pool.id(), &ts, peer, Trust::Proving, token);
        for (s, k) in remote.slots.iter_mut().zip(keys) {
            s.key = k;
        }
        Ok((exposed, remote))
    }

    /// Counters.
    pub fn stats(&self) -> AdapterStats {
        let c = &self.inner.hub.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ops = lock(&self.inner.hub.ops);
        let d = self.inner.drain_counters.snapshot();
        AdapterStats {
            posts: ops.posts,
            transfers: ops.transfers,
            transfers_succeeded: ops.transfers_succeeded,
            transfers_failed: l(&c.transfers_failed),
            transfers_unknown: l(&c.transfers_unknown),
            ops_completed: ops.ops_completed,
            ops_draining: ops.posts.saturating_sub(ops.ops_completed),
            inbound_settled: l(&c.inbound_settled),
            inbound_stale: l(&c.inbound_stale),
            inbound_unknown: l(&c.inbound_unknown),
            inbound_failed: l(&c.inbound_failed),
            inbound_no_settle: l(&c.inbound_no_settle),
            aborts_sent: d.aborts_sent,
            abort_acks_received: d.abort_acks_received,
            aborts_received: l(&c.aborts_received),
            abort_acks_sent: l(&c.abort_acks_sent),
            revoked: d.revoked,
            fences: d.fences,
            peers_lost: l(&c.peers_lost),
            posts_refused_tombstone: l(&c.posts_refused_tombstone),
        }
    }

    /// Whether tenancy `t` of `pool` was settled from a *failed* inbound
    /// status: the slot is safe to reuse or read (no NIC touches it), but it
    /// does not hold the peer's data. Settlement is about memory safety, not
    /// data validity; the last 65536 such tenancies are remembered.
    pub fn settled_by_failure(&self, pool: &SlotPool, t: Tenancy) -> bool {
        lock(&self.inner.failed).set.contains(&(pool.id(), t))
    }

    /// Wakes the driver now (after advancing a manual clock).
    pub fn kick(&self) {
        self.inner.hub.jobs.kick();
    }
}

impl PostNow for MoriTransfer {
    /// Posts one MORI transfer per slot and returns at once; the handle
    /// resolves when every status is terminal (see the module docs).
    fn post_now(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        self.post_inner(op, local, remote, opts)
    }
}

kv_transfer_core::impl_transfer_via_post_now!(MoriTransfer, BACKEND);

/// The target side every backend shares. A peer's descriptor is its
/// engine's [`EngineDesc`] (JSON: [`MoriTransfer::local_descriptor`]).
impl Target for MoriTransfer {
    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        MoriTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            AdapterError::Region(m) => BackendError::Unsupported(m),
            e => BackendError::Engine { backend: BACKEND, message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        serde_json::to_vec(&self.inner.engine.engine_desc())
            .map_err(|e| BackendError::Engine { backend: BACKEND, message: e.to_string() })
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        let desc: EngineDesc = serde_json::from_slice(descriptor)
            .map_err(|e| BackendError::Peer(format!("not an engine descriptor: {e}")))?;
        MoriTransfer::add_peer(self, &desc).map_err(|e| BackendError::Peer(e.to_string()))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        MoriTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        let m = self.stats();
        kv_transfer_core::named_counters!(m; posts, transfers, transfers_succeeded, transfers_failed,
            transfers_unknown, ops_completed, ops_draining, inbound_settled, inbound_stale, inbound_unknown,
            inbound_failed, inbound_no_settle, aborts_sent, abort_acks_received, aborts_received, abort_acks_sent,
            revoked, fences, peers_lost, posts_refused_tombstone)
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    use kv_transfer_core::drain::{ControlKind, ControlMessage};
    use kv_transfer_core::{PoolId, Tenancy};

    /// An ABORT message as a target adapter sends it (for the target's `pool`).
    pub(crate) fn abort_bytes(pool: PoolId, ts: &[Tenancy]) -> Vec<u8> {
        ControlMessage::new(ControlKind::Abort, pool, Default::default(), ts.to_vec()).encode().expect("encodes")
    }
}
