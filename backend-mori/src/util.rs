//! Small helpers.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering the data of a poisoned mutex instead of panicking.
///
/// Every critical section in this crate keeps its data consistent before any
/// call that could panic, so the data of a poisoned mutex is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `HashMap` with foldhash's fast hasher (seeded per process) instead of
/// SipHash: the per-transfer tables are hit a dozen times per operation, and
/// SipHash was the largest single cost on that path. Keys a peer chooses
/// (transfer ids, sequence numbers) live in bounded tables.
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// `HashSet` with the same hasher as [`HashMap`].
pub(crate) type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
