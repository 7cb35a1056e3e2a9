//! Bounded waiting on futures that may never resolve (a lease whose proof
//! never comes, a handle whose operation is held). Every wait in the race
//! and the suite goes through here, so no loop is unbounded in time.

use std::time::{Duration, Instant};

/// Polls a future until it resolves or a timeout passes (core's; one
/// implementation for the whole workspace).
pub use kv_transfer_core::poll_until;

/// Calls `cond` until it holds or `timeout` passes (sleeping 100 µs between
/// calls). Returns whether it held.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}
