//! The measured loop every backend's bench shares ([`measure`]).
//!
//! [`measure`] needs only an `Arc<dyn Transfer>`, a local pool and remote
//! single-slot descriptors: each thread posts `batch` single-slot operations
//! through the [`Transfer`] trait, waits (bounded) for all of them, and
//! repeats until the duration is spent. Every backend of `kvt bench` runs
//! it, so their figures are comparable in one run. It lived in
//! `backend-tcp-sim` before: a measuring loop is no part of a backend.

use kv_transfer_core::{block_on, poll_until, Op, RemoteSlots, SlotPool, Transfer, TransferOptions};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Bytes per WRITE (one slot).
    pub block_size: usize,
    /// WRITEs posted before waiting for them all.
    pub batch: usize,
    /// Posting threads.
    pub threads: usize,
    /// Measured time.
    pub duration: Duration,
    /// Unmeasured time before it.
    pub warmup: Duration,
}

/// What was measured.
#[derive(Clone, Debug)]
pub struct BenchResult {
    /// Bytes moved in the measured time.
    pub bytes: u64,
    /// Measured time.
    pub elapsed: Duration,
    /// Latency of each measured batch (post of the first operation to the last completion), µs.
    pub batch_latency_us: Vec<u64>,
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Bad configuration, or a failure while running.
    #[error("{0}")]
    Other(String),
}

impl BenchError {
    /// An [`Other`](Self::Other) error from anything printable.
    pub fn other(e: impl std::fmt::Display) -> Self {
        Self::Other(e.to_string())
    }
}

/// Bound on one operation's terminal status inside [`measure`].
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// The median of `v` (the mean of the middle two for an even count; 0 for
/// none): what the benches report over rounds.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Splits a descriptor into single-slot descriptors, `batch` per thread.
pub fn per_thread(remote: &RemoteSlots, threads: usize, batch: usize) -> Vec<Vec<RemoteSlots>> {
    let singles: Vec<RemoteSlots> =
        remote.slots.iter().map(|s| RemoteSlots { slots: vec![*s], ..remote.clone() }).collect();
    singles.chunks(batch.max(1)).take(threads).map(<[RemoteSlots]>::to_vec).collect()
}

/// The measured loop: one thread per entry of `remotes`, each posting
/// `cfg.batch` single-slot `op`s (from its own leases of `pool`) against its
/// descriptors, waiting for all of them (each at most [`OP_TIMEOUT`]), and
/// repeating until `cfg.warmup + cfg.duration` is spent. Posts without
/// notifications: the caller settles the target's exposures afterwards.
pub fn measure(
    transfer: &Arc<dyn Transfer>,
    pool: &SlotPool,
    op: Op,
    remotes: Vec<Vec<RemoteSlots>>,
    cfg: &BenchConfig,
) -> Result<BenchResult, BenchError> {
    if remotes.is_empty() || remotes.iter().any(|r| r.len() != cfg.batch) {
        return Err(BenchError::other(format!("every thread needs {} single-slot descriptors", cfg.batch)));
    }
    if remotes.iter().flatten().any(|r| r.slot_size != cfg.block_size as u64) {
        return Err(BenchError::other(format!("the target's slots are not {} B", cfg.block_size)));
    }
    let barrier = Arc::new(Barrier::new(remotes.len() + 1));
    let mut joins = Vec::new();
    for remotes in remotes {
        let (transfer, pool, barrier, cfg) = (transfer.clone(), pool.clone(), barrier.clone(), cfg.clone());
        joins.push(std::thread::spawn(move || -> Result<(u64, Vec<u64>, Duration), BenchError> {
            let mut leases = Vec::with_capacity(cfg.batch);
            for i in 0..cfg.batch {
                let mut l = pool.reserve(1).map_err(BenchError::other)?;
                l.write_at(0, 0, &vec![(i % 251) as u8; cfg.block_size]).map_err(BenchError::other)?;
                leases.push(l);
            }
            barrier.wait();
            let measure_from = Instant::now() + cfg.warmup;
            let end = measure_from + cfg.duration;
            let (mut bytes, mut lat, mut last_end) = (0u64, Vec::new(), measure_from);
            while Instant::now() < end {
                let b0 = Instant::now();
                let mut handles = Vec::with_capacity(cfg.batch);
                for (l, r) in leases.drain(..).zip(&remotes) {
                    // `write` / `read`, what an application calls (a backend
                    // that posts without waiting boxes no future for them).
                    let post = match op {
                        Op::Write => transfer.write(l, r, TransferOptions::notify(false)),
                        Op::Read => transfer.read(l, r, TransferOptions::notify(false)),
                    };
                    let h = block_on(post).map_err(|e| BenchError::other(format!("post failed: {}", e.kind)))?;
                    handles.push(h);
                }
                for mut h in handles {
                    let out = poll_until(std::pin::Pin::new(&mut h), OP_TIMEOUT)
                        .ok_or_else(|| {
                            BenchError::other(format!("an operation did not complete within {OP_TIMEOUT:?}"))
                        })?
                        .map_err(BenchError::other)?;
                    out.result.map_err(BenchError::other)?;
                    leases.push(out.lease.into_reserved());
                }
                if b0 >= measure_from {
                    bytes += (cfg.batch * cfg.block_size) as u64;
                    lat.push(b0.elapsed().as_micros() as u64);
                    last_end = Instant::now();
                }
            }
            Ok((bytes, lat, last_end.saturating_duration_since(measure_from)))
        }));
    }
    barrier.wait();
    let (mut total, mut lat, mut elapsed, mut first_err) = (0u64, Vec::new(), Duration::ZERO, None);
    for j in joins {
        match j.join() {
            Ok(Ok((b, l, e))) => {
                total += b;
                elapsed = elapsed.max(e);
                lat.extend(l);
            }
            Ok(Err(e)) => first_err = Some(e),
            Err(_) => first_err = Some(BenchError::other("bench thread panicked")),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(BenchResult { bytes: total, elapsed, batch_latency_us: lat })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_no_rounds() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
