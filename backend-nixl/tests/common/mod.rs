//! Shared helpers for the tests that run the real NIXL library.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use backend_nixl::engine::{NixlLibrary, INSTALL_HINT};

/// Loads the library. Missing library: with `CI=true` the test fails loudly with the
/// install command; otherwise it is skipped with a printed message.
pub fn library_or_skip(test: &str) -> Option<NixlLibrary> {
    match NixlLibrary::load() {
        Ok(lib) => Some(lib),
        Err(e) => {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{test}: NIXL library missing under CI=true: {e}\ninstall: {INSTALL_HINT}");
            }
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

/// A process-unique agent name.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Calls `f` until it returns `Some`, at most `max` times and for at most `limit`.
pub fn bounded<T>(max: u64, limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    for _ in 0..max {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    None
}

/// A deterministic pattern for byte checks.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}
