//! The WRITE throughput loop through the MORI adapter over [`SimTransport`],
//! shaped like `backend_tcp_sim::bench` so the figures sit side by side.
//!
//! Two engines in this process on loopback: an initiator with a pool of
//! `threads × batch` source slots and a target with as many destination
//! slots, exposed once per thread. Each thread posts `batch` single-slot
//! WRITEs through [`Transfer`] (without asking the target to settle, as the
//! simulator's bench does), waits for all of them, and repeats until the
//! duration is spent.
//!
//! ```
//! use backend_mori::bench::run_write_bench;
//! use backend_tcp_sim::bench::BenchConfig;
//! use std::time::Duration;
//! let r = run_write_bench(&BenchConfig {
//!     block_size: 64 << 10,
//!     batch: 4,
//!     threads: 1,
//!     duration: Duration::from_millis(50),
//!     warmup: Duration::ZERO,
//!     ..BenchConfig::default()
//! })
//! .unwrap();
//! assert!(r.bytes > 0 && r.gb_per_s > 0.0);
//! ```
//!
//! [`SimTransport`]: crate::sim::SimTransport

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

pub use backend_tcp_sim::bench::{BenchConfig, BenchError, BenchResult};
use backend_tcp_sim::block_on;
use kv_transfer_core::{RemoteSlots, Transfer, TransferOptions};

use crate::harness::{sim_pair, PairConfig};

fn other(e: impl std::fmt::Display) -> BenchError {
    BenchError::Other(e.to_string())
}

/// Runs the WRITE loop through the MORI adapter and reports throughput and
/// per-batch latency (same configuration and result types as the simulator's bench).
pub fn run_write_bench(cfg: &BenchConfig) -> Result<BenchResult, BenchError> {
    if cfg.block_size == 0 || cfg.batch == 0 || cfg.threads == 0 {
        return Err(other("block_size, batch and threads must be non-zero"));
    }
    let slots = cfg.threads * cfg.batch;
    let mut pc = PairConfig::new(slots, cfg.block_size);
    pc.keys = ("bench-initiator".to_owned(), "bench-target".to_owned());
    // The same NIC settings as the simulator's bench.
    pc.transport.nic.socket_buffer = cfg.socket_buffer;
    let pair = sim_pair(&pc).map_err(other)?;
    let (init, target) = (pair.prefill.clone(), pair.decode.clone());

    let mut exposures = Vec::new();
    let mut per_thread: Vec<Vec<RemoteSlots>> = Vec::new();
    for _ in 0..cfg.threads {
        let lease = target.pool.reserve(cfg.batch).map_err(other)?;
        let (exposed, remote) = target.transfer.expose(lease, pair.prefill_at_decode).map_err(|e| other(e.kind))?;
        let singles = remote.slots.iter().map(|s| RemoteSlots { slots: vec![*s], ..remote.clone() }).collect();
        per_thread.push(singles);
        exposures.push(exposed);
    }

    let barrier = Arc::new(Barrier::new(cfg.threads + 1));
    let mut joins = Vec::new();
    for remotes in per_thread {
        let transfer = init.transfer.clone();
        let ipool = init.pool.clone();
        let barrier = barrier.clone();
        let cfg = cfg.clone();
        joins.push(std::thread::spawn(move || -> Result<(u64, Vec<u64>, Duration), BenchError> {
            let mut leases = Vec::with_capacity(cfg.batch);
            for i in 0..cfg.batch {
                let mut l = ipool.reserve(1).map_err(other)?;
                l.write_at(0, 0, &vec![(i % 251) as u8; cfg.block_size]).map_err(other)?;
                leases.push(l);
            }
            barrier.wait();
            let t0 = Instant::now();
            let measure_from = t0 + cfg.warmup;
            let end = measure_from + cfg.duration;
            let (mut bytes, mut lat, mut last_end) = (0u64, Vec::new(), measure_from);
            loop {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                let b0 = Instant::now();
                let mut handles = Vec::with_capacity(cfg.batch);
                for (l, r) in leases.drain(..).zip(&remotes) {
                    let h =
                        block_on(transfer.write(l, r, TransferOptions::notify(false))).map_err(|e| other(e.kind))?;
                    handles.push(h);
                }
                for h in handles {
                    let out = block_on(h).map_err(other)?;
                    out.result.map_err(other)?;
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
    let mut total = 0u64;
    let mut lat = Vec::new();
    let mut first_err = None;
    let mut elapsed = Duration::ZERO;
    for j in joins {
        match j.join() {
            Ok(Ok((b, l, e))) => {
                total += b;
                elapsed = elapsed.max(e);
                lat.extend(l);
            }
            Ok(Err(e)) => first_err = Some(e),
            Err(_) => first_err = Some(other("bench thread panicked")),
        }
    }
    // The exposures are aborted: the ladder asks the initiator to drain (it
    // has nothing in flight) and its ABORT_ACK settles them.
    drop(exposures);
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(BenchResult {
        config: cfg.clone(),
        bytes: total,
        elapsed,
        gb_per_s: if elapsed.is_zero() { 0.0 } else { total as f64 / elapsed.as_secs_f64() / 1e9 },
        batch_latency_us: lat,
    })
}
