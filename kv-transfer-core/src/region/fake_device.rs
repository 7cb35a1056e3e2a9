//! Device-like memory on any host (`FakeDeviceRegion`).

use super::{check_range, MemoryKind, Region, RegionError};
use std::fmt;
use std::ptr::NonNull;

/// Device-like memory on any host: a region whose "device" mapping faults on
/// every CPU access.
///
/// On a GPU, a slot's address is a device pointer: the NIC (or the GPU's copy
/// engine) can reach it, the CPU cannot. Code that reads a slot through its
/// address instead of through [`Region::read`] works on host memory and
/// crashes (or reads garbage) on a GPU. This region makes that mistake crash
/// on a laptop: one `memfd` is mapped twice,
///
/// - once `PROT_NONE`: [`Region::addr`] is this mapping's address, the
///   "device pointer" that pools, descriptors and NICs see, and any load or
///   store through it is a `SIGSEGV`;
/// - once read-write, private to the region: only [`Region::read`] and
///   [`Region::write`] (the region's "device copies") use it.
///
/// [`Region::host_ptr`] is `None` and [`Region::kind`] is
/// [`MemoryKind::Device`], so backends take their device path (staging, or a
/// typed refusal). Running the conformance suite and the race with slots here
/// proves no path dereferences a slot's address on the CPU.
///
/// ```
/// use kv_transfer_core::{FakeDeviceRegion, MemoryKind, Region};
/// let r = FakeDeviceRegion::new(1 << 16).unwrap();
/// assert_eq!(r.kind(), MemoryKind::Device { ordinal: FakeDeviceRegion::ORDINAL });
/// assert!(r.host_ptr().is_none());
/// r.write(100, b"kv").unwrap();
/// let mut back = [0u8; 2];
/// r.read(100, &mut back).unwrap();
/// assert_eq!(&back, b"kv");
/// ```
pub struct FakeDeviceRegion {
    /// The `PROT_NONE` mapping: the address everyone else sees.
    device: NonNull<u8>,
    /// The read-write mapping of the same pages, used by the copies only.
    view: NonNull<u8>,
    len: usize,
    /// Bytes mapped (`len` rounded up to a page).
    mapped: usize,
}

// SAFETY: the region owns both mappings; every access goes through bounded
// raw copies on the private view (never a reference that outlives a copy),
// as `HostRegion` does.
unsafe impl Send for FakeDeviceRegion {}
// SAFETY: see `Send`.
unsafe impl Sync for FakeDeviceRegion {}

impl FakeDeviceRegion {
    /// The ordinal [`Region::kind`] reports, chosen so that no real device
    /// has it: `MemoryKind::Device { ordinal: u32::MAX }`.
    pub const ORDINAL: u32 = u32::MAX; // MemoryKind::FAKE_DEVICE

    /// Maps `len` zeroed bytes twice (see the module documentation).
    pub fn new(len: usize) -> Result<Self, RegionError> {
        let alloc_err = |_| RegionError::Allocation { len, align: super::HostRegion::PAGE };
        if len == 0 {
            return Err(alloc_err(()));
        }
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        let mapped = len.checked_next_multiple_of(page).ok_or(alloc_err(()))?;
        let name = c"kvt-fake-device";
        // SAFETY: a valid NUL-terminated name; the flags are constants.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("memfd_create"));
        }
        let mapping = |prot| {
            // SAFETY: a fresh mapping (no fixed address) of `mapped` bytes of a
            // file of at least that size.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), mapped, prot, libc::MAP_SHARED, fd, 0) };
            if p == libc::MAP_FAILED {
                Err(os_err("mmap"))
            } else {
                NonNull::new(p.cast::<u8>()).ok_or_else(|| os_err("mmap"))
            }
        };
        let result = (|| {
            // SAFETY: `fd` is the memfd opened above.
            if unsafe { libc::ftruncate(fd, mapped as libc::off_t) } != 0 {
                return Err(os_err("ftruncate"));
            }
            let device = mapping(libc::PROT_NONE)?;
            match mapping(libc::PROT_READ | libc::PROT_WRITE) {
                Ok(view) => Ok(Self { device, view, len, mapped }),
                Err(e) => {
                    // SAFETY: mapped just above with this length.
                    unsafe { libc::munmap(device.as_ptr().cast(), mapped) };
                    Err(e)
                }
            }
        })();
        // SAFETY: the mappings keep the pages alive; the descriptor is no
        // longer needed whatever happened.
        unsafe { libc::close(fd) };
        result
    }
}

fn os_err(call: &str) -> RegionError {
    RegionError::Access(format!("{call}: {}", std::io::Error::last_os_error()))
}

impl fmt::Debug for FakeDeviceRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeDeviceRegion")
            .field("device_addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for FakeDeviceRegion {
    fn drop(&mut self) {
        // SAFETY: both mapped in `new` with `self.mapped` bytes, unmapped once.
        unsafe {
            libc::munmap(self.device.as_ptr().cast(), self.mapped);
            libc::munmap(self.view.as_ptr().cast(), self.mapped);
        }
    }
}

impl Region for FakeDeviceRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device { ordinal: Self::ORDINAL }
    }
    fn addr(&self) -> u64 {
        self.device.as_ptr() as usize as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        check_range(offset, dst.len(), self.len)?;
        // SAFETY: in bounds of the view (checked); `dst` is a distinct buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.view.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) }
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        check_range(offset, src.len(), self.len)?;
        // SAFETY: in bounds of the view (checked); `src` is a distinct buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.view.as_ptr().add(offset), src.len()) }
        Ok(())
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Command;

    const CHILD: &str = "KVT_FAKE_DEVICE_TOUCH";

    /// The region is only worth anything if a CPU access through its address
    /// crashes: the test re-runs itself in a child process that reads one
    /// byte through `addr()`, and the child must die of SIGSEGV.
    #[test]
    fn cpu_access_through_the_device_address_crashes() {
        let r = FakeDeviceRegion::new(4096).expect("region");
        r.write(0, &[7]).expect("copy in");
        if std::env::var_os(CHILD).is_some() {
            // SAFETY: none: this is the access the region must turn into a crash.
            let b = unsafe { std::ptr::read_volatile(r.addr() as usize as *const u8) };
            // Reached only if the access did not fault.
            std::process::exit(i32::from(b) + 1);
        }
        let exe = std::env::current_exe().expect("test binary");
        let out = Command::new(exe)
            .args(["--exact", "region::fake_device::tests::cpu_access_through_the_device_address_crashes"])
            .args(["--nocapture", "--test-threads", "1"])
            .env(CHILD, "1")
            .output()
            .expect("child runs");
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGSEGV),
            "the child read through the device address and was not killed by SIGSEGV: {:?}",
            out.status
        );
    }

    /// Copies go through the private view: bytes written are read back, at
    /// any offset, and the bounds are checked.
    #[test]
    fn copies_round_trip_and_are_bounded() {
        let r = FakeDeviceRegion::new(10_000).expect("region");
        assert_eq!(r.len(), 10_000);
        r.write(9_990, &[1; 10]).expect("write at the end");
        let mut b = [0u8; 10];
        r.read(9_990, &mut b).expect("read at the end");
        assert_eq!(b, [1; 10]);
        assert!(matches!(r.write(9_991, &[1; 10]), Err(RegionError::OutOfBounds { .. })));
        assert!(matches!(r.read(usize::MAX, &mut b), Err(RegionError::OutOfBounds { .. })));
        assert!(FakeDeviceRegion::new(0).is_err());
    }
}
