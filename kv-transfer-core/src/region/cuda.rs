//! Slots in CUDA device memory (`CudaRegion`, feature `cuda`).

use super::{check_range, DeviceError, MemoryKind, Region, RegionError};
use cudarc::driver::{result, sys};
use std::fmt;
use std::ptr::NonNull;

/// Slots in CUDA device memory (feature `cuda`).
///
/// The driver is loaded at run time (`cudarc` with dynamic loading), so a
/// workspace built with this feature builds and passes its tests on a host
/// with no CUDA toolkit and no driver: [`CudaRegion::new`] then returns
/// [`DeviceError::NoDriver`]. The driver library is probed before any driver
/// call, because `cudarc` panics on a missing library.
///
/// The region's copies ([`Region::read`], [`Region::write`]) are
/// host-to-device and device-to-host copies on the region's own stream, each
/// synchronised before it returns: a backend that stages through host memory
/// reports a completion only after its copy into the slot finished.
///
/// ```no_run
/// use kv_transfer_core::{CudaRegion, MemoryKind, Region};
/// let r = CudaRegion::new(0, 1 << 20)?; // 1 MiB on GPU 0
/// assert_eq!(r.kind(), MemoryKind::Device { ordinal: 0 });
/// r.write(0, b"kv")?;
/// # Ok::<(), kv_transfer_core::RegionError>(())
/// ```
///
/// The memory is allocated by the region ([`CudaRegion::new`]) or someone
/// else's, kept alive by its owner ([`CudaRegion::borrowed`]: a torch
/// tensor's memory).
pub struct CudaRegion {
    ordinal: u32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    dptr: sys::CUdeviceptr,
    len: usize,
    memory: Allocation,
}

/// Who frees the device memory.
enum Allocation {
    /// The region allocated it and frees it on drop.
    Owned,
    /// Someone else did; the owner (dropped with the region) keeps it alive.
    Borrowed(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
}

// SAFETY: the handles are process-wide driver objects, usable from any thread
// once the context is made current there (every method does that first);
// the device memory is touched only through the driver's copies.
unsafe impl Send for CudaRegion {}
// SAFETY: see `Send`; the driver's stream and copy calls are thread-safe.
unsafe impl Sync for CudaRegion {}

fn driver_err(call: &'static str) -> impl Fn(result::DriverError) -> RegionError {
    move |e| {
        let message = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let code = e.0 as i32;
        RegionError::Device(match e.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => DeviceError::OutOfMemory { call, message },
            _ => DeviceError::Driver { call, code, message },
        })
    }
}

/// Whether the CUDA driver library can be loaded here (no driver call made).
pub fn cuda_driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// The number of CUDA devices, or why there are none.
pub fn cuda_device_count() -> Result<u32, RegionError> {
    if !cuda_driver_present() {
        return Err(RegionError::Device(DeviceError::NoDriver));
    }
    result::init().map_err(driver_err("cuInit"))?;
    let n = result::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
    Ok(u32::try_from(n).unwrap_or(0))
}

/// The device a CUDA context, its stream and nothing else yet: what both
/// constructors start from. Dropped on a failure, it releases what it holds.
struct Device {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
}

impl Device {
    fn open(ordinal: u32) -> Result<Self, RegionError> {
        let count = cuda_device_count()?;
        if ordinal >= count {
            return Err(RegionError::Device(DeviceError::NoDevice { ordinal, count }));
        }
        let dev = result::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet"))?;
        // SAFETY: `dev` came from `device::get`.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let mut d = Self { dev, ctx, stream: std::ptr::null_mut() };
        // SAFETY: a context retained above.
        unsafe { result::ctx::set_current(ctx) }.map_err(driver_err("cuCtxSetCurrent"))?;
        d.stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(driver_err("cuStreamCreate"))?;
        Ok(d)
    }

    fn into_region(self, ordinal: u32, dptr: sys::CUdeviceptr, len: usize, memory: Allocation) -> CudaRegion {
        let this = std::mem::ManuallyDrop::new(self);
        CudaRegion { ordinal, dev: this.dev, ctx: this.ctx, stream: this.stream, dptr, len, memory }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: created and retained in `open`, each released once.
        unsafe {
            if !self.stream.is_null() {
                let _ = result::stream::destroy(self.stream);
            }
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// The CUDA device whose memory `addr` is, if it is device memory (a torch
/// tensor's `data_ptr()` on `cuda:N`); `None` for host memory, or where no
/// CUDA driver is loaded.
pub fn cuda_device_of(addr: u64) -> Option<u32> {
    if cuda_device_count().ok()? == 0 {
        return None;
    }
    let mut kind: u32 = 0;
    // SAFETY: `kind` is a valid out-pointer for the attribute's 4 bytes; the
    // driver answers for any address (an error for one it does not know).
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut kind as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
        .result()
        .ok()?
    };
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return None;
    }
    let mut ordinal: i32 = -1;
    // SAFETY: as above, for the ordinal's 4 bytes.
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        )
        .result()
        .ok()?
    };
    u32::try_from(ordinal).ok()
}

impl CudaRegion {
    /// Allocates `len` zeroed bytes on device `ordinal`, in its primary context.
    pub fn new(ordinal: u32, len: usize) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Allocation { len, align: 256 });
        }
        let device = Device::open(ordinal)?;
        // SAFETY: the context is current; the pointer is freed in `Drop`.
        let dptr = unsafe { result::malloc_sync(len) }.map_err(driver_err("cuMemAlloc"))?;
        let r = device.into_region(ordinal, dptr, len, Allocation::Owned);
        // Device memory is not zeroed by the allocator; slots start zeroed
        // as `HostRegion`'s do.
        // SAFETY: `dptr` holds `len` bytes; the context is current.
        unsafe { result::memset_d8_sync(dptr, 0, len) }.map_err(driver_err("cuMemsetD8"))?;
        Ok(r)
    }

    /// A region over `len` bytes of device `ordinal`'s memory at `dptr` that
    /// someone else allocated (a torch tensor), kept alive by `owner` for as
    /// long as the region lives. The range is checked with the driver: it
    /// must be device memory of that device.
    pub fn borrowed(
        ordinal: u32,
        dptr: u64,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Self, RegionError> {
        if len == 0 || dptr.checked_add(len as u64).is_none() {
            return Err(RegionError::Allocation { len, align: 1 });
        }
        let device = Device::open(ordinal)?;
        let last = dptr + len as u64 - 1;
        if cuda_device_of(dptr) != Some(ordinal) || cuda_device_of(last) != Some(ordinal) {
            return Err(RegionError::Device(DeviceError::Driver {
                call: "cuPointerGetAttribute",
                code: 0,
                message: format!("{dptr:#x}+{len} is not memory of CUDA device {ordinal}"),
            }));
        }
        Ok(device.into_region(ordinal, dptr, len, Allocation::Borrowed(owner)))
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Exports the allocation as a dma-buf file descriptor, which a NIC
    /// registers for GPUDirect RDMA (`ibv_reg_dmabuf_mr`). A typed error
    /// where the driver or kernel cannot (no dma-buf support).
    pub fn dmabuf_fd(&self) -> Result<std::os::fd::OwnedFd, RegionError> {
        use std::os::fd::FromRawFd;
        self.make_current()?;
        let mut fd: i32 = -1;
        // SAFETY: `fd` is a valid out-pointer for an int; the range is the
        // whole allocation.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                self.dptr,
                self.len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
            .result()
        }
        .map_err(driver_err("cuMemGetHandleForAddressRange"))?;
        if fd < 0 {
            return Err(RegionError::Device(DeviceError::Driver {
                call: "cuMemGetHandleForAddressRange",
                code: 0,
                message: "no descriptor returned".into(),
            }));
        }
        // SAFETY: the driver handed us a fresh descriptor that nothing else owns.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    fn make_current(&self) -> Result<(), RegionError> {
        // SAFETY: the context is retained while `self` lives.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(driver_err("cuCtxSetCurrent"))
    }
}

impl fmt::Debug for CudaRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaRegion")
            .field("ordinal", &self.ordinal)
            .field("dptr", &format_args!("{:#x}", self.dptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for CudaRegion {
    fn drop(&mut self) {
        let _ = self.make_current();
        // SAFETY: allocated (if owned), created and retained in the
        // constructor, each released once.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            if let Allocation::Owned = self.memory {
                let _ = result::free_sync(self.dptr);
            }
            let _ = result::stream::destroy(self.stream);
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

impl Region for CudaRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device { ordinal: self.ordinal }
    }
    fn addr(&self) -> u64 {
        self.dptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        check_range(offset, dst.len(), self.len)?;
        self.make_current()?;
        // SAFETY: the range lies in the allocation (checked); `dst` stays
        // borrowed until the stream is synchronised below.
        unsafe {
            result::memcpy_dtoh_async(dst, self.dptr + offset as u64, self.stream)
                .map_err(driver_err("cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(self.stream).map_err(driver_err("cuStreamSynchronize"))
        }
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        check_range(offset, src.len(), self.len)?;
        self.make_current()?;
        // SAFETY: as in `read`; `src` stays borrowed until the copy finished.
        unsafe {
            result::memcpy_htod_async(self.dptr + offset as u64, src, self.stream)
                .map_err(driver_err("cuMemcpyHtoDAsync"))?;
            result::stream::synchronize(self.stream).map_err(driver_err("cuStreamSynchronize"))
        }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn dmabuf(&self) -> Option<Result<std::os::fd::OwnedFd, RegionError>> {
        Some(self.dmabuf_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs a CUDA device; reported as ignored without one (and run by
    /// `scripts/device-check.sh` where there is one).
    #[test]
    #[ignore = "needs an NVIDIA GPU and its driver (scripts/device-check.sh)"]
    fn cuda_region_copies_round_trip() {
        let r = CudaRegion::new(0, 3 << 20).expect("a CUDA device");
        let data: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        r.write(1 << 20, &data).expect("host to device");
        let mut back = vec![0u8; data.len()];
        r.read(1 << 20, &mut back).expect("device to host");
        assert_eq!(back, data);
        let mut zero = vec![1u8; 4096];
        r.read(0, &mut zero).expect("read the zeroed start");
        assert!(zero.iter().all(|b| *b == 0));
        assert!(matches!(r.write(3 << 20, &[1]), Err(RegionError::OutOfBounds { .. })));
    }

    /// A borrowed region copies into memory allocated elsewhere and does
    /// not free it; the pointer query tells device from host memory.
    #[test]
    #[ignore = "needs an NVIDIA GPU and its driver (scripts/device-check.sh)"]
    fn borrowed_device_memory_is_found_copied_and_not_freed() {
        let owner = std::sync::Arc::new(CudaRegion::new(0, 1 << 16).expect("a CUDA device"));
        assert_eq!(cuda_device_of(owner.addr()), Some(0));
        let host = [0u8; 16];
        assert_eq!(cuda_device_of(host.as_ptr() as u64), None);
        let b = CudaRegion::borrowed(0, owner.addr() + 4096, 4096, Box::new(owner.clone())).expect("borrowed");
        b.write(0, &[9; 4096]).expect("write");
        drop(b);
        let mut back = [0u8; 4096];
        owner.read(4096, &mut back).expect("the owner's memory is still there");
        assert_eq!(back, [9; 4096]);
        assert!(CudaRegion::borrowed(0, host.as_ptr() as u64, 16, Box::new(())).is_err(), "host memory refused");
    }

    /// Without a driver the error is typed, not a panic.
    #[test]
    fn no_driver_or_no_device_is_a_typed_error() {
        if cuda_driver_present() {
            match CudaRegion::new(u32::MAX - 1, 4096) {
                Err(RegionError::Device(DeviceError::NoDevice { .. })) => {}
                other => panic!("expected NoDevice, got {other:?}"),
            }
        } else {
            assert_eq!(CudaRegion::new(0, 4096).unwrap_err(), RegionError::Device(DeviceError::NoDriver));
            assert_eq!(cuda_device_of(0x1000), None);
            let e = CudaRegion::borrowed(0, 0x1000, 16, Box::new(())).unwrap_err();
            assert_eq!(e, RegionError::Device(DeviceError::NoDriver));
        }
    }
}
