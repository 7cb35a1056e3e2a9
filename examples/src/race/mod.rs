//! The randomized race of aborts, reassignments, held and delayed writes.
//!
//! One decode NIC with a pool, two prefill NICs on loopback (separate
//! [`SimNic`]s, separate connections). The run goes in rounds; in each round,
//! decided by the seed:
//!
//! 1. Some rounds are *held*: the decode NIC's [`Gate`] holds every incoming
//!    WRITE, so the round's writes stay in flight past their aborts (the
//!    "write survives the abort" of every engine's bug report).
//! 2. `round` requests reserve slots, expose them to prefill worker 0, which
//!    writes a [tagged](crate::payload) payload into them (with seeded
//!    per-WR delays).
//! 3. A seeded share of them is aborted while their writes are in flight.
//! 4. Once the aborted slots are reclaimed (immediately under `naive`, only
//!    with a proof under `safe`), a next tenant reserves slots (the free list
//!    is LIFO: the same slots) and gets its bytes from prefill worker 1,
//!    either pulled (a READ by decode, which lands before the gate opens) or
//!    pushed (a WRITE, which races the held ones at the gate); one path per
//!    round.
//! 5. The gate opens, every prefill operation is awaited (bounded), and
//!    every consumer checks every byte it reads against its own tag.
//!
//! Under [`ReleasePolicy::Naive`] the aborted requests' late writes land in
//! the next tenants' slots and consumers read foreign bytes: the positive
//! control. Under [`ReleasePolicy::Safe`] the same schedule yields zero
//! foreign bytes: the late writes are rejected at the NIC (stale generation)
//! or land before the slot is reclaimed.
//!
//! The seed fixes the schedule (which rounds hold, which requests abort,
//! which tenants pull or push, the per-WR delays); the interleaving of the
//! NICs' threads is the race itself.

#[cfg(feature = "mooncake")]
#[cfg_attr(docsrs, doc(cfg(feature = "mooncake")))]
pub mod mooncake;
#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
pub mod verbs;

use crate::payload::{pattern, verify, SlotCheck, Tag};
use crate::wait::{poll_until, wait_until};
use backend_tcp_sim::{block_on, splitmix64, DelayDist, FaultPlan, Gate, NicConfig, ReleasePolicy, SimNic};
use kv_transfer_core::{
    EscalationLadder, Exposed, LatencySummary, PeerId, PoolConfig, Region, RemoteSlots, Settled, SlotLease, SlotMemory,
    SlotPool, Transfer, TransferError, TransferHandle, TransferOptions,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RaceConfig {
    /// Requests to serve in all (first tenants and next tenants together).
    pub requests: u64,
    /// Seed of the schedule.
    pub seed: u64,
    /// The decode NIC's release policy.
    pub policy: ReleasePolicy,
    /// Share of first tenants aborted while their writes are in flight, in `[0, 1]`.
    pub abort_rate: f64,
    /// Share of rounds whose writes are held at the decode NIC past their aborts, in `[0, 1]`.
    pub hold_rate: f64,
    /// Slots per request.
    pub slots_per_request: usize,
    /// Bytes per slot (a multiple of 16 keeps every word whole).
    pub slot_size: usize,
    /// First tenants per round.
    pub round: usize,
    /// Prefill worker 0 delays each WR uniformly in `[0, delay_max_us]` µs.
    pub delay_max_us: u64,
    /// The decode pool's escalation ladder: time to drain before revoking, µs.
    pub drain_us: u64,
    /// Bound on every single wait, ms.
    pub timeout_ms: u64,
    /// Every WRITE's DONE carries digests of its bytes and every READ keeps
    /// digests of what it received: a consumer's read of a settled lease
    /// whose bytes changed after that is refused (integrity on consume).
    #[serde(default)]
    pub digest: bool,
    /// Verbs only ([`verbs`]): bytes of the WRITE prefill 0 queues on its
    /// queue pair ahead of a held round's doomed writes (RC executes a QP's
    /// requests in order, so they start only after it: the delay a real
    /// NIC gives a write behind a large one).
    #[serde(default = "default_blocker_bytes")]
    pub blocker_bytes: usize,
    /// The memory every pool's slots live in. [`SlotMemory::FakeDevice`]
    /// faults on any CPU access through a slot's address: the race then also
    /// proves no path reads a device slot on the CPU (the simulator stages
    /// device slots through host buffers; Mooncake and verbs refuse them).
    #[serde(default)]
    pub memory: SlotMemory,
}

fn default_blocker_bytes() -> usize {
    4 << 20
}

impl Default for RaceConfig {
    /// 10,000 requests, seed 1, safe, 30 % aborted, half the rounds held,
    /// 2 slots of 256 B per request, 16 requests per round.
    fn default() -> Self {
        Self {
            requests: 10_000,
            seed: 1,
            policy: ReleasePolicy::Safe,
            abort_rate: 0.3,
            hold_rate: 0.5,
            slots_per_request: 2,
            slot_size: 256,
            round: 16,
            delay_max_us: 20,
            drain_us: 300,
            timeout_ms: 5_000,
            digest: false,
            blocker_bytes: default_blocker_bytes(),
            memory: SlotMemory::Host,
        }
    }
}

/// What a run found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RaceReport {
    /// The configuration.
    pub config: Option<RaceConfig>,
    /// Requests served (first and next tenants).
    pub requests: u64,
    /// First tenants aborted with writes in flight.
    pub aborted: u64,
    /// Next tenants that took over reclaimed slots.
    pub reassigned: u64,
    /// Rounds whose writes were held past their aborts.
    pub held_rounds: u64,
    /// Aborted requests' slot writes that completed successfully after their
    /// slot had been handed to a new tenancy (held rounds, where the order is
    /// known): the hazard itself.
    pub stale_writes_landed: u64,
    /// Requests whose consumer read at least one byte of another request.
    pub foreign_requests: u64,
    /// Foreign bytes read, in all.
    pub foreign_bytes: u64,
    /// Requests whose consumer read bytes that match nobody (unwritten or torn).
    pub garbage_requests: u64,
    /// Writes of aborted requests the decode NIC rejected (stale generation, wrong peer).
    pub rejected_at_nic: u64,
    /// Notifications or acks of old tenancies dropped and counted.
    pub stale_notifications: u64,
    /// Requests refused by admission (the pool was full).
    pub admission_rejected: u64,
    /// Most decode slots quarantined at once.
    pub peak_quarantined: u64,
    /// Abort (or drop) of an exposed lease to reclaim of its slots.
    pub abort_to_reclaim: LatencySummary,
    /// Decode slots settled by `Completed` / `Revoked` / `Fenced` proofs.
    pub settled: [u64; 3],
    /// Naive policy only: proofs minted without evidence.
    pub naive_releases: u64,
    /// Bounded waits that gave up (a stuck proof or operation).
    pub timeouts: u64,
    /// Consumers whose read was refused because the settled slot's bytes did
    /// not match their digest (`digest` on): corruption caught at consume
    /// time, nothing handed over.
    #[serde(default)]
    pub integrity_caught: u64,
    /// Requests not aborted whose transfer failed (its queue pair was put in
    /// ERR by another request's rejected write, say): not consumed as data,
    /// as a serving engine would retry them (verbs only).
    #[serde(default)]
    pub transfer_failures: u64,
    /// Aborted requests' writes that completed while their slots were still
    /// quarantined (a backend that cannot revoke: the bytes land, but in
    /// memory no tenant holds; the slots come back only with the peer's ack).
    #[serde(default)]
    pub stale_writes_quarantined: u64,
    /// Connections the decode NIC fenced (the ladder's last step, or a lost peer).
    pub fences: u64,
    /// Times prefill 0 reconnected after a fence.
    pub reconnects: u64,
    /// Decode pool capacity.
    pub capacity: u64,
    /// Free decode slots at the end (equals `capacity` unless something leaked).
    pub final_free: u64,
    /// Wall time, seconds.
    pub elapsed_s: f64,
    /// Requests per second.
    pub requests_per_s: f64,
}

impl RaceReport {
    /// Whether any consumer read foreign bytes or a stale write landed in a reassigned slot.
    pub fn corrupted(&self) -> bool {
        self.foreign_requests > 0 || self.stale_writes_landed > 0
    }
    /// Whether the pool ended whole: every slot free, none quarantined.
    pub fn pool_whole(&self) -> bool {
        self.final_free == self.capacity
    }
}

/// Why a run could not be carried out (not a finding: findings are in the report).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RaceError {
    /// Bad configuration.
    #[error("bad race configuration: {0}")]
    Config(String),
    /// Setting up NICs, pools or connections failed.
    #[error("race setup failed: {0}")]
    Setup(String),
    /// A post or a local access failed where it cannot fail honestly.
    #[error("race step failed: {0}")]
    Step(String),
}

pub(crate) fn setup_err(e: impl std::fmt::Display) -> RaceError {
    RaceError::Setup(e.to_string())
}
pub(crate) fn step_err(e: impl std::fmt::Display) -> RaceError {
    RaceError::Step(e.to_string())
}

/// A seeded generator (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(splitmix64(seed ^ 0x6b76_742d_7261_6365))
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix64(self.0)
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

struct Rig {
    decode: SimNic,
    p0: SimNic,
    p1: SimNic,
    dpool: SlotPool,
    p0pool: SlotPool,
    p1pool: SlotPool,
    gate: Gate,
    /// Prefill 0 as decode numbers it.
    p0_peer: PeerId,
    /// Prefill 1 as decode numbers it.
    p1_peer: PeerId,
    /// Decode as prefill 1 numbers it.
    decode_at_p1: PeerId,
    p0name: String,
}

/// Memory for `slots` slots of `slot_size` bytes, in `memory`.
pub(crate) fn pool_region(memory: SlotMemory, slots: usize, slot_size: usize) -> Result<Arc<dyn Region>, RaceError> {
    let bytes = slots.checked_mul(slot_size).ok_or_else(|| RaceError::Config("pool too large".into()))?;
    memory.allocate(bytes).map_err(setup_err)
}

/// Refuses device memory for a race whose backend addresses host memory only.
#[cfg(any(feature = "mooncake", feature = "verbs"))]
pub(crate) fn host_memory_only(cfg: &RaceConfig, backend: &str) -> Result<(), RaceError> {
    if cfg.memory.is_device() {
        return Err(RaceError::Config(format!(
            "the {backend} race takes host memory only (--device {} needs a backend that stages or registers \
             device memory: tcp-sim, mooncake over TCP)",
            cfg.memory
        )));
    }
    Ok(())
}

/// The decode pool's ladder: `drain_us` to drain, then 1 s to revoke, 5 s
/// to fence.
pub(crate) fn race_ladder(cfg: &RaceConfig) -> EscalationLadder {
    EscalationLadder {
        drain: Duration::from_micros(cfg.drain_us),
        revoke: Duration::from_secs(1),
        fence: Duration::from_secs(5),
    }
}

fn pool(nic: &SimNic, cfg: &RaceConfig, slots: usize, ladder: EscalationLadder) -> Result<SlotPool, RaceError> {
    let region = pool_region(cfg.memory, slots, cfg.slot_size)?;
    nic.register_pool(region, PoolConfig::new(cfg.slot_size).with_ladder(ladder)).map_err(setup_err)
}

impl Rig {
    fn start(cfg: &RaceConfig) -> Result<Self, RaceError> {
        let gate = Gate::new();
        let k = cfg.slots_per_request;
        let ladder = race_ladder(cfg);
        let tag = splitmix64(cfg.seed) % 1_000_000;
        let dname = format!("race-decode-{tag}");
        let decode = SimNic::start(NicConfig::new(dname.clone()).with_policy(cfg.policy).with_faults(FaultPlan {
            seed: cfg.seed,
            gate: Some(gate.clone()),
            ..FaultPlan::default()
        }))
        .map_err(setup_err)?;
        let dpool = pool(&decode, cfg, cfg.round * k * 2, ladder)?;
        let delay = if cfg.delay_max_us == 0 {
            DelayDist::None
        } else {
            DelayDist::Uniform { min_us: 0, max_us: cfg.delay_max_us }
        };
        let p0name = format!("race-prefill0-{tag}");
        let p0 = SimNic::start(NicConfig::new(p0name.clone()).with_faults(FaultPlan {
            seed: cfg.seed,
            delay,
            ..FaultPlan::default()
        }))
        .map_err(setup_err)?;
        let p0pool = pool(&p0, cfg, cfg.round * k, EscalationLadder::default())?;
        let p1 = SimNic::start(NicConfig::new(format!("race-prefill1-{tag}"))).map_err(setup_err)?;
        let p1pool = pool(&p1, cfg, cfg.round * k * 2, ladder)?;
        p0.connect(decode.endpoint()).map_err(setup_err)?;
        let wait = Duration::from_millis(cfg.timeout_ms);
        let p0_peer = decode.wait_for_peer(&p0name, wait).ok_or_else(|| setup_err("prefill 0 did not connect"))?;
        let p1_peer = decode.connect(p1.endpoint()).map_err(setup_err)?;
        let decode_at_p1 = p1.wait_for_peer(&dname, wait).ok_or_else(|| setup_err("decode did not reach prefill 1"))?;
        Ok(Self { decode, p0, p1, dpool, p0pool, p1pool, gate, p0_peer, p1_peer, decode_at_p1, p0name })
    }

    fn reconnect_p0(&mut self, wait: Duration) -> Result<(), RaceError> {
        self.p0.connect_new(self.decode.endpoint()).map_err(setup_err)?;
        let ok =
            wait_until(wait, || self.decode.peers().iter().any(|p| p.name == self.p0name && p.peer != self.p0_peer));
        let peer = self.decode.peers().into_iter().filter(|p| p.name == self.p0name).map(|p| p.peer).max();
        match peer {
            Some(p) if ok => {
                self.p0_peer = p;
                Ok(())
            }
            _ => Err(setup_err("prefill 0 could not reconnect")),
        }
    }
}

struct First {
    id: u64,
    exposed: Option<SlotLease<Exposed>>,
    remote: RemoteSlots,
    handle: TransferHandle,
    aborted: bool,
    /// Held round, aborted, and its slots handed to a new tenancy before the gate opened.
    reassigned_before_landing: Vec<bool>,
}

enum NextData {
    /// Pulled by decode: already settled; prefill 1's exposure waits for the notify.
    Pulled { lease: Option<SlotLease<Settled>>, source: SlotLease<Exposed> },
    /// Pushed by prefill 1.
    Pushed { exposed: SlotLease<Exposed>, handle: TransferHandle },
}

struct Next {
    tags: Vec<Tag>,
    data: NextData,
}

pub(crate) fn tags_of(id: u64, remote: &RemoteSlots) -> Vec<Tag> {
    remote.slots.iter().map(|s| Tag::new(id, s.slot.0, s.generation.0)).collect()
}

pub(crate) fn fill_lease(
    lease: &mut SlotLease<kv_transfer_core::Reserved>,
    tags: &[Tag],
    size: usize,
) -> Result<(), RaceError> {
    for (i, t) in tags.iter().enumerate() {
        lease.write_at(i, 0, &pattern(size, *t)).map_err(step_err)?;
    }
    Ok(())
}

/// What a consumer found in its settled lease; `None`: the read was
/// refused for integrity (the bytes changed after their digest was taken).
pub(crate) fn check_lease(lease: &SlotLease<Settled>, tags: &[Tag], size: usize) -> Option<SlotCheck> {
    let mut c = SlotCheck::default();
    let mut buf = vec![0u8; size];
    for (i, t) in tags.iter().enumerate() {
        match lease.read_at(i, 0, &mut buf) {
            Ok(()) => c.merge(verify(&buf, *t)),
            Err(kv_transfer_core::AccessError::Integrity { .. }) => return None,
            Err(_) => c.garbage_bytes += size,
        }
    }
    Some(c)
}

#[cfg(any(feature = "verbs", feature = "mooncake"))]
/// How many of `lease`'s slots hold bytes of another request.
pub(crate) fn slots_with_foreign_bytes(lease: &SlotLease<kv_transfer_core::Settled>, tags: &[Tag], size: usize) -> u64 {
    let mut buf = vec![0u8; size];
    let mut n = 0;
    for (i, t) in tags.iter().enumerate() {
        if lease.read_at(i, 0, &mut buf).is_ok() && crate::payload::verify(&buf, *t).foreign_bytes > 0 {
            n += 1;
        }
    }
    n
}

#[cfg(any(feature = "verbs", feature = "mooncake"))]
/// Waits (bounded by `wait`) for `exposed` to settle; a wait that gives up
/// is counted in `rep.timeouts`.
pub(crate) fn settle_within(
    exposed: SlotLease<Exposed>,
    wait: Duration,
    rep: &mut RaceReport,
) -> Option<SlotLease<Settled>> {
    let mut fut = Box::pin(exposed.settled());
    let out = poll_until(fut.as_mut(), wait);
    if out.is_none() {
        rep.timeouts += 1;
    }
    out
}

#[cfg(any(feature = "verbs", feature = "mooncake"))]
/// Waits (bounded by `wait`) for `h`; whether the operation succeeded. Its
/// lease is released; an abandoned one comes back with its side's fence; a
/// wait that gives up is counted in `rep.timeouts`.
pub(crate) fn await_within(mut h: TransferHandle, wait: Duration, rep: &mut RaceReport) -> bool {
    match poll_until(std::pin::Pin::new(&mut h), wait) {
        Some(Ok(out)) => {
            let ok = out.result.is_ok();
            out.lease.release();
            ok
        }
        Some(Err(_abandoned)) => false,
        None => {
            rep.timeouts += 1;
            false
        }
    }
}

/// Counts one consumer's finding in `rep`.
pub(crate) fn record_consumed(rep: &mut RaceReport, c: Option<SlotCheck>) {
    rep.requests += 1;
    let Some(c) = c else {
        rep.integrity_caught += 1;
        return;
    };
    if c.foreign_bytes > 0 {
        rep.foreign_requests += 1;
        rep.foreign_bytes += c.foreign_bytes as u64;
    } else if c.garbage_bytes > 0 {
        rep.garbage_requests += 1;
    }
}

struct Run<'a> {
    cfg: &'a RaceConfig,
    rig: Rig,
    rng: Rng,
    rep: RaceReport,
    next_id: u64,
    wait: Duration,
}

impl Run<'_> {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn consumed(&mut self, c: Option<SlotCheck>) {
        record_consumed(&mut self.rep, c);
    }

    fn settle_exposed(&mut self, exposed: SlotLease<Exposed>) -> Option<SlotLease<Settled>> {
        let mut fut = Box::pin(exposed.settled());
        let out = poll_until(fut.as_mut(), self.wait);
        if out.is_none() {
            self.rep.timeouts += 1;
        }
        out
    }

    fn round(&mut self) -> Result<(), RaceError> {
        let (cfg, k, size) = (self.cfg, self.cfg.slots_per_request, self.cfg.slot_size);
        let held = self.rng.chance(cfg.hold_rate);
        if held {
            self.rep.held_rounds += 1;
            self.rig.gate.hold();
        }
        // First tenants: reserve, expose to prefill 0, which writes.
        let mut firsts = Vec::with_capacity(cfg.round);
        for _ in 0..cfg.round {
            let id = self.id();
            let Ok(lease) = self.rig.dpool.reserve(k) else {
                self.rep.admission_rejected += 1;
                continue;
            };
            let (exposed, remote) = match self.rig.decode.expose(lease, self.rig.p0_peer) {
                Ok(x) => x,
                Err(e) => {
                    // The connection was fenced (the ladder's last step):
                    // reconnect, as a serving engine would, and go on.
                    self.rep.reconnects += 1;
                    self.rig.reconnect_p0(self.wait)?;
                    self.rig
                        .decode
                        .expose(e.lease, self.rig.p0_peer)
                        .map_err(|e| step_err(format!("{} (decode NIC: {:?})", e.kind, self.rig.decode.stats())))?
                }
            };
            let mut src = self.rig.p0pool.reserve(k).map_err(step_err)?;
            fill_lease(&mut src, &tags_of(id, &remote), size)?;
            let handle =
                block_on(self.rig.p0.write(src, &remote, TransferOptions::default().with_digest(self.cfg.digest)))
                    .map_err(|e| step_err(e.kind))?;
            let aborted = self.rng.chance(cfg.abort_rate);
            firsts.push(First {
                id,
                exposed: Some(exposed),
                remote,
                handle,
                aborted,
                reassigned_before_landing: vec![],
            });
        }
        if held && !firsts.is_empty() && !self.rig.gate.wait_for_waiting(1, self.wait) {
            self.rep.timeouts += 1;
        }
        // Aborts while the writes are in flight.
        let mut n_aborted = 0;
        for f in firsts.iter_mut().filter(|f| f.aborted) {
            drop(f.exposed.take());
            n_aborted += 1;
        }
        self.rep.aborted += n_aborted;
        self.rep.peak_quarantined = self.rep.peak_quarantined.max(self.rig.dpool.metrics().quarantined);
        // Next tenants, once the aborted slots are back (only with a proof, under `safe`).
        let mut nexts = Vec::new();
        if n_aborted > 0 {
            let dpool = self.rig.dpool.clone();
            if !wait_until(self.wait, || dpool.metrics().quarantined == 0) {
                self.rep.timeouts += 1;
            }
            // One path per round: a pushed write held at the gate would hold
            // a pulled READ's response behind it on the same connection.
            let pull = self.rng.chance(0.5);
            for _ in 0..n_aborted {
                nexts.push(self.next_tenant(pull)?);
            }
            if held {
                for f in firsts.iter_mut().filter(|f| f.aborted) {
                    f.reassigned_before_landing = f
                        .remote
                        .slots
                        .iter()
                        .map(|s| self.rig.dpool.generation(s.slot).is_some_and(|g| g != s.generation))
                        .collect();
                }
            }
        }
        if held {
            self.rig.gate.open();
        }
        // Every prefill operation reaches its terminal status (bounded).
        for f in &mut firsts {
            match poll_until(std::pin::Pin::new(&mut f.handle), self.wait) {
                Some(Ok(out)) => {
                    if f.aborted && out.result.is_ok() {
                        self.rep.stale_writes_landed +=
                            f.reassigned_before_landing.iter().filter(|r| **r).count() as u64;
                    }
                    if matches!(out.result, Err(TransferError::Rejected(_))) && !f.aborted {
                        self.rep.garbage_requests += 1;
                    }
                    out.lease.release();
                }
                Some(Err(_abandoned)) => self.rep.timeouts += 1,
                None => self.rep.timeouts += 1,
            }
        }
        for n in &mut nexts {
            if let NextData::Pushed { handle, .. } = &mut n.data {
                match poll_until(std::pin::Pin::new(handle), self.wait) {
                    Some(Ok(out)) => out.lease.release(),
                    _ => self.rep.timeouts += 1,
                }
            }
        }
        // Consumers read and check every byte.
        for mut f in firsts {
            if let Some(exposed) = f.exposed.take() {
                let tags = tags_of(f.id, &f.remote);
                match self.settle_exposed(exposed) {
                    Some(settled) => {
                        let c = check_lease(&settled, &tags, size);
                        self.consumed(c);
                        settled.release();
                    }
                    None => self.rep.requests += 1,
                }
            } else {
                self.rep.requests += 1;
            }
        }
        for n in nexts {
            self.rep.reassigned += 1;
            match n.data {
                NextData::Pulled { lease, source } => {
                    match lease {
                        Some(l) => {
                            let c = check_lease(&l, &n.tags, size);
                            self.consumed(c);
                            l.release();
                        }
                        None => self.rep.requests += 1,
                    }
                    if let Some(s) = self.settle_exposed(source) {
                        s.release();
                    }
                }
                NextData::Pushed { exposed, .. } => match self.settle_exposed(exposed) {
                    Some(settled) => {
                        let c = check_lease(&settled, &n.tags, size);
                        self.consumed(c);
                        settled.release();
                    }
                    None => self.rep.requests += 1,
                },
            }
        }
        Ok(())
    }

    fn next_tenant(&mut self, pull: bool) -> Result<Next, RaceError> {
        let (k, size) = (self.cfg.slots_per_request, self.cfg.slot_size);
        let id = self.id();
        let lease = self.rig.dpool.reserve(k).map_err(step_err)?;
        let tags: Vec<Tag> = lease.tenancies().iter().map(|t| Tag::new(id, t.slot.0, t.generation.0)).collect();
        let mut src = self.rig.p1pool.reserve(k).map_err(step_err)?;
        fill_lease(&mut src, &tags, size)?;
        if pull {
            // Pull: decode READs prefill 1's slots; lands before the gate opens.
            let (source, sremote) = self.rig.p1.expose(src, self.rig.decode_at_p1).map_err(|e| step_err(e.kind))?;
            let mut h = block_on(self.rig.decode.read(
                lease,
                &sremote,
                TransferOptions::default().with_digest(self.cfg.digest),
            ))
            .map_err(|e| step_err(e.kind))?;
            let lease = match poll_until(std::pin::Pin::new(&mut h), self.wait) {
                Some(Ok(out)) if out.result.is_ok() => Some(out.lease),
                Some(Ok(out)) => {
                    out.lease.release();
                    None
                }
                _ => {
                    self.rep.timeouts += 1;
                    None
                }
            };
            Ok(Next { tags, data: NextData::Pulled { lease, source } })
        } else {
            // Push: prefill 1 WRITEs; races the held writes at the gate.
            let (exposed, remote) = self.rig.decode.expose(lease, self.rig.p1_peer).map_err(|e| step_err(e.kind))?;
            let handle =
                block_on(self.rig.p1.write(src, &remote, TransferOptions::default().with_digest(self.cfg.digest)))
                    .map_err(|e| step_err(e.kind))?;
            Ok(Next { tags, data: NextData::Pushed { exposed, handle } })
        }
    }
}

/// Refuses a configuration no run can carry out.
pub(crate) fn check_config(cfg: &RaceConfig) -> Result<(), RaceError> {
    if cfg.slots_per_request == 0 || cfg.slot_size == 0 || cfg.round == 0 {
        return Err(RaceError::Config("slots_per_request, slot_size and round must be non-zero".into()));
    }
    if !(0.0..=1.0).contains(&cfg.abort_rate) || !(0.0..=1.0).contains(&cfg.hold_rate) {
        return Err(RaceError::Config("abort_rate and hold_rate must lie in [0, 1]".into()));
    }
    if cfg.slot_size > 16 << 20 || cfg.slots_per_request > 64 || cfg.round > 4096 || cfg.blocker_bytes > 256 << 20 {
        return Err(RaceError::Config(
            "slot_size ≤ 16 MiB, slots_per_request ≤ 64, round ≤ 4096, blocker_bytes ≤ 256 MiB".into(),
        ));
    }
    Ok(())
}

/// A race's rounds, on whatever backend.
pub(crate) trait Rounds {
    /// Runs one round.
    fn round(&mut self) -> Result<(), RaceError>;
    /// The report so far.
    fn report(&self) -> &RaceReport;
}

/// Runs rounds until `cfg.requests` are served or refused (bounded: each
/// round serves at least `round` of them), calling `progress` after each;
/// returns the wall time.
pub(crate) fn run_rounds(
    cfg: &RaceConfig,
    run: &mut impl Rounds,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Duration, RaceError> {
    let t0 = Instant::now();
    let max_rounds = cfg.requests / cfg.round as u64 + 2;
    let mut rounds = 0;
    let left = |r: &RaceReport| r.requests + r.admission_rejected < cfg.requests;
    while left(run.report()) && rounds < max_rounds {
        run.round()?;
        rounds += 1;
        progress(run.report().requests.min(cfg.requests), cfg.requests);
    }
    Ok(t0.elapsed())
}

/// Waits (bounded) for the decode pool to come back whole, and fills the
/// report's pool figures and rates.
pub(crate) fn finish_report(rep: &mut RaceReport, dpool: &SlotPool, wait: Duration, elapsed: Duration) {
    if !wait_until(wait, || {
        let m = dpool.metrics();
        m.quarantined == 0 && m.free == m.capacity
    }) {
        rep.timeouts += 1;
    }
    let m = dpool.metrics();
    rep.abort_to_reclaim = m.abort_to_reclaim;
    rep.settled = [m.settled_completed, m.settled_revoked, m.settled_fenced];
    rep.capacity = m.capacity;
    rep.final_free = m.free;
    rep.elapsed_s = elapsed.as_secs_f64();
    rep.requests_per_s = if rep.elapsed_s > 0.0 { rep.requests as f64 / rep.elapsed_s } else { 0.0 };
}

impl Rounds for Run<'_> {
    fn round(&mut self) -> Result<(), RaceError> {
        Run::round(self)
    }
    fn report(&self) -> &RaceReport {
        &self.rep
    }
}

/// Runs the race and reports what consumers found. `progress(done, total)`
/// is called after every round.
///
/// ```
/// use kv_transfer_examples::race::{run_race, RaceConfig};
/// use backend_tcp_sim::ReleasePolicy;
/// let cfg = RaceConfig { requests: 64, policy: ReleasePolicy::Safe, ..RaceConfig::default() };
/// let r = run_race(&cfg, &mut |_, _| {}).unwrap();
/// assert_eq!(r.foreign_requests, 0);
/// assert!(r.pool_whole());
/// ```
pub fn run_race(cfg: &RaceConfig, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    check_config(cfg)?;
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
    rig.gate.open();
    finish_report(&mut rep, &rig.dpool, wait, elapsed);
    let s = rig.decode.stats();
    rep.rejected_at_nic = s.rejected_stale_generation + s.rejected_wrong_peer;
    rep.stale_notifications = s.notifications_stale;
    rep.naive_releases = s.naive_releases;
    rep.fences = s.fences;
    drop(rig);
    Ok(rep)
}

/// `naive` or `safe`.
pub fn policy_name(p: ReleasePolicy) -> &'static str {
    if p.is_naive() {
        "naive"
    } else {
        "safe"
    }
}

/// The reports side by side, one column per run, as an aligned text table.
pub fn table(reports: &[RaceReport]) -> String {
    let col = |r: &RaceReport| r.config.as_ref().map_or("?", |c| policy_name(c.policy));
    type Row = (&'static str, fn(&RaceReport) -> String);
    let rows: [Row; 12] = [
        ("requests", |r| r.requests.to_string()),
        ("aborted with writes in flight", |r| r.aborted.to_string()),
        ("slots reassigned after abort", |r| r.reassigned.to_string()),
        ("stale writes landed in a reassigned slot", |r| r.stale_writes_landed.to_string()),
        ("requests that consumed foreign bytes", |r| r.foreign_requests.to_string()),
        ("foreign bytes consumed", |r| r.foreign_bytes.to_string()),
        ("stale writes rejected at the NIC", |r| r.rejected_at_nic.to_string()),
        ("stale notifications/acks dropped", |r| r.stale_notifications.to_string()),
        ("peak quarantined slots", |r| r.peak_quarantined.to_string()),
        ("abort-to-reclaim p50 / p99", |r| format!("{} / {} µs", r.abort_to_reclaim.p50_us, r.abort_to_reclaim.p99_us)),
        ("throughput", |r| format!("{:.0} req/s", r.requests_per_s)),
        ("pool whole at the end", |r| {
            if r.pool_whole() {
                "yes".into()
            } else {
                format!("NO ({} free of {})", r.final_free, r.capacity)
            }
        }),
    ];
    let w0 = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = rows.iter().map(|(_, f)| reports.iter().map(f).collect()).collect();
    let widths: Vec<usize> = (0..reports.len())
        .map(|i| cells.iter().map(|c| c[i].chars().count()).chain([col(&reports[i]).len()]).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    let rule = "-".repeat(w0 + widths.iter().map(|w| w + 3).sum::<usize>());
    out += &format!("{:<w0$}", "");
    for (i, r) in reports.iter().enumerate() {
        out += &format!(" | {:>w$}", col(r), w = widths[i]);
    }
    out += &format!("\n{rule}\n");
    for (ri, (label, _)) in rows.iter().enumerate() {
        out += &format!("{:<w0$}", label, w0 = w0 + label.len() - label.chars().count());
        for (i, c) in cells[ri].iter().enumerate() {
            let w = widths[i] + c.len() - c.chars().count();
            out += &format!(" | {c:>w$}");
        }
        out.push('\n');
    }
    out
}
