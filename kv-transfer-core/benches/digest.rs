//! The integrity digest on consume: BLAKE3 keyed by the exposure's token
//! (what a DONE carries now) against the crc32c it replaced (forgeable by
//! anyone who can write the slot), per slot size.
//!
//! `cargo bench -p kv-transfer-core --bench digest` prints GiB/s of each.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kv_transfer_core::drain::{digest, ExposureToken};

fn bench(c: &mut Criterion) {
    let token = ExposureToken::random();
    let mut g = c.benchmark_group("digest");
    for size in [4usize << 10, 64 << 10, 1 << 20] {
        let bytes: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("blake3_keyed", size), &bytes, |b, v| b.iter(|| digest(&token, v)));
        g.bench_with_input(BenchmarkId::new("crc32c", size), &bytes, |b, v| b.iter(|| crc32c::crc32c(v)));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
