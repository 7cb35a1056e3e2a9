//! `kv_transfer.RemotePages`: what a peer needs to write into pages exposed
//! to it, one core `RemoteSlots` per buffer. It travels as bytes from the
//! exposing side to the writer; the writer parses it once (`from_bytes`)
//! and may post with it many times.

use crate::errors::DescriptorError;
use kv_transfer_core::RemoteSlots;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::{Deserialize, Serialize};

/// The wire format's version.
const VERSION: u32 = 1;
/// Largest encoded exposure accepted from a peer.
const MAX_BYTES: usize = 64 << 20;
/// Most buffers one exposure may name.
const MAX_BUFFERS: usize = 4096;

#[derive(Serialize, Deserialize)]
struct Wire {
    kvt: u32,
    buffers: Vec<RemoteSlots>,
}

/// A peer's exposed pages: per buffer, the slots' addresses, keys,
/// generations and the exposure's token. Keep it as secret as the data:
/// its tokens are what settles the exposure.
#[pyclass(module = "kv_transfer", frozen)]
pub struct RemotePages {
    pub(crate) buffers: Vec<RemoteSlots>,
}

impl RemotePages {
    pub(crate) fn new(buffers: Vec<RemoteSlots>) -> Self {
        Self { buffers }
    }

    pub(crate) fn pages(&self) -> usize {
        self.buffers.first().map_or(0, |b| b.slots.len())
    }

    /// Parses and checks the shape of a peer's exposure.
    pub(crate) fn parse(data: &[u8]) -> Result<Self, String> {
        if data.len() > MAX_BYTES {
            return Err(format!("exposure of {} B exceeds the {} B limit", data.len(), MAX_BYTES));
        }
        let w: Wire = serde_json::from_slice(data).map_err(|e| format!("malformed exposure: {e}"))?;
        if w.kvt != VERSION {
            return Err(format!("exposure format version {} (this build speaks {VERSION})", w.kvt));
        }
        if w.buffers.is_empty() || w.buffers.len() > MAX_BUFFERS {
            return Err(format!("an exposure names 1..={MAX_BUFFERS} buffers, this one {}", w.buffers.len()));
        }
        let pages = w.buffers[0].slots.len();
        if pages == 0 || w.buffers.iter().any(|b| b.slots.len() != pages) {
            return Err("every buffer of an exposure must name the same, non-zero number of pages".into());
        }
        if w.buffers.iter().any(|b| b.len_bytes().is_none() || b.slot_size == 0) {
            return Err("an exposure's slot size is zero or its length overflows".into());
        }
        Ok(Self { buffers: w.buffers })
    }
}

#[pymethods]
impl RemotePages {
    /// Parses a peer's exposure; raises `DescriptorError` if malformed.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: Vec<u8>) -> PyResult<Self> {
        py.allow_threads(|| Self::parse(&data)).map_err(DescriptorError::new_err)
    }

    /// The exposure as bytes, to send to the peer.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let w = Wire { kvt: VERSION, buffers: self.buffers.clone() };
        let v = serde_json::to_vec(&w).map_err(|e| DescriptorError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &v))
    }

    /// Pages `start..end` of the exposure (every buffer), for a chunk of a
    /// request: the same tokens, so a DONE for the chunk settles exactly
    /// those pages.
    fn slice(&self, start: usize, end: usize) -> PyResult<Self> {
        if start >= end || end > self.pages() {
            return Err(DescriptorError::new_err(format!(
                "pages {start}..{end} are not a non-empty part of an exposure of {} pages",
                self.pages()
            )));
        }
        let buffers =
            self.buffers.iter().map(|b| RemoteSlots { slots: b.slots[start..end].to_vec(), ..b.clone() }).collect();
        Ok(Self { buffers })
    }

    /// Pages exposed (in every buffer).
    #[getter(pages)]
    fn py_pages(&self) -> usize {
        self.pages()
    }

    /// Buffers exposed.
    #[getter]
    fn buffers(&self) -> usize {
        self.buffers.len()
    }

    /// The exposing side's page indices, in order.
    #[getter]
    fn page_ids(&self) -> Vec<u32> {
        self.buffers.first().map(|b| b.slots.iter().map(|s| s.slot.0).collect()).unwrap_or_default()
    }

    fn __repr__(&self) -> String {
        format!("RemotePages(buffers={}, pages={})", self.buffers.len(), self.pages())
    }
}
