//! The adapter: kv-transfer-core's [`Transfer`] over Mooncake's batch model.
//!
//! [`MooncakeTransfer`] wraps any [`TransferEngine`] (the real
//! [`MooncakeEngine`](crate::MooncakeEngine), or `MockTransferEngine` in
//! tests). It registers pools ([`MooncakeTransfer::register_pool`]) and keeps
//! their [`SettlementAuthority`] to itself: no caller can mint a proof.
//!
//! # Initiator side ([`Transfer::post`])
//!
//! The classic Mooncake engine has no cancel: [`TransferHandle::cancel`] is
//! recorded but the operation still runs to its terminal status. `post` runs
//! on the caller's thread and may block briefly: the first post to an
//! endpoint fetches its descriptor (a handshake round trip).
//!
//! One batch per operation, one task per slot. A driver thread waits on each
//! task with bounded [`TransferEngine::wait_transfer`] slices until **every**
//! task is COMPLETED or FAILED; TIMEOUT and the other non-terminal states keep
//! it waiting (no timer ends an operation: escalation is the target's ladder's
//! job). Only then is the batch freed and the local lease settled
//! (`Completed`: our own engine no longer touches it). The lease lives in the
//! core's [`Completer`] meanwhile, so a dropped
//! [`TransferHandle`] parks it until then. If every task COMPLETED under
//! protocol v2 and the caller asked for it, a `W` notification naming the
//! remote tenancies follows (core's drain codec, see below); never on failure, never to a v1
//! target.
//!
//! # Target side ([`MooncakeTransfer::expose`])
//!
//! Exposures settle from `W` or `K` notifications, accepted only from the peer
//! the tenancies were exposed to, only for tenancies still awaiting
//! settlement (stale ones are counted by core), and only from a peer that
//! speaks protocol v2.
//!
//! # Abort and the escalation ladder
//!
//! An aborted (or dropped) exposure is quarantined by core. The adapter's
//! control thread then follows the ladder:
//!
//! - `RequestDrain`: send an ABORT to the peer. An initiator running this
//!   adapter records the tenancies as aborted (later posts to them fail),
//!   waits until every task touching them is finished, then answers
//!   ABORT_ACK, which settles them `Completed`. It withholds the ack when a
//!   finished task proves nothing about the target's memory: it ran under
//!   v1, or FAILED mid-connection (bytes already in the target's socket may
//!   still be applied there), or the engine lost it. A plain Mooncake
//!   application can ack too, echoing the ABORT's token: Mooncake sends a
//!   transfer's notification only after it saw the transfer COMPLETED (the
//!   interop hazard test does exactly that).
//! - `Revoke` and `Fence` are **not in this backend's ladder**
//!   ([`CAPABILITIES`]): Mooncake's TCP transport has no access key per
//!   tenancy (the address is the key; unregistering a slot's range and
//!   registering it again later would let a late request of the old tenancy
//!   land in the new one), and a data connection carries no peer identity (a
//!   peer can always reconnect). Core skips both steps.
//! - `Exhausted`: the slots stay quarantined (core counts them as stuck and
//!   reports `quarantine_stuck`).
//!
//! So a peer that never acks (a plain Mooncake application, a v1 peer, a
//! dead peer) leaves its aborted slots quarantined and visible in the pool's
//! metrics: a capacity bug, never a data leak (DESIGN rule 2).
//!
//! # Protocol v1 peers
//!
//! A v1 peer's completions prove nothing (a WRITE's COMPLETED only means the
//! bytes left its socket). Exposures to a v1 peer are never settled from its
//! notifications (they would settle only by a fence, which this transport
//! cannot give), our initiator never sends `W` or `K` for tasks that ran
//! under v1, and the adapter warns once per peer and counts it
//! ([`AdapterMetrics::v1_peers`], [`AdapterMetrics::v1_exposures`],
//! [`AdapterMetrics::v1_completions_ignored`]).
//!
//! # The drain protocol
//!
//! Exposures, ABORT / ABORT_ACK, tombstones and the ladder are core's
//! ([`kv_transfer_core::drain`]): the control messages travel as Mooncake
//! notifications in the codec's text form (`kvt2 <hex>`), and a `W`/`K` of
//! the old format is foreign. A notification's sender is the name it
//! declares, so it is never trusted alone: a message settles only with the
//! exposure's token, which only the peer it was exposed to received.
//!
//! # The positive control
//!
//! `ReleasePolicy::Naive` (feature `naive-positive-control` of
//! `kv-transfer-core`) reproduces the bug class on purpose (a proof minted
//! on abort, without evidence) so tests can show the hazard is real. Never
//! use it outside such a test.

use kv_transfer_core::hash::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

pub use kv_transfer_core::drain::ReleasePolicy;
use kv_transfer_core::drain::{
    self, AbortTracker, Action, Capabilities, ControlKind, ControlMessage, DecodeError, DrainCounters, Driver, OpEnd,
    Outbox, Outgoing, Trust,
};
use kv_transfer_core::{
    check_shapes, BackendError, Completer, ExposeError, ExposeErrorKind, Exposed, Op, PeerId, PoolConfig, PoolId,
    PostError, PostErrorKind, Region, RejectReason, RemoteSlots, Reserved, SettlementAuthority, SlotLease, SlotPool,
    Target, Transfer, TransferError, TransferHandle, TransferOptions,
};

use crate::engine::{BatchId, SegmentId, TransferEngine, TransferRequest};
use crate::error::{EngineError, TaskError};
use crate::memory::MemoryRegion;
use crate::proto::{ProtoVersion, TcpOpcode};
use crate::TransferStatus;

/// What Mooncake over TCP can prove: drain and ack only. No revoke (the
/// address is the key: no per-tenancy access key) and no fence (data
/// connections carry no peer identity, and a peer can always reconnect).
pub const CAPABILITIES: Capabilities = Capabilities::DRAIN_ONLY;

/// What Mooncake over RDMA with a key per tenancy ([`AdapterConfig::keys`])
/// can prove: drain, and revoke (the NIC refuses an ended key); still no
/// fence (a Mooncake initiator reconnects after an error by design).
pub const CAPABILITIES_WITH_KEYS: Capabilities = Capabilities { drain: true, revoke: true, fence: false };

/// Adapter options.
#[derive(Debug, Clone)]
pub struct AdapterConfig {
    /// Threads that wait for posted operations to finish (round robin).
    pub drivers: usize,
    /// Longest single wait on one task before the driver checks for shutdown.
    pub wait_slice: Duration,
    /// How often the control thread polls notifications, with an engine
    /// that cannot wake it when one arrives ([`TransferEngine::set_notify_waker`]).
    pub poll_interval: Duration,
    /// With an engine that wakes it, the longest the control thread sleeps
    /// when nothing is due: what nothing wakes it for (a sender's failed
    /// try, put back in the outbox) waits at most this.
    pub idle_wait: Duration,
    /// Per peer, the most tombstoned slots, early-abort tenancies, unproven
    /// tenancies and waiting ABORTs remembered (each); posts to a remembered
    /// tenancy fail, and past the cap that peer fails closed (its ABORTs
    /// unanswered, its posts refused once a tombstone could not be kept),
    /// never forgetting (rule 9).
    pub max_aborted: usize,
    /// What draining an aborted exposure means.
    pub release_policy: ReleasePolicy,
    /// Access keys per tenancy, where the engine has them (Mooncake over
    /// RDMA: `rdma::RdmaTarget` publishing grants): every exposure gets its
    /// own key, every settlement ends it, the ladder can revoke, and a
    /// revoked slot is kept away from the peer that may retry it
    /// (`adapter::keys`). `None`: Mooncake TCP, drain only.
    pub keys: Option<Arc<dyn TenancyKeys>>,
    /// Threads that send ABORT_ACKs and ABORTs to peers the local side
    /// chose (a destination is served by one at a time); strangers (names
    /// only a message declared) have one thread of their own.
    pub sender_threads: usize,
    /// Most control messages queued for one destination (refused and
    /// counted beyond: `sends_refused`).
    pub max_queued_per_peer: usize,
    /// Most bytes of control messages queued for one destination.
    pub max_queued_bytes_per_peer: usize,
    /// Most strangers with messages queued at once.
    pub max_stranger_peers: usize,
    /// The old behaviour, for the hostile tests' positive control only:
    /// the control thread itself sends (a handshake round trip per message,
    /// to whatever name an ABORT declared), so one black-holed destination
    /// stalls every settlement behind it.
    pub send_on_control_thread: bool,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        Self {
            drivers: 2,
            wait_slice: Duration::from_millis(100),
            poll_interval: Duration::from_millis(2),
            idle_wait: Duration::from_millis(50),
            max_aborted: 1 << 20,
            release_policy: ReleasePolicy::Safe,
            keys: None,
            sender_threads: 2,
            max_queued_per_peer: 1024,
            max_queued_bytes_per_peer: 4 << 20,
            max_stranger_peers: 64,
            send_on_control_thread: false,
        }
    }
}

/// Errors of the adapter's own calls (posting returns core's [`PostError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterError {
    /// The engine refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] kv_transfer_core::PoolError),
    /// The adapter cannot start a thread.
    #[error("cannot start adapter thread: {0}")]
    Thread(String),
}

kv_transfer_core::backend_counters! {
    /// A snapshot of the adapter's own counters and its drain's (the pools keep theirs).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct AdapterMetrics;
    /// Operations posted (one batch each).
    posts,
    /// Operations whose every task COMPLETED.
    ops_completed,
    /// Operations finished with at least one FAILED task.
    ops_failed,
    /// Operations abandoned because the engine lost their batch (lease quarantined).
    ops_abandoned,
    /// Times a task was seen in TIMEOUT (kept waiting: not terminal).
    timeouts_seen,
    /// `free_batch_id` refused (BatchBusy) and retried after more waiting.
    free_refused,
    /// `W` notifications sent after a completed operation.
    done_sent,
    /// Notifications (`W`, `A`, `K`) whose sending failed.
    notify_failed,
    /// Adapter notifications received.
    notifies_received,
    /// Notifications with the `kvt2 ` prefix that do not decode; dropped.
    notifies_malformed,
    /// Notifications without the prefix (an application's); dropped.
    notifies_foreign,
    /// Peers added that speak protocol v1 (ourselves included, if we advertise v1).
    v1_peers,
    /// Exposures to v1 peers (they settle only by a fence).
    v1_exposures,
    /// Operations that ran (partly) under v1: no `W`/`K` sent for them.
    v1_ops,
    /// ABORTs received (as initiator).
    aborts_received,
    /// ABORT_ACKs sent.
    abort_acks_sent,
    /// Tenancies an ABORT_ACK was withheld for because a task on them ran
    /// under v1 or failed mid-connection (its end proves nothing about the
    /// target's memory; a task the engine lost is never acked at all). The
    /// target's slots stay quarantined.
    abort_acks_withheld,
    /// Posts refused because the target had aborted the tenancies.
    posts_to_aborted,
    /// Exposures refused because a slot is shadowed for that peer (it may
    /// retry a revoked tenancy's writes).
    shadow_refusals,
    /// Shadows cleared by the peer's DONE / ABORT_ACK.
    shadows_cleared,
    /// Slots now kept away from a peer that may retry a revoked tenancy's
    /// writes (a gauge).
    shadowed,
    /// Control messages (ABORT_ACK, ABORT) refused at a send queue's cap:
    /// their destination's count or bytes, or the number of strangers.
    sends_refused,
    /// Control messages queued for the sender threads now (a gauge).
    sends_queued,
    /// Slot ranges the engine's data server serves now (a gauge).
    ranges_open,
    /// Tenancies kept quarantined although proven: a data request did not
    /// leave their slot's range when it was closed (fail closed).
    ranges_stuck,
    /// DONE / ABORT_ACK tenancies for an unknown pool or from an unknown
    /// sender (the drain's forged ones are added to these in `wrong_peer`).
    unknown_sender_or_pool,
    ; drain:
    /// Tenancies in a DONE / ABORT_ACK from a peer they were not exposed to,
    /// without the exposure's token, for an unknown pool, or from an unknown
    /// sender; dropped (the forged ones are also in the pool's `forged_rejected`).
    wrong_peer = |d| d.forged,
    /// Tenancies settled `Completed` from a peer's `W`/`K`.
    settled_by_peer = |d| d.settled_by_peer,
    /// Tenancies in a DONE / ABORT_ACK for an exposure made to a v1 peer (its
    /// trust recorded when it was exposed); proves nothing, dropped.
    v1_completions_ignored = |d| d.untrusted,
    /// ABORTs sent (RequestDrain).
    aborts_sent = |d| d.aborts_sent,
    /// Escalations that reached the end of the ladder.
    exhausted = |d| d.exhausted,
    /// Tenancies released by the naive positive control, without evidence.
    naive_releases = |d| d.naive_releases,
    /// Tenancies settled `Revoked`: their key ended at the NIC (RDMA keys).
    revoked = |d| d.revoked,
}

#[derive(Debug)]
struct PeerInfo {
    name: String,
    segment: SegmentId,
    proto: ProtoVersion,
}

#[derive(Debug, Default)]
struct Peers {
    by_id: HashMap<PeerId, PeerInfo>,
    by_name: HashMap<String, PeerId>,
    next: u32,
}

struct PoolEntry {
    authority: SettlementAuthority,
    region: Arc<dyn Region>,
}

/// Initiator side: core's abort tracker, keyed by the target's segment
/// name, and the control messages waiting to be sent (one retry policy).
struct Inflight {
    tracker: AbortTracker<String>,
    outbox: Outbox<String>,
    next: u64,
}

struct Job {
    id: u64,
    batch: BatchId,
    tasks: Range<usize>,
    completer: Completer,
    /// The DONE to send after the data, with its target's segment and
    /// segment name, and whether to digest the local slots into it.
    notify: Option<(SegmentId, String, ControlMessage, bool)>,
    /// The exposure carried a key per tenancy: a refusal by the target's
    /// NIC then means the tenancy's key ended (a stale generation).
    keyed: bool,
}

struct Inner {
    engine: Arc<dyn TransferEngine>,
    /// The framing our own descriptor advertises: what every initiator uses
    /// towards us. With V1 no initiator's completion proves anything.
    self_proto: ProtoVersion,
    cfg: AdapterConfig,
    segment_name: String,
    pools: Mutex<HashMap<PoolId, PoolEntry>>,
    peers: Mutex<Peers>,
    /// Target side of core's drain protocol (core's driver: the exposure
    /// table, the pools' authorities, the ladder).
    drain: Mutex<Driver>,
    drain_counters: Arc<DrainCounters>,
    /// Per-tenancy keys and retry shadows (with [`AdapterConfig::keys`]).
    grants: Mutex<keys::Grants>,
    /// The slot ranges the engine's data server may serve (exposed now).
    ranges: Mutex<ranges::OpenRanges>,
    inflight: Mutex<Inflight>,
    /// ABORT_ACKs and ABORTs waiting for a sender thread.
    sender: sender::SendQueues,
    counters: Counters,
    /// Wakes the control thread: posting threads, the pools' quarantines,
    /// and (where the engine can) each notification received.
    wake: Arc<Wake>,
    /// Whether the engine wakes the control thread on each notification
    /// (then it sleeps until something is due instead of polling).
    notify_wakes: AtomicBool,
    stop: AtomicBool,
    jobs: Vec<Mutex<Sender<Job>>>,
    next_driver: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// kv-transfer-core's [`Transfer`] over a Mooncake [`TransferEngine`]. See the
/// [module documentation](self) for what each side proves and what it cannot.
pub struct MooncakeTransfer {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for MooncakeTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeTransfer").field("segment", &self.inner.segment_name).finish_non_exhaustive()
    }
}

impl MooncakeTransfer {
    /// Starts the adapter's driver and control threads over `engine`.
    ///
    /// Reads our own descriptor once (`open_segment` of our own name) to learn
    /// the framing initiators use towards us; if that fails, or it is v1, no
    /// initiator's notification settles anything here.
    pub fn new(engine: Arc<dyn TransferEngine>, cfg: AdapterConfig) -> Result<Self, AdapterError> {
        let drivers = cfg.drivers.max(1);
        let mut receivers = Vec::with_capacity(drivers);
        let mut senders = Vec::with_capacity(drivers);
        for _ in 0..drivers {
            let (tx, rx) = mpsc::channel::<Job>();
            senders.push(Mutex::new(tx));
            receivers.push(rx);
        }
        let segment_name = engine.local_segment_name();
        // From now on the data server serves only what we expose (unless the
        // engine was configured `TcpServe::AnyRegistered`).
        if !engine.serve_exposed_only() {
            tracing::warn!(
                "the engine's TCP data server serves any registered byte to anyone (TcpServe::AnyRegistered, \
                 or an engine without exposure filtering)"
            );
        }
        // Our own descriptor, as peers see it (one handshake to ourselves).
        let self_proto = match engine.open_segment(&segment_name).and_then(|s| engine.segment_info(s)) {
            Ok(info) => info.proto,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read our own descriptor; assuming protocol v1 (nothing settles by notification)");
                ProtoVersion::V1
            }
        };
        if self_proto == ProtoVersion::V1 {
            tracing::warn!(
                "this engine advertises TCP protocol v1: initiators' completions prove nothing; \
                 exposures settle only by a fence, which this transport cannot give"
            );
        }
        let (cfg_max_aborted, cfg_release_policy) = (cfg.max_aborted, cfg.release_policy);
        let cfg_send = (cfg.max_queued_per_peer, cfg.max_queued_bytes_per_peer, cfg.max_stranger_peers);
        let sender_threads = cfg.sender_threads.max(1);
        let caps = if cfg.keys.is_some() { CAPABILITIES_WITH_KEYS } else { CAPABILITIES };
        let drain = Driver::new(caps, cfg.release_policy);
        let drain_counters = drain.counters();
        let inner = Arc::new(Inner {
            self_proto,
            segment_name,
            engine,
            cfg,
            pools: Mutex::default(),
            peers: Mutex::default(),
            drain: Mutex::new(drain),
            drain_counters,
            grants: Mutex::default(),
            ranges: Mutex::default(),
            inflight: Mutex::new(Inflight {
                tracker: AbortTracker::with_policy(cfg_max_aborted, cfg_release_policy),
                outbox: Outbox::default(),
                next: 0,
            }),
            sender: sender::SendQueues::new(sender::SendLimits {
                per_peer: cfg_send.0.max(1),
                per_peer_bytes: cfg_send.1.max(1),
                strangers: cfg_send.2.max(1),
            }),
            counters: Counters::default(),
            wake: Arc::default(),
            notify_wakes: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            jobs: senders,
            next_driver: AtomicUsize::new(0),
        });
        // The waker holds the wake-up alone, never the adapter: an engine
        // thread must not end up dropping the adapter (and with it the engine).
        let wake = inner.wake.clone();
        let wakes = inner.engine.set_notify_waker(Arc::new(move || wake.wake()));
        inner.notify_wakes.store(wakes, Ordering::Relaxed);
        let mut threads = Vec::new();
        let mut this = MooncakeTransfer { inner: inner.clone(), threads: Vec::new() };
        for (i, rx) in receivers.into_iter().enumerate() {
            let inn = inner.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvt-mc-driver-{i}"))
                .spawn(move || driver_loop(&inn, rx))
                .map_err(|e| AdapterError::Thread(e.to_string()));
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    this.threads = threads;
                    return Err(e);
                }
            }
        }
        let lanes = (0..sender_threads).map(|_| sender::Lane::Known).chain([sender::Lane::Stranger]);
        for (i, lane) in lanes.enumerate() {
            let inn = inner.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvt-mc-send-{i}"))
                .spawn(move || sender::sender_loop(&inn, lane))
                .map_err(|e| AdapterError::Thread(e.to_string()));
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    this.threads = threads;
                    return Err(e);
                }
            }
        }
        let inn = inner.clone();
        let t = std::thread::Builder::new()
            .name("kvt-mc-control".into())
            .spawn(move || control_loop(&inn))
            .map_err(|e| AdapterError::Thread(e.to_string()));
        match t {
            Ok(t) => threads.push(t),
            Err(e) => {
                this.threads = threads;
                return Err(e);
            }
        }
        this.threads = threads;
        Ok(this)
    }

    /// The engine underneath.
    pub fn engine(&self) -> &Arc<dyn TransferEngine> {
        &self.inner.engine
    }

    /// Our segment name (`ip:port`): the endpoint of every exposure.
    pub fn segment_name(&self) -> &str {
        &self.inner.segment_name
    }

    /// The adapter's counters.
    pub fn metrics(&self) -> AdapterMetrics {
        let mut m = self.inner.counters.snapshot(&self.inner.drain_counters);
        m.wrong_peer += m.unknown_sender_or_pool;
        m.abort_acks_withheld = lock(&self.inner.inflight).tracker.stats().acks_withheld;
        m.shadowed = lock(&self.inner.grants).shadowed() as u64;
        m.sends_queued = self.inner.sender.queued() as u64;
        m.ranges_open = lock(&self.inner.ranges).len() as u64;
        m
    }

    /// Registers `region` with the engine and builds a pool over it. The
    /// pool's settlement authority stays inside the adapter.
    ///
    /// The adapter keeps the region alive until the engine can no longer
    /// touch it (see [`Drop`](MooncakeTransfer#impl-Drop-for-MooncakeTransfer)).
    ///
    /// Device memory (no host pointer) is staged by the TCP transport through
    /// host buffers; an engine on another transport refuses it
    /// ([`crate::EngineError::StagingUnsupported`]).
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        let (pool, authority) = SlotPool::new(region.clone(), config.with_capabilities(self.inner.caps()))?;
        let mr = match region.host_ptr() {
            // SAFETY: the region is owned by the `Arc` the adapter keeps in
            // `pools` until the engine unregistered it (or forever, leaked, if
            // it never can: see `Drop`); every byte the engine touches lies in
            // a slot that is exposed, so no lease reads or writes it meanwhile.
            Some(_) => unsafe { MemoryRegion::new(region.addr(), region.len() as u64) },
            None => MemoryRegion::staged(region.clone()),
        };
        self.inner.engine.register_memory(mr)?;
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        authority.on_quarantine(move || {
            if let Some(i) = weak.upgrade() {
                i.wake();
            }
        });
        lock(&self.inner.drain).add_pool(authority.clone());
        lock(&self.inner.pools).insert(pool.id(), PoolEntry { authority, region });
        Ok(pool)
    }

    /// Opens (or refreshes) the peer with this segment name and returns its
    /// id. A v1 peer is warned about once and counted.
    pub fn add_peer(&self, segment_name: &str) -> Result<PeerId, AdapterError> {
        self.inner.add_peer(segment_name)
    }

    /// The protocol version a peer speaks, if known.
    pub fn peer_proto(&self, peer: PeerId) -> Option<ProtoVersion> {
        lock(&self.inner.peers).by_id.get(&peer).map(|p| p.proto)
    }

    /// Target side: exposes a reserved lease to `peer` and describes it (the
    /// endpoint is our segment name; addresses are the slots' virtual
    /// addresses, as Mooncake's host segments use them). The exposure settles
    /// when that peer sends `W` or `K` for it; if aborted, see the ladder in
    /// the module docs. On error the lease comes back unexposed.
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let (v1, name) = match lock(&self.inner.peers).by_id.get(&peer) {
            Some(p) => (p.proto == ProtoVersion::V1 || self.inner.self_proto == ProtoVersion::V1, p.name.clone()),
            None => return Err(ExposeError { lease, kind: ExposeErrorKind::UnknownPeer(peer) }),
        };
        let pools = lock(&self.inner.pools);
        let Some(entry) = pools.get(&lease.pool().id()) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ForeignPool });
        };
        let mut slot_keys: Option<Vec<u32>> = None;
        let size = lease.pool().slot_size() as u64;
        let slots: Vec<(kv_transfer_core::Tenancy, u64, u64)> = lease
            .tenancies()
            .iter()
            .enumerate()
            .filter_map(|(i, t)| lease.slot_addr(i).map(|a| (*t, a, size)))
            .collect();
        let pool_id = lease.pool().id();
        if let Some(keys) = &self.inner.cfg.keys {
            // Each slot its own key, granted to this peer only; refused if
            // the slot is shadowed for it.
            match lock(&self.inner.grants).expose(keys, pool_id, &slots, peer, &name) {
                Ok(k) => slot_keys = Some(k),
                Err(kind) => {
                    if matches!(kind, ExposeErrorKind::RetryShadow(_)) {
                        bump(&self.inner.counters.shadow_refusals, 1);
                    }
                    return Err(ExposeError { lease, kind });
                }
            }
        }
        // The data server may touch these slots from now until their
        // settlement (admission before exposure: opened before the peer
        // learns the addresses).
        if let Err(e) = lock(&self.inner.ranges).open(self.inner.engine.as_ref(), pool_id, &slots) {
            if let Some(keys) = &self.inner.cfg.keys {
                let ts: Vec<_> = slots.iter().map(|(t, _, _)| *t).collect();
                lock(&self.inner.grants).settled(keys, pool_id, &ts);
            }
            return Err(ExposeError { lease, kind: ExposeErrorKind::Engine(e.to_string()) });
        }
        // The trust is fixed now: a v1 peer's exposure is never upgraded by a
        // later refresh of the peer (it settles only by a proof its word is not).
        let trust = if v1 { Trust::Unproving } else { Trust::Proving };
        // The pool's mark first, the drain table's record after
        // (`Driver::expose_with`): a loss of this peer handled in between
        // then fences the mark, or finds the record.
        let token = kv_transfer_core::drain::ExposureToken::random();
        let (exposed, mut remote) = entry.authority.expose(lease, peer, 0, self.inner.segment_name.clone(), token);
        lock(&self.inner.drain).expose_with(pool_id, exposed.tenancies(), peer, trust, token);
        drop(pools);
        if let Some(k) = slot_keys {
            // The peer checks its copy of our metadata against these.
            for (r, key) in remote.slots.iter_mut().zip(k) {
                r.key = Some(u64::from(key));
            }
        }
        if v1 {
            bump(&self.inner.counters.v1_exposures, 1);
            // Warned once per peer in `add_peer`; counted per exposure.
            tracing::debug!(
                peer = peer.0,
                slots = exposed.len(),
                "exposure to a protocol-v1 peer: its completions prove nothing; it settles only by a fence"
            );
        }
        Ok((exposed, remote))
    }
}

/// The target side every backend shares. A peer's descriptor is its
/// segment name (`ip:port` of its handshake listener).
impl Target for MooncakeTransfer {
    fn capabilities(&self) -> Capabilities {
        self.inner.caps()
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        MooncakeTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            e @ AdapterError::Engine(EngineError::StagingUnsupported { .. }) => {
                BackendError::Unsupported(e.to_string())
            }
            e => BackendError::Engine { backend: "mooncake", message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        Ok(self.segment_name().as_bytes().to_vec())
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        let name =
            std::str::from_utf8(descriptor).map_err(|_| BackendError::Peer("segment name is not UTF-8".into()))?;
        MooncakeTransfer::add_peer(self, name).map_err(|e| BackendError::Peer(format!("{name}: {e}")))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        MooncakeTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.metrics().fields()
    }
}

/// The control thread's wake-up: a flag and its condition variable.
#[derive(Default)]
struct Wake {
    woken: Mutex<bool>,
    cv: Condvar,
}

impl Wake {
    fn wake(&self) {
        *lock(&self.woken) = true;
        self.cv.notify_one();
    }
    /// Sleeps until woken or for `wait`, whichever comes first.
    fn sleep(&self, wait: Duration) {
        let mut woken = lock(&self.woken);
        if !*woken && !wait.is_zero() {
            woken = self.cv.wait_timeout(woken, wait).map(|r| r.0).unwrap_or_else(|e| e.into_inner().0);
        }
        *woken = false;
    }
}

impl Inner {
    fn caps(&self) -> Capabilities {
        lock(&self.drain).capabilities()
    }

    fn wake(&self) {
        self.wake.wake();
    }

    /// Before a settlement of `tenancies` is delivered: the data server
    /// stops serving their slots (and waits out requests inside them).
    /// Returns the tenancies that must not be released: a request did not
    /// leave their range in time (counted; they stay quarantined).
    fn close_ranges(&self, pool: PoolId, tenancies: &[kv_transfer_core::Tenancy]) -> Vec<kv_transfer_core::Tenancy> {
        if tenancies.is_empty() {
            return Vec::new();
        }
        let stuck = lock(&self.ranges).close(self.engine.as_ref(), pool, tenancies);
        bump(&self.counters.ranges_stuck, stuck.len() as u64);
        stuck
    }

    fn add_peer(&self, name: &str) -> Result<PeerId, AdapterError> {
        let segment = self.engine.open_segment(name)?;
        let proto = self.engine.segment_info(segment)?.proto;
        let mut peers = lock(&self.peers);
        if let Some(id) = peers.by_name.get(name).copied() {
            if let Some(p) = peers.by_id.get_mut(&id) {
                p.segment = segment;
                p.proto = proto;
            }
            return Ok(id);
        }
        let id = PeerId(peers.next);
        peers.next += 1;
        peers.by_name.insert(name.to_string(), id);
        peers.by_id.insert(id, PeerInfo { name: name.to_string(), segment, proto });
        drop(peers);
        if proto == ProtoVersion::V1 {
            bump(&self.counters.v1_peers, 1);
            tracing::warn!(
                peer = name,
                "peer speaks Mooncake TCP protocol v1: its completions prove nothing about remote memory; \
                 exposures to it settle only by a fence, which this transport cannot give"
            );
        }
        Ok(id)
    }

    /// An exposure with a key per slot (an RDMA target's grants): if our
    /// copy of the target's metadata holds another key for a slot, it is
    /// from an earlier tenancy (ended, and refused at the NIC): fetch the
    /// metadata again. A key still missing then was revoked meanwhile.
    fn fresh_keys(&self, seg: SegmentId, remote: &RemoteSlots) -> Result<(), PostErrorKind> {
        // Mooncake TCP exposures carry no keys: nothing to compare, and no
        // copy of the descriptor on every post.
        if remote.slots.iter().all(|r| r.key.is_none()) {
            return Ok(());
        }
        let stale = |desc: &crate::proto::SegmentDesc| {
            remote.slots.iter().any(|r| {
                r.key.is_some_and(|k| {
                    !desc.buffers.iter().any(|b| {
                        b.contains(r.addr, remote.slot_size) && b.rkey.first().is_some_and(|h| u64::from(*h) == k)
                    })
                })
            })
        };
        let info = self.engine.segment_info(seg).map_err(|e| engine_err(&e))?;
        if !stale(&info.desc) {
            return Ok(());
        }
        self.engine.open_segment(&info.desc.name).map_err(|e| engine_err(&e))?;
        let info = self.engine.segment_info(seg).map_err(|e| engine_err(&e))?;
        if stale(&info.desc) {
            return Err(PostErrorKind::Descriptor("the target no longer grants these slots' keys".into()));
        }
        Ok(())
    }

    fn peer_by_name(&self, name: &str) -> Option<(PeerId, SegmentId, ProtoVersion)> {
        let peers = lock(&self.peers);
        let id = *peers.by_name.get(name)?;
        peers.by_id.get(&id).map(|p| (id, p.segment, p.proto))
    }

    fn peer_for(&self, name: &str) -> Result<(PeerId, SegmentId), EngineError> {
        if let Some((id, seg, _)) = self.peer_by_name(name) {
            return Ok((id, seg));
        }
        match self.add_peer(name) {
            Ok(id) => self.peer_by_name(name).map(|(_, s, _)| (id, s)).ok_or(EngineError::BadSegmentName(name.into())),
            Err(AdapterError::Engine(e)) => Err(e),
            Err(e) => Err(EngineError::NotifyRejected(e.to_string())),
        }
    }

    /// Sends a control message as a notification (text form, in chunks).
    fn send(&self, seg: SegmentId, msg: &ControlMessage) -> bool {
        let mut ok = true;
        for m in msg.clone().chunks() {
            ok &= self.send_one(seg, &m);
        }
        ok
    }

    fn send_one(&self, seg: SegmentId, msg: &ControlMessage) -> bool {
        let text = match msg.encode_text() {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "control message cannot be encoded");
                return false;
            }
        };
        match self.engine.send_notify(seg, &text) {
            Ok(()) => true,
            Err(e) => {
                bump(&self.counters.notify_failed, 1);
                tracing::warn!(error = %e, kind = ?msg.kind, "adapter notification failed");
                false
            }
        }
    }
}

fn engine_err(e: &EngineError) -> PostErrorKind {
    PostErrorKind::Engine(e.to_string())
}

#[kv_transfer_core::async_trait]
impl Transfer for MooncakeTransfer {
    fn backend(&self) -> &'static str {
        "mooncake"
    }

    async fn post(
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
        let authority = match lock(&inner.pools).get(&local.pool().id()) {
            Some(e) => e.authority.clone(),
            None => return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool }),
        };
        if inner.stop.load(Ordering::Acquire) {
            return Err(PostError { lease: local, kind: PostErrorKind::ShuttingDown });
        }
        let (peer, seg) = match inner.peer_for(&remote.endpoint) {
            Ok(p) => p,
            Err(e) => return Err(PostError { lease: local, kind: PostErrorKind::Peer(e.to_string()) }),
        };
        if let Err(kind) = inner.fresh_keys(seg, remote) {
            return Err(PostError { lease: local, kind });
        }
        let slot = remote.slot_size;
        let mut reqs = Vec::with_capacity(local.len());
        for (i, r) in remote.slots.iter().enumerate() {
            let Some(source) = local.slot_addr(i) else {
                return Err(PostError { lease: local, kind: PostErrorKind::Descriptor("local slot missing".into()) });
            };
            let opcode = match op {
                Op::Read => TcpOpcode::Read,
                Op::Write => TcpOpcode::Write,
            };
            reqs.push(TransferRequest { opcode, source, target_id: seg, target_offset: r.addr, length: slot });
        }
        let batch = match inner.engine.allocate_batch_id(reqs.len()) {
            Ok(b) => b,
            Err(e) => return Err(PostError { lease: local, kind: engine_err(&e) }),
        };
        // Register the operation before anything is submitted, under the same
        // lock that records aborts: an ABORT either sees this op (and waits
        // for it) or this post sees the abort (and refuses).
        let id = {
            let mut fl = lock(&inner.inflight);
            fl.next += 1;
            let id = fl.next;
            if let Err(refusal) = fl.tracker.admit(id, &remote.endpoint, remote, false) {
                drop(fl);
                bump(&inner.counters.posts_to_aborted, 1);
                let _ = inner.engine.free_batch_id(batch);
                return Err(PostError { lease: local, kind: PostErrorKind::Descriptor(refusal.to_string()) });
            }
            id
        };
        let exposed = authority.expose_local(local, peer);
        let mut submitted = inner.engine.submit_transfer(batch, &reqs);
        if let Err(EngineError::TargetOutOfRange { .. }) = submitted {
            // The target may have registered memory since we fetched its
            // descriptor: refresh once (submit is all or nothing, so a retry
            // cannot double-post).
            if inner.engine.open_segment(&remote.endpoint).is_ok() {
                submitted = inner.engine.submit_transfer(batch, &reqs);
            }
        }
        let tasks = match submitted {
            Ok(r) => r,
            Err(e) => {
                // Nothing was queued (submit is all or nothing): no operation
                // touches the slots, so `Completed` is vacuously true.
                lock(&inner.inflight).tracker.finished(id, OpEnd::Proven);
                let _ = inner.engine.free_batch_id(batch);
                inner.wake();
                let proof = authority.completed_lease(&exposed);
                let lease = match exposed.settle(proof) {
                    Ok(s) => s.into_reserved(),
                    Err(err) => {
                        // Cannot happen (own pool, full cover). If it did, the
                        // lease must not come back unsettled: it is handed to a
                        // completer that is dropped, so it is quarantined and
                        // the handle resolves `Abandoned`.
                        let (h, c) = TransferHandle::pair(err.lease);
                        drop(c);
                        return Ok(h);
                    }
                };
                return Err(PostError { lease, kind: engine_err(&e) });
            }
        };
        bump(&inner.counters.posts, 1);
        let (handle, completer) = TransferHandle::pair(exposed);
        let notify = opts.notify.then(|| {
            let done = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
            (seg, remote.endpoint.clone(), done, opts.digest && op == Op::Write)
        });
        let keyed = remote.slots.iter().any(|s| s.key.is_some());
        let job = Job { id, batch, tasks, completer, notify, keyed };
        let n = inner.jobs.len().max(1);
        let k = inner.next_driver.fetch_add(1, Ordering::Relaxed) % n;
        if let Some(tx) = inner.jobs.get(k) {
            if let Err(mpsc::SendError(job)) = lock(tx).send(job) {
                // Driver gone (shutdown): the operation is in the engine, so
                // it is abandoned (quarantined), never released.
                drop(job.completer);
            }
        }
        Ok(handle)
    }
}

impl Drop for MooncakeTransfer {
    /// Stops the threads (operations still running are abandoned: their
    /// leases are quarantined, never released), then unregisters each pool's
    /// region. A region the engine still holds (a task or a remote request in
    /// flight) is leaked on purpose rather than freed under the engine.
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.sender.stop();
        self.inner.wake();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let pools: Vec<(u64, Arc<dyn Region>)> =
            lock(&self.inner.pools).values().map(|e| (e.region.addr(), e.region.clone())).collect();
        for (addr, region) in pools {
            let mut ok = false;
            for _ in 0..50 {
                match self.inner.engine.unregister_memory(addr) {
                    Ok(()) | Err(EngineError::RegionNotRegistered(_)) => {
                        ok = true;
                        break;
                    }
                    Err(EngineError::RegionBusy { .. }) => std::thread::sleep(Duration::from_millis(10)),
                    Err(_) => break,
                }
            }
            if !ok {
                tracing::error!(addr, "engine still holds a pool region at shutdown; leaking it");
                std::mem::forget(region);
            }
        }
    }
}

/// Runs a future to completion on the current thread (core's, re-exported).
pub use kv_transfer_core::block_on;

mod control;
mod initiator;
mod keys;
mod ranges;
mod sender;
pub use keys::TenancyKeys;
#[cfg(test)]
mod tests;

use control::{control_loop, queue_acks};
use initiator::driver_loop;
