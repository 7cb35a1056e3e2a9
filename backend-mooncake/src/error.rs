//! Typed errors of the engine layer.

use crate::proto::ProtoError;

/// An error returned by an engine call.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Socket or bind error.
    #[error("i/o error during {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A peer sent something that does not decode.
    #[error("protocol error: {0}")]
    Proto(#[from] ProtoError),
    /// A peer answered a handshake with an unexpected message type.
    #[error("handshake: expected {expected:?} reply, got {got:?}")]
    UnexpectedReply {
        /// Expected type.
        expected: crate::proto::HandshakeType,
        /// Received type.
        got: crate::proto::HandshakeType,
    },
    /// A sealed notification's handshake was refused (either side): another
    /// cluster key, a relay, a replay, or a peer that proved another name.
    #[error("peer handshake for a sealed notification: {0}")]
    PeerAuth(#[source] kv_transfer_core::auth::AuthError),
    /// The deployment's cluster key (`KV_TRANSFER_CLUSTER_KEY` or its file)
    /// is set but unusable.
    #[error("cluster key: {0}")]
    Key(#[source] kv_transfer_core::auth::KeyError),
    /// A notify was not acknowledged with `success`.
    #[error("notify rejected by peer: {0:?}")]
    NotifyRejected(String),
    /// Device memory (a staged region) on a transport that cannot stage it.
    #[error("the {protocol} transport cannot move device memory (only TCP stages it through host buffers)")]
    StagingUnsupported {
        /// The engine's transport.
        protocol: String,
    },
    /// A memory region has zero length or wraps the address space.
    #[error("invalid memory region [{addr:#x}, +{len})")]
    InvalidRegion {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A memory region overlaps one already registered.
    #[error("memory region [{addr:#x}, +{len}) overlaps a registered region")]
    RegionOverlap {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// No region is registered at this address.
    #[error("no memory region registered at {0:#x}")]
    RegionNotRegistered(u64),
    /// The region still has transfers in flight (local or remote); retry after
    /// they finish.
    #[error("memory region at {addr:#x} has {inflight} transfer(s) in flight")]
    RegionBusy {
        /// Start of the region.
        addr: u64,
        /// Transfers holding it.
        inflight: usize,
    },
    /// A request's local range is not inside one registered region.
    #[error("local range [{addr:#x}, +{len}) is not inside a registered region")]
    SourceNotRegistered {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A request's remote range is not inside one buffer the target advertised.
    #[error("remote range [{addr:#x}, +{len}) is outside segment {segment}'s buffers")]
    TargetOutOfRange {
        /// Segment.
        segment: u64,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A request with zero length.
    #[error("zero-length request")]
    ZeroLength,
    /// Unknown segment id.
    #[error("unknown segment id {0}")]
    UnknownSegment(u64),
    /// The segment name does not resolve to a socket address.
    #[error("bad segment name {0:?} (want host:port)")]
    BadSegmentName(String),
    /// The segment still has tasks in flight.
    #[error("segment {0} has transfers in flight")]
    SegmentBusy(u64),
    /// Unknown batch id.
    #[error("unknown batch id {0}")]
    UnknownBatch(u64),
    /// Batch capacity of zero requested.
    #[error("batch size must be > 0")]
    ZeroBatchSize,
    /// Submitting would exceed the batch capacity.
    #[error("batch {batch} full: capacity {capacity}, have {used}, adding {adding}")]
    BatchFull {
        /// Batch.
        batch: u64,
        /// Capacity.
        capacity: usize,
        /// Tasks already submitted.
        used: usize,
        /// Tasks in this call.
        adding: usize,
    },
    /// Task index out of range for this batch.
    #[error("batch {batch} has no task {task}")]
    UnknownTask {
        /// Batch.
        batch: u64,
        /// Task.
        task: usize,
    },
    /// `free_batch_id` while some task has not reached COMPLETED or FAILED.
    #[error("batch {batch} busy: {unfinished} task(s) unfinished")]
    BatchBusy {
        /// Batch.
        batch: u64,
        /// Unfinished tasks.
        unfinished: usize,
    },
    /// The engine is shutting down.
    #[error("engine is shut down")]
    Shutdown,
    /// The peer refused an RDMA Connection exchange (its `reply_msg`), or
    /// its reply does not pair with our queue pairs.
    #[error("RDMA connection refused: {0}")]
    ConnectionRejected(String),
    /// The local verbs device failed an operation.
    #[error("verbs: {0}")]
    Verbs(String),
}

impl EngineError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        EngineError::Io { context: context.into(), source }
    }
}

/// Why a task ended FAILED (kept with the task status).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    /// The target answered status 1: address rejected (nothing applied).
    #[error("target rejected the address range")]
    AddrRejected,
    /// Connecting to the data port failed (nothing was sent).
    #[error("connect failed: {0}")]
    Connect(String),
    /// The connection failed mid-request; the connection was closed, so no
    /// more bytes of this request will be sent or received by this process.
    #[error("connection failed mid-transfer: {0}")]
    Connection(String),
    /// The peer sent a malformed status word; the connection was closed.
    #[error("bad status word: {0}")]
    BadStatus(ProtoError),
    /// The transport dropped the request without running it.
    #[error("transport dropped the request")]
    Dropped,
    /// RDMA: no buffer of the target's metadata covers the range, so no key
    /// grants it (nothing was posted).
    #[error("no remote key covers [{addr:#x}, +{len})")]
    NoRemoteKey {
        /// Remote address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// RDMA: the target's NIC refused the key or the range of a slice
    /// (`REM_ACCESS_ERR`): that slice was not placed, and the target's queue
    /// pair went to ERR with it, so nothing the task sent after it is placed
    /// either; every slice posted for the task has completed.
    #[error("the target's NIC refused the key or range (REM_ACCESS_ERR)")]
    RemoteAccess,
    /// RDMA: a slice completed in error otherwise (the peer is gone, the
    /// retries ran out, the queue pair was flushed); every slice posted for
    /// the task has completed, so this process sends nothing more of it, but
    /// packets already on the wire prove nothing either way.
    #[error("RDMA slice failed: {0}")]
    Rdma(String),
}
