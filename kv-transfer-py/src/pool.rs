//! `kv_transfer.PagePool`: one core pool per KV buffer, addressed by the
//! same page indices, so that a request's pages are one lease however many
//! layers the model has.

use crate::errors::{self, AdmissionRefused, KvTransferError};
use crate::lease::PageLease;
use kv_transfer_core::{SlotId, SlotLease, SlotPool};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// Pages over registered caller memory: page `i` exists in every buffer.
///
/// A page is reserved in every buffer at once, under a fresh generation per
/// buffer; it returns to the free list only unexposed, or with a proof.
#[pyclass(module = "kv_transfer", frozen)]
pub struct PagePool {
    pub(crate) pools: Vec<SlotPool>,
    pages: usize,
    backend: &'static str,
}

impl PagePool {
    pub(crate) fn new(pools: Vec<SlotPool>, backend: &'static str) -> PyResult<Self> {
        let pages = pools.iter().map(SlotPool::capacity).min().unwrap_or(0);
        if pools.iter().any(|p| p.capacity() != pages) {
            return Err(KvTransferError::new_err("the backend built pools of different sizes"));
        }
        Ok(Self { pools, pages, backend })
    }

    /// Reserves `pages` in every buffer, all or nothing across buffers.
    fn reserve_in_all(&self, pages: &[SlotId]) -> PyResult<Vec<SlotLease<kv_transfer_core::Reserved>>> {
        let mut leases = Vec::with_capacity(self.pools.len());
        for pool in &self.pools {
            match pool.reserve_slots(pages) {
                Ok(l) => leases.push(l),
                // The leases taken so far drop here: reserved, never exposed,
                // so straight back to the free list.
                Err(e) => return Err(errors::admission(e)),
            }
        }
        Ok(leases)
    }
}

/// Page indices from Python: `bytes` of little-endian int32 (what
/// `numpy.ndarray.astype(int32).tobytes()` gives: the fast path) or any
/// sequence of ints.
pub(crate) fn page_ids(pages: &Bound<'_, PyAny>, capacity: usize) -> PyResult<Vec<SlotId>> {
    let raw: Vec<i64> = if let Ok(b) = pages.downcast::<PyBytes>() {
        let b = b.as_bytes();
        if b.len() % 4 != 0 {
            return Err(PyValueError::new_err("page indices as bytes must be little-endian int32 (length % 4 == 0)"));
        }
        b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect()
    } else {
        pages.extract().map_err(|_| PyValueError::new_err("page indices must be a sequence of ints or int32 bytes"))?
    };
    raw.into_iter()
        .map(|p| {
            if p < 0 || p as u64 >= capacity as u64 {
                Err(AdmissionRefused::new_err(format!("page {p} is outside the pool (0..{capacity})")))
            } else {
                Ok(SlotId(p as u32))
            }
        })
        .collect()
}

/// Converts a JSON value into the equivalent Python object.
pub(crate) fn json_to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<PyObject> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None(),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any().unbind(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any().unbind(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any().unbind(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any().unbind(),
        Value::Array(a) => {
            let l = PyList::empty(py);
            for x in a {
                l.append(json_to_py(py, x)?)?;
            }
            l.into_any().unbind()
        }
        Value::Object(_) => json_to_dict(py, v)?.into_any().unbind(),
    })
}

/// Converts a JSON object into a dict.
pub(crate) fn json_to_dict<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    if let serde_json::Value::Object(o) = v {
        for (k, x) in o {
            d.set_item(k, json_to_py(py, x)?)?;
        }
    }
    Ok(d)
}

/// Sums the pools' snapshots field by field (nested summaries: the largest).
fn merge(acc: &mut serde_json::Value, v: serde_json::Value) {
    use serde_json::Value;
    match (acc, v) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, x) in b {
                match a.get_mut(&k) {
                    Some(y) => merge(y, x),
                    None => {
                        a.insert(k, x);
                    }
                }
            }
        }
        (a @ Value::Number(_), Value::Number(b)) => {
            if let (Some(x), Some(y)) = (a.as_u64(), b.as_u64()) {
                *a = Value::from(x.saturating_add(y));
            } else if let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) {
                *a = Value::from(x.max(y));
            }
        }
        (a, b) => *a = b,
    }
}

#[pymethods]
impl PagePool {
    /// Pages per buffer.
    #[getter]
    fn pages(&self) -> usize {
        self.pages
    }

    /// Number of buffers (pools) a page spans.
    #[getter]
    fn buffers(&self) -> usize {
        self.pools.len()
    }

    /// Bytes of page `i` in each buffer.
    #[getter]
    fn page_bytes(&self) -> Vec<usize> {
        self.pools.iter().map(SlotPool::slot_size).collect()
    }

    /// Reserves exactly these pages (the serving engine's allocator chose
    /// them) in every buffer, all or nothing. Raises `AdmissionRefused` if
    /// any is outside the pool, listed twice, or not free (still leased, or
    /// quarantined waiting for a proof: the engine reused a page too early).
    fn reserve(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<PageLease> {
        let ids = page_ids(pages, self.pages)?;
        let leases = py.allow_threads(|| self.reserve_in_all(&ids))?;
        Ok(PageLease::reserved(self.pools.clone(), ids, leases, self.backend))
    }

    /// Reserves any `n` free pages (the same ones in every buffer).
    fn reserve_any(&self, n: usize) -> PyResult<PageLease> {
        let first = self.pools.first().ok_or_else(|| KvTransferError::new_err("pool without buffers"))?;
        let lease0 = first.reserve(n).map_err(errors::admission)?;
        let ids: Vec<SlotId> = lease0.tenancies().iter().map(|t| t.slot).collect();
        let mut leases = vec![lease0];
        for pool in &self.pools[1..] {
            leases.push(pool.reserve_slots(&ids).map_err(errors::admission)?);
        }
        Ok(PageLease::reserved(self.pools.clone(), ids, leases, self.backend))
    }

    /// Whether page `page` is free in every buffer.
    fn is_free(&self, page: u32) -> bool {
        self.pools.iter().all(|p| p.slot_is_free(SlotId(page)))
    }

    /// The pools' gauges and counters, summed over buffers (in slots:
    /// a page counts once per buffer), plus `pages` and `buffers`.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut acc = serde_json::Value::Object(Default::default());
        for p in &self.pools {
            let v = serde_json::to_value(p.metrics()).map_err(|e| KvTransferError::new_err(e.to_string()))?;
            merge(&mut acc, v);
        }
        let d = json_to_dict(py, &acc)?;
        d.set_item("pages", self.pages)?;
        d.set_item("buffers", self.pools.len())?;
        d.set_item("backend", self.backend)?;
        Ok(d)
    }

    /// Checks every pool's invariants (free + leased + quarantined ==
    /// capacity, free list consistent); raises `KvTransferError` if broken.
    fn check(&self) -> PyResult<()> {
        for (i, p) in self.pools.iter().enumerate() {
            p.check_invariants().map_err(|e| KvTransferError::new_err(format!("buffer {i}: {e}")))?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("PagePool(backend={:?}, buffers={}, pages={})", self.backend, self.pools.len(), self.pages)
    }
}
