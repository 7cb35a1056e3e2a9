//! Access keys per tenancy, where the engine has them (Mooncake over RDMA:
//! [`crate::rdma::RdmaTarget`] with `Publish::Grants`), and the retry
//! shadows that must come with them against a Mooncake initiator.
//!
//! With keys the ladder gains `Revoke`: a tenancy's key is ended at the NIC
//! and the tenancy settles `Revoked`. But a real Mooncake initiator answers
//! the refusal by re-fetching our metadata and retrying with whatever key it
//! finds there (`docs/ENGINES.md`; measured again in `tests/rdma_real.rs`: a
//! revoked slot granted to the same initiator at once took 63 MB of the old
//! request's bytes). So a revoked slot is not exposed to that peer again
//! until its DONE / ABORT_ACK for the old tenancy arrives (core's
//! [`RetryShadows`]); other peers may take it at once, since the metadata
//! they fetch never held it. Every settlement also ends the tenancy's key
//! before the slot can go back to the pool: a key that outlived its
//! tenancy would grant the next one's bytes.

use kv_transfer_core::hash::HashMap;
use std::sync::Arc;

use kv_transfer_core::drain::{ControlMessage, ExposureToken, RetryShadows};
use kv_transfer_core::{ExposeErrorKind, Generation, PeerId, PoolId, SlotId, Tenancy};

use crate::error::EngineError;

/// Per-tenancy access keys an engine grants and revokes.
pub trait TenancyKeys: Send + Sync + std::fmt::Debug {
    /// Grants `[addr, addr+len)` to the peer named `peer` under a key of
    /// its own; returns the grant's handle and the key.
    fn grant(&self, peer: &str, addr: u64, len: u64) -> Result<(u64, u32), EngineError>;
    /// Ends a grant: once this returns `true`, the NIC refuses its key.
    /// `false`: there was no such grant.
    fn revoke(&self, grant: u64) -> bool;
}

/// The adapter's grants and shadows (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Grants {
    by_slot: HashMap<(PoolId, SlotId), (Generation, u64)>,
    shadows: RetryShadows,
    /// Keys the positive control left granted.
    orphans: Vec<u64>,
}

impl Grants {
    /// Before an exposure: refuses a slot shadowed for `peer`, then grants
    /// each slot (`(tenancy, addr, len)`) to it. On a failure every grant
    /// made here is revoked again. Returns each slot's key.
    pub(super) fn expose(
        &mut self,
        keys: &Arc<dyn TenancyKeys>,
        pool: PoolId,
        slots: &[(Tenancy, u64, u64)],
        peer: PeerId,
        peer_name: &str,
    ) -> Result<Vec<u32>, ExposeErrorKind> {
        let ids: Vec<SlotId> = slots.iter().map(|(t, _, _)| t.slot).collect();
        self.shadows.admit(pool, &ids, peer).map_err(ExposeErrorKind::RetryShadow)?;
        let mut made = Vec::with_capacity(slots.len());
        for (t, addr, len) in slots {
            match keys.grant(peer_name, *addr, *len) {
                Ok(g) => made.push((*t, g)),

                Err(e) => {
                    for (_, (g, _)) in made {
                        keys.revoke(g);
                    }
                    return Err(ExposeErrorKind::Engine(e.to_string()));
                }
            }
        }
        let rkeys = made.iter().map(|(_, (_, k))| *k).collect();
        for (t, (g, _)) in made {
            if let Some((_, old)) = self.by_slot.insert((pool, t.slot), (t.generation, g)) {
                // A slot is exposed again only once settled, and settling
                // ends its key: this one is the positive control's, which
                // frees without ending anything. It stays granted (that is
                // the bug it reproduces) until the target goes.
                tracing::error!(grant = old, "NAIVE POSITIVE CONTROL: an earlier tenancy's key still grants this slot");
                self.orphans.push(old);
            }
        }
        Ok(rkeys)
    }

    /// The tenancies settled (by the peer's word or a revocation): their
    /// keys end now, before their slots can go back to the pool.
    pub(super) fn settled(&mut self, keys: &Arc<dyn TenancyKeys>, pool: PoolId, tenancies: &[Tenancy]) {
        for t in tenancies {
            if let Some((g, id)) = self.by_slot.get(&(pool, t.slot)).copied() {
                if g == t.generation {
                    self.by_slot.remove(&(pool, t.slot));
                    keys.revoke(id);
                }
            }
        }
    }

    /// The ladder's `Revoke`: ends the keys of `tenancies` (exposed to
    /// `peer` under the tokens given) and shadows their slots for that
    /// peer; returns the tenancies whose key is confirmed ended.
    pub(super) fn revoke(
        &mut self,
        keys: &Arc<dyn TenancyKeys>,
        pool: PoolId,
        peer: PeerId,
        tenancies: &[(Tenancy, ExposureToken)],
    ) -> Vec<Tenancy> {
        let mut confirmed = Vec::with_capacity(tenancies.len());
        let mut shadowed = Vec::with_capacity(tenancies.len());
        for (t, token) in tenancies {
            let Some((g, id)) = self.by_slot.get(&(pool, t.slot)).copied() else { continue };
            if g != t.generation {
                continue;
            }
            if keys.revoke(id) {
                self.by_slot.remove(&(pool, t.slot));
                confirmed.push(*t);
                shadowed.push((*t, *token));
            }
        }
        self.shadows.revoked(pool, peer, &shadowed);
        confirmed
    }

    /// A DONE or ABORT_ACK from `from`: clears the shadows it covers.
    pub(super) fn accept(&mut self, from: PeerId, msg: &ControlMessage) -> usize {
        self.shadows.accept(from, msg)
    }

    /// Slots kept away from a peer that may retry.
    pub(super) fn shadowed(&self) -> usize {
        self.shadows.len()
    }
}
