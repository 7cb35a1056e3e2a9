//! `kvt soak --adversary`: the attack phase's report and what it is
//! measured with. The adversary's part of an interval line
//! ([`AdversaryLine`]); the bounds the attack phase is held to against the
//! no-attack baseline (honest p99, threads, open descriptors, RSS, heap);
//! the targets' refusal counters ([`TargetStats`]); the findings
//! ([`AdversaryReport`], made by [`adversary_report`] from the soak's
//! state); and the measurements behind them: threads and descriptors of
//! this process, a fixed-memory latency [`Histogram`], resources at a
//! moment ([`Usage`]), and what the attack sets up on the two hosts
//! ([`AttackSetup`]). The workload is the parent module's, the attacks are
//! [`crate::adversary`]'s.

use super::{heap_bytes, rss_bytes, setup, slope_per_min, Soak, SoakError};
use crate::adversary::{self, AdversaryConfig, AttackKind, ControlCounts, KindCounts};
use backend_tcp_sim::{NicConfig, SimNic};
use kv_transfer_core::auth::ClusterKey;
use netns_lab::Lab;
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// `stats().handshakes_evicted`.
    pub handshakes_evicted: u64,
    /// `stats().handshakes_refused_per_address`.
    pub handshakes_refused_per_address: u64,
    /// `stats().connections_refused_per_address`.
    pub connections_refused_per_address: u64,
}

impl TargetStats {
    pub(super) fn of(nic: &SimNic) -> Self {
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
            handshakes_evicted: s.handshakes_evicted,
            handshakes_refused_per_address: s.handshakes_refused_per_address,
            connections_refused_per_address: s.connections_refused_per_address,
        }
    }

    pub(super) fn zip(self, o: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        Self {
            auth_established: f(self.auth_established, o.auth_established),
            auth_wrong_key: f(self.auth_wrong_key, o.auth_wrong_key),
            auth_replayed: f(self.auth_replayed, o.auth_replayed),
            auth_address_mismatch: f(self.auth_address_mismatch, o.auth_address_mismatch),
            auth_refused_by_peer: f(self.auth_refused_by_peer, o.auth_refused_by_peer),
            auth_malformed: f(self.auth_malformed, o.auth_malformed),
            auth_io: f(self.auth_io, o.auth_io),
            handshakes_refused_busy: f(self.handshakes_refused_busy, o.handshakes_refused_busy),
            handshakes_evicted: f(self.handshakes_evicted, o.handshakes_evicted),
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
            "handshakes_evicted" => self.handshakes_evicted,
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

/// What `--adversary` sets up before the workload starts (so that the
/// baseline's threads and descriptors include it): the adversary's own
/// addresses on each host's interface, and on each host an honest key
/// holder outside the workload that the relay attack lures.
pub(super) struct AttackSetup {
    pub(super) cfg: AdversaryConfig,
    _lured: Vec<SimNic>,
}

impl AttackSetup {
    pub(super) fn new(lab: &Lab, seed: u64, key: &ClusterKey) -> Result<Self, SoakError> {
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
pub(super) struct Usage {
    pub(super) threads: u64,
    pub(super) fds: u64,
    pub(super) rss: u64,
    pub(super) heap: u64,
}

impl Usage {
    pub(super) fn now() -> Self {
        Self { threads: threads(), fds: open_fds(), rss: rss_bytes(), heap: heap_bytes() }
    }
}

pub(super) fn kind_lines(c: &BTreeMap<AttackKind, KindCounts>) -> BTreeMap<&'static str, KindCounts> {
    c.iter().map(|(k, v)| (k.name(), *v)).collect()
}

/// The adversary's findings and the bounds checked.
#[allow(clippy::too_many_arguments)]
pub(super) fn adversary_report(
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
}
