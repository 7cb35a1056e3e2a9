//! `kvt soak`: the disaggregated workload across two hosts (network
//! namespaces on a veth pair, `netns-lab`) for a given time, with faults
//! injected at random: link flaps, loss bursts (netem, where the kernel has
//! it) and prefill kills and restarts.
//!
//! Decode runs on host a (a [`SimNic`] with a slot pool), prefill on host b.
//! Requests go in rounds: each reserves decode slots, exposes them to the
//! prefill, which WRITEs a [tagged](kv_transfer_examples::payload) payload
//! with seeded per-WR delays; a seeded share is aborted with its writes in
//! flight; the others wait (bounded) for their proof and their consumer
//! checks every byte. Because the free list is LIFO, the next round's
//! tenants get the aborted slots: a slot freed before its late writes were
//! drained shows up as foreign bytes. A second thread cuts the link, shapes
//! it or flags a kill at seeded times.
//!
//! What it proves: 0 foreign bytes under `safe` (and some under `naive`,
//! the positive control), the pool whole once the faults stop (every
//! quarantined slot accounted for: proven free or still reported), and RSS
//! flat after warm-up (the least-squares slope of its samples).

use crate::adversary::{self, Adversary, AdversaryConfig, AttackKind, ControlCounts, FaultClock, KindCounts, Target};
use backend_tcp_sim::{block_on, DelayDist, FaultPlan, InboundEvent, NicConfig, ReleasePolicy, SimNic};
use kv_transfer_core::auth::ClusterKey;
use kv_transfer_core::{
    poll_until, EscalationLadder, Exposed, HostRegion, MetricsSnapshot, PeerId, PoolConfig, RemoteSlots, SlotLease,
    SlotPool, Transfer, TransferHandle, TransferOptions,
};
use kv_transfer_examples::payload::{pattern, verify, Tag};
use kv_transfer_examples::race::Rng;
use netns_lab::Lab;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// How long the workload runs (faults included).
    pub duration: Duration,
    /// A line every `interval`.
    pub interval: Duration,
    /// Seed of the schedule (aborts, delays, faults).
    pub seed: u64,
    /// The decode NIC's release policy (`naive`: the positive control).
    pub policy: ReleasePolicy,
    /// Decode slots.
    pub slots: usize,
    /// Bytes per slot.
    pub slot_size: usize,
    /// Slots per request.
    pub slots_per_request: usize,
    /// Requests per round.
    pub round: usize,
    /// Share of requests aborted with their writes in flight.
    pub abort_rate: f64,
    /// Mean time between faults.
    pub fault_every: Duration,
    /// Which faults to inject.
    pub faults: FaultKinds,
    /// Run a no-attack baseline (the first third of `duration`), then the
    /// same workload under a seeded adversary ([`crate::adversary`]), and
    /// check the bounds of [`AdversaryReport`].
    pub adversary: bool,
}

/// Which faults a soak injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultKinds {
    /// Link cuts.
    pub flaps: bool,
    /// Loss bursts (netem; flaps where the kernel has no netem).
    pub bursts: bool,
    /// Prefill kills and restarts.
    pub kills: bool,
}

impl FaultKinds {
    /// Every kind.
    pub const ALL: Self = Self { flaps: true, bursts: true, kills: true };
}

impl Default for SoakConfig {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(60),
            interval: Duration::from_secs(10),
            seed: 1,
            policy: ReleasePolicy::Safe,
            slots: 64,
            slot_size: 16 << 10,
            slots_per_request: 2,
            round: 8,
            abort_rate: 0.3,
            fault_every: Duration::from_secs(3),
            faults: FaultKinds::ALL,
            adversary: false,
        }
    }
}

/// Faults injected.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Faults {
    /// Link cuts (both ends down), each restored.
    pub link_flaps: u64,
    /// Loss bursts (netem loss and delay), each cleared.
    pub loss_bursts: u64,
    /// Prefill NICs crashed (sockets shut without goodbyes) and restarted.
    pub peer_kills: u64,
    /// Why there were no loss bursts, if so (no `sch_netem`).
    pub loss_bursts_unavailable: Option<String>,
}

/// One interval's line.
#[derive(Clone, Debug, Serialize)]
pub struct IntervalLine {
    /// Seconds since the start.
    pub t_s: f64,
    /// Requests consumed so far.
    pub requests: u64,
    /// Requests aborted so far.
    pub aborted: u64,
    /// Foreign bytes consumed so far.
    pub foreign_bytes: u64,
    /// Decode slots in quarantine now.
    pub quarantined: u64,
    /// Quarantined slots past their last escalation step now.
    pub stuck: u64,
    /// Resident set size now.
    pub rss_bytes: u64,
    /// Heap in use now (glibc's `mallinfo2`; 0 elsewhere).
    pub heap_bytes: u64,
    /// With `--adversary`: the phase and the attacks so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adversary: Option<AdversaryLine>,
}

/// The adversary's part of an interval line.
#[derive(Clone, Debug, Serialize)]
pub struct AdversaryLine {
    /// `baseline` or `attack`.
    pub phase: &'static str,
    /// p99 of the honest requests of this phase so far, ms.
    pub p99_ms: f64,
    /// Threads of this process now (`/proc/self/status` `Threads`).
    pub threads: u64,
    /// Open file descriptors of this process now (`/proc/self/fd`).
    pub fds: u64,
    /// Per attack kind so far.
    pub kinds: BTreeMap<&'static str, KindCounts>,
}

/// What a soak found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SoakReport {
    /// `safe` or `naive`.
    pub policy: String,
    /// The seed.
    pub seed: u64,
    /// Requests whose consumer read its slots.
    pub requests: u64,
    /// Requests aborted (by the schedule, by a kill, or their proof not in time).
    pub aborted: u64,
    /// Foreign bytes consumed (another request's bytes in a consumer's slots).
    pub foreign_bytes: u64,
    /// Requests that consumed foreign bytes.
    pub foreign_requests: u64,
    /// Requests whose slots, after their DONE, held bytes of nobody (torn).
    pub garbage_requests: u64,
    /// Requests whose lease settled without a DONE (a fence or a
    /// revocation: the transfer failed; not consumed, as an engine retries).
    pub failed: u64,
    /// Decode slots still quarantined at the end (after the faults stopped
    /// and the drain had its time).
    pub quarantined: u64,
    /// Of those, reported stuck (no escalation step left).
    pub stuck: u64,
    /// Most slots quarantined at once.
    pub peak_quarantined: u64,
    /// RSS at the end.
    pub rss_bytes: u64,
    /// Least-squares slope of RSS after warm-up, bytes per minute.
    pub rss_slope_bytes_per_min: f64,
    /// Heap in use at the end (glibc's `mallinfo2`: what the program holds;
    /// RSS also counts what the allocator keeps after it was freed).
    pub heap_bytes: u64,
    /// Least-squares slope of the heap in use after warm-up, bytes per minute.
    pub heap_slope_bytes_per_min: f64,
    /// Faults injected.
    pub faults: Faults,
    /// Reservations refused by admission (the pool full of quarantine).
    pub admission_rejected: u64,
    /// Posts the prefill could not make (its peer gone).
    pub post_failures: u64,
    /// Decode slots settled by acks, revocations, fences.
    pub settled_completed: u64,
    /// See `settled_completed`.
    pub settled_revoked: u64,
    /// See `settled_completed`.
    pub settled_fenced: u64,
    /// Decode pool capacity.
    pub capacity: u64,
    /// Free decode slots at the end.
    pub final_free: u64,
    /// Seconds.
    pub elapsed_s: f64,
    /// A line per interval.
    pub intervals: Vec<IntervalLine>,
    /// With `--adversary`: what the attacks did, and the bounds checked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adversary: Option<AdversaryReport>,
}

impl SoakReport {
    /// The contract held: no foreign byte, every slot back in the pool
    /// (and, with `--adversary`, every bound of [`AdversaryReport`]).
    pub fn clean(&self) -> bool {
        self.foreign_bytes == 0
            && self.final_free == self.capacity
            && self.quarantined == 0
            && self.adversary.as_ref().map_or(true, |a| a.failures.is_empty())
    }
}

/// Honest p99 under attack may be at most this many times the baseline's ...
pub const P99_FACTOR: f64 = 3.0;
/// ... or the baseline's plus this many ms, whichever is larger (a noisy
/// shared 2-core machine: the adversary's threads take CPU from the
/// workload, which is the effect this bounds).
pub const P99_FLOOR_MS: f64 = 40.0;
/// Threads at the end of the attack (the adversary stopped, the targets'
/// handshake threads given their deadline to end) at most the baseline's
/// plus this.
pub const THREADS_BOUND: u64 = 8;
/// Open descriptors likewise.
pub const FDS_BOUND: u64 = 32;
/// RSS likewise, bytes.
pub const RSS_BOUND: u64 = 24 << 20;
/// Heap in use (glibc's `mallinfo2`) likewise, bytes.
pub const HEAP_BOUND: u64 = 8 << 20;
/// Least-squares slope of the heap in use over the attack phase's second
/// half at most this, bytes per minute.
pub const HEAP_SLOPE_BOUND: f64 = 16.0 * (1 << 20) as f64;
/// Fewest samples (one a second) the heap slope bound is checked on:
/// fewer (an attack phase under 40 s) are reported, not checked (a flood
/// in flight at one sample moves the slope of a few samples by megabytes).
pub const HEAP_SLOPE_MIN_SAMPLES: usize = 20;
/// Fewest honest requests a phase's p99 is taken over.
pub const MIN_LATENCY_SAMPLES: u64 = 200;
/// How long a fault's effects (fences, reconnects, drains) are taken to
/// last after it ends: honest requests of rounds that overlap a fault or
/// this grace are left out of the p99s (counted in `latency_excluded`).
const FAULT_GRACE: Duration = Duration::from_secs(2);

/// Handshake and listener counters of the targets (summed over the honest NICs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TargetStats {
    /// `auth_stats().established`.
    pub auth_established: u64,
    /// `auth_stats().wrong_key`.
    pub auth_wrong_key: u64,
    /// `auth_stats().replayed`.
    pub auth_replayed: u64,
    /// `auth_stats().address_mismatch`.
    pub auth_address_mismatch: u64,
    /// `auth_stats().refused_by_peer`.
    pub auth_refused_by_peer: u64,
    /// `auth_stats().malformed`.
    pub auth_malformed: u64,
    /// `auth_stats().io`.
    pub auth_io: u64,
    /// `stats().handshakes_refused_busy`.
    pub handshakes_refused_busy: u64,
    /// `stats().handshakes_refused_per_address`.
    pub handshakes_refused_per_address: u64,
    /// `stats().connections_refused_per_address`.
    pub connections_refused_per_address: u64,
}

impl TargetStats {
    fn of(nic: &SimNic) -> Self {
        let (a, s) = (nic.auth_stats(), nic.stats());
        Self {
            auth_established: a.established,
            auth_wrong_key: a.wrong_key,
            auth_replayed: a.replayed,
            auth_address_mismatch: a.address_mismatch,
            auth_refused_by_peer: a.refused_by_peer,
            auth_malformed: a.malformed,
            auth_io: a.io,
            handshakes_refused_busy: s.handshakes_refused_busy,
            handshakes_refused_per_address: s.handshakes_refused_per_address,
            connections_refused_per_address: s.connections_refused_per_address,
        }
    }

    fn zip(self, o: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        Self {
            auth_established: f(self.auth_established, o.auth_established),
            auth_wrong_key: f(self.auth_wrong_key, o.auth_wrong_key),
            auth_replayed: f(self.auth_replayed, o.auth_replayed),
            auth_address_mismatch: f(self.auth_address_mismatch, o.auth_address_mismatch),
            auth_refused_by_peer: f(self.auth_refused_by_peer, o.auth_refused_by_peer),
            auth_malformed: f(self.auth_malformed, o.auth_malformed),
            auth_io: f(self.auth_io, o.auth_io),
            handshakes_refused_busy: f(self.handshakes_refused_busy, o.handshakes_refused_busy),
            handshakes_refused_per_address: f(self.handshakes_refused_per_address, o.handshakes_refused_per_address),
            connections_refused_per_address: f(self.connections_refused_per_address, o.connections_refused_per_address),
        }
    }

    /// The counter named `name` (an [`AttackKind::refused_as`]).
    pub fn get(&self, name: &str) -> u64 {
        match name {
            "auth_established" => self.auth_established,
            "auth_wrong_key" => self.auth_wrong_key,
            "auth_replayed" => self.auth_replayed,
            "auth_address_mismatch" => self.auth_address_mismatch,
            "auth_refused_by_peer" => self.auth_refused_by_peer,
            "auth_malformed" => self.auth_malformed,
            "auth_io" => self.auth_io,
            "handshakes_refused_busy" => self.handshakes_refused_busy,
            "handshakes_refused_per_address" => self.handshakes_refused_per_address,
            "connections_refused_per_address" => self.connections_refused_per_address,
            _ => 0,
        }
    }
}

/// One attack kind in the report.
#[derive(Clone, Debug, Serialize)]
pub struct KindReport {
    /// The adversary's counts.
    #[serde(flatten)]
    pub counts: KindCounts,
    /// The targets' counter that types this refusal.
    pub refused_as: &'static str,
    /// That counter's growth over the attack phase (shared by the kinds
    /// refused the same way).
    pub refused_as_delta: u64,
}

/// What `--adversary` found, with its bounds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AdversaryReport {
    /// Seconds of the no-attack baseline phase.
    pub baseline_s: f64,
    /// Seconds of the attack phase.
    pub attack_s: f64,
    /// Honest requests in each phase's p99 (rounds clear of faults).
    pub baseline_samples: u64,
    /// See `baseline_samples`.
    pub attack_samples: u64,
    /// Honest requests left out of the p99s: their round overlapped a fault.
    pub latency_excluded: u64,
    /// Honest request latency (reserve to consumed), ms: p50 and p99 of each phase.
    pub baseline_p50_ms: f64,
    /// See `baseline_p50_ms`.
    pub baseline_p99_ms: f64,
    /// See `baseline_p50_ms`.
    pub attack_p50_ms: f64,
    /// See `baseline_p50_ms`.
    pub attack_p99_ms: f64,
    /// `max(P99_FACTOR * baseline_p99_ms, baseline_p99_ms + P99_FLOOR_MS)`.
    pub p99_bound_ms: f64,
    /// Threads at the baseline's end and at the attack's end.
    pub threads_baseline: u64,
    /// See `threads_baseline`.
    pub threads_end: u64,
    /// Most threads seen during the attack.
    pub threads_peak: u64,
    /// Open descriptors at the baseline's end and at the attack's end.
    pub fds_baseline: u64,
    /// See `fds_baseline`.
    pub fds_end: u64,
    /// Most open descriptors seen during the attack.
    pub fds_peak: u64,
    /// RSS at the baseline's end and at the attack's end.
    pub rss_baseline_bytes: u64,
    /// See `rss_baseline_bytes`.
    pub rss_end_bytes: u64,
    /// Heap in use at the baseline's end and at the attack's end.
    pub heap_baseline_bytes: u64,
    /// See `heap_baseline_bytes`.
    pub heap_end_bytes: u64,
    /// Slope of RSS over the attack phase's second half, bytes per minute.
    pub attack_rss_slope_bytes_per_min: f64,
    /// Slope of the heap in use over the attack phase's second half, bytes per minute.
    pub attack_heap_slope_bytes_per_min: f64,
    /// The bounds: `THREADS_BOUND`, `FDS_BOUND`, `RSS_BOUND`, `HEAP_BOUND`, `HEAP_SLOPE_BOUND`.
    pub threads_bound: u64,
    /// See `threads_bound`.
    pub fds_bound: u64,
    /// See `threads_bound`.
    pub rss_bound_bytes: u64,
    /// See `threads_bound`.
    pub heap_bound_bytes: u64,
    /// See `threads_bound`.
    pub heap_slope_bound_bytes_per_min: f64,
    /// Honest listening ports attacked.
    pub targets: u64,
    /// Per attack kind.
    pub kinds: BTreeMap<&'static str, KindReport>,
    /// Summed over kinds.
    pub total: KindCounts,
    /// The targets' counters' growth over the attack phase.
    pub target_stats: TargetStats,
    /// Peers at the honest NICs under a name the adversary made up (must be 0).
    pub ghost_peers: u64,
    /// The positive control: the attack code with the real key, per target.
    pub control: ControlCounts,
    /// Every bound or check that did not hold (empty: all held).
    pub failures: Vec<String>,
}

/// RSS of this process, from `/proc/self/status` (`VmRSS`, kB).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        })
        .map_or(0, |kb| kb * 1024)
}

/// Heap bytes in use (glibc's `mallinfo2`: arenas' allocated chunks and
/// mmapped blocks); 0 where the C library is not glibc.
pub fn heap_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 has no preconditions; it only reads the allocator's statistics.
        let m = unsafe { libc::mallinfo2() };
        (m.uordblks + m.hblkhd) as u64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

/// Least-squares slope of `(seconds, bytes)` samples, bytes per minute.
pub fn slope_per_min(samples: &[(f64, u64)]) -> f64 {
    let n = samples.len() as f64;
    if samples.len() < 2 {
        return 0.0;
    }
    let mx = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let my = samples.iter().map(|s| s.1 as f64).sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for &(x, y) in samples {
        sxy += (x - mx) * (y as f64 - my);
        sxx += (x - mx) * (x - mx);
    }
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx * 60.0
    }
}

/// Threads of this process (`/proc/self/status` `Threads`).
pub fn threads() -> u64 {
    netns_lab::proc_status("Threads:")
}

/// Open file descriptors of this process (entries of `/proc/self/fd`).
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// Latencies in fixed memory (a soak may run for hours): log-linear
/// buckets of microseconds, 16 per power of two (at most 1/16 off).
#[derive(Clone, Debug)]
pub struct Histogram {
    buckets: Vec<u64>,
    n: u64,
}

const SUB: u64 = 16;

impl Default for Histogram {
    fn default() -> Self {
        Self { buckets: vec![0; 64 * SUB as usize], n: 0 }
    }
}

impl Histogram {
    fn bucket(us: u64) -> usize {
        if us < SUB {
            return us as usize;
        }
        let e = 63 - u64::from(us.leading_zeros());
        let m = (us >> (e - 4)) & (SUB - 1);
        ((e - 3) * SUB + m) as usize
    }

    /// The bucket's lower bound, microseconds.
    fn low(b: usize) -> u64 {
        let b = b as u64;
        if b < SUB {
            return b;
        }
        let (e, m) = (b / SUB + 3, b % SUB);
        (SUB + m) << (e - 4)
    }

    /// Records one latency.
    pub fn record(&mut self, d: Duration) {
        let i = Self::bucket(d.as_micros().min(u128::from(u64::MAX >> 8)) as u64);
        let last = self.buckets.len() - 1;
        self.buckets[i.min(last)] += 1;
        self.n += 1;
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// The `q` quantile (0..=1), ms; 0 with no samples.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let want = ((q * self.n as f64).ceil() as u64).clamp(1, self.n);
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                // The bucket's upper bound: never under-reports.
                return Self::low(i + 1) as f64 / 1_000.0;
            }
        }
        0.0
    }
}

/// Why a soak could not run (findings are in the report).
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    /// The two hosts could not be built (needs root and iproute2).
    #[error("kvt soak runs across two network namespaces, which need root and iproute2: {0}")]
    Lab(#[from] netns_lab::LabError),
    /// Setting up NICs or pools failed.
    #[error("soak setup failed: {0}")]
    Setup(String),
}

fn setup<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> SoakError {
    move |e| SoakError::Setup(format!("{what}: {e}"))
}

/// The decode pool's ladder: short, so cuts of a second or two outlast it.
fn ladder() -> EscalationLadder {
    EscalationLadder {
        drain: Duration::from_millis(200),
        revoke: Duration::from_millis(300),
        fence: Duration::from_millis(1_000),
    }
}

/// Prefill workers on host b. Worker 0 is degraded: it delays each WR by
/// up to 5 ms, and the decode aborts what it sends there; worker 1 is
/// healthy. An aborted request's late write on worker 0 races its slot's
/// next tenant on worker 1: the reordering across connections that makes
/// the hazard. (Either takes the other's share while the other is down.)
const PREFILLS: usize = 2;

/// A prefill worker: a NIC on host b, its pool, and the decode's id for it.
struct Prefill {
    nic: SimNic,
    pool: SlotPool,
    name: String,
    /// This prefill as the decode numbers it.
    peer: PeerId,
}

/// Handles of aborted requests' writes, polled (not awaited) until they
/// end; past this many (a cut link), the oldest are dropped: the backend
/// keeps a dropped handle's lease until its completion.
const MAX_PENDING: usize = 512;

struct Soak<'a> {
    cfg: &'a SoakConfig,
    lab: Arc<Lab>,
    decode: SimNic,
    dpool: SlotPool,
    prefills: Vec<Prefill>,
    restarts: u64,
    rng: Rng,
    rep: SoakReport,
    next_id: u64,
    /// Slot → the latest generation a DONE was seen for (the decode NIC's
    /// `Notified` events): the data is in place only for those.
    notified: HashMap<u32, u64>,
    pending: VecDeque<TransferHandle>,
    /// Honest request latencies: [baseline, attack].
    latency: [Histogram; 2],
    /// 1 once the attack phase started.
    phase: usize,
    latency_excluded: u64,
    /// Latencies count from this long after the start (warm-up).
    latency_from: Duration,
    faults: Arc<FaultClock>,
    /// With `--adversary`: the cluster key the honest NICs share (random
    /// per run), and the ports the adversary may hit (kept current across
    /// prefill restarts).
    key: Option<ClusterKey>,
    targets: Arc<Mutex<Vec<Target>>>,
    /// Counters of prefill NICs replaced since the attack began.
    retired: TargetStats,
}

/// A request of a round.
struct InFlight {
    id: u64,
    reserved: Instant,
    exposed: SlotLease<Exposed>,
    remote: RemoteSlots,
    handle: TransferHandle,
}

impl<'a> Soak<'a> {
    fn start(cfg: &'a SoakConfig, lab: Arc<Lab>, faults: Arc<FaultClock>) -> Result<Self, SoakError> {
        let key = if cfg.adversary { Some(random_key()?) } else { None };
        let mut dcfg = NicConfig::new("soak-decode").with_policy(cfg.policy);
        dcfg.cluster_key = key.clone();
        dcfg.listen = format!("{}:0", lab.a.addr);
        dcfg.revoke_wait = Duration::from_millis(300);
        let decode = lab.a.run(move || SimNic::start(dcfg)).map_err(setup("host a"))?.map_err(setup("decode NIC"))?;
        let region = HostRegion::new(cfg.slots * cfg.slot_size).map(Arc::new).map_err(setup("decode region"))?;
        let dpool = decode
            .register_pool(region, PoolConfig::new(cfg.slot_size).with_ladder(ladder()))
            .map_err(setup("decode pool"))?;
        let prefills = (0..PREFILLS as u64)
            .map(|n| Self::start_prefill(cfg, &lab, &decode, n, key.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let rep = SoakReport {
            policy: kv_transfer_examples::race::policy_name(cfg.policy).to_string(),
            seed: cfg.seed,
            capacity: dpool.metrics().capacity,
            ..SoakReport::default()
        };
        Ok(Self {
            cfg,
            lab,
            decode,
            dpool,
            prefills,
            restarts: 0,
            rng: Rng::new(cfg.seed),
            rep,
            next_id: 0,
            notified: HashMap::new(),
            pending: VecDeque::new(),
            latency: Default::default(),
            phase: 0,
            latency_excluded: 0,
            latency_from: (cfg.duration / 20).min(Duration::from_secs(5)),
            faults,
            key,
            targets: Arc::default(),
            retired: TargetStats::default(),
        })
    }

    /// The honest NICs' listening ports (decode on host a, prefills on b).
    fn publish_targets(&self) {
        let t = |nic: &SimNic, host: usize| {
            nic.endpoint().parse::<SocketAddrV4>().ok().map(|endpoint| Target {
                name: nic.name().to_string(),
                endpoint,
                host,
            })
        };
        let mut v: Vec<Target> = t(&self.decode, 0).into_iter().collect();
        v.extend(self.prefills.iter().filter_map(|p| t(&p.nic, 1)));
        *self.targets.lock().unwrap_or_else(|p| p.into_inner()) = v;
    }

    /// The targets' counters now (current NICs plus those retired since the attack began).
    fn target_stats(&self) -> TargetStats {
        let mut s = TargetStats::of(&self.decode).zip(self.retired, |a, b| a + b);
        for p in &self.prefills {
            s = s.zip(TargetStats::of(&p.nic), |a, b| a + b);
        }
        s
    }

    /// The `n`-th prefill NIC since the start, on host b, connected; even
    /// ones delay their WRs.
    fn start_prefill(
        cfg: &SoakConfig,
        lab: &Lab,
        decode: &SimNic,
        n: u64,
        key: Option<&ClusterKey>,
    ) -> Result<Prefill, SoakError> {
        let name = format!("soak-prefill-{n}");
        let delay = if n % 2 == 0 { DelayDist::Uniform { min_us: 0, max_us: 5_000 } } else { DelayDist::None };
        let mut pcfg =
            NicConfig::new(name.clone()).with_faults(FaultPlan { seed: cfg.seed ^ n, delay, ..FaultPlan::default() });
        pcfg.listen = format!("{}:0", lab.b.addr);
        // Nobody reads the delay log here; kept, it would grow for hours.
        pcfg.fault_log_limit = 0;
        pcfg.cluster_key = key.cloned();
        let ep = decode.endpoint().to_string();
        let nic = lab
            .b
            .run(move || -> Result<SimNic, String> {
                let nic = SimNic::start(pcfg).map_err(|e| e.to_string())?;
                nic.connect(&ep).map_err(|e| e.to_string())?;
                Ok(nic)
            })
            .map_err(setup("host b"))?
            .map_err(setup("prefill NIC"))?;
        let region = HostRegion::new(cfg.slots * cfg.slot_size).map(Arc::new).map_err(setup("prefill region"))?;
        let pool = nic.register_pool(region, PoolConfig::new(cfg.slot_size)).map_err(setup("prefill pool"))?;
        let peer = decode
            .wait_for_peer(&name, Duration::from_secs(5))
            .ok_or_else(|| SoakError::Setup(format!("{name} did not reach the decode")))?;
        Ok(Prefill { nic, pool, name, peer })
    }

    /// After a fence (the decode shut the connection) or a failed link:
    /// a new connection from the same prefill, bounded; false while the
    /// link is down (the next round tries again).
    fn reconnect(&mut self, i: usize) -> bool {
        let (nic, ep) = (self.prefills[i].nic.clone(), self.decode.endpoint().to_string());
        if !matches!(self.lab.b.run(move || nic.connect_new(&ep).is_ok()), Ok(true)) {
            return false;
        }
        let (old, name) = (self.prefills[i].peer, self.prefills[i].name.clone());
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let newest =
                self.decode.peers().into_iter().filter(|p| p.name == name && p.peer > old).map(|p| p.peer).max();
            if let Some(p) = newest.filter(|&p| self.decode.is_connected(p)) {
                self.prefills[i].peer = p;
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    /// Prefill `i` crashes (its sockets shut without goodbyes, as when the
    /// process dies) and a new one takes its place.
    fn kill_and_restart(&mut self, i: usize) -> Result<(), SoakError> {
        self.faults.begin(Duration::ZERO, FAULT_GRACE);
        if self.phase == 1 {
            self.retired = self.retired.zip(TargetStats::of(&self.prefills[i].nic), |a, b| a + b);
        }
        self.prefills[i].nic.crash();
        self.rep.faults.peer_kills += 1;
        // The link may be cut right now: retry (bounded) until a new one connects.
        // Names stay unique and keep the worker's parity (its delay).
        self.restarts += 1;
        let n = 2 * self.restarts + i as u64;
        for _ in 0..50 {
            match Self::start_prefill(self.cfg, &self.lab, &self.decode, n, self.key.as_ref()) {
                Ok(p) => {
                    self.prefills[i] = p;
                    self.publish_targets();
                    self.faults.end(FAULT_GRACE);
                    return Ok(());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        Err(SoakError::Setup("a prefill could not restart within 5 s".into()))
    }

    /// Whether a DONE covered every slot of `remote` (waiting for the
    /// decode NIC's `Notified` event until `deadline`). A lease settled
    /// otherwise (a fence, a revocation, the drain's ack) is safe to reuse
    /// but its bytes are not the transfer's: a consumer must not read them.
    fn data_in_place(&mut self, remote: &RemoteSlots, deadline: Instant) -> bool {
        loop {
            if remote.slots.iter().all(|s| self.notified.get(&s.slot.0) == Some(&s.generation.0)) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.decode.next_event(left.min(Duration::from_millis(5))) {
                Some(InboundEvent::Notified { tenancies, .. }) => {
                    for t in tenancies {
                        self.notified.insert(t.slot.0, t.generation.0);
                    }
                }
                Some(_) => {}
                None if left.is_zero() => return false,
                None => {}
            }
        }
    }

    fn note(&mut self, m: &MetricsSnapshot) {
        self.rep.peak_quarantined = self.rep.peak_quarantined.max(m.quarantined);
    }

    /// One round: expose, write, abort some, consume the rest.
    fn round(&mut self, kill: &AtomicBool) -> Result<(), SoakError> {
        let (k, size) = (self.cfg.slots_per_request, self.cfg.slot_size);
        let mark = self.faults.mark();
        let mut latencies = Vec::with_capacity(self.cfg.round);
        let live: Vec<usize> =
            (0..PREFILLS).filter(|&i| self.decode.is_connected(self.prefills[i].peer) || self.reconnect(i)).collect();
        if live.is_empty() {
            // The link is down: nothing can be posted; try again shortly.
            std::thread::sleep(Duration::from_millis(20));
            return Ok(());
        }
        // Reserve first, then doom a seeded share: the doomed go to the
        // degraded worker (0), whose requests the decode gives up on (as in
        // production, where aborts hit the slow prefill), the others to the
        // healthy one. The doomed slots go (LIFO) to whichever requests of
        // the next round reserve them, while the late writes are in flight.
        let mut exposures = Vec::new();
        for _ in 0..self.cfg.round {
            let doomed = self.rng.chance(self.cfg.abort_rate);
            let w = match (doomed, live.as_slice()) {
                (_, [only]) => *only,
                (true, _) => 0,
                (false, _) => 1,
            };
            let reserved = Instant::now();
            let Ok(lease) = self.dpool.reserve(k) else {
                self.rep.admission_rejected += 1;
                continue;
            };
            match self.decode.expose(lease, self.prefills[w].peer) {
                Ok((exposed, remote)) => exposures.push((doomed, w, exposed, remote, reserved)),
                Err(_) => self.rep.post_failures += 1,
            }
        }
        exposures.sort_by_key(|e| e.0);
        if exposures.is_empty() {
            // The pool is all quarantine (the drains are running): wait a
            // little rather than spin on admission.
            std::thread::sleep(Duration::from_millis(1));
            self.poll_pending();
            return Ok(());
        }
        let mut flights = Vec::new();
        for (doomed, w, exposed, remote, reserved) in exposures {
            let Ok(mut src) = self.prefills[w].pool.reserve(k) else {
                // The worker's slots are all in flight on a cut link.
                exposed.abort();
                self.rep.aborted += 1;
                continue;
            };
            self.next_id += 1;
            let id = self.next_id;
            for (i, s) in remote.slots.iter().enumerate() {
                let _ = src.write_at(i, 0, &pattern(size, Tag::new(id, s.slot.0, s.generation.0)));
            }
            match block_on(self.prefills[w].nic.write(src, &remote, TransferOptions::notify(true))) {
                Ok(handle) => flights.push((doomed, InFlight { id, reserved, exposed, remote, handle })),
                Err(_) => {
                    self.rep.post_failures += 1;
                    exposed.abort();
                    self.rep.aborted += 1;
                }
            }
        }
        // A kill lands here: writes posted, proofs not yet in.
        if kill.swap(false, Ordering::SeqCst) {
            let victim = (self.rng.next_u64() % PREFILLS as u64) as usize;
            self.kill_and_restart(victim)?;
        }
        // The doomed are aborted first, with their writes in flight; their
        // handles are polled in later rounds, not awaited.
        let mut kept = Vec::new();
        for (doomed, f) in flights {
            if doomed {
                f.exposed.abort();
                self.rep.aborted += 1;
                self.pending.push_back(f.handle);
            } else {
                kept.push(f);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut handles = Vec::new();
        for f in kept {
            handles.push(f.handle);
            let mut settled = Box::pin(f.exposed.settled());
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(lease) = poll_until(settled.as_mut(), left) else {
                // No proof in time (a cut link): give up, as a serving engine
                // would; the lease goes to quarantine with the drain running.
                self.rep.aborted += 1;
                continue;
            };
            if !self.data_in_place(&f.remote, deadline.max(Instant::now() + Duration::from_millis(50))) {
                // Settled by a fence or revocation: the transfer failed.
                lease.release();
                self.rep.failed += 1;
                continue;
            }
            let mut buf = vec![0u8; size];
            let (mut foreign, mut garbage) = (0u64, false);
            for (i, s) in f.remote.slots.iter().enumerate() {
                if lease.read_at(i, 0, &mut buf).is_ok() {
                    let c = verify(&buf, Tag::new(f.id, s.slot.0, s.generation.0));
                    foreign += c.foreign_bytes as u64;
                    garbage |= c.garbage_bytes > 0;
                }
            }
            lease.release();
            latencies.push(f.reserved.elapsed());
            self.rep.requests += 1;
            if foreign > 0 {
                self.rep.foreign_requests += 1;
                self.rep.foreign_bytes += foreign;
            } else if garbage {
                self.rep.garbage_requests += 1;
            }
        }
        // Only rounds clear of faults count toward the p99s: a cut link
        // holds requests for seconds in both phases alike.
        if self.faults.disturbed_since(mark) {
            self.latency_excluded += latencies.len() as u64;
        } else if mark.since_start() < self.latency_from {
            // Start-up: connections, allocators and caches warming.
        } else {
            for d in latencies {
                self.latency[self.phase].record(d);
            }
        }
        let m = self.dpool.metrics();
        self.note(&m);
        // The kept requests' sources come back when their writes end
        // (bounded; a handle not done by then is carried over).
        for mut h in handles {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match poll_until(Pin::new(&mut h), left) {
                Some(Ok(out)) => out.lease.release(),
                Some(Err(_)) => {}
                None => self.pending.push_back(h),
            }
        }
        self.poll_pending();
        Ok(())
    }

    /// Releases the sources of carried-over writes that have ended.
    fn poll_pending(&mut self) {
        for _ in 0..self.pending.len() {
            let Some(mut h) = self.pending.pop_front() else { break };
            match poll_until(Pin::new(&mut h), Duration::ZERO) {
                Some(Ok(out)) => out.lease.release(),
                Some(Err(_)) => {}
                None => self.pending.push_back(h),
            }
        }
        while self.pending.len() > MAX_PENDING {
            self.pending.pop_front();
        }
    }

    fn line(&self, t0: Instant) -> IntervalLine {
        let m = self.dpool.metrics();
        IntervalLine {
            t_s: t0.elapsed().as_secs_f64(),
            requests: self.rep.requests,
            aborted: self.rep.aborted,
            foreign_bytes: self.rep.foreign_bytes,
            quarantined: m.quarantined,
            stuck: m.quarantine_stuck,
            rss_bytes: rss_bytes(),
            heap_bytes: heap_bytes(),
            adversary: None,
        }
    }
}

/// A cluster key from the OS's random source, for this run's honest NICs.
fn random_key() -> Result<ClusterKey, SoakError> {
    use std::io::Read;
    let mut secret = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(setup("the OS's random source"))?;
    ClusterKey::from_secret(&secret).map_err(setup("cluster key"))
}

/// The fault injector: at seeded times cuts the link, shapes it with loss,
/// or asks the driver to kill the prefill; every fault is undone before the
/// next, and all of them before it returns.
fn inject_faults(
    lab: &Lab,
    cfg: &SoakConfig,
    stop: &AtomicBool,
    kill: &AtomicBool,
    faults: &Mutex<Faults>,
    clock: &FaultClock,
) {
    let mut rng = Rng::new(cfg.seed ^ 0xfa17);
    let netem = lab.netem_available();
    if !netem {
        if let Ok(mut f) = faults.lock() {
            f.loss_bursts_unavailable = Some("this kernel has no sch_netem: loss bursts became link flaps".into());
        }
    }
    let mean = cfg.fault_every.as_millis().max(10) as u64;
    let sleep = |ms: u64| {
        // In steps, so that a stop request ends it within 10 ms.
        let until = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < until && !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let count = |f: &dyn Fn(&mut Faults)| {
        if let Ok(mut g) = faults.lock() {
            f(&mut g);
        }
    };
    while !stop.load(Ordering::SeqCst) {
        sleep(mean / 2 + rng.next_u64() % mean.max(1));
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let pick = rng.next_u64() % 100;
        let hold = 200 + rng.next_u64() % 2_300;
        let kinds = cfg.faults;
        let (kill_now, burst_now) = (pick < 30, (30..55).contains(&pick));
        if (kill_now && !kinds.kills) || (burst_now && !kinds.bursts) || (!kill_now && !burst_now && !kinds.flaps) {
            continue;
        }
        if kill_now {
            // The driver kills at its next post point (mid-transfer) and counts it.
            kill.store(true, Ordering::SeqCst);
        } else if burst_now && netem {
            clock.begin(Duration::from_millis(hold), FAULT_GRACE);
            if lab.netem("loss 30% delay 5ms 2ms").is_ok() {
                count(&|f| f.loss_bursts += 1);
                sleep(hold);
                let _ = lab.clear_netem();
            }
            clock.end(FAULT_GRACE);
        } else {
            clock.begin(Duration::from_millis(hold), FAULT_GRACE);
            if lab.cut().is_ok() {
                count(&|f| f.link_flaps += 1);
                sleep(hold);
                let _ = lab.restore();
            }
            clock.end(FAULT_GRACE);
        }
    }
    let _ = lab.restore();
    let _ = lab.clear_netem();
}

/// What `--adversary` sets up before the workload starts (so that the
/// baseline's threads and descriptors include it): the adversary's own
/// addresses on each host's interface, and on each host an honest key
/// holder outside the workload that the relay attack lures.
struct AttackSetup {
    cfg: AdversaryConfig,
    _lured: Vec<SimNic>,
}

impl AttackSetup {
    fn new(lab: &Lab, seed: u64, key: &ClusterKey) -> Result<Self, SoakError> {
        let o = lab.a.addr.octets();
        let mut addresses: [Vec<Ipv4Addr>; 2] = Default::default();
        for (host, h) in [&lab.a, &lab.b].into_iter().enumerate() {
            for i in 0..adversary::ADDRESSES_PER_HOST {
                let ip = Ipv4Addr::new(o[0], o[1], o[2], (100 + 50 * host + i) as u8);
                h.exec(&["ip", "addr", "add", &format!("{ip}/32"), "dev", &h.ifname])
                    .map_err(setup("adversary address"))?;
                addresses[host].push(ip);
            }
        }
        let mut lured = Vec::new();
        let mut lures: [Option<adversary::Lure>; 2] = [None, None];
        for (host, h) in [&lab.a, &lab.b].into_iter().enumerate() {
            let mut c = NicConfig::new(format!("soak-lured-{host}")).with_cluster_key(key.clone());
            c.listen = format!("{}:0", h.addr);
            c.handshake_timeout = Duration::from_secs(2);
            let nic = h.run(move || SimNic::start(c)).map_err(setup("lured host"))?.map_err(setup("lured NIC"))?;
            let victim = nic.clone();
            lures[host] =
                Some(Arc::new(move |addr: &str| victim.connect(addr).map(|_| ()).map_err(|e| format!("{e:?}"))));
            lured.push(nic);
        }
        let guess = ClusterKey::from_secret(format!("kvt soak adversary's guess {seed:016x}").as_bytes())
            .map_err(setup("the adversary's key"))?;
        let limits = backend_tcp_sim::ListenerLimits::default();
        let cfg = AdversaryConfig {
            seed,
            guess,
            addresses,
            handshakes: limits.handshakes,
            per_address: limits.per_address,
            handshake_timeout: NicConfig::new("x").handshake_timeout,
            lures,
            faults: Arc::default(),
        };
        Ok(Self { cfg, _lured: lured })
    }
}

/// Resources at a moment.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    threads: u64,
    fds: u64,
    rss: u64,
    heap: u64,
}

impl Usage {
    fn now() -> Self {
        Self { threads: threads(), fds: open_fds(), rss: rss_bytes(), heap: heap_bytes() }
    }
}

fn kind_lines(c: &BTreeMap<AttackKind, KindCounts>) -> BTreeMap<&'static str, KindCounts> {
    c.iter().map(|(k, v)| (k.name(), *v)).collect()
}

/// Runs the soak; `on_line` gets each interval's line as it is made.
pub fn run_soak(cfg: &SoakConfig, on_line: &mut dyn FnMut(&IntervalLine)) -> Result<SoakReport, SoakError> {
    if cfg.slots < cfg.slots_per_request * cfg.round || cfg.slots_per_request == 0 || cfg.round == 0 {
        return Err(SoakError::Setup("the pool must hold a round: slots >= slots_per_request * round".into()));
    }
    let lab = Arc::new(Lab::new("soak")?);
    let clock = Arc::new(FaultClock::default());
    let mut soak = Soak::start(cfg, lab.clone(), clock.clone())?;
    let attack_setup = match &soak.key {
        Some(key) => {
            let mut a = AttackSetup::new(&lab, cfg.seed, key)?;
            a.cfg.faults = clock.clone();
            Some(a)
        }
        None => None,
    };
    let (stop, kill) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let faults = Arc::new(Mutex::new(Faults::default()));
    let injector = {
        let (lab, cfg, stop, kill, faults, clock) =
            (lab.clone(), cfg.clone(), stop.clone(), kill.clone(), faults.clone(), clock.clone());
        std::thread::spawn(move || inject_faults(&lab, &cfg, &stop, &kill, &faults, &clock))
    };
    let t0 = Instant::now();
    // RSS grows while allocators and queues reach their working size; the
    // slope is taken after that.
    let warmup = (cfg.duration / 4).min(Duration::from_secs(60));
    let (mut rss, mut heap) = (Vec::new(), Vec::new());
    let (mut next_line, mut next_sample) = (t0 + cfg.interval, t0);
    // With --adversary: the baseline is the first third, the attack the rest.
    let switch_at = t0 + cfg.duration / 3;
    let mut baseline: Option<(Instant, Usage, TargetStats)> = None;
    let mut adv: Option<Adversary> = None;
    let mut attack_samples: Vec<(f64, u64, u64)> = Vec::new();
    let (mut threads_peak, mut fds_peak) = (0u64, 0u64);
    let spawn_in = |host: usize, f: adversary::Task| -> Option<std::thread::JoinHandle<()>> {
        let h = if host == 0 { &lab.a } else { &lab.b };
        h.run(move || std::thread::Builder::new().name("kvt-adversary".into()).spawn(f).ok()).ok().flatten()
    };
    let result = (|| -> Result<(), SoakError> {
        while t0.elapsed() < cfg.duration {
            soak.round(&kill)?;
            let now = Instant::now();
            if let (Some(a), None) = (&attack_setup, &baseline) {
                if now >= switch_at {
                    baseline = Some((now, Usage::now(), soak.target_stats()));
                    soak.phase = 1;
                    soak.publish_targets();
                    adv = Some(Adversary::start(a.cfg.clone(), soak.targets.clone(), &spawn_in));
                }
            }
            if now >= next_sample {
                if now - t0 >= warmup {
                    let t = (now - t0).as_secs_f64();
                    rss.push((t, rss_bytes()));
                    heap.push((t, heap_bytes()));
                }
                if adv.is_some() {
                    let u = Usage::now();
                    attack_samples.push(((now - t0).as_secs_f64(), u.rss, u.heap));
                    threads_peak = threads_peak.max(u.threads);
                    fds_peak = fds_peak.max(u.fds);
                }
                next_sample = now + Duration::from_secs(1);
            }
            if now >= next_line {
                let mut l = soak.line(t0);
                if attack_setup.is_some() {
                    l.adversary = Some(AdversaryLine {
                        phase: if soak.phase == 0 { "baseline" } else { "attack" },
                        p99_ms: soak.latency[soak.phase].quantile_ms(0.99),
                        threads: threads(),
                        fds: open_fds(),
                        kinds: adv.as_ref().map(|a| kind_lines(&a.counts())).unwrap_or_default(),
                    });
                }
                on_line(&l);
                soak.rep.intervals.push(l);
                next_line += cfg.interval;
            }
        }
        Ok(())
    })();
    let attack_end = Instant::now();
    let counts = adv.take().map(Adversary::stop);
    stop.store(true, Ordering::SeqCst);
    let _ = injector.join();
    result?;
    // The positive control, now that the link is back: the attack code with
    // the real key, from the adversary's host, against every target.
    let mut control = ControlCounts::default();
    if let (Some(a), Some(key)) = (&attack_setup, &soak.key) {
        let targets = soak.targets.lock().map(|t| t.clone()).unwrap_or_default();
        for t in targets {
            let (acfg, key, host) = (a.cfg.clone(), key.clone(), 1 - t.host);
            let h = if host == 0 { &lab.a } else { &lab.b };
            if let Ok(c) = h.run(move || adversary::positive_control(&acfg, host, &t, &key)) {
                control.attempted += c.attempted;
                control.established += c.established;
                control.registered += c.registered;
            }
        }
    }
    // The faults have stopped and the link is back: give the drain and its
    // ladder time to prove every quarantined slot (bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let m = soak.dpool.metrics();
        if m.quarantined == 0 {
            break;
        }
        for i in 0..PREFILLS {
            if !soak.decode.is_connected(soak.prefills[i].peer) {
                soak.reconnect(i);
            }
        }
        soak.poll_pending();
        std::thread::sleep(Duration::from_millis(20));
    }
    // With --adversary: the targets' handshake threads end by their
    // deadline (5 s) once the adversary is gone; wait for that (bounded)
    // before comparing with the baseline.
    let mut end_usage = Usage::now();
    if let Some((_, base, _)) = &baseline {
        let settle = Instant::now() + NicConfig::new("x").handshake_timeout + Duration::from_secs(2);
        while Instant::now() < settle
            && (end_usage.threads > base.threads + THREADS_BOUND || end_usage.fds > base.fds + FDS_BOUND)
        {
            std::thread::sleep(Duration::from_millis(50));
            end_usage = Usage::now();
        }
    }
    let final_line = soak.line(t0);
    let m = soak.dpool.metrics();
    let mut rep = std::mem::take(&mut soak.rep);
    let fault_counts = faults.lock().map(|f| f.clone()).unwrap_or_default();
    rep.faults = Faults { peer_kills: rep.faults.peer_kills, ..fault_counts };
    rep.quarantined = m.quarantined;
    rep.stuck = m.quarantine_stuck;
    rep.final_free = m.free;
    rep.settled_completed = m.settled_completed;
    rep.settled_revoked = m.settled_revoked;
    rep.settled_fenced = m.settled_fenced;
    rep.rss_bytes = rss_bytes();
    rep.rss_slope_bytes_per_min = slope_per_min(&rss);
    rep.heap_bytes = heap_bytes();
    rep.heap_slope_bytes_per_min = slope_per_min(&heap);
    rep.elapsed_s = t0.elapsed().as_secs_f64();
    if attack_setup.is_some() {
        rep.adversary = Some(adversary_report(
            &soak,
            baseline,
            t0,
            attack_end,
            counts.unwrap_or_default(),
            &attack_samples,
            (threads_peak, fds_peak),
            end_usage,
            control,
        ));
    }
    on_line(&final_line);
    rep.intervals.push(final_line);
    Ok(rep)
}

/// The adversary's findings and the bounds checked.
#[allow(clippy::too_many_arguments)]
fn adversary_report(
    soak: &Soak<'_>,
    baseline: Option<(Instant, Usage, TargetStats)>,
    t0: Instant,
    attack_end: Instant,
    counts: BTreeMap<AttackKind, KindCounts>,
    attack_samples: &[(f64, u64, u64)],
    (threads_peak, fds_peak): (u64, u64),
    end: Usage,
    control: ControlCounts,
) -> AdversaryReport {
    let mut failures = Vec::new();
    let Some((switched, base, stats0)) = baseline else {
        return AdversaryReport {
            failures: vec!["the attack phase never started (--duration too short)".into()],
            ..AdversaryReport::default()
        };
    };
    let target_stats = soak.target_stats().zip(stats0, u64::saturating_sub);
    let (lb, la) = (&soak.latency[0], &soak.latency[1]);
    let (b99, a99) = (lb.quantile_ms(0.99), la.quantile_ms(0.99));
    let p99_bound_ms = (P99_FACTOR * b99).max(b99 + P99_FLOOR_MS);
    for (phase, h) in [("baseline", lb), ("attack", la)] {
        if h.count() < MIN_LATENCY_SAMPLES {
            failures.push(format!(
                "{phase}: {} honest requests clear of faults, fewer than {MIN_LATENCY_SAMPLES}",
                h.count()
            ));
        }
    }
    if a99 > p99_bound_ms {
        failures
            .push(format!("honest p99 under attack {a99:.2} ms > bound {p99_bound_ms:.2} ms (baseline {b99:.2} ms)"));
    }
    let mut kinds = BTreeMap::new();
    for (k, c) in &counts {
        let delta = target_stats.get(k.refused_as());
        let n = k.name();
        if c.attempted == 0 {
            failures.push(format!("{n}: never attempted"));
        } else if c.refused == 0 {
            failures.push(format!("{n}: {} attempted, none refused ({} lost to faults)", c.attempted, c.lost));
        }
        if c.established > 0 {
            failures.push(format!("{n}: {} sessions without the key", c.established));
        }
        if c.unrefused > 0 {
            failures.push(format!("{n}: {} attacks not refused as the target must", c.unrefused));
        }
        if c.refused > 0 && delta == 0 {
            failures.push(format!("{n}: refused, but the targets' {} did not grow", k.refused_as()));
        }
        kinds.insert(n, KindReport { counts: *c, refused_as: k.refused_as(), refused_as_delta: delta });
    }
    let total = adversary::total(&counts);
    // RSS and heap over the attack's second half.
    let half = (switched - t0).as_secs_f64() + (attack_end - switched).as_secs_f64() / 2.0;
    let late: Vec<&(f64, u64, u64)> = attack_samples.iter().filter(|s| s.0 >= half).collect();
    let attack_rss_slope = slope_per_min(&late.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>());
    let attack_heap_slope = slope_per_min(&late.iter().map(|s| (s.0, s.2)).collect::<Vec<_>>());
    if end.threads > base.threads + THREADS_BOUND {
        failures
            .push(format!("threads {} at the end > {} at the baseline + {THREADS_BOUND}", end.threads, base.threads));
    }
    if end.fds > base.fds + FDS_BOUND {
        failures.push(format!("open fds {} at the end > {} at the baseline + {FDS_BOUND}", end.fds, base.fds));
    }
    if end.rss > base.rss + RSS_BOUND {
        failures.push(format!("RSS {} at the end > {} at the baseline + {RSS_BOUND}", end.rss, base.rss));
    }
    if end.heap > base.heap + HEAP_BOUND {
        failures.push(format!("heap {} at the end > {} at the baseline + {HEAP_BOUND}", end.heap, base.heap));
    }
    if late.len() >= HEAP_SLOPE_MIN_SAMPLES && attack_heap_slope > HEAP_SLOPE_BOUND {
        failures.push(format!(
            "heap slope {attack_heap_slope:.0} B/min over the attack's second half > {HEAP_SLOPE_BOUND:.0}"
        ));
    }
    if control.attempted == 0 || control.established < control.attempted || control.registered < control.attempted {
        failures.push(format!(
            "positive control: with the real key, {} of {} sessions established, {} registered: the attack code \
             proves nothing",
            control.established, control.attempted, control.registered
        ));
    }
    let mut names: Vec<String> = soak.decode.peers().into_iter().map(|p| p.name).collect();
    for p in &soak.prefills {
        names.extend(p.nic.peers().into_iter().map(|p| p.name));
    }
    let ghost_peers = names.iter().filter(|n| n.starts_with(adversary::GHOST)).count() as u64;
    if ghost_peers > 0 {
        failures.push(format!("{ghost_peers} peers under names the adversary made up"));
    }
    AdversaryReport {
        baseline_s: (switched - t0).as_secs_f64(),
        attack_s: (attack_end - switched).as_secs_f64(),
        baseline_samples: lb.count(),
        attack_samples: la.count(),
        latency_excluded: soak.latency_excluded,
        baseline_p50_ms: lb.quantile_ms(0.5),
        baseline_p99_ms: b99,
        attack_p50_ms: la.quantile_ms(0.5),
        attack_p99_ms: a99,
        p99_bound_ms,
        threads_baseline: base.threads,
        threads_end: end.threads,
        threads_peak,
        fds_baseline: base.fds,
        fds_end: end.fds,
        fds_peak,
        rss_baseline_bytes: base.rss,
        rss_end_bytes: end.rss,
        heap_baseline_bytes: base.heap,
        heap_end_bytes: end.heap,
        attack_rss_slope_bytes_per_min: attack_rss_slope,
        attack_heap_slope_bytes_per_min: attack_heap_slope,
        threads_bound: THREADS_BOUND,
        fds_bound: FDS_BOUND,
        rss_bound_bytes: RSS_BOUND,
        heap_bound_bytes: HEAP_BOUND,
        heap_slope_bound_bytes_per_min: HEAP_SLOPE_BOUND,
        targets: soak.targets.lock().map_or(0, |t| t.len() as u64),
        kinds,
        total,
        target_stats,
        ghost_peers,
        control,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_flat_series_is_zero_and_of_a_ramp_its_rate() {
        let flat: Vec<(f64, u64)> = (0..10).map(|i| (i as f64, 1_000)).collect();
        assert_eq!(slope_per_min(&flat), 0.0);
        // 100 bytes per second = 6,000 per minute.
        let ramp: Vec<(f64, u64)> = (0..10).map(|i| (i as f64, 1_000 + 100 * i)).collect();
        assert!((slope_per_min(&ramp) - 6_000.0).abs() < 1e-6);
        assert_eq!(slope_per_min(&[(1.0, 5)]), 0.0);
    }

    #[test]
    fn histogram_quantiles_are_within_a_bucket_and_never_under() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile_ms(0.99), 0.0);
        for us in 1..=10_000u64 {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 10_000);
        let p99 = h.quantile_ms(0.99);
        assert!((9.9..=9.9 * 17.0 / 16.0 + 0.01).contains(&p99), "{p99}");
        let p50 = h.quantile_ms(0.5);
        assert!((5.0..=5.0 * 17.0 / 16.0 + 0.01).contains(&p50), "{p50}");
        for us in [0u64, 1, 15, 16, 17, 31, 32, 1_000, 123_456_789] {
            let b = Histogram::bucket(us);
            assert!(Histogram::low(b) <= us && us < Histogram::low(b + 1), "{us}: bucket {b}");
        }
    }

    #[test]
    fn threads_and_fds_of_this_process_are_read() {
        assert!(threads() >= 1);
        assert!(open_fds() >= 3);
    }

    #[test]
    fn rss_and_heap_of_this_process_are_read() {
        assert!(rss_bytes() > 0);
        let held: Vec<u8> = vec![1; 4 << 20];
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(heap_bytes() >= held.len() as u64);
        }
        drop(held);
    }
}
