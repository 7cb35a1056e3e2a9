//! Thin safe wrappers over the C API: one type per C handle.
//!
//! Ownership mirrors NIXL's lifetimes: every child keeps an `Arc` to its parent, so
//! an [`Agent`] outlives its backends, registrations and requests, and the library
//! outlives every agent. These wrappers are shaped like the C API; in particular
//! [`XferRequest::release`] behaves exactly as NIXL does (it "succeeds" on a request
//! still in progress). [`crate::engine::RealNixlEngine`] adds the guards.

use std::alloc::Layout;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, MutexGuard};

use super::error::{xfer_state, EngineError, LoadError, NixlError, NixlOp, XferState};
use super::ffi::{self, Loaded};
use super::types::{MemRegion, Notification, XferOp};

extern "C" {
    // The C library's allocator: `get_local_md` returns a `malloc`'d buffer and
    // `load_remote_md` a `strdup`'d string, both to be freed with `free`.
    fn free(p: *mut c_void);
}

/// The loaded `libnixl_capi.so`. Cheap to clone; unloaded when the last clone and
/// every object created through it are gone.
#[derive(Clone, Debug)]
pub struct NixlLibrary {
    inner: Arc<Loaded>,
}

impl NixlLibrary {
    /// Finds and opens the library (see the crate docs for the search order) and
    /// sets `NIXL_PLUGIN_DIR` beside it if unset. A missing file or symbol is a
    /// [`LoadError`] whose message says what to install.
    ///
    /// The first successful load is kept for the life of the process and returned
    /// again by later calls: the library is never `dlclose`d, because NIXL and UCX
    /// leave threads and exit handlers behind that would then run unmapped code.
    /// A failed load is retried on the next call.
    pub fn load() -> Result<Self, LoadError> {
        static LOADED: Mutex<Option<Arc<Loaded>>> = Mutex::new(None);
        let mut slot = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = slot.as_ref() {
            return Ok(Self { inner: Arc::clone(l) });
        }
        let l = Arc::new(ffi::load()?);
        *slot = Some(Arc::clone(&l));
        Ok(Self { inner: l })
    }

    /// The file that was opened.
    pub fn path(&self) -> &std::path::Path {
        &self.inner.path
    }

    pub(crate) fn api(&self) -> &ffi::Api {
        &self.inner.api
    }
}

/// NIXL's thread-safety mode for an agent (`nixl_capi_thread_sync_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadSync {
    /// No internal locking (NIXL's default).
    None,
    /// One lock around every agent call.
    #[default]
    Strict,
    /// Reader/writer locking.
    ReadWrite,
}

/// Agent configuration (`nixl_capi_agent_config_t`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// Run NIXL's progress thread, so completions, incoming data and notifications
    /// advance without this process calling in. Default: on (as
    /// `nixl_capi_create_agent` does). With UCX over TCP a *target* that neither
    /// runs it nor polls `get_notifs` never lets an incoming WRITE complete.
    pub progress_thread: bool,
    /// Run NIXL's metadata listener thread. Default: off (metadata is exchanged
    /// out of band).
    pub listen_thread: bool,
    /// Listener port, if `listen_thread`.
    pub listen_port: u16,
    /// Internal locking mode. Default: [`ThreadSync::Strict`].
    pub thread_sync: ThreadSync,
    /// Number of backend workers (0: backend default).
    pub num_workers: u32,
    /// Progress-thread delay in microseconds.
    pub progress_delay_us: u64,
    /// Listener-thread delay in microseconds.
    pub listen_delay_us: u64,
    /// Capture per-request telemetry.
    pub capture_telemetry: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            progress_thread: true,
            listen_thread: false,
            listen_port: 0,
            thread_sync: ThreadSync::Strict,
            num_workers: 0,
            progress_delay_us: 0,
            listen_delay_us: 100_000,
            capture_telemetry: false,
        }
    }
}

fn cstring(what: &str, s: &str) -> Result<CString, EngineError> {
    CString::new(s).map_err(|_| EngineError::InvalidArgument(format!("{what} contains a NUL byte: {s:?}")))
}

/// A NIXL agent (`nixl_capi_agent_t`). Calls into one agent are serialised by a
/// mutex in this wrapper, so it is `Send + Sync` whatever the `ThreadSync` mode.
pub struct Agent {
    lib: NixlLibrary,
    h: ffi::AgentH,
    name: String,
    lock: Mutex<()>,
}

// SAFETY: the handle is a heap object of the C library, not tied to a thread. Every
// call through it takes `lock`, so no two threads of ours use it at once; NIXL's own
// threads synchronise internally.
unsafe impl Send for Agent {}
// SAFETY: see `Send`: shared access only goes through `lock`.
unsafe impl Sync for Agent {}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Agent {
    /// `nixl_capi_create_configured_agent`.
    pub fn new(lib: &NixlLibrary, name: &str, cfg: &AgentConfig) -> Result<Arc<Self>, EngineError> {
        let cname = cstring("agent name", name)?;
        let raw = ffi::RawAgentConfig {
            enable_prog_thread: cfg.progress_thread,
            enable_listen_thread: cfg.listen_thread,
            listen_port: i32::from(cfg.listen_port),
            thread_sync: match cfg.thread_sync {
                ThreadSync::None => 0,
                ThreadSync::Strict => 1,
                ThreadSync::ReadWrite => 2,
            },
            num_workers: cfg.num_workers,
            pthr_delay_us: cfg.progress_delay_us,
            lthr_delay_us: cfg.listen_delay_us,
            capture_telemetry: cfg.capture_telemetry,
        };
        let mut h: ffi::AgentH = ptr::null_mut();
        // SAFETY: `cname` and `raw` outlive the call; `h` is a valid out-pointer.
        let rc = unsafe { (lib.api().create_configured_agent)(cname.as_ptr(), &raw, &mut h) };
        NixlError::check(NixlOp::CreateAgent, rc)?;
        if h.is_null() {
            return Err(NixlError { op: NixlOp::CreateAgent, status: super::error::Status::Backend }.into());
        }
        Ok(Arc::new(Self { lib: lib.clone(), h, name: name.to_owned(), lock: Mutex::new(()) }))
    }

    /// The agent's name (what peers pass as `remote_agent`).
    pub fn name(&self) -> &str {
        &self.name
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        // A panic while holding the lock leaves no C state half-changed that we
        // track, so a poisoned lock is simply taken over.
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn api(&self) -> &ffi::Api {
        self.lib.api()
    }

    /// Creates a backend from `plugin`'s default parameters (from
    /// `get_plugin_params`) with `overrides` applied on top, e.g. `("UCX", [])`.
    pub fn create_backend(
        self: &Arc<Self>,
        plugin: &str,
        overrides: &[(String, String)],
    ) -> Result<Backend, EngineError> {
        let cplugin = cstring("plugin name", plugin)?;
        let over: Vec<(CString, CString)> = overrides
            .iter()
            .map(|(k, v)| Ok((cstring("param key", k)?, cstring("param value", v)?)))
            .collect::<Result<_, EngineError>>()?;
        let _g = self.guard();
        let api = self.api();
        let mut mems: ffi::MemListH = ptr::null_mut();
        let mut params: ffi::ParamsH = ptr::null_mut();
        // SAFETY: valid agent handle; out-pointers are valid locals.
        let rc = unsafe { (api.get_plugin_params)(self.h, cplugin.as_ptr(), &mut mems, &mut params) };
        let res = (|| {
            NixlError::check(NixlOp::GetPluginParams, rc)?;
            if params.is_null() {
                // SAFETY: valid out-pointer.
                let rc = unsafe { (api.create_params)(&mut params) };
                NixlError::check(NixlOp::CreateParams, rc)?;
            }
            for (k, v) in &over {
                // SAFETY: `params` is a live params handle; strings outlive the call.
                let rc = unsafe { (api.params_add)(params, k.as_ptr(), v.as_ptr()) };
                NixlError::check(NixlOp::ParamsAdd, rc)?;
            }
            let mut b: ffi::BackendH = ptr::null_mut();
            // SAFETY: live agent and params handles; `b` is a valid out-pointer.
            let rc = unsafe { (api.create_backend)(self.h, cplugin.as_ptr(), params, &mut b) };
            NixlError::check(NixlOp::CreateBackend, rc)?;
            Ok::<_, NixlError>(b)
        })();
        // SAFETY: each handle was produced by the library and is destroyed once;
        // `create_backend` copies the parameters it needs.
        unsafe {
            if !mems.is_null() {
                (api.destroy_mem_list)(mems);
            }
            if !params.is_null() {
                (api.destroy_params)(params);
            }
        }
        let h = res?;
        Ok(Backend { agent: Arc::clone(self), h, plugin: plugin.to_owned() })
    }

    /// Registers host memory with every backend of this agent (or only `backend`).
    ///
    /// # Safety
    /// Each region must be memory of this process that stays allocated, and that no
    /// Rust reference aliases while a transfer or a peer may write it, until the
    /// returned [`Registration`] is dropped and every request and peer that could
    /// touch it has reached a terminal state or been fenced. NIXL and the NIC read
    /// and write it outside Rust's control.
    pub unsafe fn register_mem(
        self: &Arc<Self>,
        regions: &[MemRegion],
        backend: Option<&Backend>,
    ) -> Result<Registration, EngineError> {
        if regions.is_empty() || regions.iter().any(|r| r.len == 0 || r.addr == 0) {
            return Err(EngineError::InvalidArgument(
                "registration needs at least one region, each with a non-null address and non-zero length".into(),
            ));
        }
        let _g = self.guard();
        let dlist = RegDlist::new(self.lib.clone(), regions)?;
        let opt = OptArgs::new(self.lib.clone(), backend, None)?;
        // SAFETY: live handles; the caller upholds the memory contract above.
        let rc = unsafe { (self.api().register_mem)(self.h, dlist.h, opt.h) };
        NixlError::check(NixlOp::RegisterMem, rc)?;
        Ok(Registration { agent: Arc::clone(self), dlist: Some(dlist), opt, regions: regions.to_vec() })
    }

    /// `get_local_md`: this agent's metadata blob, to hand to peers. The C buffer
    /// is copied and freed at once.
    pub fn local_metadata(&self) -> Result<Vec<u8>, EngineError> {
        let _g = self.guard();
        let mut data: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live agent; out-pointers valid.
        let rc = unsafe { (self.api().get_local_md)(self.h, &mut data, &mut len) };
        NixlError::check(NixlOp::GetLocalMd, rc)?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: on success `data` points to `len` bytes malloc'd by the library;
        // they are copied before the buffer is freed once with the C allocator.
        let out = unsafe {
            let v = std::slice::from_raw_parts(data.cast::<u8>(), len).to_vec();
            free(data);
            v
        };
        Ok(out)
    }

    /// `load_remote_md`: loads a peer's blob; returns the peer's agent name.
    pub fn load_remote_metadata(&self, md: &[u8]) -> Result<String, EngineError> {
        if md.is_empty() {
            return Err(EngineError::InvalidArgument("empty metadata blob".into()));
        }
        let _g = self.guard();
        let mut name: *mut c_char = ptr::null_mut();
        // SAFETY: `md` outlives the call (the library copies it); out-pointer valid.
        let rc = unsafe { (self.api().load_remote_md)(self.h, md.as_ptr().cast(), md.len(), &mut name) };
        NixlError::check(NixlOp::LoadRemoteMd, rc)?;
        if name.is_null() {
            return Err(NixlError { op: NixlOp::LoadRemoteMd, status: super::error::Status::Backend }.into());
        }
        // SAFETY: on success `name` is a NUL-terminated strdup'd string; copied, then
        // freed once with the C allocator.
        let s = unsafe {
            let s = CStr::from_ptr(name).to_string_lossy().into_owned();
            free(name.cast());
            s
        };
        Ok(s)
    }

    /// `invalidate_remote_md`: forgets a peer (its connection and keys).
    pub fn invalidate_remote_metadata(&self, remote_agent: &str) -> Result<(), EngineError> {
        let c = cstring("remote agent", remote_agent)?;
        let _g = self.guard();
        // SAFETY: live agent; string outlives the call.
        let rc = unsafe { (self.api().invalidate_remote_md)(self.h, c.as_ptr()) };
        Ok(NixlError::check(NixlOp::InvalidateRemoteMd, rc)?)
    }

    /// `create_xfer_req`: a request (not yet posted) moving `local[i]` to or from
    /// `remote[i]` on `remote_agent`, with an optional notification message the
    /// target receives once the data has landed.
    pub fn create_xfer(
        self: &Arc<Self>,
        op: XferOp,
        local: &[MemRegion],
        remote: &[MemRegion],
        remote_agent: &str,
        notif: Option<&[u8]>,
        backend: Option<&Backend>,
    ) -> Result<XferRequest, EngineError> {
        super::types::validate_descs(local, remote)?;
        let cremote = cstring("remote agent", remote_agent)?;
        let _g = self.guard();
        let l = XferDlist::new(self.lib.clone(), local)?;
        let r = XferDlist::new(self.lib.clone(), remote)?;
        let opt = OptArgs::new(self.lib.clone(), backend, notif)?;
        let cop = match op {
            XferOp::Read => ffi::XFER_OP_READ,
            XferOp::Write => ffi::XFER_OP_WRITE,
        };
        let mut h: ffi::XferReqH = ptr::null_mut();
        // SAFETY: live handles and strings; `h` is a valid out-pointer. The request
        // copies the descriptor lists and options.
        let rc = unsafe { (self.api().create_xfer_req)(self.h, cop, l.h, r.h, cremote.as_ptr(), &mut h, opt.h) };
        NixlError::check(NixlOp::CreateXferReq, rc)?;
        Ok(XferRequest {
            agent: Arc::clone(self),
            h,
            opt: Some(opt),
            posted: false,
            released: false,
            remote_agent: remote_agent.to_owned(),
        })
    }

    /// `get_notifs`: every notification received since the last call, copied out
    /// of NIXL's map at once.
    pub fn get_notifs(&self) -> Result<Vec<Notification>, EngineError> {
        let _g = self.guard();
        let api = self.api();
        let mut map: ffi::NotifMapH = ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (api.create_notif_map)(&mut map) };
        NixlError::check(NixlOp::CreateNotifMap, rc)?;
        let res = (|| {
            // SAFETY: live agent and map; null opt args means "all backends".
            let rc = unsafe { (api.get_notifs)(self.h, map, ptr::null_mut()) };
            NixlError::check(NixlOp::GetNotifs, rc)?;
            let mut out = Vec::new();
            let mut n_agents = 0usize;
            // SAFETY: live map; valid out-pointer.
            let rc = unsafe { (api.notif_map_size)(map, &mut n_agents) };
            NixlError::check(NixlOp::NotifMapRead, rc)?;
            for i in 0..n_agents {
                let mut name: *const c_char = ptr::null();
                // SAFETY: `i < size`, so the C side never advances past the end.
                let rc = unsafe { (api.notif_map_get_agent_at)(map, i, &mut name) };
                NixlError::check(NixlOp::NotifMapRead, rc)?;
                if name.is_null() {
                    continue;
                }
                // SAFETY: `name` is a NUL-terminated string owned by the map, valid
                // until the map changes; copied at once.
                let agent = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
                let cagent = cstring("agent", &agent)?;
                let mut n = 0usize;
                // SAFETY: live map, valid strings and out-pointer.
                let rc = unsafe { (api.notif_map_get_notifs_size)(map, cagent.as_ptr(), &mut n) };
                NixlError::check(NixlOp::NotifMapRead, rc)?;
                for j in 0..n {
                    let mut data: *const c_void = ptr::null();
                    let mut len = 0usize;
                    // SAFETY: `j < n`; out-pointers valid.
                    let rc = unsafe { (api.notif_map_get_notif)(map, cagent.as_ptr(), j, &mut data, &mut len) };
                    NixlError::check(NixlOp::NotifMapRead, rc)?;
                    let msg = if data.is_null() || len == 0 {
                        Vec::new()
                    } else {
                        // SAFETY: `data` points to `len` bytes owned by the map; copied
                        // before the map is touched again.
                        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
                    };
                    out.push(Notification { agent: agent.clone(), msg });
                }
            }
            Ok::<_, EngineError>(out)
        })();
        // SAFETY: the map was created above and is destroyed once; nothing borrowed
        // from it survives (everything was copied).
        unsafe { (api.destroy_notif_map)(map) };
        res
    }

    /// `gen_notif`: sends `msg` to `remote_agent` (whose metadata must be loaded).
    pub fn gen_notif(&self, remote_agent: &str, msg: &[u8]) -> Result<(), EngineError> {
        let c = cstring("remote agent", remote_agent)?;
        let _g = self.guard();
        // SAFETY: live agent; buffers outlive the call (copied by the library).
        let rc = unsafe { (self.api().gen_notif)(self.h, c.as_ptr(), msg.as_ptr().cast(), msg.len(), ptr::null_mut()) };
        Ok(NixlError::check(NixlOp::GenNotif, rc)?)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Every child holds an `Arc<Agent>`, so nothing of ours refers to it now.
        // SAFETY: the handle is live and destroyed exactly once.
        let rc = unsafe { (self.api().destroy_agent)(self.h) };
        if let Err(e) = NixlError::check(NixlOp::DestroyAgent, rc) {
            tracing::warn!(agent = %self.name, error = %e, "destroying NIXL agent failed");
        }
    }
}

/// A backend instance of an agent (`nixl_capi_backend_t`), e.g. UCX.
pub struct Backend {
    agent: Arc<Agent>,
    h: ffi::BackendH,
    plugin: String,
}

// SAFETY: the wrapper handle is only read (passed by value to the C API) under the
// agent's lock, and freed once in `drop`.
unsafe impl Send for Backend {}
// SAFETY: see `Send`.
unsafe impl Sync for Backend {}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").field("plugin", &self.plugin).field("agent", &self.agent.name).finish_non_exhaustive()
    }
}

impl Backend {
    /// The plugin name.
    pub fn plugin(&self) -> &str {
        &self.plugin
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _g = self.agent.guard();
        // SAFETY: frees only the C wrapper object (the engine itself belongs to the
        // agent, kept alive by `self.agent`); destroyed exactly once.
        unsafe { (self.agent.api().destroy_backend)(self.h) };
    }
}

/// Owned option arguments (`nixl_capi_opt_args_t`).
struct OptArgs {
    lib: NixlLibrary,
    h: ffi::OptArgsH,
}

impl OptArgs {
    fn new(lib: NixlLibrary, backend: Option<&Backend>, notif: Option<&[u8]>) -> Result<Self, EngineError> {
        let mut h: ffi::OptArgsH = ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (lib.api().create_opt_args)(&mut h) };
        NixlError::check(NixlOp::CreateOptArgs, rc)?;
        let me = Self { lib, h };
        if let Some(b) = backend {
            // SAFETY: live handles; the opt args copy the backend pointer, whose
            // engine lives as long as the agent.
            let rc = unsafe { (me.lib.api().opt_args_add_backend)(me.h, b.h) };
            NixlError::check(NixlOp::OptArgsAddBackend, rc)?;
        }
        if let Some(msg) = notif {
            // SAFETY: the message is copied by the library.
            let rc = unsafe { (me.lib.api().opt_args_set_notif_msg)(me.h, msg.as_ptr().cast(), msg.len()) };
            NixlError::check(NixlOp::OptArgsSetNotifMsg, rc)?;
            // SAFETY: live handle.
            let rc = unsafe { (me.lib.api().opt_args_set_has_notif)(me.h, true) };
            NixlError::check(NixlOp::OptArgsSetHasNotif, rc)?;
        }
        Ok(me)
    }
}

impl Drop for OptArgs {
    fn drop(&mut self) {
        // SAFETY: created by `create_opt_args`, destroyed once.
        unsafe { (self.lib.api().destroy_opt_args)(self.h) };
    }
}

/// A list's one memory type, or why the regions have none.
fn mem_of(regions: &[MemRegion]) -> Result<super::types::MemType, EngineError> {
    super::types::list_mem_type(regions).ok_or_else(|| {
        EngineError::InvalidArgument("a descriptor list needs at least one region, all of one memory type".into())
    })
}

struct RegDlist {
    lib: NixlLibrary,
    h: ffi::RegDlistH,
}

impl RegDlist {
    fn new(lib: NixlLibrary, regions: &[MemRegion]) -> Result<Self, EngineError> {
        let mut h: ffi::RegDlistH = ptr::null_mut();
        let mem = ffi::mem_type(mem_of(regions)?);
        // SAFETY: valid out-pointer.
        let rc = unsafe { (lib.api().create_reg_dlist)(mem, &mut h) };
        NixlError::check(NixlOp::CreateRegDlist, rc)?;
        let me = Self { lib, h };
        for r in regions {
            // SAFETY: live list; no per-descriptor metadata (null, 0).
            let rc = unsafe { (me.lib.api().reg_dlist_add_desc)(me.h, r.addr, r.len, r.dev_id, ptr::null(), 0) };
            NixlError::check(NixlOp::RegDlistAddDesc, rc)?;
        }
        Ok(me)
    }
}

impl Drop for RegDlist {
    fn drop(&mut self) {
        // SAFETY: created by `create_reg_dlist`, destroyed once.
        unsafe { (self.lib.api().destroy_reg_dlist)(self.h) };
    }
}

struct XferDlist {
    lib: NixlLibrary,
    h: ffi::XferDlistH,
}

impl XferDlist {
    fn new(lib: NixlLibrary, regions: &[MemRegion]) -> Result<Self, EngineError> {
        let mut h: ffi::XferDlistH = ptr::null_mut();
        let mem = ffi::mem_type(mem_of(regions)?);
        // SAFETY: valid out-pointer.
        let rc = unsafe { (lib.api().create_xfer_dlist)(mem, &mut h) };
        NixlError::check(NixlOp::CreateXferDlist, rc)?;
        let me = Self { lib, h };
        for r in regions {
            // SAFETY: live list.
            let rc = unsafe { (me.lib.api().xfer_dlist_add_desc)(me.h, r.addr, r.len, r.dev_id) };
            NixlError::check(NixlOp::XferDlistAddDesc, rc)?;
        }
        Ok(me)
    }
}

impl Drop for XferDlist {
    fn drop(&mut self) {
        // SAFETY: created by `create_xfer_dlist`, destroyed once.
        unsafe { (self.lib.api().destroy_xfer_dlist)(self.h) };
    }
}

/// Registered host memory. Dropping it deregisters (`deregister_mem`), which NIXL
/// does without any in-flight check: drop it only when no request and no peer can
/// still touch it.
pub struct Registration {
    agent: Arc<Agent>,
    dlist: Option<RegDlist>,
    opt: OptArgs,
    regions: Vec<MemRegion>,
}

// SAFETY: handles are used only under the agent's lock (in `deregister`/`drop`).
unsafe impl Send for Registration {}
// SAFETY: `&Registration` exposes only plain data.
unsafe impl Sync for Registration {}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("agent", &self.agent.name)
            .field("regions", &self.regions)
            .finish_non_exhaustive()
    }
}

impl Registration {
    /// The registered regions.
    pub fn regions(&self) -> &[MemRegion] {
        &self.regions
    }

    /// Deregisters now and reports the status (drop does the same silently).
    pub fn deregister(mut self) -> Result<(), EngineError> {
        self.do_deregister()
    }

    fn do_deregister(&mut self) -> Result<(), EngineError> {
        let Some(dlist) = self.dlist.take() else {
            return Ok(());
        };
        let _g = self.agent.guard();
        // SAFETY: live handles; the registration was made with this same list.
        let rc = unsafe { (self.agent.api().deregister_mem)(self.agent.h, dlist.h, self.opt.h) };
        Ok(NixlError::check(NixlOp::DeregisterMem, rc)?)
    }

    /// Leaks this registration: the memory stays registered for the life of the
    /// process (and the agent is never destroyed). For memory a NIC may still touch.
    pub fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(e) = self.do_deregister() {
            tracing::warn!(error = %e, "deregister_mem failed on drop");
        }
    }
}

/// A transfer request (`nixl_capi_xfer_req_t`).
///
/// Dropping a request that is still in progress does **not** release it: the drop
/// polls once, and if the request is not terminal it leaks the request and keeps its
/// agent alive forever (a leak, never an early reuse).
pub struct XferRequest {
    agent: Arc<Agent>,
    h: ffi::XferReqH,
    opt: Option<OptArgs>,
    posted: bool,
    released: bool,
    remote_agent: String,
}

// SAFETY: the handle is used only under the agent's lock.
unsafe impl Send for XferRequest {}
// SAFETY: `&XferRequest` methods take the agent's lock before any C call.
unsafe impl Sync for XferRequest {}

impl std::fmt::Debug for XferRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XferRequest")
            .field("agent", &self.agent.name)
            .field("remote_agent", &self.remote_agent)
            .field("posted", &self.posted)
            .finish_non_exhaustive()
    }
}

impl XferRequest {
    /// The peer this request targets.
    pub fn remote_agent(&self) -> &str {
        &self.remote_agent
    }

    /// Whether `post` has been called.
    pub fn is_posted(&self) -> bool {
        self.posted
    }

    /// `post_xfer_req`: `Done` if it completed at once, `InProgress` if it goes on.
    /// The notification set at creation goes with it.
    pub fn post(&mut self) -> Result<XferState, NixlError> {
        let _g = self.agent.guard();
        self.posted = true;
        // SAFETY: live handles; null opt args keeps the options given at creation.
        let rc = unsafe { (self.agent.api().post_xfer_req)(self.agent.h, self.h, ptr::null_mut()) };
        xfer_state(NixlOp::PostXferReq, rc)
    }

    /// `get_xfer_status`. Polling also drives progress (and the notification) when
    /// the agent has no progress thread.
    pub fn status(&self) -> Result<XferState, NixlError> {
        let _g = self.agent.guard();
        // SAFETY: live handles.
        let rc = unsafe { (self.agent.api().get_xfer_status)(self.agent.h, self.h) };
        xfer_state(NixlOp::GetXferStatus, rc)
    }

    /// `release_xfer_req` then `destroy_xfer_req`, exactly as NIXL does them.
    ///
    /// **Hazard:** with UCX, releasing a request that is still `InProgress` returns
    /// success while its RMA keeps landing, and its notification is never sent.
    /// Call this only after [`status`](Self::status) returned `Done` or an error.
    /// On failure the request is handed back with the error.
    pub fn release(mut self) -> Result<(), (Self, NixlError)> {
        match self.do_release() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn do_release(&mut self) -> Result<(), NixlError> {
        if self.released {
            return Ok(());
        }
        let _g = self.agent.guard();
        let api = self.agent.api();
        // SAFETY: live handles. On success the C wrapper clears its inner request, so
        // `destroy_xfer_req` then frees only the wrapper.
        let rc = unsafe { (api.release_xfer_req)(self.agent.h, self.h) };
        NixlError::check(NixlOp::ReleaseXferReq, rc)?;
        self.released = true;
        // SAFETY: released above; destroyed exactly once.
        let rc = unsafe { (api.destroy_xfer_req)(self.h) };
        if let Err(e) = NixlError::check(NixlOp::DestroyXferReq, rc) {
            tracing::warn!(error = %e, "destroy_xfer_req failed after release; wrapper leaked");
        }
        self.opt = None;
        Ok(())
    }
}

impl Drop for XferRequest {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let terminal = !self.posted || !matches!(self.status(), Ok(XferState::InProgress));
        if terminal {
            if let Err(e) = self.do_release() {
                tracing::warn!(error = %e, "release_xfer_req failed on drop; request leaked");
                std::mem::forget(Arc::clone(&self.agent));
            }
        } else {
            tracing::warn!(
                agent = %self.agent.name,
                remote = %self.remote_agent,
                "dropping an in-progress NIXL request: leaking it and its agent instead of releasing"
            );
            // Keep the agent (and with it the registrations' keys and the
            // connection) alive for the rest of the process.
            std::mem::forget(Arc::clone(&self.agent));
            if let Some(opt) = self.opt.take() {
                std::mem::forget(opt);
            }
        }
    }
}

/// Page-aligned, zeroed host memory owned by this process, for registration.
///
/// Its bytes are only reached through copies (never through a long-lived Rust
/// reference), because a NIC may write them at any time while registered.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an owned heap allocation; shared access only copies out.
unsafe impl Send for HostBuffer {}
// SAFETY: `&self` methods only copy bytes out; mutation needs `&mut self`.
unsafe impl Sync for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("addr", &format_args!("{:#x}", self.addr())).field("len", &self.len).finish()
    }
}

const PAGE: usize = 4096;

impl HostBuffer {
    /// Allocates `len` zeroed bytes (`len > 0`), aligned to 4 KiB.
    pub fn new(len: usize) -> Result<Self, EngineError> {
        let layout = Layout::from_size_align(len, PAGE)
            .ok()
            .filter(|_| len > 0)
            .ok_or_else(|| EngineError::InvalidArgument(format!("bad buffer length {len}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p)
            .ok_or_else(|| EngineError::InvalidArgument(format!("out of memory allocating {len} bytes")))?;
        Ok(Self { ptr, len })
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer as a region (device id 0).
    pub fn region(&self) -> MemRegion {
        MemRegion::new(self.addr(), self.len)
    }

    /// A sub-range as a region, bounds-checked.
    pub fn sub_region(&self, offset: usize, len: usize) -> Result<MemRegion, EngineError> {
        self.check(offset, len)?;
        Ok(MemRegion::new(self.addr() + offset, len))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), EngineError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => {
                Err(EngineError::InvalidArgument(format!("range {offset}+{len} outside buffer of {} bytes", self.len)))
            }
        }
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), EngineError> {
        self.check(offset, out.len())?;
        // SAFETY: in bounds (checked); `out` is a distinct Rust buffer.
        unsafe { ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies the whole buffer out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: exactly `len` bytes, in bounds.
        unsafe { ptr::copy_nonoverlapping(self.ptr.as_ptr(), v.as_mut_ptr(), self.len) };
        v
    }

    /// Copies `data` in at `offset`.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<(), EngineError> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds (checked); `data` is a distinct Rust buffer.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Sets every byte to `byte`.
    pub fn fill(&mut self, byte: u8) {
        // SAFETY: exactly `len` bytes, in bounds.
        unsafe { ptr::write_bytes(self.ptr.as_ptr(), byte, self.len) };
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this exact layout (validated there).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, PAGE)) };
    }
}
