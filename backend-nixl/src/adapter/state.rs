//! The adapter's shared state: [`Inner`] (what the handle and the driver
//! thread share) and [`State`], the tables behind its one lock (ops in
//! flight, pools, peers, the drain protocol's tables, the request cache,
//! metrics), with the lock's helpers.

use kv_transfer_core::hash::HashMap;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_transfer_core::drain::{AbortTracker, Driver, Outbox, ReleasePolicy};
use kv_transfer_core::{PeerId, PoolId, Region, SettlementAuthority, Tenancy};

use super::driver::Wake;
use super::lifecycle::InFlight;
use super::post::CacheKey;
use super::{AdapterConfig, AdapterMetrics, NixlEvent};
use crate::engine::{IdMap, NixlEngine, Notification, RegId};

/// Tombstones and unproven tenancies remembered (oldest forgotten first).
const REMEMBERED: usize = 1 << 16;

/// A registered pool: its authority, its memory and NIXL's registration of it.
pub(super) struct PoolEntry {
    pub(super) authority: SettlementAuthority,
    pub(super) region: Arc<dyn Region>,
    pub(super) reg: RegId,
}

/// The tables behind [`Inner::state`]'s lock.
pub(super) struct State {
    pub(super) closing: bool,
    pub(super) stop: bool,
    pub(super) next_op: u64,
    pub(super) ops: IdMap<u64, InFlight>,
    pub(super) pools: IdMap<PoolId, PoolEntry>,
    pub(super) peers: HashMap<PeerId, Arc<str>>,
    pub(super) names: IdMap<Arc<str>, PeerId>,
    /// The entry of `names` the last post found (a clone of its key): posts go
    /// to one peer in runs, and comparing a name costs less than hashing it.
    /// Cleared when that peer is removed.
    pub(super) last_peer: Option<(Arc<str>, PeerId)>,
    pub(super) next_peer: u32,
    /// Target side of core's drain protocol: live exposures, their tokens,
    /// the pools' authorities and their escalation (core's driver).
    pub(super) drain: Driver,
    /// Initiator side of core's drain protocol: tombstones, tenancies an
    /// unproven failure touched, ABORTs waiting for ops.
    pub(super) aborts: AbortTracker<Arc<str>>,
    /// Messages for peers (DONE deferred until no request of ours touches
    /// the slots, ABORT_ACK), with core's one retry policy.
    pub(super) outgoing: Outbox<Arc<str>>,
    /// Completed requests (terminal, unreleased) for re-posting, oldest first.
    pub(super) cache: Vec<CacheKey>,
    /// Emptied tenancy lists of finished ops, reused by posts (no allocation per post).
    pub(super) spare: Vec<Vec<Tenancy>>,
    /// Cached re-posts made under the lock, finished there or not (the driver
    /// compares it between rounds to see whether a thread is posting; see
    /// [`Inner::take_notif_poll`]).
    pub(super) fast_posts: u64,
    /// Notifications a posting thread fetched for the driver, oldest first.
    pub(super) inbox: Vec<Notification>,
    pub(super) events: VecDeque<NixlEvent>,
    pub(super) next_escalation: Option<Instant>,
    pub(super) m: AdapterMetrics,
}

impl Default for State {
    fn default() -> Self {
        Self {
            closing: false,
            stop: false,
            next_op: 0,
            ops: IdMap::default(),
            pools: IdMap::default(),
            peers: HashMap::default(),
            names: IdMap::default(),
            last_peer: None,
            next_peer: 0,
            drain: Driver::new(super::CAPABILITIES, ReleasePolicy::Safe),
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

/// What [`NixlTransfer`](super::NixlTransfer) and its driver thread share.
pub(super) struct Inner {
    pub(super) engine: Arc<dyn NixlEngine>,
    pub(super) name: Arc<str>,
    pub(super) cfg: AdapterConfig,
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    /// Threads blocked in `wait_changed`.
    pub(super) changed_waiters: std::sync::atomic::AtomicUsize,
    pub(super) wake: Arc<Wake>,
    /// The driver handed its next notification poll to a posting thread (see
    /// [`Inner::take_notif_poll`]).
    pub(super) notif_due: std::sync::atomic::AtomicBool,
}

impl Inner {
    #[inline]
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the tables consistent; take a poisoned lock over.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits (at most 50 ms at a time) for the driver or a completion to change
    /// the tables. Called with the state lock held.
    pub(super) fn wait_changed<'a>(&self, g: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
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
    #[inline]
    pub(super) fn notify_changed(&self) {
        if self.changed_waiters.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.changed.notify_all();
        }
    }
}
