//! # kv-transfer-testkit
//!
//! What every test of the workspace needs and none should write again:
//!
//! - [`wait`]: bounded waits (every loop of a test is bounded in count and
//!   time): [`wait::wait_until`] says whether a condition came to hold,
//!   [`wait::wait_for`] fails the test naming what never came, and
//!   [`wait::poll_until`] polls a future that may never resolve.
//! - [`payload`]: self-describing KV payloads, so a consumer tells its own
//!   bytes from a late writer's (a *foreign* run) and from torn ones.
//!
//! It depends on `kv-transfer-core` alone, so any crate's tests can use it
//! (a dev-dependency), and no production crate depends on it.
//!
//! ```
//! use kv_transfer_testkit::wait::{wait_for, wait_until};
//! use std::time::Duration;
//! let t0 = std::time::Instant::now();
//! assert!(wait_until(Duration::from_secs(1), || t0.elapsed() > Duration::from_millis(5)));
//! assert!(!wait_until(Duration::from_millis(5), || false));
//! wait_for("a condition that holds", Duration::from_secs(1), || true);
//! ```
#![deny(missing_docs)]

pub mod payload;
pub mod wait;
