//! Small helpers.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering the data of a poisoned mutex instead of panicking.
///
/// Every critical section in this crate keeps its data consistent before any
/// call that could panic, so the data of a poisoned mutex is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
