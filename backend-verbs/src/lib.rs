//! # backend-verbs
//!
//! Real RDMA verbs for kv-transfer: the contract's three proofs as what the
//! NIC itself enforces. A pool's memory is registered with
//! `LOCAL_WRITE | MW_BIND` only, so its own key grants nothing remote; each
//! tenancy gets a type-2 memory window, and the window's key is the
//! generation at the NIC:
//!
//! - **Revoked**: the tenancy's window invalidated (`LOCAL_INV`, or bound
//!   again under a new key) and that work request completed: a late WRITE
//!   with the old key is refused by the NIC (`REM_ACCESS_ERR`), memory
//!   unchanged.
//! - **Fenced**: the peer's queue pair moved to ERR and every request posted
//!   on it completed flushed: nothing more leaves or lands through it.
//! - **Completed**: terminal completions of every work request (or the
//!   initiator's ABORT_ACK after its own).
//!
//! Two layers, split by one trait ([`Engine`]: register, windows, queue
//! pairs, post, poll, by handle):
//!
//! - the adapter ([`VerbsTransfer`]: core's `Transfer` and `Target`), a
//!   window per exposed slot, a TCP side channel for connection setup, a
//!   heartbeat that fences a dead peer, reconnection after a fence; an
//!   aborted exposure is drained, then revoked, then fenced. It never
//!   touches a device itself, so it builds and is tested anywhere;
//! - the engines: [`DeviceEngine`] (feature `verbs`), a safe layer over
//!   libibverbs (through `ibverbs-sys`) in the style of rust-ibverbs:
//!   parents kept alive by `Arc` (a queue pair holds its completion queue
//!   and protection domain, a region holds its memory), one [`VerbsError`]
//!   per operation, every `unsafe` private, posted requests holding their
//!   memory until their completion is polled, so no caller upholds the
//!   in-flight rule; and [`FakeFabric`], a software NIC with the same rules
//!   and hardware's bad habits, for tests on hosts without a device.
//!
//! ## Why `ibverbs-sys`
//!
//! It has the whole of `verbs.h` (memory windows, `LOCAL_INV`, the provider
//! ops table through which the inline verbs `ibv_post_send`, `ibv_poll_cq`
//! and `ibv_alloc_mw` are called) and links the system `libibverbs.so.1`;
//! a bind / write / `LOCAL_INV` / stale-write test on it passed on Soft-RoCE.
//! `ibverbs`' safe API has no RDMA WRITE, READ or windows; `sideway` has no
//! window bind; `rdma-sys` needs librdmacm and was not tried on a device.
//!
//! ## Where it runs
//!
//! On a machine with a verbs device. This project's hosts have none (the
//! device list fails): `scripts/rdma-lab test` boots the kernel's Soft-RoCE
//! driver in a qemu guest and runs this crate's tests there; on the host
//! they show as ignored with that command.
//!
//! # Feature flags
//!
//! - `verbs`: `DeviceEngine`, the real verbs layer over libibverbs. Building it
//!   needs `cmake libclang-dev libibverbs-dev libnl-3-dev libnl-route-3-dev`
//!   (`scripts/test` installs them); its tests run where a verbs device exists
//!   (`scripts/rdma-lab test`). Without it the adapter builds and runs on
//!   `FakeFabric`.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod error;
pub use error::VerbsError;
mod work;
pub use work::{
    Completion, Endpoint, Gid, MrAccess, MrId, MrInfo, MwId, QpId, QpState, WcKind, WcStatus, WorkRequest, ENDPOINT_LEN,
};

#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
mod device;
#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
mod memory;
#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
mod queue;

pub mod adapter;
pub mod engine;

pub use adapter::{VerbsConfig, VerbsTransfer};
#[cfg(feature = "verbs")]
pub use device::{devices, Context, DeviceCaps};
pub use engine::fake::{FakeFabric, FakeNic, FakeStats};
#[cfg(feature = "verbs")]
pub use engine::DeviceEngine;
pub use engine::Engine;
#[cfg(feature = "verbs")]
pub use memory::{MemoryRegion, MemoryWindow, ProtectionDomain, WindowState};
#[cfg(feature = "verbs")]
pub use queue::{CompletionQueue, QueuePair, QP_DEPTH};

/// The lab's environment: the device and GID index the verbs tests use
/// (`KVT_VERBS_DEVICE`, `KVT_VERBS_GID_INDEX`, set by `scripts/rdma-lab`),
/// and whether this process runs in the lab's guest (`KVT_RDMA_LAB=1`),
/// where a missing device is a failure, not a skip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabEnv {
    /// Device name (default `rxe_lo`).
    pub device: String,
    /// RoCE v2 GID index (default 1).
    pub gid_index: u8,
    /// Running in the lab's guest.
    pub in_lab: bool,
}

impl LabEnv {
    /// Reads the environment.
    pub fn from_env() -> Self {
        Self {
            device: std::env::var("KVT_VERBS_DEVICE").unwrap_or_else(|_| "rxe_lo".to_owned()),
            gid_index: std::env::var("KVT_VERBS_GID_INDEX").ok().and_then(|v| v.parse().ok()).unwrap_or(1),
            in_lab: std::env::var("KVT_RDMA_LAB").is_ok_and(|v| v == "1"),
        }
    }
}
