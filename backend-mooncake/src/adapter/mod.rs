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
//! One batch per operation, one task per slot. Nothing happens to the lease
//! until **every** task is COMPLETED or FAILED; TIMEOUT and the other
//! non-terminal states keep it waiting (no timer ends an operation:
//! escalation is the target's ladder's job). Only then is the batch freed and
//! the local lease settled (`Completed`: our own engine no longer touches
//! it). Who sees that moment: the engine's completion hook
//! ([`TransferEngine::on_batch_finished`]), on the engine's thread that
//! finished the last task, which settles an operation without a DONE right
//! there; or, for an operation with a DONE to send (a send may block) and
//! with an engine without hooks ([`AdapterConfig::engine_hooks`]), a waiter
//! thread, which waits on each task in bounded
//! [`TransferEngine::wait_transfer`] slices. The lease lives in the
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
//! the old format is foreign. Between two kv-transfer engines a notification
//! is sealed ([`crate::sealed`]): its sender's name is what core's peer
//! handshake proved, and only such an ABORT buys abort state (under that
//! name, so no one can spend another peer's share). A plain notification's
//! sender is only the name it declares, so a DONE or ABORT_ACK settles only
//! with the exposure's token, which only the peer it was exposed to received
//! (a real Mooncake application acks that way).
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
    PostError, PostErrorKind, PostNow, Region, RejectReason, RemoteSlots, Reserved, SettlementAuthority, SlotLease,
    SlotPool, Target, TransferError, TransferHandle, TransferOptions,
};

// Named in the docs (`Transfer`'s impl comes from `impl_transfer_via_post_now!`).
#[cfg(doc)]
use kv_transfer_core::Transfer;

use crate::batch::BatchHook;
use crate::engine::{BatchId, SegmentId, TransferEngine, TransferRequest};
use crate::error::{EngineError, TaskError};
use crate::memory::MemoryRegion;
use crate::proto::{ProtoVersion, TcpOpcode};
use crate::{TaskStatus, TransferStatus};

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
    /// Waiter threads (round robin): they send the DONEs after the data, and
    /// with an engine without completion hooks (or `engine_hooks` off) wait
    /// for posted operations to finish.
    pub drivers: usize,
    /// Settle an operation without a DONE on the engine's thread that
    /// finished its last task, where the engine has completion hooks
    /// ([`TransferEngine::batch_hooks`]): no hand-off to a waiter thread.
    /// `false` (the default for now): a waiter thread waits for every
    /// operation, and the engine's threads do nothing but transfer. Opt in:
    /// the guest's lossy-link race (`netns_lossy_reordering_network_race::mooncake`)
    /// ran out of prefill slots in 2 of 4 full runs with hooks on, and the
    /// cause is not found yet.
    pub engine_hooks: bool,
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
    /// An ABORT buys abort state only under the notify name of a segment
    /// this side opened (`add_peer`, or a post to its descriptor); any other
    /// name's is dropped and counted (`aborts_from_strangers`), so made-up
    /// names buy nothing (issue 46, attack 1). Off by default: a decode that
    /// aborts before this prefill ever posted to it (or added it) would get
    /// no answer, and Mooncake can neither revoke nor fence, so its slot
    /// would stay quarantined. Turn it on where prefills `add_peer` every
    /// decode before its descriptors arrive.
    pub aborts_only_from_known_peers: bool,
    /// The old behaviour, for the hostile tests' positive control only: an
    /// ABORT counts under whatever name its notification declares, so a
    /// third party can spend a decode's share of the abort state (issue 46,
    /// attack 2). Off: an ABORT counts only if it came sealed from a
    /// kv-transfer engine that proved its name ([`crate::sealed`]); a plain
    /// one is dropped and counted (`aborts_unproven`).
    pub accept_unproven_aborts: bool,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        Self {
            drivers: 2,
            engine_hooks: false,
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
            aborts_only_from_known_peers: false,
            accept_unproven_aborts: false,
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
    /// Operations settled on the engine's thread by its completion hook (no
    /// DONE to send: no waiter thread involved).
    ops_settled_by_engine,
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
    /// ABORTs dropped because their sender is not a peer this side chose
    /// (made-up notify names buy no abort state).
    aborts_from_strangers,
    /// ABORTs dropped because no handshake proved their sender's name (a
    /// plain notification: anyone can declare any name).
    aborts_unproven,
    /// Peers the abort tracker holds state for (a gauge).
    abort_state_peers,
    /// Entries the abort tracker holds for all peers: tombstones, early
    /// aborts, unproven ends, waiting ABORTs (a gauge).
    abort_state_entries,
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
        let pools: Arc<Mutex<HashMap<PoolId, PoolEntry>>> = Arc::default();
        let inflight = Arc::new(Mutex::new(Inflight {
            tracker: AbortTracker::with_policy(cfg_max_aborted, cfg_release_policy),
            outbox: Outbox::default(),
            next: 0,
        }));
        let counters: Arc<Counters> = Arc::default();
        let wake: Arc<Wake> = Arc::default();
        let jobs: Arc<[JobQueue]> = (0..drivers).map(|_| JobQueue::default()).collect();
        let settler = Arc::new(Settler {
            pools: pools.clone(),
            inflight: inflight.clone(),
            counters: counters.clone(),
            wake: wake.clone(),
            jobs: jobs.clone(),
        });
        let hooks = cfg.engine_hooks && engine.batch_hooks();
        let inner = Arc::new(Inner {
            self_proto,
            segment_name,
            engine,
            cfg,
            pools,
            peers: Mutex::default(),
            drain: Mutex::new(drain),
            drain_counters,
            grants: Mutex::default(),
            ranges: Mutex::default(),
            inflight,
            sender: sender::SendQueues::new(sender::SendLimits {
                per_peer: cfg_send.0.max(1),
                per_peer_bytes: cfg_send.1.max(1),
                strangers: cfg_send.2.max(1),
            }),
            counters,
            wake,
            notify_wakes: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            jobs,
            hooks,
            settler,
            next_driver: AtomicUsize::new(0),
        });
        // The waker holds the wake-up alone, never the adapter: an engine
        // thread must not end up dropping the adapter (and with it the engine).
        let wake = inner.wake.clone();
        let wakes = inner.engine.set_notify_waker(Arc::new(move || wake.wake()));
        inner.notify_wakes.store(wakes, Ordering::Relaxed);
        let mut threads = Vec::new();
        let mut this = MooncakeTransfer { inner: inner.clone(), threads: Vec::new() };
        for i in 0..drivers {
            let inn = inner.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvt-mc-waiter-{i}"))
                .spawn(move || waiter_loop(&inn, i))
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
        {
            let inflight = lock(&self.inner.inflight);
            m.abort_acks_withheld = inflight.tracker.stats().acks_withheld;
            m.abort_state_peers = inflight.tracker.peers() as u64;
            m.abort_state_entries = inflight.tracker.remembered() as u64;
        }
        m.shadowed = lock(&self.inner.grants).shadowed() as u64;
        m.sends_queued = self.inner.sender.queued() as u64;
        m.ranges_open = lock(&self.inner.ranges).len() as u64;
        m
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

mod driver;
mod initiator;
mod keys;
mod post;
mod ranges;
mod sender;
mod state;
mod target;
pub use keys::TenancyKeys;
#[cfg(test)]
mod tests;

use driver::control_loop;
use initiator::{waiter_loop, InEngine, Settler};
use state::*;
