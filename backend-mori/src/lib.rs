//! MORI-IO semantics in Rust, over a pluggable transport.
//!
//! MORI-IO is AMD's KV-cache transfer engine (SGLang's MORI backend). This crate
//! is the *engine layer* of kv-transfer's MORI backend: an [`IoEngine`] shaped
//! like MORI-IO's `IOEngine` (engine keys and descriptors exchanged out of band,
//! memory registration returning serializable [`MemoryDesc`]s, per-engine
//! transfer ids, `read`/`write` and batch variants returning a
//! [`TransferStatus`], `wait`/`wait_for`, sessions, and the target's
//! [`IoEngine::pop_inbound_status`]), implemented by [`MoriEngine`] over any
//! [`MoriTransport`]. The [`loopback`] transport runs two or more engines in
//! one process; a TCP-simulator or RDMA transport plugs in the same way.
//!
//! # What is kept from MORI, and what is closed
//!
//! Kept, because the adapter above must cope with it: there is no cancel; a
//! `wait_for` that times out returns `IN_PROGRESS` and the transfer goes on;
//! the target learns of a transfer only from an inbound status popped by
//! `(remote engine key, transfer id)`.
//!
//! Closed:
//!
//! - **Deregistration while in flight**: [`IoEngine::deregister_memory`] refuses
//!   with [`EngineError::MemoryBusy`] while any transfer touching the region is
//!   not terminal (MORI deregisters regardless).
//! - **Silent failures**: the initiator notifies the target of every terminal
//!   transfer, success *or failure*, with the caller's [`Tag`] (MORI notifies
//!   successes only). A transfer rejected by validation is notified too when
//!   the peer is known and the uid is not pending (nothing was posted).
//! - **Wrap-around**: transfer ids are full `u64`, allocated with wrapping
//!   arithmetic and only compared for equality; a uid still pending towards the
//!   same peer is refused (`BAD_STATE`). Notification sequence numbers are
//!   `u32` per (initiator, target) pair, compared with serial-number arithmetic
//!   in a window that drops duplicates and skips gaps left by lost messages.
//!   Both counters can start anywhere ([`EngineConfig::uid_start`],
//!   [`EngineConfig::notif_seq_start`]); the tests start them near the maximum.
//! - **Unknown codes**: [`StatusCode::Unknown`] is an error, never success,
//!   and not terminal (it proves nothing about the NIC).
//! - **Partial posts**: a status becomes terminal only when every operation of
//!   the transfer that was accepted by the transport has completed; failure
//!   wins, but only then.
//!
//! # Testing with mocks
//!
//! With the `mock` feature, `MockIoEngine`, `MockIoSession` and
//! `MockMoriTransport` (mockall) are exported. [`TransferStatus::in_progress_forever`]
//! and [`TransferStatus::pending`] build statuses that behave as MORI does at
//! its worst.

#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod engine;
mod error;
pub mod loopback;
mod status;
pub mod transport;
mod types;
mod util;
mod window;

#[cfg(test)]
mod mock_tests;

pub use engine::{wait_all, EngineConfig, EngineStats, IoEngine, IoSession, MoriEngine};
#[cfg(any(test, feature = "mock"))]
pub use engine::{MockIoEngine, MockIoSession};
pub use error::{EngineError, TransportError};
pub use status::{StatusCode, StatusUpdater, TransferStatus, ERR_BEGIN};
#[cfg(any(test, feature = "mock"))]
pub use transport::MockMoriTransport;
pub use transport::{Completion, MoriTransport, Notification, OpKind, TransportEvent, WorkRequest};
pub use types::{
    BatchRequest, EngineDesc, EngineKey, HostBuffer, InboundStatus, MemoryDesc, MemoryId, MemoryLocation, MemoryRegion,
    Segment, Tag, TransferUniqueId,
};
