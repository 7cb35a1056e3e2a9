//! Mooncake Transfer Engine semantics in Rust, wire-compatible with Mooncake
//! 0.3.13.post1's TCP transport (protocol v2, and v1 peers) and its P2P
//! handshake.
//!
//! This is the *engine layer* of the Mooncake backend: a
//! [`TransferEngine`] trait shaped like Mooncake's own API (batch ids, task
//! status, notifications) and its implementation [`MooncakeEngine`]. With the
//! `mock` feature, `MockTransferEngine` (mockall) lets adapter tests script an
//! engine that behaves as badly as the real one (TIMEOUT forever, free refused).
//!
//! Layers:
//! - [`proto`]: pure codecs (handshake frames, descriptor/notify JSON, TCP
//!   header and status word).
//! - [`memory`]: registered memory and its safety contract.
//! - [`transport`]: the [`DataTransport`] trait and the TCP transport.
//! - [`client`]: handshake round trips.
//! - the engine ([`MooncakeEngine`]) with its target-side servers.
//! - [`adapter`]: kv-transfer-core's `Transfer` over the engine
//!   ([`MooncakeTransfer`]): slot leases, settlement by notification,
//!   ABORT / ABORT_ACK, and what Mooncake TCP cannot prove (revoke, fence, v1).
//! - with the `testing` feature, the rigs: `bench`, a throughput bench
//!   driving the adapter (for `mc_bench` and `scripts/measure.sh`), and
//!   `gate`, a transport that holds WRITEs in flight (for the races).
//!
//! What a status means for memory safety:
//! - only [`TransferStatus::Completed`] and [`TransferStatus::Failed`] are
//!   finished; after either, this process no longer touches the task's local
//!   memory. [`TransferStatus::Timeout`] is not terminal.
//! - against a [`ProtoVersion::V1`] target, COMPLETED for a WRITE means only
//!   that the bytes left our socket; FAILED may follow bytes having landed.
//! - against [`ProtoVersion::V2`], COMPLETED means applied at the target; FAILED
//!   after a connection error means our side stopped, but bytes already in the
//!   target's socket may still be applied there.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use backend_mooncake::*;
//!
//! # fn main() -> Result<(), EngineError> {
//! let engine = MooncakeEngine::new(EngineConfig::default())?;
//! let mut kv = vec![0u8; 1 << 20];
//! // SAFETY: `kv` outlives the registration (unregistered or engine dropped
//! // first) and is not referenced while transfers run.
//! engine.register_memory(unsafe { MemoryRegion::new(kv.as_mut_ptr() as u64, kv.len() as u64) })?;
//! let seg = engine.open_segment("127.0.0.1:16023")?; // peer's handshake ip:port
//! let remote = engine.segment_info(seg)?.desc.buffers[0].addr;
//! let batch = engine.allocate_batch_id(1)?;
//! let tasks = engine.submit_transfer(batch, &[TransferRequest {
//!     opcode: TcpOpcode::Write,
//!     source: kv.as_ptr() as u64,
//!     target_id: seg,
//!     target_offset: remote,
//!     length: 4096,
//! }])?;
//! for t in tasks {
//!     let st = engine.wait_transfer(batch, t, Duration::from_secs(5))?;
//!     assert!(st.status.is_finished() || st.status == TransferStatus::Timeout);
//! }
//! engine.free_batch_id(batch)?; // BatchBusy until every task is finished
//! engine.send_notify(seg, "kv ready")?;
//! drop(engine); // fences all connections; `kv` may be freed after this
//! # Ok(()) }
//! ```
//!
//! # Feature flags
//!
//! - `rdma`: Mooncake's RDMA transport and target over `backend-verbs`, on its
//!   software NIC.
//! - `rdma-device`: the same on a verbs device too, with the real-engine tests
//!   (`tests/rdma_real.rs`, which `scripts/rdma-lab test` runs in the guest)
//!   and `mc_bench --rdma DEVICE`.
//! - `mock`: exports the engine layer's `mockall` mocks for adapters' tests.
//! - `testing`: the test rigs `bench` and `gate` (not what a deployment links).
#![deny(missing_docs)]

pub mod adapter;
mod batch;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod bench;
pub mod client;
mod engine;
mod error;
pub mod exposed;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod gate;
pub mod limits;
pub mod memory;
pub mod proto;
#[cfg(feature = "rdma")]
#[cfg_attr(docsrs, doc(cfg(feature = "rdma")))]
pub mod rdma;
pub mod sealed;
mod server;
pub mod transport;

pub use adapter::{AdapterConfig, AdapterError, AdapterMetrics, MooncakeTransfer, ReleasePolicy};
pub use batch::{BatchHook, TaskStatus, TransferStatus};
#[cfg(any(test, feature = "mock"))]
pub use engine::MockTransferEngine;
pub use engine::{
    BatchId, EngineConfig, MooncakeEngine, NotifyWaker, SegmentId, SegmentInfo, TransferEngine, TransferRequest,
};
pub use error::{EngineError, TaskError};
pub use exposed::{RangeAccess, RangeId, TcpServe};
pub use limits::{ConnLimits, NotifyLimits};
pub use memory::MemoryRegion;
pub use proto::{ProtoVersion, TcpOpcode};
pub use server::{TargetHook, TargetStats};
pub use transport::{DataTransport, TcpTransport, TcpTransportConfig};
