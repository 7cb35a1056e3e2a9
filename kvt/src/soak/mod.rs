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

pub mod adversary_report;

use crate::adversary::{self, Adversary, ControlCounts, FaultClock, Target};
use adversary_report::{adversary_report, kind_lines, AttackSetup, Usage};
pub use adversary_report::{
    open_fds, threads, AdversaryLine, AdversaryReport, Histogram, TargetStats, FDS_BOUND, THREADS_BOUND,
};
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
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
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

/// How long a fault's effects (fences, reconnects, drains) are taken to
/// last after it ends: honest requests of rounds that overlap a fault or
/// this grace are left out of the p99s (counted in `latency_excluded`).
const FAULT_GRACE: Duration = Duration::from_secs(2);

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
    fn rss_and_heap_of_this_process_are_read() {
        assert!(rss_bytes() > 0);
        let held: Vec<u8> = vec![1; 4 << 20];
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(heap_bytes() >= held.len() as u64);
        }
        drop(held);
    }
}
