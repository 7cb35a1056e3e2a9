//! The initiator side's abort tracker: which posted operations touch which
//! remote tenancies, which remote tenancies their target gave up, and when
//! an ABORT may be answered.

use super::codec::{ControlKind, ControlMessage, ExposureToken};
use crate::ids::{Generation, PoolId, SlotId, Tenancy};
use crate::remote::RemoteSlots;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::Hash;

/// How an operation ended, for [`AbortTracker::finished`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpEnd {
    /// Every part reached a terminal status that proves it stopped touching
    /// the target (success, or an error the engine reports only once all is over).
    Proven,
    /// It ended with an error that proves nothing (a part may still run, or
    /// bytes may still be applied at the target): no ABORT_ACK is ever sent
    /// for its tenancies.
    Unproven,
}

/// Why a post was refused by [`AbortTracker::admit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The target aborted this tenancy, or it was handed back already (a
    /// DONE or ABORT_ACK was sent for it): post a fresh descriptor.
    #[error("remote {0} was aborted by its target or handed back")]
    Tombstoned(Tenancy),
    /// An operation of ours on this remote tenancy is still in flight and
    /// the post asked for exclusive use.
    #[error("remote {0} has an operation of ours in flight")]
    Busy(Tenancy),
}

/// A message for the backend to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing<K> {
    /// The peer, as the backend names it.
    pub to: K,
    /// The message.
    pub msg: ControlMessage,
}

#[derive(Debug)]
struct PostedOp<K> {
    peer: K,
    pool: PoolId,
    token: ExposureToken,
    tenancies: Vec<Tenancy>,
}

#[derive(Debug)]
struct PendingAbort<K> {
    peer: K,
    msg: ControlMessage,
    waiting: HashSet<u64>,
}

/// Counters of an [`AbortTracker`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// ABORTs received.
    pub aborts_received: u64,
    /// ABORT_ACKs handed to the backend to send.
    pub acks: u64,
    /// Tenancies an ABORT_ACK was withheld for (an operation on them ended unproven).
    pub acks_withheld: u64,
    /// Posts refused (tombstoned or busy).
    pub refused: u64,
}

/// Initiator side of the drain protocol, sans-IO, generic over how the
/// backend names a peer (`K`: a connection id, an agent name, a segment name).
///
/// - [`admit`](Self::admit) registers a post's remote tenancies before
///   anything is submitted (under the same lock an ABORT is handled in, so an
///   ABORT either sees the operation and waits for it, or the post sees the
///   abort and is refused);
/// - [`finished`](Self::finished) records that an operation is terminal, and
///   returns the ABORT_ACKs that are now due;
/// - [`on_abort`](Self::on_abort) tombstones the tenancies and answers at once
///   when no operation of ours touches them.
///
/// An ABORT_ACK never names a tenancy an operation ended [`OpEnd::Unproven`] on.
///
/// ```
/// use kv_transfer_core::drain::{AbortTracker, ControlKind, ControlMessage, OpEnd};
/// use kv_transfer_core::*;
///
/// let (pool, _authority) = SlotPool::new(std::sync::Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(4096)).unwrap();
/// let (_exposed, remote) = _authority.expose(pool.reserve(1).unwrap(), PeerId(1), 0, "decode", Default::default());
/// let mut tracker: AbortTracker<&str> = AbortTracker::new(1 << 16);
/// tracker.admit(1, &"decode", &remote, false).unwrap();
/// let abort = ControlMessage::new(ControlKind::Abort, remote.pool, remote.token, remote.tenancies());
/// assert!(tracker.on_abort(&"decode", abort).is_none()); // op 1 still runs: no ack yet
/// let acks = tracker.finished(1, OpEnd::Proven);
/// assert_eq!(acks[0].msg.kind, ControlKind::AbortAck);
/// assert!(tracker.admit(2, &"decode", &remote, false).is_err()); // tombstoned
/// ```
#[derive(Debug)]
pub struct AbortTracker<K> {
    ops: HashMap<u64, PostedOp<K>>,
    pending: Vec<PendingAbort<K>>,
    /// Per (peer, pool): the highest generation of each slot that was
    /// aborted or handed back, with that exposure's token; a post naming an
    /// older generation, or that one under that token, is refused (the same
    /// tenancy exposed again gets a new token).
    tombstones: HashMap<(K, PoolId), HashMap<SlotId, (Generation, ExposureToken)>>,
    tombstone_order: VecDeque<(K, PoolId, SlotId)>,
    unproven: HashSet<(K, PoolId, Tenancy)>,
    unproven_order: VecDeque<(K, PoolId, Tenancy)>,
    max_remembered: usize,
    stats: TrackerStats,
}

impl<K: Clone + Eq + Hash> AbortTracker<K> {
    /// A tracker that remembers at most `max_remembered` tombstones and
    /// unproven tenancies each (the oldest are forgotten first).
    pub fn new(max_remembered: usize) -> Self {
        Self {
            ops: HashMap::new(),
            pending: Vec::new(),
            tombstones: HashMap::new(),
            tombstone_order: VecDeque::new(),
            unproven: HashSet::new(),
            unproven_order: VecDeque::new(),
            max_remembered: max_remembered.max(1),
            stats: TrackerStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> TrackerStats {
        self.stats
    }

    /// Operations registered and not finished.
    pub fn in_flight(&self) -> usize {
        self.ops.len()
    }

    /// ABORTs waiting for operations.
    pub fn pending_aborts(&self) -> usize {
        self.pending.len()
    }

    fn tombstoned(&self, peer: &K, pool: PoolId, token: &ExposureToken, t: &Tenancy) -> bool {
        self.tombstones
            .get(&(peer.clone(), pool))
            .and_then(|m| m.get(&t.slot))
            .is_some_and(|(g, k)| *g > t.generation || (*g == t.generation && k.ct_eq(token)))
    }

    /// Registers operation `op` on `remote` (of `peer`) before it is
    /// submitted. Refused if a tenancy is tombstoned, or (with `exclusive`)
    /// if another operation of ours is in flight on the same tenancy (a newer
    /// tenancy of the same slot is another tenancy).
    pub fn admit(&mut self, op: u64, peer: &K, remote: &RemoteSlots, exclusive: bool) -> Result<(), Refusal> {
        self.check(peer, remote)?;
        let tenancies = remote.tenancies();
        if exclusive {
            let busy = self
                .ops
                .values()
                .filter(|o| o.peer == *peer && o.pool == remote.pool)
                .find_map(|o| tenancies.iter().find(|t| o.tenancies.contains(t)).copied());
            if let Some(t) = busy {
                self.stats.refused += 1;
                return Err(Refusal::Busy(t));
            }
        }
        self.ops.insert(op, PostedOp { peer: peer.clone(), pool: remote.pool, token: remote.token, tenancies });
        Ok(())
    }

    /// [`admit`](Self::admit)'s tombstone check alone, registering nothing:
    /// for an operation that finishes before anything else can see it (a
    /// backend that completes a post under the lock it handles ABORTs in).
    pub fn check(&mut self, peer: &K, remote: &RemoteSlots) -> Result<(), Refusal> {
        if self.tombstones.is_empty() {
            return Ok(());
        }
        for s in &remote.slots {
            let t = s.tenancy();
            if self.tombstoned(peer, remote.pool, &remote.token, &t) {
                self.stats.refused += 1;
                return Err(Refusal::Tombstoned(t));
            }
        }
        Ok(())
    }

    /// Tombstones `tenancies` of `peer`'s `pool` under the exposure `token`
    /// (handed back by a DONE or an ABORT_ACK of ours, or aborted by the target).
    pub fn tombstone(&mut self, peer: &K, pool: PoolId, token: ExposureToken, tenancies: &[Tenancy]) {
        let key = (peer.clone(), pool);
        let dead = self.tombstones.entry(key).or_default();
        for t in tenancies {
            let e = dead.entry(t.slot).or_insert((t.generation, token));
            if t.generation >= e.0 {
                *e = (t.generation, token);
            }
            self.tombstone_order.push_back((peer.clone(), pool, t.slot));
        }
        while self.tombstone_order.len() > self.max_remembered {
            let Some((p, pool, slot)) = self.tombstone_order.pop_front() else { break };
            if let Some(m) = self.tombstones.get_mut(&(p.clone(), pool)) {
                m.remove(&slot);
                if m.is_empty() {
                    self.tombstones.remove(&(p, pool));
                }
            }
        }
    }

    /// Operation `op` is terminal. Returns the ABORT_ACKs now due (those
    /// whose every operation is terminal), without the tenancies an
    /// unproven end touched.
    pub fn finished(&mut self, op: u64, end: OpEnd) -> Vec<Outgoing<K>> {
        let Some(o) = self.ops.remove(&op) else { return Vec::new() };
        if end == OpEnd::Unproven {
            for t in &o.tenancies {
                let k = (o.peer.clone(), o.pool, *t);
                if self.unproven.insert(k.clone()) {
                    self.unproven_order.push_back(k);
                }
            }
            while self.unproven_order.len() > self.max_remembered {
                if let Some(k) = self.unproven_order.pop_front() {
                    self.unproven.remove(&k);
                }
            }
            self.tombstone(&o.peer, o.pool, o.token, &o.tenancies);
        }
        if self.pending.is_empty() {
            return Vec::new();
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            self.pending[i].waiting.remove(&op);
            if self.pending[i].waiting.is_empty() {
                let p = self.pending.swap_remove(i);
                due.extend(self.ack(p.peer, p.msg));
            } else {
                i += 1;
            }
        }
        due
    }

    /// An ABORT from `from` (already decoded; the caller checked it is one).
    /// Tombstones its tenancies; returns the ABORT_ACK at once if no
    /// operation of ours touches them, else keeps it until they are terminal.
    pub fn on_abort(&mut self, from: &K, msg: ControlMessage) -> Option<Outgoing<K>> {
        self.stats.aborts_received += 1;
        self.tombstone(from, msg.pool, msg.token, &msg.tenancies);
        let wanted: HashSet<Tenancy> = msg.tenancies.iter().copied().collect();
        let waiting: HashSet<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| o.peer == *from && o.pool == msg.pool && o.tenancies.iter().any(|t| wanted.contains(t)))
            .map(|(id, _)| *id)
            .collect();
        if waiting.is_empty() {
            return self.ack(from.clone(), msg);
        }
        self.pending.push(PendingAbort { peer: from.clone(), msg, waiting });
        None
    }

    /// The initiator hands tenancies back by itself (its operation on them
    /// was canceled, or failed in a way that proves it stopped): as if the
    /// target had sent an ABORT, answered once every operation of ours on
    /// them is terminal and never for one an unproven end touched.
    pub fn hand_back(
        &mut self,
        peer: &K,
        pool: PoolId,
        token: ExposureToken,
        tenancies: Vec<Tenancy>,
    ) -> Option<Outgoing<K>> {
        let msg = ControlMessage::new(ControlKind::Abort, pool, token, tenancies);
        let out = self.on_abort(peer, msg);
        self.stats.aborts_received -= 1;
        out
    }

    /// Forgets everything about `peer` (it was fenced or removed): pending
    /// ABORTs from it are dropped unanswered; its operations stay registered
    /// until they finish.
    pub fn forget_peer(&mut self, peer: &K) {
        self.pending.retain(|p| p.peer != *peer);
        self.tombstones.retain(|(p, _), _| p != peer);
        self.tombstone_order.retain(|(p, _, _)| p != peer);
    }

    fn ack(&mut self, peer: K, abort: ControlMessage) -> Option<Outgoing<K>> {
        let before = abort.tenancies.len();
        let tenancies: Vec<Tenancy> =
            abort.tenancies.into_iter().filter(|t| !self.unproven.contains(&(peer.clone(), abort.pool, *t))).collect();
        let withheld = before - tenancies.len();
        if withheld > 0 {
            self.stats.acks_withheld += withheld as u64;
            tracing::warn!(
                withheld,
                "ABORT_ACK withheld for tenancies an operation ended on without proof that it stopped"
            );
        }
        if tenancies.is_empty() {
            return None;
        }
        self.stats.acks += 1;
        Some(Outgoing { to: peer, msg: ack_of(abort.pool, abort.token, tenancies) })
    }
}

fn ack_of(pool: PoolId, token: ExposureToken, tenancies: Vec<Tenancy>) -> ControlMessage {
    ControlMessage::new(ControlKind::AbortAck, pool, token, tenancies)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::PoolId;
    use crate::remote::RemoteSlot;

    fn remote(slots: &[(u32, u64)]) -> RemoteSlots {
        RemoteSlots {
            endpoint: "d".into(),
            pool: PoolId(1),
            key: 0,
            slot_size: 64,
            token: ExposureToken([1; 16]),
            slots: slots
                .iter()
                .map(|&(s, g)| RemoteSlot {
                    slot: SlotId(s),
                    generation: Generation(g),
                    addr: u64::from(s) * 64,
                    key: None,
                })
                .collect(),
        }
    }

    fn abort(r: &RemoteSlots) -> ControlMessage {
        ControlMessage::new(ControlKind::Abort, r.pool, r.token, r.tenancies())
    }

    #[test]
    fn abort_is_answered_once_every_operation_on_its_tenancies_is_terminal() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(16);
        let r = remote(&[(0, 1), (1, 1)]);
        tr.admit(1, &9, &remote(&[(0, 1)]), false).unwrap();
        tr.admit(2, &9, &remote(&[(1, 1)]), false).unwrap();
        tr.admit(3, &8, &remote(&[(1, 1)]), false).unwrap(); // another peer: not waited for
        assert_eq!(tr.on_abort(&9, abort(&r)), None);
        assert!(tr.finished(1, OpEnd::Proven).is_empty());
        let acks = tr.finished(2, OpEnd::Proven);
        assert_eq!(acks.len(), 1);
        assert_eq!(acks[0].to, 9);
        assert_eq!(acks[0].msg.token, r.token);
        assert_eq!(acks[0].msg.tenancies, r.tenancies());
        assert_eq!(tr.admit(4, &9, &remote(&[(0, 1)]), false), Err(Refusal::Tombstoned(r.tenancies()[0])));
        assert_eq!(
            tr.admit(4, &9, &remote(&[(0, 0)]), false),
            Err(Refusal::Tombstoned(Tenancy::new(SlotId(0), Generation(0))))
        );
        assert!(tr.admit(4, &9, &remote(&[(0, 2)]), false).is_ok(), "a newer tenancy of the slot may be posted");
        let mut again = remote(&[(0, 1)]);
        again.token = ExposureToken([2; 16]);
        assert!(tr.admit(5, &9, &again, false).is_ok(), "the same tenancy exposed again (a new token) may be posted");
    }

    #[test]
    fn ack_is_withheld_for_tenancies_an_unproven_end_touched() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(16);
        let r = remote(&[(0, 1), (1, 1)]);
        tr.admit(1, &9, &remote(&[(0, 1)]), false).unwrap();
        assert_eq!(tr.on_abort(&9, abort(&r)), None);
        let acks = tr.finished(1, OpEnd::Unproven);
        assert_eq!(acks[0].msg.tenancies, vec![Tenancy::new(SlotId(1), Generation(1))]);
        assert_eq!(tr.stats().acks_withheld, 1);
        // All unproven: nothing at all.
        tr.admit(2, &9, &remote(&[(5, 1)]), false).unwrap();
        tr.finished(2, OpEnd::Unproven);
        assert_eq!(tr.on_abort(&9, abort(&remote(&[(5, 1)]))), None);
    }

    #[test]
    fn exclusive_posts_are_refused_while_one_is_in_flight() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(16);
        tr.admit(1, &9, &remote(&[(0, 1)]), true).unwrap();
        assert!(matches!(tr.admit(2, &9, &remote(&[(0, 1)]), true), Err(Refusal::Busy(_))));
        assert!(tr.admit(2, &9, &remote(&[(0, 1)]), false).is_ok());
        tr.finished(1, OpEnd::Proven);
        tr.finished(2, OpEnd::Proven);
        assert!(tr.admit(3, &9, &remote(&[(0, 1)]), true).is_ok());
    }

    #[test]
    fn memory_is_bounded() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(4);
        for s in 0..100 {
            tr.tombstone(&1, PoolId(1), ExposureToken::default(), &[Tenancy::new(SlotId(s), Generation(1))]);
        }
        assert!(tr.tombstone_order.len() <= 4);
        assert!(tr.tombstones.values().map(HashMap::len).sum::<usize>() <= 4);
    }
}
