//! What a peer needs to reach exposed slots.

use crate::ids::{Generation, PoolId, SlotId, Tenancy};
use serde::{Deserialize, Serialize};

/// One exposed slot as a peer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteSlot {
    /// The slot.
    pub slot: SlotId,
    /// Its generation for this tenancy: every write, notification and ack
    /// that concerns the slot carries it back.
    pub generation: Generation,
    /// Its address as the exposing side's NIC sees it.
    pub addr: u64,
    /// This slot's own access key, where the backend keys each slot (the
    /// verbs backend: the rkey of the memory window bound over this slot for
    /// this tenancy); `None`: [`RemoteSlots::key`] covers it.
    #[serde(default)]
    pub key: Option<u64>,
}

impl RemoteSlot {
    /// The tenancy this slot names.
    pub fn tenancy(&self) -> Tenancy {
        Tenancy::new(self.slot, self.generation)
    }
}

/// Descriptor of slots exposed to a peer: address, length, key and
/// generation of each. Serializable, to travel in whatever control message
/// the serving engine uses.
///
/// ```
/// # use kv_transfer_core::*;
/// # use std::sync::Arc;
/// let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(1024)).unwrap();
/// let (_exposed, remote) = authority.expose(pool.reserve(2).unwrap(), PeerId(1), 42, "decode-0", Default::default());
/// let json = serde_json::to_string(&remote).unwrap();
/// let back: RemoteSlots = serde_json::from_str(&json).unwrap();
/// assert_eq!(back, remote);
/// assert_eq!(back.len_bytes(), Some(2048));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSlots {
    /// How the peer reaches the exposing side (backend-specific: an address,
    /// an agent name, a segment name).
    pub endpoint: String,
    /// The exposing pool.
    pub pool: PoolId,
    /// Access key for the slots (an rkey, a registration key).
    pub key: u64,
    /// Bytes per slot.
    pub slot_size: u64,
    /// Where the slots live (host memory, or a device's: NIXL types its
    /// transfers by it). Absent in a descriptor from an older peer: host.
    #[serde(default)]
    pub memory: crate::MemoryKind,
    /// The exposure's unguessable token: a DONE or ABORT_ACK for these
    /// tenancies settles them only if it carries it (DESIGN rule 8). Keep it
    /// as secret as the data.
    #[serde(default)]
    pub token: crate::drain::ExposureToken,
    /// The slots, in the exposing lease's order.
    pub slots: Vec<RemoteSlot>,
}

impl RemoteSlots {
    /// The tenancies described.
    pub fn tenancies(&self) -> Vec<Tenancy> {
        self.slots.iter().map(RemoteSlot::tenancy).collect()
    }
    /// The access key of the `i`-th slot: its own, or the exposure's.
    pub fn key_of(&self, i: usize) -> u64 {
        self.slots.get(i).and_then(|s| s.key).unwrap_or(self.key)
    }
    /// Total bytes described; `None` if a peer-supplied size overflows.
    pub fn len_bytes(&self) -> Option<u64> {
        self.slot_size.checked_mul(self.slots.len() as u64)
    }
}
