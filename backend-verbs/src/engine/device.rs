//! [`Engine`] over libibverbs: one device context, protection domain and
//! completion queue; queue pairs, regions and windows kept by handle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kv_transfer_core::Region;

use super::Engine;
use crate::device::Context;
use crate::error::VerbsError;
use crate::memory::{MemoryRegion, MemoryWindow, ProtectionDomain};
use crate::queue::{CompletionQueue, QueuePair};
use crate::work::{Completion, Endpoint, MrAccess, MrId, MrInfo, MwId, QpId, QpState, WorkRequest};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A window operation in flight: its completion moves the window on.
#[derive(Clone, Copy, Debug)]
enum WindowOp {
    Bind { mw: MwId, addr: u64, len: u32 },
    Invalidate { mw: MwId },
}

#[derive(Default)]
struct Tables {
    qps: HashMap<QpId, Arc<QueuePair>>,
    mrs: HashMap<MrId, Arc<MemoryRegion>>,
    mws: HashMap<MwId, MemoryWindow>,
    next_mr: u32,
    next_mw: u32,
    /// `(qp, wr_id)` of each bind and invalidation posted.
    window_ops: HashMap<(u32, u64), WindowOp>,
    /// The MTU each queue pair offered its peer.
    mtus: HashMap<QpId, u32>,
}

impl Drop for Tables {
    fn drop(&mut self) {
        // Windows first: a bound type-2 window holds a reference on its
        // queue pair, and Soft-RoCE's destroy_qp waits for every reference
        // to go (it hung a teardown with an exposure still bound). Then the
        // queue pairs (their requests flush), then the regions.
        self.mws.clear();
        self.qps.clear();
        self.mrs.clear();
    }
}

/// The real NIC: a verbs device opened by name (`rxe_lo` in the lab).
/// Teardown order is the handles': queue pairs, windows and regions hold
/// the protection domain and context they were made from.
pub struct DeviceEngine {
    /// The port's active MTU when opened.
    port_mtu: u32,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    port: u8,
    gid_index: u8,
    tables: Mutex<Tables>,
}

impl std::fmt::Debug for DeviceEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceEngine").field("port", &self.port).field("gid_index", &self.gid_index).finish()
    }
}

impl DeviceEngine {
    fn add_window(&self, mw: MemoryWindow) -> Result<MwId, VerbsError> {
        let mut t = lock(&self.tables);
        t.next_mw += 1;
        let id = MwId(t.next_mw);
        t.mws.insert(id, mw);
        Ok(id)
    }

    /// Opens `device`; queue pairs use `port` and GID `gid_index`.
    pub fn open(device: &str, port: u8, gid_index: u8) -> Result<Arc<Self>, VerbsError> {
        let ctx = Context::open(device)?;
        let port_mtu = ctx.active_mtu(port)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&pd, 4096)?;
        Ok(Arc::new(Self { port_mtu, pd, cq, port, gid_index, tables: Mutex::default() }))
    }

    fn qp(&self, qp: QpId) -> Result<Arc<QueuePair>, VerbsError> {
        lock(&self.tables)
            .qps
            .get(&qp)
            .cloned()
            .ok_or_else(|| VerbsError::invalid("queue pair", format!("no QP {}", qp.0)))
    }
}

fn no(what: &'static str, id: u32) -> VerbsError {
    VerbsError::invalid(what, format!("unknown handle {id}"))
}

impl DeviceEngine {
    fn create_qp_psn(&self, mtu: u32, psn: Option<u32>) -> Result<Endpoint, VerbsError> {
        let qp = QueuePair::with_psn(&self.pd, &self.cq, self.port, self.gid_index, psn)?;
        // No larger than the port runs at (1024 on a 1500-byte Ethernet
        // RoCE port, 4096 on Soft-RoCE over loopback).
        let ep = qp.endpoint(mtu.min(self.port_mtu))?;
        let mut t = lock(&self.tables);
        t.mtus.insert(QpId(ep.qpn), ep.mtu);
        t.qps.insert(QpId(ep.qpn), Arc::new(qp));
        Ok(ep)
    }
}

impl Engine for DeviceEngine {
    fn register(&self, region: Arc<dyn Region>, access: MrAccess) -> Result<MrInfo, VerbsError> {
        let mr = MemoryRegion::register(&self.pd, region, access)?;
        let mut t = lock(&self.tables);
        t.next_mr += 1;
        let id = MrId(t.next_mr);
        let info = MrInfo { id, addr: mr.addr(), rkey: mr.rkey() };
        t.mrs.insert(id, mr);
        Ok(info)
    }

    fn deregister(&self, mr: MrId) {
        lock(&self.tables).mrs.remove(&mr);
    }

    fn alloc_window(&self) -> Result<MwId, VerbsError> {
        self.add_window(MemoryWindow::new(&self.pd)?)
    }

    fn alloc_pd_window(&self) -> Result<MwId, VerbsError> {
        self.add_window(MemoryWindow::new_type1(&self.pd)?)
    }

    fn free_window(&self, mw: MwId) {
        lock(&self.tables).mws.remove(&mw);
    }

    fn create_qp(&self, mtu: u32) -> Result<Endpoint, VerbsError> {
        self.create_qp_psn(mtu, None)
    }

    fn create_qp_with_psn(&self, mtu: u32, psn: u32) -> Result<Endpoint, VerbsError> {
        self.create_qp_psn(mtu, Some(psn))
    }

    fn destroy_qp(&self, qp: QpId) {
        // The last reference goes here (no work request ever named it), and
        // with it the QP (ibv_destroy_qp in QueuePair's drop).
        let mut t = lock(&self.tables);
        t.mtus.remove(&qp);
        t.qps.remove(&qp);
    }

    fn connect(&self, qp: QpId, remote: &Endpoint) -> Result<(), VerbsError> {
        let ours = lock(&self.tables).mtus.get(&qp).copied().unwrap_or(remote.mtu);
        // Both ends use the smaller of the two offers.
        self.qp(qp)?.connect(&Endpoint { mtu: ours.min(remote.mtu), ..*remote })
    }

    fn post(&self, qp: QpId, wr_id: u64, wr: WorkRequest) -> Result<Option<u32>, VerbsError> {
        let mut t = lock(&self.tables);
        let q = t.qps.get(&qp).cloned().ok_or_else(|| no("post", qp.0))?;
        let mr = |t: &Tables, id: MrId| t.mrs.get(&id).cloned().ok_or_else(|| no("post: memory region", id.0));
        match wr {
            WorkRequest::Write { local, offset, len, remote_addr, rkey } => {
                q.post_write(wr_id, &mr(&t, local)?, offset, len, remote_addr, rkey)?
            }
            WorkRequest::Read { local, offset, len, remote_addr, rkey } => {
                q.post_read(wr_id, &mr(&t, local)?, offset, len, remote_addr, rkey)?
            }
            WorkRequest::Send { local, offset, len } => q.post_send(wr_id, &mr(&t, local)?, offset, len)?,
            WorkRequest::Recv { local, offset, len } => q.post_recv(wr_id, &mr(&t, local)?, offset, len)?,
            WorkRequest::Heartbeat => q.post_heartbeat(wr_id)?,
            WorkRequest::Bind { window, mr: m, offset, len } => {
                let region = mr(&t, m)?;
                let w = t.mws.get_mut(&window).ok_or_else(|| no("post: window", window.0))?;
                let key = q.post_bind(wr_id, w, &region, offset, len)?;
                let addr = region.addr() + offset;
                t.window_ops.insert((qp.0, wr_id), WindowOp::Bind { mw: window, addr, len });
                return Ok(Some(key));
            }
            WorkRequest::Invalidate { window } => {
                let w = t.mws.get_mut(&window).ok_or_else(|| no("post: window", window.0))?;
                q.post_invalidate(wr_id, w)?;
                t.window_ops.insert((qp.0, wr_id), WindowOp::Invalidate { mw: window });
            }
        }
        Ok(None)
    }

    fn poll(&self, max: usize) -> Result<Vec<Completion>, VerbsError> {
        let polled = self.cq.poll(max)?;
        let mut t = lock(&self.tables);
        if !t.window_ops.is_empty() {
            for c in &polled {
                // rxe: the application sets the window's new key once the
                // bind completed (`MemoryWindow::bind_completed`).
                match t.window_ops.remove(&(c.qp_num, c.wr_id)) {
                    Some(WindowOp::Bind { mw, addr, len }) => {
                        if let Some(w) = t.mws.get_mut(&mw) {
                            w.bind_completed(c.status.is_success(), addr, len);
                        }
                    }
                    Some(WindowOp::Invalidate { mw }) => {
                        if let Some(w) = t.mws.get_mut(&mw) {
                            w.invalidate_completed(c.status.is_success());
                        }
                    }
                    None => {}
                }
            }
        }
        Ok(polled)
    }

    fn to_error(&self, qp: QpId) -> Result<(), VerbsError> {
        self.qp(qp)?.to_error()
    }

    fn qp_state(&self, qp: QpId) -> Result<QpState, VerbsError> {
        self.qp(qp)?.query_state()
    }
}
