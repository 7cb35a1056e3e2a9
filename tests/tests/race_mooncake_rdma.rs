//! Scenario 2 over Mooncake's RDMA transport (backend-verbs' software NIC),
//! the decode side granting a key per exposure: naive must corrupt (its old
//! keys are never ended, so the held writes land in the next tenants), safe
//! must show 0 foreign bytes with the stale writes refused at the NIC (the
//! ladder revoked their keys) and the pool whole.
//!
//! `KVT_RACE_ITERS` and `KVT_RACE_SEED` as for `tests/race.rs`; 2,000
//! requests per policy by default (under `naive` every aborted slot leaves
//! a key granted and published, so its metadata grows with the run).

use backend_tcp_sim::ReleasePolicy;
use kv_transfer_examples::race::mooncake::run_mooncake_rdma_race;
use kv_transfer_examples::race::RaceConfig;
use kv_transfer_tests::scenarios::{race_positive_control, race_safe};

fn race_config(policy: ReleasePolicy) -> RaceConfig {
    let mut cfg = kv_transfer_tests::scenarios::race_config(policy);
    if std::env::var("KVT_RACE_ITERS").is_err() {
        cfg.requests = 2_000;
    }
    cfg
}

#[test]
fn s2_mooncake_rdma_naive_policy_shows_corruption() {
    let cfg = race_config(ReleasePolicy::Naive);
    let r = run_mooncake_rdma_race(&cfg, &mut |_, _| {}).expect("race runs");
    if let Err(f) = race_positive_control(&r, cfg.requests) {
        panic!("{}", f.0);
    }
}

#[test]
fn s2_mooncake_rdma_safe_policy_zero_foreign_bytes_stale_writes_refused_at_the_nic() {
    let cfg = race_config(ReleasePolicy::Safe);
    let r = run_mooncake_rdma_race(&cfg, &mut |_, _| {}).expect("race runs");
    if let Err(f) = race_safe(&r, cfg.requests) {
        panic!("{}", f.0);
    }
    assert!(r.rejected_at_nic > 0, "no stale write reached the NIC: the race proved nothing about the keys: {r:#?}");
}
