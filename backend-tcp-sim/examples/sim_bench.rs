//! WRITE throughput on loopback:
//! `cargo run --release --example sim_bench -p backend-tcp-sim [secs] [socket-buffer-bytes|auto]`.
use backend_tcp_sim::bench::{run_write_bench, BenchConfig};
use std::time::Duration;

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let socket_buffer = match std::env::args().nth(2) {
        Some(s) if s == "auto" => None,
        Some(s) => s.parse().ok(),
        None => BenchConfig::default().socket_buffer,
    };
    for block in [64usize << 10, 1 << 20] {
        let cfg = BenchConfig {
            block_size: block,
            batch: 32,
            threads: 4,
            duration: Duration::from_secs_f64(secs),
            warmup: Duration::from_millis(300),
            socket_buffer,
        };
        match run_write_bench(&cfg) {
            Ok(r) => println!(
                "block {:>5} KiB  batch {}  threads {}  {:.2} GB/s  batch p50 {} us  p99 {} us  ({} batches)",
                block >> 10,
                cfg.batch,
                cfg.threads,
                r.gb_per_s,
                r.latency_quantile_us(0.5),
                r.latency_quantile_us(0.99),
                r.batch_latency_us.len()
            ),
            Err(e) => eprintln!("block {block}: {e}"),
        }
    }
}
