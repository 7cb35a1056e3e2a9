//! The Rust side of the overhead benchmark (`python/bench/overhead.py`): the
//! same request (reserve N pages in every buffer, WRITE each buffer into the
//! peer's exposure, wait for every completion, release) driven from Rust
//! with core's API, in the same process, over the same endpoints, so that
//! the Python layer's cost is the difference.

use crate::endpoint::Endpoint;
use crate::errors::{self, BackendFailure};
use crate::pool::PagePool;
use crate::remote::RemotePages;
use kv_transfer_core::{block_on, poll_until, TransferOptions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::pin::Pin;
use std::time::Duration;
use std::time::Instant;

/// Runs `iters` requests of `remote.pages` pages from `pool` into `remote`
/// through `endpoint` in Rust (GIL released); returns each request's
/// nanoseconds. `notify` as `Endpoint.write`. `poll=True` polls the
/// operations without blocking until all are terminal (what SGLang's
/// scheduler does with `sender.poll()`); `poll=False` blocks on each.
#[pyfunction]
#[pyo3(signature = (endpoint, pool, remote, iters, *, notify = false, poll = true))]
pub fn rust_baseline(
    py: Python<'_>,
    endpoint: &Endpoint,
    pool: &PagePool,
    remote: &RemotePages,
    iters: usize,
    notify: bool,
    poll: bool,
) -> PyResult<Vec<u64>> {
    if remote.buffers.len() != pool.pools.len() {
        return Err(PyValueError::new_err("the exposure and the pool have different numbers of buffers"));
    }
    let n = remote.pages();
    let backend = endpoint.backend.clone();
    let opts = TransferOptions::notify(notify);
    py.allow_threads(|| {
        let mut out = Vec::with_capacity(iters);
        let mut handles = Vec::with_capacity(pool.pools.len());
        for _ in 0..iters {
            let t0 = Instant::now();
            let first = pool.pools[0].reserve(n).map_err(errors::admission)?;
            let ids: Vec<_> = first.tenancies().iter().map(|t| t.slot).collect();
            let mut leases = vec![first];
            for p in &pool.pools[1..] {
                leases.push(p.reserve_slots(&ids).map_err(errors::admission)?);
            }
            for (l, r) in leases.into_iter().zip(&remote.buffers) {
                handles.push(block_on(backend.write(l, r, opts.clone())).map_err(|e| errors::post(&e.kind))?);
            }
            for mut h in handles.drain(..) {
                let o = if poll {
                    loop {
                        if let Some(o) = poll_until(Pin::new(&mut h), Duration::ZERO) {
                            break o;
                        }
                    }
                } else {
                    block_on(h)
                };
                let o = o.map_err(|a| BackendFailure::new_err(a.to_string()))?;
                o.result.map_err(|e| BackendFailure::new_err(e.to_string()))?;
                o.lease.release();
            }
            out.push(t0.elapsed().as_nanos() as u64);
        }
        Ok(out)
    })
}
