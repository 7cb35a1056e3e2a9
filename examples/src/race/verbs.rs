//! Scenario 2's rig on real RDMA verbs: the race's one schedule of aborts
//! and reassignments (see [`super`]), through `backend-verbs` (Soft-RoCE
//! in `scripts/rdma-lab`'s guest, or any verbs device).
//!
//! One decode adapter with a pool, two prefill adapters (each its own RC
//! queue pair to decode). A NIC cannot be told to hold a WRITE, so a *held*
//! round delays its doomed writes the way hardware does: prefill 0 queues a
//! large WRITE ([`RaceConfig::blocker_bytes`], into a scratch exposure of its
//! own) ahead of the round's to-be-aborted writes on its queue pair, and RC
//! starts them only after it. Each round:
//!
//! 1. `round` requests reserve decode slots and expose them to prefill 0
//!    (a memory window per slot, or, under `naive`, the pool's own key);
//!    prefill 0 writes a [tagged](crate::payload) payload into each, the
//!    requests to be kept first, then (held rounds) the blocker, then the
//!    doomed ones.
//! 2. The doomed requests are aborted while their writes are queued.
//! 3. Once their slots are back (at once under `naive`; under `safe` only
//!    with a proof: the peer's ABORT_ACK after its writes ended, or the
//!    windows invalidated), next tenants take them (the free list is LIFO)
//!    and prefill 1 writes their bytes over its own queue pair.
//! 4. Every prefill operation is awaited (bounded); every consumer checks
//!    every byte it reads against its own tag.
//!
//! Under `naive` the old writes land after the new tenants' and their
//! consumers read the old request's bytes (the positive control). Under
//! `safe`, the same schedule yields zero foreign bytes: a write that comes
//! after its window was invalidated is refused by the NIC
//! (`REM_ACCESS_ERR`, counted as [`RaceReport::rejected_at_nic`]), which also
//! puts both ends of that queue pair in ERR: the decode side fences it and
//! prefill 0 reconnects. A kept request whose own write was flushed by that
//! fence is a failed transfer ([`RaceReport::transfer_failures`]), not data.

use super::run::{Prefill, RaceRig, Sides};
use super::{setup_err, step_err, RaceConfig, RaceError, RaceReport};
use crate::wait::wait_until;
use backend_tcp_sim::block_on;
use backend_verbs::{LabEnv, VerbsConfig, VerbsTransfer};
use kv_transfer_core::{
    EscalationLadder, Exposed, PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotPool, Transfer,
    TransferHandle, TransferOptions,
};
use std::time::Duration;

struct Rig {
    sides: Sides<VerbsTransfer>,
    /// One decode slot the blocker writes into.
    scratch: SlotPool,
    /// The blocker's source.
    p0blocker: SlotPool,
    p0name: String,
    p1name: String,
    /// A held round's blocker: its scratch exposure and its WRITE.
    blocker: Option<(SlotLease<Exposed>, Option<TransferHandle>)>,
}

fn adapter(name: String, env: &LabEnv, policy: backend_tcp_sim::ReleasePolicy) -> Result<VerbsTransfer, RaceError> {
    let mut c = VerbsConfig::new(name, env.device.clone(), env.gid_index);
    c.release_policy = policy;
    VerbsTransfer::new(c).map_err(|e| setup_err(format!("verbs adapter on {}: {e}", env.device)))
}

fn pool(t: &VerbsTransfer, slots: usize, slot_size: usize, ladder: EscalationLadder) -> Result<SlotPool, RaceError> {
    let region = super::pool_region(kv_transfer_core::SlotMemory::Host, slots, slot_size)?;
    t.register_pool(region, PoolConfig::new(slot_size).with_ladder(ladder)).map_err(setup_err)
}

impl Rig {
    fn start(cfg: &RaceConfig) -> Result<Self, RaceError> {
        let env = LabEnv::from_env();
        let k = cfg.slots_per_request;
        let ladder = super::race_ladder(cfg);
        let tag = format!("{}-{}", std::process::id(), backend_tcp_sim::splitmix64(cfg.seed) % 1_000_000);
        let decode = adapter(format!("race-decode-{tag}"), &env, cfg.policy)?;
        let dpool = pool(&decode, cfg.round * k * 2, cfg.slot_size, ladder)?;
        let blocker = cfg.blocker_bytes.max(cfg.slot_size);
        let scratch = pool(&decode, 1, blocker, ladder)?;
        let safe = backend_tcp_sim::ReleasePolicy::Safe;
        let (p0name, p1name) = (format!("race-prefill0-{tag}"), format!("race-prefill1-{tag}"));
        let p0 = adapter(p0name.clone(), &env, safe)?;
        let p0pool = pool(&p0, cfg.round * k, cfg.slot_size, EscalationLadder::default())?;
        let p0blocker = pool(&p0, 1, blocker, EscalationLadder::default())?;
        let p1 = adapter(p1name.clone(), &env, safe)?;
        let p1pool = pool(&p1, cfg.round * k * 2, cfg.slot_size, EscalationLadder::default())?;
        // The prefill sides dial: after a fence they dial again.
        p0.add_peer(decode.descriptor()).map_err(setup_err)?;
        p1.add_peer(decode.descriptor()).map_err(setup_err)?;
        // Who a connection is comes from the descriptor the decode side is
        // given (backend-verbs: a claim its owner confirms), not its hello.
        decode.add_peer(p0.descriptor()).map_err(setup_err)?;
        decode.add_peer(p1.descriptor()).map_err(setup_err)?;
        let sides = Sides { decode, p0, p1, dpool, p0pool, p1pool };
        Ok(Self { sides, scratch, p0blocker, p0name, p1name, blocker: None })
    }

    /// The decode side's current peer for `name` (a new one after a fence
    /// and reconnect), bounded by `wait`.
    fn peer(&self, name: &str, wait: Duration) -> Result<PeerId, RaceError> {
        let mut found = None;
        wait_until(wait, || {
            found = self.sides.decode.peer_named(name);
            found.is_some()
        });
        found.ok_or_else(|| step_err(format!("{name} is not connected: decode {:?}", self.sides.decode.counters())))
    }
}

impl RaceRig for Rig {
    type Xfer = VerbsTransfer;

    fn sides(&self) -> &Sides<Self::Xfer> {
        &self.sides
    }

    fn expose(
        &mut self,
        lease: SlotLease<Reserved>,
        to: Prefill,
        wait: Duration,
    ) -> Result<Option<(SlotLease<Exposed>, RemoteSlots)>, RaceError> {
        let name = match to {
            Prefill::First => &self.p0name,
            Prefill::Next => &self.p1name,
        };
        match self.sides.decode.expose(lease, self.peer(name, wait)?) {
            Ok(x) => Ok(Some(x)),
            // The peer was fenced between the lookup and the binds: once
            // more, on its new connection.
            Err(e) => self.sides.decode.expose(e.lease, self.peer(name, wait)?).map(Some).map_err(|e| step_err(e.kind)),
        }
    }

    /// A NIC cannot be told to hold a WRITE: a held round holds its doomed
    /// writes behind a large one queued ahead of them (see the module docs).
    fn hold(&mut self) -> bool {
        true
    }
    fn between_posts(&mut self, wait: Duration) -> Result<(), RaceError> {
        let lease = self.scratch.reserve(1).map_err(|e| step_err(format!("scratch reserve: {e}")))?;
        let (exposed, remote) = self
            .expose(lease, Prefill::First, wait)?
            .ok_or_else(|| step_err("the blocker's scratch slot was refused"))?;
        let src = self.p0blocker.reserve(1).map_err(|e| step_err(format!("blocker reserve: {e}")))?;
        let handle = match block_on(self.sides.p0.write(src, &remote, TransferOptions::default())) {
            Ok(h) => Some(h),
            Err(e) => {
                e.lease.release();
                None
            }
        };
        self.blocker = Some((exposed, handle));
        Ok(())
    }
    /// The blocker ends like any write: awaited, its exposure settled.
    fn release(&mut self, rep: &mut RaceReport, wait: Duration) {
        if let Some((exposed, handle)) = self.blocker.take() {
            if let Some(h) = handle {
                super::await_within(h, wait, rep);
            }
            if let Some(s) = super::settle_within(exposed, wait, rep) {
                s.release();
            }
        }
    }

    /// Prefill 0's flushed leases come back with its own fence.
    fn end_round(&self, wait: Duration) -> bool {
        wait_until(wait, || self.sides.p0pool.metrics().quarantined == 0)
    }

    fn finish(&self, rep: &mut RaceReport) {
        rep.rejected_at_nic =
            self.sides.p0.counter("remote_access_errors") + self.sides.p1.counter("remote_access_errors");
        rep.stale_notifications = self.sides.dpool.metrics().stale_rejected;
        rep.naive_releases = self.sides.decode.counter("naive_releases");
        rep.fences = self.sides.decode.counter("fences");
        rep.reconnects = self.sides.p0.counter("fences");
    }
}

/// Runs scenario 2 on verbs (device and GID index from
/// [`LabEnv`]: `KVT_VERBS_DEVICE`, `KVT_VERBS_GID_INDEX`) and reports what
/// consumers found. `progress(done, total)` is called after every round.
/// [`RaceConfig::blocker_bytes`] sets how long a held round's writes wait.
pub fn run_verbs_race(cfg: &RaceConfig, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    super::host_memory_only(cfg, "verbs")?;
    super::run::run(cfg, Rig::start, progress)
}
