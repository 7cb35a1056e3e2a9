//! The initiator side's abort tracker: which posted operations touch which
//! remote tenancies, which remote tenancies their target gave up, and when
//! an ABORT may be answered.

use super::codec::{ControlKind, ControlMessage, ExposureToken};
use crate::hash::{HashMap, HashSet};
use crate::ids::{Generation, PoolId, SlotId, Tenancy};
use crate::remote::RemoteSlots;
use std::collections::VecDeque;
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
    /// What this tracker must remember about the peer (tombstones, unproven
    /// ends) ran out of room: it is closed to posts until it is fenced or
    /// removed, rather than forget a tombstone (rule 9, fail closed).
    #[error("the peer's abort state is full: posts are refused until it is fenced")]
    PeerStateFull,
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
struct PendingAbort {
    msg: ControlMessage,
    waiting: HashSet<u64>,
}

/// What one peer's messages have made this tracker remember: each table is
/// the peer's own and capped (rule 9), so one peer's flood neither evicts
/// nor delays another peer's state.
#[derive(Debug, Default)]
struct PeerAborts {
    /// Verified tombstones, per pool and slot: the highest generation that
    /// was aborted or handed back, with that exposure's token. Only an ABORT
    /// under a token this tracker has seen (an operation of ours carried it,
    /// or a tombstone of that slot holds it) or our own hand-back lands here,
    /// so a peer cannot raise a slot's generation with a made-up token.
    tombstones: HashMap<PoolId, HashMap<SlotId, (Generation, ExposureToken)>>,
    tombstoned: usize,
    /// ABORTs under a token no operation or tombstone of ours carries yet
    /// (the target aborted before we posted): a post under that token is
    /// refused, and promotes the entry to a verified tombstone.
    early: HashMap<(PoolId, ExposureToken), HashSet<Tenancy>>,
    early_len: usize,
    /// ABORTs waiting for operations, one per exposure (a repeated ABORT
    /// merges into the one already waiting).
    pending: Vec<PendingAbort>,
    /// Tenancies an operation of ours ended unproven on: never acknowledged.
    unproven: HashSet<(PoolId, Tenancy)>,
    /// A table that must not forget ran out of room: no post to this peer is
    /// admitted and no ABORT of it acknowledged until it is fenced or
    /// removed ([`AbortTracker::forget_peer`]). Failing closed, never forgetting.
    saturated: bool,
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
    /// Posts refused (tombstoned, busy, or the peer's state full).
    pub refused: u64,
    /// ABORTs dropped unanswered because their peer's room was full (the
    /// target asks again; nothing it holds is freed without our ack).
    pub aborts_refused: u64,
    /// ABORTs under a token no operation or tombstone of ours carried:
    /// kept apart, by token, so they refuse only posts under that token.
    pub aborts_unverified: u64,
    /// ABORTs merged into one already waiting for the same exposure.
    pub aborts_merged: u64,
    /// Times a peer's state that must not forget ran out of room, so that
    /// the peer was closed to posts and acks until fenced (fail closed).
    pub peers_saturated: u64,
    /// ABORTs dropped unanswered, buying nothing, because they came from a
    /// peer this tracker holds nothing for while it already holds state for
    /// [`AbortTracker::max_peers`] peers (made-up names buy no entries).
    pub peers_refused: u64,
}

/// How an [`AbortTracker`] remembers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Remembering {
    /// Rule 9: per peer, verified by token, capped, failing closed.
    #[default]
    PerPeer,
    /// The positive control of the hostile-peer tests (before rule 9): every
    /// ABORT trusted, one FIFO of tombstones shared by all peers that forgets
    /// the oldest, repeated ABORTs kept apart.
    #[cfg(feature = "naive-positive-control")]
    SharedFifo,
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
/// What a peer's messages make it remember is that peer's alone and capped
/// (rule 9): an ABORT under a token we never saw refuses only posts under
/// that token, a repeated ABORT merges into the one waiting, and a table
/// that must not forget fails closed when full (the peer's posts refused,
/// its ABORTs dropped unanswered, counted) instead of forgetting.
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
    peers: HashMap<K, PeerAborts>,
    /// Per peer: the most tombstoned slots, early-abort tenancies, unproven
    /// tenancies and waiting ABORTs, each.
    cap: usize,
    /// The most peers whose unsolicited ABORTs may create state here (our
    /// own posts' peers always may: this side chose them).
    max_peers: usize,
    mode: Remembering,
    /// Only under [`Remembering::SharedFifo`]: the shared eviction order.
    fifo: VecDeque<(K, PoolId, SlotId)>,
    stats: TrackerStats,
    /// Tenancy lists of finished operations, cleared, for the next
    /// [`admit`](Self::admit): in steady state a post allocates none.
    spare: Vec<Vec<Tenancy>>,
}

/// Most tenancy lists kept for reuse (a burst beyond this many in flight
/// allocates again), and the longest kept: at most 64 × 1,024 tenancies
/// (1 MiB) stay allocated.
const SPARE_LISTS: usize = 64;
const SPARE_LEN: usize = 1024;

/// The default of [`AbortTracker::max_peers`].
pub const DEFAULT_MAX_PEERS: usize = 256;

impl<K: Clone + Eq + Hash> AbortTracker<K> {
    /// A tracker that remembers, per peer, at most `max_remembered`
    /// tombstoned slots, early-abort tenancies, unproven tenancies and
    /// waiting ABORTs (each); past that it fails closed for that peer.
    pub fn new(max_remembered: usize) -> Self {
        Self {
            ops: HashMap::default(),
            peers: HashMap::default(),
            cap: max_remembered.max(1),
            max_peers: DEFAULT_MAX_PEERS,
            mode: Remembering::PerPeer,
            fifo: VecDeque::new(),
            stats: TrackerStats::default(),
            spare: Vec::new(),
        }
    }

    /// [`new`](Self::new) under a release policy: `Safe` is `new`; `Naive`
    /// (the hostile-peer tests' positive control) remembers as before rule 9:
    /// every ABORT trusted, one FIFO of `max_remembered` tombstones shared by
    /// all peers that forgets the oldest, repeated ABORTs waiting apart.
    pub fn with_policy(max_remembered: usize, policy: super::ReleasePolicy) -> Self {
        #[allow(unused_mut)]
        let mut t = Self::new(max_remembered);
        #[cfg(feature = "naive-positive-control")]
        if policy.is_naive() {
            t.mode = Remembering::SharedFifo;
        }
        let _ = policy;
        t
    }

    fn per_peer(&self) -> bool {
        self.mode == Remembering::PerPeer
    }

    /// Caps the peers whose ABORTs may create state here at `n` (default
    /// [`DEFAULT_MAX_PEERS`]). An ABORT from a peer this tracker holds
    /// nothing for, past the cap, is dropped unanswered and buys nothing
    /// (`peers_refused`); the peers of our own posts are never refused.
    /// So a flood under made-up names holds at most `n` × 4 × the per-peer
    /// cap entries, however many names it uses.
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n.max(1);
        self
    }

    /// The peer cap ([`with_max_peers`](Self::with_max_peers)).
    pub fn max_peers(&self) -> usize {
        self.max_peers
    }

    /// Peers this tracker holds state for.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Entries all peers' messages hold here (see [`remembered_for`](Self::remembered_for)).
    pub fn remembered(&self) -> usize {
        self.peers.values().map(|p| p.tombstoned + p.early_len + p.unproven.len() + p.pending.len()).sum()
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
        self.peers.values().map(|p| p.pending.len()).sum()
    }

    /// Entries `peer`'s messages hold here (tombstoned slots, early-abort
    /// tenancies, unproven tenancies, waiting ABORTs): at most four times the
    /// cap, whatever the peer sends.
    pub fn remembered_for(&self, peer: &K) -> usize {
        self.peers.get(peer).map_or(0, |p| p.tombstoned + p.early_len + p.unproven.len() + p.pending.len())
    }

    /// Registers operation `op` on `remote` (of `peer`) before it is
    /// submitted. Refused if a tenancy is tombstoned, or (with `exclusive`)
    /// if another operation of ours is in flight on the same tenancy (a newer
    /// tenancy of the same slot is another tenancy).
    pub fn admit(&mut self, op: u64, peer: &K, remote: &RemoteSlots, exclusive: bool) -> Result<(), Refusal> {
        self.check(peer, remote)?;
        let mut tenancies = self.spare.pop().unwrap_or_default();
        tenancies.extend(remote.slots.iter().map(|s| s.tenancy()));
        if exclusive {
            let busy = self
                .ops
                .values()
                .filter(|o| o.peer == *peer && o.pool == remote.pool)
                .find_map(|o| tenancies.iter().find(|t| o.tenancies.contains(t)).copied());
            if let Some(t) = busy {
                self.stats.refused += 1;
                self.recycle(tenancies);
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
        let Some(p) = self.peers.get_mut(peer) else { return Ok(()) };
        if p.saturated {
            self.stats.refused += 1;
            return Err(Refusal::PeerStateFull);
        }
        // The application holds this token: an early ABORT under it was the
        // target's own, so it becomes a verified tombstone (generations count).
        if let Some(early) = p.early.remove(&(remote.pool, remote.token)) {
            p.early_len -= early.len();
            let early: Vec<Tenancy> = early.into_iter().collect();
            self.record(peer, remote.pool, remote.token, &early);
        }
        let Some(p) = self.peers.get(peer) else { return Ok(()) };
        if p.saturated {
            self.stats.refused += 1;
            return Err(Refusal::PeerStateFull);
        }
        let Some(dead) = p.tombstones.get(&remote.pool) else { return Ok(()) };
        for s in &remote.slots {
            let t = s.tenancy();
            let hit = dead
                .get(&t.slot)
                .is_some_and(|(g, k)| *g > t.generation || (*g == t.generation && k.ct_eq(&remote.token)));
            if hit {
                self.stats.refused += 1;
                return Err(Refusal::Tombstoned(t));
            }
        }
        Ok(())
    }

    /// Keeps `list`'s allocation for a later operation.
    fn recycle(&mut self, mut list: Vec<Tenancy>) {
        if self.spare.len() < SPARE_LISTS && list.capacity() <= SPARE_LEN {
            list.clear();
            self.spare.push(list);
        }
    }

    /// Tombstones `tenancies` of `peer`'s `pool` under the exposure `token`
    /// (handed back by a DONE or an ABORT_ACK of ours, or aborted by the
    /// target). Past the peer's cap the peer is closed (fail closed).
    pub fn tombstone(&mut self, peer: &K, pool: PoolId, token: ExposureToken, tenancies: &[Tenancy]) {
        self.record(peer, pool, token, tenancies);
    }

    /// Records verified tombstones; false if the peer's room ran out (the
    /// peer is then saturated: nothing is forgotten, everything refused).
    fn record(&mut self, peer: &K, pool: PoolId, token: ExposureToken, tenancies: &[Tenancy]) -> bool {
        let cap = self.cap;
        let per_peer = self.per_peer();
        let p = self.peers.entry(peer.clone()).or_default();
        let dead = p.tombstones.entry(pool).or_default();
        let mut full = false;
        for t in tenancies {
            match dead.get_mut(&t.slot) {
                Some(e) => {
                    if t.generation >= e.0 {
                        *e = (t.generation, token);
                    }
                }
                None if per_peer && p.tombstoned >= cap => full = true,
                None => {
                    dead.insert(t.slot, (t.generation, token));
                    p.tombstoned += 1;
                }
            }
            if !per_peer {
                self.fifo.push_back((peer.clone(), pool, t.slot));
            }
        }
        if full && !p.saturated {
            p.saturated = true;
            self.stats.peers_saturated += 1;
            tracing::warn!(cap, "a peer's tombstones are full: its posts and ABORTs are refused until it is fenced");
        }
        if !per_peer {
            self.evict_shared_fifo();
        }
        !full
    }

    /// The positive control's memory: one FIFO for all peers, oldest forgotten.
    fn evict_shared_fifo(&mut self) {
        while self.fifo.len() > self.cap {
            let Some((peer, pool, slot)) = self.fifo.pop_front() else { break };
            if let Some(p) = self.peers.get_mut(&peer) {
                if let Some(m) = p.tombstones.get_mut(&pool) {
                    if m.remove(&slot).is_some() {
                        p.tombstoned -= 1;
                    }
                }
            }
        }
    }

    /// Operation `op` is terminal. Returns the ABORT_ACKs now due (those
    /// whose every operation is terminal), without the tenancies an
    /// unproven end touched.
    pub fn finished(&mut self, op: u64, end: OpEnd) -> Vec<Outgoing<K>> {
        let Some(mut o) = self.ops.remove(&op) else { return Vec::new() };
        if end == OpEnd::Unproven {
            let (cap, per_peer) = (self.cap, self.per_peer());
            let p = self.peers.entry(o.peer.clone()).or_default();
            for t in &o.tenancies {
                if per_peer && p.unproven.len() >= cap && !p.unproven.contains(&(o.pool, *t)) {
                    // Forgetting an unproven end could ack it later: close instead.
                    if !p.saturated {
                        p.saturated = true;
                        self.stats.peers_saturated += 1;
                    }
                    break;
                }
                p.unproven.insert((o.pool, *t));
            }
            if !per_peer && p.unproven.len() > cap {
                p.unproven.clear();
            }
            self.record(&o.peer, o.pool, o.token, &o.tenancies);
        }
        self.recycle(std::mem::take(&mut o.tenancies));
        let Some(p) = self.peers.get_mut(&o.peer) else { return Vec::new() };
        if p.pending.is_empty() {
            return Vec::new();
        }
        let mut ready = Vec::new();
        let mut i = 0;
        while i < p.pending.len() {
            p.pending[i].waiting.remove(&op);
            if p.pending[i].waiting.is_empty() {
                ready.push(p.pending.swap_remove(i).msg);
            } else {
                i += 1;
            }
        }
        ready.into_iter().filter_map(|msg| self.ack(o.peer.clone(), msg)).collect()
    }

    /// An ABORT from `from` (already decoded; the caller checked it is one).
    /// Tombstones its tenancies; returns the ABORT_ACK at once if no
    /// operation of ours touches them, else keeps it until they are terminal.
    ///
    /// Under a token we have seen (an operation of ours carried it, or a
    /// tombstone of one of its slots holds it) the tombstones are verified;
    /// under another they refuse only posts under that token. Past the
    /// peer's cap the ABORT is dropped unanswered and counted: its target
    /// keeps the slots quarantined and asks again.
    pub fn on_abort(&mut self, from: &K, msg: ControlMessage) -> Option<Outgoing<K>> {
        self.stats.aborts_received += 1;
        self.abort_from(from, msg, false)
    }

    fn knows(&self, from: &K, msg: &ControlMessage) -> bool {
        let by_op = self.ops.values().any(|o| o.peer == *from && o.pool == msg.pool && o.token.ct_eq(&msg.token));
        by_op
            || self.peers.get(from).and_then(|p| p.tombstones.get(&msg.pool)).is_some_and(|dead| {
                msg.tenancies.iter().any(|t| dead.get(&t.slot).is_some_and(|(_, k)| k.ct_eq(&msg.token)))
            })
    }

    fn refuse_abort(&mut self, why: &'static str) -> Option<Outgoing<K>> {
        self.stats.aborts_refused += 1;
        tracing::debug!(why, "ABORT dropped unanswered (its target keeps the slots quarantined and asks again)");
        None
    }

    fn abort_from(&mut self, from: &K, msg: ControlMessage, ours: bool) -> Option<Outgoing<K>> {
        let per_peer = self.per_peer();
        if self.peers.get(from).is_some_and(|p| p.saturated) {
            return self.refuse_abort("the peer's state is full");
        }
        if per_peer
            && !ours
            && self.peers.len() >= self.max_peers
            && !self.peers.contains_key(from)
            && !self.ops.values().any(|o| o.peer == *from)
        {
            self.stats.peers_refused += 1;
            return self.refuse_abort("state for the most peers is held already");
        }
        if !per_peer || ours || self.knows(from, &msg) {
            if !self.record(from, msg.pool, msg.token, &msg.tenancies) {
                return self.refuse_abort("the peer's tombstones are full");
            }
        } else {
            let cap = self.cap;
            let p = self.peers.entry(from.clone()).or_default();
            let known = p.early.get(&(msg.pool, msg.token));
            let new = msg.tenancies.iter().filter(|t| !known.is_some_and(|k| k.contains(t))).count();
            if p.early_len + new > cap {
                return self.refuse_abort("the peer's early aborts are full");
            }
            p.early.entry((msg.pool, msg.token)).or_default().extend(msg.tenancies.iter().copied());
            p.early_len += new;
            self.stats.aborts_unverified += 1;
        }
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
        let cap = self.cap;
        let p = self.peers.entry(from.clone()).or_default();
        if per_peer {
            let same = p.pending.iter_mut().find(|w| w.msg.pool == msg.pool && w.msg.token.ct_eq(&msg.token));
            if let Some(w) = same {
                for t in msg.tenancies {
                    if !w.msg.tenancies.contains(&t) {
                        w.msg.tenancies.push(t);
                    }
                }
                w.waiting.extend(waiting);
                self.stats.aborts_merged += 1;
                return None;
            }
            if p.pending.len() >= cap {
                return self.refuse_abort("the peer's waiting ABORTs are full");
            }
        }
        p.pending.push(PendingAbort { msg, waiting });
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
        self.abort_from(peer, msg, true)
    }

    /// Forgets everything about `peer` (it was fenced or removed): pending
    /// ABORTs from it are dropped unanswered; its operations stay registered
    /// until they finish.
    pub fn forget_peer(&mut self, peer: &K) {
        self.peers.remove(peer);
        self.fifo.retain(|(p, _, _)| p != peer);
    }

    fn ack(&mut self, peer: K, abort: ControlMessage) -> Option<Outgoing<K>> {
        let before = abort.tenancies.len();
        let unproven = self.peers.get(&peer).map(|p| &p.unproven);
        let tenancies: Vec<Tenancy> =
            abort.tenancies.into_iter().filter(|t| !unproven.is_some_and(|u| u.contains(&(abort.pool, *t)))).collect();
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
            memory: Default::default(),
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
    fn reused_tenancy_lists_are_bounded_and_carry_nothing_over() {
        let mut tr = AbortTracker::new(16);
        let n = SPARE_LISTS as u64 + 36;
        for op in 0..n {
            tr.admit(op, &9, &remote(&[(op as u32, 1)]), false).unwrap();
        }
        for op in 0..n {
            assert!(tr.finished(op, OpEnd::Proven).is_empty());
        }
        assert_eq!(tr.spare.len(), SPARE_LISTS, "at most SPARE_LISTS lists kept");
        // A reused list holds only the new operation's tenancies: an ABORT
        // of the tenancy the list last held (the last one kept) is acked at
        // once (nothing in flight touches it); one of the new operation's
        // waits for it.
        tr.admit(n, &9, &remote(&[(500, 1)]), false).unwrap();
        assert!(tr.on_abort(&9, abort(&remote(&[(SPARE_LISTS as u32 - 1, 1)]))).is_some());
        assert!(tr.on_abort(&9, abort(&remote(&[(500, 1)]))).is_none());
        assert_eq!(tr.finished(n, OpEnd::Proven).len(), 1);
        // A list longer than SPARE_LEN is not kept.
        let long: Vec<(u32, u64)> = (0..SPARE_LEN as u32 + 1).map(|s| (1000 + s, 1)).collect();
        tr.spare.clear();
        tr.admit(n + 1, &9, &remote(&long), false).unwrap();
        tr.finished(n + 1, OpEnd::Proven);
        assert!(tr.spare.is_empty());
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
    fn rule9_memory_is_bounded_per_peer_and_a_full_peer_fails_closed() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(4);
        for s in 0..100 {
            tr.tombstone(&1, PoolId(1), ExposureToken::default(), &[Tenancy::new(SlotId(s), Generation(1))]);
        }
        assert_eq!(tr.remembered_for(&1), 4, "no more than the cap");
        assert_eq!(tr.stats().peers_saturated, 1);
        // Nothing was forgotten: the peer is closed instead.
        assert_eq!(tr.admit(1, &1, &remote(&[(0, 1)]), false), Err(Refusal::PeerStateFull));
        assert_eq!(tr.admit(1, &1, &remote(&[(50, 2)]), false), Err(Refusal::PeerStateFull));
        assert_eq!(tr.on_abort(&1, abort(&remote(&[(7, 1)]))), None);
        assert_eq!(tr.stats().aborts_refused, 1);
        // Another peer is untouched.
        assert_eq!(tr.admit(2, &2, &remote(&[(0, 1)]), false), Ok(()));
        // A fence clears the closed peer.
        tr.forget_peer(&1);
        assert_eq!(tr.admit(3, &1, &remote(&[(0, 2)]), false), Ok(()));
    }

    fn forged(slot: u32, generation: u64, i: u64) -> ControlMessage {
        let mut token = [0xa5; 16];
        token[..8].copy_from_slice(&i.to_le_bytes());
        ControlMessage::new(
            ControlKind::Abort,
            PoolId(1),
            ExposureToken(token),
            vec![Tenancy::new(SlotId(slot), Generation(generation))],
        )
    }

    /// Attack 1 of the second hostile round, at the tracker: a real aborted
    /// tenancy's tombstone, then a flood of ABORTs under made-up tokens from
    /// the same claimed name; the late post must still be refused.
    fn flood_then_late_post(tr: &mut AbortTracker<u32>, flood: u64) -> Result<(), Refusal> {
        let real = remote(&[(3, 1)]);
        tr.admit(1, &9, &real, false).unwrap();
        assert_eq!(tr.on_abort(&9, abort(&real)), None);
        assert!(tr.finished(1, OpEnd::Proven).len() == 1, "the real ABORT is acked once the op is over");
        for i in 0..flood {
            let _ = tr.on_abort(&9, forged(100 + i as u32, 1, i));
        }
        tr.admit(2, &9, &real, false)
    }

    #[test]
    fn hostile_abort_flood_under_made_up_tokens_never_evicts_a_real_tombstone() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(64);
        assert_eq!(
            flood_then_late_post(&mut tr, 640),
            Err(Refusal::Tombstoned(Tenancy::new(SlotId(3), Generation(1))))
        );
        assert!(tr.remembered_for(&9) <= 2 * 64, "the flood bought at most the peer's cap");
        assert_eq!(tr.stats().aborts_unverified, 64);
        assert_eq!(tr.stats().aborts_refused, 640 - 64);
        assert_eq!(tr.stats().peers_saturated, 0, "early aborts refuse; they never close the peer");
    }

    #[cfg(feature = "naive-positive-control")]
    #[test]
    fn hostile_abort_flood_positive_control_the_shared_fifo_forgets_the_real_tombstone() {
        let mut tr: AbortTracker<u32> = AbortTracker::with_policy(64, crate::drain::ReleasePolicy::Naive);
        assert_eq!(flood_then_late_post(&mut tr, 640), Ok(()), "the late post is admitted: the attack works");
    }

    #[test]
    fn hostile_abort_at_the_last_generation_under_a_made_up_token_refuses_no_post() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(64);
        assert!(tr.on_abort(&9, forged(0, u64::MAX, 1)).is_some(), "answered: nothing of ours touches it");
        assert_eq!(tr.admit(1, &9, &remote(&[(0, 1)]), false), Ok(()), "an honest post to the slot");
        #[cfg(feature = "naive-positive-control")]
        {
            let mut naive: AbortTracker<u32> = AbortTracker::with_policy(64, crate::drain::ReleasePolicy::Naive);
            let _ = naive.on_abort(&9, forged(0, u64::MAX, 1));
            assert!(naive.admit(1, &9, &remote(&[(0, 1)]), false).is_err(), "positive control: the slot is dead");
        }
        // The same ABORT under the exposure's real token does refuse it.
        let mut m = forged(0, u64::MAX, 1);
        m.token = remote(&[]).token;
        tr.finished(1, OpEnd::Proven);
        let _ = tr.on_abort(&9, m.clone());
        assert!(tr.admit(2, &9, &remote(&[(0, 1)]), false).is_err(), "an early ABORT under the real token");
    }

    #[test]
    fn hostile_repeated_abort_while_an_operation_runs_is_merged_and_acked_once() {
        let mut tr: AbortTracker<u32> = AbortTracker::new(64);
        let r = remote(&[(0, 1)]);
        tr.admit(1, &9, &r, false).unwrap();
        for _ in 0..10_000 {
            assert_eq!(tr.on_abort(&9, abort(&r)), None);
        }
        assert_eq!(tr.pending_aborts(), 1);
        assert_eq!(tr.stats().aborts_merged, 9_999);
        let acks = tr.finished(1, OpEnd::Proven);
        assert_eq!(acks.len(), 1, "one ABORT_ACK, not one per repeat");
        #[cfg(feature = "naive-positive-control")]
        {
            let mut naive: AbortTracker<u32> = AbortTracker::with_policy(64, crate::drain::ReleasePolicy::Naive);
            naive.admit(1, &9, &r, false).unwrap();
            for _ in 0..10_000 {
                let _ = naive.on_abort(&9, abort(&r));
            }
            assert_eq!(naive.finished(1, OpEnd::Proven).len(), 10_000, "positive control: one ack per repeat");
        }
        // Distinct made-up tokens naming the in-flight tenancy: capped.
        tr.admit(2, &9, &r, false).unwrap_err();
        let r2 = remote(&[(1, 1)]);
        tr.admit(3, &9, &r2, false).unwrap();
        for i in 0..640 {
            let _ = tr.on_abort(&9, forged(1, 1, i));
        }
        assert!(tr.pending_aborts() <= 64, "waiting ABORTs capped per peer: {}", tr.pending_aborts());
    }
}
