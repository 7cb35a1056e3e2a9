//! Time as an input. Core reads the clock only to stamp quarantine entries
//! and to measure abort-to-reclaim latency; deadlines are compared against the
//! `now` a backend passes in, so tests can drive escalation without sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A source of monotonic time.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to: for deterministic tests of the
/// escalation ladder.
///
/// ```
/// use kv_transfer_core::{Clock, ManualClock};
/// use std::time::Duration;
/// let c = ManualClock::new();
/// let t0 = c.now();
/// c.advance(Duration::from_millis(5));
/// assert_eq!(c.now() - t0, Duration::from_millis(5));
/// ```
#[derive(Debug)]
pub struct ManualClock {
    origin: Instant,
    offset_ns: AtomicU64,
}

impl ManualClock {
    /// A clock standing at the moment it was made.
    pub fn new() -> Self {
        Self { origin: Instant::now(), offset_ns: AtomicU64::new(0) }
    }
    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.offset_ns.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.origin + Duration::from_nanos(self.offset_ns.load(Ordering::SeqCst))
    }
}
