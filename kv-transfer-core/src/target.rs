//! The target-side interface every backend implements, so an application,
//! `kvt`, the conformance suite and language bindings drive any backend the
//! same way: register a pool, learn and add peers, expose a reserved lease.

use crate::drain::{Capabilities, Shadowed};
use crate::ids::PeerId;
use crate::lease::{Exposed, Reserved, SlotLease};
use crate::pool::{PoolConfig, PoolError, SlotPool};
use crate::region::Region;
use crate::remote::RemoteSlots;
use std::fmt;
use std::sync::Arc;

/// `(name, value)` pairs of a counters struct's fields, for
/// [`Target::counters`]: `named_counters!(snapshot; posts, failures)`.
#[macro_export]
macro_rules! named_counters {
    ($s:expr; $($f:ident),* $(,)?) => {{
        let s = &$s;
        vec![$((stringify!($f), s.$f as u64)),*]
    }};
}

/// Why an exposure was refused. One type for every backend.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExposeErrorKind {
    /// The lease's pool was not registered with this backend.
    #[error("pool not registered with this backend")]
    ForeignPool,
    /// The peer is not known (never added, or gone).
    #[error("unknown or disconnected peer {0:?}")]
    UnknownPeer(PeerId),
    /// The backend is shutting down.
    #[error("backend is shutting down")]
    ShuttingDown,
    /// The engine refused to grant access.
    #[error("engine refused: {0}")]
    Engine(String),
    /// A slot's earlier tenancy was revoked while exposed to this peer, and
    /// that peer may still retry its writes of it: the slot is not exposed
    /// to it again until a proof covers its retries (DESIGN, "Peers that
    /// retry after a revocation"). Another peer may take it now.
    #[error("{0}")]
    RetryShadow(Shadowed),
}

/// A refused exposure, with the lease handed back unexposed (rule 3).
#[derive(thiserror::Error)]
#[error("expose failed: {kind}")]
pub struct ExposeError {
    /// The lease, still reserved.
    pub lease: SlotLease<Reserved>,
    /// Why.
    pub kind: ExposeErrorKind,
}

impl fmt::Debug for ExposeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExposeError").field("kind", &self.kind).field("lease", &self.lease).finish()
    }
}

/// Errors of a backend's management calls (registering pools, adding peers).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The region or request is of a kind this backend cannot serve.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The peer's descriptor is malformed or the peer cannot be reached.
    #[error("peer: {0}")]
    Peer(String),
    /// The engine refused.
    #[error("{backend}: {message}")]
    Engine {
        /// The backend.
        backend: &'static str,
        /// The engine's words.
        message: String,
    },
    /// The backend is shutting down.
    #[error("backend is shutting down")]
    ShuttingDown,
}

/// A backend's target side: what the decode worker calls, whatever the
/// backend. Object-safe (`Arc<dyn Target>`); a backend that also posts
/// implements [`Transfer`](crate::Transfer).
///
/// Peers are set up in one shape: each side gives the other its
/// [`local_descriptor`](Self::local_descriptor) out of band (bytes the
/// backend defines: an endpoint, an agent's metadata, a segment name, an
/// engine descriptor), and [`add_peer`](Self::add_peer) turns a peer's
/// descriptor into its [`PeerId`].
pub trait Target: Send + Sync {
    /// What this backend can prove about an aborted exposure; its pools'
    /// escalation ladders hold only these steps.
    fn capabilities(&self) -> Capabilities;
    /// Registers `region` and builds its pool (with this backend's
    /// capabilities); the backend keeps the pool's settlement authority.
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError>;
    /// What a peer needs to add this side.
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError>;
    /// Adds (or finds) the peer a descriptor names.
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError>;
    /// Exposes a reserved lease to `peer` and describes it; the exposure
    /// settles only with a proof. On error the lease comes back unexposed.
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError>;
    /// The backend's own counters, by name (the pools keep theirs).
    fn counters(&self) -> Vec<(&'static str, u64)>;
}
