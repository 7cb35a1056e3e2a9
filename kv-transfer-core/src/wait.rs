//! Driving futures without an async runtime.
//!
//! Core requires no executor: a backend's `TransferHandle` and a lease's
//! `settled()` future can be awaited from any runtime. Tests, benches and
//! command-line tools that have none use these two functions, which park the
//! calling thread between polls (they spawn nothing).

use std::future::Future;
use std::pin::{pin, Pin};
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

thread_local! {
    /// This thread's waker, made once and lent to each wait: a wait costs
    /// neither an allocation nor a reference count (two atomic operations
    /// per wait, a measurable share of a fast completion).
    static THREAD_WAKER: Waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
}

/// Runs a future to completion on the current thread.
///
/// ```
/// assert_eq!(kv_transfer_core::block_on(async { 1 + 1 }), 2);
/// ```
pub fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    THREAD_WAKER.with(|waker| {
        let mut cx = Context::from_waker(waker);
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
            std::thread::park();
        }
    })
}

/// Polls `fut` on the current thread until it resolves or `timeout` passes
/// (counted from the end of the first poll that finds it pending: a future
/// ready at once costs no clock read). `None` on timeout: the future is left
/// as it is (not dropped), so the caller decides what giving up means (for a
/// lease: abort it, quarantine).
///
/// ```
/// use kv_transfer_core::poll_until;
/// use std::time::Duration;
/// let mut f = Box::pin(async { 7 });
/// assert_eq!(poll_until(f.as_mut(), Duration::from_millis(10)), Some(7));
/// let mut never = Box::pin(std::future::pending::<()>());
/// assert_eq!(poll_until(never.as_mut(), Duration::from_millis(5)), None);
/// ```
pub fn poll_until<F: Future + ?Sized>(mut fut: Pin<&mut F>, timeout: Duration) -> Option<F::Output> {
    THREAD_WAKER.with(|waker| {
        let mut cx = Context::from_waker(waker);
        // The clock is read only once the future is pending: an operation
        // that finished before its wait (the common case of a fast transfer)
        // costs no clock read.
        let mut deadline = None;
        loop {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return Some(v);
            }
            let now = Instant::now();
            let deadline = *deadline.get_or_insert_with(|| now + timeout);
            if now >= deadline {
                return None;
            }
            // Woken early by the waker; the short cap also covers futures that
            // never register one.
            std::thread::park_timeout((deadline - now).min(Duration::from_millis(2)));
        }
    })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Pending until another thread sets the flag and wakes the waker it was
    /// lent (the lent thread waker must unpark the waiting thread).
    struct Flag {
        set: Arc<AtomicBool>,
        spawned: bool,
    }

    impl Future for Flag {
        type Output = u32;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
            if self.set.load(Ordering::Acquire) {
                return Poll::Ready(7);
            }
            if !self.spawned {
                self.spawned = true;
                let (set, waker) = (self.set.clone(), cx.waker().clone());
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(5));
                    set.store(true, Ordering::Release);
                    waker.wake();
                });
            }
            Poll::Pending
        }
    }

    #[test]
    fn a_wake_from_another_thread_ends_the_wait() {
        let f = Flag { set: Arc::new(AtomicBool::new(false)), spawned: false };
        assert_eq!(block_on(f), 7);
        let mut f = Box::pin(Flag { set: Arc::new(AtomicBool::new(false)), spawned: false });
        assert_eq!(poll_until(f.as_mut(), Duration::from_secs(10)), Some(7));
    }

    #[test]
    fn waits_nest() {
        // A future that blocks on another inside its poll borrows the same
        // thread waker twice; both waits end.
        let outer = async { block_on(Flag { set: Arc::new(AtomicBool::new(false)), spawned: false }) + 1 };
        assert_eq!(block_on(outer), 8);
    }
}
