//! Registered memory: raw `(addr, len)` ranges the caller promises stay valid.
//!
//! # Safety contract
//!
//! A [`MemoryRegion`] is created with the `unsafe` [`MemoryRegion::new`]. By
//! calling it the caller promises that, from registration until
//! [`crate::TransferEngine::unregister_memory`] returns `Ok`, the range
//! `[addr, addr+len)` is mapped, readable and writable, and not freed or
//! remapped. Bytes in it may be written at any time by remote peers (target
//! side) or by this engine's READs (initiator side), so the caller must not
//! hold Rust references (`&`/`&mut`) to those bytes while transfers may run;
//! access them through raw pointers or only after the transfers touching them
//! are finished. Concurrent transfers that overlap the same bytes race, as they
//! would on a NIC.
//!
//! Device memory (a GPU's, or core's faulting `FakeDeviceRegion`) is
//! registered with the safe [`MemoryRegion::staged`]: the engine never
//! dereferences its addresses, it moves the bytes through the region's own
//! copies, staged in a host buffer, and a WRITE into it is acknowledged only
//! after the copy into the region finished. Only the TCP transport can stage.
//!
//! The engine only ever touches memory inside a registered region, and
//! `unregister_memory` refuses ([`crate::EngineError::RegionBusy`]) while any
//! local task or remote request holds the region, so a successful unregister
//! means no engine thread can touch it any more.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use kv_transfer_core::{with_staging_buffer as with_staging, Region};

use crate::error::EngineError;

/// A range of memory the caller vouches for, or a region whose bytes move
/// through its own copies (see the module docs).
#[derive(Debug, Clone)]
pub struct MemoryRegion {
    addr: u64,
    len: u64,
    staging: Option<Arc<dyn Region>>,
}

impl MemoryRegion {
    /// Vouches for `[addr, addr+len)`.
    ///
    /// # Safety
    ///
    /// The range must stay mapped, readable and writable, and must not be
    /// freed, until it is unregistered successfully (or the engine is
    /// dropped), and the caller must not hold Rust references into it while
    /// transfers may touch it. See the module documentation.
    pub unsafe fn new(addr: u64, len: u64) -> Self {
        Self { addr, len, staging: None }
    }
    /// `region`, whose bytes the engine moves only through
    /// [`Region::read`] / [`Region::write`] (device memory): safe, since no
    /// address of it is ever dereferenced.
    pub fn staged(region: Arc<dyn Region>) -> Self {
        Self { addr: region.addr(), len: region.len() as u64, staging: Some(region) }
    }
    /// Whether its bytes move through the region's copies.
    pub fn is_staged(&self) -> bool {
        self.staging.is_some()
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the length is zero (such a region is rejected at registration).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Debug)]
struct Entry {
    addr: u64,
    len: u64,
    inflight: AtomicUsize,
    /// Device memory: copies go through it, the address is never dereferenced.
    staging: Option<Arc<dyn Region>>,
}

/// Registered regions, with an in-flight count per region.
#[derive(Debug, Default)]
pub struct MemoryRegistry {
    map: RwLock<BTreeMap<u64, Arc<Entry>>>,
}

/// A hold on a registered region for the duration of one transfer; while any
/// guard exists the region cannot be unregistered.
#[derive(Debug)]
pub struct RegionGuard {
    entry: Arc<Entry>,
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        self.entry.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl RegionGuard {
    /// Start of the held region.
    pub fn region_addr(&self) -> u64 {
        self.entry.addr
    }

    /// Raw pointer to `addr` after checking `[addr, addr+len)` lies in the
    /// held region; `None` otherwise, and for staged (device) memory, whose
    /// addresses the CPU must not dereference.
    pub fn ptr(&self, addr: u64, len: u64) -> Option<*mut u8> {
        self.offset(addr, len)?;
        self.entry.staging.is_none().then_some(addr as usize as *mut u8)
    }

    /// Offset of `addr` in the held region, if `[addr, addr+len)` lies in it.
    fn offset(&self, addr: u64, len: u64) -> Option<usize> {
        let end = addr.checked_add(len)?;
        if addr < self.entry.addr || end > self.entry.addr + self.entry.len {
            return None;
        }
        usize::try_from(addr - self.entry.addr).ok()
    }

    /// Hands `f` the bytes of `[addr, addr+len)`: in place for host memory,
    /// a staged copy for device memory. `None`: outside the region, or the
    /// device copy failed.
    ///
    /// # Safety
    /// No one may write these bytes while `f` runs (the caller's registration
    /// contract plus the engine's own single writer per request).
    pub(crate) unsafe fn with_bytes<R>(&self, addr: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let off = self.offset(addr, len)?;
        let n = usize::try_from(len).ok()?;
        match &self.entry.staging {
            // SAFETY: inside a registered region (valid per the registration
            // contract) and the guard keeps the registration alive.
            None => Some(f(unsafe { std::slice::from_raw_parts(addr as usize as *const u8, n) })),
            Some(region) => with_staging(n, |buf| region.read(off, buf).ok().map(|()| f(buf))),
        }
    }

    /// Lets `fill` write `[addr, addr+len)`: in place for host memory; for
    /// device memory into a host buffer, copied into the region only after
    /// `fill` succeeded, so a completion follows the device copy. `None`:
    /// outside the region.
    ///
    /// # Safety
    /// As [`RegionGuard::with_bytes`], and no other access to these bytes may
    /// happen while `fill` runs.
    pub(crate) unsafe fn fill(
        &self,
        addr: u64,
        len: u64,
        fill: impl FnOnce(&mut [u8]) -> std::io::Result<()>,
    ) -> Option<std::io::Result<()>> {
        let off = self.offset(addr, len)?;
        let n = usize::try_from(len).ok()?;
        Some(match &self.entry.staging {
            // SAFETY: as in `with_bytes`; exclusivity is the caller's obligation.
            None => fill(unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, n) }),
            Some(region) => with_staging(n, |buf| {
                fill(buf)?;
                region.write(off, buf).map_err(std::io::Error::other)
            }),
        })
    }
}

impl MemoryRegistry {
    /// Registers a region. Zero length, wrap-around and overlap are rejected.
    pub fn register(&self, r: MemoryRegion) -> Result<(), EngineError> {
        let MemoryRegion { addr, len, staging } = r;
        let end = addr.checked_add(len);
        if len == 0 || addr == 0 || end.is_none() || usize::try_from(len).is_err() {
            return Err(EngineError::InvalidRegion { addr, len });
        }
        let end = end.unwrap_or(u64::MAX);
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        let prev_overlaps = map.range(..end).next_back().is_some_and(|(_, e)| e.addr + e.len > addr);
        if prev_overlaps {
            return Err(EngineError::RegionOverlap { addr, len });
        }
        map.insert(addr, Arc::new(Entry { addr, len, inflight: AtomicUsize::new(0), staging }));
        tracing::debug!(addr, len, "registered memory");
        Ok(())
    }

    /// Unregisters the region starting at `addr`; refused while in flight.
    pub fn unregister(&self, addr: u64) -> Result<(), EngineError> {
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        let e = map.get(&addr).ok_or(EngineError::RegionNotRegistered(addr))?;
        let inflight = e.inflight.load(Ordering::Acquire);
        if inflight > 0 {
            return Err(EngineError::RegionBusy { addr, inflight });
        }
        map.remove(&addr);
        tracing::debug!(addr, "unregistered memory");
        Ok(())
    }

    /// Holds the region containing `[addr, addr+len)`, if one does and `len > 0`.
    pub fn acquire(&self, addr: u64, len: u64) -> Option<RegionGuard> {
        if len == 0 {
            return None;
        }
        let end = addr.checked_add(len)?;
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        let (_, e) = map.range(..=addr).next_back()?;
        if end > e.addr + e.len {
            return None;
        }
        // Incremented under the read lock: unregister (write lock) sees it.
        e.inflight.fetch_add(1, Ordering::AcqRel);
        Some(RegionGuard { entry: e.clone() })
    }

    /// Snapshot of registered regions as `(addr, len)`.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.values().map(|e| (e.addr, e.len)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(a: u64, l: u64) -> MemoryRegion {
        // SAFETY: these tests never dereference the ranges.
        unsafe { MemoryRegion::new(a, l) }
    }

    #[test]
    fn register_rules() {
        let m = MemoryRegistry::default();
        assert!(matches!(m.register(r(100, 0)), Err(EngineError::InvalidRegion { .. })));
        assert!(matches!(m.register(r(u64::MAX, 2)), Err(EngineError::InvalidRegion { .. })));
        m.register(r(100, 100)).unwrap();
        for (a, l) in [(100, 1), (50, 51), (199, 10), (0x10, 1000), (150, 1)] {
            assert!(m.register(r(a, l)).is_err(), "{a} {l}");
        }
        m.register(r(200, 10)).unwrap();
        m.register(r(50, 50)).unwrap();
        assert!(m.acquire(150, 50).is_some());
        assert!(m.acquire(150, 51).is_none());
        assert!(m.acquire(150, 0).is_none());
        let g = m.acquire(200, 10).unwrap();
        assert!(matches!(m.unregister(200), Err(EngineError::RegionBusy { inflight: 1, .. })));
        drop(g);
        m.unregister(200).unwrap();
        assert!(matches!(m.unregister(200), Err(EngineError::RegionNotRegistered(200))));
        assert!(m.acquire(200, 1).is_none());
    }
}
