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
//! tenancies (core's [`drain`](kv_transfer_core::drain) codec); NIXL sends it
//! only after the data is flushed. If another request of ours still touches one
//! of those slots, the notification is not attached but sent by the driver once
//! all of them are terminal. After a notifying post, or an abort, those
//! tenancies are tombstoned: a later post naming them (or an older generation
//! of their slots) is refused.
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
//! `quarantined`/`quarantine_stuck` gauges and in a warning the driver logs.
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
//!
//! **Layout**: this module holds [`NixlTransfer`] (its configuration, errors,
//! metrics, teardown and the [`Target`] impl); `state` the tables behind the
//! adapter's one lock; `post` admission, posting, the request cache and
//! descriptors; `lifecycle` an op's phases (posting, polled by the driver,
//! terminal, finishing) and finishing it; `driver` the driver thread (polling
//! requests and notifications, peers' messages, the outbox, escalation).

mod driver;
mod lifecycle;
mod post;
mod state;
mod target;

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_transfer_core::drain::{AbortTracker, Capabilities, ControlKind, Driver, ReleasePolicy, Trust};
use kv_transfer_core::{
    BackendError, ExposeError, ExposeErrorKind, Exposed, MemoryKind, PeerId, PoolConfig, PoolError, PoolId, Region,
    RemoteSlots, Reserved, SlotLease, SlotPool, Target, Tenancy,
};
// Named in the docs (`Transfer`'s impl comes from `impl_transfer_via_post_now!`).
#[cfg(doc)]
use kv_transfer_core::{check_shapes, SettlementAuthority, Transfer, TransferError, TransferHandle};

use crate::engine::{AgentConfig, EngineConfig, EngineError, MemRegion, NixlEngine, RealNixlEngine, ReqId};

use driver::Wake;
use lifecycle::InFlight;
use state::{Inner, PoolEntry, State};

/// What NIXL lets this adapter prove: drain and ack only. NIXL can neither
/// revoke one tenancy's access nor tear one peer's connection down and
/// confirm it flushed.
pub const CAPABILITIES: Capabilities = Capabilities::DRAIN_ONLY;

/// The backend name reported by [`Transfer::backend`] and in [`TransferError::Engine`].
pub const BACKEND: &str = "nixl";

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
    /// How quarantined and exposed slots are settled: keep
    /// [`ReleasePolicy::Safe`]. `Naive` (feature `naive-positive-control` of
    /// `kv-transfer-core`) is the tests' positive control only: it frees an
    /// aborted slot without a proof and takes a notification's claimed
    /// agent name for its identity, whatever token it carries.
    pub release_policy: ReleasePolicy,
    /// Per peer, the most tombstoned slots, early-abort tenancies, unproven
    /// tenancies and waiting ABORTs the initiator side remembers (each);
    /// past it that peer fails closed (its ABORTs dropped unanswered, its
    /// posts refused once a tombstone could not be kept), never forgetting
    /// (rule 9).
    pub max_aborted: usize,
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
            release_policy: ReleasePolicy::Safe,
            max_aborted: 1 << 16,
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
    /// Memory NIXL cannot register: device memory that is not a CUDA
    /// device's (core's fake device, which only staging can reach).
    #[error("NIXL registers host memory (DRAM) and CUDA device memory (VRAM), not {0}")]
    UnsupportedMemory(MemoryKind),
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
    /// The initiator side's abort tracker (rule 9): ABORTs dropped because
    /// their peer's room was full, kept under a token we never saw, merged
    /// into one already waiting, and peers closed for want of room.
    pub abort_tracker: kv_transfer_core::drain::TrackerStats,
    /// ABORTs waiting for operations of ours.
    pub pending_aborts: usize,
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

/// `now + timeout`, or about a year from now if that overflows.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(365 * 86_400))
}

impl NixlTransfer {
    /// An adapter over `engine`, with its driver thread started.
    pub fn new(engine: Arc<dyn NixlEngine>, cfg: AdapterConfig) -> Result<Self, AdapterError> {
        let name: Arc<str> = engine.agent_name().into();
        let state = State {
            drain: Driver::new(CAPABILITIES, cfg.release_policy),
            aborts: AbortTracker::with_policy(cfg.max_aborted, cfg.release_policy),
            ..State::default()
        };
        let inner = Arc::new(Inner {
            engine,
            name,
            cfg,
            state: Mutex::new(state),
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

    /// Target-side events since the last call (oldest first).
    pub fn take_events(&self) -> Vec<NixlEvent> {
        self.inner.state().events.drain(..).collect()
    }

    /// A snapshot of the adapter's counters.
    pub fn metrics(&self) -> AdapterMetrics {
        let st = self.inner.state();
        let mut m = st.m;
        m.in_flight = st.ops.len();
        m.oldest_in_flight = st.ops.values().filter_map(|o| o.phase.driven()).map(|d| d.started.elapsed()).max();
        m.exposed_slots = st.drain.exposures().len();
        let d = st.drain.counters();
        let g = kv_transfer_core::drain::DrainCounters::get;
        m.stale = g(&d.stale) + g(&d.forged) + g(&d.untrusted);
        m.settled_by_message = g(&d.settled_by_peer);
        m.aborts_sent = g(&d.aborts_sent);
        m.pending_messages = st.outgoing.len();
        m.cached_requests = st.cache.len();
        m.acks_withheld = st.aborts.stats().acks_withheld;
        m.abort_tracker = st.aborts.stats();
        m.pending_aborts = st.aborts.pending_aborts();
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
            let exposed = st.drain.exposures().exposed_to(peer);
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
        while !(st.ops.is_empty() && st.drain.exposures().is_empty() && st.outgoing.is_empty()) {
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
        let mut report = ShutdownReport {
            in_flight_left: st.ops.len(),
            exposed_left: st.drain.exposures().len(),
            ..Default::default()
        };
        let ops_left = !st.ops.is_empty();
        let pools: Vec<(PoolId, PoolEntry)> = st.pools.drain().collect();
        let mut leak_engine = ops_left;
        for (id, entry) in pools {
            st.drain.remove_pool(id);
            let exposed = st.drain.exposures().exposed_in(id) > 0;
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

kv_transfer_core::impl_transfer_via_post_now!(NixlTransfer, BACKEND);

#[cfg(test)]
mod tests;
