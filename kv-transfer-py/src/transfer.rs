//! `kv_transfer.Transfer`: a posted WRITE of a lease's pages, one core
//! operation per buffer. It owns the local leases until each operation is
//! terminal (the core's `TransferHandle` owns them inside the backend), so
//! a Python caller that forgets it cannot free a page a NIC still reads.

use crate::errors::LeaseStateError;
use crate::lease::PageLease;
use kv_transfer_core::{
    poll_until, Abandoned, PostErrorKind, Reserved, SlotId, SlotLease, SlotPool, TransferHandle, TransferOutcome,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// A timeout in seconds from Python: finite, non-negative (capped at a day).
pub(crate) fn duration(seconds: f64) -> PyResult<Duration> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(PyValueError::new_err("timeout must be a non-negative number of seconds"));
    }
    Ok(Duration::from_secs_f64(seconds.min(86_400.0)))
}

/// One buffer's operation.
pub(crate) enum Part {
    /// Posted; the backend owns the lease until the terminal status.
    InFlight(TransferHandle),
    /// Terminal, with the lease settled (no NIC touches it).
    Done(TransferOutcome),
    /// The backend refused the post: the lease is back, never exposed.
    Refused(SlotLease<Reserved>, PostErrorKind),
    /// Ended without a proof for the local lease: it is in quarantine.
    Abandoned(Abandoned),
}

/// Where the whole transfer is.
enum Phase {
    Running(Vec<Part>),
    /// `release()`d (or taken as a settled lease).
    Finished,
}

/// A posted WRITE (or READ) of every buffer of a lease.
///
/// `poll()` / `wait(timeout)` return `"pending"`, `"success"` or `"failed"`;
/// `error` says why it failed. Once terminal, `release()` gives the local
/// pages back (a failed part whose lease could not be proven stays in
/// quarantine: the pool frees it with a proof), or `take_lease()` hands them
/// over settled.
#[pyclass(module = "kv_transfer", frozen)]
pub struct Transfer {
    pools: Vec<SlotPool>,
    pages: Vec<SlotId>,
    backend: &'static str,
    phase: Mutex<Phase>,
}

/// Polls the in-flight parts once; whether every part is terminal.
fn poll_parts(parts: &mut [Part]) -> bool {
    let mut all = true;
    for p in parts.iter_mut() {
        if let Part::InFlight(h) = p {
            match poll_until(Pin::new(h), Duration::ZERO) {
                Some(Ok(o)) => *p = Part::Done(o),
                Some(Err(a)) => *p = Part::Abandoned(a),
                None => all = false,
            }
        }
    }
    all
}

fn error_of(parts: &[Part]) -> Option<String> {
    parts.iter().find_map(|p| match p {
        Part::Done(TransferOutcome { result: Err(e), .. }) => Some(e.to_string()),
        Part::Refused(_, k) => Some(format!("post refused: {k}")),
        Part::Abandoned(a) => Some(a.to_string()),
        _ => None,
    })
}

impl Transfer {
    pub(crate) fn new(pools: Vec<SlotPool>, pages: Vec<SlotId>, parts: Vec<Part>, backend: &'static str) -> Self {
        Self { pools, pages, backend, phase: Mutex::new(Phase::Running(parts)) }
    }

    fn status_locked(phase: &mut Phase) -> &'static str {
        match phase {
            Phase::Finished => "released",
            Phase::Running(parts) => {
                if !poll_parts(parts) {
                    "pending"
                } else if error_of(parts).is_some() {
                    "failed"
                } else {
                    "success"
                }
            }
        }
    }
}

#[pymethods]
impl Transfer {
    /// Polls once (non-blocking): `"pending"`, `"success"`, `"failed"`, or
    /// `"released"` after `release()`.
    fn poll(&self) -> &'static str {
        Self::status_locked(&mut self.phase.lock())
    }

    /// Waits at most `timeout` seconds (GIL released) for a terminal
    /// status; returns the status as `poll()` does.
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<&'static str> {
        let deadline = Instant::now() + duration(timeout)?;
        Ok(py.allow_threads(|| loop {
            let s = Self::status_locked(&mut self.phase.lock());
            let now = Instant::now();
            if s != "pending" || now >= deadline {
                return s;
            }
            // Woken by the completion (the handle registered this thread).
            std::thread::park_timeout((deadline - now).min(Duration::from_millis(5)));
        }))
    }

    /// Why the transfer failed (`None` while pending or after success).
    #[getter]
    fn error(&self) -> Option<String> {
        match &*self.phase.lock() {
            Phase::Running(parts) => error_of(parts),
            Phase::Finished => None,
        }
    }

    /// Asks the backend to cancel what has not moved yet (best effort: the
    /// transfer still ends only at a terminal status).
    fn cancel(&self) {
        if let Phase::Running(parts) = &*self.phase.lock() {
            for p in parts {
                if let Part::InFlight(h) = p {
                    h.cancel();
                }
            }
        }
    }

    /// Gives the local pages back once terminal. Raises `LeaseStateError`
    /// while pending (the NIC may still read them).
    fn release(&self) -> PyResult<()> {
        let mut phase = self.phase.lock();
        match Self::status_locked(&mut phase) {
            "pending" => Err(LeaseStateError::new_err("cannot release a transfer that is still in flight")),
            _ => {
                // Done and Refused leases drop back to the free list;
                // abandoned ones are already in quarantine (proof only).
                *phase = Phase::Finished;
                Ok(())
            }
        }
    }

    /// Once it succeeded: the local pages as a settled `PageLease` (to read
    /// them back, or release later). Raises `LeaseStateError` otherwise.
    fn take_lease(&self) -> PyResult<PageLease> {
        let mut phase = self.phase.lock();
        match Self::status_locked(&mut phase) {
            "success" => {}
            s => return Err(LeaseStateError::new_err(format!("cannot take the lease of a transfer that is {s}"))),
        }
        let Phase::Running(parts) = std::mem::replace(&mut *phase, Phase::Finished) else {
            return Err(LeaseStateError::new_err("transfer already released"));
        };
        let leases = parts
            .into_iter()
            .filter_map(|p| match p {
                Part::Done(o) => Some(o.lease),
                _ => None,
            })
            .collect();
        Ok(PageLease::settled(self.pools.clone(), self.pages.clone(), leases, self.backend))
    }

    fn __repr__(&self) -> String {
        format!("Transfer(status={:?}, pages={})", Self::status_locked(&mut self.phase.lock()), self.pages.len())
    }
}
