//! `kv_transfer.PageLease`: a request's pages in every buffer, with the
//! typestate of core's `SlotLease` turned into an explicit lifecycle checked
//! at run time. Python cannot forget a state: each transition takes the
//! state out of the enum and puts the next one back; a refused transition
//! puts the same state back and raises `LeaseStateError`.

use crate::endpoint::Backend;
use crate::errors::{self, DescriptorError, LeaseStateError};
use crate::remote::RemotePages;
use crate::transfer::{duration, Part, Transfer};
use kv_transfer_core::{
    block_on, poll_until, Exposed, Op, PeerId, Reserved, Settled, SettledFuture, SlotId, SlotLease, SlotPool, Tenancy,
    TransferOptions,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// One buffer's exposure: waiting for its proof, or settled.
enum ExposedPart {
    Waiting(SettledFuture),
    Settled(SlotLease<Settled>),
}

/// Where a lease is in its life. Every state owns what it needs and nothing
/// else; there is no combination of flags to get wrong.
enum Life {
    /// Reserved, never exposed: may be released, posted, exposed.
    Reserved(Vec<SlotLease<Reserved>>),
    /// Exposed to a peer: settles only with a proof per buffer.
    Exposed { parts: Vec<ExposedPart>, tenancies: Vec<Vec<Tenancy>> },
    /// Moved into a `Transfer` (posted); comes back only through it.
    InFlight,
    /// Every buffer proven: no NIC can touch the pages; readable, releasable.
    Settled(Vec<SlotLease<Settled>>),
    /// Aborted while exposed: in quarantine until a proof frees each slot.
    Aborted { tenancies: Vec<Vec<Tenancy>> },
    /// Given back.
    Released,
}

impl Life {
    fn name(&self) -> &'static str {
        match self {
            Life::Reserved(_) => "reserved",
            Life::Exposed { .. } => "exposed",
            Life::InFlight => "in_flight",
            Life::Settled(_) => "settled",
            Life::Aborted { .. } => "aborted",
            Life::Released => "released",
        }
    }
}

/// A request's pages, reserved in every buffer of a `PagePool`.
///
/// States: `reserved` → (`expose`) `exposed` → (proof) `settled` →
/// `released`; `reserved` → (`Endpoint.write`) `in_flight` (the `Transfer`
/// owns it); `exposed` → (`abort`) `aborted` (quarantined until proven
/// free: `drained`). `release()` and `read()` of an exposed lease raise
/// `LeaseStateError` and free nothing. A lease dropped while exposed is
/// aborted (quarantine), never freed.
#[pyclass(module = "kv_transfer", frozen)]
pub struct PageLease {
    pools: Vec<SlotPool>,
    pages: Vec<SlotId>,
    backend: &'static str,
    life: Mutex<Life>,
}

fn wrong_state(op: &str, life: &Life) -> PyErr {
    LeaseStateError::new_err(format!("cannot {op} a lease that is {}", life.name()))
}

impl PageLease {
    pub(crate) fn reserved(
        pools: Vec<SlotPool>,
        pages: Vec<SlotId>,
        leases: Vec<SlotLease<Reserved>>,
        backend: &'static str,
    ) -> Self {
        Self { pools, pages, backend, life: Mutex::new(Life::Reserved(leases)) }
    }

    pub(crate) fn settled(
        pools: Vec<SlotPool>,
        pages: Vec<SlotId>,
        leases: Vec<SlotLease<Settled>>,
        backend: &'static str,
    ) -> Self {
        Self { pools, pages, backend, life: Mutex::new(Life::Settled(leases)) }
    }

    /// Takes the reserved leases out (to expose or post), or refuses.
    fn take_reserved(&self, op: &str) -> PyResult<Vec<SlotLease<Reserved>>> {
        let mut life = self.life.lock();
        match std::mem::replace(&mut *life, Life::InFlight) {
            Life::Reserved(l) => Ok(l),
            other => {
                let e = wrong_state(op, &other);
                *life = other;
                Err(e)
            }
        }
    }

    fn put_back(&self, leases: Vec<SlotLease<Reserved>>) {
        *self.life.lock() = Life::Reserved(leases);
    }

    pub(crate) fn expose(&self, py: Python<'_>, backend: &dyn Backend, peer: PeerId) -> PyResult<RemotePages> {
        let leases = self.take_reserved("expose")?;
        let out = py.allow_threads(|| {
            let mut parts = Vec::with_capacity(leases.len());
            let mut remotes = Vec::with_capacity(leases.len());
            let mut leases = leases.into_iter();
            while let Some(l) = leases.next() {
                match backend.expose(l, peer) {
                    Ok((exposed, remote)) => {
                        parts.push(exposed);
                        remotes.push(remote);
                    }
                    Err(e) => {
                        let tenancies: Vec<Vec<Tenancy>> =
                            parts.iter().map(|p: &SlotLease<Exposed>| p.tenancies().to_vec()).collect();
                        drop(parts);
                        let mut rest = vec![e.lease];
                        rest.extend(leases);
                        return Err((e.kind, rest, tenancies));
                    }
                }
            }
            Ok((parts, remotes))
        });
        match out {
            Ok((parts, remotes)) => {
                let tenancies = parts.iter().map(|p| p.tenancies().to_vec()).collect();
                let parts = parts.into_iter().map(|p| ExposedPart::Waiting(p.settled())).collect();
                *self.life.lock() = Life::Exposed { parts, tenancies };
                Ok(RemotePages::new(remotes))
            }
            Err((kind, rest, exposed)) => {
                if exposed.is_empty() {
                    // Nothing was exposed: the lease comes back reserved.
                    self.put_back(rest);
                } else {
                    // Buffers already exposed cannot be taken back without a
                    // proof: they are in quarantine; the rest (never exposed)
                    // went back to the free list. `drained` says when the
                    // whole lease is free.
                    drop(rest);
                    *self.life.lock() = Life::Aborted { tenancies: exposed };
                }
                Err(errors::expose(&kind))
            }
        }
    }

    pub(crate) fn post(
        &self,
        py: Python<'_>,
        backend: &dyn Backend,
        op: Op,
        remote: &RemotePages,
        notify: bool,
        digest: bool,
    ) -> PyResult<Transfer> {
        {
            let life = self.life.lock();
            let Life::Reserved(l) = &*life else {
                return Err(wrong_state("post", &life));
            };
            if remote.buffers.len() != l.len() {
                return Err(DescriptorError::new_err(format!(
                    "the peer exposed {} buffers, the local lease has {}",
                    remote.buffers.len(),
                    l.len()
                )));
            }
            if remote.pages() != self.pages.len() {
                return Err(DescriptorError::new_err(format!(
                    "the peer exposed {} pages, the local lease has {}",
                    remote.pages(),
                    self.pages.len()
                )));
            }
        }
        let leases = self.take_reserved("post")?;
        let opts = TransferOptions::notify(notify).with_digest(digest);
        let parts = py.allow_threads(|| {
            let mut parts = Vec::with_capacity(leases.len());
            for (l, r) in leases.into_iter().zip(&remote.buffers) {
                let posted = match op {
                    Op::Write => block_on(backend.write(l, r, opts.clone())),
                    Op::Read => block_on(backend.read(l, r, opts.clone())),
                };
                match posted {
                    Ok(h) => parts.push(Part::InFlight(h)),
                    Err(e) => {
                        parts.push(Part::Refused(e.lease, e.kind));
                    }
                }
            }
            parts
        });
        if parts.iter().all(|p| matches!(p, Part::Refused(..))) {
            // Nothing was posted: hand the lease back, reserved (rule 3).
            let mut kinds = Vec::new();
            let mut back = Vec::new();
            for p in parts {
                if let Part::Refused(l, k) = p {
                    back.push(l);
                    kinds.push(k);
                }
            }
            self.put_back(back);
            return Err(errors::post(&kinds[0]));
        }
        Ok(Transfer::new(self.pools.clone(), self.pages.clone(), parts, self.backend))
    }

    /// Polls every waiting buffer once; whether all are settled.
    fn poll_parts(parts: &mut [ExposedPart]) -> bool {
        let mut all = true;
        for p in parts.iter_mut() {
            if let ExposedPart::Waiting(f) = p {
                match poll_until(Pin::new(f), Duration::ZERO) {
                    Some(s) => *p = ExposedPart::Settled(s),
                    None => all = false,
                }
            }
        }
        all
    }

    /// One poll: moves an exposed lease to settled when every buffer is proven.
    fn try_settle_locked(life: &mut Life) -> bool {
        match life {
            Life::Settled(_) => true,
            Life::Exposed { parts, .. } => {
                if !Self::poll_parts(parts) {
                    return false;
                }
                let Life::Exposed { parts, .. } = std::mem::replace(life, Life::InFlight) else { return false };
                let settled = parts
                    .into_iter()
                    .filter_map(|p| match p {
                        ExposedPart::Settled(s) => Some(s),
                        ExposedPart::Waiting(_) => None,
                    })
                    .collect();
                *life = Life::Settled(settled);
                true
            }
            _ => false,
        }
    }

    fn drained_locked(&self, life: &Life) -> bool {
        match life {
            Life::Aborted { tenancies } => tenancies.iter().zip(&self.pools).all(|(ts, pool)| {
                ts.iter()
                    .all(|t| pool.slot_is_free(t.slot) || pool.generation(t.slot).is_some_and(|g| g > t.generation))
            }),
            Life::Released => true,
            _ => false,
        }
    }
}

#[pymethods]
impl PageLease {
    /// `"reserved"`, `"exposed"`, `"in_flight"`, `"settled"`, `"aborted"` or `"released"`.
    #[getter]
    fn state(&self) -> &'static str {
        self.life.lock().name()
    }

    /// The page indices, in order.
    #[getter]
    fn pages(&self) -> Vec<u32> {
        self.pages.iter().map(|s| s.0).collect()
    }

    /// Number of pages.
    fn __len__(&self) -> usize {
        self.pages.len()
    }

    /// The backend whose pool this is.
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// Exposed: whether every buffer's proof has arrived (non-blocking); the
    /// lease becomes `settled` if so. Settled: True. Otherwise False.
    fn try_settle(&self) -> bool {
        Self::try_settle_locked(&mut self.life.lock())
    }

    /// Waits at most `timeout` seconds (GIL released) for an exposed lease
    /// to settle; whether it did. A timeout changes nothing: the exposure
    /// stays in force (a timer never frees).
    fn wait_settled(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let deadline = Instant::now() + duration(timeout)?;
        py.allow_threads(|| loop {
            {
                let mut life = self.life.lock();
                if Self::try_settle_locked(&mut life) {
                    return Ok(true);
                }
                if !matches!(&*life, Life::Exposed { .. }) {
                    return Ok(false);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            // The pool wakes this thread when a proof lands (the waker the
            // poll registered); the bound is only a backstop.
            std::thread::park_timeout((deadline - now).min(Duration::from_millis(5)));
        })
    }

    /// Aborts an exposed lease: every buffer goes to quarantine and the
    /// backend's escalation ladder starts (drain, revoke, fence). The pages
    /// are free again only when proven (`drained`). A settled lease is
    /// released instead; a reserved one too (never exposed).
    fn abort(&self) -> PyResult<()> {
        let mut life = self.life.lock();
        match std::mem::replace(&mut *life, Life::Released) {
            Life::Exposed { parts, tenancies } => {
                for p in parts {
                    match p {
                        ExposedPart::Waiting(f) => f.abort(),
                        ExposedPart::Settled(s) => s.release(),
                    }
                }
                *life = Life::Aborted { tenancies };
                Ok(())
            }
            Life::Reserved(l) => {
                drop(l);
                Ok(())
            }
            Life::Settled(l) => {
                drop(l);
                Ok(())
            }
            other => {
                let e = wrong_state("abort", &other);
                *life = other;
                Err(e)
            }
        }
    }

    /// Whether the pages are free again (for an aborted lease: every slot
    /// proven, by an ack, a revocation or a fence; a released lease: True).
    #[getter]
    fn drained(&self) -> bool {
        self.drained_locked(&self.life.lock())
    }

    /// Gives the pages back. Only a `reserved` or `settled` lease: an
    /// exposed one raises `LeaseStateError` and nothing is freed (abort it).
    fn release(&self) -> PyResult<()> {
        let mut life = self.life.lock();
        Self::try_settle_locked(&mut life);
        match std::mem::replace(&mut *life, Life::Released) {
            Life::Reserved(l) => drop(l),
            Life::Settled(l) => drop(l),
            Life::Released => {}
            other => {
                let e = wrong_state("release", &other);
                *life = other;
                return Err(e);
            }
        }
        Ok(())
    }

    /// The bytes of page `index` (position in `pages`) of buffer `buffer`.
    /// Only a settled lease: reading an exposed one raises `LeaseStateError`
    /// (a NIC may still write); a page whose DONE carried a digest that the
    /// bytes no longer match raises `IntegrityError`.
    fn read<'py>(&self, py: Python<'py>, buffer: usize, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        let mut life = self.life.lock();
        Self::try_settle_locked(&mut life);
        let Life::Settled(leases) = &*life else {
            return Err(wrong_state("read", &life));
        };
        let lease = leases.get(buffer).ok_or_else(|| PyIndexError::new_err(format!("no buffer {buffer}")))?;
        if index >= lease.len() {
            return Err(PyIndexError::new_err(format!("no page at position {index}")));
        }
        let mut buf = vec![0u8; lease.pool().slot_size()];
        lease.read_at(index, 0, &mut buf).map_err(errors::access)?;
        Ok(PyBytes::new(py, &buf))
    }

    fn __repr__(&self) -> String {
        format!("PageLease(state={:?}, pages={})", self.life.lock().name(), self.pages.len())
    }
}
