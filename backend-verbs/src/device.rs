//! A verbs device: opening it, what it can do, its GIDs.

use std::ffi::CStr;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::error::VerbsError;
use crate::work::Gid;

/// An open device (`ibv_context`). Everything made from it keeps it alive
/// through an `Arc`, so it closes last.
#[derive(Debug)]
pub struct Context {
    pub(crate) ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: libibverbs objects may be used from any thread (the library locks
// what it shares); the pointer is only freed in `Drop`, once.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// What the device says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Memory windows it can hold.
    pub max_mw: u32,
    /// Queue pairs it can hold.
    pub max_qp: u32,
    /// Whether it has type-2B memory windows (bound to one QP).
    pub mw_type_2b: bool,
}

/// Names of the verbs devices here. Fails where the machine has no verbs
/// stack (the device list itself cannot be read).
pub fn devices() -> Result<Vec<String>, VerbsError> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(VerbsError::NoDevice { name: String::new(), why: std::io::Error::last_os_error().to_string() });
    }
    let mut out = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: `list` has `n` valid entries; names are NUL-terminated.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) };
        out.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list came from `ibv_get_device_list` and is freed once.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(out)
}

impl Context {
    /// Opens the device named `name`.
    pub fn open(name: &str) -> Result<Arc<Self>, VerbsError> {
        let mut n = 0;
        // SAFETY: as in `devices`.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(VerbsError::NoDevice {
                name: name.to_owned(),
                why: std::io::Error::last_os_error().to_string(),
            });
        }
        let mut ctx = std::ptr::null_mut();
        let mut found = false;
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: `list` has `n` valid entries.
            let dev = unsafe { *list.add(i) };
            // SAFETY: device names are NUL-terminated.
            if unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }.to_bytes() == name.as_bytes() {
                found = true;
                // SAFETY: `dev` is a device of the list, which is still alive.
                ctx = unsafe { ffi::ibv_open_device(dev) };
                break;
            }
        }
        let err = std::io::Error::last_os_error();
        // SAFETY: freed once; an opened context does not need the list.
        unsafe { ffi::ibv_free_device_list(list) };
        if !found {
            return Err(VerbsError::NoDevice { name: name.to_owned(), why: format!("{n} other device(s)") });
        }
        let ctx = NonNull::new(ctx).ok_or(VerbsError::Os { op: "ibv_open_device", source: err })?;
        Ok(Arc::new(Self { ctx, name: name.to_owned() }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the device can do.
    pub fn caps(&self) -> Result<DeviceCaps, VerbsError> {
        // SAFETY: plain C struct, zero is a valid value.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `attr` is a valid out-pointer.
        let ret = unsafe { ffi::ibv_query_device(self.ctx.as_ptr(), &mut attr) };
        if ret != 0 {
            return Err(VerbsError::os("ibv_query_device", ret));
        }
        Ok(DeviceCaps {
            max_mw: u32::try_from(attr.max_mw).unwrap_or(0),
            max_qp: u32::try_from(attr.max_qp).unwrap_or(0),
            mw_type_2b: u64::from(attr.device_cap_flags) & u64::from(ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0,
        })
    }

    /// The path MTU `port` runs at now, in bytes (256..=4096): a queue
    /// pair's MTU can be no larger.
    pub fn active_mtu(&self, port: u8) -> Result<u32, VerbsError> {
        // SAFETY: plain C struct, zero is a valid value.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `attr` is a valid out-pointer at least as
        // large as the compat struct the exported symbol fills.
        let ret =
            unsafe { ffi::ibv_query_port(self.ctx.as_ptr(), port, (&mut attr as *mut ffi::ibv_port_attr).cast()) };
        if ret != 0 {
            return Err(VerbsError::os("ibv_query_port", ret));
        }
        Ok(match attr.active_mtu {
            ffi::IBV_MTU_256 => 256,
            ffi::IBV_MTU_512 => 512,
            ffi::IBV_MTU_1024 => 1024,
            ffi::IBV_MTU_2048 => 2048,
            ffi::IBV_MTU_4096 => 4096,
            other => return Err(VerbsError::invalid("ibv_query_port", format!("active MTU code {other}"))),
        })
    }

    /// The GID at `index` of `port`.
    pub fn gid(&self, port: u8, index: u8) -> Result<Gid, VerbsError> {
        // SAFETY: plain C union, zero is a valid value.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `gid` is a valid out-pointer.
        let ret = unsafe { ffi::ibv_query_gid(self.ctx.as_ptr(), port, i32::from(index), &mut gid) };
        if ret != 0 {
            return Err(VerbsError::os("ibv_query_gid", ret));
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(Gid(unsafe { gid.raw }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once; every child holds an `Arc`
        // to this context, so none is left.
        let ret = unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
        if ret != 0 {
            tracing::warn!(device = %self.name, ret, "ibv_close_device failed");
        }
    }
}
