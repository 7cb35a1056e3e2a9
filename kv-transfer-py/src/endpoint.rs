//! `kv_transfer.Endpoint`: one backend, chosen by name at run time among
//! those compiled in, driven through the two traits every backend
//! implements (`Target` for pools, peers and exposure; `Transfer` for posts).

use crate::errors::{self, BackendUnavailable, KvTransferError};
use crate::lease::PageLease;
use crate::pool::PagePool;
use crate::region;
use crate::remote::RemotePages;
use crate::transfer::Transfer as PyTransfer;
use backend_tcp_sim::{FaultPlan, Gate, NicConfig, SimNic};
use kv_transfer_core::{drain::ReleasePolicy, Op, PeerId, PoolConfig, Region, Target, Transfer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// What an endpoint drives: both halves of one backend.
pub(crate) trait Backend: Target + Transfer {}
impl<T: Target + Transfer> Backend for T {}

/// The backends compiled into this build, in the order `backends()` lists them.
const COMPILED: &[&str] = &[
    "tcp-sim",
    #[cfg(feature = "mooncake")]
    "mooncake",
    #[cfg(feature = "nixl")]
    "nixl",
    #[cfg(feature = "verbs")]
    "verbs",
];

/// The backends compiled into this build of the package (`tcp-sim` always;
/// `mooncake`, `nixl`, `verbs` by cargo feature). Whether an engine or device
/// is present is known only when an [`Endpoint`] is built.
#[pyfunction]
pub fn backends() -> Vec<&'static str> {
    COMPILED.to_vec()
}

/// One backend's endpoint: registers pools over caller memory, exchanges
/// descriptors with peers, exposes leases and posts transfers.
///
/// `Endpoint(backend, name, *, policy="safe", fault_gate=False,
/// host="127.0.0.1", device=None, gid_index=0)`. `backend` is one of
/// `kv_transfer.backends()`. `policy="naive"` (tcp-sim only, and only in a
/// build with the `naive-positive-control` feature) is the race tests'
/// positive control: it frees aborted slots without a proof. `fault_gate`
/// (tcp-sim only) holds incoming WRITEs at this NIC while
/// `hold_writes()` is in force, to hold a write in flight
/// in tests.
#[pyclass(module = "kv_transfer", frozen)]
pub struct Endpoint {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) name: String,
    kind: &'static str,
    gate: Option<Gate>,
    sim: Option<Arc<SimNic>>,
}

fn parse_policy(policy: &str) -> PyResult<ReleasePolicy> {
    match policy {
        "safe" => Ok(ReleasePolicy::Safe),
        #[cfg(feature = "naive-positive-control")]
        "naive" => Ok(ReleasePolicy::Naive),
        #[cfg(not(feature = "naive-positive-control"))]
        "naive" => Err(BackendUnavailable::new_err(
            "policy=\"naive\" is the race tests' positive control; this build of kv_transfer leaves it out \
             (build with the `naive-positive-control` feature)",
        )),
        other => Err(PyValueError::new_err(format!("unknown policy {other:?} (\"safe\" or \"naive\")"))),
    }
}

impl Endpoint {
    fn start(
        kind: &str,
        name: &str,
        policy: ReleasePolicy,
        fault_gate: bool,
        host: &str,
        device: Option<&str>,
        gid_index: u8,
    ) -> PyResult<Self> {
        if policy != ReleasePolicy::Safe && kind != "tcp-sim" {
            return Err(PyValueError::new_err("policy=\"naive\" exists only on the tcp-sim backend"));
        }
        if fault_gate && kind != "tcp-sim" {
            return Err(PyValueError::new_err("fault_gate exists only on the tcp-sim backend"));
        }
        let (backend, kind, gate, sim): (Arc<dyn Backend>, _, _, _) = match kind {
            "tcp-sim" => {
                let gate = fault_gate.then(Gate::new);
                let faults = FaultPlan { gate: gate.clone(), ..FaultPlan::none() };
                let nic = SimNic::start(NicConfig::new(name).with_policy(policy).with_faults(faults))
                    .map_err(|e| errors::BackendFailure::new_err(format!("tcp-sim: {e}")))?;
                let nic = Arc::new(nic);
                (nic.clone(), "tcp-sim", gate, Some(nic))
            }
            #[cfg(feature = "mooncake")]
            "mooncake" => {
                use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer};
                let _ = device;
                let cfg = EngineConfig { local_host: host.to_string(), ..EngineConfig::default() };
                let engine = MooncakeEngine::new(cfg)
                    .map_err(|e| errors::BackendFailure::new_err(format!("mooncake engine: {e}")))?;
                let t = MooncakeTransfer::new(Arc::new(engine), AdapterConfig::default())
                    .map_err(|e| errors::BackendFailure::new_err(format!("mooncake adapter: {e}")))?;
                (Arc::new(t), "mooncake", None, None)
            }
            #[cfg(feature = "nixl")]
            "nixl" => {
                use backend_nixl::{AdapterConfig, NixlTransfer};
                let t = NixlTransfer::new_real(name, AdapterConfig::default()).map_err(|e| {
                    BackendUnavailable::new_err(format!(
                        "nixl: {e} (install the engine: pip install nixl-cu12==1.5.1 into a venv and set \
                         KVT_ENGINES_VENV to it, or NIXL_LIB_DIR to the directory of libnixl_capi.so)"
                    ))
                })?;
                (Arc::new(t), "nixl", None, None)
            }
            #[cfg(feature = "verbs")]
            "verbs" => {
                use backend_verbs::{VerbsConfig, VerbsTransfer};
                let Some(device) = device else {
                    return Err(PyValueError::new_err("the verbs backend needs device=\"<ibv device name>\""));
                };
                let t = VerbsTransfer::new(VerbsConfig::new(name.to_string(), device, gid_index)).map_err(|e| {
                    BackendUnavailable::new_err(format!("verbs: device {device} (GID index {gid_index}): {e}"))
                })?;
                (Arc::new(t), "verbs", None, None)
            }
            other => {
                let _ = (host, device, gid_index);
                return Err(BackendUnavailable::new_err(format!(
                    "backend {other:?} is not compiled into this kv_transfer (compiled in: {})",
                    COMPILED.join(", ")
                )));
            }
        };
        Ok(Self { backend, name: name.to_string(), kind, gate, sim })
    }

    fn gate(&self) -> PyResult<&Gate> {
        self.gate.as_ref().ok_or_else(|| PyValueError::new_err("this endpoint was built without fault_gate=True"))
    }
}

#[pymethods]
impl Endpoint {
    // The Python constructor's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    #[new]
    #[pyo3(signature = (backend, name, *, policy = "safe", fault_gate = false, host = "127.0.0.1", device = None, gid_index = 0))]
    fn new(
        py: Python<'_>,
        backend: &str,
        name: &str,
        policy: &str,
        fault_gate: bool,
        host: &str,
        device: Option<&str>,
        gid_index: u8,
    ) -> PyResult<Self> {
        let policy = parse_policy(policy)?;
        if name.is_empty() {
            return Err(PyValueError::new_err("an endpoint needs a non-empty name"));
        }
        py.allow_threads(|| Self::start(backend, name, policy, fault_gate, host, device, gid_index))
    }

    /// The backend's name (`"tcp-sim"`, `"mooncake"`, `"nixl"`, `"verbs"`).
    #[getter]
    fn backend(&self) -> &'static str {
        self.kind
    }

    /// This endpoint's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Registers buffers of caller memory as one page pool. `buffers` is a
    /// list of `(address, length, page_bytes)`, one per KV buffer (e.g. each
    /// layer's K and V); page `i` of buffer `b` is `address_b + i *
    /// page_bytes_b`. Every buffer has the same number of pages (the
    /// smallest `length // page_bytes`). `owner` is kept alive as long as
    /// the memory is registered (pass the tensors). `device`: the CUDA
    /// device the buffers are on; by default each address is asked of the
    /// CUDA driver, if one is loaded (a `cuda:N` tensor's `data_ptr()` is
    /// device memory of N), and is host memory otherwise. Device memory is
    /// never touched through its address: socket backends stage it, NIXL
    /// registers it as VRAM, verbs through a dma-buf.
    #[pyo3(signature = (buffers, owner = None, device = None))]
    fn register(
        &self,
        py: Python<'_>,
        buffers: Vec<(usize, usize, usize)>,
        owner: Option<Py<PyAny>>,
        device: Option<u32>,
    ) -> PyResult<PagePool> {
        if buffers.is_empty() {
            return Err(PyValueError::new_err("register needs at least one buffer"));
        }
        let pages = buffers.iter().map(|&(_, len, page)| len.checked_div(page).unwrap_or(0)).min().unwrap_or(0);
        if pages == 0 {
            return Err(PyValueError::new_err("every buffer needs page_bytes > 0 and room for at least one page"));
        }
        let mut regions: Vec<Arc<dyn Region>> = Vec::with_capacity(buffers.len());
        for &(addr, _, page) in &buffers {
            let owner = owner.as_ref().map(|o| o.clone_ref(py));
            regions.push(region::foreign(addr, pages * page, owner, device).map_err(|e| match e {
                region::RegionFailure::Buffer(m) => PyValueError::new_err(m),
                region::RegionFailure::Device(m) => BackendUnavailable::new_err(m),
            })?);
        }
        let backend = self.backend.clone();
        let pools = py.allow_threads(|| {
            regions
                .into_iter()
                .zip(&buffers)
                .map(|(r, &(_, _, page))| backend.register_pool(r, PoolConfig::new(page)))
                .collect::<Result<Vec<_>, _>>()
        });
        PagePool::new(pools.map_err(errors::backend)?, self.kind)
    }

    /// What a peer passes to its own `add_peer` to reach this endpoint
    /// (after this side registered its pools).
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<pyo3::Bound<'py, pyo3::types::PyBytes>> {
        let d = py.allow_threads(|| self.backend.local_descriptor()).map_err(errors::backend)?;
        Ok(pyo3::types::PyBytes::new(py, &d))
    }

    /// Adds (or finds) the peer a descriptor names; returns its id.
    fn add_peer(&self, py: Python<'_>, descriptor: Vec<u8>) -> PyResult<u64> {
        let peer = py.allow_threads(|| self.backend.add_peer(&descriptor)).map_err(errors::backend)?;
        Ok(peer.0 as u64)
    }

    /// Exposes a reserved lease to `peer`: the peer may now write into its
    /// pages. The lease becomes `exposed` and settles only with a proof
    /// (the peer's DONE, a revocation, a fence). Returns what the peer
    /// needs (`RemotePages.to_bytes()` travels to it).
    fn expose(&self, py: Python<'_>, lease: &PageLease, peer: u64) -> PyResult<RemotePages> {
        let peer = PeerId(u32::try_from(peer).map_err(|_| PyValueError::new_err("peer id out of range"))?);
        lease.expose(py, self.backend.as_ref(), peer)
    }

    /// Posts a WRITE of every page of the local `lease` into the peer's
    /// exposed `remote` pages (in order). `notify` sends the DONE that
    /// settles the peer's exposure once the bytes landed. The lease moves
    /// into the returned `Transfer` (its state becomes `in_flight`).
    #[pyo3(signature = (lease, remote, *, notify = true, digest = false))]
    fn write(
        &self,
        py: Python<'_>,
        lease: &PageLease,
        remote: &RemotePages,
        notify: bool,
        digest: bool,
    ) -> PyResult<PyTransfer> {
        lease.post(py, self.backend.as_ref(), Op::Write, remote, notify, digest)
    }

    /// Posts a READ of the peer's exposed `remote` pages (in order) into
    /// every page of the local `lease` (pull mode: the decode reads what the
    /// prefill exposed). `notify` sends the DONE that settles the peer's
    /// exposure once the READs completed: the peer's pages may go back to
    /// its free list only then. The lease moves into the returned `Transfer`.
    #[pyo3(signature = (lease, remote, *, notify = true, digest = false))]
    fn read(
        &self,
        py: Python<'_>,
        lease: &PageLease,
        remote: &RemotePages,
        notify: bool,
        digest: bool,
    ) -> PyResult<PyTransfer> {
        lease.post(py, self.backend.as_ref(), Op::Read, remote, notify, digest)
    }

    /// The backend's own counters (the pools keep theirs).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("backend", self.kind)?;
        for (k, v) in self.backend.counters() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// tcp-sim with `fault_gate=True`: hold WRITEs arriving at this NIC
    /// from now on (before any check), until `release_writes`.
    fn hold_writes(&self) -> PyResult<()> {
        self.gate()?.hold();
        Ok(())
    }

    /// tcp-sim with `fault_gate=True`: hold only the next `n` WRITEs to
    /// arrive (until `release_writes`); later ones pass. Keeps a stale
    /// write in flight while the page's next tenant is written.
    fn hold_next_writes(&self, n: usize) -> PyResult<()> {
        self.gate()?.hold_next(n);
        Ok(())
    }

    /// tcp-sim with `fault_gate=True`: let every held WRITE through (each
    /// is then checked against the current generation, as a NIC would).
    fn release_writes(&self) -> PyResult<()> {
        self.gate()?.open();
        Ok(())
    }

    /// tcp-sim with `fault_gate=True`: waits (GIL released, at most
    /// `timeout` seconds) until at least `n` WRITEs are held; whether they are.
    fn wait_held_writes(&self, py: Python<'_>, n: usize, timeout: f64) -> PyResult<bool> {
        let gate = self.gate()?.clone();
        let t = crate::transfer::duration(timeout)?;
        Ok(py.allow_threads(|| gate.wait_for_waiting(n, t)))
    }

    /// tcp-sim: the NIC's counters, including the stale writes it rejected
    /// (`stale_rejected`) and those it applied into a reassigned slot under
    /// the naive policy.
    fn nic_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let nic = self.sim.as_ref().ok_or_else(|| PyValueError::new_err("nic_stats exists only on tcp-sim"))?;
        let json = serde_json::to_value(nic.stats()).map_err(|e| KvTransferError::new_err(e.to_string()))?;
        crate::pool::json_to_dict(py, &json)
    }

    fn __repr__(&self) -> String {
        format!("Endpoint(backend={:?}, name={:?})", self.kind, self.name)
    }
}
