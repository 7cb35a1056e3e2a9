//! WRITE throughput of the MORI adapter over the TCP simulator next to the
//! bare simulator, same sizes, same process:
//! `cargo run --release --example mori_bench -p backend-mori [secs] [rounds]`.
//!
//! Each round runs the bare bench and the MORI bench back to back (the order
//! alternates between rounds); the figures are the means over the rounds.
use backend_tcp_sim::bench::{run_write_bench as bare_bench, BenchConfig, BenchResult};
use std::time::Duration;

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn line(name: &str, r: &BenchResult) {
    println!(
        "  {name:<5} block {:>5} KiB  batch {}  threads {}  {:.3} GB/s  batch p50 {} us  p99 {} us  ({} batches)",
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
    for block in [64usize << 10, 1 << 20] {
        let cfg = BenchConfig {
            block_size: block,
            batch: 32,
            threads: 4,
            duration: Duration::from_secs_f64(secs),
            warmup: Duration::from_millis(300),
            ..BenchConfig::default()
        };
        let (mut bare, mut mori) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let order: [bool; 2] = if round % 2 == 0 { [false, true] } else { [true, false] };
            for is_mori in order {
                let r = if is_mori { backend_mori::bench::run_write_bench(&cfg) } else { bare_bench(&cfg) };
                match r {
                    Ok(r) => {
                        line(if is_mori { "mori" } else { "bare" }, &r);
                        if is_mori {
                            mori.push(r.gb_per_s);
                        } else {
                            bare.push(r.gb_per_s);
                        }
                    }
                    Err(e) => eprintln!("block {block} ({}): {e}", if is_mori { "mori" } else { "bare" }),
                }
            }
        }
        let (b, m) = (mean(&bare), mean(&mori));
        let ratio = if b > 0.0 { m / b } else { 0.0 };
        println!(
            "block {:>5} KiB: bare tcp-sim {b:.3} GB/s, mori adapter {m:.3} GB/s, ratio {ratio:.3} ({:+.1}%)",
            block >> 10,
            (ratio - 1.0) * 100.0
        );
    }
}
