//! # kv-transfer-core
//!
//! The safe-release contract for moving KV cache between prefill and decode
//! workers over RDMA-class transports. One bug class is the target: a KV
//! slot going back to the free list while some NIC may still write into it,
//! so that the next request reads the previous request's late bytes.
//!
//! This crate is a state machine with no sockets and no threads (the way
//! `quinn-proto` is driven by `quinn`): backends drive it.
//!
//! - A [`SlotPool`] carves fixed-size slots out of a registered [`Region`];
//!   every lease bumps the slot's [`Generation`], so `(SlotId, Generation)`
//!   names one tenancy ([`Tenancy`]).
//! - [`SlotPool::reserve`] is all-or-nothing and refuses with a typed
//!   [`AdmissionError`] before anything is exposed.
//! - A [`SlotLease<S>`] moves through `Reserved → Exposed → Settled`. Only
//!   `Reserved` and `Settled` leases can be released or read; dropping an
//!   `Exposed` lease quarantines its slots.
//! - A slot leaves exposure or quarantine only with a settlement proof —
//!   [`Completed`], [`Revoked`] or [`Fenced`] — which only the pool's
//!   [`SettlementAuthority`] (held by the backend) can mint. Timers only
//!   escalate ([`EscalationLadder`]); they never free.
//! - [`Transfer`] is the backend trait; its [`TransferHandle`] resolves only
//!   at a terminal status and hands the lease back settled.
//!
//! ```
//! use kv_transfer_core::*;
//! use std::sync::Arc;
//!
//! // The backend registers a region and builds the pool; it keeps the authority.
//! let region = Arc::new(HostRegion::new(16 * 4096).unwrap());
//! let (pool, authority) = SlotPool::new(region, PoolConfig::new(4096)).unwrap();
//!
//! // Decode side: reserve, expose to the prefill peer, hand it the descriptor.
//! let lease = pool.reserve(4).unwrap();
//! let (exposed, remote) = authority.expose(lease, PeerId(1), 0x1234, "decode-0", Default::default());
//!
//! // The request is aborted while the peer's writes may be in flight.
//! exposed.abort();
//! assert_eq!(pool.metrics().quarantined, 4); // not free: a NIC may still write
//!
//! // Deadlines only escalate: the backend is asked to drain, revoke, fence.
//! let actions = authority.poll_escalations();
//! assert_eq!(actions[0].step, EscalationStep::RequestDrain);
//! assert_eq!(pool.metrics().free, 12);
//!
//! // The peer acknowledges it drained: the proof frees the slots.
//! authority.deliver(authority.completed(&remote.tenancies()));
//! assert_eq!(pool.metrics().free, 16);
//! ```
//!
//! # Feature flags
//!
//! - `metrics`: report counters, gauges and the abort-to-reclaim histogram
//!   through the `metrics` facade (Prometheus exporters plug in there).
//! - `naive-positive-control`: `ReleasePolicy::Naive`, the race tests' positive
//!   control, which frees aborted slots without a proof. Only the demo, `kvt
//!   race` and the tests enable it, never a server.
//! - `cuda`: [`CudaRegion`], slots in a GPU's memory. The driver is loaded at
//!   run time: the feature builds with no CUDA toolkit and no driver, and
//!   reports their absence as a typed [`DeviceError`].
//! - `fake-device` (Linux): [`FakeDeviceRegion`], device-like memory whose
//!   address faults on any CPU access, so that tests on a host without a GPU
//!   catch code that reads a device slot through its address.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_op_in_unsafe_fn)]

pub mod auth;
mod clock;
mod counters;
pub mod drain;
mod escalation;
mod gate;
pub mod hash;
mod ids;
mod lease;
mod metrics;
mod pool;
mod proof;
mod region;
mod remote;
mod sync;
mod target;
mod transfer;
mod wait;

pub use async_trait::async_trait;
pub use clock::{Clock, ManualClock, SystemClock};
pub use escalation::{EscalationAction, EscalationLadder, EscalationStep, QuarantineId, REDRAIN_MAX_INTERVAL};
pub use gate::{AtFull, GatePermit, GateRefusal, PeerGate};
pub use ids::{Generation, PeerId, PoolId, SlotId, Tenancy};
pub use lease::{
    AccessError, Exposed, LeaseState, Reserved, SettleError, SettleErrorReason, Settled, SettledFuture, SlotLease,
};
pub use metrics::{LatencySummary, MetricsSnapshot};
pub use pool::{AdmissionError, DeliveryReport, PoolConfig, PoolError, SlotPool};
pub use proof::{Completed, Fenced, Revoked, Settlement, SettlementAuthority, SettlementKind};
#[cfg(all(feature = "fake-device", target_os = "linux"))]
pub use region::FakeDeviceRegion;
#[cfg(feature = "cuda")]
pub use region::{cuda_device_count, cuda_device_of, cuda_driver_present, CudaRegion};
pub use region::{
    with_staging_buffer, DeviceError, HostRegion, MemoryKind, Region, RegionError, SlotMemory, UnknownMemory,
};
pub use remote::{RemoteSlot, RemoteSlots};
pub use target::{BackendError, ExposeError, ExposeErrorKind, Target};
pub use transfer::{
    check_shapes, Abandoned, Completer, Op, PostError, PostErrorKind, PostFuture, PostNow, RejectReason, Transfer,
    TransferError, TransferHandle, TransferOptions, TransferOutcome,
};

pub use wait::{block_on, poll_until};

#[doc(hidden)]
pub use lease::StateKind;
