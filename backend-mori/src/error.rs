//! Typed errors of the engine and of the transports.

use thiserror::Error;

use crate::status::StatusCode;
use crate::types::{EngineKey, MemoryId};

/// An error a transport reports, for a call or for a completed operation.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum TransportError {
    /// A range lies outside its registered region.
    #[error("range out of bounds of the registered region")]
    OutOfBounds,
    /// The local or remote region is not registered (or its key is stale).
    #[error("memory {id} of engine {engine} is not registered (or its key is stale)")]
    UnknownMemory {
        /// Owning engine.
        engine: EngineKey,
        /// Region id.
        id: MemoryId,
    },
    /// The peer engine is not reachable through this transport.
    #[error("engine {0} is not reachable")]
    UnknownPeer(EngineKey),
    /// The region still has posted operations; it cannot be deregistered.
    #[error("memory {0} still has posted operations")]
    Busy(MemoryId),
    /// The transport cannot do this (GPU memory on a host-only transport, a fence, ...).
    #[error("memory not supported by this transport: {0}")]
    Unsupported(String),
    /// The transport is not attached to an engine, or was attached twice.
    #[error("transport state: {0}")]
    State(String),
    /// The operation failed on the wire or at the remote NIC.
    #[error("remote operation failed: {0}")]
    Remote(String),
    /// The transport is shut down.
    #[error("transport closed")]
    Closed,
    /// The deployment's cluster key could not be loaded
    /// ([`kv_transfer_core::auth::ClusterKey::from_env`]: a variable set
    /// but wrong, an unreadable key file).
    #[error("cluster key: {0}")]
    Key(String),
    /// A side channel's handshake under the cluster key failed (counted in
    /// the transport's `auth_*` stats).
    #[error("side-channel handshake refused ({refusal:?}): {detail}")]
    Auth {
        /// Why, by kind.
        refusal: AuthRefusal,
        /// Core's error, in words.
        detail: String,
    },
}

/// Why a side channel's handshake under the cluster key failed: core's
/// kind of [`kv_transfer_core::auth::AuthError`].
pub use kv_transfer_core::auth::AuthErrorKind as AuthRefusal;

impl From<kv_transfer_core::auth::AuthError> for TransportError {
    fn from(e: kv_transfer_core::auth::AuthError) -> Self {
        Self::Auth { refusal: e.kind(), detail: e.to_string() }
    }
}

impl From<kv_transfer_core::auth::KeyError> for TransportError {
    fn from(e: kv_transfer_core::auth::KeyError) -> Self {
        Self::Key(e.to_string())
    }
}

impl TransportError {
    /// The MORI status code this error maps to.
    pub fn code(&self) -> StatusCode {
        match self {
            Self::OutOfBounds => StatusCode::InvalidArgs,
            Self::UnknownMemory { .. } | Self::UnknownPeer(_) => StatusCode::NotFound,
            Self::Busy(_) | Self::State(_) | Self::Closed => StatusCode::BadState,
            Self::Unsupported(_) | Self::Key(_) => StatusCode::InvalidArgs,
            Self::Remote(_) | Self::Auth { .. } => StatusCode::RdmaOp,
        }
    }
}

/// An error of an engine call that returns `Result` (registration, sessions).
/// Transfers report errors through their [`crate::TransferStatus`] instead.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EngineError {
    /// Bad arguments (`INVALID_ARGS`).
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    /// Unknown engine, memory or session (`NOT_FOUND`).
    #[error("not found: {0}")]
    NotFound(String),
    /// The memory is still touched by transfers that are not terminal; it stays
    /// registered (`BAD_STATE`). MORI deregisters anyway; this engine refuses.
    #[error("memory {id} is in use by {in_flight} transfer(s) that are not terminal")]
    MemoryBusy {
        /// Region id.
        id: MemoryId,
        /// Non-terminal transfers touching it.
        in_flight: usize,
    },
    /// The remote engine still has transfers that are not terminal (`BAD_STATE`).
    #[error("engine {key} has {in_flight} transfer(s) that are not terminal")]
    PeerBusy {
        /// Remote engine.
        key: EngineKey,
        /// Non-terminal transfers to or from it.
        in_flight: usize,
    },
    /// The call is not allowed in the engine's state (`BAD_STATE`).
    #[error("bad state: {0}")]
    BadState(String),
    /// GPU memory or operation not supported (`GPU_OP`).
    #[error("gpu: {0}")]
    Gpu(String),
    /// The transport refused the call.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
}

impl EngineError {
    /// The MORI status code this error maps to.
    pub fn code(&self) -> StatusCode {
        match self {
            Self::InvalidArgs(_) => StatusCode::InvalidArgs,
            Self::NotFound(_) => StatusCode::NotFound,
            Self::MemoryBusy { .. } | Self::PeerBusy { .. } | Self::BadState(_) => StatusCode::BadState,
            Self::Gpu(_) => StatusCode::GpuOp,
            Self::Transport(e) => e.code(),
        }
    }
}
