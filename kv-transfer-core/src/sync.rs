//! The one place that names synchronisation primitives, so that `--cfg loom`
//! can swap them for loom's model-checked versions (the tokio/tower habit).
//!
//! Only the pool's mutex is modelled: it is the single point every thread
//! meets. `Arc` stays `std`'s so that `Arc<dyn Region>` coerces.

#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// Lock, ignoring poisoning: every critical section in core leaves the state
/// consistent before it can panic (it only panics on allocation failure), so a
/// poisoned lock still guards a valid state, and refusing it would turn one
/// panic into a pool that can never settle or release anything again.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
