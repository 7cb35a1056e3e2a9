//! Bounded waiting on futures that may never resolve (a lease whose proof
//! never comes, a handle whose operation is held). Every wait in the race
//! and the suite goes through here, so no loop is unbounded in time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `fut` on this thread until it resolves or `timeout` passes.
/// `None` on timeout: the future is left as it is (not dropped), so the
/// caller decides what giving up means (for a lease: abort it, quarantine).
///
/// ```
/// use kv_transfer_examples::wait::poll_until;
/// use std::time::Duration;
/// let mut f = Box::pin(async { 7 });
/// assert_eq!(poll_until(f.as_mut(), Duration::from_millis(10)), Some(7));
/// let mut never = Box::pin(std::future::pending::<()>());
/// assert_eq!(poll_until(never.as_mut(), Duration::from_millis(5)), None);
/// ```
pub fn poll_until<F: Future + ?Sized>(mut fut: Pin<&mut F>, timeout: Duration) -> Option<F::Output> {
    let deadline = Instant::now() + timeout;
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        // Woken early by the waker; the short cap also covers futures that
        // do not register one.
        std::thread::park_timeout((deadline - now).min(Duration::from_millis(2)));
    }
}

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
