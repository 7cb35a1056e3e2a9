//! The drain's driver: one sans-IO state machine per backend that owns the
//! exposure table and the pools' authorities, turns a peer's DONE and
//! ABORT_ACK into proofs, and the pools' escalation steps into what the
//! backend must do. The backend feeds it what arrives and executes what it
//! returns; it never decides anything about settlement itself.
//!
//! # The timer contract
//!
//! As quinn-proto's `poll_timeout` / `handle_timeout`: the driver has no
//! clock and no thread. The backend's one driving loop
//!
//! 1. feeds every control message it received to [`Driver::on_settling`]
//!    (DONE, ABORT_ACK) and delivers what comes back;
//! 2. collects the due escalation steps ([`Driver::due`], then
//!    [`Due::collect`] with no lock of the driver's held: a pool's own lock
//!    is never taken under the driver's, which posting threads also take),
//!    plans them ([`Driver::plan`]; [`Driver::poll`] does all three for a
//!    driver no other thread shares) and executes every [`Action`] with no
//!    lock of the driver's held, reporting back: [`Driver::revoked`] with
//!    what a revocation confirmed, [`Driver::fenced`] once a fence is
//!    confirmed;
//! 3. sleeps until the steps' [`next_deadline`](Steps::next_deadline) has
//!    passed or something woke it (a new quarantine:
//!    [`SettlementAuthority::on_quarantine`]), then goes back to 1.
//!
//! Waking late is safe (a proof is only delayed); waking early costs one
//! empty poll. Nothing here frees a slot because time passed: a deadline
//! only moves an exposure to the next step of its ladder, and when the
//! ladder is exhausted the slots stay quarantined and are reported stuck.
//!
//! ```
//! use kv_transfer_core::drain::{Action, Capabilities, ControlKind, ControlMessage, Driver, ExposureToken, ReleasePolicy, Trust};
//! use kv_transfer_core::*;
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! let clock = Arc::new(ManualClock::new());
//! let region = Arc::new(HostRegion::new(4 * 64).unwrap());
//! let (pool, authority) = SlotPool::new(
//!     region,
//!     PoolConfig::new(64).with_capabilities(Capabilities::DRAIN_ONLY).with_clock(clock.clone()),
//! )
//! .unwrap();
//! let mut driver = Driver::new(Capabilities::DRAIN_ONLY, ReleasePolicy::Safe);
//! driver.add_pool(authority.clone());
//!
//! // Exposed to peer 7, then aborted: quarantined, and the driver asks
//! // the peer to drain.
//! let lease = pool.reserve(1).unwrap();
//! let tenancies = lease.tenancies().to_vec();
//! let token = ExposureToken::random();
//! let exposed = authority.expose_local(lease, PeerId(7)); // the pool's mark first,
//! driver.expose_with(pool.id(), &tenancies, PeerId(7), Trust::Proving, token); // the record after

//! exposed.abort();
//! let asks: Vec<Action> = driver.poll();
//! assert!(matches!(&asks[..], [Action::SendAbort { peer: PeerId(7), .. }]));
//!
//! // However long nothing comes back, nothing is freed.
//! clock.advance(Duration::from_secs(3600));
//! for a in driver.poll() {
//!     assert!(!matches!(a, Action::Deliver(_)));
//! }
//! assert_eq!(pool.metrics().free, 3);
//!
//! // The peer's ABORT_ACK, under the exposure's token, is the proof.
//! let ack = ControlMessage::new(ControlKind::AbortAck, pool.id(), token, tenancies);
//! driver.on_settling(PeerId(7), &ack).deliver();
//! assert_eq!(pool.metrics().free, 4);
//! ```

use super::codec::{ControlKind, ControlMessage, ExposureToken};
use super::exposures::{ExposureTable, Plan, Trust, Verdict};
use super::{Capabilities, ReleasePolicy};
use crate::escalation::EscalationAction;
use crate::ids::{PeerId, PoolId, Tenancy};
use crate::pool::DeliveryReport;
use crate::proof::{Fenced, Settlement, SettlementAuthority};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What the backend must do for the drain, from [`Driver::poll`]. Execute
/// each with no lock of the driver's held.
#[derive(Debug)]
#[must_use = "an action not executed leaves its slots quarantined"]
pub enum Action {
    /// Send these ABORTs to `peer` (one per exposure token, each within
    /// the codec's bounds). Count a sent one with
    /// [`DrainCounters::aborts_sent`]; a failed send needs nothing: the
    /// ladder re-asks and then moves on.
    SendAbort {
        /// The peer the tenancies are exposed to.
        peer: PeerId,
        /// The messages.
        messages: Vec<ControlMessage>,
    },
    /// Revoke these tenancies' access at the transport, then report those
    /// the transport confirmed with [`Driver::revoked`] (now, or when an
    /// asynchronous invalidation completes). An unconfirmed one stays
    /// quarantined and the ladder goes on to the fence.
    Revoke {
        /// Their pool.
        pool: PoolId,
        /// The peer they are exposed to.
        peer: PeerId,
        /// The tenancies.
        tenancies: Vec<Tenancy>,
    },
    /// Fence `peer`: mint its proofs first ([`Driver::fence_proofs`]), tear
    /// the connection down, and once nothing more can arrive report it
    /// with [`Driver::fenced`].
    Fence {
        /// The peer.
        peer: PeerId,
    },
    /// Proofs to deliver ([`Delivery::deliver`]); only the positive
    /// control (`ReleasePolicy::Naive`) produces these from a poll.
    Deliver(Delivery),
}

/// The drain's counters, one set per driver, shared (`Arc`) so a backend's
/// metrics read them without the driver's lock.
#[derive(Debug, Default)]
pub struct DrainCounters {
    /// DONE messages received.
    pub dones_received: AtomicU64,
    /// ABORT_ACK messages received.
    pub abort_acks_received: AtomicU64,
    /// Tenancies a peer's DONE or ABORT_ACK settled.
    pub settled_by_peer: AtomicU64,
    /// Named tenancies not awaiting settlement (rule 5), or of an unknown pool.
    pub stale: AtomicU64,
    /// Named tenancies exposed to another peer or under another token (rule 8).
    pub forged: AtomicU64,
    /// Named tenancies whose exposure's peer proves nothing (`Trust::Unproving`).
    pub untrusted: AtomicU64,
    /// ABORTs the backend sent (it counts them: only it knows a send worked).
    pub aborts_sent: AtomicU64,
    /// Tenancies revoked with the transport's confirmation.
    pub revoked: AtomicU64,
    /// Fences confirmed.
    pub fences: AtomicU64,
    /// Escalations that ran out of steps (the slots stay quarantined).
    pub exhausted: AtomicU64,
    /// Tenancies the positive control freed without a proof.
    pub naive_releases: AtomicU64,
}

/// The drain's counters at one moment ([`DrainCounters::snapshot`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)] // the fields are `DrainCounters`'s, documented there
pub struct DrainSnapshot {
    pub dones_received: u64,
    pub abort_acks_received: u64,
    pub settled_by_peer: u64,
    pub stale: u64,
    pub forged: u64,
    pub untrusted: u64,
    pub aborts_sent: u64,
    pub revoked: u64,
    pub fences: u64,
    pub exhausted: u64,
    pub naive_releases: u64,
}

impl DrainCounters {
    /// Every counter, now.
    pub fn snapshot(&self) -> DrainSnapshot {
        let g = Self::get;
        DrainSnapshot {
            dones_received: g(&self.dones_received),
            abort_acks_received: g(&self.abort_acks_received),
            settled_by_peer: g(&self.settled_by_peer),
            stale: g(&self.stale),
            forged: g(&self.forged),
            untrusted: g(&self.untrusted),
            aborts_sent: g(&self.aborts_sent),
            revoked: g(&self.revoked),
            fences: g(&self.fences),
            exhausted: g(&self.exhausted),
            naive_releases: g(&self.naive_releases),
        }
    }

    /// Adds `n` to `c`.
    pub fn add(c: &AtomicU64, n: u64) {
        if n > 0 {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Reads `c`.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Proofs for one pool, to deliver with no lock held (a delivery wakes the
/// exposures' waiters). A settlement by a peer's message can be narrowed
/// first ([`Delivery::retain`]): a backend that must end a tenancy's access
/// before it is proven (clear a binding, close a served range) keeps only
/// those it ended.
#[derive(Debug, Default)]
#[must_use = "a delivery not delivered leaves its slots unsettled"]
pub struct Delivery {
    items: Vec<(SettlementAuthority, Proofs)>,
    counters: Option<Arc<DrainCounters>>,
}

#[derive(Debug)]
enum Proofs {
    /// A peer's DONE or ABORT_ACK, as the exposure table judged it.
    ByPeer(Verdict),
    /// A minted proof (revoked, fenced, the positive control's completed).
    Minted(Settlement),
}

impl Delivery {
    fn one(authority: SettlementAuthority, p: Proofs, counters: &Arc<DrainCounters>) -> Self {
        Self { items: vec![(authority, p)], counters: Some(counters.clone()) }
    }

    /// The tenancies a peer's message settles (empty for minted proofs).
    pub fn tenancies(&self) -> Vec<Tenancy> {
        self.items
            .iter()
            .flat_map(|(_, p)| match p {
                Proofs::ByPeer(v) => v.settled.clone(),
                Proofs::Minted(_) => Vec::new(),
            })
            .collect()
    }

    /// The pool a peer's message named, if it is one of the driver's.
    pub fn pool(&self) -> Option<PoolId> {
        self.items.first().map(|(a, _)| a.pool().id())
    }

    /// Keeps, of the tenancies a peer's message settles, those `keep`
    /// accepts (it ends their access first); the others stay as they are,
    /// to be settled by the ladder.
    pub fn retain(&mut self, mut keep: impl FnMut(Tenancy) -> bool) {
        for (_, p) in &mut self.items {
            if let Proofs::ByPeer(v) = p {
                v.settled.retain(|t| keep(*t));
                let kept = v.settled.clone();
                v.digests.retain(|(t, _)| kept.contains(t));
            }
        }
    }

    /// Counts `n` named tenancies as stale (e.g. a binding already gone
    /// when the backend went to clear it).
    pub fn add_stale(&mut self, n: usize) {
        for (_, p) in &mut self.items {
            if let Proofs::ByPeer(v) = p {
                v.stale += n;
                return;
            }
        }
    }

    /// Whether there is nothing to deliver.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Delivers every proof to its pool.
    pub fn deliver(self) -> DeliveryReport {
        let mut r = DeliveryReport::default();
        for (authority, p) in self.items {
            let d = match p {
                Proofs::ByPeer(v) => {
                    if let Some(c) = &self.counters {
                        // Counted before delivery, so a waiter woken by it sees the count.
                        DrainCounters::add(&c.settled_by_peer, v.settled.len() as u64);
                        DrainCounters::add(&c.stale, v.stale as u64);
                        DrainCounters::add(&c.forged, v.forged as u64);
                        DrainCounters::add(&c.untrusted, v.untrusted as u64);
                    }
                    v.deliver(&authority)
                }
                Proofs::Minted(s) => authority.deliver(s),
            };
            r.settled += d.settled;
            r.reclaimed += d.reclaimed;
            r.stale += d.stale;
        }
        r
    }
}

/// `Fenced(peer)` for every pool, minted before a fence starts
/// ([`Driver::fence_proofs`]): each covers the exposures to the peer made
/// so far, none made later (core's fence epoch), however late it is
/// delivered.
#[derive(Debug)]
#[must_use = "a fence's proofs are delivered with Driver::fenced once it is confirmed"]
pub struct FenceProofs {
    peer: PeerId,
    proofs: Vec<(SettlementAuthority, Fenced)>,
}

impl FenceProofs {
    /// The peer being fenced.
    pub fn peer(&self) -> PeerId {
        self.peer
    }
}

/// The pools whose due escalation steps a driving loop collects with no
/// lock of the driver's held ([`Driver::due`]).
#[derive(Debug)]
#[must_use = "collect the due steps, then plan them"]
pub struct Due {
    pools: Vec<SettlementAuthority>,
}

impl Due {
    /// Each pool's due steps, and when the next one falls due (each pool's
    /// own lock, briefly).
    pub fn collect(self) -> Steps {
        let mut next: Option<Duration> = None;
        let steps = self
            .pools
            .into_iter()
            .filter_map(|a| {
                // After the poll: the rungs it climbed are past.
                let due = a.poll_escalations();
                if let Some(d) = a.next_escalation_in() {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
                (!due.is_empty()).then_some((a, due))
            })
            .collect();
        Steps { steps, next_deadline: next }
    }
}

/// Due escalation steps, for [`Driver::plan`].
#[derive(Debug, Default)]
pub struct Steps {
    steps: Vec<(SettlementAuthority, Vec<EscalationAction>)>,
    next_deadline: Option<Duration>,
}

impl Steps {
    /// How long until the next step falls due, as the pools said when the
    /// steps were collected (`None`: none pending): sleep at most this long.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.next_deadline
    }
}

/// The drain of one backend's pools, sans-IO. See the module's docs for
/// the loop that drives it.
#[derive(Debug)]
pub struct Driver {
    caps: Capabilities,
    policy: ReleasePolicy,
    exposures: ExposureTable,
    pools: Vec<SettlementAuthority>,
    counters: Arc<DrainCounters>,
}

impl Driver {
    /// A driver for a backend that can prove `caps`, releasing under
    /// `policy` (`Safe`, or the race tests' positive control).
    pub fn new(caps: Capabilities, policy: ReleasePolicy) -> Self {
        Self {
            caps,
            policy,
            exposures: ExposureTable::with_policy(policy),
            pools: Vec::new(),
            counters: Arc::default(),
        }
    }

    /// The counters (shared: read them without the driver's lock).
    pub fn counters(&self) -> Arc<DrainCounters> {
        self.counters.clone()
    }

    /// What the backend can prove.
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// The release policy.
    pub fn policy(&self) -> ReleasePolicy {
        self.policy
    }

    /// Drives `authority`'s pool from now on (replacing one of the same pool).
    pub fn add_pool(&mut self, authority: SettlementAuthority) {
        let id = authority.pool().id();
        self.pools.retain(|a| a.pool().id() != id);
        self.pools.push(authority);
    }

    /// Stops driving `pool` (its exposures stay in the table until a proof
    /// or a fence ends them).
    pub fn remove_pool(&mut self, pool: PoolId) {
        self.pools.retain(|a| a.pool().id() != pool);
    }

    /// The authority of `pool`, if the driver drives it.
    pub fn authority(&self, pool: PoolId) -> Option<&SettlementAuthority> {
        self.pools.iter().find(|a| a.pool().id() == pool)
    }

    /// The exposure table (read-only: exposures are made with
    /// [`Driver::expose_with`] and ended by the driver).
    pub fn exposures(&self) -> &ExposureTable {
        &self.exposures
    }

    /// Records an exposure the pool already marked, under the token it was
    /// marked with (a fresh [`ExposureToken::random`]), the only way a
    /// backend records one. The order matters where the driver can run
    /// [`Driver::lost`] or [`Driver::fenced`] for `peer` between the two
    /// steps (a posting thread exposes while the driver handles the peer's
    /// loss): recorded first and marked after, the loss would forget the
    /// record while its fence, minted before the mark, does not cover the
    /// exposure, which then nothing could settle; marked first, the fence
    /// covers it, or the record comes after the loss and stays.
    pub fn expose_with(
        &mut self,
        pool: PoolId,
        tenancies: &[Tenancy],
        peer: PeerId,
        trust: Trust,
        token: ExposureToken,
    ) {
        self.exposures.expose_with(pool, tenancies, peer, trust, token)
    }

    /// Removes the exposure of `t` to `peer` for a settlement the backend
    /// observed by itself ([`ExposureTable::take`]).
    pub fn take(&mut self, pool: PoolId, t: Tenancy, peer: PeerId) -> bool {
        self.exposures.take(pool, t, peer)
    }

    /// A DONE or ABORT_ACK from `from`, the peer as the transport
    /// authenticates it (a connection, a registered agent; never a name the
    /// message declares). Returns what it settles: narrow it if access must
    /// end first ([`Delivery::retain`]), then deliver it with no lock held.
    /// An ABORT settles nothing here (it is the initiator side's: the
    /// backend's `AbortTracker`).
    pub fn on_settling(&mut self, from: PeerId, msg: &ControlMessage) -> Delivery {
        let c = &self.counters;
        match msg.kind {
            ControlKind::Done => DrainCounters::add(&c.dones_received, 1),
            ControlKind::AbortAck => DrainCounters::add(&c.abort_acks_received, 1),
            ControlKind::Abort => return Delivery::default(),
        }
        let Some(authority) = self.authority(msg.pool).cloned() else {
            DrainCounters::add(&c.stale, msg.tenancies.len() as u64);
            return Delivery::default();
        };
        let v = self.exposures.accept(from, msg);
        Delivery::one(authority, Proofs::ByPeer(v), &self.counters)
    }

    /// Every due escalation step of every pool, as actions. The positive
    /// control's releases come back as [`Action::Deliver`]; an exhausted
    /// ladder is logged and counted here (its slots stay quarantined).
    ///
    /// This takes each pool's own lock while the driver is borrowed: a
    /// driver behind a lock that posting threads also take polls in three
    /// steps instead, [`Driver::due`], [`Due::collect`] with no lock of the
    /// driver's held, then [`Driver::plan`].
    pub fn poll(&mut self) -> Vec<Action> {
        let mut steps = self.due().collect();
        self.plan(&mut steps)
    }

    /// The pools to look at (their authorities, cheap to clone): collect
    /// their due steps with [`Due::collect`] once the driver's lock is
    /// released.
    pub fn due(&self) -> Due {
        Due { pools: self.pools.clone() }
    }

    /// The actions for steps collected by [`Due::collect`] (taken from
    /// `steps`; its next deadline stays).
    pub fn plan(&self, steps: &mut Steps) -> Vec<Action> {
        let mut out = Vec::new();
        for (authority, actions) in steps.steps.drain(..) {
            let pool = authority.pool().id();
            for a in actions {
                if let Some(act) = self.plan_one(&authority, pool, a) {
                    out.push(act);
                }
            }
        }
        out
    }

    fn plan_one(&self, authority: &SettlementAuthority, pool: PoolId, a: EscalationAction) -> Option<Action> {
        tracing::debug!(pool = pool.0, peer = a.peer.0, step = ?a.step, slots = a.tenancies.len(), "escalation");
        let plan = self.exposures.plan(pool, &a, self.caps, self.policy);
        if let Some(ts) = plan.release_without_proof() {
            // THE BUG, on purpose (the positive control): a proof without evidence.
            tracing::error!(slots = ts.len(), "NAIVE POSITIVE CONTROL: releasing aborted slots without a proof");
            DrainCounters::add(&self.counters.naive_releases, ts.len() as u64);
            let proof = authority.completed(ts).into();
            return Some(Action::Deliver(Delivery::one(authority.clone(), Proofs::Minted(proof), &self.counters)));
        }
        #[allow(unreachable_patterns)]
        match plan {
            Plan::Nothing => None,
            Plan::SendAbort { peer, messages } => Some(Action::SendAbort { peer, messages }),
            Plan::Revoke { peer, tenancies } => Some(Action::Revoke { pool, peer, tenancies }),
            Plan::Fence { peer } => Some(Action::Fence { peer }),
            Plan::Stuck { peer, tenancies } => {
                DrainCounters::add(&self.counters.exhausted, 1);
                tracing::error!(
                    pool = pool.0,
                    peer = peer.0,
                    slots = tenancies.len(),
                    caps = ?self.caps,
                    "escalation exhausted: the slots stay quarantined until a proof comes (a leak, not a reuse)"
                );
                None
            }
            _ => None,
        }
    }

    /// How long until the next escalation step falls due (`None`: none
    /// pending). Sleep at most this long before the next [`Driver::poll`].
    pub fn next_deadline(&self) -> Option<Duration> {
        self.pools.iter().filter_map(SettlementAuthority::next_escalation_in).min()
    }

    /// Tenancies of `pool` exposed to `peer` whose revocation the
    /// transport confirmed: they leave the table and get a `Revoked` proof
    /// (tenancies no longer exposed to `peer` are dropped).
    pub fn revoked(&mut self, pool: PoolId, peer: PeerId, confirmed: &[Tenancy]) -> Delivery {
        let done = self.exposures.revoked(pool, peer, confirmed);
        let Some(authority) = self.authority(pool).cloned() else { return Delivery::default() };
        if done.is_empty() {
            return Delivery::default();
        }
        DrainCounters::add(&self.counters.revoked, done.len() as u64);
        let proof = authority.revoked(&done).into();
        Delivery::one(authority, Proofs::Minted(proof), &self.counters)
    }

    /// `Fenced(peer)` for every pool, minted now, before the fence starts.
    pub fn fence_proofs(&self, peer: PeerId) -> FenceProofs {
        FenceProofs { peer, proofs: self.pools.iter().map(|a| (a.clone(), a.fenced(peer))).collect() }
    }

    /// The fence of `proofs`' peer is confirmed (nothing more can arrive
    /// from it): every exposure to it is forgotten, and the proofs come
    /// back to deliver.
    pub fn fenced(&mut self, proofs: FenceProofs) -> Delivery {
        DrainCounters::add(&self.counters.fences, 1);
        self.lost(proofs)
    }

    /// [`Driver::fenced`] for a connection that ended without a fence of
    /// ours (the transport reported it lost, or it was fenced before and
    /// something was exposed to it since): nothing more can arrive from the
    /// peer, so its exposures settle, but no fence is counted.
    pub fn lost(&mut self, proofs: FenceProofs) -> Delivery {
        self.exposures.fenced(proofs.peer);
        Delivery {
            items: proofs.proofs.into_iter().map(|(a, p)| (a, Proofs::Minted(p.into()))).collect(),
            counters: Some(self.counters.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EscalationLadder, HostRegion, ManualClock, PoolConfig, SlotPool};

    const LADDER: EscalationLadder = EscalationLadder {
        drain: Duration::from_millis(10),
        revoke: Duration::from_millis(10),
        fence: Duration::from_millis(10),
    };

    struct World {
        clock: Arc<ManualClock>,
        pool: SlotPool,
        authority: SettlementAuthority,
        driver: Driver,
    }

    fn world(caps: Capabilities) -> World {
        let clock = Arc::new(ManualClock::new());
        let region = Arc::new(HostRegion::new(4 * 64).expect("region"));
        let cfg = PoolConfig::new(64).with_capabilities(caps).with_ladder(LADDER).with_clock(clock.clone());
        let (pool, authority) = SlotPool::new(region, cfg).expect("pool");
        let mut driver = Driver::new(caps, ReleasePolicy::Safe);
        driver.add_pool(authority.clone());
        World { clock, pool, authority, driver }
    }

    /// Exposes one slot to `peer` and aborts it; its tenancies and token.
    fn aborted(w: &mut World, peer: PeerId) -> (Vec<Tenancy>, ExposureToken) {
        let lease = w.pool.reserve(1).expect("reserve");
        let ts = lease.tenancies().to_vec();
        let token = ExposureToken::random();
        w.authority.expose_local(lease, peer).abort();
        w.driver.expose_with(w.pool.id(), &ts, peer, Trust::Proving, token);
        (ts, token)
    }

    /// Steps virtual time past each deadline, `rounds` times; the actions.
    fn step(w: &mut World, rounds: usize) -> Vec<Action> {
        let mut all = w.driver.poll();
        for _ in 0..rounds {
            let Some(d) = w.driver.next_deadline() else { break };
            w.clock.advance(d + Duration::from_millis(1));
            all.extend(w.driver.poll());
        }
        all
    }

    #[test]
    fn rule3_no_deadline_frees_a_slot_the_ladder_only_reports_it_stuck() {
        let mut w = world(Capabilities::DRAIN_ONLY);
        aborted(&mut w, PeerId(1));
        let acts = step(&mut w, 20);
        assert!(acts.iter().all(|a| matches!(a, Action::SendAbort { .. })), "{acts:?}");
        assert!(!acts.is_empty());
        assert_eq!(w.pool.metrics().free, 3, "nothing freed by time");
        assert_eq!(DrainCounters::get(&w.driver.counters().exhausted), 1);
    }

    #[test]
    fn rule8_only_the_exposed_peer_with_its_token_settles_through_the_driver() {
        let mut w = world(Capabilities::DRAIN_ONLY);
        let (ts, token) = aborted(&mut w, PeerId(1));
        let forged = ControlMessage::new(ControlKind::AbortAck, w.pool.id(), token, ts.clone());
        assert_eq!(w.driver.on_settling(PeerId(2), &forged).deliver().settled, 0);
        let guessed = ControlMessage::new(ControlKind::AbortAck, w.pool.id(), ExposureToken::random(), ts.clone());
        assert_eq!(w.driver.on_settling(PeerId(1), &guessed).deliver().settled, 0);
        assert_eq!(DrainCounters::get(&w.driver.counters().forged), 2);
        let ack = ControlMessage::new(ControlKind::AbortAck, w.pool.id(), token, ts);
        assert_eq!(w.driver.on_settling(PeerId(1), &ack).deliver().reclaimed, 1);
        assert_eq!(w.pool.metrics().free, 4);
    }

    #[test]
    fn a_settlement_narrowed_by_the_backend_proves_only_what_it_kept() {
        let mut w = world(Capabilities::DRAIN_ONLY);
        let (ts, token) = aborted(&mut w, PeerId(1));
        let ack = ControlMessage::new(ControlKind::AbortAck, w.pool.id(), token, ts);
        let mut d = w.driver.on_settling(PeerId(1), &ack);
        d.retain(|_| false); // access could not be ended
        assert_eq!(d.deliver().settled, 0);
        assert_eq!(w.pool.metrics().free, 3);
    }

    #[test]
    fn rule4_a_revocation_proves_only_what_the_transport_confirmed() {
        let mut w = world(Capabilities::ALL);
        let (ts, _) = aborted(&mut w, PeerId(1));
        let acts = step(&mut w, 1);
        let Some(Action::Revoke { pool, peer, tenancies }) =
            acts.into_iter().find(|a| matches!(a, Action::Revoke { .. }))
        else {
            panic!("no revoke step")
        };
        assert_eq!((peer, &tenancies), (PeerId(1), &ts));
        assert_eq!(w.driver.revoked(pool, peer, &[]).deliver().settled, 0, "unconfirmed: no proof");
        assert_eq!(w.driver.revoked(pool, PeerId(2), &ts).deliver().settled, 0, "another peer's: no proof");
        assert_eq!(w.driver.revoked(pool, peer, &ts).deliver().reclaimed, 1);
        assert_eq!(w.pool.metrics().free, 4);
    }

    #[test]
    fn rule8_a_fence_covers_exposures_made_before_its_proofs_were_minted_only() {
        let mut w = world(Capabilities::ALL);
        aborted(&mut w, PeerId(1));
        let proofs = w.driver.fence_proofs(PeerId(1));
        // Exposed after the fence started: not covered.
        aborted(&mut w, PeerId(1));
        let r = w.driver.fenced(proofs).deliver();
        assert_eq!(r.reclaimed, 1);
        assert_eq!(w.pool.metrics().free, 3, "the later exposure stays quarantined");
    }

    #[test]
    fn a_message_for_an_unknown_pool_settles_nothing_and_counts_stale() {
        let mut w = world(Capabilities::DRAIN_ONLY);
        let (ts, token) = aborted(&mut w, PeerId(1));
        let msg = ControlMessage::new(ControlKind::Done, PoolId(u64::MAX), token, ts);
        assert!(w.driver.on_settling(PeerId(1), &msg).is_empty());
        assert_eq!(DrainCounters::get(&w.driver.counters().stale), 1);
    }
}
