//! The hash maps of the workspace's per-operation tables.
//!
//! `std`'s default hasher (SipHash-1-3) costs about 140 instructions per
//! short key; a transfer looks up and inserts several times (its operation,
//! its batch, its peer, its abort tracking), which made hashing alone about
//! 2,000 instructions of a Mooncake transfer (`kvt cost`). foldhash is seeded
//! per process, as `std`'s `RandomState` is, so a peer cannot pick keys that
//! collide without knowing the seed; the tables keyed by what a peer sends
//! are bounded per peer besides (rule 9).
//!
//! ```
//! use kv_transfer_core::hash::HashMap;
//! let mut m: HashMap<u64, &str> = HashMap::default();
//! m.insert(7, "seven");
//! assert_eq!(m.get(&7), Some(&"seven"));
//! ```

/// `HashMap` with foldhash's fast hasher, seeded per process.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// `HashSet` with the same hasher as [`HashMap`].
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
