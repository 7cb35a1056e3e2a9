//! The adapter: `kv-transfer-core`'s [`Transfer`] over a [`NixlEngine`].
//!
//! [`NixlTransfer`] owns one engine (one NIXL agent), registers pools' memory with
//! it and keeps their [`SettlementAuthority`]s, and runs one driver thread.
//!
//! **Initiator side** ([`Transfer::post`]): the local lease is checked
//! ([`check_shapes`], pool registered here), one NIXL request is created for all
//! slots, or taken from the request cache (nothing exposed yet: a failure hands the lease back unexposed), then the
//! lease is exposed locally and the request posted. The driver (or, for a
//! request that ends at once, the posting thread: see below) polls every
//! in-flight request until a terminal status (`IN_PROG` is never terminal, every
//! error and unknown code is an error), *then* releases it, *then* completes the
//! operation with a `Completed` proof, so the lease comes back settled, to the
//! handle or (handle dropped) to the pool. A request that never becomes terminal
//! keeps its lease forever: visible in [`AdapterMetrics::in_flight`], never reused.
//!
//! An error *status* is not such a proof: NIXL's UCX backend returns the first
//! failed part of a request while its other parts may still run. So the
//! operation ends [`Abandoned`](kv_transfer_core::Abandoned) carrying the engine
//! error, its local lease stays quarantined, its remote tenancies are tombstoned,
//! and no `K` is ever sent for them ([`AdapterMetrics::failed_unproven`],
//! [`AdapterMetrics::acks_withheld`]): the target's slots stay quarantined, a
//! counted leak rather than a reuse. (A post that failed but whose request then
//! reached `Done` is proven and completes normally, with the post's error.)
//! With [`AdapterConfig::request_cache`] on (the default), a request without an
//! attached notification that completed successfully is kept (terminal,
//! unreleased) and re-posted by the next identical post instead of being
//! released; a kept request belongs to the cache alone and is taken out of it
//! (under the adapter's lock) by the one post that re-posts it, so it is only
//! ever re-posted once terminal. Its lease still comes back only after the
//! terminal status, and kept requests are released at eviction, before
//! `invalidate_remote_metadata` and before `deregister`.
//!
//! **Finishing in the posting thread**: a request that NIXL reports `Done` from
//! its post call (CMA on one host), or that reaches `Done` while the posting
//! thread polls it for up to [`AdapterConfig::inline_poll`] (only when no other
//! request of ours is in flight), is released or kept and its op completed by
//! the posting thread, the same way the driver would, without waking it. A
//! post that re-posts a cached request without a notification holds the
//! adapter's lock across NIXL's post call (which holds the agent's own lock for
//! as long, so no engine call could run meanwhile anyway) and, when no other
//! request of ours is in flight and inline polling is on, across one status
//! poll right after it: if NIXL reports `Done` there, the request goes back
//! into the cache and the op is complete before any other thread could see it
//! (no op is registered, nothing is handed over); otherwise it becomes an op
//! like any other (an error status from that poll goes to the driver as the
//! op's terminal status, exactly as one met by the inline polling).
//! Any other status (`IN_PROG`, an error, a failed release) goes to the driver.
//!
//! With `notify`, the request carries a `W`/`R` notification naming the target's
//! tenancies (see [`wire`]); NIXL sends it only after the data is flushed. If
//! another request of ours still touches one of those slots, the notification is
//! not attached but sent by the driver once all of them are terminal. After a
//! notifying post, or an abort, those tenancies are tombstoned: a later post
//! naming them (or an older generation of their slots) is refused.
//!
//! Why an initiator-observed `Done` is enough for a `Completed` proof on the
//! target: NIXL's UCX backend ends every posted request with an endpoint flush,
//! so the request reports success only once the puts are remotely complete, and
//! the attached notification is sent only after that (read in NIXL's
//! `ucx_backend.cpp`, `sendXferRange`/`checkXfer`). All descriptors of one of our
//! requests go to one agent, hence one endpoint.
//!
//! **Abort**: NIXL has no cancel. [`TransferHandle::cancel`] waits for the
//! terminal status, then tells the target with a `K` (ABORT_ACK) carrying slot
//! and generation. A target that gives up an exposure sends `A` (ABORT); we
//! answer `K` only when every request of ours on those tenancies is terminal,
//! and never for a tenancy an unproven failure touched.
//!
//! **Target side** ([`NixlTransfer::expose`]): exposures settle from `W`/`R`/`K`
//! notifications sent by the peer they were exposed to. A notification naming a
//! tenancy that is not awaiting settlement, or that was exposed to another peer,
//! is dropped and counted (stale); a message that does not parse is dropped and
//! counted (malformed). When an exposed lease is aborted or dropped, the pool's
//! escalation ladder asks for a drain: the driver sends `A`. NIXL can neither
//! revoke one tenancy's access nor tear down and flush one peer's connection with
//! a confirmation, so `Revoke` and `Fence` produce no proof: the driver re-sends
//! the ABORT and the slots stay quarantined (rule 2), visible in the pool's
//! `quarantined`/`quarantine_stuck` gauges and in
//! [`AdapterMetrics::unsupported_escalations`].
//!
//! **Teardown**: [`NixlTransfer::remove_peer`] invalidates a peer's metadata only
//! once no request to it and no exposure to it is outstanding;
//! [`NixlTransfer::shutdown`] deregisters memory only once nothing is in flight or
//! exposed. Both wait a bounded time; what cannot be torn down safely is reported
//! and leaked (memory stays allocated and registered), never freed early.
//!
//! **Progress** ([`Progress`]): either NIXL's progress thread moves the agent and
//! the driver only observes, or the driver's own polling is the progress (then it
//! also polls notifications while exposures are outstanding). The driver sleeps
//! with a bounded backoff while work is outstanding (after a short polling
//! window following each completion or post, `AdapterConfig::spin`) and blocks on a condition variable
//! with a long timeout when idle: no busy spin in steady state. While a thread
//! keeps re-posting cached requests, the driver hands its periodic
//! notification poll to that thread, which makes it between two posts (it
//! would otherwise block on the agent's lock, held across each small post, and
//! then block the next post); what that poll fetches is handled by the driver,
//! in order, and the driver polls by itself again once posting stops.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_transfer_core::drain::{
    AbortTracker, Capabilities, ControlKind, ControlMessage, DecodeError, ExposureTable, ExposureToken, OpEnd, Outbox,
    Outgoing, Plan, ReleasePolicy, Trust,
};
use kv_transfer_core::{
    check_shapes, BackendError, Completed, Completer, ExposeError, ExposeErrorKind, Exposed, MemoryKind, Op, PeerId,
    PoolConfig, PoolError, PoolId, PostError, PostErrorKind, PostNow, Region, RemoteSlot, RemoteSlots, Reserved,
    SettlementAuthority, SlotLease, SlotPool, Target, Tenancy, TransferError, TransferHandle, TransferOptions,
};
// Named in the docs; the impl comes from `impl_transfer_via_post_now!`.
#[cfg(doc)]
use kv_transfer_core::Transfer;

use crate::engine::{
    AgentConfig, EngineConfig, EngineError, IdMap, MemRegion, NixlEngine, Notification, RealNixlEngine, RegId, ReqId,
    XferOp, XferSpec, XferState,
};

/// What NIXL lets this adapter prove: drain and ack only. NIXL can neither
/// revoke one tenancy's access nor tear one peer's connection down and
/// confirm it flushed.
pub const CAPABILITIES: Capabilities = Capabilities::DRAIN_ONLY;

/// Tombstones and unproven tenancies remembered (oldest forgotten first).
const REMEMBERED: usize = 1 << 16;

/// The backend name reported by [`Transfer::backend`] and in [`TransferError::Engine`].
pub const BACKEND: &str = "nixl";

/// Most emptied tenancy lists kept for reuse.
const SPARE_TENANCY_LISTS: usize = 64;

/// `code` of a [`TransferError::Engine`] whose cause is not a NIXL status (an
/// adapter-side error such as an unknown request).
pub const NO_NIXL_STATUS: i64 = -1000;

/// Who makes progress on the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Progress {
    /// NIXL's progress thread (the agent must be created with it, as
    /// [`NixlTransfer::new_real`] does). The driver only observes.
    #[default]
    AgentThread,
    /// The adapter's driver thread: its polling of request status and
    /// notifications is the progress (the agent runs no progress thread).
    Driver,
}

/// Configuration of a [`NixlTransfer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterConfig {
    /// Who makes progress.
    pub progress: Progress,
    /// With [`Progress::AgentThread`], the delay [`NixlTransfer::new_real`] gives
    /// NIXL's progress thread between rounds (`pthr_delay_us`). At 0 that thread
    /// busy-spins (measured here: about 75% of a core per agent, idle); 10 µs
    /// brings an idle pair of agents to a few percent of one core.
    pub agent_progress_delay: Duration,
    /// Shortest sleep between polls while requests are in flight.
    pub poll_min: Duration,
    /// Longest sleep between polls while requests are in flight (backoff cap).
    pub poll_max: Duration,
    /// After a post or completion, keep polling without sleeping for this long
    /// (keeps small transfers' latency low; zero disables). Once it has passed
    /// with nothing new, the driver sleeps with backoff.
    pub spin: Duration,
    /// How often notifications are polled while exposures or messages are
    /// outstanding (with [`Progress::AgentThread`]; with [`Progress::Driver`] they
    /// are polled at the request polling rate).
    pub notif_interval: Duration,
    /// Driver wake-up period when nothing is outstanding.
    pub idle_interval: Duration,
    /// How long [`Drop`] waits for outstanding work before leaking it.
    pub teardown_timeout: Duration,
    /// After a post that NIXL did not finish inside its post call, and when no
    /// other request of this adapter was in flight, the posting thread polls the
    /// request's status for up to this long before handing it to the driver
    /// thread; a request that is terminal by then is finished in the posting
    /// thread, without waking the driver (two thread hops saved: measured here,
    /// 64 KiB over `UCX_TLS=tcp` at one transfer at a time went from ~58% to
    /// ~75% of the raw loop at 20 µs). Zero disables it, and the status poll a
    /// cached re-post makes under the adapter's lock (see the module docs).
    /// Bounds how long [`Transfer::post`] spends beyond NIXL's own post (and
    /// that one status poll).
    pub inline_poll: Duration,
    /// Completed requests kept for re-posting (0: off; default 64). A request
    /// without an attached notification that completed successfully is not
    /// released at once but kept, terminal, and re-posted by a later post with
    /// exactly the same descriptors and peer, saving NIXL's create and release per
    /// transfer. Its lease still comes back only after the terminal status; the
    /// release itself happens at eviction (the least recently completed goes
    /// first), at [`NixlTransfer::remove_peer`] before
    /// `invalidate_remote_metadata`, and at shutdown before `deregister`.
    pub request_cache: usize,
    /// Capacity of the target-side event queue ([`NixlTransfer::take_events`]);
    /// the oldest events are dropped (and counted) beyond it.
    pub event_capacity: usize,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        Self {
            progress: Progress::AgentThread,
            agent_progress_delay: Duration::from_micros(10),
            poll_min: Duration::from_micros(20),
            poll_max: Duration::from_millis(1),
            spin: Duration::from_micros(100),
            notif_interval: Duration::from_millis(1),
            idle_interval: Duration::from_millis(10),
            teardown_timeout: Duration::from_secs(5),
            inline_poll: Duration::from_micros(20),
            request_cache: 64,
            event_capacity: 4096,
        }
    }
}

/// Errors of the adapter's own calls (not of transfers).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterError {
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Only host memory with a host pointer can be registered.
    #[error("only host memory can be registered with this adapter")]
    NotHostMemory,
    /// No such peer.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// The pool was not registered here.
    #[error("pool {0:?} is not registered with this adapter")]
    ForeignPool(PoolId),
    /// Teardown refused: work that may still touch the peer or memory is outstanding.
    #[error("{what}: {in_flight} request(s) and {exposed} exposure(s) still outstanding")]
    Busy {
        /// What was refused.
        what: String,
        /// Requests not yet terminal and released.
        in_flight: usize,
        /// Exposures not yet settled.
        exposed: usize,
    },
    /// The adapter is shutting down.
    #[error("the adapter is shutting down")]
    ShuttingDown,
}

/// Adapter counters and gauges (the pools keep their own: `SlotPool::metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterMetrics {
    /// Requests posted and not yet terminal and released (gauge).
    pub in_flight: usize,
    /// Age of the oldest of them that the driver polls (counted from when its
    /// posting thread handed it over).
    pub oldest_in_flight: Option<Duration>,
    /// Exposures to peers not yet settled (gauge, slots).
    pub exposed_slots: usize,
    /// Outgoing messages waiting for requests to drain (gauge).
    pub pending_messages: usize,
    /// Requests posted.
    pub posted: u64,
    /// Of those, completed requests re-posted from the cache.
    pub reposted: u64,
    /// Completed requests kept for re-posting (gauge).
    pub cached_requests: usize,
    /// Requests that ended in success.
    pub completed_ok: u64,
    /// Requests that ended in an error.
    pub completed_err: u64,
    /// `release_xfer` calls that failed (retried).
    pub release_failures: u64,
    /// Adapter messages received.
    pub messages_received: u64,
    /// Messages that did not parse (dropped).
    pub malformed: u64,
    /// Notifications that are not adapter messages, or from unknown agents (dropped).
    pub foreign: u64,
    /// Tenancies named by a message that were not awaiting settlement or were
    /// exposed to another peer (dropped; also counted in the pool's `stale_rejected`).
    pub stale: u64,
    /// Tenancies settled by a message (`Completed`).
    pub settled_by_message: u64,
    /// ABORTs sent (target side).
    pub aborts_sent: u64,
    /// ABORTs received (initiator side).
    pub aborts_received: u64,
    /// ABORT_ACKs sent (initiator side).
    pub acks_sent: u64,
    /// Operations whose status was an engine error: NIXL may report one while
    /// other parts of the request still run, so their local leases stay
    /// quarantined (the handle resolves `Abandoned`) and no ack is sent.
    pub failed_unproven: u64,
    /// Tenancies for which an ABORT_ACK was withheld because an operation on
    /// them failed without proof that it stopped (the target keeps them
    /// quarantined: a leak, never a reuse).
    pub acks_withheld: u64,
    /// Completion messages sent by the driver (deferred `W`/`R`).
    pub deferred_notifs_sent: u64,
    /// Posts refused because the remote tenancy was handed back or aborted.
    pub refused_tombstoned: u64,
    /// `get_notifs`/`gen_notif` failures.
    pub notif_errors: u64,
    /// Target-side events dropped because the queue was full.
    pub events_dropped: u64,
    /// Registrations leaked at teardown because something might still touch them.
    pub leaked_registrations: u64,
}

/// A target-side event: a peer settled some of our exposed tenancies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlEvent {
    /// The peer.
    pub peer: PeerId,
    /// Our pool.
    pub pool: PoolId,
    /// The tenancies settled (stale ones removed).
    pub tenancies: Vec<Tenancy>,
    /// What the peer said: `Done` (its operation succeeded) or `AbortAck`
    /// (it stopped; the bytes may be incomplete).
    pub kind: ControlKind,
}

/// What [`NixlTransfer::shutdown`] achieved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Requests still not terminal at the deadline: their leases stay quarantined,
    /// the engine and memory are leaked.
    pub in_flight_left: usize,
    /// Exposed slots not settled at the deadline (memory leaked, registered).
    pub exposed_left: usize,
    /// Registrations deregistered.
    pub deregistered: usize,
    /// Registrations leaked.
    pub leaked: usize,
}

struct PoolEntry {
    authority: SettlementAuthority,
    region: Arc<dyn Region>,
    reg: RegId,
}

/// A request kept for re-posting, and what it moves: re-posted only for an
/// identical post.
struct CacheKey {
    agent: Arc<str>,
    op: XferOp,
    /// The first (local, remote) descriptor pair: most posts have just one,
    /// contiguous slots being merged.
    first: (MemRegion, MemRegion),
    /// The other pairs.
    rest: Vec<(MemRegion, MemRegion)>,
    req: ReqId,
}

/// An operation from admission until its request is terminal and released (or
/// kept for re-posting). Small: posts that finish in their own thread only
/// insert and remove it.
struct InFlight {
    /// The op's id (in `ops` and in the abort tracker).
    id: u64,
    agent: Arc<str>,
    remote_pool: PoolId,
    /// The remote exposure's token (every message about it carries it).
    token: ExposureToken,
    remote: Vec<Tenancy>,
    notify: bool,
    notif_attached: bool,
    local_pool: PoolId,
    /// Set when the posting thread hands the op to the driver; until then the
    /// driver leaves it alone.
    driven: Option<Box<Driven>>,
}

/// An op's state once the driver polls it.
struct Driven {
    req: ReqId,
    /// Set when the request may be kept for re-posting after a clean completion.
    key: Option<CacheKey>,
    completer: Option<Completer>,
    /// When the op was handed to the driver.
    started: Instant,
    post_error: Option<TransferError>,
    /// Terminal status seen; release still to do.
    terminal: Option<Result<(), TransferError>>,
    /// The engine no longer knows the request (nothing to release).
    forgotten: bool,
    /// A thread is releasing and completing it.
    finishing: bool,
}

/// How an op ended, for [`Inner::conclude`].
struct End {
    completer: Option<Completer>,
    /// The request, kept for re-posting (else it was released).
    key: Option<CacheKey>,
    terminal: Option<Result<(), TransferError>>,
    post_error: Option<TransferError>,
}

struct State {
    closing: bool,
    stop: bool,
    next_op: u64,
    ops: IdMap<u64, InFlight>,
    pools: IdMap<PoolId, PoolEntry>,
    peers: HashMap<PeerId, Arc<str>>,
    names: IdMap<Arc<str>, PeerId>,
    /// The entry of `names` the last post found (a clone of its key): posts go
    /// to one peer in runs, and comparing a name costs less than hashing it.
    /// Cleared when that peer is removed.
    last_peer: Option<(Arc<str>, PeerId)>,
    next_peer: u32,
    /// Target side of core's drain protocol: live exposures, their tokens.
    exposures: ExposureTable,
    /// Initiator side of core's drain protocol: tombstones, tenancies an
    /// unproven failure touched, ABORTs waiting for ops.
    aborts: AbortTracker<Arc<str>>,
    /// Messages for peers (DONE deferred until no request of ours touches
    /// the slots, ABORT_ACK), with core's one retry policy.
    outgoing: Outbox<Arc<str>>,
    /// Completed requests (terminal, unreleased) for re-posting, oldest first.
    cache: Vec<CacheKey>,
    /// Emptied tenancy lists of finished ops, reused by posts (no allocation per post).
    spare: Vec<Vec<Tenancy>>,
    /// Cached re-posts made under the lock, finished there or not (the driver
    /// compares it between rounds to see whether a thread is posting; see
    /// [`Inner::take_notif_poll`]).
    fast_posts: u64,
    /// Notifications a posting thread fetched for the driver, oldest first.
    inbox: Vec<Notification>,
    events: VecDeque<NixlEvent>,
    next_escalation: Option<Instant>,
    m: AdapterMetrics,
}

impl Default for State {
    fn default() -> Self {
        Self {
            closing: false,
            stop: false,
            next_op: 0,
            ops: IdMap::default(),
            pools: IdMap::default(),
            peers: HashMap::new(),
            names: IdMap::default(),
            last_peer: None,
            next_peer: 0,
            exposures: ExposureTable::new(),
            aborts: AbortTracker::new(REMEMBERED),
            outgoing: Outbox::default(),
            cache: Vec::new(),
            spare: Vec::new(),
            fast_posts: 0,
            inbox: Vec::new(),
            events: VecDeque::new(),
            next_escalation: None,
            m: AdapterMetrics::default(),
        }
    }
}

struct Wake {
    flag: Mutex<bool>,
    /// The driver is blocked in `wait` (only then is a notify worth a syscall).
    waiting: std::sync::atomic::AtomicBool,
    cv: Condvar,
}

impl Wake {
    fn new() -> Self {
        Self { flag: Mutex::new(false), waiting: std::sync::atomic::AtomicBool::new(false), cv: Condvar::new() }
    }
    fn wake(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        *self.flag.lock().unwrap_or_else(|p| p.into_inner()) = true;
        if self.waiting.load(SeqCst) {
            self.cv.notify_one();
        }
    }
    /// Waits up to `d` for a wake-up; returns whether one came.
    fn wait(&self, d: Duration) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let mut g = self.flag.lock().unwrap_or_else(|p| p.into_inner());
        if !*g {
            // Set under the lock: a `wake` either sets the flag before we look at it
            // or sees `waiting` and notifies after we block.
            self.waiting.store(true, SeqCst);
            g = match self.cv.wait_timeout(g, d) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            self.waiting.store(false, SeqCst);
        }
        std::mem::replace(&mut *g, false)
    }
}

struct Inner {
    engine: Arc<dyn NixlEngine>,
    name: Arc<str>,
    cfg: AdapterConfig,
    state: Mutex<State>,
    changed: Condvar,
    /// Threads blocked in `wait_changed`.
    changed_waiters: std::sync::atomic::AtomicUsize,
    wake: Arc<Wake>,
    /// The driver handed its next notification poll to a posting thread (see
    /// [`Inner::take_notif_poll`]).
    notif_due: std::sync::atomic::AtomicBool,
}

/// `kv-transfer-core`'s [`Transfer`] over NIXL. See the [module docs](self).
pub struct NixlTransfer {
    inner: Arc<Inner>,
    driver: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for NixlTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransfer").field("agent", &self.inner.name).finish_non_exhaustive()
    }
}

/// A terminal status as polled: the result (an error proves nothing about the
/// NIC) and whether the engine no longer knows the request.
type Terminal = (Result<(), TransferError>, bool);

/// What a status poll says: `None` while the request is in progress
/// (`IN_PROG` is never terminal), else its terminal result (every error and
/// unknown status is an error) and whether the engine no longer knows it.
fn terminal(status: Result<XferState, EngineError>) -> Option<Terminal> {
    match status {
        Ok(XferState::InProgress) => None,
        Ok(XferState::Done) => Some((Ok(()), false)),
        Err(e) => Some((Err(engine_error(&e)), matches!(e, EngineError::UnknownRequest(_)))),
    }
}

fn engine_error(e: &EngineError) -> TransferError {
    TransferError::Engine {
        engine: BACKEND,
        code: e.status().map_or(NO_NIXL_STATUS, |s| i64::from(s.to_raw())),
        message: e.to_string(),
    }
}

/// `now + timeout`, or about a year from now if that overflows.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(365 * 86_400))
}

fn slots_overlap(a: &[Tenancy], b: &[Tenancy]) -> bool {
    a.iter().any(|x| b.iter().any(|y| x.slot == y.slot))
}

/// Local and remote slot addresses paired into descriptors, merging runs that
/// are contiguous on both sides.
struct Descriptors<I: Iterator<Item = (u64, u64)>> {
    pairs: I,
    slot: u64,
    next: Option<(u64, u64)>,
}

impl<I: Iterator<Item = (u64, u64)>> Descriptors<I> {
    fn new(pairs: I, slot: u64) -> Self {
        Self { pairs, slot, next: None }
    }
}

/// The descriptors of a post: the lease's slots paired with the remote ones.
fn descriptors<'a>(
    local: &'a SlotLease<Reserved>,
    remote: &'a RemoteSlots,
) -> Descriptors<impl Iterator<Item = (u64, u64)> + 'a> {
    let pairs = (0..local.len()).filter_map(|i| local.slot_addr(i)).zip(remote.slots.iter().map(|s| s.addr));
    Descriptors::new(pairs, remote.slot_size)
}

impl<I: Iterator<Item = (u64, u64)>> Iterator for Descriptors<I> {
    type Item = (MemRegion, MemRegion);

    fn next(&mut self) -> Option<Self::Item> {
        let (la, ra) = self.next.take().or_else(|| self.pairs.next())?;
        let mut len = self.slot;
        for (l, r) in self.pairs.by_ref() {
            if l == la + len && r == ra + len {
                len += self.slot;
            } else {
                self.next = Some((l, r));
                break;
            }
        }
        Some((MemRegion::new(la as usize, len as usize), MemRegion::new(ra as usize, len as usize)))
    }
}

impl NixlTransfer {
    /// An adapter over `engine`, with its driver thread started.
    pub fn new(engine: Arc<dyn NixlEngine>, cfg: AdapterConfig) -> Result<Self, AdapterError> {
        let name: Arc<str> = engine.agent_name().into();
        let inner = Arc::new(Inner {
            engine,
            name,
            cfg,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            changed_waiters: std::sync::atomic::AtomicUsize::new(0),
            wake: Arc::new(Wake::new()),
            notif_due: std::sync::atomic::AtomicBool::new(false),
        });
        let d = Arc::clone(&inner);
        let driver =
            std::thread::Builder::new()
                .name(format!("nixl-driver-{}", inner.name))
                .spawn(move || d.drive())
                .map_err(|e| AdapterError::Engine(EngineError::InvalidArgument(format!("cannot start driver: {e}"))))?;
        Ok(Self { inner, driver: Mutex::new(Some(driver)) })
    }

    /// Loads the library and builds a [`RealNixlEngine`] (UCX) named `name` whose
    /// agent runs NIXL's progress thread exactly when `cfg.progress` says so (with
    /// `cfg.agent_progress_delay` between rounds).
    pub fn new_real(name: &str, cfg: AdapterConfig) -> Result<Self, AdapterError> {
        let mut ec = EngineConfig::ucx(name);
        ec.agent = AgentConfig {
            progress_thread: cfg.progress == Progress::AgentThread,
            progress_delay_us: u64::try_from(cfg.agent_progress_delay.as_micros()).unwrap_or(u64::MAX),
            ..AgentConfig::default()
        };
        let engine = RealNixlEngine::new(ec)?;
        Self::new(Arc::new(engine), cfg)
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<dyn NixlEngine> {
        &self.inner.engine
    }

    /// This agent's name (the `endpoint` of the `RemoteSlots` it exposes).
    pub fn agent_name(&self) -> &str {
        &self.inner.name
    }

    /// Builds a pool over `region` and registers the region with NIXL. The pool's
    /// authority stays inside the adapter; the region is kept alive (and leaked if
    /// it can never be safely deregistered).
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        if region.kind() != MemoryKind::Host || region.host_ptr().is_none() {
            return Err(AdapterError::NotHostMemory);
        }
        if self.inner.state().closing {
            return Err(AdapterError::ShuttingDown);
        }
        let (pool, authority) = SlotPool::new(Arc::clone(&region), config.with_capabilities(CAPABILITIES))?;
        let mr = MemRegion::new(region.addr() as usize, region.len());
        // SAFETY: the region is host memory of this process (checked above). The
        // adapter keeps an `Arc` to it until it deregisters it, which it does only
        // when no request of ours and no exposure of it is outstanding; otherwise
        // it leaks the `Arc`, so the memory is never freed while registered. Rust
        // code reaches the bytes only through `Region`'s raw copies.
        let reg = unsafe { self.inner.engine.register_dram(&[mr]) }?;
        let wake = Arc::clone(&self.inner.wake);
        authority.on_quarantine(move || wake.wake());
        self.inner.state().pools.insert(pool.id(), PoolEntry { authority, region, reg });
        Ok(pool)
    }

    /// This agent's metadata, for peers' [`add_peer`](Self::add_peer). Call it
    /// after registering the pools peers will target.
    pub fn local_metadata(&self) -> Result<Vec<u8>, AdapterError> {
        Ok(self.inner.engine.local_metadata()?)
    }

    /// Loads a peer's metadata. Loading the same agent again returns its id.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<PeerId, AdapterError> {
        let name: Arc<str> = self.inner.engine.load_remote_metadata(metadata)?.into();
        let mut st = self.inner.state();
        if let Some(p) = st.names.get(&name) {
            return Ok(*p);
        }
        let id = PeerId(st.next_peer);
        st.next_peer += 1;
        st.peers.insert(id, Arc::clone(&name));
        st.names.insert(name, id);
        Ok(id)
    }

    /// A peer's agent name.
    pub fn peer_name(&self, peer: PeerId) -> Option<String> {
        self.inner.state().peers.get(&peer).map(|s| s.to_string())
    }

    /// Target side: exposes `lease`'s slots to `peer` and describes them. The
    /// exposure settles when the peer's `W`/`R`/`K` message for these tenancies
    /// arrives; aborting it sends the peer an ABORT.
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let mut st = self.inner.state();
        if st.closing {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ShuttingDown });
        }
        let pool = lease.pool().id();
        let Some(entry) = st.pools.get(&pool) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ForeignPool });
        };
        if !st.peers.contains_key(&peer) {
            return Err(ExposeError { lease, kind: ExposeErrorKind::UnknownPeer(peer) });
        }
        let (key, authority) = (entry.reg.0, entry.authority.clone());
        let token = st.exposures.expose(pool, lease.tenancies(), peer, Trust::Proving);
        st.m.exposed_slots = st.exposures.len();
        // Under the lock: a message for these tenancies waits until they are recorded.
        let (exposed, remote) = authority.expose(lease, peer, key, self.inner.name.to_string(), token);
        drop(st);
        self.inner.wake.wake();
        Ok((exposed, remote))
    }

    /// Target-side events since the last call (oldest first).
    pub fn take_events(&self) -> Vec<NixlEvent> {
        self.inner.state().events.drain(..).collect()
    }

    /// A snapshot of the adapter's counters.
    pub fn metrics(&self) -> AdapterMetrics {
        let st = self.inner.state();
        let mut m = st.m;
        m.in_flight = st.ops.len();
        m.oldest_in_flight = st.ops.values().filter_map(|o| o.driven.as_ref()).map(|d| d.started.elapsed()).max();
        m.exposed_slots = st.exposures.len();
        m.pending_messages = st.outgoing.len();
        m.cached_requests = st.cache.len();
        m.acks_withheld = st.aborts.stats().acks_withheld;
        m
    }

    /// Forgets a peer (`invalidate_remote_metadata`) once no request to it, no
    /// exposure to it and no message for it is outstanding, waiting at most
    /// `timeout`. On timeout nothing is invalidated and the error says what is left.
    pub fn remove_peer(&self, peer: PeerId, timeout: Duration) -> Result<(), AdapterError> {
        let deadline = deadline_after(timeout);
        let mut st = self.inner.state();
        let name = st.peers.get(&peer).cloned().ok_or(AdapterError::UnknownPeer(peer))?;
        loop {
            let in_flight = st.ops.values().filter(|o| o.agent == name).count();
            let exposed = st.exposures.exposed_to(peer);
            let msgs = st.outgoing.iter().filter(|o| o.to == name).count();
            if in_flight == 0 && exposed == 0 && msgs == 0 {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(AdapterError::Busy {
                    what: format!("invalidate metadata of {name:?}"),
                    in_flight,
                    exposed,
                });
            }
            st = self.inner.wait_changed(st, deadline - now);
        }
        // Under the lock, so no post to this peer can start in between: completed
        // requests kept for re-posting go first, then the metadata.
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut st.cache).into_iter().partition(|k| k.agent == name);
        st.cache = kept;
        for k in gone {
            if !self.inner.release_cached(k.req) {
                st.m.release_failures += 1;
            }
        }
        self.inner.engine.invalidate_remote_metadata(&name)?;
        st.peers.remove(&peer);
        st.names.remove(&name);
        st.last_peer = None;
        st.aborts.forget_peer(&name);
        Ok(())
    }

    /// Stops accepting work, waits up to `timeout` for every request to be
    /// terminal and released and every exposure settled, stops the driver, and
    /// deregisters the pools. What is still outstanding at the deadline is
    /// reported; the memory it may touch stays registered and allocated for the
    /// life of the process (and the engine is kept alive), so nothing is freed
    /// under a NIC. Idempotent.
    pub fn shutdown(&self, timeout: Duration) -> ShutdownReport {
        let deadline = deadline_after(timeout);
        let mut st = self.inner.state();
        st.closing = true;
        self.inner.wake.wake();
        while !(st.ops.is_empty() && st.exposures.is_empty() && st.outgoing.is_empty()) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = self.inner.wait_changed(st, deadline - now);
        }
        st.stop = true;
        drop(st);
        self.inner.wake.wake();
        let handle = self.driver.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        let cached: Vec<ReqId> = std::mem::take(&mut self.inner.state().cache).into_iter().map(|k| k.req).collect();
        for req in cached {
            if !self.inner.release_cached(req) {
                self.inner.state().m.release_failures += 1;
            }
        }
        let mut st = self.inner.state();
        let mut report =
            ShutdownReport { in_flight_left: st.ops.len(), exposed_left: st.exposures.len(), ..Default::default() };
        let ops_left = !st.ops.is_empty();
        let pools: Vec<(PoolId, PoolEntry)> = st.pools.drain().collect();
        let mut leak_engine = ops_left;
        for (id, entry) in pools {
            let exposed = st.exposures.exposed_in(id) > 0;
            let safe = !ops_left && !exposed && self.inner.engine.deregister(entry.reg).is_ok();
            if safe {
                report.deregistered += 1;
            } else {
                tracing::warn!(pool = id.0, "memory may still be touched by a NIC: leaking its registration");
                report.leaked += 1;
                st.m.leaked_registrations += 1;
                leak_engine = true;
                std::mem::forget(entry.region);
            }
        }
        // Completers of requests that never became terminal: dropping them
        // quarantines their leases (their memory was leaked above) and resolves
        // their handles `Abandoned`.
        let ops: Vec<InFlight> = st.ops.drain().map(|(_, o)| o).collect();
        drop(st);
        if leak_engine {
            // Never release a request or destroy the agent under a possible write.
            std::mem::forget(Arc::clone(&self.inner.engine));
        }
        drop(ops);
        if report.in_flight_left > 0 || report.exposed_left > 0 {
            tracing::warn!(?report, "NIXL adapter shut down with outstanding work");
        }
        report
    }
}

impl Drop for NixlTransfer {
    fn drop(&mut self) {
        let running = self.driver.lock().map(|d| d.is_some()).unwrap_or(true);
        if running {
            self.shutdown(self.inner.cfg.teardown_timeout);
        }
    }
}

impl PostNow for NixlTransfer {
    fn post_now(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        self.inner.post(op, local, remote, opts)
    }
}

kv_transfer_core::impl_transfer_via_post_now!(NixlTransfer, BACKEND);

/// The target side every backend shares. A peer's descriptor is its
/// agent's metadata ([`NixlTransfer::local_metadata`]).
impl Target for NixlTransfer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        NixlTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            AdapterError::NotHostMemory => BackendError::Unsupported(e.to_string()),
            AdapterError::ShuttingDown => BackendError::ShuttingDown,
            e => BackendError::Engine { backend: BACKEND, message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        self.local_metadata().map_err(|e| BackendError::Engine { backend: BACKEND, message: e.to_string() })
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        NixlTransfer::add_peer(self, descriptor).map_err(|e| BackendError::Peer(e.to_string()))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        NixlTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        let m = self.metrics();
        kv_transfer_core::named_counters!(m; in_flight, exposed_slots, pending_messages, posted, reposted,
            cached_requests, completed_ok, completed_err, release_failures, messages_received, malformed, foreign,
            stale, settled_by_message, aborts_sent, aborts_received, acks_sent, failed_unproven, acks_withheld,
            deferred_notifs_sent, refused_tombstoned, notif_errors, events_dropped, leaked_registrations)
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the tables consistent; take a poisoned lock over.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits (at most 50 ms at a time) for the driver or a completion to change
    /// the tables. Called with the state lock held.
    fn wait_changed<'a>(&self, g: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        use std::sync::atomic::Ordering::SeqCst;
        self.changed_waiters.fetch_add(1, SeqCst);
        let g = match self.changed.wait_timeout(g, d.min(Duration::from_millis(50))) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
        self.changed_waiters.fetch_sub(1, SeqCst);
        g
    }

    /// Wakes teardown waiters, if any (a notify is a syscall; the hot path has none).
    fn notify_changed(&self) {
        if self.changed_waiters.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.changed.notify_all();
        }
    }

    #[allow(clippy::result_large_err)]
    fn post(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        let xop = if op == Op::Write { XferOp::Write } else { XferOp::Read };
        // The first descriptor pair, and whether it is the only one (what a cache
        // lookup compares first).
        let (first, single) = if self.cfg.request_cache > 0 {
            let mut d = descriptors(&local, remote);
            (d.next(), d.next().is_none())
        } else {
            (None, false)
        };
        // Admission under the lock: peer, tombstones, overlap.
        let mut guard = self.state();
        let st = &mut *guard;
        let (agent_id, peer, overlap) = match Self::admit(st, &local, remote) {
            Ok(a) => a,
            Err(kind) => return Err(PostError { lease: local, kind }),
        };
        // A notification attached to the request carries one DONE of at most
        // the codec's tenancies; a larger one goes deferred, in chunks.
        let attach = opts.notify && !overlap && remote.slots.len() <= kv_transfer_core::drain::MAX_TENANCIES;
        // A completed request with the very same descriptors, peer and no
        // notification: re-post it instead of creating one.
        let hit = match first {
            Some(first) if !attach => st.cache.iter().rposition(|c| {
                c.first == first
                    && c.op == xop
                    && Arc::as_ptr(&c.agent).cast::<u8>() == agent_id
                    && if c.rest.is_empty() {
                        single
                    } else {
                        !single && descriptors(&local, remote).skip(1).eq(c.rest.iter().copied())
                    }
            }),
            _ => None,
        };
        if let (Some(i), false) = (hit, opts.notify) {
            // The common case: re-post under the lock (NIXL's post holds the
            // agent's own lock anyway, so no engine call could run meanwhile). If
            // NIXL finished it inside its post, or (no other op of ours in flight,
            // inline polling on) at the one status poll that follows it still
            // under the lock, it stays cached and the op is complete: nothing else
            // ever saw it, so nothing else has to be told.
            let req = st.cache[i].req;
            let alone = st.ops.is_empty();
            let exposed = match st.pools.get(&local.pool().id()) {
                Some(p) => p.authority.expose_local(local, peer),
                None => return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool }),
            };
            let (mut first, status) = self.engine.post_xfer_polled(req, alone && !self.cfg.inline_poll.is_zero());
            st.fast_posts += 1;
            let fetched = self.take_notif_poll(st);
            let mut polled = None;
            match status.and_then(terminal) {
                Some((Ok(()), _)) => first = Ok(XferState::Done),
                // An error status: terminal, unproven; the driver finishes it.
                other => polled = other,
            }
            if matches!(first, Ok(XferState::Done)) {
                st.m.posted += 1;
                st.m.reposted += 1;
                st.m.completed_ok += 1;
                // Most recently completed last.
                if i + 1 != st.cache.len() {
                    let key = st.cache.remove(i);
                    st.cache.push(key);
                }
                let proof = st.pools.get(&exposed.pool().id()).map(|p| p.authority.completed(exposed.tenancies()));
                let pending = fetched || !st.outgoing.is_empty();
                drop(guard);
                return Ok(self.finish_fast(exposed, proof, pending));
            }
            // Not finished inside the post: the request is this op's alone, and the
            // op one like any other from here.
            let (handle, completer) = TransferHandle::pair(exposed);
            let key = st.cache.remove(i);
            let agent = key.agent.clone();
            let op_id = Self::register(st, agent, remote, &opts, false, completer.lease().pool().id());
            drop(guard);
            if fetched {
                self.wake.wake();
            }
            self.after_post(op_id, req, Some(key), completer, (first, polled), (true, alone));
            return Ok(handle);
        }
        let Some(agent) = st.peers.get(&peer).cloned() else {
            return Err(PostError { lease: local, kind: PostErrorKind::Peer(format!("{peer:?} was removed")) });
        };
        let Some(authority) = st.pools.get(&local.pool().id()).map(|p| p.authority.clone()) else {
            return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool });
        };
        // Taking it out of the cache makes it this post's alone.
        let cached = hit.map(|i| st.cache.remove(i));
        // A placeholder that aborts, teardown and other posts see.
        let alone = st.ops.is_empty();
        let op_id = Self::register(st, agent.clone(), remote, &opts, attach, local.pool().id());
        drop(guard);
        let reposted = cached.is_some();
        // Nothing is exposed by creating a request: a failure hands the lease back.
        let (req, key) = match cached {
            Some(c) => (c.req, Some(c)),
            None => match self.create_request(xop, &local, remote, agent, attach) {
                Ok(created) => created,
                Err(e) => {
                    self.state().ops.remove(&op_id);
                    self.notify_changed();
                    self.wake.wake();
                    return Err(PostError { lease: local, kind: PostErrorKind::Engine(e.to_string()) });
                }
            },
        };
        let (handle, completer) = TransferHandle::pair(authority.expose_local(local, peer));
        // From here the request may run: it is finished only at a terminal status.
        let first = self.engine.post_xfer(req);
        self.after_post(op_id, req, key, completer, (first, None), (reposted, alone));
        Ok(handle)
    }

    /// Records an admitted op (its posting thread's until handed to the driver).
    fn register(
        st: &mut State,
        agent: Arc<str>,
        remote: &RemoteSlots,
        opts: &TransferOptions,
        attach: bool,
        local_pool: PoolId,
    ) -> u64 {
        let id = st.next_op;
        st.next_op += 1;
        // Admitted under this lock already (`admit`'s tombstone check): an
        // ABORT from now on waits for this op.
        let _ = st.aborts.admit(id, &agent, remote, false);
        let mut ts = st.spare.pop().unwrap_or_default();
        ts.extend(remote.slots.iter().map(RemoteSlot::tenancy));
        st.ops.insert(
            id,
            InFlight {
                id,
                agent,
                remote_pool: remote.pool,
                token: remote.token,
                remote: ts,
                notify: opts.notify,
                notif_attached: attach,
                local_pool,
                driven: None,
            },
        );
        id
    }

    /// Runs the notification poll the driver handed to posting threads, if it
    /// is still due, and keeps what it fetched in [`State::inbox`]; returns
    /// whether anything came (the caller wakes the driver).
    ///
    /// Called by a cached re-post right after its post, under the lock. A
    /// thread that keeps posting holds NIXL's agent lock most of the time (a
    /// small post copies inside the call), so the driver's own periodic
    /// `get_notifs` would block on it and then make the next post block in
    /// turn: a sleep and a wake-up each time, on the posting thread's
    /// critical path. Polled here, between two posts, it costs that thread
    /// one uncontended call instead.
    fn take_notif_poll(&self, st: &mut State) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Relaxed};
        if !self.notif_due.load(Relaxed) || !self.notif_due.swap(false, AcqRel) {
            return false;
        }
        match self.engine.get_notifs() {
            Ok(n) => {
                let fetched = !n.is_empty();
                st.inbox.extend(n);
                fetched
            }
            Err(e) => {
                tracing::debug!(error = %e, "get_notifs failed");
                st.m.notif_errors += 1;
                false
            }
        }
    }

    /// Puts a completed request back into the cache; returns the one evicted.
    fn keep(&self, st: &mut State, key: CacheKey) -> Option<ReqId> {
        st.cache.push(key);
        (st.cache.len() > self.cfg.request_cache).then(|| st.cache.remove(0).req)
    }

    /// The end of a post finished under the lock (called without it).
    fn finish_fast(&self, exposed: SlotLease<Exposed>, proof: Option<Completed>, pending: bool) -> TransferHandle {
        let handle = match proof {
            // Settled now; the handle resolves at its first poll (no completer).
            Some(proof) => {
                let (handle, settled) = TransferHandle::completed(exposed, proof, Ok(()));
                if let Err(e) = settled {
                    tracing::error!(error = %e, "completion proof did not settle the lease; it is quarantined");
                }
                handle
            }
            // No pool, no proof: dropping the completer quarantines the lease.
            None => TransferHandle::pair(exposed).0,
        };
        if pending {
            self.wake.wake();
        }
        handle
    }

    /// What follows NIXL's post of a registered op: until the op is handed over,
    /// the driver leaves it alone, so this thread may poll it (small transfers
    /// then finish without a thread hop) if no other op was in flight (else the
    /// driver is busy anyway, and this thread had better post the next one); a
    /// request terminal here is finished here, anything else goes to the driver.
    /// `(first, polled)`: what the post returned, and a terminal status already
    /// seen by a poll after it (from [`terminal_status`](Self::terminal_status)).
    /// `(reposted, alone)`: the request came from the cache; no other op was in
    /// flight when this one was admitted.
    fn after_post(
        &self,
        op_id: u64,
        req: ReqId,
        key: Option<CacheKey>,
        completer: Completer,
        (first, polled): (Result<XferState, EngineError>, Option<Terminal>),
        (reposted, alone): (bool, bool),
    ) {
        let (mut terminal, mut forgotten, mut post_error) = (None, false, None);
        match first {
            // Completed inside post (CMA on one host).
            Ok(XferState::Done) => terminal = Some(Ok(())),
            Ok(XferState::InProgress) => {
                let seen = match polled {
                    Some(t) => Some(t),
                    None if alone && !self.cfg.inline_poll.is_zero() => self.poll_inline(req),
                    None => None,
                };
                if let Some((t, f)) = seen {
                    (terminal, forgotten) = (Some(t), f);
                }
            }
            // Possibly partly posted: poll to a terminal status, report the post's error.
            Err(e) => post_error = Some(engine_error(&e)),
        }
        let (key, completer) = if matches!(terminal, Some(Ok(()))) && post_error.is_none() {
            // This thread releases (or keeps) the request and completes the op.
            match self.finish_inline(op_id, req, key, completer, reposted) {
                Ok(pending) => {
                    if pending {
                        self.wake.wake();
                    }
                    return;
                }
                // Release failed (so nothing was to be kept): the driver retries it.
                Err(completer) => (None, completer),
            }
        } else {
            (key, completer)
        };
        let driven = Driven {
            req,
            key,
            completer: Some(completer),
            started: Instant::now(),
            post_error,
            terminal,
            forgotten,
            finishing: false,
        };
        self.hand_off(op_id, driven, reposted);
    }

    /// Admission of a post, under the lock: the local pool is ours, the peer
    /// known, no remote tenancy tombstoned, and no notifying request of ours on
    /// the same remote slots. Returns the address of the peer's agent name (the
    /// one `Arc` of `names`, which the cache and ops hold clones of: compared by
    /// address), its id, and whether another request of ours touches those slots.
    fn admit(
        st: &mut State,
        local: &SlotLease<Reserved>,
        remote: &RemoteSlots,
    ) -> Result<(*const u8, PeerId, bool), PostErrorKind> {
        if st.closing {
            return Err(PostErrorKind::ShuttingDown);
        }
        if !st.pools.contains_key(&local.pool().id()) {
            return Err(PostErrorKind::ForeignPool);
        }
        if st.last_peer.as_ref().map_or(true, |(a, _)| **a != *remote.endpoint) {
            let Some((agent, peer)) = st.names.get_key_value(remote.endpoint.as_str()) else {
                return Err(PostErrorKind::Peer(format!("agent {:?} was never added", remote.endpoint)));
            };
            st.last_peer = Some((Arc::clone(agent), *peer));
        }
        let Some((agent, peer)) = &st.last_peer else {
            return Err(PostErrorKind::Peer(format!("agent {:?} was never added", remote.endpoint)));
        };
        let (agent_id, peer) = (Arc::as_ptr(agent).cast::<u8>(), *peer);
        if let Err(refusal) = st.aborts.check(agent, remote) {
            st.m.refused_tombstoned += 1;
            return Err(PostErrorKind::Descriptor(refusal.to_string()));
        }
        let mut overlap = false;
        for o in st.ops.values() {
            if o.remote_pool == remote.pool
                && Arc::as_ptr(&o.agent).cast::<u8>() == agent_id
                && o.remote.iter().any(|x| remote.slots.iter().any(|y| x.slot == y.slot))
            {
                if o.notify {
                    return Err(PostErrorKind::Descriptor(
                        "remote slots are being handed back by a notifying request".into(),
                    ));
                }
                overlap = true;
            }
        }
        Ok((agent_id, peer, overlap))
    }

    /// Creates the request of a post that found none to re-post. Nothing is
    /// exposed by this. Returns it, with its cache entry when it may be kept.
    #[inline(never)]
    fn create_request(
        &self,
        xop: XferOp,
        local: &SlotLease<Reserved>,
        remote: &RemoteSlots,
        agent: Arc<str>,
        attach: bool,
    ) -> Result<(ReqId, Option<CacheKey>), EngineError> {
        let (l, r): (Vec<MemRegion>, Vec<MemRegion>) = descriptors(local, remote).unzip();
        // The DONE NIXL sends once the data is flushed (a notification
        // attached to the request): core's codec, text form.
        let done = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
        let spec = XferSpec {
            op: xop,
            local: l,
            remote: r,
            remote_agent: agent.to_string(),
            notif: if attach { done.encode_text().ok().map(String::into_bytes) } else { None },
        };
        let req = self.engine.create_xfer(&spec)?;
        let mut descs = spec.local.iter().copied().zip(spec.remote.iter().copied());
        let key = match descs.next() {
            Some(first) if self.cfg.request_cache > 0 && !attach => {
                Some(CacheKey { agent, op: xop, first, rest: descs.collect(), req })
            }
            _ => None,
        };
        Ok((req, key))
    }

    /// Hands a posted op that its posting thread did not finish to the driver.
    #[inline(never)]
    fn hand_off(&self, op_id: u64, driven: Driven, reposted: bool) {
        let mut orphan = None;
        {
            let mut guard = self.state();
            let st = &mut *guard;
            match st.ops.get_mut(&op_id) {
                Some(o) => {
                    if o.notify {
                        // Being handed back: no later post may name them.
                        st.aborts.tombstone(&o.agent, o.remote_pool, o.token, &o.remote);
                    }
                    o.driven = Some(Box::new(driven));
                }
                // Drained by a shutdown that gave up on it: dropping its completer
                // (outside the lock) quarantines the lease.
                None => orphan = Some(driven),
            }
            st.m.posted += 1;
            if reposted {
                st.m.reposted += 1;
            }
        }
        drop(orphan);
        self.wake.wake();
    }

    /// Polls a just-posted request from the posting thread for up to
    /// `AdapterConfig::inline_poll`. Returns its terminal status, if one came.
    fn poll_inline(&self, req: ReqId) -> Option<Terminal> {
        // The clock is read only once a poll found the request still in progress.
        let mut deadline = None;
        loop {
            if let Some(t) = self.terminal_status(req) {
                return Some(t);
            }
            let now = Instant::now();
            if now >= *deadline.get_or_insert_with(|| now + self.cfg.inline_poll) {
                return None;
            }
            std::hint::spin_loop();
        }
    }

    /// Polls a posted request once (see [`terminal`]).
    fn terminal_status(&self, req: ReqId) -> Option<Terminal> {
        terminal(self.engine.xfer_status(req))
    }

    /// Finishes, in the posting thread, an op whose request reached `Done` there:
    /// releases the request (or keeps it for re-posting when `key` is set), then
    /// removes the op and completes it. Returns whether messages wait for the
    /// driver; on a failed release, hands the completer back (the driver
    /// retries; nothing was to be kept).
    fn finish_inline(
        &self,
        op_id: u64,
        req: ReqId,
        key: Option<CacheKey>,
        completer: Completer,
        reposted: bool,
    ) -> Result<bool, Completer> {
        if key.is_none() {
            match self.engine.release_xfer(req) {
                Ok(()) | Err(EngineError::UnknownRequest(_)) => {}
                Err(e) => {
                    if !matches!(e, EngineError::StillInProgress(_)) {
                        tracing::warn!(%req, error = %e, "release_xfer failed; retrying");
                        self.state().m.release_failures += 1;
                    }
                    return Err(completer);
                }
            }
        }
        let mut guard = self.state();
        let st = &mut *guard;
        st.m.posted += 1;
        if reposted {
            st.m.reposted += 1;
        }
        let Some(o) = st.ops.remove(&op_id) else {
            // Drained by a shutdown that gave up on it: dropping the completer
            // quarantines the lease.
            return Ok(false);
        };
        if o.notify {
            st.aborts.tombstone(&o.agent, o.remote_pool, o.token, &o.remote);
        }
        Ok(self.conclude(guard, o, End { completer: Some(completer), key, terminal: Some(Ok(())), post_error: None }))
    }

    /// Releases a terminal request and completes its operation. Returns whether it
    /// was finished (false: release failed, retried later).
    fn finish_terminal(&self, op_id: u64) -> bool {
        let (req, forgotten) = {
            let mut st = self.state();
            match st.ops.get_mut(&op_id).and_then(|o| o.driven.as_deref_mut()) {
                Some(d) if d.terminal.is_some() && !d.finishing => {
                    d.finishing = true;
                    (d.req, d.forgotten)
                }
                _ => return false,
            }
        };
        self.finish_claimed(op_id, req, forgotten)
    }

    /// [`finish_terminal`](Self::finish_terminal) for an op this thread claimed.
    fn finish_claimed(&self, op_id: u64, req: ReqId, forgotten: bool) -> bool {
        let unclaim = |terminal: bool| {
            if let Some(d) = self.state().ops.get_mut(&op_id).and_then(|o| o.driven.as_deref_mut()) {
                d.finishing = false;
                if !terminal {
                    d.terminal = None;
                }
            }
        };
        // A clean completion of a cacheable request is kept (terminal) for re-posting.
        let keep = self.cfg.request_cache > 0
            && !forgotten
            && self
                .state()
                .ops
                .get(&op_id)
                .and_then(|o| o.driven.as_ref())
                .is_some_and(|d| d.key.is_some() && d.post_error.is_none() && matches!(d.terminal, Some(Ok(()))));
        if !forgotten && !keep {
            match self.engine.release_xfer(req) {
                Ok(()) => {}
                Err(EngineError::StillInProgress(_)) => {
                    // Not terminal after all: back to polling.
                    unclaim(false);
                    return false;
                }
                Err(EngineError::UnknownRequest(_)) => {}
                Err(e) => {
                    tracing::warn!(%req, error = %e, "release_xfer failed; retrying");
                    self.state().m.release_failures += 1;
                    unclaim(true);
                    return false;
                }
            }
        }
        let mut st = self.state();
        let Some(d) = st.ops.get_mut(&op_id).and_then(|o| o.driven.take()) else { return false };
        let Some(o) = st.ops.remove(&op_id) else { return false };
        let Driven { key, completer, terminal, post_error, .. } = *d;
        let key = key.filter(|_| keep);
        self.conclude(st, o, End { completer, key, terminal, post_error });
        true
    }

    /// The end of an op: it is out of `ops` and its request terminal and released,
    /// or kept in `key` for re-posting. Records the outcome, queues what the target
    /// must hear, then (outside the lock) releases an evicted cached request and
    /// completes the op. Returns whether messages wait for the driver.
    fn conclude(&self, mut guard: MutexGuard<'_, State>, mut o: InFlight, end: End) -> bool {
        let End { completer, key, terminal, post_error } = end;
        let st = &mut *guard;
        let mut evicted = None;
        if let Some(key) = key {
            evicted = self.keep(st, key);
        }
        // An error *status* proves nothing: NIXL may report it while other
        // parts of the request still run. (A post error followed by a clean
        // terminal status is proven: the request itself finished.)
        let unproven = matches!(terminal, Some(Err(_)));
        let mut result = terminal.unwrap_or(Ok(()));
        if let (Some(pe), Ok(())) = (post_error, &result) {
            result = Err(pe);
        }
        let canceled = completer.as_ref().is_some_and(Completer::cancel_requested);
        if result.is_ok() {
            st.m.completed_ok += 1;
        } else {
            st.m.completed_err += 1;
        }
        // What the target must hear, once no other request of ours touches
        // the slots. An unproven end is never acknowledged (core's tracker
        // remembers it and tombstones its tenancies).
        let acks = st.aborts.finished(o.id, if unproven { OpEnd::Unproven } else { OpEnd::Proven });
        for a in acks {
            st.outgoing.push(a);
        }
        let message = match (&result, o.notify, o.notif_attached, canceled) {
            _ if unproven => {
                st.m.failed_unproven += 1;
                None
            }
            (Ok(()), true, true, _) => None,
            (Ok(()), true, false, _) => Some(ControlKind::Done),
            (Err(_), true, _, _) | (_, _, _, true) => Some(ControlKind::AbortAck),
            (_, false, _, false) => None,
        };
        match message {
            Some(ControlKind::Done) => {
                let tenancies = std::mem::take(&mut o.remote);
                let msg = ControlMessage::new(ControlKind::Done, o.remote_pool, o.token, tenancies);
                st.outgoing.push(Outgoing { to: o.agent.clone(), msg });
            }
            Some(_) => {
                let tenancies = std::mem::take(&mut o.remote);
                if let Some(ack) = st.aborts.hand_back(&o.agent, o.remote_pool, o.token, tenancies) {
                    st.outgoing.push(ack);
                }
            }
            None => {}
        }
        if o.remote.capacity() > 0 && st.spare.len() < SPARE_TENANCY_LISTS {
            o.remote.clear();
            st.spare.push(std::mem::take(&mut o.remote));
        }
        let pending = !st.outgoing.is_empty();
        // A proven end: the proof for the lease (no pool, no proof: quarantined).
        let proof = match (&completer, unproven) {
            (Some(c), false) => st.pools.get(&o.local_pool).map(|p| p.authority.completed(c.lease().tenancies())),
            _ => None,
        };
        drop(guard);
        if let Some(req) = evicted {
            if !self.release_cached(req) {
                self.state().m.release_failures += 1;
            }
        }
        self.notify_changed();
        let mut completer = completer;
        if unproven {
            if let (Some(c), Err(e)) = (completer.take(), &result) {
                c.abandon(e.clone());
            }
        }
        if let (Some(c), Some(proof)) = (completer, proof) {
            if let Err(e) = c.complete(proof, result) {
                tracing::error!(error = %e, "completion proof did not settle the lease; it is quarantined");
            }
        }
        pending
    }

    fn drive(&self) {
        let mut last_activity = Instant::now();
        // Poll notifications on the first round.
        let mut last_notif_poll: Option<Instant> = None;
        // A configuration with `poll_min > poll_max` is taken as the other way round.
        let (poll_lo, poll_hi) = (self.cfg.poll_min.min(self.cfg.poll_max), self.cfg.poll_max.max(self.cfg.poll_min));
        let mut backoff = poll_lo;
        let mut escalate_now = true;
        // Notification polls handed to posting threads (see `take_notif_poll`):
        // whether the last due poll was handed over, and `fast_posts` as the
        // last due poll saw it.
        let (mut handed, mut fast_posts_then) = (false, 0u64);
        loop {
            let now = Instant::now();
            let mut progressed = false;
            let (posted, exposures, outgoing, stop, youngest, next_esc, inbox, fast_posts) = {
                let mut st = self.state();
                // Ops being posted or finished by another thread are not the driver's.
                let mine = || {
                    st.ops.iter().filter_map(|(id, o)| o.driven.as_deref().filter(|d| !d.finishing).map(|d| (id, d)))
                };
                let posted: Vec<(u64, ReqId, bool)> =
                    mine().map(|(id, d)| (*id, d.req, d.terminal.is_some())).collect();
                let youngest = mine().map(|(_, d)| now.saturating_duration_since(d.started)).min();
                let inbox = std::mem::take(&mut st.inbox);
                (
                    posted,
                    !st.exposures.is_empty(),
                    !st.outgoing.is_empty(),
                    st.stop,
                    youngest,
                    st.next_escalation,
                    inbox,
                    st.fast_posts,
                )
            };
            if stop {
                break;
            }
            // Fetched by a posting thread before anything this round fetches.
            progressed |= !inbox.is_empty();
            for n in inbox {
                self.on_message(&n.agent, &n.msg);
            }
            for (op_id, req, terminal) in &posted {
                if !terminal {
                    let Some((res, forgotten)) = self.terminal_status(*req) else { continue };
                    if let Some(d) = self.state().ops.get_mut(op_id).and_then(|o| o.driven.as_deref_mut()) {
                        d.terminal = Some(res);
                        d.forgotten = forgotten;
                    }
                }
                progressed |= self.finish_terminal(*op_id);
            }
            let notif_every = match self.cfg.progress {
                Progress::Driver if exposures => Duration::ZERO,
                _ if exposures || outgoing || !posted.is_empty() => self.cfg.notif_interval,
                _ => self.cfg.idle_interval,
            };
            if last_notif_poll.map_or(true, |t| now.saturating_duration_since(t) >= notif_every) {
                last_notif_poll = Some(now);
                use std::sync::atomic::Ordering::{AcqRel, Release};
                // Not yet taken: no thread re-posted since it was handed over.
                let untaken = self.notif_due.swap(false, AcqRel);
                let posting = fast_posts != fast_posts_then;
                fast_posts_then = fast_posts;
                // A thread is re-posting (or just took the last one): hand it this
                // poll too. Else poll here; nothing fetched by a posting thread can
                // be newer then, since none took a poll since the last round.
                // Never with polling on every round (`notif_every` zero): the hand
                // over would alternate with polls here.
                if !notif_every.is_zero() && !untaken && (handed || posting) {
                    handed = true;
                    self.notif_due.store(true, Release);
                } else {
                    handed = false;
                    progressed |= self.poll_notifs();
                }
            }
            if escalate_now || next_esc.is_some_and(|t| t <= now) {
                escalate_now = false;
                self.escalate();
            }
            if outgoing {
                progressed |= self.flush_outgoing();
            }
            if progressed {
                last_activity = Instant::now();
                backoff = poll_lo;
                self.notify_changed();
            }
            let busy = !posted.is_empty() || outgoing || (exposures && self.cfg.progress == Progress::Driver);
            let woke = if busy {
                if last_activity.elapsed() < self.cfg.spin {
                    // Bounded polling window right after a post or completion (not
                    // `yield_now`: on a loaded host a yield can cost a whole time slice).
                    std::hint::spin_loop();
                    continue;
                }
                // Sleep at most a sixteenth of the youngest request's age, so a
                // long transfer is seen done within ~6% of its duration.
                let cap = youngest.map_or(poll_hi, |a| a / 16).clamp(poll_lo, poll_hi);
                let d = backoff.min(cap);
                backoff = backoff.saturating_mul(2).clamp(poll_lo, poll_hi);
                self.wake.wait(d)
            } else {
                let mut d = self.cfg.idle_interval;
                if let Some(t) = next_esc {
                    d = d.min(t.saturating_duration_since(Instant::now()));
                }
                self.wake.wait(d.max(Duration::from_micros(100)))
            };
            if woke {
                // A post, a quarantine or a shutdown: look at everything now.
                escalate_now = true;
                last_activity = Instant::now();
                backoff = poll_lo;
            }
        }
    }

    fn poll_notifs(&self) -> bool {
        let notifs = match self.engine.get_notifs() {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(error = %e, "get_notifs failed");
                self.state().m.notif_errors += 1;
                return false;
            }
        };
        let progressed = !notifs.is_empty();
        for n in notifs {
            self.on_message(&n.agent, &n.msg);
        }
        progressed
    }

    /// A notification from `agent` (NIXL names the sending agent: one we
    /// loaded the metadata of, so the name is the transport's, not the
    /// message's; the exposure's token is checked on top of it).
    fn on_message(&self, agent: &str, msg: &[u8]) {
        let mut st = self.state();
        let Some((agent, peer)) = st.names.get_key_value(agent).map(|(a, p)| (Arc::clone(a), *p)) else {
            st.m.foreign += 1;
            return;
        };
        let m = match ControlMessage::decode_text(msg) {
            Ok(m) => m,
            Err(DecodeError::Foreign) => {
                st.m.foreign += 1;
                return;
            }
            Err(e) => {
                tracing::debug!(%agent, error = %e, "malformed notification dropped");
                st.m.malformed += 1;
                return;
            }
        };
        st.m.messages_received += 1;
        match m.kind {
            ControlKind::Abort => {
                // The target gave these up: never post to them again, and
                // answer once every request of ours on them is terminal.
                st.m.aborts_received += 1;
                if let Some(ack) = st.aborts.on_abort(&agent, m) {
                    st.outgoing.push(ack);
                }
            }
            ControlKind::Done | ControlKind::AbortAck => {
                let Some(authority) = st.pools.get(&m.pool).map(|p| p.authority.clone()) else {
                    st.m.stale += m.tenancies.len() as u64;
                    return;
                };
                let v = st.exposures.accept(peer, &m);
                st.m.stale += (v.stale + v.forged) as u64;
                if v.settled.is_empty() {
                    drop(st);
                    v.deliver(&authority);
                    return;
                }
                st.m.settled_by_message += v.settled.len() as u64;
                if st.events.len() >= self.cfg.event_capacity {
                    st.events.pop_front();
                    st.m.events_dropped += 1;
                }
                st.events.push_back(NixlEvent { peer, pool: m.pool, tenancies: v.settled.clone(), kind: m.kind });
                drop(st);
                v.deliver(&authority);
                self.notify_changed();
            }
        }
    }

    /// Releases a cached (completed, terminal) request.
    /// Returns whether it worked (the caller counts failures: it may hold the lock).
    fn release_cached(&self, req: ReqId) -> bool {
        match self.engine.release_xfer(req) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%req, error = %e, "releasing a cached request failed");
                false
            }
        }
    }

    /// Sends the messages whose slots no request of ours touches any more
    /// (core's outbox: one retry policy).
    fn flush_outgoing(&self) -> bool {
        let ready: Vec<(Outgoing<Arc<str>>, u32)> = {
            let mut st = self.state();
            let st = &mut *st;
            let mut ready = Vec::new();
            for (o, attempts) in st.outgoing.take_all() {
                let busy = st.ops.values().any(|op| {
                    op.agent == o.to && op.remote_pool == o.msg.pool && slots_overlap(&op.remote, &o.msg.tenancies)
                });
                if busy {
                    st.outgoing.defer(o, attempts);
                } else {
                    ready.push((o, attempts));
                }
            }
            ready
        };
        let mut sent = false;
        for (o, attempts) in ready {
            let mut ok = true;
            for m in o.msg.clone().chunks() {
                let text = match m.encode_text() {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::error!(error = %e, "control message cannot be encoded");
                        continue;
                    }
                };
                if let Err(e) = self.engine.gen_notif(&o.to, text.as_bytes()) {
                    tracing::debug!(agent = %o.to, error = %e, "gen_notif failed; retrying");
                    ok = false;
                    break;
                }
            }
            let mut st = self.state();
            if ok {
                sent = true;
                match o.msg.kind {
                    ControlKind::AbortAck => st.m.acks_sent += 1,
                    _ => st.m.deferred_notifs_sent += 1,
                }
            } else {
                st.m.notif_errors += 1;
                st.outgoing.retry(o, attempts);
            }
        }
        if sent {
            self.notify_changed();
        }
        sent
    }

    /// Runs due escalation steps of every pool (core's plans; NIXL's ladder
    /// is drain and ack only, so the rest is core's `quarantine_stuck`).
    fn escalate(&self) {
        let authorities: Vec<(PoolId, SettlementAuthority)> =
            self.state().pools.iter().map(|(id, p)| (*id, p.authority.clone())).collect();
        let mut next: Option<Instant> = None;
        for (pool, a) in authorities {
            for action in a.poll_escalations() {
                let (plan, agent) = {
                    let st = self.state();
                    let plan = st.exposures.plan(pool, &action, CAPABILITIES, ReleasePolicy::Safe);
                    (plan, st.peers.get(&action.peer).cloned())
                };
                match plan {
                    Plan::SendAbort { messages, .. } => {
                        let Some(agent) = agent else { continue };
                        for m in messages {
                            let sent = m
                                .encode_text()
                                .map_err(|e| e.to_string())
                                .and_then(|t| self.engine.gen_notif(&agent, t.as_bytes()).map_err(|e| e.to_string()));
                            match sent {
                                Ok(()) => self.state().m.aborts_sent += 1,
                                Err(e) => {
                                    tracing::warn!(%agent, error = %e, "sending ABORT failed");
                                    self.state().m.notif_errors += 1;
                                }
                            }
                        }
                    }
                    Plan::Stuck { peer, tenancies } => tracing::warn!(
                        pool = pool.0,
                        peer = peer.0,
                        slots = tenancies.len(),
                        "NIXL can neither revoke nor fence with a confirmation: slots stay quarantined until the \
                         peer acknowledges"
                    ),
                    _ => {}
                }
            }
            if let Some(d) = a.next_escalation_in() {
                // Looked at again within 100 ms even if the pool's clock is a
                // test's manual one that moves while the driver sleeps.
                let t = Instant::now() + d.min(Duration::from_millis(100));
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        self.state().next_escalation = next;
    }
}

#[cfg(test)]
mod tests;
