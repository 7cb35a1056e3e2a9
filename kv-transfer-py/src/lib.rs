//! # kv-transfer-py: the `kv_transfer` Python package's native module
//!
//! Python drives kv-transfer; it does not reimplement it. Everything that
//! decides when a slot may be reused (leases, generations, proofs,
//! quarantine, escalation) stays in `kv-transfer-core` and the backends; this
//! crate only turns their types into Python objects whose state is checked at
//! run time, because Python has no typestate:
//!
//! - [`Endpoint`](endpoint::Endpoint): one backend (tcp-sim, Mooncake over
//!   TCP, NIXL, verbs), its descriptor, its peers.
//! - [`PagePool`](pool::PagePool): a set of pools over memory the caller owns
//!   (one per KV buffer, e.g. one per layer's K and V: SGLang's `KVArgs`),
//!   all addressed by the same page indices.
//! - [`PageLease`](lease::PageLease): the pages of one request in every
//!   buffer, in an explicit lifecycle (reserved, exposed, in flight,
//!   settled, aborted, released). An exposed lease cannot be released or
//!   read: a typed exception, and nothing is freed.
//! - [`Transfer`](transfer::Transfer): a posted WRITE of a lease into a
//!   peer's exposed pages; polled or awaited without the GIL.
//!
//! Errors are Python exceptions deriving from `kv_transfer.KvTransferError`;
//! nothing in this module panics on bad input.
//!
//! # Feature flags
//!
//! - `mooncake`, `nixl` (default), `verbs`: compile that backend into the
//!   Python package.
//! - `naive-positive-control`: `Endpoint(..., policy="naive")` on tcp-sim, for
//!   the hazard test's positive control (`scripts/sglang-tests` builds with it;
//!   a production wheel does not).
#![cfg_attr(docsrs, feature(doc_cfg))]
// PyO3's macros expand to `unsafe` and to conversions clippy dislikes.
#![allow(clippy::useless_conversion)]

pub mod auth;
pub mod bench;
pub mod endpoint;
pub mod errors;
pub mod lease;
pub mod logging;
pub mod pool;
pub mod region;
pub mod remote;
pub mod transfer;

use pyo3::prelude::*;

/// The native module (`kv_transfer._native`).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust's `tracing` events (through `log`) go to Python's `logging`,
    // under logger names that start with the crate's (`backend_tcp_sim`, ...).
    logging::install(log::LevelFilter::Warn);
    errors::register(m)?;
    auth::register(m)?;
    m.add_class::<endpoint::Endpoint>()?;
    m.add_class::<pool::PagePool>()?;
    m.add_class::<lease::PageLease>()?;
    m.add_class::<remote::RemotePages>()?;
    m.add_class::<transfer::Transfer>()?;
    m.add_function(wrap_pyfunction!(endpoint::backends, m)?)?;
    m.add_function(wrap_pyfunction!(bench::rust_baseline, m)?)?;
    m.add_function(wrap_pyfunction!(logging::set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(logging::disable_log_bridge, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NAIVE_POLICY_BUILT", cfg!(feature = "naive-positive-control"))?;
    Ok(())
}
