//! The randomized race of aborts, reassignments, held and delayed writes
//! (scenario 2), written once (`run.rs`) and run on each backend's rig: the
//! TCP simulator ([`run_race`]), the Mooncake adapter (`mooncake`) and real
//! verbs (`verbs`).
//!
//! One decode side with a pool twice a round's size, two prefill workers.
//! The run goes in rounds; in each round, decided by the seed:
//!
//! 1. Some rounds are *held*: prefill 0's writes stay in flight past their
//!    aborts (the "write survives the abort" of every engine's bug report).
//!    How is the backend's: the simulator holds them at the decode NIC's
//!    gate, Mooncake in prefill 0's transport, verbs behind a large WRITE
//!    queued ahead of them on the same queue pair.
//! 2. `round` requests reserve slots and expose them to prefill 0, which
//!    writes a [tagged](crate::payload) payload into them.
//! 3. A seeded share of them is aborted while their writes are in flight.
//! 4. Once the aborted slots are reclaimed (at once under `naive`, only
//!    with a proof under `safe`), next tenants reserve slots (the free list
//!    is LIFO: the same slots) and get their bytes from prefill 1, pushed
//!    (a WRITE) or, where the backend can, pulled (a READ by decode).
//! 5. The hold ends, every prefill operation is awaited (bounded), and
//!    every consumer checks every byte it reads against its own tag.
//!
//! Under [`ReleasePolicy::Naive`] the aborted requests' late writes land in
//! the next tenants' slots and consumers read foreign bytes: the positive
//! control ([`RaceReport::stale_writes_landed`]). Under
//! [`ReleasePolicy::Safe`] the same schedule yields zero foreign bytes: the
//! late writes are refused at the NIC (stale generation, an invalidated
//! window, a revoked key), or, on a backend that cannot revoke, land in
//! slots still quarantined ([`RaceReport::stale_writes_quarantined`]).
//!
//! The seed fixes the schedule (which rounds hold, which requests abort,
//! which tenants pull or push, the simulator's per-WR delays); the
//! interleaving of the NICs' threads is the race itself.

#[cfg(feature = "mooncake")]
#[cfg_attr(docsrs, doc(cfg(feature = "mooncake")))]
pub mod mooncake;
mod run;
mod sim;
#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
pub mod verbs;

pub use sim::run_race;

use crate::payload::{pattern, verify, SlotCheck, Tag};
use crate::wait::{poll_until, wait_until};
use backend_tcp_sim::{splitmix64, ReleasePolicy};
use kv_transfer_core::{
    EscalationLadder, Exposed, LatencySummary, Region, RemoteSlots, Settled, SlotLease, SlotMemory, SlotPool,
    TransferHandle,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

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

/// How many of `lease`'s slots an old write changed: bytes of another
/// request, or bytes that no longer match their digest (a read refused for
/// integrity).
pub(crate) fn stale_slots(lease: &SlotLease<Settled>, tags: &[Tag], size: usize) -> u64 {
    let mut buf = vec![0u8; size];
    let mut n = 0;
    for (i, t) in tags.iter().enumerate() {
        n += match lease.read_at(i, 0, &mut buf) {
            Ok(()) => u64::from(verify(&buf, *t).foreign_bytes > 0),
            Err(kv_transfer_core::AccessError::Integrity { .. }) => 1,
            Err(_) => 0,
        };
    }
    n
}

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
