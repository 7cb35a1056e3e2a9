//! Loopback rigs: for each backend, an initiator `Transfer` with its pool
//! and a target's exposure of `slots` slots, both in this process, so that
//! [`crate::bench::run_loop`] can measure every backend the same way.

use crate::Backend;
use anyhow::bail;
use kv_transfer_core::{RemoteSlots, SlotPool, Transfer};
use std::sync::Arc;

#[cfg(feature = "mooncake")]
mod mooncake;
#[cfg(feature = "mori")]
mod mori;
#[cfg(feature = "nixl")]
mod nixl;
mod sim;

/// One backend's initiator and target, connected, in this process.
pub struct Rig {
    /// The backend's name, as the report prints it.
    pub backend: &'static str,
    /// The initiator's transport.
    pub transfer: Arc<dyn Transfer>,
    /// The initiator's pool: at least `slots` slots of the block size.
    pub pool: SlotPool,
    /// The target's exposure: exactly `slots` slots of the block size.
    pub remote: RemoteSlots,
    /// Settles the target's exposure and shuts both sides down.
    pub teardown: Box<dyn FnOnce() + Send>,
}

/// Builds `backend`'s loopback rig with `slots` slots of `block` bytes a side.
pub fn loopback_rig(backend: Backend, slots: usize, block: usize) -> anyhow::Result<Rig> {
    match backend {
        Backend::TcpSim => sim::rig(slots, block),
        #[cfg(feature = "nixl")]
        Backend::Nixl => nixl::rig(slots, block),
        #[cfg(feature = "mooncake")]
        Backend::Mooncake => mooncake::rig(slots, block),
        #[cfg(feature = "mori")]
        Backend::Mori => mori::rig(slots, block),
        #[allow(unreachable_patterns)]
        other => bail!("backend `{}` is not compiled into this kvt", other.name()),
    }
}
