//! Seeded, reproducible fault injection.
//!
//! Every random decision is a pure function of `(seed, connection index, WR
//! sequence number)` (splitmix64), so the same [`FaultPlan`] gives the same
//! schedule of faults on every run, whatever the threads do.
//!
//! ```
//! use backend_tcp_sim::{DelayDist, FaultPlan};
//! let plan = FaultPlan { seed: 42, delay: DelayDist::Uniform { min_us: 10, max_us: 500 }, ..FaultPlan::default() };
//! let again = plan.clone();
//! assert_eq!(plan.schedule(0, 100), again.schedule(0, 100));
//! assert_ne!(plan.schedule(0, 100), FaultPlan { seed: 43, ..plan.clone() }.schedule(0, 100));
//! ```

use serde::{Deserialize, Serialize};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Delay added before each work request leaves the initiator's NIC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum DelayDist {
    /// No delay.
    #[default]
    None,
    /// The same delay for every WR.
    Fixed {
        /// Microseconds.
        us: u64,
    },
    /// Uniform in `[min_us, max_us]`.
    Uniform {
        /// Lower bound, µs.
        min_us: u64,
        /// Upper bound, µs.
        max_us: u64,
    },
    /// Exponential with this mean (capped at 20 × the mean).
    Exponential {
        /// Mean, µs.
        mean_us: u64,
    },
}

/// Tear a connection down after this many bytes have left on it (possibly
/// in the middle of a WRITE's payload).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropSpec {
    /// Which connection of this NIC (0 = the first one it opened or accepted).
    pub conn_index: u32,
    /// Bytes sent before the socket is shut down.
    pub after_bytes: u64,
}

/// Faults of one NIC. Serializable except for the [`Gate`], which a test
/// holds and opens at run time.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FaultPlan {
    /// Seed of every random decision.
    pub seed: u64,
    /// Per-WR delay at the initiator.
    pub delay: DelayDist,
    /// Reordering across connections: each connection gets an extra constant
    /// delay drawn uniformly from `[0, reorder_jitter_us]`.
    pub reorder_jitter_us: u64,
    /// Drop a connection mid-stream.
    pub drop_connection: Option<DropSpec>,
    /// Slow target: applying a write takes at least `len / rate` seconds.
    pub slow_target_bytes_per_sec: Option<u64>,
    /// Holds incoming WRITEs at this (target) NIC, before any check, until opened.
    #[serde(skip)]
    pub gate: Option<Gate>,
}

/// splitmix64: a tiny, well-mixed, deterministic generator step.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn draw(seed: u64, a: u64, b: u64) -> u64 {
    splitmix64(seed ^ splitmix64(a.wrapping_mul(0x1000_0000_01B3) ^ splitmix64(b)))
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether this plan adds any delay at all.
    pub fn has_delays(&self) -> bool {
        self.delay != DelayDist::None || self.reorder_jitter_us > 0
    }

    /// The delay of the `seq`-th WR sent on connection `conn` (per-WR delay
    /// plus the connection's reorder delay).
    pub fn wr_delay(&self, conn: u32, seq: u64) -> Duration {
        let r = draw(self.seed, u64::from(conn), seq);
        let us = match self.delay {
            DelayDist::None => 0,
            DelayDist::Fixed { us } => us,
            DelayDist::Uniform { min_us, max_us } => {
                let (lo, hi) = (min_us.min(max_us), min_us.max(max_us));
                lo + r % (hi - lo + 1)
            }
            DelayDist::Exponential { mean_us } => {
                // Inverse CDF on a uniform in (0, 1].
                let u = ((r >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let x = -(u.ln()) * mean_us as f64;
                x.min(20.0 * mean_us as f64) as u64
            }
        };
        Duration::from_micros(us) + self.conn_delay(conn)
    }

    /// The constant extra delay of connection `conn` (reordering across connections).
    pub fn conn_delay(&self, conn: u32) -> Duration {
        if self.reorder_jitter_us == 0 {
            return Duration::ZERO;
        }
        let r = draw(self.seed, u64::from(conn), u64::MAX);
        Duration::from_micros(r % (self.reorder_jitter_us + 1))
    }

    /// The delays of the first `n` WRs on connection `conn`: the schedule
    /// the NIC will follow.
    pub fn schedule(&self, conn: u32, n: u64) -> Vec<Duration> {
        (0..n).map(|s| self.wr_delay(conn, s)).collect()
    }
}

#[derive(Debug, Default)]
struct GateState {
    held: bool,
    /// Writes still to be held by `hold_next` (each until the next `open`).
    hold_budget: usize,
    /// Bumped by every `open`: a write held by the budget waits for it.
    opened: u64,
    waiting: usize,
    passed: u64,
}

/// Holds WRITEs at a target NIC until a test opens it: "the write survives
/// the abort". Cheap to clone; clones share the gate. Starts open.
///
/// ```
/// use backend_tcp_sim::Gate;
/// let g = Gate::new();
/// g.hold();
/// assert!(!g.is_open());
/// g.open();
/// assert!(g.is_open());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Gate {
    inner: Arc<(Mutex<GateState>, Condvar)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Gate {
    /// An open gate.
    pub fn new() -> Self {
        Self::default()
    }
    /// A gate that holds from the start.
    pub fn closed() -> Self {
        let g = Self::new();
        g.hold();
        g
    }
    /// Start holding writes that arrive from now on.
    pub fn hold(&self) {
        lock(&self.inner.0).held = true;
    }
    /// Holds only the next `n` WRITEs to arrive (each until the next
    /// [`open`](Self::open)); later ones pass. A stale write can so be kept
    /// in flight while the slot's next tenant is written through the same NIC.
    ///
    /// ```
    /// use backend_tcp_sim::Gate;
    /// let g = Gate::new();
    /// g.hold_next(1);
    /// assert!(g.is_open()); // new writes pass once the budget is spent
    /// ```
    pub fn hold_next(&self, n: usize) {
        lock(&self.inner.0).hold_budget = n;
    }
    /// Let every held write (and later ones) through.
    pub fn open(&self) {
        let mut st = lock(&self.inner.0);
        st.held = false;
        st.hold_budget = 0;
        st.opened += 1;
        drop(st);
        self.inner.1.notify_all();
    }
    /// Whether writes pass.
    pub fn is_open(&self) -> bool {
        !lock(&self.inner.0).held
    }
    /// Writes waiting at the gate now.
    pub fn waiting(&self) -> usize {
        lock(&self.inner.0).waiting
    }
    /// Writes that went through the gate so far.
    pub fn passed(&self) -> u64 {
        lock(&self.inner.0).passed
    }
    /// Waits (bounded) until at least `n` writes wait at the gate.
    pub fn wait_for_waiting(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.inner.0);
        while st.waiting < n {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = match self.inner.1.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }
    /// Blocks while held; gives up (returns false) when `cancel()` says so.
    /// Waits are bounded (10 ms) so cancellation is noticed.
    pub(crate) fn pass(&self, cancel: impl Fn() -> bool) -> bool {
        let mut st = lock(&self.inner.0);
        let by_budget = !st.held && st.hold_budget > 0;
        if !st.held && !by_budget {
            st.passed += 1;
            return true;
        }
        if by_budget {
            st.hold_budget -= 1;
        }
        let opened = st.opened;
        st.waiting += 1;
        self.inner.1.notify_all();
        while if by_budget { st.opened == opened } else { st.held } {
            if cancel() {
                st.waiting -= 1;
                self.inner.1.notify_all();
                return false;
            }
            st = match self.inner.1.wait_timeout(st, Duration::from_millis(10)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        st.waiting -= 1;
        st.passed += 1;
        true
    }
}
