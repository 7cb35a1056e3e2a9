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

use std::sync::Arc;

use backend_tcp_sim::bench::{measure, per_thread};
pub use backend_tcp_sim::bench::{BenchConfig, BenchError, BenchResult};
use kv_transfer_core::{Op, Transfer};

use crate::harness::{sim_pair, PairConfig};

/// Runs the WRITE loop through the MORI adapter and reports throughput and
/// per-batch latency (same configuration and result types as the simulator's bench).
pub fn run_write_bench(cfg: &BenchConfig) -> Result<BenchResult, BenchError> {
    let slots = cfg.slots()?;
    let mut pc = PairConfig::new(slots, cfg.block_size);
    pc.keys = ("bench-initiator".to_owned(), "bench-target".to_owned());
    // The same NIC settings as the simulator's bench.
    pc.transport.nic.socket_buffer = cfg.socket_buffer;
    let pair = sim_pair(&pc).map_err(BenchError::other)?;
    let (init, target) = (pair.prefill.clone(), pair.decode.clone());
    let lease = target.pool.reserve(slots).map_err(BenchError::other)?;
    let (exposed, remote) =
        target.transfer.expose(lease, pair.prefill_at_decode).map_err(|e| BenchError::other(e.kind))?;

    let transfer: Arc<dyn Transfer> = Arc::new(init.transfer.clone());
    let result = measure(&transfer, &init.pool, Op::Write, per_thread(&remote, cfg.threads, cfg.batch), cfg);
    // The exposure is aborted: the ladder asks the initiator to drain (it
    // has nothing in flight) and its ABORT_ACK settles it.
    drop(exposed);
    result
}
