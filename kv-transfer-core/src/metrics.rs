//! Counters a pool keeps, and their snapshot.
//!
//! The counters live inside the pool's state (updated under the lock the
//! transition already holds, so they cost no extra atomics). With the
//! `metrics` feature every change is also reported through the `metrics`
//! facade, so an engine can export to Prometheus.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Latency histogram with power-of-two microsecond buckets: bucket `i` holds
/// samples in `[2^(i-1), 2^i)` µs (bucket 0 holds < 1 µs). 40 buckets reach
/// beyond 6 days, more than any quarantine should last.
#[derive(Clone, Debug)]
pub(crate) struct Histogram {
    buckets: [u64; 40],
    count: u64,
    max_us: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self { buckets: [0; 40], count: 0, max_us: 0 }
    }
}

impl Histogram {
    pub(crate) fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let idx = (64 - us.leading_zeros()) as usize;
        self.buckets[idx.min(self.buckets.len() - 1)] += 1;
        self.count += 1;
        self.max_us = self.max_us.max(us);
    }

    /// Upper bound of the bucket holding quantile `q`, capped at the maximum seen.
    fn quantile_us(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((self.count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let upper = if i == 0 { 1 } else { 1u64 << i };
                return upper.min(self.max_us.max(1));
            }
        }
        self.max_us
    }

    pub(crate) fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            p50_us: self.quantile_us(0.50),
            p99_us: self.quantile_us(0.99),
            max_us: self.max_us,
        }
    }
}

/// Quantiles of a latency histogram, in microseconds (bucketed: each value is
/// the upper bound of its power-of-two bucket, capped at the maximum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Samples recorded.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest sample.
    pub max_us: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) leases: u64,
    pub(crate) admission_rejected: u64,
    pub(crate) exposures: u64,
    pub(crate) settled_completed: u64,
    pub(crate) settled_revoked: u64,
    pub(crate) settled_fenced: u64,
    pub(crate) quarantined_total: u64,
    pub(crate) stale_rejected: u64,
    pub(crate) forged_rejected: u64,
    pub(crate) integrity_failures: u64,
    pub(crate) released: u64,
    pub(crate) abort_to_reclaim: Histogram,
}

/// A point-in-time view of a pool.
///
/// Invariant: `free + leased + quarantined == capacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// Slots in the pool.
    pub capacity: u64,
    /// Slots on the free list.
    pub free: u64,
    /// Slots held by live leases (reserved, exposed or settled).
    pub leased: u64,
    /// Slots waiting in quarantine for a settlement proof (a gauge).
    pub quarantined: u64,
    /// Quarantined slots whose escalation ladder is exhausted: they stay out
    /// of the pool until a proof arrives, and an operator should look.
    pub quarantine_stuck: u64,
    /// Leases granted by `reserve`.
    pub leases: u64,
    /// `reserve` calls refused by admission.
    pub admission_rejected: u64,
    /// Exposures (local posts and hand-outs to peers).
    pub exposures: u64,
    /// Slots settled by a `Completed` proof.
    pub settled_completed: u64,
    /// Slots settled by a `Revoked` proof.
    pub settled_revoked: u64,
    /// Slots settled by a `Fenced` proof.
    pub settled_fenced: u64,
    /// Slots that ever entered quarantine.
    pub quarantined_total: u64,
    /// Stale proofs, notifications or acks (old generation) dropped.
    pub stale_rejected: u64,
    /// DONE / ABORT_ACK tenancies dropped because the sender was not the
    /// peer they were exposed to or the exposure's token did not match.
    pub forged_rejected: u64,
    /// Reads of a settled lease refused because its bytes did not match the
    /// digest its DONE carried (a write landed after the DONE).
    pub integrity_failures: u64,
    /// Slots returned to the free list.
    pub released: u64,
    /// Time from abort (or drop) of an exposed lease to the return of its
    /// last slot to the free list.
    pub abort_to_reclaim: LatencySummary,
}

#[cfg(feature = "metrics")]
pub(crate) mod facade {
    //! Reports to the `metrics` facade, labelled by pool.
    use crate::PoolId;

    pub(crate) fn counter(name: &'static str, pool: PoolId, n: u64) {
        metrics::counter!(name, "pool" => pool.0.to_string()).increment(n);
    }
    pub(crate) fn gauge(name: &'static str, pool: PoolId, v: u64) {
        metrics::gauge!(name, "pool" => pool.0.to_string()).set(v as f64);
    }
    pub(crate) fn latency(name: &'static str, pool: PoolId, d: std::time::Duration) {
        metrics::histogram!(name, "pool" => pool.0.to_string()).record(d.as_secs_f64());
    }
}

/// Reports a counter increment through the facade when the feature is on.
macro_rules! report_counter {
    ($name:literal, $pool:expr, $n:expr) => {{
        #[cfg(feature = "metrics")]
        $crate::metrics::facade::counter($name, $pool, $n as u64);
        #[cfg(not(feature = "metrics"))]
        let _ = (&$pool, &$n);
    }};
}
pub(crate) use report_counter;
