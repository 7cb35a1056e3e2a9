//! One lease cycle: reserve → expose → settle → release.
//!
//! `cargo bench -p kv-transfer-core --bench lease_cycle` prints ns per cycle,
//! single-threaded and with two threads contending for one pool, and the
//! metadata bytes per slot of a 1M-slot pool.

use criterion::{criterion_group, criterion_main, Criterion};
use kv_transfer_core::*;
use std::sync::Arc;
use std::time::Instant;

fn pool(slots: usize, slot_size: usize) -> (SlotPool, SettlementAuthority) {
    SlotPool::new(Arc::new(HostRegion::new(slots * slot_size).unwrap()), PoolConfig::new(slot_size)).unwrap()
}

fn cycle(pool: &SlotPool, authority: &SettlementAuthority) {
    let lease = pool.reserve(1).unwrap();
    let exposed = authority.expose_local(lease, PeerId(1));
    let proof = authority.completed_lease(&exposed);
    let settled = match exposed.settle(proof) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    settled.release();
}

fn bench(c: &mut Criterion) {
    let (p, a) = pool(1024, 64);
    c.bench_function("lease_cycle/1_thread", |b| b.iter(|| cycle(&p, &a)));

    let (p2, a2) = pool(1024, 64);
    c.bench_function("lease_cycle/2_threads_contending", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    let (p, a) = (p2.clone(), a2.clone());
                    s.spawn(move || {
                        for _ in 0..iters {
                            cycle(&p, &a);
                        }
                    });
                }
            });
            // Per cycle of either thread: total wall time over all cycles run.
            start.elapsed() / 2
        })
    });

    let slots = 1 << 20;
    let (big, _a) = pool(slots, 64);
    eprintln!(
        "metadata: {} bytes per slot at {} slots ({} MiB in all)",
        SlotPool::metadata_bytes_per_slot(),
        big.capacity(),
        (SlotPool::metadata_bytes_per_slot() * big.capacity()) >> 20
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
