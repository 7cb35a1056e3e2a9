//! Loopback rigs: for each backend, an initiator `Transfer` with its pool
//! and a target's exposure of `slots` slots, both in this process, so that
//! [`crate::bench::run_loop`] can measure every backend the same way.

use crate::Backend;
use anyhow::{anyhow, bail, Context};
use kv_transfer_core::{Exposed, PoolConfig, Region, RemoteSlots, SlotLease, SlotMemory, SlotPool, Target, Transfer};
use std::sync::Arc;

#[cfg(feature = "mooncake")]
mod mooncake;
#[cfg(feature = "mori")]
mod mori;
#[cfg(feature = "nixl")]
mod nixl;
mod sim;
#[cfg(feature = "verbs")]
mod verbs;

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

/// `slots` slots of `block` bytes in `memory`.
pub fn allocate(memory: SlotMemory, slots: usize, block: usize) -> anyhow::Result<Arc<dyn Region>> {
    let len = slots.checked_mul(block).ok_or_else(|| anyhow!("{slots} slots of {block} B overflow"))?;
    memory.allocate(len).map_err(|e| anyhow!("cannot allocate {len} B of {memory} memory: {e}"))
}

/// Where each side's slots live: the initiator's (the source of a WRITE)
/// and the target's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The initiator's pool.
    pub initiator: SlotMemory,
    /// The target's pool.
    pub target: SlotMemory,
}

impl Placement {
    /// Whether either side is device memory.
    pub fn is_device(self) -> bool {
        self.initiator.is_device() || self.target.is_device()
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.initiator == self.target {
            write!(f, "{}", self.target)
        } else {
            write!(f, "{}->{}", self.initiator, self.target)
        }
    }
}

/// Builds `backend`'s loopback rig with `slots` slots of `block` bytes a
/// side, each side's in the memory `placement` says. Device memory: the
/// socket backends stage it through host buffers, NIXL registers a GPU's as
/// VRAM, verbs through a dma-buf; each refuses, by name, what it cannot reach.
pub fn loopback_rig(backend: Backend, slots: usize, block: usize, placement: Placement) -> anyhow::Result<Rig> {
    match backend {
        Backend::TcpSim => sim::rig(slots, block, placement),
        #[cfg(feature = "nixl")]
        Backend::Nixl => nixl::rig(slots, block, placement),
        #[cfg(feature = "mooncake")]
        Backend::Mooncake => mooncake::rig(slots, block, placement),
        #[cfg(feature = "mori")]
        Backend::Mori if placement.is_device() => {
            bail!("--device {placement}: MORI's engine here registers host buffers only")
        }
        Backend::Mori => mori::rig(slots, block),
        Backend::MooncakeRdma => bail!(
            "mooncake-rdma runs `kvt race` only here (its NIC is a software one: speed means nothing); Mooncake over \
             RDMA is measured in the lab's guest (scripts/rdma-lab test)"
        ),
        #[cfg(feature = "verbs")]
        Backend::Verbs => verbs::rig(slots, block, placement),
        #[allow(unreachable_patterns)]
        other => bail!("backend `{}` is not compiled into this kvt", other.name()),
    }
}

/// An initiator and a target of one backend, connected through the target
/// interface every backend implements ([`Target`]): a pool of `slots` slots
/// of `block` bytes registered on each side, the descriptors exchanged both
/// ways, and the target's exposure of all its slots to the initiator.
pub struct Pair {
    /// The initiator's pool.
    pub pool: SlotPool,
    /// The target's pool.
    pub target_pool: SlotPool,
    /// The target's exposure and its descriptor.
    pub exposed: SlotLease<Exposed>,
    /// What the initiator writes into.
    pub remote: RemoteSlots,
}

/// Connects `init` and `target` the one way every backend is driven.
/// Each pool's slots live where `placement` says.
pub fn connect(
    init: &dyn Target,
    target: &dyn Target,
    slots: usize,
    block: usize,
    placement: Placement,
) -> anyhow::Result<Pair> {
    let region = |memory| allocate(memory, slots, block);
    let pool = init
        .register_pool(region(placement.initiator)?, PoolConfig::new(block))
        .context("registering the initiator's pool")?;
    let target_pool = target
        .register_pool(region(placement.target)?, PoolConfig::new(block))
        .context("registering the target's pool")?;
    // Descriptors after registration, so each side knows the other's memory.
    init.add_peer(&target.local_descriptor()?).context("the initiator adding the target")?;
    let peer = target.add_peer(&init.local_descriptor()?).context("the target adding the initiator")?;
    let (exposed, remote) =
        target.expose(target_pool.reserve(slots)?, peer).map_err(|e| anyhow!("expose: {}", e.kind))?;
    Ok(Pair { pool, target_pool, exposed, remote })
}

/// A rig's teardown after it aborted the target's exposure: waits (at most
/// `wait`) until the target's pool has nothing quarantined and every slot
/// back, and says so on stderr if not (`why`: what the proof waits for).
pub fn await_settled(pool: &SlotPool, backend: &str, why: &str, wait: std::time::Duration) {
    let deadline = std::time::Instant::now() + wait;
    let whole = |m: &kv_transfer_core::MetricsSnapshot| m.quarantined == 0 && m.free == m.capacity;
    while !whole(&pool.metrics()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let left = pool.metrics().quarantined;
    if left > 0 {
        eprintln!("{backend} teardown: {left} target slot(s) still quarantined ({why})");
    }
}
