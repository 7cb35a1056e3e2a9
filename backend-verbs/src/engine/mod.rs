//! The one interface the adapter has to a NIC: register memory, allocate
//! windows, create and connect RC queue pairs, post work requests, poll
//! completions. [`DeviceEngine`] is libibverbs (feature `verbs`);
//! [`fake::FakeFabric`] a software NIC that behaves as badly as hardware
//! does (completions out of order across queue pairs, `REM_ACCESS_ERR`
//! putting both ends in ERR, flushes, a link that dies with requests
//! posted), so the adapter's settlement logic is tested on any host; and,
//! in this crate's unit tests, mockall's `MockEngine` for exact fault
//! sequences.
//!
//! Handles, not objects: the engine keeps the memory a posted request names
//! alive until that request's completion is polled (so
//! [`Engine::deregister`] right after a post is safe), and the adapter never
//! holds a raw resource whose teardown order it would have to get right.

pub mod fake;

#[cfg(feature = "verbs")]
mod device;
#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
pub use device::DeviceEngine;

use std::sync::Arc;

use kv_transfer_core::Region;

use crate::error::VerbsError;
use crate::work::{Completion, Endpoint, MrAccess, MrId, MrInfo, MwId, QpId, QpState, WorkRequest};

/// A NIC, as the adapter uses it. Every call is one operation with one
/// error; none blocks on the network.
#[cfg_attr(test, mockall::automock)]
pub trait Engine: Send + Sync + 'static {
    /// Registers `region` (host memory) with `access`.
    fn register(&self, region: Arc<dyn Region>, access: MrAccess) -> Result<MrInfo, VerbsError>;
    /// Gives up the engine's handle on `mr`; requests still posted that
    /// name it keep it registered until their completions are polled.
    fn deregister(&self, mr: MrId);
    /// A new type-2 memory window (unbound): a bind posted on a queue pair
    /// grants access through that queue pair only.
    fn alloc_window(&self) -> Result<MwId, VerbsError>;
    /// A new type-1 memory window (unbound): a bind posted on any queue pair
    /// of this engine grants access through every queue pair of it (the
    /// protection domain), for peers that stripe one grant over several.
    /// Its key ends when it is freed ([`Engine::free_window`]).
    fn alloc_pd_window(&self) -> Result<MwId, VerbsError>;
    /// Frees `mw` (its key, if bound, stops granting anything).
    fn free_window(&self, mw: MwId);
    /// A new RC queue pair in RESET, and what its peer needs to connect to
    /// it (path MTU `mtu`).
    fn create_qp(&self, mtu: u32) -> Result<Endpoint, VerbsError>;
    /// As [`Engine::create_qp`], starting its send queue at packet sequence
    /// number `psn`: for peers whose connection message carries no PSN
    /// (Mooncake's assumes 0 both ways).
    fn create_qp_with_psn(&self, mtu: u32, psn: u32) -> Result<Endpoint, VerbsError>;
    /// Moves `qp` through INIT and RTR to RTS, connected to `remote`.
    fn connect(&self, qp: QpId, remote: &Endpoint) -> Result<(), VerbsError>;
    /// Destroys a queue pair that never carried a work request (a side
    /// channel handshake that failed): without it, every refused
    /// connection would keep a QP, a resource the device has only so many of.
    fn destroy_qp(&self, qp: QpId);
    /// Posts one signaled work request; a bind returns the key it binds
    /// (usable once the bind completed).
    fn post(&self, qp: QpId, wr_id: u64, wr: WorkRequest) -> Result<Option<u32>, VerbsError>;
    /// Up to `max` completions of any queue pair (none waiting: empty), in
    /// each queue pair's order; across queue pairs, in no particular order.
    fn poll(&self, max: usize) -> Result<Vec<Completion>, VerbsError>;
    /// Moves `qp` to ERR: everything posted on it completes flushed.
    fn to_error(&self, qp: QpId) -> Result<(), VerbsError>;
    /// `qp`'s state as the device reports it (ERR once the NIC put it there).
    fn qp_state(&self, qp: QpId) -> Result<QpState, VerbsError>;
}
