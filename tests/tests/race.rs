//! Scenario 2: the reassignment race, through the one implementation the
//! demo and `kvt race` use.
//!
//! `KVT_RACE_ITERS` sets the requests per policy (default 10,000; run
//! 100,000 or more with `KVT_RACE_ITERS=100000 cargo test --release -p
//! kv-transfer-tests --test race`). `KVT_RACE_SEED` sets the seed.

use backend_tcp_sim::ReleasePolicy;
use kv_transfer_core::SlotMemory;
use kv_transfer_examples::race::{run_race, RaceConfig};
use kv_transfer_tests::scenarios::{race_config, race_positive_control, race_safe};

fn config(policy: ReleasePolicy) -> RaceConfig {
    race_config(policy)
}

/// The positive control on `memory`: with the naive policy the race must
/// show corruption, or the test proves nothing.
fn naive_shows_corruption(memory: SlotMemory) {
    let cfg = RaceConfig { memory, ..config(ReleasePolicy::Naive) };
    let r = run_race(&cfg, &mut |_, _| {}).expect("race runs");
    if let Err(f) = race_positive_control(&r, cfg.requests) {
        panic!("{}", f.0);
    }
}

/// The contract on `memory`: with the safe policy no consumer reads a
/// foreign byte, and the pool comes back whole.
fn safe_has_zero_foreign_bytes(memory: SlotMemory) {
    let cfg = RaceConfig { memory, ..config(ReleasePolicy::Safe) };
    let r = run_race(&cfg, &mut |_, _| {}).expect("race runs");
    if let Err(f) = race_safe(&r, cfg.requests) {
        panic!("{}", f.0);
    }
    // The simulator fails no kept request's transfer (verbs may: a refused
    // stale write puts its queue pair in ERR and flushes the kept ones).
    assert_eq!(r.transfer_failures, 0, "a kept request's transfer failed: {r:#?}");
}

/// The positive control, on host memory.
#[test]
fn s2_naive_policy_shows_corruption() {
    naive_shows_corruption(SlotMemory::Host);
}

/// The contract, on host memory.
#[test]
fn s2_safe_policy_zero_foreign_bytes() {
    safe_has_zero_foreign_bytes(SlotMemory::Host);
}

/// On device-like memory (slots whose address faults on the CPU; the
/// simulator stages them through host buffers): the hazard is the same, and
/// no path touched a slot through its address (that would have crashed).
#[test]
fn s2_naive_policy_shows_corruption_on_device_memory() {
    naive_shows_corruption(SlotMemory::FakeDevice);
}

#[test]
fn s2_safe_policy_zero_foreign_bytes_on_device_memory() {
    safe_has_zero_foreign_bytes(SlotMemory::FakeDevice);
}

/// The CUDA device the `_on_cuda_memory` races use (`KVT_DEVICE`, default `cuda:0`).
fn cuda() -> SlotMemory {
    std::env::var("KVT_DEVICE").ok().and_then(|d| d.parse().ok()).unwrap_or(SlotMemory::Cuda { ordinal: 0 })
}

/// On a GPU's memory (the simulator stages through host buffers and the
/// device's copies).
#[test]
#[ignore = "needs an NVIDIA GPU and its driver (scripts/device-check.sh)"]
fn s2_naive_policy_shows_corruption_on_cuda_memory() {
    naive_shows_corruption(cuda());
}

#[test]
#[ignore = "needs an NVIDIA GPU and its driver (scripts/device-check.sh)"]
fn s2_safe_policy_zero_foreign_bytes_on_cuda_memory() {
    safe_has_zero_foreign_bytes(cuda());
}

/// Integrity on consume, as a second line: under the naive policy alone
/// (slots freed without a proof), DONE digests (and READs' own digests) still
/// catch every corruption when the consumer reads: the hazard happens, no
/// foreign byte is handed over.
#[test]
fn s2_naive_policy_with_digests_is_caught_at_consume() {
    let cfg = RaceConfig { digest: true, ..config(ReleasePolicy::Naive) };
    let r = run_race(&cfg, &mut |_, _| {}).expect("race runs");
    eprintln!(
        "naive + digests: {} requests, {} stale writes landed, {} reads refused for integrity, {} consumed foreign bytes",
        r.requests, r.stale_writes_landed, r.integrity_caught, r.foreign_requests
    );
    assert!(r.stale_writes_landed > 0, "the hazard must still happen (positive control): {r:#?}");
    assert!(r.integrity_caught > 0, "digests caught nothing: {r:#?}");
    assert_eq!(r.foreign_requests, 0, "a corrupted slot was handed over despite its digest: {r:#?}");
    assert_eq!(r.foreign_bytes, 0);
}

/// The same schedule without digests is the positive control of the one
/// above: the corruption is consumed.
#[test]
fn s2_naive_policy_without_digests_consumes_the_corruption() {
    let r = run_race(&config(ReleasePolicy::Naive), &mut |_, _| {}).expect("race runs");
    assert_eq!(r.integrity_caught, 0);
    assert!(r.foreign_requests > 0, "{r:#?}");
}
