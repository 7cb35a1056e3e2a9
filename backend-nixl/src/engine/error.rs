//! Status codes and typed errors of the engine layer.

use std::fmt;
use std::path::PathBuf;

/// The command that installs the library this crate loads.
pub const INSTALL_HINT: &str = "python3 -m venv .engines && .engines/bin/pip install --no-deps nixl-cu12==1.5.1";

/// A NIXL C API status code (`nixl_capi_status_t`), every value mapped.
///
/// Only [`Status::Success`] is success. [`Status::InProgress`] is a non-terminal
/// status: neither success nor an error. Any code this crate does not know is
/// [`Status::Unknown`], which is treated as an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// `NIXL_CAPI_SUCCESS` (0).
    Success,
    /// `NIXL_CAPI_IN_PROG` (1): the operation goes on.
    InProgress,
    /// `NIXL_CAPI_ERROR_INVALID_PARAM` (-1).
    InvalidParam,
    /// `NIXL_CAPI_ERROR_BACKEND` (-2): most engine errors collapse into this one.
    Backend,
    /// `NIXL_CAPI_ERROR_INVALID_STATE` (-3).
    InvalidState,
    /// `NIXL_CAPI_ERROR_EXCEPTION` (-4).
    Exception,
    /// `NIXL_CAPI_ERROR_NO_TELEMETRY` (-5).
    NoTelemetry,
    /// `NIXL_CAPI_ERROR_NOT_FOUND` (-6): metadata not loaded, or no backend serves it.
    NotFound,
    /// Any other code: an error, never success.
    Unknown(i32),
}

impl Status {
    /// Maps a raw C status code.
    pub fn from_raw(code: i32) -> Self {
        match code {
            0 => Self::Success,
            1 => Self::InProgress,
            -1 => Self::InvalidParam,
            -2 => Self::Backend,
            -3 => Self::InvalidState,
            -4 => Self::Exception,
            -5 => Self::NoTelemetry,
            -6 => Self::NotFound,
            other => Self::Unknown(other),
        }
    }

    /// The raw C status code.
    pub fn to_raw(self) -> i32 {
        match self {
            Self::Success => 0,
            Self::InProgress => 1,
            Self::InvalidParam => -1,
            Self::Backend => -2,
            Self::InvalidState => -3,
            Self::Exception => -4,
            Self::NoTelemetry => -5,
            Self::NotFound => -6,
            Self::Unknown(c) => c,
        }
    }

    /// True for every status except `Success` and `InProgress`.
    pub fn is_error(self) -> bool {
        !matches!(self, Self::Success | Self::InProgress)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Success => f.write_str("SUCCESS (0)"),
            Self::InProgress => f.write_str("IN_PROG (1)"),
            Self::InvalidParam => f.write_str("ERROR_INVALID_PARAM (-1)"),
            Self::Backend => f.write_str("ERROR_BACKEND (-2)"),
            Self::InvalidState => f.write_str("ERROR_INVALID_STATE (-3)"),
            Self::Exception => f.write_str("ERROR_EXCEPTION (-4)"),
            Self::NoTelemetry => f.write_str("ERROR_NO_TELEMETRY (-5)"),
            Self::NotFound => f.write_str("ERROR_NOT_FOUND (-6)"),
            Self::Unknown(c) => write!(f, "unknown status ({c})"),
        }
    }
}

/// The C API operation that returned a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // each variant is the C function of the same name
pub enum NixlOp {
    CreateAgent,
    DestroyAgent,
    GetPluginParams,
    CreateParams,
    ParamsAdd,
    CreateBackend,
    CreateOptArgs,
    OptArgsAddBackend,
    OptArgsSetNotifMsg,
    OptArgsSetHasNotif,
    CreateRegDlist,
    RegDlistAddDesc,
    RegisterMem,
    DeregisterMem,
    GetLocalMd,
    LoadRemoteMd,
    InvalidateRemoteMd,
    CreateXferDlist,
    XferDlistAddDesc,
    CreateXferReq,
    PostXferReq,
    GetXferStatus,
    ReleaseXferReq,
    DestroyXferReq,
    CreateNotifMap,
    GetNotifs,
    NotifMapRead,
    GenNotif,
}

impl NixlOp {
    /// The C function name, without the `nixl_capi_` prefix.
    pub fn c_name(self) -> &'static str {
        match self {
            Self::CreateAgent => "create_configured_agent",
            Self::DestroyAgent => "destroy_agent",
            Self::GetPluginParams => "get_plugin_params",
            Self::CreateParams => "create_params",
            Self::ParamsAdd => "params_add",
            Self::CreateBackend => "create_backend",
            Self::CreateOptArgs => "create_opt_args",
            Self::OptArgsAddBackend => "opt_args_add_backend",
            Self::OptArgsSetNotifMsg => "opt_args_set_notif_msg",
            Self::OptArgsSetHasNotif => "opt_args_set_has_notif",
            Self::CreateRegDlist => "create_reg_dlist",
            Self::RegDlistAddDesc => "reg_dlist_add_desc",
            Self::RegisterMem => "register_mem",
            Self::DeregisterMem => "deregister_mem",
            Self::GetLocalMd => "get_local_md",
            Self::LoadRemoteMd => "load_remote_md",
            Self::InvalidateRemoteMd => "invalidate_remote_md",
            Self::CreateXferDlist => "create_xfer_dlist",
            Self::XferDlistAddDesc => "xfer_dlist_add_desc",
            Self::CreateXferReq => "create_xfer_req",
            Self::PostXferReq => "post_xfer_req",
            Self::GetXferStatus => "get_xfer_status",
            Self::ReleaseXferReq => "release_xfer_req",
            Self::DestroyXferReq => "destroy_xfer_req",
            Self::CreateNotifMap => "create_notif_map",
            Self::GetNotifs => "get_notifs",
            Self::NotifMapRead => "notif_map_get_*",
            Self::GenNotif => "gen_notif",
        }
    }
}

impl fmt::Display for NixlOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nixl_capi_{}", self.c_name())
    }
}

/// A C API call returned a status that is not success for that call.
///
/// `status` is never [`Status::Success`]. It is [`Status::InProgress`] only when a
/// call that has no in-progress state (anything but post and status) returned 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{op} failed: {status}")]
pub struct NixlError {
    /// The call.
    pub op: NixlOp,
    /// What it returned.
    pub status: Status,
}

impl NixlError {
    /// Maps the return code of a call that has no in-progress state: only 0 is `Ok`.
    pub fn check(op: NixlOp, code: i32) -> Result<(), NixlError> {
        match Status::from_raw(code) {
            Status::Success => Ok(()),
            status => Err(NixlError { op, status }),
        }
    }
}

/// The state of a posted transfer: 0 is `Done`, 1 is `InProgress`, anything else
/// an error (see [`xfer_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferState {
    /// Not terminal: the NIC may still read or write the descriptors.
    InProgress,
    /// Terminal success: every descriptor completed.
    Done,
}

/// Maps the return code of `post_xfer_req` or `get_xfer_status`.
pub fn xfer_state(op: NixlOp, code: i32) -> Result<XferState, NixlError> {
    match Status::from_raw(code) {
        Status::Success => Ok(XferState::Done),
        Status::InProgress => Ok(XferState::InProgress),
        status => Err(NixlError { op, status }),
    }
}

/// The library could not be loaded. The message always says what to install.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    /// No `libnixl_capi.so` in any candidate directory.
    #[error(
        "libnixl_capi.so not found (searched: {searched:?}); install it at the workspace root with \
         `{INSTALL_HINT}`, or set NIXL_LIB_DIR to the directory holding libnixl_capi.so \
         (or KVT_ENGINES_VENV to the venv)"
    )]
    NotFound {
        /// Directories tried.
        searched: Vec<PathBuf>,
    },
    /// The file exists but `dlopen` failed.
    #[error("cannot open {path:?}: {reason}; reinstall with `{INSTALL_HINT}`")]
    Open {
        /// The file.
        path: PathBuf,
        /// `dlerror` text.
        reason: String,
    },
    /// A symbol this crate needs is not exported (wrong NIXL version).
    #[error("{path:?} lacks symbol {symbol} ({reason}); install the pinned version with `{INSTALL_HINT}`")]
    MissingSymbol {
        /// The missing symbol.
        symbol: String,
        /// The file.
        path: PathBuf,
        /// `dlerror` text.
        reason: String,
    },
}

/// Identifies a transfer request inside one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReqId(pub u64);

impl fmt::Display for ReqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req#{}", self.0)
    }
}

/// Identifies a memory registration inside one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegId(pub u64);

impl fmt::Display for RegId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "reg#{}", self.0)
    }
}

/// Every error of the engine layer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The library could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A C API call failed.
    #[error(transparent)]
    Nixl(#[from] NixlError),
    /// The request was created but posting it failed. The request still exists:
    /// poll it with `xfer_status` and release it only once that is terminal
    /// (NIXL may have posted part of it before failing).
    #[error("posting {id} failed: {source}")]
    PostFailed {
        /// The request, still owned by the engine.
        id: ReqId,
        /// The post's status.
        source: NixlError,
    },
    /// A bad argument caught before any C call (interior NUL, empty or
    /// mismatched descriptor lists, zero length...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No live request with that id (never created, or already released).
    #[error("unknown request {0}")]
    UnknownRequest(ReqId),
    /// No live registration with that id.
    #[error("unknown registration {0}")]
    UnknownRegistration(RegId),
    /// The engine refused to release a request whose last observed state is
    /// `InProgress`: releasing it would let the NIC keep writing memory that is then
    /// handed back. Poll it to a terminal status first.
    #[error("{0} is still in progress; refusing to release it")]
    StillInProgress(ReqId),
    /// The engine refused an operation while requests are live: `deregister`
    /// or `invalidate_remote_metadata` with unreleased requests that may touch it.
    #[error("busy: {live} live request(s) may still touch this; {what}")]
    Busy {
        /// What was refused.
        what: String,
        /// How many live requests block it.
        live: usize,
    },
}

impl EngineError {
    /// The NIXL status behind this error, if it came from a C call.
    pub fn status(&self) -> Option<Status> {
        match self {
            Self::Nixl(e) | Self::PostFailed { source: e, .. } => Some(e.status),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_code_maps_and_round_trips() {
        let table = [
            (0, Status::Success),
            (1, Status::InProgress),
            (-1, Status::InvalidParam),
            (-2, Status::Backend),
            (-3, Status::InvalidState),
            (-4, Status::Exception),
            (-5, Status::NoTelemetry),
            (-6, Status::NotFound),
        ];
        for (code, st) in table {
            assert_eq!(Status::from_raw(code), st);
            assert_eq!(st.to_raw(), code);
        }
        for code in [2, 3, -7, -100, i32::MIN, i32::MAX] {
            let st = Status::from_raw(code);
            assert_eq!(st, Status::Unknown(code));
            assert!(st.is_error());
            assert_eq!(st.to_raw(), code);
        }
    }

    #[test]
    fn only_zero_is_success_for_plain_calls() {
        assert_eq!(NixlError::check(NixlOp::RegisterMem, 0), Ok(()));
        let e = NixlError::check(NixlOp::RegisterMem, 1).unwrap_err();
        assert_eq!(e.status, Status::InProgress);
        for code in [-1, -2, -3, -4, -5, -6, 7, -9] {
            let e = NixlError::check(NixlOp::LoadRemoteMd, code).unwrap_err();
            assert_eq!(e.op, NixlOp::LoadRemoteMd);
            assert_eq!(e.status.to_raw(), code);
        }
    }

    #[test]
    fn in_prog_is_not_terminal_and_unknown_is_an_error() {
        assert_eq!(xfer_state(NixlOp::GetXferStatus, 1), Ok(XferState::InProgress));
        assert_eq!(xfer_state(NixlOp::GetXferStatus, 0), Ok(XferState::Done));
        let e = xfer_state(NixlOp::GetXferStatus, -2).unwrap_err();
        assert_eq!(e.status, Status::Backend);
        let e = xfer_state(NixlOp::PostXferReq, 42).unwrap_err();
        assert_eq!(e.status, Status::Unknown(42));
        assert_eq!(e.op, NixlOp::PostXferReq);
        assert!(e.to_string().contains("nixl_capi_post_xfer_req"));
        assert!(e.to_string().contains("42"));
    }

    #[test]
    fn load_errors_say_what_to_install() {
        let errs = [
            LoadError::NotFound { searched: vec![] },
            LoadError::Open { path: "/x".into(), reason: "r".into() },
            LoadError::MissingSymbol { symbol: "nixl_capi_x".into(), path: "/x".into(), reason: "r".into() },
        ];
        for e in errs {
            let msg = EngineError::from(e).to_string();
            assert!(msg.contains(INSTALL_HINT), "{msg}");
        }
    }

    #[test]
    fn engine_error_exposes_status() {
        let e = EngineError::PostFailed {
            id: ReqId(3),
            source: NixlError { op: NixlOp::PostXferReq, status: Status::Backend },
        };
        assert_eq!(e.status(), Some(Status::Backend));
        assert_eq!(EngineError::UnknownRequest(ReqId(1)).status(), None);
    }
}
