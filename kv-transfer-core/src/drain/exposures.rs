//! The target side's exposure table: which tenancies are exposed to which
//! peer, under which token and trust, and what a peer's DONE or ABORT_ACK
//! may settle.

use super::codec::{ControlKind, ControlMessage, ExposureToken};
use super::{Capabilities, ReleasePolicy};
use crate::escalation::{EscalationAction, EscalationStep};
use crate::hash::HashMap;
use crate::ids::{Generation, PeerId, PoolId, SlotId, Tenancy};

/// Whether what a peer says about an exposure proves anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Trust {
    /// The peer's DONE / ABORT_ACK prove its operations ended (the default).
    #[default]
    Proving,
    /// Nothing the peer says proves anything (e.g. a Mooncake TCP v1 peer,
    /// whose completions only mean the bytes left its socket). Recorded with
    /// the exposure when it is made and never upgraded afterwards: such an
    /// exposure settles only by a revoke or a fence.
    Unproving,
}

#[derive(Clone, Copy, Debug)]
struct Exposure {
    generation: Generation,
    peer: PeerId,
    token: ExposureToken,
    trust: Trust,
}

/// What a DONE or ABORT_ACK settles. Deliver it with [`Verdict::deliver`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// The pool the message named.
    pub pool: Option<PoolId>,
    /// Tenancies proven (removed from the table): deliver `Completed`.
    pub settled: Vec<Tenancy>,
    /// With a DONE that carried digests: each settled tenancy's digest.
    pub digests: Vec<(Tenancy, super::Digest)>,
    /// The token the digests are keyed by (the message's).
    pub digest_key: ExposureToken,
    /// Named tenancies not awaiting settlement (old generation, never
    /// exposed, settled already): dropped (rule 5).
    pub stale: usize,
    /// Named tenancies exposed to another peer or under another token:
    /// dropped, counted as forged (rule 8).
    pub forged: usize,
    /// Named tenancies whose exposure's trust is [`Trust::Unproving`].
    pub untrusted: usize,
    /// The message was not a DONE or ABORT_ACK (nothing settled).
    pub wrong_kind: bool,
}

impl Verdict {
    /// Delivers the verdict to the pool's authority: `Completed` for the
    /// settled tenancies (with their digests), and the stale and forged
    /// counts. The authority must be the one of [`Verdict::pool`].
    pub fn deliver(&self, authority: &crate::SettlementAuthority) -> crate::DeliveryReport {
        if self.stale > 0 {
            authority.record_stale(self.stale as u64);
        }
        if self.forged > 0 {
            authority.record_forged(self.forged as u64);
        }
        if self.settled.is_empty() {
            return crate::DeliveryReport::default();
        }
        let proof = if self.digests.is_empty() {
            authority.completed(&self.settled)
        } else {
            authority.completed_with_digests(&self.settled, &self.digests, self.digest_key)
        };
        authority.deliver(proof)
    }
}

/// What the backend should do for one escalation action, decided by
/// [`ExposureTable::plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Nothing: the tenancies are no longer exposed to that peer (settled
    /// meanwhile), or belong to a local operation that drains by itself.
    Nothing,
    /// Send these ABORTs to the peer (one per exposure token).
    SendAbort {
        /// The peer.
        peer: PeerId,
        /// The messages.
        messages: Vec<ControlMessage>,
    },
    /// Revoke these tenancies' access and report which were confirmed
    /// ([`ExposureTable::revoked`]); only those get a `Revoked` proof.
    Revoke {
        /// The peer they are exposed to.
        peer: PeerId,
        /// The tenancies.
        tenancies: Vec<Tenancy>,
    },
    /// Fence the peer; on confirmation call [`ExposureTable::fenced`] and
    /// deliver `Fenced` to every pool.
    Fence {
        /// The peer.
        peer: PeerId,
    },
    /// **Positive control only**: mint `Completed` now, without evidence.
    #[cfg(feature = "naive-positive-control")]
    #[cfg_attr(docsrs, doc(cfg(feature = "naive-positive-control")))]
    ReleaseWithoutProof {
        /// The tenancies to free.
        tenancies: Vec<Tenancy>,
    },
    /// The ladder is exhausted: the slots stay quarantined and are reported
    /// (the pool counts them as stuck).
    Stuck {
        /// The peer.
        peer: PeerId,
        /// The slots left.
        tenancies: Vec<Tenancy>,
    },
}

impl Plan {
    /// The tenancies the positive control frees without a proof (only ever
    /// `Some` with the feature `naive-positive-control` and
    /// [`ReleasePolicy::Naive`]), so a backend handles it without naming
    /// the feature.
    pub fn release_without_proof(&self) -> Option<&[Tenancy]> {
        match self {
            #[cfg(feature = "naive-positive-control")]
            Plan::ReleaseWithoutProof { tenancies } => Some(tenancies),
            _ => None,
        }
    }
}

/// Target side: every tenancy exposed to a peer, with the peer, the
/// exposure's token and its trust. Sans-IO; a backend keeps one under its
/// own lock, feeds it the messages it receives and executes its [`Plan`]s.
///
/// ```
/// use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureTable, Trust};
/// use kv_transfer_core::*;
///
/// let mut table = ExposureTable::new();
/// let ts = [Tenancy::new(SlotId(3), Generation(1))];
/// let token = table.expose(PoolId(1), &ts, PeerId(7), Trust::Proving);
///
/// // A third party with the right name but no token settles nothing.
/// let forged = ControlMessage::new(ControlKind::Done, PoolId(1), Default::default(), ts.to_vec());
/// assert_eq!(table.accept(PeerId(7), &forged).forged, 1);
/// // The peer it was exposed to, with the token, settles it once.
/// let done = ControlMessage::new(ControlKind::Done, PoolId(1), token, ts.to_vec());
/// assert_eq!(table.accept(PeerId(7), &done).settled, ts.to_vec());
/// assert_eq!(table.accept(PeerId(7), &done).stale, 1);
/// ```
#[derive(Debug, Default)]
pub struct ExposureTable {
    map: HashMap<(PoolId, SlotId), Exposure>,
    /// The hostile-peer tests' positive control ([`ReleasePolicy::Naive`]):
    /// a message settles by (pool, slot, generation) alone, whoever sends
    /// it and whatever token it carries, as names did before tokens.
    trust_anyone: bool,
}

impl ExposureTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table for a backend running under `policy`. With
    /// [`ReleasePolicy::Safe`] this is [`ExposureTable::new`]. With the
    /// positive control (`Naive`, feature `naive-positive-control`) the
    /// table checks neither the sender nor the token, so the hostile-peer
    /// tests can show that their attacks succeed without those checks.
    pub fn with_policy(policy: ReleasePolicy) -> Self {
        Self { map: HashMap::default(), trust_anyone: policy.is_naive() }
    }

    /// Whether `from` with `token` speaks for exposure `e`.
    fn authorizes(&self, e: &Exposure, from: PeerId, token: &ExposureToken) -> bool {
        self.trust_anyone || (e.peer == from && e.token.ct_eq(token))
    }

    /// Records an exposure of `tenancies` of `pool` to `peer` and returns
    /// its fresh token (for the [`RemoteSlots`](crate::RemoteSlots) handed
    /// to that peer). A slot exposed earlier under an older generation is
    /// replaced: that tenancy is over.
    pub fn expose(&mut self, pool: PoolId, tenancies: &[Tenancy], peer: PeerId, trust: Trust) -> ExposureToken {
        let token = ExposureToken::random();
        self.expose_with(pool, tenancies, peer, trust, token);
        token
    }

    /// [`ExposureTable::expose`] under a token minted before: for a backend
    /// that marks the pool's slots exposed first and records them here
    /// after, so that a fence or loss of `peer` in between either covers
    /// the pool's exposure or finds it recorded (see [`Driver::expose_with`](super::Driver::expose_with)).
    pub fn expose_with(
        &mut self,
        pool: PoolId,
        tenancies: &[Tenancy],
        peer: PeerId,
        trust: Trust,
        token: ExposureToken,
    ) {
        for t in tenancies {
            self.map.insert((pool, t.slot), Exposure { generation: t.generation, peer, token, trust });
        }
    }

    /// The token `t` of `pool` is exposed to `peer` under, if it is (what a
    /// backend records in its [`RetryShadows`](super::RetryShadows) before a
    /// revocation removes the exposure).
    pub fn token_of(&self, pool: PoolId, t: Tenancy, peer: PeerId) -> Option<ExposureToken> {
        self.map.get(&(pool, t.slot)).filter(|e| e.generation == t.generation && e.peer == peer).map(|e| e.token)
    }

    /// Whether `t` of `pool` is exposed to `peer` (under that generation).
    pub fn is_exposed(&self, pool: PoolId, t: Tenancy, peer: PeerId) -> bool {
        self.map.get(&(pool, t.slot)).is_some_and(|e| e.generation == t.generation && e.peer == peer)
    }

    /// [`ExposureTable::is_exposed`], or under the positive control exposed
    /// to anyone.
    fn is_exposed_for(&self, pool: PoolId, t: Tenancy, peer: PeerId) -> bool {
        self.map
            .get(&(pool, t.slot))
            .is_some_and(|e| e.generation == t.generation && (e.peer == peer || self.trust_anyone))
    }

    /// Removes the exposure of `t` to `peer` (a settlement the backend
    /// observed by itself, e.g. an engine status bound to the connection);
    /// returns whether it was there.
    pub fn take(&mut self, pool: PoolId, t: Tenancy, peer: PeerId) -> bool {
        if self.is_exposed_for(pool, t, peer)
            && self.map.get(&(pool, t.slot)).is_some_and(|e| e.trust == Trust::Proving)
        {
            self.map.remove(&(pool, t.slot));
            return true;
        }
        false
    }

    /// A DONE or ABORT_ACK from `from` (the peer as the transport
    /// authenticates it: a connection, a registered agent; never a name the
    /// message declares). Settles, and removes from the table, each named
    /// tenancy that is exposed to `from` under the message's token with
    /// [`Trust::Proving`]; the rest is counted.
    pub fn accept(&mut self, from: PeerId, msg: &ControlMessage) -> Verdict {
        let mut v = Verdict { pool: Some(msg.pool), digest_key: msg.token, ..Verdict::default() };
        if msg.kind == ControlKind::Abort {
            v.wrong_kind = true;
            return v;
        }
        let digests = !msg.digests.is_empty() && msg.digests.len() == msg.tenancies.len();
        for (i, t) in msg.tenancies.iter().enumerate() {
            match self.map.get(&(msg.pool, t.slot)) {
                Some(e) if e.generation == t.generation => {
                    if !self.authorizes(e, from, &msg.token) {
                        v.forged += 1;
                    } else if e.trust == Trust::Unproving {
                        v.untrusted += 1;
                    } else {
                        self.map.remove(&(msg.pool, t.slot));
                        v.settled.push(*t);
                        if digests {
                            v.digests.push((*t, msg.digests[i]));
                        }
                    }
                }
                _ => v.stale += 1,
            }
        }
        if v.forged > 0 {
            tracing::warn!(
                peer = from.0,
                pool = msg.pool.0,
                forged = v.forged,
                "control message with a wrong token or from the wrong peer dropped"
            );
        }
        v
    }

    /// Confirmed revocations: removes them. Returns those that were exposed.
    pub fn revoked(&mut self, pool: PoolId, peer: PeerId, tenancies: &[Tenancy]) -> Vec<Tenancy> {
        tenancies
            .iter()
            .copied()
            .filter(|t| {
                let hit = self.is_exposed(pool, *t, peer);
                if hit {
                    self.map.remove(&(pool, t.slot));
                }
                hit
            })
            .collect()
    }

    /// A confirmed fence of `peer`: forgets every exposure to it (the
    /// backend delivers `Fenced(peer)` to its pools). Returns how many.
    pub fn fenced(&mut self, peer: PeerId) -> usize {
        let before = self.map.len();
        self.map.retain(|_, e| e.peer != peer);
        before - self.map.len()
    }

    /// Exposures to `peer`.
    pub fn exposed_to(&self, peer: PeerId) -> usize {
        self.map.values().filter(|e| e.peer == peer).count()
    }

    /// Exposures of `pool`.
    pub fn exposed_in(&self, pool: PoolId) -> usize {
        self.map.keys().filter(|(p, _)| *p == pool).count()
    }

    /// All exposures.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is exposed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// What to do for an escalation action of `pool` (from
    /// [`SettlementAuthority::poll_escalations`](crate::SettlementAuthority::poll_escalations)).
    /// The pool's ladder only contains steps `caps` allows; this still
    /// checks, so a step the backend cannot take is never handed to it.
    pub fn plan(&self, pool: PoolId, a: &EscalationAction, caps: Capabilities, policy: ReleasePolicy) -> Plan {
        let _ = policy;
        #[cfg(feature = "naive-positive-control")]
        if policy == ReleasePolicy::Naive {
            return match a.step {
                EscalationStep::RequestDrain => Plan::ReleaseWithoutProof { tenancies: a.tenancies.clone() },
                _ => Plan::Nothing,
            };
        }
        let exposed: Vec<Tenancy> = a.tenancies.iter().copied().filter(|t| self.is_exposed(pool, *t, a.peer)).collect();
        match a.step {
            EscalationStep::RequestDrain if caps.drain => {
                let mut by_token: Vec<(ExposureToken, Vec<Tenancy>)> = Vec::new();
                for t in exposed {
                    let Some(e) = self.map.get(&(pool, t.slot)) else { continue };
                    match by_token.iter_mut().find(|(k, _)| *k == e.token) {
                        Some((_, v)) => v.push(t),
                        None => by_token.push((e.token, vec![t])),
                    }
                }
                if by_token.is_empty() {
                    return Plan::Nothing;
                }
                let messages = by_token
                    .into_iter()
                    .flat_map(|(token, ts)| ControlMessage::new(ControlKind::Abort, pool, token, ts).chunks())
                    .collect();
                Plan::SendAbort { peer: a.peer, messages }
            }
            EscalationStep::Revoke if caps.revoke && !exposed.is_empty() => {
                Plan::Revoke { peer: a.peer, tenancies: exposed }
            }
            // A fence also settles a local operation's lease on that peer.
            EscalationStep::Fence if caps.fence => Plan::Fence { peer: a.peer },
            EscalationStep::Exhausted => Plan::Stuck { peer: a.peer, tenancies: a.tenancies.clone() },
            _ => Plan::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u32, g: u64) -> Tenancy {
        Tenancy::new(SlotId(s), Generation(g))
    }

    #[test]
    fn rule8_only_the_exposed_peer_with_the_token_settles() {
        let mut table = ExposureTable::new();
        let token = table.expose(PoolId(1), &[t(0, 5), t(1, 5)], PeerId(2), Trust::Proving);
        let other = table.expose(PoolId(1), &[t(2, 5)], PeerId(3), Trust::Proving);
        let msg = |tok, ts: Vec<Tenancy>| ControlMessage::new(ControlKind::Done, PoolId(1), tok, ts);
        assert_eq!(table.token_of(PoolId(1), t(0, 5), PeerId(2)), Some(token));
        assert_eq!(table.token_of(PoolId(1), t(0, 5), PeerId(3)), None);
        assert_eq!(table.token_of(PoolId(1), t(0, 4), PeerId(2)), None);
        // Another peer, with the right token: forged.
        assert_eq!(table.accept(PeerId(3), &msg(token, vec![t(0, 5)])).forged, 1);
        // The right peer, another exposure's token: forged.
        assert_eq!(table.accept(PeerId(2), &msg(other, vec![t(0, 5)])).forged, 1);
        // A guessed generation: stale.
        assert_eq!(table.accept(PeerId(2), &msg(token, vec![t(0, 6)])).stale, 1);
        // Another pool: stale.
        let mut m = msg(token, vec![t(0, 5)]);
        m.pool = PoolId(9);
        assert_eq!(table.accept(PeerId(2), &m).stale, 1);
        let v = table.accept(PeerId(2), &msg(token, vec![t(0, 5), t(1, 5)]));
        assert_eq!((v.settled, v.stale, v.forged), (vec![t(0, 5), t(1, 5)], 0, 0));
        // Replayed: stale.
        assert_eq!(table.accept(PeerId(2), &msg(token, vec![t(0, 5)])).stale, 1);
        assert_eq!(table.len(), 1);
    }

    /// The positive control of the hostile-peer tests: without the checks,
    /// a third party's DONE with a guessed token settles (the attack the
    /// checks stop); with them it is counted as forged.
    #[cfg(feature = "naive-positive-control")]
    #[test]
    fn rule8_without_the_checks_a_forged_done_settles() {
        for (policy, settled) in [(ReleasePolicy::Safe, 0), (ReleasePolicy::Naive, 1)] {
            let mut table = ExposureTable::with_policy(policy);
            table.expose(PoolId(1), &[t(0, 1)], PeerId(2), Trust::Proving);
            let forged = ControlMessage::new(ControlKind::Done, PoolId(1), ExposureToken::default(), vec![t(0, 1)]);
            let v = table.accept(PeerId(3), &forged);
            assert_eq!((v.settled.len(), v.forged), (settled, 1 - settled), "{policy:?}");
        }
    }

    #[test]
    fn rule8_an_unproving_exposure_is_never_upgraded_by_a_message() {
        let mut table = ExposureTable::new();
        let token = table.expose(PoolId(1), &[t(0, 1)], PeerId(2), Trust::Unproving);
        let done = ControlMessage::new(ControlKind::Done, PoolId(1), token, vec![t(0, 1)]);
        assert_eq!(table.accept(PeerId(2), &done).untrusted, 1);
        assert!(!table.take(PoolId(1), t(0, 1), PeerId(2)));
        assert_eq!(table.fenced(PeerId(2)), 1);
    }

    #[test]
    fn plan_follows_capabilities_and_groups_aborts_by_token() {
        let mut table = ExposureTable::new();
        let a = table.expose(PoolId(1), &[t(0, 1)], PeerId(2), Trust::Proving);
        let b = table.expose(PoolId(1), &[t(1, 1)], PeerId(2), Trust::Proving);
        let action = |step| EscalationAction {
            quarantine: crate::escalation::QuarantineId(0),
            peer: PeerId(2),
            tenancies: vec![t(0, 1), t(1, 1), t(7, 1)],
            step,
        };
        let all = Capabilities::ALL;
        match table.plan(PoolId(1), &action(EscalationStep::RequestDrain), all, ReleasePolicy::Safe) {
            Plan::SendAbort { peer, messages } => {
                assert_eq!(peer, PeerId(2));
                assert_eq!(messages.len(), 2);
                assert_eq!((messages[0].token, messages[1].token), (a, b));
                assert!(messages.iter().all(|m| m.kind == ControlKind::Abort && m.tenancies.len() == 1));
            }
            other => panic!("{other:?}"),
        }
        let none = Capabilities { drain: false, revoke: false, fence: false };
        assert_eq!(
            table.plan(PoolId(1), &action(EscalationStep::RequestDrain), none, ReleasePolicy::Safe),
            Plan::Nothing
        );
        assert_eq!(table.plan(PoolId(1), &action(EscalationStep::Revoke), none, ReleasePolicy::Safe), Plan::Nothing);
        assert_eq!(table.plan(PoolId(1), &action(EscalationStep::Fence), none, ReleasePolicy::Safe), Plan::Nothing);
        assert_eq!(
            table.plan(PoolId(1), &action(EscalationStep::Revoke), all, ReleasePolicy::Safe),
            Plan::Revoke { peer: PeerId(2), tenancies: vec![t(0, 1), t(1, 1)] }
        );
        assert_eq!(table.revoked(PoolId(1), PeerId(2), &[t(0, 1), t(7, 1)]), vec![t(0, 1)]);
        assert!(matches!(
            table.plan(PoolId(1), &action(EscalationStep::Exhausted), all, ReleasePolicy::Safe),
            Plan::Stuck { .. }
        ));
    }
}
