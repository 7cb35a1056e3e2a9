//! Runs lease cycles in a loop for profilers (`valgrind --tool=callgrind`,
//! `perf`): `cargo run --release -p kv-transfer-core --example cycle_profile -- 100000`.
use kv_transfer_core::*;
use std::sync::Arc;

fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(1024 * 64).unwrap()), PoolConfig::new(64)).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..n {
        let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(1));
        let proof = authority.completed_lease(&exposed);
        match exposed.settle(proof) {
            Ok(s) => s.release(),
            Err(e) => panic!("{e}"),
        }
    }
    println!("{:.1} ns per cycle over {n} cycles", start.elapsed().as_nanos() as f64 / n as f64);
}
