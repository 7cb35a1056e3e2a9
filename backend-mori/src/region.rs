//! Registered memory as a core [`Region`]: what a NIC that takes a core
//! region (the simulator's, or a verbs engine's) binds for a MORI memory
//! registration. Shared by the simulated and the verbs transports.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use kv_transfer_core::{MemoryKind, Region, RegionError};

use crate::error::TransportError;
use crate::types::{HostBuffer, MemoryRegion};

/// The memory a shadow pool is carved from: the caller's memory by address
/// (external host memory) or a [`HostBuffer`].
enum Mem {
    /// External memory by address, with what keeps it allocated (the
    /// registration's owner): the simulated NIC binds this memory for good,
    /// so it must outlive every adapter and pool.
    External {
        addr: u64,
        len: usize,
        _owner: Option<crate::types::Owner>,
    },
    Host(HostBuffer),
    /// A core region reached through its own copies (device memory).
    Core(Arc<dyn Region>),
}

/// Registered memory as a core [`Region`], for a NIC that takes one (the
/// simulator's, or a verbs engine's).
pub(crate) struct SimMem(Mem);

impl fmt::Debug for SimMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimMem").field("addr", &self.addr()).field("len", &self.len()).finish()
    }
}

impl SimMem {
    /// The host memory of `region` (and its length).
    pub(crate) fn of(region: &MemoryRegion) -> Result<(Arc<Self>, usize), TransportError> {
        let len = usize::try_from(region.len()).map_err(|_| TransportError::OutOfBounds)?;
        let mem = match (region.host_buffer(), region.core_region()) {
            (Some(b), _) => Mem::Host(b.clone()),
            (None, Some(r)) => Mem::Core(r.clone()),
            (None, None) => Mem::External { addr: region.addr(), len, _owner: region.owner().cloned() },
        };
        Ok((Arc::new(SimMem(mem)), len))
    }

    pub(crate) fn check(&self, offset: usize, len: usize) -> Result<(), RegionError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(RegionError::OutOfBounds { offset, len, region_len: self.len() }),
        }
    }
}

impl Region for SimMem {
    fn kind(&self) -> MemoryKind {
        match &self.0 {
            Mem::Core(r) => r.kind(),
            _ => MemoryKind::Host,
        }
    }
    fn addr(&self) -> u64 {
        match &self.0 {
            Mem::External { addr, .. } => *addr,
            Mem::Host(b) => b.addr(),
            Mem::Core(r) => r.addr(),
        }
    }
    fn len(&self) -> usize {
        match &self.0 {
            Mem::External { len, .. } => *len,
            Mem::Host(b) => b.len() as usize,
            Mem::Core(r) => r.len(),
        }
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        self.check(offset, dst.len())?;
        match &self.0 {
            Mem::External { addr, .. } => {
                // SAFETY: in bounds (checked); `MemoryRegion::external`'s
                // contract keeps the memory valid while it is registered, and
                // registration outlives every access through this transport.
                unsafe {
                    std::ptr::copy_nonoverlapping((*addr as usize + offset) as *const u8, dst.as_mut_ptr(), dst.len())
                }
                Ok(())
            }
            Mem::Host(b) => b.read_at(offset as u64, dst).map_err(|e| RegionError::Access(e.to_string())),
            Mem::Core(r) => r.read(offset, dst),
        }
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        self.check(offset, src.len())?;
        match &self.0 {
            Mem::External { addr, .. } => {
                // SAFETY: see `read`.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (*addr as usize + offset) as *mut u8, src.len()) }
                Ok(())
            }
            Mem::Host(b) => b.write_at(offset as u64, src).map_err(|e| RegionError::Access(e.to_string())),
            Mem::Core(r) => r.write(offset, src),
        }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        match &self.0 {
            Mem::External { addr, .. } => NonNull::new(*addr as usize as *mut u8),
            Mem::Host(_) => None,
            Mem::Core(r) => r.host_ptr(),
        }
    }
    fn dmabuf(&self) -> Option<Result<std::os::fd::OwnedFd, RegionError>> {
        match &self.0 {
            Mem::Core(r) => r.dmabuf(),
            _ => None,
        }
    }
}
