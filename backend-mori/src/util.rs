//! Small helpers.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering the data of a poisoned mutex instead of panicking.
///
/// Every critical section in this crate keeps its data consistent before any
/// call that could panic, so the data of a poisoned mutex is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The per-transfer tables' maps (foldhash, seeded per process: see core's
/// `hash`): hit a dozen times per operation, where SipHash was the largest
/// single cost. Keys a peer chooses (transfer ids, sequence numbers) live in
/// bounded tables.
pub(crate) use kv_transfer_core::hash::{HashMap, HashSet};
