//! Scenario 2 on real RDMA verbs: the same schedule of aborts and
//! reassignments as the simulator's race, through `backend-verbs` (Soft-RoCE
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

use super::{
    check_config, check_lease, fill_lease, finish_report, record_consumed, run_rounds, setup_err,
    slots_with_foreign_bytes, step_err, tags_of, RaceConfig, RaceError, RaceReport, Rng,
};
use crate::payload::Tag;
use crate::wait::wait_until;
use backend_tcp_sim::block_on;
use backend_verbs::{LabEnv, VerbsConfig, VerbsTransfer};
use kv_transfer_core::{
    EscalationLadder, Exposed, PeerId, PoolConfig, RemoteSlots, Settled, SlotLease, SlotPool, Transfer, TransferHandle,
    TransferOptions,
};
use std::time::Duration;

struct Rig {
    decode: VerbsTransfer,
    p0: VerbsTransfer,
    p1: VerbsTransfer,
    dpool: SlotPool,
    /// One decode slot the blocker writes into.
    scratch: SlotPool,
    p0pool: SlotPool,
    /// The blocker's source.
    p0blocker: SlotPool,
    p1pool: SlotPool,
    p0name: String,
    p1name: String,
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
        Ok(Self { decode, p0, p1, dpool, scratch, p0pool, p0blocker, p1pool, p0name, p1name })
    }

    /// The decode side's current peer for `name` (a new one after a fence
    /// and reconnect), bounded by `wait`.
    fn peer(&self, name: &str, wait: Duration) -> Result<PeerId, RaceError> {
        let mut found = None;
        wait_until(wait, || {
            found = self.decode.peer_named(name);
            found.is_some()
        });
        found.ok_or_else(|| step_err(format!("{name} is not connected: decode {:?}", self.decode.counters())))
    }

    fn expose(
        &self,
        lease: kv_transfer_core::SlotLease<kv_transfer_core::Reserved>,
        name: &str,
        wait: Duration,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), RaceError> {
        match self.decode.expose(lease, self.peer(name, wait)?) {
            Ok(x) => Ok(x),
            // The peer was fenced between the lookup and the binds: once
            // more, on its new connection.
            Err(e) => self.decode.expose(e.lease, self.peer(name, wait)?).map_err(|e| step_err(e.kind)),
        }
    }
}

/// A first tenant: exposed to prefill 0, written by it.
struct First {
    id: u64,
    exposed: Option<SlotLease<Exposed>>,
    remote: RemoteSlots,
    /// `None`: the post was refused (the queue pair was being fenced).
    handle: Option<TransferHandle>,
    doomed: bool,
    /// Whether prefill 0's write succeeded.
    written: bool,
}

struct Run<'a> {
    cfg: &'a RaceConfig,
    rig: Rig,
    rng: Rng,
    rep: RaceReport,
    next_id: u64,
    wait: Duration,
}

impl super::Rounds for Run<'_> {
    fn round(&mut self) -> Result<(), RaceError> {
        Run::round(self)
    }
    fn report(&self) -> &RaceReport {
        &self.rep
    }
}

impl Run<'_> {
    /// A consumer: settles `exposed` and, if its transfer succeeded, checks
    /// every byte against `tags` (and, for a reassigned slot, counts the
    /// slots an old write landed in).
    fn consume(&mut self, exposed: SlotLease<Exposed>, written: bool, tags: &[Tag], reassigned: bool) {
        let size = self.cfg.slot_size;
        match self.settle(exposed) {
            Some(settled) if written => {
                if reassigned {
                    // Foreign bytes in a reassigned slot came from an old
                    // write that landed after the reassignment.
                    self.rep.stale_writes_landed += slots_with_foreign_bytes(&settled, tags, size);
                }
                let c = check_lease(&settled, tags, size);
                record_consumed(&mut self.rep, c);
                settled.release();
            }
            Some(settled) => {
                self.rep.requests += 1;
                self.rep.transfer_failures += 1;
                settled.release();
            }
            None => self.rep.requests += 1,
        }
    }

    fn settle(&mut self, exposed: SlotLease<Exposed>) -> Option<SlotLease<Settled>> {
        super::settle_within(exposed, self.wait, &mut self.rep)
    }

    /// Waits for `h`; whether the operation succeeded.
    fn await_handle(&mut self, h: TransferHandle) -> bool {
        super::await_within(h, self.wait, &mut self.rep)
    }

    fn post_first(&mut self, f: &mut First) -> Result<(), RaceError> {
        let (k, size) = (self.cfg.slots_per_request, self.cfg.slot_size);
        let mut src = self.rig.p0pool.reserve(k).map_err(|e| step_err(format!("prefill 0 reserve: {e}")))?;
        fill_lease(&mut src, &tags_of(f.id, &f.remote), size)?;
        match block_on(self.rig.p0.write(src, &f.remote, TransferOptions::default())) {
            Ok(h) => f.handle = Some(h),
            Err(e) => e.lease.release(),
        }
        Ok(())
    }

    fn round(&mut self) -> Result<(), RaceError> {
        let (cfg, k, size) = (self.cfg, self.cfg.slots_per_request, self.cfg.slot_size);
        let held = self.rng.chance(cfg.hold_rate);
        if held {
            self.rep.held_rounds += 1;
        }
        let mut firsts = Vec::with_capacity(cfg.round);
        for _ in 0..cfg.round {
            self.next_id += 1;
            let id = self.next_id;
            let doomed = self.rng.chance(cfg.abort_rate);
            let Ok(lease) = self.rig.dpool.reserve(k) else {
                self.rep.admission_rejected += 1;
                continue;
            };
            let (exposed, remote) = self.rig.expose(lease, &self.rig.p0name, self.wait)?;
            firsts.push(First { id, exposed: Some(exposed), remote, handle: None, doomed, written: false });
        }
        // Kept requests first; then, in a held round, the blocker; then the
        // doomed requests, which RC starts only after the blocker.
        for f in firsts.iter_mut().filter(|f| !f.doomed) {
            self.post_first(f)?;
        }
        let mut blocker = None;
        if held {
            let lease = self.rig.scratch.reserve(1).map_err(|e| step_err(format!("scratch reserve: {e}")))?;
            let (exposed, remote) = self.rig.expose(lease, &self.rig.p0name, self.wait)?;
            let src = self.rig.p0blocker.reserve(1).map_err(|e| step_err(format!("blocker reserve: {e}")))?;
            let h = match block_on(self.rig.p0.write(src, &remote, TransferOptions::default())) {
                Ok(h) => Some(h),
                Err(e) => {
                    e.lease.release();
                    None
                }
            };
            blocker = Some((exposed, h));
        }
        for f in firsts.iter_mut().filter(|f| f.doomed) {
            self.post_first(f)?;
        }
        // The aborts, with the doomed writes queued.
        let mut n_aborted = 0;
        for f in firsts.iter_mut().filter(|f| f.doomed) {
            drop(f.exposed.take());
            n_aborted += 1;
        }
        self.rep.aborted += n_aborted;
        self.rep.peak_quarantined = self.rep.peak_quarantined.max(self.rig.dpool.metrics().quarantined);
        // Next tenants, once the aborted slots are back.
        let mut nexts: Vec<(Vec<Tag>, SlotLease<Exposed>, Option<TransferHandle>)> = Vec::new();
        if n_aborted > 0 {
            let dpool = self.rig.dpool.clone();
            if !wait_until(self.wait, || dpool.metrics().quarantined == 0) {
                self.rep.timeouts += 1;
            }
            for _ in 0..n_aborted {
                self.next_id += 1;
                let id = self.next_id;
                let lease = self.rig.dpool.reserve(k).map_err(|e| step_err(format!("next tenant: {e}")))?;
                let (exposed, remote) = self.rig.expose(lease, &self.rig.p1name, self.wait)?;
                let tags = tags_of(id, &remote);
                let mut src = self.rig.p1pool.reserve(k).map_err(|e| step_err(format!("prefill 1 reserve: {e}")))?;
                fill_lease(&mut src, &tags, size)?;
                let h = match block_on(self.rig.p1.write(src, &remote, TransferOptions::default())) {
                    Ok(h) => Some(h),
                    Err(e) => {
                        e.lease.release();
                        None
                    }
                };
                nexts.push((tags, exposed, h));
            }
        }
        // Every prefill operation reaches its terminal status (bounded).
        for f in &mut firsts {
            if let Some(h) = f.handle.take() {
                f.written = self.await_handle(h);
            }
        }
        let mut next_written = Vec::with_capacity(nexts.len());
        for (_, _, h) in &mut nexts {
            let ok = match h.take() {
                Some(h) => self.await_handle(h),
                None => false,
            };
            next_written.push(ok);
        }
        if let Some((exposed, h)) = blocker {
            if let Some(h) = h {
                self.await_handle(h);
            }
            if let Some(s) = self.settle(exposed) {
                s.release();
            }
        }
        // Consumers read and check every byte of what was written.
        for mut f in firsts {
            match f.exposed.take() {
                Some(exposed) => self.consume(exposed, f.written, &tags_of(f.id, &f.remote), false),
                None => self.rep.requests += 1,
            }
        }
        for ((tags, exposed, _), written) in nexts.into_iter().zip(next_written) {
            self.rep.reassigned += 1;
            self.consume(exposed, written, &tags, true);
        }
        // Prefill 0's flushed leases come back with its own fence.
        let p0pool = self.rig.p0pool.clone();
        if !wait_until(self.wait, || p0pool.metrics().quarantined == 0) {
            self.rep.timeouts += 1;
        }
        Ok(())
    }
}

/// Runs scenario 2 on verbs (device and GID index from
/// [`LabEnv`]: `KVT_VERBS_DEVICE`, `KVT_VERBS_GID_INDEX`) and reports what
/// consumers found. `progress(done, total)` is called after every round.
/// [`RaceConfig::blocker_bytes`] sets how long a held round's writes wait.
pub fn run_verbs_race(cfg: &RaceConfig, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    check_config(cfg)?;
    super::host_memory_only(cfg, "verbs")?;
    let rig = Rig::start(cfg)?;
    let mut run = Run {
        cfg,
        rig,
        rng: Rng::new(cfg.seed),
        rep: RaceReport { config: Some(cfg.clone()), ..RaceReport::default() },
        next_id: 0,
        wait: Duration::from_millis(cfg.timeout_ms.max(1)),
    };
    let elapsed = run_rounds(cfg, &mut run, progress)?;
    let Run { mut rep, rig, wait, .. } = run;
    finish_report(&mut rep, &rig.dpool, wait, elapsed);
    rep.rejected_at_nic = rig.p0.counter("remote_access_errors") + rig.p1.counter("remote_access_errors");
    rep.stale_notifications = rig.dpool.metrics().stale_rejected;
    rep.naive_releases = rig.decode.counter("naive_releases");
    rep.fences = rig.decode.counter("fences");
    rep.reconnects = rig.p0.counter("fences");
    drop(rig);
    Ok(rep)
}
