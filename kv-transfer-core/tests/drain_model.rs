//! The drain protocol against a reference model: random interleavings of
//! exposures, posts, completions (proven or unproven), target aborts (ABORTs
//! planned by [`ExposureTable::plan`] or built directly), DONEs, hand-backs,
//! escalation deadlines, deliveries in any order, and stale, replayed or
//! forged messages, over a real [`SlotPool`] and [`SettlementAuthority`] and
//! one [`AbortTracker`] per initiator.
//!
//! Checked after each step, against the model:
//!
//! - (a) `ExposureTable::accept` settles a tenancy only for the peer it was
//!   exposed to, under that exposure's token, with [`Trust::Proving`], and
//!   only once;
//! - (b) an ABORT_ACK is produced only once every operation of that
//!   initiator on its tenancies finished, never names a tenancy an
//!   [`OpEnd::Unproven`] operation touched, and is produced as soon as the
//!   last awaited operation finishes;
//! - (c) a post to a tenancy aborted or handed back (under the same token) is
//!   refused, and one to a tenancy never tombstoned is admitted;
//! - (d) a forged, stale or replayed message settles nothing and frees nothing;
//! - the pool's own invariants hold, its free and quarantined counts are the
//!   model's (a slot leaves quarantine only with a proof), no slot an
//!   operation is in flight on is ever free or re-leased, and at the end,
//!   once everything is delivered, every aborted tenancy is reclaimed unless
//!   nothing could prove it (an unproven end, an unproving exposure).
//!
//! The pool's ladder is [`Capabilities::DRAIN_ONLY`], so only DONE and
//! ABORT_ACK produce proofs here (revoke and fence are the pool model's
//! business, `tests/model.rs`).
//!
//! No loom model: the drain module holds no shared state of its own (its
//! structs are plain data a backend keeps under its own locks), so there is
//! no interleaving inside it to explore; the interleavings that matter are
//! the message orders this test generates.
#![cfg(not(loom))]

use kv_transfer_core::drain::{
    AbortTracker, Capabilities, ControlKind, ControlMessage, ExposureTable, ExposureToken, OpEnd, Plan, Refusal,
    ReleasePolicy, Trust,
};
use kv_transfer_core::*;
use proptest::prelude::*;
use proptest::sample::Index;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

const CAP: usize = 8;
const SLOT: usize = 64;
/// The two initiators, as the target's transport authenticates them.
const PEERS: [PeerId; 2] = [PeerId(1), PeerId(2)];
/// How an initiator's tracker names the (one) target.
const TARGET: u8 = 0;

#[derive(Clone, Copy, Debug)]
enum Forgery {
    /// The exposed peer, the right tenancies, a token of its own making.
    WrongToken,
    /// The other initiator, with the right token.
    WrongPeer,
    /// The right peer and token, a generation too old.
    OldGeneration,
    /// The right peer and token, a generation not yet leased.
    NewerGeneration,
    /// The right everything, naming another pool.
    OtherPool,
    /// An ABORT sent to the target (only DONE and ABORT_ACK settle).
    AbortKind,
    /// A DONE or ABORT_ACK the target already received, again.
    Replay(Index),
}

#[derive(Clone, Debug)]
enum Step {
    /// The target exposes `n` slots to initiator `peer`.
    Expose { peer: usize, n: usize, unproving: bool },
    /// Initiator `peer` posts an operation on one of its exposures.
    Post { peer: usize, exposure: Index, exclusive: bool },
    /// An operation in flight ends.
    Finish { op: Index, proven: bool },
    /// The target aborts a live exposure; its ABORT comes from the plan of
    /// the pool's RequestDrain action, or is built from the RemoteSlots.
    Abort { exposure: Index, via_plan: bool },
    /// A message in flight arrives (in any order).
    Deliver { msg: Index },
    /// Initiator `peer` sends DONE for one of its exposures (when nothing
    /// of its is in flight there and nothing ended unproven).
    Done { peer: usize, exposure: Index },
    /// Initiator `peer` hands an exposure back by itself.
    HandBack { peer: usize, exposure: Index },
    /// The target picks a live exposure's proof up (`try_settled`).
    Pickup { exposure: Index },
    /// A forged or stale DONE / ABORT_ACK reaches the target.
    Forge { exposure: Index, ack: bool, forgery: Forgery },
    /// An ABORT the target sent earlier reaches its initiator again.
    ReplayAbort { abort: Index },
    /// Time passes; the target polls its escalations and runs their plans.
    Deadline { ms: u64 },
}

fn forgery() -> impl Strategy<Value = Forgery> {
    prop_oneof![
        Just(Forgery::WrongToken),
        Just(Forgery::WrongPeer),
        Just(Forgery::OldGeneration),
        Just(Forgery::NewerGeneration),
        Just(Forgery::OtherPool),
        Just(Forgery::AbortKind),
        any::<Index>().prop_map(Forgery::Replay),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..2usize, 1..=3usize, prop::bool::weighted(0.15))
            .prop_map(|(peer, n, unproving)| Step::Expose { peer, n, unproving }),
        5 => (0..2usize, any::<Index>(), any::<bool>())
            .prop_map(|(peer, exposure, exclusive)| Step::Post { peer, exposure, exclusive }),
        4 => (any::<Index>(), prop::bool::weighted(0.75)).prop_map(|(op, proven)| Step::Finish { op, proven }),
        3 => (any::<Index>(), any::<bool>()).prop_map(|(exposure, via_plan)| Step::Abort { exposure, via_plan }),
        6 => any::<Index>().prop_map(|msg| Step::Deliver { msg }),
        2 => (0..2usize, any::<Index>()).prop_map(|(peer, exposure)| Step::Done { peer, exposure }),
        1 => (0..2usize, any::<Index>()).prop_map(|(peer, exposure)| Step::HandBack { peer, exposure }),
        2 => any::<Index>().prop_map(|exposure| Step::Pickup { exposure }),
        3 => (any::<Index>(), any::<bool>(), forgery())
            .prop_map(|(exposure, ack, forgery)| Step::Forge { exposure, ack, forgery }),
        1 => any::<Index>().prop_map(|abort| Step::ReplayAbort { abort }),
        2 => (0..25u64).prop_map(|ms| Step::Deadline { ms }),
    ]
}

struct Exposure {
    peer: usize,
    remote: RemoteSlots,
    /// `Some` while the target holds the exposed lease.
    lease: Option<SlotLease<Exposed>>,
    aborted: bool,
    trust: Trust,
}

struct Op {
    peer: usize,
    token: ExposureToken,
    tenancies: Vec<Tenancy>,
}

/// What the model knows of one exposed tenancy.
struct Exposed1 {
    peer: usize,
    token: ExposureToken,
    trust: Trust,
    exposure: usize,
    settled: bool,
}

struct PendingAbort {
    peer: usize,
    msg: ControlMessage,
    waiting: HashSet<u64>,
}

enum Wire {
    /// A DONE or ABORT_ACK from initiator `from` to the target.
    ToTarget { from: usize, msg: ControlMessage },
    /// An ABORT from the target to initiator `to`.
    ToInitiator { to: usize, msg: ControlMessage },
}

struct World {
    clock: Arc<ManualClock>,
    pool: SlotPool,
    authority: SettlementAuthority,
    table: ExposureTable,
    trackers: [AbortTracker<u8>; 2],
    exposures: Vec<Exposure>,
    exposed: HashMap<Tenancy, Exposed1>,
    ever_settled: HashSet<Tenancy>,
    ops: HashMap<u64, Op>,
    next_op: u64,
    /// Per initiator: tenancies an operation of its ended unproven on.
    unproven: [HashSet<Tenancy>; 2],
    /// Per initiator: per slot, the newest generation aborted or handed
    /// back, with its exposure's token.
    tombstones: [HashMap<SlotId, (Generation, ExposureToken)>; 2],
    /// Per initiator: ABORTs under a token it had not seen, by token.
    early: [HashMap<ExposureToken, HashSet<Tenancy>>; 2],
    pending: Vec<PendingAbort>,
    wire: Vec<Wire>,
    /// DONEs and ABORT_ACKs the target received, for replays.
    received: Vec<(usize, ControlMessage)>,
    /// ABORTs the target sent, for replays.
    aborts_sent: Vec<(usize, ControlMessage)>,
}

type R = Result<(), TestCaseError>;

fn sorted_bytes(msgs: &[ControlMessage]) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = msgs.iter().map(|m| m.encode().unwrap()).collect();
    v.sort();
    v
}

impl World {
    fn new() -> Self {
        let clock = Arc::new(ManualClock::new());
        let ladder = EscalationLadder {
            drain: Duration::from_millis(10),
            revoke: Duration::from_millis(10),
            fence: Duration::from_millis(10),
        };
        let config = PoolConfig::new(SLOT)
            .with_capabilities(Capabilities::DRAIN_ONLY)
            .with_ladder(ladder)
            .with_clock(clock.clone());
        let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(CAP * SLOT).unwrap()), config).unwrap();
        Self {
            clock,
            pool,
            authority,
            table: ExposureTable::new(),
            trackers: [AbortTracker::new(1 << 16), AbortTracker::new(1 << 16)],
            exposures: Vec::new(),
            exposed: HashMap::new(),
            ever_settled: HashSet::new(),
            ops: HashMap::new(),
            next_op: 1,
            unproven: Default::default(),
            tombstones: Default::default(),
            early: Default::default(),
            pending: Vec::new(),
            wire: Vec::new(),
            received: Vec::new(),
            aborts_sent: Vec::new(),
        }
    }

    fn peer_index(p: PeerId) -> usize {
        PEERS.iter().position(|x| *x == p).expect("one of our peers")
    }

    fn pick_exposure(&self, i: Index, filter: impl Fn(&Exposure) -> bool) -> Option<usize> {
        let c: Vec<usize> = (0..self.exposures.len()).filter(|&e| filter(&self.exposures[e])).collect();
        (!c.is_empty()).then(|| c[i.index(c.len())])
    }

    fn tombstoned(&self, peer: usize, token: &ExposureToken, t: &Tenancy) -> bool {
        self.tombstones[peer].get(&t.slot).is_some_and(|(g, k)| *g > t.generation || (*g == t.generation && k == token))
    }

    fn tombstone(&mut self, peer: usize, token: ExposureToken, ts: &[Tenancy]) {
        for t in ts {
            let e = self.tombstones[peer].entry(t.slot).or_insert((t.generation, token));
            if t.generation >= e.0 {
                *e = (t.generation, token);
            }
        }
    }

    /// Slots the target holds (live leases) and quarantined tenancies no proof reached.
    fn held_and_quarantined(&self) -> (Vec<SlotId>, Vec<SlotId>) {
        let (mut held, mut quarantined) = (Vec::new(), Vec::new());
        for e in &self.exposures {
            for t in e.remote.tenancies() {
                if e.lease.is_some() {
                    held.push(t.slot);
                } else if e.aborted && !self.exposed[&t].settled {
                    quarantined.push(t.slot);
                }
            }
        }
        (held, quarantined)
    }

    fn check(&self) -> R {
        self.pool.check_invariants().map_err(TestCaseError::fail)?;
        let (held, quarantined) = self.held_and_quarantined();
        for s in held.iter().chain(&quarantined) {
            prop_assert!(!self.pool.slot_is_free(*s), "slot {} is free without a proof", s.0);
        }
        let m = self.pool.metrics();
        prop_assert_eq!(
            m.free as usize,
            CAP - held.len() - quarantined.len(),
            "free count is not what the proofs allow"
        );
        prop_assert_eq!(m.quarantined as usize, quarantined.len());
        for (id, op) in &self.ops {
            for t in &op.tenancies {
                prop_assert!(!self.pool.slot_is_free(t.slot), "op {} is in flight on freed {}", id, t);
                prop_assert_eq!(
                    self.pool.generation(t.slot),
                    Some(t.generation),
                    "op {} in flight on re-leased {}",
                    id,
                    t
                );
            }
        }
        let unsettled = self.exposed.values().filter(|x| !x.settled).count();
        prop_assert_eq!(self.table.len(), unsettled, "the table holds exactly the unsettled exposures");
        Ok(())
    }

    fn expose(&mut self, peer: usize, n: usize, unproving: bool) -> R {
        let free = self.pool.metrics().free as usize;
        let lease = match self.pool.reserve(n) {
            Ok(l) => l,
            Err(e) => {
                prop_assert!(free < n, "reserve({}) refused with {} free: {:?}", n, free, e);
                return Ok(());
            }
        };
        let ts = lease.tenancies().to_vec();
        let trust = if unproving { Trust::Unproving } else { Trust::Proving };
        let token = self.table.expose(self.pool.id(), &ts, PEERS[peer], trust);
        let (lease, remote) = self.authority.expose(lease, PEERS[peer], 0, "x", token);
        prop_assert_eq!(remote.token, token);
        prop_assert_eq!(remote.tenancies(), ts.clone());
        let exposure = self.exposures.len();
        for t in &ts {
            prop_assert!(!self.exposed.contains_key(t), "tenancy {} named twice", t);
            self.exposed.insert(*t, Exposed1 { peer, token, trust, exposure, settled: false });
        }
        self.exposures.push(Exposure { peer, remote, lease: Some(lease), aborted: false, trust });
        Ok(())
    }

    fn post(&mut self, peer: usize, exposure: Index, exclusive: bool) -> R {
        let Some(e) = self.pick_exposure(exposure, |x| x.peer == peer) else { return Ok(()) };
        let remote = self.exposures[e].remote.clone();
        let ts = remote.tenancies();
        let op = self.next_op;
        self.next_op += 1;
        let got = self.trackers[peer].admit(op, &TARGET, &remote, exclusive);
        // The post shows the token: ABORTs kept under it become tombstones.
        if let Some(early) = self.early[peer].remove(&remote.token) {
            let early: Vec<Tenancy> = early.into_iter().collect();
            self.tombstone(peer, remote.token, &early);
        }
        // (c) a tombstoned tenancy is refused; the first one is named.
        if let Some(t) = ts.iter().find(|t| self.tombstoned(peer, &remote.token, t)) {
            prop_assert_eq!(got, Err(Refusal::Tombstoned(*t)), "post to a tombstoned tenancy");
            return Ok(());
        }
        let busy: HashSet<Tenancy> = self
            .ops
            .values()
            .filter(|o| o.peer == peer)
            .flat_map(|o| o.tenancies.iter().copied())
            .filter(|t| ts.contains(t))
            .collect();
        if exclusive && !busy.is_empty() {
            prop_assert!(matches!(got, Err(Refusal::Busy(t)) if busy.contains(&t)), "exclusive post got {:?}", got);
            return Ok(());
        }
        prop_assert_eq!(got, Ok(()), "a post to live tenancies was refused");
        self.ops.insert(op, Op { peer, token: remote.token, tenancies: ts });
        Ok(())
    }

    /// (b) for one ABORT_ACK initiator `peer` produced.
    fn check_ack(&self, peer: usize, msg: &ControlMessage) -> R {
        prop_assert_eq!(msg.kind, ControlKind::AbortAck);
        prop_assert!(msg.digests.is_empty());
        for t in &msg.tenancies {
            prop_assert!(
                !self.ops.values().any(|o| o.peer == peer && o.tenancies.contains(t)),
                "ABORT_ACK for {} while an operation on it is in flight",
                t
            );
            prop_assert!(!self.unproven[peer].contains(t), "ABORT_ACK names {}, which an unproven end touched", t);
        }
        Ok(())
    }

    fn ack_of(&self, peer: usize, abort: &ControlMessage) -> Option<ControlMessage> {
        let ts: Vec<Tenancy> = abort.tenancies.iter().copied().filter(|t| !self.unproven[peer].contains(t)).collect();
        (!ts.is_empty()).then(|| ControlMessage::new(ControlKind::AbortAck, abort.pool, abort.token, ts))
    }

    fn send_acks(&mut self, peer: usize, acks: Vec<ControlMessage>) -> R {
        for msg in acks {
            self.check_ack(peer, &msg)?;
            self.wire.push(Wire::ToTarget { from: peer, msg });
        }
        Ok(())
    }

    fn finish(&mut self, op: Index, proven: bool) -> R {
        let mut ids: Vec<u64> = self.ops.keys().copied().collect();
        if ids.is_empty() {
            return Ok(());
        }
        ids.sort_unstable();
        let id = ids[op.index(ids.len())];
        self.finish_id(id, proven)
    }

    fn finish_id(&mut self, id: u64, proven: bool) -> R {
        let o = self.ops.remove(&id).unwrap();
        if !proven {
            self.unproven[o.peer].extend(o.tenancies.iter().copied());
            self.tombstone(o.peer, o.token, &o.tenancies);
        }
        let mut expected = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].peer == o.peer {
                self.pending[i].waiting.remove(&id);
            }
            if self.pending[i].waiting.is_empty() {
                let p = self.pending.remove(i);
                expected.extend(self.ack_of(p.peer, &p.msg));
            } else {
                i += 1;
            }
        }
        let end = if proven { OpEnd::Proven } else { OpEnd::Unproven };
        let got: Vec<ControlMessage> = self.trackers[o.peer]
            .finished(id, end)
            .into_iter()
            .map(|out| {
                assert_eq!(out.to, TARGET);
                out.msg
            })
            .collect();
        prop_assert_eq!(sorted_bytes(&got), sorted_bytes(&expected), "the ABORT_ACKs due after op {}", id);
        self.send_acks(o.peer, got)
    }

    /// An ABORT (or a hand-back) reaches initiator `peer`.
    fn on_abort(&mut self, peer: usize, msg: ControlMessage, hand_back: bool) -> R {
        // Rule 9: under a token the initiator has seen (an operation of its
        // in flight carries it, or a tombstone of one of the named slots
        // holds it) the tombstones are verified; under another they are kept
        // apart, by token, until a post shows the token.
        let known = self.ops.values().any(|o| o.peer == peer && o.token == msg.token)
            || msg.tenancies.iter().any(|t| self.tombstones[peer].get(&t.slot).is_some_and(|(_, k)| *k == msg.token));
        if hand_back || known {
            self.tombstone(peer, msg.token, &msg.tenancies);
        } else {
            self.early[peer].entry(msg.token).or_default().extend(msg.tenancies.iter().copied());
        }
        let waiting: HashSet<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| o.peer == peer && o.tenancies.iter().any(|t| msg.tenancies.contains(t)))
            .map(|(id, _)| *id)
            .collect();
        let expected = if waiting.is_empty() { self.ack_of(peer, &msg) } else { None };
        let got = if hand_back {
            self.trackers[peer].hand_back(&TARGET, msg.pool, msg.token, msg.tenancies.clone())
        } else {
            self.trackers[peer].on_abort(&TARGET, msg.clone())
        }
        .map(|out| out.msg);
        prop_assert_eq!(&got, &expected, "the answer to an ABORT");
        if !waiting.is_empty() {
            // A repeated ABORT for an exposure merges into the one waiting.
            if let Some(p) = self.pending.iter_mut().find(|p| p.peer == peer && p.msg.token == msg.token) {
                for t in &msg.tenancies {
                    if !p.msg.tenancies.contains(t) {
                        p.msg.tenancies.push(*t);
                    }
                }
                p.waiting.extend(waiting);
            } else {
                self.pending.push(PendingAbort { peer, msg, waiting });
            }
        }
        self.send_acks(peer, got.into_iter().collect())
    }

    fn done(&mut self, peer: usize, exposure: Index) -> R {
        let Some(e) = self.pick_exposure(exposure, |x| x.peer == peer) else { return Ok(()) };
        let remote = self.exposures[e].remote.clone();
        let ts = remote.tenancies();
        let quiet = ts.iter().all(|t| {
            !self.ops.values().any(|o| o.peer == peer && o.tenancies.contains(t))
                && !self.unproven[peer].contains(t)
                && !self.tombstoned(peer, &remote.token, t)
                && !self.early[peer].get(&remote.token).is_some_and(|e| e.contains(t))
        });
        if !quiet {
            return Ok(()); // an initiator says DONE only after its operations all succeeded
        }
        self.trackers[peer].tombstone(&TARGET, remote.pool, remote.token, &ts);
        self.tombstone(peer, remote.token, &ts);
        let msg = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, ts);
        self.wire.push(Wire::ToTarget { from: peer, msg });
        Ok(())
    }

    fn hand_back(&mut self, peer: usize, exposure: Index) -> R {
        let Some(e) = self.pick_exposure(exposure, |x| x.peer == peer) else { return Ok(()) };
        let r = &self.exposures[e].remote;
        let msg = ControlMessage::new(ControlKind::Abort, r.pool, r.token, r.tenancies());
        self.on_abort(peer, msg, true)
    }

    /// A DONE / ABORT_ACK (or, forged, anything) reaches the target from `from`.
    fn target_receives(&mut self, from: usize, msg: ControlMessage, forged: bool) -> R {
        // (a) what the model says this message may settle.
        let mut expected = Vec::new();
        if msg.kind != ControlKind::Abort && msg.pool == self.pool.id() {
            for t in &msg.tenancies {
                if let Some(x) = self.exposed.get(t) {
                    if x.peer == from
                        && x.token == msg.token
                        && x.trust == Trust::Proving
                        && !x.settled
                        && !expected.contains(t)
                    {
                        expected.push(*t);
                    }
                }
            }
        }
        let free_before = self.pool.metrics().free;
        let v = self.table.accept(PEERS[from], &msg);
        prop_assert_eq!(v.wrong_kind, msg.kind == ControlKind::Abort);
        prop_assert_eq!(&v.settled, &expected, "what {:?} from peer {} settles", msg.kind, from);
        // (d) forged, stale and replayed messages settle nothing.
        if forged {
            prop_assert!(v.settled.is_empty(), "a forged or stale {:?} settled {:?}", msg.kind, v.settled);
        }
        let report = v.deliver(&self.authority);
        prop_assert_eq!(report.settled, v.settled.len());
        prop_assert_eq!(report.stale, 0, "a settled tenancy was not awaiting settlement");
        let mut reclaimed = 0;
        for t in &v.settled {
            prop_assert!(self.ever_settled.insert(*t), "{} settled twice", t);
            let x = self.exposed.get_mut(t).unwrap();
            x.settled = true;
            if self.exposures[x.exposure].lease.is_none() {
                reclaimed += 1;
            }
        }
        prop_assert_eq!(report.reclaimed, reclaimed);
        if forged {
            prop_assert_eq!(self.pool.metrics().free, free_before, "a forged message freed slots");
        }
        if msg.kind != ControlKind::Abort {
            self.received.push((from, msg));
        }
        Ok(())
    }

    fn deliver(&mut self, i: Index) -> R {
        if self.wire.is_empty() {
            return Ok(());
        }
        self.deliver_nth(i.index(self.wire.len()))
    }

    fn deliver_nth(&mut self, n: usize) -> R {
        match self.wire.remove(n) {
            Wire::ToTarget { from, msg } => self.target_receives(from, msg, false),
            Wire::ToInitiator { to, msg } => self.on_abort(to, msg, false),
        }
    }

    fn send_abort(&mut self, to: usize, msg: ControlMessage) {
        self.aborts_sent.push((to, msg.clone()));
        self.wire.push(Wire::ToInitiator { to, msg });
    }

    fn abort(&mut self, exposure: Index, via_plan: bool) -> R {
        let Some(e) = self.pick_exposure(exposure, |x| x.lease.is_some()) else { return Ok(()) };
        let x = &mut self.exposures[e];
        x.lease.take().unwrap().abort();
        x.aborted = true;
        if via_plan {
            self.escalate()
        } else {
            let (to, r) = (x.peer, &x.remote);
            let msg = ControlMessage::new(ControlKind::Abort, r.pool, r.token, r.tenancies());
            self.send_abort(to, msg);
            Ok(())
        }
    }

    fn escalate(&mut self) -> R {
        for a in self.authority.poll_escalations() {
            for t in &a.tenancies {
                let x = &self.exposed[t];
                prop_assert!(!x.settled, "escalation for settled {}", t);
                prop_assert!(self.exposures[x.exposure].aborted, "escalation for live {}", t);
                prop_assert_eq!(PEERS[x.peer], a.peer);
            }
            match self.table.plan(self.pool.id(), &a, Capabilities::DRAIN_ONLY, ReleasePolicy::Safe) {
                Plan::SendAbort { peer, messages } => {
                    prop_assert_eq!(a.step, EscalationStep::RequestDrain);
                    prop_assert_eq!(peer, a.peer);
                    let to = Self::peer_index(peer);
                    for m in messages {
                        prop_assert_eq!(m.kind, ControlKind::Abort);
                        for t in &m.tenancies {
                            prop_assert!(a.tenancies.contains(t));
                            prop_assert_eq!(self.exposed[t].token, m.token, "ABORT under another exposure's token");
                        }
                        self.send_abort(to, m);
                    }
                }
                Plan::Nothing => {}
                Plan::Stuck { peer, tenancies } => {
                    prop_assert_eq!(a.step, EscalationStep::Exhausted);
                    prop_assert_eq!((peer, tenancies), (a.peer, a.tenancies.clone()));
                }
                other => prop_assert!(false, "a drain-only pool was planned {:?}", other),
            }
        }
        Ok(())
    }

    fn pickup(&mut self, exposure: Index) -> R {
        let Some(e) = self.pick_exposure(exposure, |x| x.lease.is_some()) else { return Ok(()) };
        let all_proven = self.exposures[e].remote.tenancies().iter().all(|t| self.exposed[t].settled);
        let lease = self.exposures[e].lease.take().unwrap();
        match lease.try_settled() {
            Ok(settled) => {
                prop_assert!(all_proven, "a lease settled without a proof of each slot");
                settled.release();
            }
            Err(lease) => {
                prop_assert!(!all_proven, "a proven lease did not settle");
                self.exposures[e].lease = Some(lease);
            }
        }
        Ok(())
    }

    fn forge(&mut self, exposure: Index, ack: bool, forgery: Forgery) -> R {
        let kind = if ack { ControlKind::AbortAck } else { ControlKind::Done };
        let (from, msg) = if let Forgery::Replay(i) = forgery {
            if self.received.is_empty() {
                return Ok(());
            }
            self.received[i.index(self.received.len())].clone()
        } else {
            let Some(e) = self.pick_exposure(exposure, |_| true) else { return Ok(()) };
            let x = &self.exposures[e];
            let mut msg = ControlMessage::new(kind, x.remote.pool, x.remote.token, x.remote.tenancies());
            let mut from = x.peer;
            match forgery {
                Forgery::WrongToken => msg.token = ExposureToken::random(),
                Forgery::WrongPeer => from = 1 - from,
                Forgery::OldGeneration => {
                    for t in &mut msg.tenancies {
                        t.generation.0 = t.generation.0.wrapping_sub(1);
                    }
                }
                Forgery::NewerGeneration => {
                    for t in &mut msg.tenancies {
                        t.generation.0 = t.generation.0.wrapping_add(1);
                    }
                }
                Forgery::OtherPool => msg.pool = PoolId(msg.pool.0 ^ 0x5a5a_5a5a),
                Forgery::AbortKind => msg.kind = ControlKind::Abort,
                Forgery::Replay(_) => unreachable!(),
            }
            (from, msg)
        };
        self.target_receives(from, msg, true)
    }

    fn replay_abort(&mut self, i: Index) -> R {
        if self.aborts_sent.is_empty() {
            return Ok(());
        }
        let (to, msg) = self.aborts_sent[i.index(self.aborts_sent.len())].clone();
        self.on_abort(to, msg, false)
    }

    fn apply(&mut self, s: &Step) -> R {
        match *s {
            Step::Expose { peer, n, unproving } => self.expose(peer, n, unproving),
            Step::Post { peer, exposure, exclusive } => self.post(peer, exposure, exclusive),
            Step::Finish { op, proven } => self.finish(op, proven),
            Step::Abort { exposure, via_plan } => self.abort(exposure, via_plan),
            Step::Deliver { msg } => self.deliver(msg),
            Step::Done { peer, exposure } => self.done(peer, exposure),
            Step::HandBack { peer, exposure } => self.hand_back(peer, exposure),
            Step::Pickup { exposure } => self.pickup(exposure),
            Step::Forge { exposure, ack, forgery } => self.forge(exposure, ack, forgery),
            Step::ReplayAbort { abort } => self.replay_abort(abort),
            Step::Deadline { ms } => {
                self.clock.advance(Duration::from_millis(ms));
                self.escalate()
            }
        }
    }

    /// Every operation ends (proven), every message arrives, every due
    /// escalation runs; then whatever is still quarantined is so only
    /// because nothing could prove it.
    fn quiesce(&mut self) -> R {
        for _ in 0..16 {
            self.escalate()?;
            let mut ids: Vec<u64> = self.ops.keys().copied().collect();
            ids.sort_unstable();
            for id in ids {
                self.finish_id(id, true)?;
                self.check()?;
            }
            while !self.wire.is_empty() {
                self.deliver_nth(0)?;
                self.check()?;
            }
            if self.ops.is_empty() && self.wire.is_empty() && self.authority.next_escalation_at().is_none() {
                break;
            }
            self.clock.advance(Duration::from_millis(10));
        }
        prop_assert!(self.pending.is_empty() && self.trackers.iter().all(|t| t.pending_aborts() == 0));
        for e in self.exposures.iter().filter(|e| e.aborted) {
            for t in e.remote.tenancies() {
                if !self.exposed[&t].settled {
                    prop_assert!(
                        e.trust == Trust::Unproving || self.unproven[e.peer].contains(&t),
                        "aborted {} was never reclaimed though nothing withheld its ack",
                        t
                    );
                }
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn drain_protocol_settles_only_what_was_proven(steps in prop::collection::vec(step(), 1..60)) {
        let mut w = World::new();
        for s in &steps {
            w.apply(s)?;
            w.check()?;
        }
        w.quiesce()?;
        w.check()?;
    }
}
