//! The data server's view of our exposures (Mooncake TCP has no key, so
//! the engine filters by address): a slot's range is opened when the slot
//! is exposed and closed before its settlement proof is delivered, so a
//! request by address reaches only slots exposed now ([`crate::exposed`]).

use kv_transfer_core::hash::HashMap;

use kv_transfer_core::{Generation, PoolId, SlotId, Tenancy};

use crate::engine::TransferEngine;
use crate::error::EngineError;
use crate::exposed::{RangeAccess, RangeId};

/// Open ranges by slot, with the tenancy they were opened for.
#[derive(Debug, Default)]
pub(super) struct OpenRanges {
    by_slot: HashMap<(PoolId, SlotId), (Generation, RangeId)>,
}

impl OpenRanges {
    /// Opens each slot (`(tenancy, addr, len)`) for remote READ and WRITE
    /// (core's exposures do not say which way the peer moves bytes). All or
    /// nothing: on a refusal the ranges opened here are closed again.
    pub(super) fn open(
        &mut self,
        engine: &dyn TransferEngine,
        pool: PoolId,
        slots: &[(Tenancy, u64, u64)],
    ) -> Result<(), EngineError> {
        for (t, _, _) in slots {
            if let Some((_, old)) = self.by_slot.remove(&(pool, t.slot)) {
                // Left open by the positive control, which frees a slot
                // without ending anything; a new tenancy starts clean.
                tracing::error!(slot = t.slot.0, "NAIVE POSITIVE CONTROL: an earlier tenancy's range was still open");
                engine.unexpose_range(old);
            }
        }
        let mut made = Vec::with_capacity(slots.len());
        for (t, addr, len) in slots {
            match engine.expose_range(*addr, *len, RangeAccess::ReadWrite) {
                Ok(Some(id)) => made.push((*t, id)),
                // The engine does not filter by exposure.
                Ok(None) => {}
                Err(e) => {
                    for (_, id) in made {
                        engine.unexpose_range(id);
                    }
                    return Err(e);
                }
            }
        }
        for (t, id) in made {
            self.by_slot.insert((pool, t.slot), (t.generation, id));
        }
        Ok(())
    }

    /// The tenancies settled (or are about to be, by any proof): their
    /// ranges close now, before the slots can go back to the pool. Returns
    /// those whose range a data request did not leave in time: they must
    /// not be released (fail closed: they stay quarantined).
    pub(super) fn close(&mut self, engine: &dyn TransferEngine, pool: PoolId, tenancies: &[Tenancy]) -> Vec<Tenancy> {
        let mut stuck = Vec::new();
        for t in tenancies {
            if let Some((g, id)) = self.by_slot.get(&(pool, t.slot)).copied() {
                if g == t.generation {
                    self.by_slot.remove(&(pool, t.slot));
                    if !engine.unexpose_range(id) {
                        tracing::error!(slot = t.slot.0, "a data request did not leave a closed exposure in time");
                        stuck.push(*t);
                    }
                }
            }
        }
        stuck
    }

    /// Ranges open now.
    pub(super) fn len(&self) -> usize {
        self.by_slot.len()
    }
}
