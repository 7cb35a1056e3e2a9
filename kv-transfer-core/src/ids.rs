//! Names for slots, tenancies, peers and pools.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of one fixed-size slot inside a pool's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SlotId(pub u32);

/// Tenancy counter of a slot. Bumped every time the slot is leased, so
/// `(SlotId, Generation)` names exactly one tenancy and never repeats: at one
/// lease per nanosecond a `u64` lasts five centuries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u64);

/// One tenancy of one slot: the unit every descriptor, write, notification,
/// ack and proof names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Tenancy {
    /// The slot.
    pub slot: SlotId,
    /// Its generation for this tenancy.
    pub generation: Generation,
}

impl Tenancy {
    /// A tenancy from its parts.
    pub const fn new(slot: SlotId, generation: Generation) -> Self {
        Self { slot, generation }
    }
}

impl fmt::Display for Tenancy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {}@gen {}", self.slot.0, self.generation.0)
    }
}

/// A peer as the backend numbers it (a connection, an agent, an engine).
/// Exposures are recorded per peer so that a fence settles them all at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PeerId(pub u32);

/// Identity of one [`SlotPool`](crate::SlotPool). Proofs carry it, so a proof
/// minted for one pool cannot settle another's slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PoolId(pub u64);
