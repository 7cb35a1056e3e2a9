//! Plain data types shared by the raw wrappers, the trait and its mocks.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::error::EngineError;

/// A hasher for small integer keys (request and operation ids, counters): one
/// multiply per word instead of SipHash, for the tables on the post path. Not
/// for keys an attacker chooses.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: spreads sequential ids over the high bits too.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A `HashMap` keyed by small integer ids, hashed with [`IdHasher`].
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The memory a descriptor list names (`nixl_capi_mem_type_t`); a list
/// holds one type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MemType {
    /// Host memory (`NIXL_CAPI_MEM_DRAM` = 0).
    #[default]
    Dram,
    /// GPU memory (`NIXL_CAPI_MEM_VRAM` = 1); the descriptor's `dev_id` is
    /// the CUDA device.
    Vram,
}

/// One contiguous range of host or GPU memory: a registration or transfer
/// descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemRegion {
    /// Start address (in the owning process; a device pointer for VRAM).
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Device id; 0 for host memory. Remote descriptors must carry the id the peer
    /// registered with.
    pub dev_id: u64,
    /// Host or GPU memory.
    pub mem: MemType,
}

impl MemRegion {
    /// A host region with device id 0.
    pub fn new(addr: usize, len: usize) -> Self {
        Self { addr, len, dev_id: 0, mem: MemType::Dram }
    }
    /// A range of GPU `device`'s memory.
    pub fn vram(addr: usize, len: usize, device: u32) -> Self {
        Self { addr, len, dev_id: u64::from(device), mem: MemType::Vram }
    }
    /// The descriptor of a whole region: DRAM for host memory, VRAM of its
    /// device for a CUDA device's; `None` for memory NIXL cannot register
    /// (core's fake device, which only staging through its copies reaches).
    pub fn of(r: &dyn kv_transfer_core::Region) -> Option<Self> {
        use kv_transfer_core::MemoryKind;
        match r.kind() {
            MemoryKind::Host => r.host_ptr().map(|_| Self::new(r.addr() as usize, r.len())),
            MemoryKind::FAKE_DEVICE => None,
            MemoryKind::Device { ordinal } => Some(Self::vram(r.addr() as usize, r.len(), ordinal)),
            _ => None,
        }
    }
    /// This range as the same kind of memory at another address and length.
    pub fn like(self, addr: usize, len: usize) -> Self {
        Self { addr, len, ..self }
    }
}

/// The one memory type of a descriptor list; `None` for an empty or mixed list.
pub(crate) fn list_mem_type(regions: &[MemRegion]) -> Option<MemType> {
    let first = regions.first()?.mem;
    regions.iter().all(|r| r.mem == first).then_some(first)
}

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferOp {
    /// Pull: remote to local (`NIXL_CAPI_XFER_OP_READ` = 0).
    Read,
    /// Push: local to remote (`NIXL_CAPI_XFER_OP_WRITE` = 1).
    Write,
}

/// What one transfer request moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XferSpec {
    /// Read or write.
    pub op: XferOp,
    /// Local descriptors (inside memory registered with this engine).
    pub local: Vec<MemRegion>,
    /// Remote descriptors (inside memory the peer registered), paired one to one
    /// with `local`, same lengths.
    pub remote: Vec<MemRegion>,
    /// The peer's agent name, as returned by `load_remote_metadata`.
    pub remote_agent: String,
    /// A notification the peer receives once all the data has landed (only if
    /// the request reaches `Done` while being polled; a request released early
    /// never sends it).
    pub notif: Option<Vec<u8>>,
}

/// One notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Notification {
    /// The sender's agent name.
    pub agent: String,
    /// The message bytes, copied out of NIXL's map.
    pub msg: Vec<u8>,
}

/// Checks a descriptor pairing before any C call: non-empty, same count, non-zero
/// and equal lengths pairwise, non-null addresses.
pub fn validate_descs(local: &[MemRegion], remote: &[MemRegion]) -> Result<(), EngineError> {
    if local.is_empty() {
        return Err(EngineError::InvalidArgument("no descriptors".into()));
    }
    if local.len() != remote.len() {
        return Err(EngineError::InvalidArgument(format!(
            "{} local descriptors but {} remote",
            local.len(),
            remote.len()
        )));
    }
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        if l.len == 0 || l.addr == 0 || r.addr == 0 {
            return Err(EngineError::InvalidArgument(format!("descriptor {i} is empty or null")));
        }
        if l.len != r.len {
            return Err(EngineError::InvalidArgument(format!(
                "descriptor {i}: local length {} != remote length {}",
                l.len, r.len
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        let a = MemRegion::new(0x1000, 64);
        let b = MemRegion::new(0x2000, 64);
        assert!(validate_descs(&[a], &[b]).is_ok());
        assert!(validate_descs(&[], &[]).is_err());
        assert!(validate_descs(&[a], &[b, b]).is_err());
        assert!(validate_descs(&[a], &[MemRegion::new(0x2000, 32)]).is_err());
        assert!(validate_descs(&[MemRegion::new(0, 64)], &[b]).is_err());
        assert!(validate_descs(&[MemRegion::new(0x1000, 0)], &[MemRegion::new(0x2000, 0)]).is_err());
    }
}
