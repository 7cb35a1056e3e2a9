//! Retry shadows: what a revocation does not cover against a peer that
//! retries.
//!
//! A real Mooncake initiator over RDMA answers `REM_ACCESS_ERR` by deleting
//! its endpoint, fetching the target's metadata again, reconnecting and
//! retrying the slice with whatever key the metadata now holds (up to
//! `MC_RETRY_CNT`, 9). Measured (`docs/ENGINES.md`): with the buffer
//! published again under a new key, the stale write retried this way
//! succeeds. So a `Revoked` proof (the tenancy's window invalidated) ends
//! that tenancy's *key*, not that peer's *intent* to write the slot: if the
//! slot is exposed to the same peer again, the new key is in the metadata
//! that peer fetches, and its retry of the old write lands in the new
//! tenancy.
//!
//! The rule: a slot whose tenancy was settled by a revocation while exposed
//! to peer P is not exposed to P again until a proof that covers P's
//! retries arrives: P's own DONE or ABORT_ACK for that tenancy (it has
//! stopped: its retries are over), or a fence of P observed end to end.
//! Other peers may get the slot at once (their metadata never held it).
//! [`RetryShadows`] keeps those per-(slot, peer) shadows, sans-IO, beside
//! the backend's [`ExposureTable`](super::ExposureTable).

use super::codec::{ControlKind, ControlMessage, ExposureToken};
use crate::hash::HashMap;
use crate::ids::{Generation, PeerId, PoolId, SlotId, Tenancy};

/// An exposure refused because the slot is shadowed for that peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("slot {slot:?} of pool {pool:?} still has a revoked tenancy (generation {generation:?}) whose writes peer {peer:?} may retry")]
pub struct Shadowed {
    /// The pool.
    pub pool: PoolId,
    /// The slot.
    pub slot: SlotId,
    /// The peer that may retry.
    pub peer: PeerId,
    /// The revoked tenancy's generation.
    pub generation: Generation,
}

/// Per (pool, slot, peer): the revoked tenancy that peer may still retry
/// writes of, with its exposure token. A backend whose peers retry after a
/// revocation (Mooncake over RDMA) records every confirmed revocation here,
/// asks [`admit`](Self::admit) before each exposure, and feeds every DONE
/// or ABORT_ACK and every confirmed fence.
///
/// ```
/// use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken, RetryShadows};
/// use kv_transfer_core::*;
///
/// let (pool, peer, other) = (PoolId(1), PeerId(7), PeerId(8));
/// let old = Tenancy::new(SlotId(3), Generation(1));
/// let token = ExposureToken::random();
/// let mut shadows = RetryShadows::default();
/// shadows.revoked(pool, peer, &[(old, token)]);
/// // The same peer may retry its old write: not exposed to it again.
/// assert!(shadows.admit(pool, &[SlotId(3)], peer).is_err());
/// // Another peer never held the slot's key: admitted.
/// assert!(shadows.admit(pool, &[SlotId(3)], other).is_ok());
/// // The peer's own ack for the old tenancy covers its retries.
/// let ack = ControlMessage::new(ControlKind::AbortAck, pool, token, vec![old]);
/// assert_eq!(shadows.accept(peer, &ack), 1);
/// assert!(shadows.admit(pool, &[SlotId(3)], peer).is_ok());
/// ```
#[derive(Debug, Default)]
pub struct RetryShadows {
    map: HashMap<(PoolId, SlotId, PeerId), (Generation, ExposureToken)>,
    cleared: u64,
    refused: u64,
}

impl RetryShadows {
    /// Confirmed revocations of `tenancies` (with the token each was exposed
    /// under) of `pool`, exposed to `peer`: each slot is shadowed for that
    /// peer. A newer generation of the same slot replaces an older shadow
    /// (the older tenancy's ack can no longer be told apart from the newer's
    /// retries, so the newer one stands for both).
    pub fn revoked(&mut self, pool: PoolId, peer: PeerId, tenancies: &[(Tenancy, ExposureToken)]) {
        for (t, token) in tenancies {
            let e = self.map.entry((pool, t.slot, peer)).or_insert((t.generation, *token));
            if t.generation >= e.0 {
                *e = (t.generation, *token);
            }
        }
    }

    /// Whether `slots` of `pool` may be exposed to `peer`: refused, with the
    /// first shadowed slot, if one of them has a revoked tenancy `peer` may
    /// still retry.
    pub fn admit(&mut self, pool: PoolId, slots: &[SlotId], peer: PeerId) -> Result<(), Shadowed> {
        if self.map.is_empty() {
            return Ok(());
        }
        for &slot in slots {
            if let Some(&(generation, _)) = self.map.get(&(pool, slot, peer)) {
                self.refused += 1;
                return Err(Shadowed { pool, slot, peer, generation });
            }
        }
        Ok(())
    }

    /// A DONE or ABORT_ACK from `from` (as the transport authenticates it):
    /// clears each shadow it names for `from` with the shadow's generation
    /// and token. Returns how many it cleared. Anything else clears nothing:
    /// an ABORT, another peer, a guessed token, an older generation.
    pub fn accept(&mut self, from: PeerId, msg: &ControlMessage) -> usize {
        if msg.kind == ControlKind::Abort || self.map.is_empty() {
            return 0;
        }
        let mut n = 0;
        for t in &msg.tenancies {
            let key = (msg.pool, t.slot, from);
            if self.map.get(&key).is_some_and(|(g, k)| *g == t.generation && k.ct_eq(&msg.token)) {
                self.map.remove(&key);
                n += 1;
            }
        }
        self.cleared += n as u64;
        n
    }

    /// A fence of `peer` observed end to end (its connections torn down,
    /// nothing more can arrive from it, and a reconnect is a new peer):
    /// clears its shadows. Returns how many.
    pub fn fenced(&mut self, peer: PeerId) -> usize {
        let before = self.map.len();
        self.map.retain(|(_, _, p), _| *p != peer);
        let n = before - self.map.len();
        self.cleared += n as u64;
        n
    }

    /// Shadows held now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Shadows cleared so far (by an ack or a fence).
    pub fn cleared(&self) -> u64 {
        self.cleared
    }

    /// Exposures refused so far.
    pub fn refused(&self) -> u64 {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u32, g: u64) -> Tenancy {
        Tenancy::new(SlotId(s), Generation(g))
    }

    #[test]
    fn retry_shadow_only_the_peers_own_ack_or_fence_clears_it() {
        let (pool, p, q) = (PoolId(1), PeerId(1), PeerId(2));
        let (tok, other_tok) = (ExposureToken::random(), ExposureToken::random());
        let mut s = RetryShadows::default();
        s.revoked(pool, p, &[(t(0, 4), tok), (t(1, 4), tok)]);
        assert_eq!(s.admit(pool, &[SlotId(2), SlotId(1)], p).map_err(|e| e.slot), Err(SlotId(1)));
        assert!(s.admit(pool, &[SlotId(0)], q).is_ok());
        assert!(s.admit(PoolId(9), &[SlotId(0)], p).is_ok());
        let msg = |kind, token, ts| ControlMessage::new(kind, pool, token, ts);
        // An ABORT, another peer, a guessed token, another generation: nothing.
        assert_eq!(s.accept(p, &msg(ControlKind::Abort, tok, vec![t(0, 4)])), 0);
        assert_eq!(s.accept(q, &msg(ControlKind::AbortAck, tok, vec![t(0, 4)])), 0);
        assert_eq!(s.accept(p, &msg(ControlKind::AbortAck, other_tok, vec![t(0, 4)])), 0);
        assert_eq!(s.accept(p, &msg(ControlKind::Done, tok, vec![t(0, 3)])), 0);
        // The peer's DONE for slot 0's revoked tenancy: cleared; slot 1 stays.
        assert_eq!(s.accept(p, &msg(ControlKind::Done, tok, vec![t(0, 4)])), 1);
        assert!(s.admit(pool, &[SlotId(0)], p).is_ok());
        assert!(s.admit(pool, &[SlotId(1)], p).is_err());
        // A fence of the peer clears the rest.
        assert_eq!(s.fenced(q), 0);
        assert_eq!(s.fenced(p), 1);
        assert!(s.is_empty());
        assert_eq!((s.cleared(), s.refused()), (2, 2));
    }

    #[test]
    fn retry_shadow_a_newer_revocation_of_the_slot_replaces_the_older() {
        let (pool, p) = (PoolId(1), PeerId(1));
        let (old, new) = (ExposureToken::random(), ExposureToken::random());
        let mut s = RetryShadows::default();
        s.revoked(pool, p, &[(t(0, 2), new)]);
        s.revoked(pool, p, &[(t(0, 1), old)]); // late, older: ignored
        assert_eq!(s.accept(p, &ControlMessage::new(ControlKind::AbortAck, pool, old, vec![t(0, 1)])), 0);
        assert_eq!(s.admit(pool, &[SlotId(0)], p).map_err(|e| e.generation), Err(Generation(2)));
        assert_eq!(s.accept(p, &ControlMessage::new(ControlKind::AbortAck, pool, new, vec![t(0, 2)])), 1);
        assert!(s.is_empty());
    }
}
