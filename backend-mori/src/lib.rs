//! MORI-IO semantics in Rust, over a pluggable transport, and kv-transfer's
//! MORI backend on top of them.
//!
//! Three layers:
//!
//! - [`MoriTransfer`] ([`adapter`]): kv-transfer-core's `Transfer` over any
//!   [`IoEngine`], with target-side exposure, settlement from inbound
//!   statuses, ABORT / ABORT_ACK and the escalation ladder.
//! - [`SimTransport`] ([`sim`]): a [`MoriTransport`] over the TCP simulator's
//!   fabric, so engine and adapter run on a real wire in CI; [`harness`] builds
//!   connected prefill/decode sides on it (both with the `sim` feature: test
//!   rigs, not what a deployment links; `kvt bench --backend mori` measures it).
//! - The engine layer below, described here.
//!
//! MORI-IO is AMD's KV-cache transfer engine (SGLang's MORI backend). This crate
//! holds the *engine layer* of kv-transfer's MORI backend: an [`IoEngine`] shaped
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
//!   the peer is known and the uid is not pending (nothing was posted). Over
//!   a transport that carries notifications with the data (the simulator), a
//!   one-segment WRITE's success rides behind its bytes and only a failure
//!   is sent on its own, under the same sequence number.
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
//! Added beyond MORI, for the adapter's settlement proofs:
//! [`IoEngine::fence_remote_engine`] (a transport-level fence; the loopback
//! implements it, a transport that cannot refuses with a typed error),
//! [`IoEngine::wait_inbound_status`] and [`IoEngine::set_inbound_hook`] (so the
//! target need not spin on `pop_inbound_status`), and
//! [`TransferStatus::on_complete`] (so an initiator can wake a future),
//! [`IoEngine::send_message`] / [`IoEngine::set_message_hook`] (control
//! messages: the adapter's ABORT / ABORT_ACK), and per-slot access grants
//! [`IoEngine::grant_access`] / [`IoEngine::withdraw_access`] /
//! [`IoEngine::revoke_access`] (no-ops or refusals on MORI-like transports;
//! the simulator's NIC binds, checks and revokes generations). Every
//! [`WorkRequest`] carries its transfer's [`Tag`].
//!
//! # For the adapter
//!
//! - Initiator: `uid = engine.allocate_transfer_unique_id()`, then
//!   `engine.write(local_desc, local_off, remote_desc, remote_off, len, uid,
//!   Tag::new(slot_or_lease, generation))` (or `batch_write` with one
//!   [`BatchRequest`] per lease). The lease may come back as settled only when
//!   `status.is_terminal()`; `SUCCESS` is the only success, every other
//!   terminal code is a failure, and [`StatusCode::Unknown`] is a failure that
//!   proves nothing (escalate). `wait_for` returning `IN_PROGRESS` proves
//!   nothing either.
//! - Target: `pop_inbound_status(initiator_key, uid)` /
//!   `wait_inbound_status(..)` yields the initiator's terminal code and tag
//!   once the initiator observed all its operations terminal: the "Completed"
//!   proof of DESIGN.md when the tag's generation is current. A missing
//!   notification proves nothing.
//! - Memory: `deregister_memory` refusing with [`EngineError::MemoryBusy`] is
//!   the signal that something is still in flight; never work around it.
//!
//! # Testing with mocks
//!
//! With the `mock` feature, `MockIoEngine`, `MockIoSession` and
//! `MockMoriTransport` (mockall) are exported. [`TransferStatus::in_progress_forever`]
//! and [`TransferStatus::pending`] build statuses that behave as MORI does at
//! its worst.
//!
//! # Feature flags
//!
//! - `verbs`: `VerbsTransport`, MORI's semantics over any
//!   `backend_verbs::Engine` (the software NIC on any host).
//! - `verbs-device`: the same plus libibverbs, for its device tests.
//! - `mock`: exports the engine layer's `mockall` mocks for adapters' tests.
//! - `sim`: [`SimTransport`] (MORI over the TCP simulator), the [`loopback`]
//!   transport and the [`harness`]: test rigs, and `kvt`'s simulated MORI.

#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod adapter;
mod engine;
mod error;
#[cfg(feature = "sim")]
#[cfg_attr(docsrs, doc(cfg(feature = "sim")))]
pub mod harness;
#[cfg(feature = "sim")]
#[cfg_attr(docsrs, doc(cfg(feature = "sim")))]
pub mod loopback;
#[cfg(any(feature = "sim", feature = "verbs"))]
mod notify;
#[cfg(any(feature = "sim", feature = "verbs"))]
mod region;
#[cfg(feature = "sim")]
#[cfg_attr(docsrs, doc(cfg(feature = "sim")))]
pub mod sim;
mod status;
pub mod transport;
mod types;
mod util;
#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
pub mod verbs;
mod window;

#[cfg(test)]
mod adapter_mock_tests;
#[cfg(test)]
mod mock_tests;

pub use adapter::{AdapterError, AdapterStats, ExposeError, ExposeErrorKind, MoriTransfer};
pub use engine::{
    wait_all, EngineConfig, EngineStats, InboundHook, IoEngine, IoSession, MessageHook, MoriEngine, PeerLostHook,
};
#[cfg(any(test, feature = "mock"))]
pub use engine::{MockIoEngine, MockIoSession};
pub use error::{AuthRefusal, EngineError, TransportError};
#[cfg(feature = "sim")]
#[cfg_attr(docsrs, doc(cfg(feature = "sim")))]
pub use sim::{SimTransport, SimTransportConfig};
pub use status::{listener_panics, StatusCode, StatusListener, StatusUpdater, TransferStatus, ERR_BEGIN};
#[cfg(any(test, feature = "mock"))]
pub use transport::MockMoriTransport;
pub use transport::{Completion, EventSink, MoriTransport, Notification, OpKind, TransportEvent, WorkRequest};
pub use types::{
    BatchRequest, EngineDesc, EngineKey, HostBuffer, InboundStatus, MemoryDesc, MemoryId, MemoryLocation, MemoryRegion,
    Segment, Tag, TransferUniqueId,
};
#[cfg(feature = "verbs")]
pub use verbs::{VerbsTransport, VerbsTransportConfig};
