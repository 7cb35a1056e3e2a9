//! Scenario 2 with digests: the second line of defence, on the simulator.
//!
//! The race itself (naive must corrupt, safe must not, on host, device-like
//! and CUDA memory) is a row of the conformance matrix on every backend with
//! a race rig (`tests/conformance.rs`, `s2_*::<backend>`). These two runs
//! check what DONE digests add under the naive policy alone.
//!
//! `KVT_RACE_ITERS` sets the requests per run (default 10,000; run 100,000
//! or more with `KVT_RACE_ITERS=100000 cargo test --release -p
//! kv-transfer-tests --test race`). `KVT_RACE_SEED` sets the seed.

use backend_tcp_sim::ReleasePolicy;
use kv_transfer_examples::race::{run_race, RaceConfig};
use kv_transfer_tests::scenarios::race_config;

/// Integrity on consume, as a second line: under the naive policy alone
/// (slots freed without a proof), DONE digests (and READs' own digests) still
/// catch every corruption when the consumer reads: the hazard happens, no
/// foreign byte is handed over.
#[test]
fn s2_naive_policy_with_digests_is_caught_at_consume() {
    let cfg = RaceConfig { digest: true, ..race_config(ReleasePolicy::Naive) };
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
    let r = run_race(&race_config(ReleasePolicy::Naive), &mut |_, _| {}).expect("race runs");
    assert_eq!(r.integrity_caught, 0);
    assert!(r.foreign_requests > 0, "{r:#?}");
}
