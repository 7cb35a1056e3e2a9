//! How a remote tenancy and a remote memory travel: the [`Tag`] of a
//! transfer (settle flag, memory id, slot, generation) and the endpoint
//! string of the [`RemoteSlots`] this adapter hands out. Both sides of the
//! adapter decode what the other encoded, so the formats live together.

#[cfg(doc)]
use kv_transfer_core::RemoteSlots;
use kv_transfer_core::{Generation, SlotId, Tenancy};

use crate::types::{EngineKey, MemoryDesc, MemoryLocation, Tag};

pub(super) const TAG_SETTLE: u64 = 1 << 63;

/// The tag of a transfer aimed at remote tenancy `t` of memory `mem`:
/// `slot` = settle flag (bit 63) | memory id (bits 32..63) | slot index; the
/// generation as is.
pub(crate) fn pack_tag(mem: u32, t: Tenancy, settle: bool) -> Tag {
    let flag = if settle { TAG_SETTLE } else { 0 };
    Tag::new(flag | (u64::from(mem & 0x7FFF_FFFF) << 32) | u64::from(t.slot.0), t.generation.0)
}

/// `(settle, memory id, tenancy)` of a tag.
pub(super) fn unpack_tag(tag: Tag) -> (bool, u32, Tenancy) {
    let settle = tag.slot & TAG_SETTLE != 0;
    let mem = ((tag.slot >> 32) & 0x7FFF_FFFF) as u32;
    (settle, mem, Tenancy::new(SlotId((tag.slot & 0xFFFF_FFFF) as u32), Generation(tag.generation)))
}

/// The endpoint string of [`RemoteSlots`] made by this adapter: what the
/// initiator needs to rebuild the target's [`MemoryDesc`] (the key travels
/// in [`RemoteSlots::key`]).
pub(super) fn encode_endpoint(d: &MemoryDesc) -> String {
    let loc = match d.loc {
        MemoryLocation::Cpu => "cpu",
        MemoryLocation::Gpu => "gpu",
    };
    format!("mori:{}/{}/{}/{}/{}/{}", d.engine_key, d.id, d.addr, d.size, d.device_id, loc)
}

pub(super) fn decode_endpoint(s: &str, rkey: u64) -> Option<MemoryDesc> {
    let s = s.strip_prefix("mori:")?;
    let mut it = s.rsplitn(6, '/');
    let loc = match it.next()? {
        "cpu" => MemoryLocation::Cpu,
        "gpu" => MemoryLocation::Gpu,
        _ => return None,
    };
    let device_id = it.next()?.parse().ok()?;
    let size = it.next()?.parse().ok()?;
    let addr = it.next()?.parse().ok()?;
    let id = it.next()?.parse().ok()?;
    let key = it.next()?;
    if key.is_empty() {
        return None;
    }
    Some(MemoryDesc { engine_key: EngineKey::new(key), id, device_id, addr, size, loc, rkey })
}
