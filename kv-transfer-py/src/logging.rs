//! Rust's log records (and `tracing` events, through its `log` feature) to
//! Python's `logging`, under the record's target (`backend_tcp_sim::nic`,
//! ...), as children of nothing: configure them like any Python logger.
//!
//! Backend threads log at any time, also while the interpreter shuts down,
//! when taking the GIL from a foreign thread is not allowed (CPython ends
//! such a thread, which aborts a Rust process). The package's `atexit`
//! handler turns the bridge off first ([`disable_log_bridge`]); records after that are
//! dropped.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(false);

struct Bridge;

fn python_level(l: log::Level) -> u32 {
    match l {
        log::Level::Error => 40,
        log::Level::Warn => 30,
        log::Level::Info => 20,
        log::Level::Debug => 10,
        log::Level::Trace => 5,
    }
}

impl log::Log for Bridge {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        ENABLED.load(Ordering::Relaxed) && m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let msg = r.args().to_string();
        let target = r.target().replace("::", ".");
        Python::with_gil(|py| {
            // Re-checked under the GIL: `disable` runs under it.
            if !ENABLED.load(Ordering::Relaxed) {
                return;
            }
            let _ = py
                .import("logging")
                .and_then(|l| l.call_method1("getLogger", (target,)))
                .and_then(|lg| lg.call_method1("log", (python_level(r.level()), msg)));
        });
    }
    fn flush(&self) {}
}

static BRIDGE: Bridge = Bridge;

/// Installs the bridge (once) at `max_level`: records below it cost one
/// atomic load and never take the GIL.
pub(crate) fn install(max_level: log::LevelFilter) {
    if log::set_logger(&BRIDGE).is_ok() {
        log::set_max_level(max_level);
    }
    ENABLED.store(true, Ordering::Relaxed);
}

/// `kv_transfer._native.set_log_level(level)`: Python's numeric level
/// (`logging.DEBUG`, ...) below which Rust records are not forwarded.
#[pyfunction]
pub fn set_log_level(level: u32) {
    log::set_max_level(match level {
        0..=5 => log::LevelFilter::Trace,
        6..=10 => log::LevelFilter::Debug,
        11..=20 => log::LevelFilter::Info,
        21..=30 => log::LevelFilter::Warn,
        _ => log::LevelFilter::Error,
    });
}

/// Stops forwarding (the package's `atexit` handler calls it).
#[pyfunction]
pub fn disable_log_bridge() {
    ENABLED.store(false, Ordering::Relaxed);
}
