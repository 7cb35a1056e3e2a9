//! Raw declarations of the NIXL C API (`libnixl_capi.so`) and the run-time loader.
//!
//! The declarations are written from the public header `src/bindings/rust/wrapper.h`
//! of the NIXL repository and checked against `nm -D` on the `nixl-cu12==1.5.1`
//! wheel. Nothing here is public outside the engine layer.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};

use super::error::LoadError;

/// `nixl_capi_status_t` (a C enum, `int`-sized).
pub(crate) type RawStatus = c_int;

/// `nixl_capi_mem_type_t`: host memory.
pub(crate) const MEM_DRAM: c_int = 0;
/// `nixl_capi_mem_type_t`: GPU memory.
pub(crate) const MEM_VRAM: c_int = 1;

/// The C value of a descriptor list's memory type.
pub(crate) fn mem_type(m: super::types::MemType) -> c_int {
    match m {
        super::types::MemType::Dram => MEM_DRAM,
        super::types::MemType::Vram => MEM_VRAM,
    }
}

/// `nixl_capi_xfer_op_t`.
pub(crate) const XFER_OP_READ: c_int = 0;
/// `nixl_capi_xfer_op_t`.
pub(crate) const XFER_OP_WRITE: c_int = 1;

/// Opaque handle types: all are pointers to incomplete C structs.
pub(crate) type AgentH = *mut c_void;
pub(crate) type ParamsH = *mut c_void;
pub(crate) type MemListH = *mut c_void;
pub(crate) type BackendH = *mut c_void;
pub(crate) type OptArgsH = *mut c_void;
pub(crate) type XferDlistH = *mut c_void;
pub(crate) type RegDlistH = *mut c_void;
pub(crate) type XferReqH = *mut c_void;
pub(crate) type NotifMapH = *mut c_void;

/// `nixl_capi_agent_config_t`, laid out as the C struct (natural alignment,
/// no packing): bool, bool, int, enum(int), unsigned, u64, u64, bool.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawAgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: c_int,
    pub num_workers: c_uint,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

/// Declares the function-pointer table and its loader in one place, so the list of
/// symbols looked up and the list of fields cannot drift apart.
macro_rules! capi {
    ($( $field:ident : fn( $($arg:ty),* ) ; )*) => {
        /// Every C function this crate calls, resolved once at load time.
        #[allow(clippy::type_complexity)]
        pub(crate) struct Api {
            $( pub(crate) $field: unsafe extern "C" fn($($arg),*) -> RawStatus, )*
        }

        impl Api {
            /// Resolves every symbol; the first one missing is a typed error.
            ///
            /// # Safety
            /// `lib` must be the NIXL C API library, so that each symbol has the
            /// signature declared here (taken from its public header).
            unsafe fn resolve(lib: &libloading::Library, path: &Path) -> Result<Self, LoadError> {
                Ok(Self {
                    $( $field: {
                        let name = concat!("nixl_capi_", stringify!($field), "\0");
                        // SAFETY: the caller guarantees this is libnixl_capi; the type is
                        // the header's prototype. The pointer is copied out of the
                        // `Symbol`, and stays valid because `Library` outlives `Api`
                        // (both live in `NixlLibrary`, which is never unloaded early).
                        let got = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> RawStatus>(name.as_bytes())
                        };
                        let sym = got.map_err(|e| LoadError::MissingSymbol {
                            symbol: name.trim_end_matches('\0').to_owned(),
                            path: path.to_path_buf(),
                            reason: e.to_string(),
                        })?;
                        *sym
                    }, )*
                })
            }
        }
    };
}

capi! {
    create_configured_agent: fn(*const c_char, *const RawAgentConfig, *mut AgentH);
    destroy_agent: fn(AgentH);
    get_local_md: fn(AgentH, *mut *mut c_void, *mut usize);
    load_remote_md: fn(AgentH, *const c_void, usize, *mut *mut c_char);
    invalidate_remote_md: fn(AgentH, *const c_char);
    get_plugin_params: fn(AgentH, *const c_char, *mut MemListH, *mut ParamsH);
    destroy_mem_list: fn(MemListH);
    create_params: fn(*mut ParamsH);
    params_add: fn(ParamsH, *const c_char, *const c_char);
    destroy_params: fn(ParamsH);
    create_backend: fn(AgentH, *const c_char, ParamsH, *mut BackendH);
    destroy_backend: fn(BackendH);
    create_opt_args: fn(*mut OptArgsH);
    destroy_opt_args: fn(OptArgsH);
    opt_args_add_backend: fn(OptArgsH, BackendH);
    opt_args_set_notif_msg: fn(OptArgsH, *const c_void, usize);
    opt_args_set_has_notif: fn(OptArgsH, bool);
    create_reg_dlist: fn(c_int, *mut RegDlistH);
    reg_dlist_add_desc: fn(RegDlistH, usize, usize, u64, *const c_void, usize);
    destroy_reg_dlist: fn(RegDlistH);
    register_mem: fn(AgentH, RegDlistH, OptArgsH);
    deregister_mem: fn(AgentH, RegDlistH, OptArgsH);
    create_xfer_dlist: fn(c_int, *mut XferDlistH);
    xfer_dlist_add_desc: fn(XferDlistH, usize, usize, u64);
    destroy_xfer_dlist: fn(XferDlistH);
    create_xfer_req: fn(AgentH, c_int, XferDlistH, XferDlistH, *const c_char, *mut XferReqH, OptArgsH);
    post_xfer_req: fn(AgentH, XferReqH, OptArgsH);
    get_xfer_status: fn(AgentH, XferReqH);
    release_xfer_req: fn(AgentH, XferReqH);
    destroy_xfer_req: fn(XferReqH);
    create_notif_map: fn(*mut NotifMapH);
    destroy_notif_map: fn(NotifMapH);
    get_notifs: fn(AgentH, NotifMapH, OptArgsH);
    notif_map_size: fn(NotifMapH, *mut usize);
    notif_map_get_agent_at: fn(NotifMapH, usize, *mut *const c_char);
    notif_map_get_notifs_size: fn(NotifMapH, *const c_char, *mut usize);
    notif_map_get_notif: fn(NotifMapH, *const c_char, usize, *mut *const c_void, *mut usize);
    gen_notif: fn(AgentH, *const c_char, *const c_void, usize, OptArgsH);
}

/// The loaded library and its resolved functions. Kept alive by an `Arc` in every
/// object that can still call into it, so it is unloaded last.
pub(crate) struct Loaded {
    pub(crate) api: Api,
    pub(crate) path: PathBuf,
    // Field order matters: `api` holds plain function pointers into `_lib`; `_lib` is
    // dropped last of all.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("path", &self.path).finish_non_exhaustive()
    }
}

/// The library's file name.
pub(crate) const LIB_NAME: &str = "libnixl_capi.so";

/// Where the build found the workspace root (the directory above this crate).
const MANIFEST_DIR: &str = env!("CARGO_MANIFEST_DIR");

/// Candidate directories for `libnixl_capi.so`, in the order they are tried.
pub(crate) fn candidate_dirs() -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os("NIXL_LIB_DIR") {
        // An explicit directory wins and is the only candidate: a wrong setting must
        // be reported, not silently replaced by another copy.
        return vec![PathBuf::from(dir)];
    }
    let mut venvs = Vec::new();
    if let Some(v) = std::env::var_os("KVT_ENGINES_VENV") {
        venvs.push(PathBuf::from(v));
    }
    // Walk up from this crate's manifest directory: the first ancestor holding an
    // `.engines` venv is the workspace root.
    // The canonical path is tried too, for a crate reached through a symlink.
    let manifest = Path::new(MANIFEST_DIR);
    let canon = std::fs::canonicalize(manifest).ok();
    for start in std::iter::once(manifest).chain(canon.as_deref()) {
        if let Some(cand) = start.ancestors().map(|a| a.join(".engines")).find(|c| c.is_dir()) {
            if !venvs.contains(&cand) {
                venvs.push(cand);
            }
        }
    }
    let mut dirs = Vec::new();
    for venv in venvs {
        for lib in ["lib", "lib64"] {
            let Ok(entries) = std::fs::read_dir(venv.join(lib)) else {
                continue;
            };
            let mut pys: Vec<PathBuf> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python3.")))
                .collect();
            pys.sort();
            for py in pys {
                let d = py.join("site-packages").join(".nixl_cu12.mesonpy.libs");
                if !dirs.contains(&d) {
                    dirs.push(d);
                }
            }
        }
    }
    dirs
}

/// True if the kernel lists any RDMA device.
fn has_rdma_devices() -> bool {
    std::fs::read_dir("/sys/class/infiniband").map(|mut d| d.next().is_some()).unwrap_or(false)
}

/// Opens `libnixl_capi.so` and resolves every symbol this crate uses.
pub(crate) fn load() -> Result<Loaded, LoadError> {
    let dirs = candidate_dirs();
    let Some(dir) = dirs.iter().find(|d| d.join(LIB_NAME).is_file()) else {
        return Err(LoadError::NotFound { searched: dirs });
    };
    let path = dir.join(LIB_NAME);
    if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
        let plugins = dir.join("plugins");
        tracing::debug!(plugins = %plugins.display(), "setting NIXL_PLUGIN_DIR");
        // The plugin manager reads this when the first agent is created, which is
        // after this point. Setting the environment is racy only against threads that
        // read or write it concurrently; it is done once, before the first agent.
        std::env::set_var("NIXL_PLUGIN_DIR", plugins);
    }
    if std::env::var_os("UCX_MODULES").is_none() && !has_rdma_devices() {
        // Without RDMA devices the IB transport modules are useless, and loading
        // them brings in the wheel's libnl-route, whose destructor crashes the
        // process at exit (SIGSEGV in rtnl_tc_unregister from _dl_fini, seen with
        // nixl-cu12 1.5.1 / UCX 1.23). Skip them; an explicit setting wins.
        tracing::debug!("no RDMA device: setting UCX_MODULES=^ib*");
        std::env::set_var("UCX_MODULES", "^ib*");
    }
    // SAFETY: loading a shared library runs its initialisers. This is the NIXL C API
    // library from the pinned wheel, whose initialisers only set up C++ statics.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| LoadError::Open { path: path.clone(), reason: e.to_string() })?;
    // SAFETY: `lib` is libnixl_capi; the prototypes come from its public header.
    let api = unsafe { Api::resolve(&lib, &path) }?;
    Ok(Loaded { api, path, _lib: lib })
}
