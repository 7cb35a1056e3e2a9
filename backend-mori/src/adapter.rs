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

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread;
use std::time::Duration;

use kv_transfer_core::drain::{
    self, AbortTracker, Capabilities, ControlKind, ControlMessage, ExposureTable, OpEnd, ReleasePolicy, Trust,
};
use kv_transfer_core::{
    check_shapes, BackendError, Completer, EscalationAction, Exposed, Generation, Op, PeerId, PoolConfig, PoolError,
    PoolId, PostError, PostErrorKind, PostNow, Region, RejectReason, RemoteSlots, Reserved, SettlementAuthority,
    SlotId, SlotLease, SlotPool, Target, Tenancy, TransferError, TransferHandle, TransferOptions,
};
// Named in the docs; the impl comes from `impl_transfer_via_post_now!`.
#[cfg(doc)]
use kv_transfer_core::Transfer;

use crate::engine::IoEngine;
use crate::error::EngineError;
use crate::status::{StatusCode, StatusListener, TransferStatus};
use crate::types::{
    BatchRequest, EngineDesc, EngineKey, InboundStatus, MemoryDesc, MemoryLocation, MemoryRegion, Segment, Tag,
};
use crate::util::{lock, HashMap, HashSet};
use smallvec::SmallVec;

/// Name of this backend in [`Transfer::backend`].
pub const BACKEND: &str = "mori";

/// Longest sleep of the driver between checks.
const DRIVER_TICK: Duration = Duration::from_millis(200);
/// Tombstoned remote tenancies remembered (oldest forgotten first).
const TOMBSTONES: usize = 1 << 16;
/// Decoded remote descriptors kept (see `Inner::endpoints`).
const MAX_ENDPOINTS: usize = 1024;

const TAG_SETTLE: u64 = 1 << 63;

/// The tag of a transfer aimed at remote tenancy `t` of memory `mem`:
/// `slot` = settle flag (bit 63) | memory id (bits 32..63) | slot index; the
/// generation as is.
pub(crate) fn pack_tag(mem: u32, t: Tenancy, settle: bool) -> Tag {
    let flag = if settle { TAG_SETTLE } else { 0 };
    Tag::new(flag | (u64::from(mem & 0x7FFF_FFFF) << 32) | u64::from(t.slot.0), t.generation.0)
}

/// `(settle, memory id, tenancy)` of a tag.
fn unpack_tag(tag: Tag) -> (bool, u32, Tenancy) {
    let settle = tag.slot & TAG_SETTLE != 0;
    let mem = ((tag.slot >> 32) & 0x7FFF_FFFF) as u32;
    (settle, mem, Tenancy::new(SlotId((tag.slot & 0xFFFF_FFFF) as u32), Generation(tag.generation)))
}

/// The endpoint string of [`RemoteSlots`] made by this adapter: what the
/// initiator needs to rebuild the target's [`MemoryDesc`] (the key travels
/// in [`RemoteSlots::key`]).
fn encode_endpoint(d: &MemoryDesc) -> String {
    let loc = match d.loc {
        MemoryLocation::Cpu => "cpu",
        MemoryLocation::Gpu => "gpu",
    };
    format!("mori:{}/{}/{}/{}/{}/{}", d.engine_key, d.id, d.addr, d.size, d.device_id, loc)
}

fn decode_endpoint(s: &str, rkey: u64) -> Option<MemoryDesc> {
    let s = s.strip_prefix("mori:")?;
    let mut it = s.rsplitn(6, '/');
    let loc = match it.next()? {
        "cpu" => MemoryLocation::Cpu,
        "gpu" => MemoryLocation::Gpu,
        _ => return None,
    };
    let device_id = it.next()?.parse().ok()?;
    let size = it.next()?.parse().ok()?;
    let addr = it.next()?.parse().ok()?;
    let id = it.next()?.parse().ok()?;
    let key = it.next()?;
    if key.is_empty() {
        return None;
    }
    Some(MemoryDesc { engine_key: EngineKey::new(key), id, device_id, addr, size, loc, rkey })
}

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

#[derive(Default)]
struct Counters {
    // posts, transfers, transfers_succeeded and ops_completed: in `OpTable`.
    transfers_failed: AtomicU64,
    transfers_unknown: AtomicU64,
    inbound_settled: AtomicU64,
    inbound_stale: AtomicU64,
    inbound_unknown: AtomicU64,
    inbound_failed: AtomicU64,
    inbound_no_settle: AtomicU64,
    aborts_sent: AtomicU64,
    abort_acks_received: AtomicU64,
    aborts_received: AtomicU64,
    abort_acks_sent: AtomicU64,
    revoked: AtomicU64,
    fences: AtomicU64,
    peers_lost: AtomicU64,
    posts_refused_tombstone: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
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

struct PoolEntry {
    pool: SlotPool,
    authority: SettlementAuthority,
    desc: MemoryDesc,
    slot_size: u64,
}

/// Remote tenancies of one post (one, usually: kept inline).
type Tenancies = SmallVec<[Tenancy; 2]>;

/// One posted operation, from post to proof.
struct OpState {
    /// The adapter's op table, queue and counters.
    hub: Arc<OpHub>,
    /// One lock for what the last status hands over: the completer and the
    /// first error.
    done: Mutex<OpDone>,
    remaining: AtomicUsize,
    unknown: AtomicBool,
    /// The op's id in the drain protocol's abort tracker.
    id: u64,
    peer: PeerId,
    /// The target's pool (what its ABORT names) and the exposure's token.
    remote_pool: PoolId,
    token: drain::ExposureToken,
    remote: Tenancies,
    settle: bool,
    pool: Arc<PoolEntry>,
}

struct OpDone {
    completer: Option<Completer>,
    error: Option<(StatusCode, String)>,
    /// Statuses that did not end in `SUCCESS`.
    failed: usize,
    /// The op's statuses, kept until it finishes: a status whose updater
    /// is gone (never terminal) keeps its listener, and with it this op and
    /// its lease, parked for good (a leak, never a reuse).
    statuses: SmallVec<[TransferStatus; 1]>,
}

impl OpState {
    /// What `finish` needs, taken once: the completer, the first error and
    /// how many statuses failed.
    fn take_done(&self) -> (Option<Completer>, Option<(StatusCode, String)>, usize) {
        let mut done = lock(&self.done);
        done.statuses.clear();
        (done.completer.take(), done.error.take(), done.failed)
    }
}

struct OpTable {
    /// Core's initiator side of the drain protocol: which remote tenancies
    /// have a transfer of ours in flight (at most one each), which were
    /// handed back or aborted, and which ABORTs wait for which ops.
    aborts: AbortTracker<PeerId>,
    next_op: u64,
    /// Ops whose status proved nothing and whose peer could not be fenced:
    /// kept (with their leases) for good.
    parked: Vec<Arc<OpState>>,
    /// The hot counters, kept under the lock every post and every finish
    /// takes anyway (atomics shared by the posting threads and the
    /// completing one would move a cache line per transfer).
    posts: u64,
    transfers: u64,
    transfers_succeeded: u64,
    ops_completed: u64,
}

impl Default for OpTable {
    fn default() -> Self {
        Self {
            aborts: AbortTracker::new(TOMBSTONES),
            next_op: 0,
            parked: Vec::new(),
            posts: 0,
            transfers: 0,
            transfers_succeeded: 0,
            ops_completed: 0,
        }
    }
}

enum Job {
    PeerLost(EngineKey),
    Filed(InboundStatus),
    Message(EngineKey, Vec<u8>),
    Fence(Arc<OpState>),
    /// An ABORT_ACK for a peer, by its number.
    SendTo(PeerId, ControlMessage),
}

#[derive(Default)]
struct JobQueue {
    q: VecDeque<Job>,
    kicked: bool,
    shutdown: bool,
}

#[derive(Default)]
struct Jobs {
    m: Mutex<JobQueue>,
    cv: Condvar,
}

impl Jobs {
    fn push(&self, j: Job) {
        let mut q = lock(&self.m);
        let was_empty = q.q.is_empty();
        q.q.push_back(j);
        drop(q);
        // The driver waits only on an empty queue.
        if was_empty {
            self.cv.notify_all();
        }
    }
    fn kick(&self) {
        lock(&self.m).kicked = true;
        self.cv.notify_all();
    }
}

#[derive(Default)]
struct PeerTable {
    by_key: HashMap<EngineKey, PeerId>,
    by_id: HashMap<PeerId, EngineKey>,
    next: u32,
}

/// Tenancies the target settled from a *failed* inbound status, remembered
/// (bounded) so the application can tell settled-but-not-written slots.
#[derive(Default)]
struct FailedSet {
    set: HashSet<(PoolId, Tenancy)>,
    order: VecDeque<(PoolId, Tenancy)>,
}

/// What a post looks up, behind one lock (one shared lock word taken per
/// post, not three).
#[derive(Default)]
struct Routes {
    pools: Vec<Arc<PoolEntry>>,
    /// Remote memory descriptors already decoded from an endpoint string,
    /// by key (a fresh registration gets a fresh key): a post then parses
    /// nothing. Bounded by the remote registrations this adapter was shown.
    endpoints: HashMap<u64, (String, MemoryDesc)>,
    peers: PeerTable,
}

impl Routes {
    /// The local pool, remote memory and peer of a post, if the endpoint
    /// was seen before.
    fn of_post(&self, pool: PoolId, endpoint: &str, rkey: u64) -> Option<(Arc<PoolEntry>, MemoryDesc, Option<PeerId>)> {
        let (e, d) = self.endpoints.get(&rkey)?;
        if e != endpoint {
            return None;
        }
        let entry = self.pools.iter().find(|e| e.pool.id() == pool)?;
        Some((entry.clone(), d.clone(), self.peers.by_key.get(&d.engine_key).copied()))
    }
}

struct Inner {
    routes: RwLock<Routes>,
    failed: Mutex<FailedSet>,
    engine: Arc<dyn IoEngine>,
    /// Shared with every operation (held strongly by each, so a
    /// completion reaches it without upgrading a weak reference).
    hub: Arc<OpHub>,
    /// Target side of core's drain protocol: every tenancy exposed to a
    /// peer, under its token.
    exposures: Mutex<ExposureTable>,
    /// What the transport lets this adapter prove (its pools' ladders).
    caps: Capabilities,
}

/// What an operation needs when its statuses end: the op table, the
/// driver's queue and the counters.
struct OpHub {
    ops: Mutex<OpTable>,
    jobs: Arc<Jobs>,
    counters: Counters,
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
        let inner = Arc::new(Inner {
            routes: RwLock::new(Routes { peers: PeerTable { next: 1, ..PeerTable::default() }, ..Routes::default() }),
            failed: Mutex::default(),
            engine,
            hub: Arc::new(OpHub {
                ops: Mutex::new(OpTable::default()),
                jobs: jobs.clone(),
                counters: Counters::default(),
            }),
            exposures: Mutex::new(ExposureTable::new()),
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

    /// Registers host memory `region` with the engine (external memory, with
    /// the slot size declared) and builds its pool. The adapter keeps the
    /// pool's settlement authority.
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        if region.host_ptr().is_none() {
            return Err(AdapterError::Region("only host memory with a host pointer is supported".into()));
        }
        let slot_size = config.slot_size as u64;
        let (pool, authority) = SlotPool::new(region.clone(), config.with_capabilities(self.inner.caps))?;
        // SAFETY: `region` is kept alive by the pool, which this adapter
        // keeps while the memory is registered (registrations are never
        // removed while the adapter lives), and the pool's leases keep the
        // application away from bytes an operation may touch.
        let mem = unsafe { MemoryRegion::external(region.addr(), region.len() as u64, MemoryLocation::Cpu, -1) }
            .with_slot_size(slot_size);
        let desc = self.inner.engine.register_memory(mem)?;
        let jobs = self.inner.hub.jobs.clone();
        authority.on_quarantine(move || jobs.kick());
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
        for (i, t) in ts.iter().enumerate() {
            if let Err(e) = self.inner.engine.grant_access(&entry.desc, &key, t.slot.0, t.generation.0) {
                for u in &ts[..i] {
                    let _ = self.inner.engine.withdraw_access(&entry.desc, u.slot.0, u.generation.0);
                }
                return Err(ExposeError { lease, kind: ExposeErrorKind::Engine(e.to_string()) });
            }
        }
        let token = lock(&self.inner.exposures).expose(entry.pool.id(), &ts, peer, Trust::Proving);
        Ok(entry.authority.expose(lease, peer, entry.desc.rkey, encode_endpoint(&entry.desc), token))
    }

    /// Counters.
    pub fn stats(&self) -> AdapterStats {
        let c = &self.inner.hub.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ops = lock(&self.inner.hub.ops);
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
            aborts_sent: l(&c.aborts_sent),
            abort_acks_received: l(&c.abort_acks_received),
            aborts_received: l(&c.aborts_received),
            abort_acks_sent: l(&c.abort_acks_sent),
            revoked: l(&c.revoked),
            fences: l(&c.fences),
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

    fn post_inner(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        let inner = &self.inner;
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        let (entry, rdesc, peer) = match inner.route(local.pool().id(), &remote.endpoint, remote.key) {
            Ok(r) => r,
            Err(kind) => return Err(PostError { lease: local, kind }),
        };
        // Every remote slot must lie inside the remote memory (its offset is
        // then `addr - rdesc.addr`, computed again below).
        for s in &remote.slots {
            let inside = s
                .addr
                .checked_sub(rdesc.addr)
                .is_some_and(|off| off.checked_add(remote.slot_size).is_some_and(|e| e <= rdesc.size));
            if !inside {
                let kind = PostErrorKind::Descriptor(format!("slot {} lies outside the remote memory", s.slot.0));
                return Err(PostError { lease: local, kind });
            }
        }
        let remote_ts: Tenancies = remote.slots.iter().map(|s| s.tenancy()).collect();
        let op_id = {
            let mut ops = lock(&inner.hub.ops);
            ops.next_op += 1;
            let id = ops.next_op;
            // Claim every remote tenancy, or none: at most one transfer of
            // ours per remote tenancy, none to one handed back or aborted.
            if let Err(refusal) = ops.aborts.admit(id, &peer, remote, true) {
                drop(ops);
                inc(&inner.hub.counters.posts_refused_tombstone);
                let kind = PostErrorKind::Descriptor(format!("{refusal}: post a fresh descriptor"));
                return Err(PostError { lease: local, kind });
            }
            ops.posts += 1;
            ops.transfers += remote_ts.len() as u64;
            id
        };
        let exposed = entry.authority.expose_local(local, peer);
        let (handle, completer) = TransferHandle::pair(exposed);
        // One MORI transfer per slot, built while the completer still lends
        // its lease's tenancies.
        let plan = {
            let lease_ts = completer.lease().tenancies();
            let segment = |lt: &Tenancy, rs: &kv_transfer_core::RemoteSlot| {
                Segment::new(u64::from(lt.slot.0) * entry.slot_size, rs.addr - rdesc.addr, entry.slot_size)
            };
            match (lease_ts, remote.slots.as_slice()) {
                // One slot, the usual post: MORI's single-transfer call, no request vectors.
                ([lt], [rs]) => Plan::One {
                    segment: segment(lt, rs),
                    uid: inner.engine.allocate_transfer_unique_id(),
                    tag: pack_tag(rdesc.id, rs.tenancy(), opts.notify),
                },
                _ => Plan::Many(
                    lease_ts
                        .iter()
                        .zip(&remote.slots)
                        .map(|(lt, rs)| BatchRequest {
                            local: entry.desc.clone(),
                            remote: rdesc.clone(),
                            segments: vec![segment(lt, rs)],
                            uid: inner.engine.allocate_transfer_unique_id(),
                            tag: pack_tag(rdesc.id, rs.tenancy(), opts.notify),
                        })
                        .collect(),
                ),
            }
        };
        let n = remote_ts.len();
        let state = Arc::new(OpState {
            hub: inner.hub.clone(),
            done: Mutex::new(OpDone { completer: Some(completer), error: None, failed: 0, statuses: SmallVec::new() }),
            remaining: AtomicUsize::new(n),
            unknown: AtomicBool::new(false),
            id: op_id,
            peer,
            remote_pool: remote.pool,
            token: remote.token,
            remote: remote_ts,
            settle: opts.notify,
            pool: entry,
        });
        // Each status reports to `on_status` once it is no longer pending
        // (at once if the engine refused it), then is kept by the op.
        let listen = |st: TransferStatus| {
            st.on_complete_shared(state.clone());
            keep(&state, st);
        };
        let (l, r) = (&state.pool.desc, &rdesc);
        let statuses = match (plan, op) {
            (Plan::One { segment: s, uid, tag }, Op::Write) => {
                listen(inner.engine.write(l, s.local_offset, r, s.remote_offset, s.size, uid, tag));
                return Ok(handle);
            }
            (Plan::One { segment: s, uid, tag }, Op::Read) => {
                listen(inner.engine.read(l, s.local_offset, r, s.remote_offset, s.size, uid, tag));
                return Ok(handle);
            }
            (Plan::Many(requests), Op::Write) => inner.engine.batch_write(&requests),
            (Plan::Many(requests), Op::Read) => inner.engine.batch_read(&requests),
        };
        if statuses.len() != n {
            // The engine answered for fewer (or more) transfers than asked:
            // nothing proves the others are over. Treat as unknown.
            tracing::error!(asked = n, got = statuses.len(), "engine returned a wrong number of statuses");
            state.unknown.store(true, Ordering::Release);
        }
        let missing = n.saturating_sub(statuses.len());
        for _ in 0..missing {
            state.clone().on_status(StatusCode::Unknown(u32::MAX), "");
        }
        for st in statuses.into_iter().take(n) {
            listen(st);
        }
        Ok(handle)
    }
}

/// Keeps `st` with its op until the op finishes (see [`OpDone::statuses`]);
/// an op that finished already (its statuses were terminal at once) does
/// not need it.
fn keep(op: &OpState, st: TransferStatus) {
    let mut done = lock(&op.done);
    if done.completer.is_some() {
        done.statuses.push(st);
    }
}

/// The MORI calls of one post.
enum Plan {
    /// One slot: `write` / `read`.
    One { segment: Segment, uid: u64, tag: Tag },
    /// Several: `batch_write` / `batch_read`, one transfer per slot.
    Many(Vec<BatchRequest>),
}

impl StatusListener for OpState {
    fn on_status(self: Arc<Self>, code: StatusCode, message: &str) {
        on_status(&self, code, message);
    }
}

fn on_status(op: &Arc<OpState>, code: StatusCode, message: &str) {
    let hub = &op.hub;
    if !code.is_success() {
        match code {
            StatusCode::Unknown(_) => inc(&hub.counters.transfers_unknown),
            _ => inc(&hub.counters.transfers_failed),
        }
        let mut done = lock(&op.done);
        done.failed += 1;
        done.error.get_or_insert_with(|| (code, message.to_owned()));
    }
    if matches!(code, StatusCode::Unknown(_)) {
        op.unknown.store(true, Ordering::Release);
    }
    if op.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
        return;
    }
    // Every status left the pending states.
    if op.unknown.load(Ordering::Acquire) {
        // The driver fences the peer; if it is gone (the adapter was
        // dropped), the job stays queued with the op: parked.
        hub.jobs.push(Job::Fence(op.clone()));
        return;
    }
    let (completer, error, failed) = op.take_done();
    let proof = match &completer {
        Some(c) => op.pool.authority.completed(c.lease().tenancies()),
        None => op.pool.authority.completed(&[]),
    };
    finish(op, (completer, error, failed), proof.into());
}

/// A target's refusal carried in an engine message (`RDMA_OP` with the
/// transport's words, "rejected by the target: <reason>") as core's typed
/// rejection; any other error stays the engine's.
fn to_transfer_error(code: StatusCode, message: String) -> TransferError {
    const PREFIX: &str = "rejected by the target: ";
    if code == StatusCode::RdmaOp {
        if let Some(at) = message.find(PREFIX) {
            let reason = match message[at + PREFIX.len()..].trim() {
                "out of bounds" => Some(RejectReason::OutOfBounds),
                "unknown key" => Some(RejectReason::UnknownKey),
                "stale generation" => Some(RejectReason::StaleGeneration),
                "zero length" => Some(RejectReason::ZeroLength),
                "oversize" => Some(RejectReason::Oversize),
                _ => None,
            };
            if let Some(r) = reason {
                return TransferError::Rejected(r);
            }
        }
    }
    TransferError::Engine { engine: BACKEND, code: i64::from(code.raw()), message }
}

/// Completes `op` (its completer, with the first error if a status failed;
/// what [`OpState::take_done`] returned) with `proof` and clears its bookkeeping.
fn finish(
    op: &Arc<OpState>,
    (completer, error, failed): (Option<Completer>, Option<(StatusCode, String)>, usize),
    proof: kv_transfer_core::Settlement,
) {
    let result = match error {
        None => Ok(()),
        Some((code, message)) => Err(to_transfer_error(code, message)),
    };
    let hub = &op.hub;
    let acks = {
        let mut ops = lock(&hub.ops);
        ops.ops_completed += 1;
        ops.transfers_succeeded += op.remote.len().saturating_sub(failed) as u64;
        // An unknown status proves nothing about the target: never acked.
        let end = if op.unknown.load(Ordering::Acquire) { OpEnd::Unproven } else { OpEnd::Proven };
        let acks = ops.aborts.finished(op.id, end);
        if op.settle {
            // Handed back: the target settles from its inbound status.
            ops.aborts.tombstone(&op.peer, op.remote_pool, op.token, &op.remote);
        }
        acks
    };
    for a in acks {
        hub.jobs.push(Job::SendTo(a.to, a.msg));
    }
    if let Some(c) = completer {
        if let Err(e) = c.complete(proof, result) {
            tracing::error!(error = %e, "operation's proof did not settle its lease");
        }
    }
}

impl Inner {
    fn routes(&self) -> std::sync::RwLockReadGuard<'_, Routes> {
        self.routes.read().unwrap_or_else(|p| p.into_inner())
    }
    fn routes_mut(&self) -> std::sync::RwLockWriteGuard<'_, Routes> {
        self.routes.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The local pool, remote memory and peer a post names: one read of the
    /// routes once the endpoint was decoded (cached by key; see
    /// [`Routes::endpoints`]).
    fn route(
        &self,
        pool: PoolId,
        endpoint: &str,
        rkey: u64,
    ) -> Result<(Arc<PoolEntry>, MemoryDesc, PeerId), PostErrorKind> {
        let found = self.routes().of_post(pool, endpoint, rkey);
        let (entry, rdesc, peer) = match found {
            Some(r) => r,
            None => {
                let entry = self.pool_entry(pool).ok_or(PostErrorKind::ForeignPool)?;
                // The descriptor names no engine this adapter could reach.
                let Some(d) = decode_endpoint(endpoint, rkey) else {
                    return Err(PostErrorKind::Peer(format!("not a MORI endpoint: {endpoint}")));
                };
                let mut routes = self.routes_mut();
                if routes.endpoints.len() >= MAX_ENDPOINTS {
                    routes.endpoints.clear();
                }
                routes.endpoints.insert(rkey, (endpoint.to_owned(), d.clone()));
                let peer = routes.peers.by_key.get(&d.engine_key).copied();
                (entry, d, peer)
            }
        };
        let peer = peer.ok_or_else(|| PostErrorKind::Peer(format!("engine {} was not added", rdesc.engine_key)))?;
        Ok((entry, rdesc, peer))
    }

    fn pool_entry(&self, id: PoolId) -> Option<Arc<PoolEntry>> {
        self.routes().pools.iter().find(|e| e.pool.id() == id).cloned()
    }
    fn pool_by_mem(&self, mem: u32) -> Option<Arc<PoolEntry>> {
        self.routes().pools.iter().find(|e| e.desc.id == mem).cloned()
    }
    fn all_pools(&self) -> Vec<Arc<PoolEntry>> {
        self.routes().pools.clone()
    }
    fn peer_id(&self, key: &EngineKey) -> Option<PeerId> {
        self.routes().peers.by_key.get(key).copied()
    }
    fn peer_key(&self, id: PeerId) -> Option<EngineKey> {
        self.routes().peers.by_id.get(&id).cloned()
    }

    /// Settles `t` of `entry` from an inbound status of `peer` (the engine
    /// binds it to the peer's connection): `Completed` if it is that peer's
    /// current exposure, else stale. Returns whether it settled.
    fn settle_by_status(&self, entry: &PoolEntry, peer: PeerId, t: Tenancy) -> bool {
        if !lock(&self.exposures).take(entry.pool.id(), t, peer) {
            entry.authority.record_stale(1);
            return false;
        }
        let _ = self.engine.withdraw_access(&entry.desc, t.slot.0, t.generation.0);
        entry.authority.deliver(entry.authority.completed(&[t]));
        true
    }

    fn on_status(&self, s: InboundStatus) {
        let c = &self.hub.counters;
        let (settle, mem, t) = unpack_tag(s.tag);
        if !settle {
            inc(&c.inbound_no_settle);
            return;
        }
        if !s.code.is_terminal() {
            inc(&c.inbound_unknown);
            tracing::warn!(peer = %s.remote, uid = s.uid, code = %s.code, "inbound status proves nothing");
            return;
        }
        let Some(entry) = self.pool_by_mem(mem) else {
            inc(&c.inbound_stale);
            return;
        };
        match self.peer_id(&s.remote) {
            Some(p) => {
                if !s.code.is_success() && lock(&self.exposures).is_exposed(entry.pool.id(), t, p) {
                    // Recorded before the proof, so the application sees it
                    // as soon as the slot is settled.
                    inc(&c.inbound_failed);
                    let mut f = lock(&self.failed);
                    let k = (entry.pool.id(), t);
                    if f.set.insert(k) {
                        f.order.push_back(k);
                        if f.order.len() > TOMBSTONES {
                            if let Some(old) = f.order.pop_front() {
                                f.set.remove(&old);
                            }
                        }
                    }
                }
                if self.settle_by_status(&entry, p, t) {
                    inc(&c.inbound_settled);
                } else {
                    inc(&c.inbound_stale);
                }
            }
            None => {
                inc(&c.inbound_stale);
                entry.authority.record_stale(1);
            }
        }
    }

    /// A control message of core's drain protocol from `from` (the engine
    /// binds messages to the peer's connection).
    fn on_message(&self, from: &EngineKey, bytes: &[u8]) {
        let msg = match ControlMessage::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(peer = %from, error = %e, "malformed control message dropped");
                return;
            }
        };
        match msg.kind {
            ControlKind::Abort => {
                inc(&self.hub.counters.aborts_received);
                let ack = match self.peer_id(from) {
                    Some(peer) => lock(&self.hub.ops).aborts.on_abort(&peer, msg),
                    // A peer never added has no transfer of ours to wait for.
                    None => Some(drain::Outgoing {
                        to: PeerId(0),
                        msg: ControlMessage::new(ControlKind::AbortAck, msg.pool, msg.token, msg.tenancies),
                    }),
                };
                if let Some(a) = ack {
                    self.send(from, a.msg);
                }
            }
            ControlKind::AbortAck => {
                inc(&self.hub.counters.abort_acks_received);
                let Some(entry) = self.pool_entry(msg.pool) else { return };
                let Some(peer) = self.peer_id(from) else {
                    entry.authority.record_stale(msg.tenancies.len() as u64);
                    return;
                };
                let v = lock(&self.exposures).accept(peer, &msg);
                for t in &v.settled {
                    let _ = self.engine.withdraw_access(&entry.desc, t.slot.0, t.generation.0);
                }
                v.deliver(&entry.authority);
            }
            // This adapter's DONE is the engine's inbound status.
            ControlKind::Done => tracing::warn!(peer = %from, "unexpected DONE message dropped"),
        }
    }

    fn send(&self, to: &EngineKey, msg: ControlMessage) {
        let kind = msg.kind;
        for m in msg.chunks() {
            let bytes = match m.encode() {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "control message cannot be encoded");
                    return;
                }
            };
            match self.engine.send_message(to, bytes) {
                Ok(()) => match kind {
                    ControlKind::Abort => inc(&self.hub.counters.aborts_sent),
                    ControlKind::AbortAck => inc(&self.hub.counters.abort_acks_sent),
                    ControlKind::Done => {}
                },
                Err(e) => tracing::warn!(peer = %to, error = %e, "control message not sent"),
            }
        }
    }

    /// The connection to `peer` is torn down (and the transport confirmed
    /// it): `Fenced` for every exposure to it, in every pool.
    fn fenced(&self, peer: PeerId) {
        lock(&self.exposures).fenced(peer);
        lock(&self.hub.ops).aborts.forget_peer(&peer);
        for e in self.all_pools() {
            e.authority.deliver(e.authority.fenced(peer));
        }
    }

    /// Fences `peer`; on success delivers `Fenced` to every pool.
    fn fence(&self, peer: PeerId) -> bool {
        let Some(key) = self.peer_key(peer) else { return false };
        match self.engine.fence_remote_engine(&key) {
            Ok(()) => {
                inc(&self.hub.counters.fences);
                self.fenced(peer);
                true
            }
            Err(e) => {
                tracing::error!(peer = %key, error = %e, "fence failed");
                false
            }
        }
    }

    /// Executes core's plan for one escalation action.
    fn escalate(&self, entry: &PoolEntry, a: EscalationAction) {
        tracing::debug!(peer = a.peer.0, step = ?a.step, slots = a.tenancies.len(), "escalation");
        let plan = lock(&self.exposures).plan(entry.pool.id(), &a, self.caps, ReleasePolicy::Safe);
        match plan {
            drain::Plan::Nothing => {}
            drain::Plan::SendAbort { peer, messages } => match self.peer_key(peer) {
                Some(key) => messages.into_iter().for_each(|m| self.send(&key, m)),
                None => tracing::warn!(peer = peer.0, "cannot ask an unknown peer to drain"),
            },
            drain::Plan::Revoke { peer, tenancies } => {
                // Only a revocation the transport confirmed is a proof.
                let mut confirmed = Vec::new();
                for t in &tenancies {
                    match self.engine.revoke_access(&entry.desc, t.slot.0, t.generation.0) {
                        Ok(true) => confirmed.push(*t),
                        Ok(false) => {}
                        Err(e) => {
                            tracing::debug!(error = %e, "revocation unavailable: the ladder moves on to the fence");
                            break;
                        }
                    }
                }
                let done = lock(&self.exposures).revoked(entry.pool.id(), peer, &confirmed);
                if !done.is_empty() {
                    self.hub.counters.revoked.fetch_add(done.len() as u64, Ordering::Relaxed);
                    entry.authority.deliver(entry.authority.revoked(&done));
                }
            }
            drain::Plan::Fence { peer } => {
                self.fence(peer);
            }
            drain::Plan::Stuck { peer, tenancies } => tracing::error!(
                peer = peer.0,
                slots = tenancies.len(),
                "escalation exhausted: slots stay quarantined (a leak, not a reuse)"
            ),
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }
}

fn driver_loop(weak: Weak<Inner>, jobs: Arc<Jobs>) {
    loop {
        let mut timeout = DRIVER_TICK;
        if let Some(inner) = weak.upgrade() {
            for e in inner.all_pools() {
                if let Some(d) = e.authority.next_escalation_in() {
                    timeout = timeout.min(d);
                }
            }
        }
        let batch: Vec<Job> = {
            let mut q = lock(&jobs.m);
            if q.q.is_empty() && !q.kicked && !q.shutdown && !timeout.is_zero() {
                q = jobs.cv.wait_timeout(q, timeout).unwrap_or_else(|e| e.into_inner()).0;
            }
            if q.shutdown {
                return;
            }
            q.kicked = false;
            q.q.drain(..).collect()
        };
        let Some(inner) = weak.upgrade() else { return };
        for job in batch {
            match job {
                Job::PeerLost(key) => {
                    if let Some(peer) = inner.peer_id(&key) {
                        inc(&inner.hub.counters.peers_lost);
                        inner.fenced(peer);
                    }
                }
                Job::Filed(st) => inner.on_status(st),
                Job::Message(from, bytes) => inner.on_message(&from, &bytes),
                Job::SendTo(to, msg) => match inner.peer_key(to) {
                    Some(key) => inner.send(&key, msg),
                    None => tracing::warn!(peer = to.0, "ABORT_ACK for a peer no longer known dropped"),
                },
                Job::Fence(op) => {
                    if inner.fence(op.peer) {
                        let proof = op.pool.authority.fenced(op.peer);
                        finish(&op, op.take_done(), proof.into());
                    } else {
                        tracing::error!(peer = op.peer.0, "unknown status and no fence: the operation stays parked");
                        lock(&inner.hub.ops).parked.push(op);
                    }
                }
            }
        }
        for e in inner.all_pools() {
            for a in e.authority.poll_escalations() {
                inner.escalate(&e, a);
            }
        }
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
    use super::*;

    /// An ABORT message as a target adapter sends it (for the target's `pool`).
    pub(crate) fn abort_bytes(pool: PoolId, ts: &[Tenancy]) -> Vec<u8> {
        ControlMessage::new(ControlKind::Abort, pool, Default::default(), ts.to_vec()).encode().expect("encodes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejections_keep_their_reason() {
        let m = "remote operation failed: rejected by the target: stale generation";
        assert_eq!(
            to_transfer_error(StatusCode::RdmaOp, m.into()),
            TransferError::Rejected(RejectReason::StaleGeneration)
        );
        let e = to_transfer_error(StatusCode::RdmaOp, "remote operation failed: connection fenced".into());
        assert!(matches!(e, TransferError::Engine { code: 13, .. }));
        let e = to_transfer_error(StatusCode::BadState, "rejected by the target: oversize".into());
        assert!(matches!(e, TransferError::Engine { code: 14, .. }));
    }

    #[test]
    fn tag_round_trip() {
        let t = Tenancy::new(SlotId(u32::MAX), Generation(u64::MAX));
        for settle in [true, false] {
            let tag = pack_tag(7, t, settle);
            assert_eq!(unpack_tag(tag), (settle, 7, t));
        }
    }

    #[test]
    fn endpoint_round_trip() {
        let d = MemoryDesc {
            engine_key: EngineKey::new("de/co:de"),
            id: 3,
            device_id: -1,
            addr: 0x1000,
            size: 4096,
            loc: MemoryLocation::Cpu,
            rkey: 99,
        };
        assert_eq!(decode_endpoint(&encode_endpoint(&d), 99), Some(d));
        assert_eq!(decode_endpoint("tcp://x", 1), None);
        assert_eq!(decode_endpoint("mori:/1/2/3/4/cpu", 1), None);
    }
}
