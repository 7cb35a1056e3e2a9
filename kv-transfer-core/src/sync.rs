//! The one place that names synchronisation primitives, so that `--cfg loom`
//! can swap them for loom's model-checked versions (the tokio/tower habit).
//!
//! Only the pool's mutex is modelled: it is the single point every thread
//! meets. `Arc` stays `std`'s so that `Arc<dyn Region>` coerces.
//!
//! Outside loom the mutex is `parking_lot`'s: no poisoning (every critical
//! section in core leaves the state consistent before it could panic, and it
//! only panics on allocation failure) and a cheaper uncontended path, which
//! matters with four lock round trips per lease cycle.

#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, MutexGuard};

/// Locks the mutex.
#[cfg(not(loom))]
#[inline]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// Locks the mutex, taking a poisoned one over (see the module docs).
#[cfg(loom)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
