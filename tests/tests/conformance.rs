//! Scenarios 1 and 3-8 against every available backend.

use kv_transfer_tests::{for_each_backend, scenarios, Failure};
use std::path::PathBuf;

fn worker() -> Option<PathBuf> {
    Some(PathBuf::from(env!("CARGO_BIN_EXE_prefill-worker")))
}

fn run(f: impl Fn(&dyn kv_transfer_tests::Backend) -> Result<(), Failure>) {
    if let Err(e) = for_each_backend(worker(), f) {
        panic!("{e}");
    }
}

#[test]
fn s1_abort_while_writes_in_flight() {
    run(scenarios::abort_in_flight);
}

#[test]
fn s3_peer_crash_in_process() {
    run(|b| scenarios::peer_crash(b, false));
}

#[test]
fn s3_peer_crash_killed_process() {
    run(|b| scenarios::peer_crash(b, true));
}

#[test]
fn s4_stale_ack_never_settles_new_tenancy() {
    run(scenarios::stale_ack);
}

#[test]
fn s5_bad_input() {
    run(scenarios::bad_input);
}

#[test]
fn s6_admission_overload() {
    run(scenarios::admission_overload);
}

#[test]
fn s7_dropped_handle_and_lease() {
    run(scenarios::dropped_handles);
}

#[test]
fn s8_peer_never_acks() {
    run(scenarios::never_acks);
}
