//! Descriptors and small value types shared by the engine, the transports and
//! the adapter.

use std::fmt;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::TransportError;
use crate::status::StatusCode;
use crate::util::lock;

/// A transfer id, allocated per initiating engine.
///
/// Full 64-bit width (MORI's type is 64-bit but its counter is 32-bit). The
/// allocator wraps with wrapping arithmetic; ids are only ever compared for
/// equality, keyed by `(remote engine, uid)`, never ordered.
pub type TransferUniqueId = u64;

/// The name of an engine, unique in a deployment (MORI's `EngineKey`).
///
/// The engine keys every transfer, notification and inbound status by it, so
/// it must be cheap to clone, hash and compare:
/// - a key of up to [`EngineKey::INLINE`] bytes (the usual case) is stored in
///   place and cloned by copy, with no allocation and no shared reference
///   count for the posting threads to contend on; a longer one is shared text
///   (`Arc<str>`);
/// - a fingerprint of the text, computed once, is what a hasher sees (one
///   `u64`), and what equality compares first.
///
/// Equality and order are those of the text, whatever the storage.
#[derive(Clone, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub struct EngineKey {
    fingerprint: u64,
    repr: KeyRepr,
}

#[derive(Clone)]
enum KeyRepr {
    Inline { len: u8, bytes: [u8; EngineKey::INLINE] },
    Shared(Arc<str>),
}

impl EngineKey {
    /// Longest key stored in place.
    pub const INLINE: usize = 22;

    /// Builds a key.
    pub fn new(key: impl AsRef<str>) -> Self {
        let key = key.as_ref();
        // FNV-1a: stable, and the same text always gives the same fingerprint.
        let fingerprint =
            key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        let repr = match u8::try_from(key.len()) {
            Ok(len) if key.len() <= Self::INLINE => {
                let mut bytes = [0u8; Self::INLINE];
                bytes[..key.len()].copy_from_slice(key.as_bytes());
                KeyRepr::Inline { len, bytes }
            }
            _ => KeyRepr::Shared(Arc::from(key)),
        };
        Self { fingerprint, repr }
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        match &self.repr {
            // Valid UTF-8: copied from a `str` in `new`.
            KeyRepr::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            KeyRepr::Shared(s) => s,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match &self.repr {
            KeyRepr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            KeyRepr::Shared(s) => s.as_bytes(),
        }
    }
}

impl PartialEq for EngineKey {
    fn eq(&self, other: &Self) -> bool {
        if self.fingerprint != other.fingerprint {
            return false;
        }
        match (&self.repr, &other.repr) {
            // Fixed-size compare (the bytes past `len` are zero).
            (KeyRepr::Inline { len: a, bytes: x }, KeyRepr::Inline { len: b, bytes: y }) => a == b && x == y,
            _ => self.as_bytes() == other.as_bytes(),
        }
    }
}

impl Eq for EngineKey {}

impl std::hash::Hash for EngineKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Equal keys have equal fingerprints.
        state.write_u64(self.fingerprint);
    }
}

impl PartialOrd for EngineKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for EngineKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Byte order is `str` order.
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl fmt::Debug for EngineKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for EngineKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for EngineKey {
    fn from(key: &str) -> Self {
        Self::new(key)
    }
}

impl From<String> for EngineKey {
    fn from(key: String) -> Self {
        Self::new(key)
    }
}

impl From<EngineKey> for String {
    fn from(key: EngineKey) -> Self {
        key.as_str().to_owned()
    }
}

/// What an engine publishes about itself, exchanged out of band (MORI's
/// `EngineDesc`). Serializable with any serde format.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineDesc {
    /// The engine's key.
    pub key: EngineKey,
    /// Host name of the machine.
    pub hostname: String,
    /// Out-of-band host address (MORI's `IOEngineConfig::host`).
    pub host: String,
    /// Out-of-band port.
    pub port: u16,
    /// Name of the transport under the engine (`"loopback"`, `"tcp-sim"`, `"rdma"`).
    pub transport: String,
    /// Opaque bytes the transport needs to reach this engine (listen address,
    /// GID and QP numbers, ...), produced by [`crate::MoriTransport::attach`].
    pub transport_info: Vec<u8>,
    /// First notification sequence number this engine sends to every peer; a
    /// target that registers this descriptor starts its window there.
    pub notif_seq_start: u32,
}

/// Id of a registered memory region, unique per engine.
pub type MemoryId = u32;

/// Where registered memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryLocation {
    /// Host memory.
    Cpu,
    /// GPU memory.
    Gpu,
}

/// What a registration returns and a peer needs to address the region
/// (MORI's `MemoryDesc`). Serializable; hand it to the peer out of band.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryDesc {
    /// The engine that registered the region.
    pub engine_key: EngineKey,
    /// Id of the region in that engine.
    pub id: MemoryId,
    /// Device index (`-1` for host memory).
    pub device_id: i32,
    /// Address of the first byte, as the owning process sees it.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// Host or GPU.
    pub loc: MemoryLocation,
    /// Transport access key for this registration (an rkey on verbs). A fresh
    /// registration gets a fresh key, so a stale descriptor is refused.
    pub rkey: u64,
}

/// Host memory owned by the crate: a fixed-size byte buffer that can be
/// registered, shared with a transport and read back.
///
/// The bytes sit behind a mutex, so the loopback transport copies them without
/// `unsafe`. Cloning shares the same bytes. The transport keeps a clone while
/// the region is registered, so the memory outlives every operation on it.
#[derive(Clone)]
pub struct HostBuffer {
    bytes: Arc<Mutex<Box<[u8]>>>,
    addr: u64,
    len: u64,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer").field("addr", &self.addr).field("len", &self.len).finish()
    }
}

impl HostBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        Self::from_vec(vec![0u8; len])
    }

    /// A buffer holding `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let bytes = bytes.into_boxed_slice();
        let addr = bytes.as_ptr() as usize as u64;
        let len = bytes.len() as u64;
        Self { bytes: Arc::new(Mutex::new(bytes)), addr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// `true` for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte (informative: descriptors carry it).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Copies `out.len()` bytes starting at `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), TransportError> {
        let bytes = lock(&self.bytes);
        let range = range_in(offset, out.len() as u64, bytes.len())?;
        out.copy_from_slice(&bytes[range]);
        Ok(())
    }

    /// Copies `data` into the buffer starting at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), TransportError> {
        let mut bytes = lock(&self.bytes);
        let range = range_in(offset, data.len() as u64, bytes.len())?;
        bytes[range].copy_from_slice(data);
        Ok(())
    }

    /// Sets every byte to `value`.
    pub fn fill(&self, value: u8) {
        lock(&self.bytes).fill(value);
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        lock(&self.bytes).to_vec()
    }

    /// `true` if both share the same bytes.
    pub fn same_as(&self, other: &HostBuffer) -> bool {
        Arc::ptr_eq(&self.bytes, &other.bytes)
    }
}

fn range_in(offset: u64, len: u64, total: usize) -> Result<std::ops::Range<usize>, TransportError> {
    let end = offset.checked_add(len).ok_or(TransportError::OutOfBounds)?;
    let start = usize::try_from(offset).map_err(|_| TransportError::OutOfBounds)?;
    let end = usize::try_from(end).map_err(|_| TransportError::OutOfBounds)?;
    if end > total {
        return Err(TransportError::OutOfBounds);
    }
    Ok(start..end)
}

#[derive(Clone, Debug)]
enum RegionKind {
    Host(HostBuffer),
    External {
        addr: u64,
        len: u64,
        loc: MemoryLocation,
        device_id: i32,
    },
    /// A core region reached only through its own copies (device memory).
    Core(std::sync::Arc<dyn kv_transfer_core::Region>),
}

/// Memory handed to [`crate::IoEngine::register_memory`]: an owned
/// [`HostBuffer`], or external memory known only by address (a GPU KV pool, a
/// host pool owned by the serving engine).
#[derive(Clone, Debug)]
pub struct MemoryRegion {
    kind: RegionKind,
    slot_size: Option<u64>,
    owner: Option<Owner>,
}

/// What keeps external memory allocated ([`MemoryRegion::with_owner`]).
#[derive(Clone)]
pub struct Owner(pub std::sync::Arc<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Owner(..)")
    }
}

impl MemoryRegion {
    /// Host memory owned by a [`HostBuffer`]. Every transport in this crate can use it.
    pub fn host(buffer: HostBuffer) -> Self {
        Self { kind: RegionKind::Host(buffer), slot_size: None, owner: None }
    }

    /// External memory by address: `len` bytes at `addr`, on the host or on GPU
    /// `device_id`.
    ///
    /// Nothing in this crate dereferences the address: the loopback transport
    /// refuses external regions (`GPU_OP` for GPU memory, `INVALID_ARGS` for
    /// host memory). A hardware transport registers it with the NIC.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must stay allocated and valid for the NIC to read and
    /// write until `deregister_memory` for this region returned `Ok`, and the
    /// caller must not access bytes an operation may touch while that
    /// operation's status is not terminal.
    pub unsafe fn external(addr: u64, len: u64, loc: MemoryLocation, device_id: i32) -> Self {
        Self { kind: RegionKind::External { addr, len, loc, device_id }, slot_size: None, owner: None }
    }

    /// A core region whose bytes a transport reaches only through
    /// [`Region::read`](kv_transfer_core::Region::read) and `write` (device
    /// memory: a GPU's, or core's fake device): safe, since no address of it
    /// is dereferenced. The simulator and the verbs software NIC copy
    /// through it; the loopback transport refuses it.
    pub fn of_region(region: std::sync::Arc<dyn kv_transfer_core::Region>) -> Self {
        Self { kind: RegionKind::Core(region), slot_size: None, owner: None }
    }

    /// The core region of [`MemoryRegion::of_region`], if this is one.
    pub fn core_region(&self) -> Option<&std::sync::Arc<dyn kv_transfer_core::Region>> {
        match &self.kind {
            RegionKind::Core(r) => Some(r),
            _ => None,
        }
    }

    /// Hands the registration something that keeps external memory
    /// allocated (the `Arc` of the region it lies in): a transport that binds
    /// the memory at its NIC keeps the owner for as long as the binding
    /// lives, so no order of dropping adapter, pool, engine and transport
    /// frees memory a NIC can still touch.
    pub fn with_owner(mut self, owner: std::sync::Arc<dyn std::any::Any + Send + Sync>) -> Self {
        self.owner = Some(Owner(owner));
        self
    }

    /// The owner given with [`MemoryRegion::with_owner`].
    pub fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    /// Declares that the region is carved into slots of `slot_size` bytes
    /// (the kv-transfer pool's slots). The engine ignores it; a transport that
    /// can bind access per slot and generation (the TCP simulator's) uses it.
    pub fn with_slot_size(mut self, slot_size: u64) -> Self {
        self.slot_size = Some(slot_size);
        self
    }

    /// The slot size declared with [`MemoryRegion::with_slot_size`].
    pub fn slot_size(&self) -> Option<u64> {
        self.slot_size
    }

    /// The owned host buffer, if this is one.
    pub fn host_buffer(&self) -> Option<&HostBuffer> {
        match &self.kind {
            RegionKind::Host(buffer) => Some(buffer),
            RegionKind::External { .. } | RegionKind::Core(_) => None,
        }
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        match &self.kind {
            RegionKind::Host(buffer) => buffer.addr(),
            RegionKind::External { addr, .. } => *addr,
            RegionKind::Core(r) => r.addr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match &self.kind {
            RegionKind::Host(buffer) => buffer.len(),
            RegionKind::External { len, .. } => *len,
            RegionKind::Core(r) => r.len() as u64,
        }
    }

    /// `true` for a zero-length region (registration refuses it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Host or GPU.
    pub fn location(&self) -> MemoryLocation {
        match &self.kind {
            RegionKind::Host(_) => MemoryLocation::Cpu,
            RegionKind::External { loc, .. } => *loc,
            RegionKind::Core(r) => match r.kind() {
                kv_transfer_core::MemoryKind::Host => MemoryLocation::Cpu,
                _ => MemoryLocation::Gpu,
            },
        }
    }

    /// Device index (`-1` for host memory).
    pub fn device_id(&self) -> i32 {
        match &self.kind {
            RegionKind::Host(_) => -1,
            RegionKind::External { device_id, .. } => *device_id,
            RegionKind::Core(r) => match r.kind() {
                kv_transfer_core::MemoryKind::Device { ordinal } => i32::try_from(ordinal).unwrap_or(-1),
                _ => -1,
            },
        }
    }
}

/// An opaque pair of `u64` the caller attaches to a transfer; it comes back in
/// the target's [`InboundStatus`]. The engine never interprets it. The
/// kv-transfer adapter puts a slot id and its generation there.
///
/// The tag also travels with every [`crate::WorkRequest`], so a transport
/// that checks access per slot and generation (the TCP simulator's) can name
/// them: by convention the low 32 bits of `slot` are the remote slot index and
/// `generation` is its generation; the high bits of `slot` are the caller's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tag {
    /// First word (the adapter: slot or lease id).
    pub slot: u64,
    /// Second word (the adapter: generation).
    pub generation: u64,
}

impl Tag {
    /// Builds a tag.
    pub const fn new(slot: u64, generation: u64) -> Self {
        Self { slot, generation }
    }
}

/// One contiguous piece of a transfer: `size` bytes between `local_offset` in
/// the local region and `remote_offset` in the remote region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Segment {
    /// Offset in the local region.
    pub local_offset: u64,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Bytes; must be non-zero.
    pub size: u64,
}

impl Segment {
    /// Builds a segment.
    pub const fn new(local_offset: u64, remote_offset: u64, size: u64) -> Self {
        Self { local_offset, remote_offset, size }
    }
}

/// One transfer of a batch call: one status, one uid, one tag, one or more
/// segments between one local and one remote region (MORI's batch calls take
/// the same shape as parallel vectors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchRequest {
    /// Local region.
    pub local: MemoryDesc,
    /// Remote region.
    pub remote: MemoryDesc,
    /// Pieces to move; must not be empty.
    pub segments: Vec<Segment>,
    /// Transfer id (from `allocate_transfer_unique_id`).
    pub uid: TransferUniqueId,
    /// Caller's tag, delivered to the target.
    pub tag: Tag,
}

/// What the target learns about a transfer another engine ran against its
/// memory, popped with [`crate::IoEngine::pop_inbound_status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboundStatus {
    /// The initiating engine.
    pub remote: EngineKey,
    /// The initiator's transfer id.
    pub uid: TransferUniqueId,
    /// Terminal code the initiator observed (`SUCCESS` or an error; a code this
    /// crate does not know arrives as [`StatusCode::Unknown`]).
    pub code: StatusCode,
    /// The initiator's message (empty on success).
    pub message: String,
    /// The initiator's tag.
    pub tag: Tag,
    /// Notification sequence number (per initiator and target, wrapping `u32`).
    pub seq: u32,
}

#[cfg(test)]
mod tests {
    use super::EngineKey;
    use std::collections::HashSet;

    /// Short keys live in place, long ones are shared; either way equality,
    /// hashing, order and the serialized form are those of the text.
    #[test]
    fn engine_keys_behave_as_their_text() {
        let long = "k".repeat(EngineKey::INLINE + 1);
        let texts = ["", "a", "b", "prefill-0", "prefill-1", &"x".repeat(EngineKey::INLINE), &long, "k"];
        let keys: Vec<EngineKey> = texts.iter().map(EngineKey::new).collect();
        for (a, ka) in texts.iter().zip(&keys) {
            assert_eq!(ka.as_str(), *a);
            assert_eq!(ka.to_string(), *a);
            assert_eq!(format!("{ka:?}"), format!("{a:?}"));
            assert_eq!(ka.clone(), *ka);
            let json = serde_json::to_string(ka).unwrap();
            assert_eq!(json, serde_json::to_string(a).unwrap());
            assert_eq!(serde_json::from_str::<EngineKey>(&json).unwrap(), *ka);
            for (b, kb) in texts.iter().zip(&keys) {
                assert_eq!(ka == kb, a == b, "{a:?} vs {b:?}");
                assert_eq!(ka.cmp(kb), a.cmp(b), "{a:?} vs {b:?}");
            }
        }
        let set: HashSet<EngineKey> = keys.iter().cloned().chain(texts.iter().map(EngineKey::new)).collect();
        assert_eq!(set.len(), texts.len());
        assert!(set.contains(&EngineKey::from(long.clone())));
    }
}
