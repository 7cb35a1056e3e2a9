//! Registered memory that slots are carved from.
//!
//! A pool does not care where its bytes live: host memory ([`HostRegion`]),
//! a GPU's memory ([`CudaRegion`], feature `cuda`) or device-like memory that
//! faults on the CPU ([`FakeDeviceRegion`], feature `fake-device`, for tests
//! on hosts without a GPU). It needs the address a NIC uses, the length, and
//! a way to copy bytes in and out for the application's own reads and writes.
//! Everything else (registration keys, memory windows) belongs to the
//! backend.
//!
//! The rule for device memory: a slot's address is never dereferenced on the
//! CPU. Every read of a slot's bytes (a consumer's read, a digest check, a
//! socket backend's staging) goes through [`Region::read`] / [`Region::write`].

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
mod cuda;
#[cfg(all(feature = "fake-device", target_os = "linux"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fake-device")))]
mod fake_device;
mod memory;

#[cfg(feature = "cuda")]
pub use cuda::{cuda_device_count, cuda_device_of, cuda_driver_present, CudaRegion};
#[cfg(all(feature = "fake-device", target_os = "linux"))]
pub use fake_device::FakeDeviceRegion;
pub use memory::{SlotMemory, UnknownMemory};

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

/// Where a region's memory lives. Descriptors carry it
/// ([`RemoteSlots::memory`](crate::RemoteSlots::memory)): a peer whose engine
/// types its transfers by memory (NIXL's DRAM and VRAM) needs to know.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum MemoryKind {
    /// Ordinary host memory (DRAM).
    #[default]
    Host,
    /// Device memory of the accelerator with this ordinal.
    Device {
        /// The device's ordinal (CUDA device index).
        ordinal: u32,
    },
}

impl MemoryKind {
    /// What [`FakeDeviceRegion`](crate::FakeDeviceRegion) reports: device
    /// memory with an ordinal no real device has. A backend that registers
    /// device memory with a GPU-aware engine (NIXL's VRAM) refuses it: only
    /// staging through the region's copies can reach it.
    pub const FAKE_DEVICE: Self = Self::Device { ordinal: u32::MAX };
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Host => f.write_str("host memory"),
            Self::FAKE_DEVICE => f.write_str("fake device memory"),
            Self::Device { ordinal } => write!(f, "device {ordinal}'s memory"),
        }
    }
}

/// Errors of region access.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionError {
    /// The range `[offset, offset + len)` is not inside the region.
    #[error("range {offset}+{len} lies outside the region of {region_len} bytes")]
    OutOfBounds {
        /// Start of the requested range.
        offset: usize,
        /// Its length.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// The allocation could not be made (zero length, bad alignment, no memory).
    #[error("cannot allocate a region of {len} bytes aligned to {align}")]
    Allocation {
        /// Requested length.
        len: usize,
        /// Requested alignment.
        align: usize,
    },
    /// The memory kind cannot do this (for example a device copy without a driver).
    #[error("memory access failed: {0}")]
    Access(String),
    /// Device memory could not be had or copied.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Why device memory could not be had or copied.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceError {
    /// This build has no support for the memory asked for.
    #[error("{what} needs kv-transfer-core built with the feature `{feature}`")]
    NotBuilt {
        /// The memory asked for.
        what: &'static str,
        /// The feature that provides it.
        feature: &'static str,
    },
    /// No CUDA driver library (`libcuda.so`) could be loaded.
    #[error("no CUDA driver: libcuda.so could not be loaded (is the NVIDIA driver installed?)")]
    NoDriver,
    /// The device ordinal names no device.
    #[error("no CUDA device {ordinal}: this host has {count}")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices present.
        count: u32,
    },
    /// The device is out of memory.
    #[error("{call}: out of device memory ({message})")]
    OutOfMemory {
        /// The driver call that failed.
        call: &'static str,
        /// The driver's words.
        message: String,
    },
    /// Any other driver error.
    #[error("{call} failed with CUDA error {code}: {message}")]
    Driver {
        /// The driver call that failed.
        call: &'static str,
        /// The driver's result code.
        code: i32,
        /// The driver's words.
        message: String,
    },
}

/// Memory that a pool's slots are carved from and that a backend registers
/// with its NIC.
///
/// Implementations copy with plain memory semantics. Concurrent access by a
/// NIC is exactly what the pool's leases rule out; a backend that writes into
/// a slot it has no exposure for (the `naive` positive control) races like a
/// real NIC's DMA would, and the copy sees whichever bytes won.
pub trait Region: Send + Sync + fmt::Debug + 'static {
    /// Where the memory lives.
    fn kind(&self) -> MemoryKind;
    /// Base address as the NIC sees it (a virtual address for host memory, a
    /// device pointer for device memory).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the region has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError>;
    /// Copies `src` into the region starting at `offset`.
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError>;
    /// A host pointer to the first byte, for backends that move host memory
    /// themselves (the TCP simulator's NIC). `None` for device memory.
    fn host_ptr(&self) -> Option<NonNull<u8>>;
    /// A dma-buf file descriptor exporting the whole region, for a NIC that
    /// registers device memory itself (GPUDirect RDMA: `ibv_reg_dmabuf_mr`).
    /// `None`: this memory has no dma-buf (host memory, core's fake device).
    fn dmabuf(&self) -> Option<Result<std::os::fd::OwnedFd, RegionError>> {
        None
    }
}

std::thread_local! {
    /// Each thread's staging buffer for device memory ([`with_staging_buffer`]).
    static STAGING: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on a host buffer of `n` bytes: this thread's staging buffer,
/// reused, so a backend that stages device slots through host memory (a
/// socket backend: receive into it, then [`Region::write`]) allocates only
/// when a transfer is larger than any before on this thread. The bytes it
/// starts with are whatever the last use left.
///
/// ```
/// let sum: u32 = kv_transfer_core::with_staging_buffer(4, |b| {
///     b.copy_from_slice(&[1, 2, 3, 4]);
///     b.iter().map(|x| u32::from(*x)).sum()
/// });
/// assert_eq!(sum, 10);
/// ```
pub fn with_staging_buffer<R>(n: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    STAGING.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < n {
                buf.resize(n, 0);
            }
            f(&mut buf[..n])
        }
        // Re-entered on this thread: a buffer of its own.
        Err(_) => f(&mut vec![0u8; n]),
    })
}

pub(crate) fn check_range(offset: usize, len: usize, region_len: usize) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionError::OutOfBounds { offset, len, region_len }),
    }
}

/// Page-aligned, zeroed host memory owned by the region.
pub struct HostRegion {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the region owns its allocation; every access goes through raw,
// bounds-checked copies (never a `&`/`&mut` to the bytes that outlives a copy),
// so sharing it between threads is as sound as sharing DMA-able memory.
unsafe impl Send for HostRegion {}
// SAFETY: see `Send`.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Page size used for alignment when none is asked for.
    pub const PAGE: usize = 4096;

    /// Allocates `len` zeroed bytes aligned to a page.
    ///
    /// ```
    /// use kv_transfer_core::{HostRegion, Region};
    /// let r = HostRegion::new(1 << 20).unwrap();
    /// assert_eq!(r.len(), 1 << 20);
    /// assert_eq!(r.addr() % 4096, 0);
    /// ```
    pub fn new(len: usize) -> Result<Self, RegionError> {
        Self::with_alignment(len, Self::PAGE)
    }

    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    pub fn with_alignment(len: usize, align: usize) -> Result<Self, RegionError> {
        let err = RegionError::Allocation { len, align };
        if len == 0 {
            return Err(err);
        }
        let layout = Layout::from_size_align(len, align).map_err(|_| err.clone())?;
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(err)?;
        Ok(Self { ptr, layout })
    }

    /// Raw pointer to the first byte. Writing through it is the caller's
    /// business; the pool's leases say when that is safe.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.layout.size())
            .finish()
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: allocated in `with_alignment` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl Region for HostRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        check_range(offset, dst.len(), self.len())?;
        // SAFETY: in bounds (checked); `dst` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) }
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        check_range(offset, src.len(), self.len())?;
        // SAFETY: in bounds (checked); `src` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) }
        Ok(())
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }
}
