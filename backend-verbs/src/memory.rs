//! Protection domains, memory regions and type-2 memory windows.
//!
//! The safe policy registers a pool's memory with `LOCAL_WRITE | MW_BIND`
//! only: the region's own rkey grants no remote access, so a peer can reach
//! a slot only through a window bound over it, one window per tenancy. The
//! window's key is then the generation at the NIC: invalidating the window
//! (`LOCAL_INV`) or binding it again under a new key makes every later
//! access with the old key fail at the NIC (`REM_ACCESS_ERR`), memory
//! unchanged.

use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;
use kv_transfer_core::Region;

use crate::device::Context;
use crate::error::VerbsError;
use crate::work::MrAccess;

/// A protection domain.
#[derive(Debug)]
pub struct ProtectionDomain {
    pub(crate) pd: NonNull<ffi::ibv_pd>,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see `Context`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsError::os("ibv_alloc_pd", 0))?;
        Ok(Arc::new(Self { pd, ctx: Arc::clone(ctx) }))
    }

    /// The device it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; every MR, MW and QP of it holds an
        // `Arc` to it, so none is left.
        let ret = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_dealloc_pd failed");
        }
    }
}

impl MrAccess {
    fn flags(self) -> ffi::ibv_access_flags {
        use ffi::ibv_access_flags as A;
        match self {
            Self::Local => A::IBV_ACCESS_LOCAL_WRITE,
            Self::WindowsOnly => A::IBV_ACCESS_LOCAL_WRITE | A::IBV_ACCESS_MW_BIND,
            Self::RemoteWriteRead => A::IBV_ACCESS_LOCAL_WRITE | A::IBV_ACCESS_REMOTE_WRITE | A::IBV_ACCESS_REMOTE_READ,
        }
    }
}

/// Registered memory. Holds the region it registers (so the memory outlives
/// the registration, and so every binding and in-flight operation that
/// holds this `Arc`) and its protection domain.
#[derive(Debug)]
pub struct MemoryRegion {
    mr: NonNull<ffi::ibv_mr>,
    region: Arc<dyn Region>,
    access: MrAccess,
    /// Kept alive: deregistered before its domain is freed.
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: see `Context`.
unsafe impl Send for MemoryRegion {}
// SAFETY: see `Context`.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `region` in `pd` with `access`: host memory through its
    /// host pointer (`ibv_reg_mr`), device memory through the dma-buf it
    /// exports (`ibv_reg_dmabuf_mr`, GPUDirect RDMA), its I/O virtual address
    /// being the region's address, so windows and work requests name device
    /// memory exactly as they name host memory. Device memory without a
    /// dma-buf, or a NIC that cannot take one, is
    /// [`VerbsError::DeviceMemory`].
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        region: Arc<dyn Region>,
        access: MrAccess,
    ) -> Result<Arc<Self>, VerbsError> {
        if region.is_empty() {
            return Err(VerbsError::invalid("ibv_reg_mr", "an empty region"));
        }
        let flags = access.flags().0 as i32;
        let mr = match region.host_ptr() {
            // SAFETY: `ptr..ptr+len` is the region's memory, kept alive by
            // the `Arc` stored with the registration.
            Some(ptr) => unsafe { ffi::ibv_reg_mr(pd.pd.as_ptr(), ptr.as_ptr().cast(), region.len(), flags) },
            None => {
                let device = |why: String| VerbsError::DeviceMemory { why };
                let fd = region
                    .dmabuf()
                    .ok_or_else(|| device(format!("{:?} exports no dma-buf", region.kind())))?
                    .map_err(|e| device(e.to_string()))?;
                // SAFETY: `fd` exports the whole region; the kernel takes its
                // own reference on the dma-buf, so the descriptor may close
                // once the call returns, and the region (the allocation the
                // dma-buf pins) is kept alive by the `Arc` stored here.
                let mr = unsafe {
                    ffi::ibv_reg_dmabuf_mr(pd.pd.as_ptr(), 0, region.len(), region.addr(), fd.as_raw_fd(), flags)
                };
                if mr.is_null() {
                    let os = std::io::Error::last_os_error();
                    return Err(device(format!(
                        "ibv_reg_dmabuf_mr: {os} (the NIC, its driver or the kernel cannot \
                                               register GPU memory)"
                    )));
                }
                mr
            }
        };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::os("ibv_reg_mr", 0))?;
        Ok(Arc::new(Self { mr, region, access, _pd: Arc::clone(pd) }))
    }

    /// The local key (for scatter/gather entries).
    pub fn lkey(&self) -> u32 {
        // SAFETY: registered until `Drop`.
        unsafe { self.mr.as_ref().lkey }
    }

    /// The region's own remote key: grants remote access only with
    /// [`MrAccess::RemoteWriteRead`] (the positive control).
    pub fn rkey(&self) -> u32 {
        // SAFETY: registered until `Drop`.
        unsafe { self.mr.as_ref().rkey }
    }

    /// The first byte's address, as the NIC sees it.
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Whether it has no bytes (never: an empty region is refused).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// What it was registered with.
    pub fn access(&self) -> MrAccess {
        self.access
    }

    /// The memory it registers.
    pub fn region(&self) -> &Arc<dyn Region> {
        &self.region
    }

    /// Checks `offset..offset+len` against the region; returns the address.
    pub(crate) fn range(&self, op: &'static str, offset: u64, len: u32) -> Result<u64, VerbsError> {
        let end = offset.checked_add(u64::from(len));
        match end {
            Some(end) if end <= self.len() as u64 => Ok(self.addr() + offset),
            _ => Err(VerbsError::invalid(op, format!("{offset}+{len} is outside a region of {} bytes", self.len()))),
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_mr {
        self.mr.as_ptr()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`; windows bound over it and
        // in-flight operations on it hold this `Arc`, so none is left.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_dereg_mr failed");
        }
    }
}

/// A type-2 memory window's lifecycle. Binds and invalidations are work
/// requests on a queue pair: each is pending until its completion.
#[derive(Debug)]
pub enum WindowState {
    /// Grants nothing.
    Unbound,
    /// A bind was posted under `rkey`; not yet usable by the peer.
    Binding {
        /// The key being bound.
        rkey: u32,
        /// The memory it will grant.
        mr: Arc<MemoryRegion>,
    },
    /// `rkey` grants remote access to `mr`'s `addr..addr+len`, through the
    /// queue pair it was bound on only (type 2B).
    Bound {
        /// The key.
        rkey: u32,
        /// The memory it grants.
        mr: Arc<MemoryRegion>,
        /// Start address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// A `LOCAL_INV` of `rkey` was posted; the key still grants access
    /// until its completion.
    Invalidating {
        /// The key being invalidated.
        rkey: u32,
        /// The memory it granted.
        mr: Arc<MemoryRegion>,
        /// Start address.
        addr: u64,
        /// Length.
        len: u32,
    },
}

/// A memory window (type 2, or type 1: [`MemoryWindow::new_type1`]).
#[derive(Debug)]
pub struct MemoryWindow {
    mw: NonNull<ffi::ibv_mw>,
    pub(crate) state: WindowState,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: see `Context`; the window's state is only changed through `&mut`.
unsafe impl Send for MemoryWindow {}
// SAFETY: see `Context`.
unsafe impl Sync for MemoryWindow {}

impl MemoryWindow {
    /// Allocates a type-2 window in `pd`.
    pub fn new(pd: &Arc<ProtectionDomain>) -> Result<Self, VerbsError> {
        Self::of_type(pd, ffi::IBV_MW_TYPE_2)
    }

    /// Allocates a type-1 window in `pd`: bound by a `BIND_MW` posted on any
    /// queue pair of `pd` (what `ibv_bind_mw` does), its key then good
    /// through every queue pair of `pd`; freeing it ends the key.
    pub fn new_type1(pd: &Arc<ProtectionDomain>) -> Result<Self, VerbsError> {
        Self::of_type(pd, ffi::IBV_MW_TYPE_1)
    }

    fn of_type(pd: &Arc<ProtectionDomain>, kind: ffi::ibv_mw_type) -> Result<Self, VerbsError> {
        // SAFETY: `alloc_mw` is the provider's entry for `ibv_alloc_mw` (an
        // inline in verbs.h); `pd` is live.
        let mw = unsafe {
            let ctx = pd.ctx.ctx.as_ptr();
            match (*ctx).ops.alloc_mw {
                Some(alloc) => alloc(pd.pd.as_ptr(), kind),
                None => return Err(VerbsError::invalid("ibv_alloc_mw", "the provider has no memory windows")),
            }
        };
        let mw = NonNull::new(mw).ok_or_else(|| VerbsError::os("ibv_alloc_mw", 0))?;
        Ok(Self { mw, state: WindowState::Unbound, pd: Arc::clone(pd) })
    }

    /// Where it is in its lifecycle.
    pub fn state(&self) -> &WindowState {
        &self.state
    }

    /// The key the next bind uses: the current key with its low 8 bits (the
    /// part the consumer owns) moved on by one.
    pub(crate) fn next_rkey(&self) -> u32 {
        // SAFETY: allocated until `Drop`.
        let k = unsafe { self.mw.as_ref().rkey };
        (k & 0xffff_ff00) | (k.wrapping_add(1) & 0xff)
    }

    /// Records that the bind of `rkey` completed (successfully or not).
    /// rxe's quirk: the application itself sets the window's key after a
    /// bind, or the next bind fails and takes the QP to ERR.
    pub fn bind_completed(&mut self, ok: bool, addr: u64, len: u32) {
        let state = std::mem::replace(&mut self.state, WindowState::Unbound);
        self.state = match (state, ok) {
            (WindowState::Binding { rkey, mr }, true) => {
                // SAFETY: allocated until `Drop`; only this `&mut` writes it.
                unsafe { self.mw.as_mut().rkey = rkey };
                WindowState::Bound { rkey, mr, addr, len }
            }
            (WindowState::Binding { .. }, false) => WindowState::Unbound,
            (other, _) => other,
        };
    }

    /// Records that the invalidation completed: successful, nothing is
    /// granted any more; failed, the key may still grant access.
    pub fn invalidate_completed(&mut self, ok: bool) {
        let state = std::mem::replace(&mut self.state, WindowState::Unbound);
        self.state = match (state, ok) {
            (WindowState::Invalidating { .. }, true) => WindowState::Unbound,
            (WindowState::Invalidating { rkey, mr, addr, len }, false) => WindowState::Bound { rkey, mr, addr, len },
            (other, _) => other,
        };
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_mw {
        self.mw.as_ptr()
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once (the memory a bound window
        // grants is kept alive by the `Arc` in its state until then).
        unsafe {
            let ctx = self.pd.ctx.ctx.as_ptr();
            if let Some(dealloc) = (*ctx).ops.dealloc_mw {
                let ret = dealloc(self.mw.as_ptr());
                if ret != 0 {
                    tracing::warn!(ret, "ibv_dealloc_mw failed");
                }
            }
        }
    }
}
