//! Bounded waiting: on a condition ([`wait_until`], [`wait_for`]) or on a
//! future that may never resolve ([`poll_until`]: a lease whose proof never
//! comes, a handle whose operation is held). Every wait in the workspace's
//! tests goes through here, so no loop is unbounded in time.

use std::time::{Duration, Instant};

/// Polls a future until it resolves or a timeout passes (core's; one
/// implementation for the whole workspace).
pub use kv_transfer_core::poll_until;

/// The longest sleep between two looks at a condition.
const MAX_NAP: Duration = Duration::from_millis(2);

/// Calls `cond` until it holds or `timeout` passes, sleeping between calls
/// (100 µs at first, doubling up to 2 ms: a condition that holds soon is
/// seen soon, a long wait costs little CPU). Returns whether it held; it is
/// called once more at the deadline.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut nap = Duration::from_micros(100);
    loop {
        if cond() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = (nap * 2).min(MAX_NAP);
    }
}

/// [`wait_until`], failing the test (a panic naming `what` and the limit)
/// when `cond` does not come to hold within `limit`.
#[track_caller]
pub fn wait_for(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    assert!(wait_until(limit, cond), "timed out after {limit:?} waiting for {what}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_is_bounded_and_checks_once_more_at_the_deadline() {
        let mut calls = 0u32;
        let t0 = Instant::now();
        assert!(!wait_until(Duration::from_millis(20), || {
            calls += 1;
            false
        }));
        assert!(t0.elapsed() >= Duration::from_millis(20));
        assert!(calls >= 2, "called {calls} times");
    }

    #[test]
    #[should_panic(expected = "waiting for the impossible")]
    fn wait_for_names_what_never_came() {
        wait_for("the impossible", Duration::from_millis(5), || false);
    }
}
