//! WRITE throughput of the MORI adapter over the TCP simulator next to the
//! bare simulator, same sizes, same process:
//! `cargo run --release --example mori_bench -p backend-mori [secs] [rounds]`.
//!
//! `MORI_BENCH_ONLY=bare|mori` runs one side, `MORI_BENCH_BLOCKS=65536,...`
//! picks block sizes (for profiling), `MORI_BENCH_THREADS` and
//! `MORI_BENCH_BATCH` change the 4 threads × 32 writes.
//!
//! Each round runs the bare bench and the MORI bench back to back (the order
//! alternates between rounds); the figures are medians over the rounds, and
//! the ratio is the median of the per-round ratios (each round compares two
//! runs seconds apart, so slow drift on a shared machine cancels out).
use backend_tcp_sim::bench::{median, run_write_bench as bare_bench, BenchConfig, BenchResult};
use std::time::Duration;

/// CPU seconds (user + system) this process used so far, from `/proc/self/stat`
/// (0 where it cannot be read).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // Fields after the command name (which ends with the last ')').
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

fn line(name: &str, r: &BenchResult, cpu_per_gb: f64) {
    println!(
        "  {name:<5} block {:>5} KiB  batch {}  threads {}  {:.3} GB/s  {cpu_per_gb:.3} CPU-s/GB  batch p50 {} us  p99 {} us  ({} batches)",
        r.config.block_size >> 10,
        r.config.batch,
        r.config.threads,
        r.gb_per_s,
        r.latency_quantile_us(0.5),
        r.latency_quantile_us(0.99),
        r.batch_latency_us.len()
    );
}

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let rounds: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(2).max(1);
    // MORI_BENCH_ONLY=bare|mori runs one side (for profiling).
    let only = std::env::var("MORI_BENCH_ONLY").unwrap_or_default();
    let blocks: Vec<usize> = std::env::var("MORI_BENCH_BLOCKS")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.parse().ok()).collect())
        .unwrap_or_else(|| vec![64 << 10, 1 << 20]);
    for block in blocks {
        let knob = |name: &str, default: usize| {
            std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(default)
        };
        let cfg = BenchConfig {
            block_size: block,
            batch: knob("MORI_BENCH_BATCH", 32),
            threads: knob("MORI_BENCH_THREADS", 4),
            duration: Duration::from_secs_f64(secs),
            warmup: Duration::from_millis(300),
            ..BenchConfig::default()
        };
        let (mut bare, mut mori) = (Vec::new(), Vec::new());
        let (mut bare_cpu, mut mori_cpu) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let order: [bool; 2] = if round % 2 == 0 { [false, true] } else { [true, false] };
            for is_mori in order {
                if (only == "mori" && !is_mori) || (only == "bare" && is_mori) {
                    continue;
                }
                let c0 = cpu_seconds();
                let r = if is_mori { backend_mori::bench::run_write_bench(&cfg) } else { bare_bench(&cfg) };
                // Whole run (set-up and warm-up included) over the measured bytes:
                // a relative figure, steadier than GB/s on a shared machine.
                let cpu = cpu_seconds() - c0;
                match r {
                    Ok(r) => {
                        let cpu_per_gb = if r.bytes > 0 { cpu / (r.bytes as f64 / 1e9) } else { 0.0 };
                        line(if is_mori { "mori" } else { "bare" }, &r, cpu_per_gb);
                        if is_mori {
                            mori.push(r.gb_per_s);
                            mori_cpu.push(cpu_per_gb);
                        } else {
                            bare.push(r.gb_per_s);
                            bare_cpu.push(cpu_per_gb);
                        }
                    }
                    Err(e) => eprintln!("block {block} ({}): {e}", if is_mori { "mori" } else { "bare" }),
                }
            }
        }
        let (b, m) = (median(&bare), median(&mori));
        let ratios: Vec<f64> = bare.iter().zip(&mori).filter(|(b, _)| **b > 0.0).map(|(b, m)| m / b).collect();
        let ratio = median(&ratios);
        let (bc, mc) = (median(&bare_cpu), median(&mori_cpu));
        println!(
            "block {:>5} KiB: bare tcp-sim {b:.3} GB/s, mori adapter {m:.3} GB/s, ratio {ratio:.3} ({:+.1}%; \
             {} rounds, {:.3}..{:.3}); CPU-s/GB bare {bc:.3}, mori {mc:.3} ({:+.1}%)",
            block >> 10,
            (ratio - 1.0) * 100.0,
            ratios.len(),
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
            if bc > 0.0 { (mc / bc - 1.0) * 100.0 } else { 0.0 }
        );
    }
}
