//! A region over memory the caller owns (a torch tensor, a numpy array, an
//! mmap): the pointer and length Python hands over, and the object that owns
//! the memory, kept alive for as long as any pool, lease or in-flight
//! operation holds the region.

use kv_transfer_core::{MemoryKind, Region, RegionError};
use pyo3::prelude::*;
use std::fmt;
use std::ptr::NonNull;

/// Host memory at `addr..addr + len`, owned by a Python object.
pub struct ForeignRegion {
    ptr: NonNull<u8>,
    len: usize,
    /// What owns the memory (e.g. the tensor whose `data_ptr()` this is).
    /// Dropped without the GIL, PyO3 defers the decref to the next holder of
    /// the GIL: the memory outlives every Rust user of the region.
    _owner: Option<Py<PyAny>>,
}

// SAFETY: the region is plain host memory; concurrent access by a NIC is
// what the pool's leases rule out (as for `HostRegion`). `Py<PyAny>` is Send
// and Sync.
unsafe impl Send for ForeignRegion {}
// SAFETY: as above.
unsafe impl Sync for ForeignRegion {}

impl ForeignRegion {
    /// A region over `len` bytes at `addr`, kept alive by `owner`.
    ///
    /// The caller (Python) vouches that the memory is valid host memory for
    /// `len` bytes while `owner` lives, the same promise `ctypes` and
    /// `torch.from_blob` take. Refused: a null address, zero length, or a
    /// range that wraps the address space.
    pub fn new(addr: usize, len: usize, owner: Option<Py<PyAny>>) -> Result<Self, String> {
        let ptr = NonNull::new(addr as *mut u8).ok_or("the buffer's address is null")?;
        if len == 0 {
            return Err("the buffer is empty".into());
        }
        if addr.checked_add(len).is_none() {
            return Err(format!("the buffer {addr:#x} + {len} B wraps the address space"));
        }
        Ok(Self { ptr, len, _owner: owner })
    }
}

impl fmt::Debug for ForeignRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

/// The region of `len` bytes at `addr`, owned by `owner`: device memory of
/// CUDA device `device` (checked with the driver), or, with `device` `None`,
/// of whatever device the driver says `addr` is on, host memory if none.
/// Device memory needs the package built with the feature `cuda`.
pub fn foreign(
    addr: usize,
    len: usize,
    owner: Option<Py<PyAny>>,
    device: Option<u32>,
) -> Result<std::sync::Arc<dyn Region>, RegionFailure> {
    #[cfg(feature = "cuda")]
    {
        if let Some(ordinal) = device.or_else(|| kv_transfer_core::cuda_device_of(addr as u64)) {
            let owner: Box<dyn std::any::Any + Send + Sync> = match owner {
                Some(o) => Box::new(o),
                None => Box::new(()),
            };
            return kv_transfer_core::CudaRegion::borrowed(ordinal, addr as u64, len, owner)
                .map(|r| std::sync::Arc::new(r) as std::sync::Arc<dyn Region>)
                .map_err(|e| RegionFailure::Device(e.to_string()));
        }
    }
    #[cfg(not(feature = "cuda"))]
    if let Some(ordinal) = device {
        return Err(RegionFailure::Device(format!(
            "CUDA device {ordinal}: this build of kv_transfer has no CUDA support (build it with the feature `cuda`)"
        )));
    }
    Ok(std::sync::Arc::new(ForeignRegion::new(addr, len, owner).map_err(RegionFailure::Buffer)?))
}

/// Why a buffer could not become a region.
#[derive(Debug)]
pub enum RegionFailure {
    /// The buffer itself is unusable (null, empty, wrapping).
    Buffer(String),
    /// Device memory that this build or host cannot reach.
    Device(String),
}

fn check(offset: usize, len: usize, region_len: usize) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionError::OutOfBounds { offset, len, region_len }),
    }
}

impl Region for ForeignRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        check(offset, dst.len(), self.len)?;
        // SAFETY: in bounds (checked); the memory is valid while `_owner` lives
        // (the constructor's promise); `dst` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) }
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        check(offset, src.len(), self.len)?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) }
        Ok(())
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }
}
