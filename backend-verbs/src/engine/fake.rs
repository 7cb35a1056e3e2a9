//! A software NIC that behaves as badly as hardware does, so the adapter's
//! settlement logic runs on any host (no device, no root): [`FakeFabric`]
//! connects the NICs it hands out and executes their work requests on real
//! memory, with the rules the verbs tests prove on Soft-RoCE:
//!
//! - A WRITE or READ lands only through a key that grants it: a region
//!   registered with remote access, or a window bound over that range
//!   *through the queue pair the request arrives on* (type 2B). Anything
//!   else is `REM_ACCESS_ERR` at the initiator, memory unchanged, and both
//!   ends of the queue pair go to ERR (RC).
//! - A queue pair in ERR completes everything posted on it flushed (RECVs
//!   too), in order, and anything posted later at once, flushed.
//! - Completions come in each queue pair's order but interleaved across
//!   queue pairs by a seeded generator (hardware gives no order across
//!   them).
//! - A SEND waits at the head of its queue until the peer has a RECV posted
//!   (RNR retry, forever); a SEND larger than the RECV buffer fails both
//!   ends.
//! - Test hooks: [`FakeFabric::hold`] keeps a queue pair's requests
//!   posted and not executed (a WRITE that stays in flight past its abort),
//!   [`FakeFabric::release`] lets them go, [`FakeFabric::break_link`] puts
//!   both ends in ERR with requests posted (a link or port failure: what an
//!   async event reports).
//!
//! Work runs inside the engine calls (`post`, `poll`, `release`), under one
//! lock: no threads of its own.
//!
//! ```
//! use backend_verbs::{FakeFabric, VerbsConfig, VerbsTransfer};
//! let fabric = FakeFabric::new(7);
//! let decode = VerbsTransfer::with_engine(VerbsConfig::new("decode", "fake", 1), fabric.nic()).unwrap();
//! let prefill = VerbsTransfer::with_engine(VerbsConfig::new("prefill", "fake", 1), fabric.nic()).unwrap();
//! prefill.add_peer(decode.descriptor()).unwrap();
//! assert_eq!(fabric.queue_pairs().len(), 2);
//! ```

use kv_transfer_core::hash::{HashMap, HashSet};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use kv_transfer_core::Region;

use super::Engine;
use crate::error::VerbsError;
use crate::work::{
    Completion, Endpoint, Gid, MrAccess, MrId, MrInfo, MwId, QpId, QpState, WcKind, WcStatus, WorkRequest,
};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `ibv_wc_status` values the fake reports beyond the named ones.
const WC_LOC_LEN_ERR: u32 = 1;
const WC_REM_INV_REQ_ERR: u32 = 9;
const WC_RETRY_EXC_ERR: u32 = 12;

/// What the fabric did, in all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FakeStats {
    /// WRITEs that changed target memory.
    pub writes_placed: u64,
    /// Accesses refused for their key (`REM_ACCESS_ERR`).
    pub rejected_access: u64,
    /// Requests completed flushed.
    pub flushed: u64,
}

struct Mr {
    region: Arc<dyn Region>,
    access: MrAccess,
    rkey: u32,
}

/// A window's grant once its bind executed.
#[derive(Clone)]
struct Grant {
    region: Arc<dyn Region>,
    /// Absolute address of the first byte granted.
    addr: u64,
    len: u64,
    /// The queue pair (target side) it works through.
    qp: u32,
}

#[derive(Default)]
struct Mw {
    rkey: u32,
    /// Type 1: its grant works through every queue pair of its NIC.
    pd_wide: bool,
    /// A bind or invalidation is posted and not executed.
    pending: bool,
    grant: Option<Grant>,
}

#[derive(Default)]
struct Nic {
    mrs: HashMap<MrId, Mr>,
    mws: HashMap<MwId, Mw>,
    next_mr: u32,
    next_mw: u32,
    /// Completions by queue pair, each in its order.
    cq: HashMap<u32, VecDeque<Completion>>,
}

/// A posted request, its local memory resolved (so a deregistration after
/// the post does not pull it from under the request).
struct Queued {
    wr_id: u64,
    wr: WorkRequest,
    local: Option<Arc<dyn Region>>,
    /// A bind's key.
    key: u32,
}

struct Recv {
    wr_id: u64,
    region: Arc<dyn Region>,
    offset: u64,
    len: u32,
}

struct Qp {
    nic: usize,
    state: QpState,
    remote: Option<u32>,
    sq: VecDeque<Queued>,
    rq: VecDeque<Recv>,
}

#[derive(Default)]
struct Fabric {
    nics: Vec<Nic>,
    qps: HashMap<u32, Qp>,
    held: HashSet<u32>,
    next_qpn: u32,
    next_key: u32,
    rng: u64,
    stats: FakeStats,
}

/// Several fake NICs on one fabric (see the [module docs](self)).
#[derive(Clone)]
pub struct FakeFabric {
    inner: Arc<Mutex<Fabric>>,
}

impl std::fmt::Debug for FakeFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeFabric").field("stats", &self.stats()).finish()
    }
}

/// One NIC of a [`FakeFabric`].
#[derive(Clone)]
pub struct FakeNic {
    fabric: FakeFabric,
    nic: usize,
}

impl FakeFabric {
    /// An empty fabric; `seed` fixes the interleaving of completions.
    pub fn new(seed: u64) -> Self {
        let f = Fabric { next_qpn: 0x100, next_key: 0x1000, rng: seed | 1, ..Fabric::default() };
        Self { inner: Arc::new(Mutex::new(f)) }
    }

    /// A new NIC on this fabric.
    pub fn nic(&self) -> Arc<dyn Engine> {
        Arc::new(self.fake_nic())
    }

    /// A new NIC on this fabric, as its own type.
    pub fn fake_nic(&self) -> FakeNic {
        let mut f = lock(&self.inner);
        f.nics.push(Nic::default());
        FakeNic { fabric: self.clone(), nic: f.nics.len() - 1 }
    }

    /// Every queue pair: `(qpn, its NIC, the qpn it is connected to)`.
    pub fn queue_pairs(&self) -> Vec<(u32, usize, Option<u32>)> {
        let f = lock(&self.inner);
        let mut v: Vec<_> = f.qps.iter().map(|(n, q)| (*n, q.nic, q.remote)).collect();
        v.sort_unstable();
        v
    }

    /// Holds `qpn`'s send queue: what is posted on it stays posted.
    pub fn hold(&self, qpn: u32) {
        lock(&self.inner).held.insert(qpn);
    }

    /// Lets `qpn`'s send queue run again.
    pub fn release(&self, qpn: u32) {
        let mut f = lock(&self.inner);
        f.held.remove(&qpn);
        f.run();
    }

    /// Both ends of `qpn`'s connection to ERR, with what is posted flushed.
    pub fn break_link(&self, qpn: u32) {
        let mut f = lock(&self.inner);
        let remote = f.qps.get(&qpn).and_then(|q| q.remote);
        f.error(qpn);
        if let Some(r) = remote {
            f.error(r);
        }
    }

    /// What the fabric did so far.
    pub fn stats(&self) -> FakeStats {
        lock(&self.inner).stats
    }

    /// Requests posted on `qpn` and not executed yet.
    pub fn posted(&self, qpn: u32) -> usize {
        lock(&self.inner).qps.get(&qpn).map_or(0, |q| q.sq.len())
    }

    /// Requests posted on `qpn` and not executed yet, heartbeats left out:
    /// one falls due every `heartbeat` on a live peer, so on a slow host a
    /// probe can queue behind a held send queue at any point of a test.
    pub fn posted_transfers(&self, qpn: u32) -> usize {
        lock(&self.inner)
            .qps
            .get(&qpn)
            .map_or(0, |q| q.sq.iter().filter(|w| !matches!(w.wr, WorkRequest::Heartbeat)).count())
    }
}

impl FakeNic {
    /// Its index on the fabric.
    pub fn id(&self) -> usize {
        self.nic
    }
}

fn bad(op: &'static str, why: impl Into<String>) -> VerbsError {
    VerbsError::invalid(op, why)
}

impl Fabric {
    fn next_rand(&mut self) -> u64 {
        // xorshift64: enough to shuffle completions.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    fn complete(&mut self, qpn: u32, wr_id: u64, status: WcStatus, kind: WcKind, byte_len: u32) {
        let Some(nic) = self.qps.get(&qpn).map(|q| q.nic) else { return };
        if status == WcStatus::Flushed {
            self.stats.flushed += 1;
        }
        let kind = if status.is_success() { kind } else { WcKind::Unknown };
        let c = Completion { wr_id, qp_num: qpn, status, kind, byte_len };
        self.nics[nic].cq.entry(qpn).or_default().push_back(c);
    }

    /// `qpn` to ERR: everything posted completes flushed, in order.
    fn error(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else { return };
        q.state = QpState::Error;
        let nic = q.nic;
        let sq: Vec<Queued> = q.sq.drain(..).collect();
        let rq: Vec<u64> = q.rq.drain(..).map(|r| r.wr_id).collect();
        for w in sq {
            // A window operation that never ran leaves the window as it was.
            if let WorkRequest::Bind { window, .. } | WorkRequest::Invalidate { window } = w.wr {
                if let Some(mw) = self.nics[nic].mws.get_mut(&window) {
                    mw.pending = false;
                }
            }
            self.complete(qpn, w.wr_id, WcStatus::Flushed, WcKind::Unknown, 0);
        }
        for id in rq {
            self.complete(qpn, id, WcStatus::Flushed, WcKind::Unknown, 0);
        }
    }

    /// Both ends of `qpn`'s connection to ERR.
    fn error_both(&mut self, qpn: u32) {
        let remote = self.qps.get(&qpn).and_then(|q| q.remote);
        self.error(qpn);
        if let Some(r) = remote {
            self.error(r);
        }
    }

    /// The target memory `rkey` grants for `len` bytes at `addr`, arriving
    /// on the target's queue pair `qpn`.
    fn grant(&self, nic: usize, qpn: u32, rkey: u32, addr: u64, len: u64) -> Option<(Arc<dyn Region>, usize)> {
        let n = &self.nics[nic];
        let within = |start: u64, size: u64| addr >= start && addr.checked_add(len).is_some_and(|e| e <= start + size);
        for mr in n.mrs.values() {
            let r = &mr.region;
            if mr.rkey == rkey && mr.access == MrAccess::RemoteWriteRead && within(r.addr(), r.len() as u64) {
                return Some((Arc::clone(r), (addr - r.addr()) as usize));
            }
        }
        for mw in n.mws.values() {
            match &mw.grant {
                Some(g) if mw.rkey == rkey && (g.qp == qpn || mw.pd_wide) && within(g.addr, g.len) => {
                    return Some((Arc::clone(&g.region), (addr - g.region.addr()) as usize));
                }
                _ => {}
            }
        }
        None
    }

    /// Runs every queue pair that is not held, until nothing moves.
    fn run(&mut self) {
        // Bounded: each pass executes at least one request or stops.
        for _ in 0..1_000_000 {
            let mut moved = false;
            let mut qpns: Vec<u32> = self.qps.keys().copied().collect();
            qpns.sort_unstable();
            for qpn in qpns {
                if !self.held.contains(&qpn) {
                    moved |= self.step(qpn);
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Executes the head of `qpn`'s send queue; whether it did.
    fn step(&mut self, qpn: u32) -> bool {
        let Some(q) = self.qps.get(&qpn) else { return false };
        if q.state != QpState::ReadyToSend {
            return false;
        }
        let Some(head) = q.sq.front() else { return false };
        let (nic, remote) = (q.nic, q.remote);
        let (wr_id, wr, key) = (head.wr_id, head.wr, head.key);
        let local = head.local.clone();
        let peer = remote.filter(|r| self.qps.get(r).is_some_and(|p| p.state == QpState::ReadyToSend));
        let pop = |f: &mut Fabric| {
            if let Some(q) = f.qps.get_mut(&qpn) {
                q.sq.pop_front();
            }
        };
        match wr {
            WorkRequest::Bind { window, offset, len, .. } => {
                pop(self);
                if let (Some(mw), Some(region)) = (self.nics[nic].mws.get_mut(&window), local) {
                    let addr = region.addr() + offset;
                    mw.rkey = key;
                    mw.pending = false;
                    mw.grant = Some(Grant { region, addr, len: u64::from(len), qp: qpn });
                }
                self.complete(qpn, wr_id, WcStatus::Success, WcKind::Bind, 0);
            }
            WorkRequest::Invalidate { window } => {
                pop(self);
                if let Some(mw) = self.nics[nic].mws.get_mut(&window) {
                    mw.grant = None;
                    mw.pending = false;
                }
                self.complete(qpn, wr_id, WcStatus::Success, WcKind::LocalInv, 0);
            }
            _ if peer.is_none() => {
                // The peer is gone: the transport's retries run out.
                pop(self);
                self.complete(qpn, wr_id, WcStatus::Other(WC_RETRY_EXC_ERR), WcKind::Unknown, 0);
                self.error(qpn);
            }
            WorkRequest::Heartbeat => {
                pop(self);
                self.complete(qpn, wr_id, WcStatus::Success, WcKind::Write, 0);
            }
            WorkRequest::Write { offset, len, remote_addr, rkey, .. }
            | WorkRequest::Read { offset, len, remote_addr, rkey, .. } => {
                pop(self);
                let r = peer.unwrap_or_default();
                let rnic = self.qps[&r].nic;
                let write = matches!(wr, WorkRequest::Write { .. });
                let Some((target, at)) = self.grant(rnic, r, rkey, remote_addr, u64::from(len)) else {
                    self.stats.rejected_access += 1;
                    self.complete(qpn, wr_id, WcStatus::RemoteAccess, WcKind::Unknown, 0);
                    self.error_both(qpn);
                    return true;
                };
                let mut buf = vec![0u8; len as usize];
                let local = local.unwrap_or_else(|| Arc::clone(&target));
                let copied = if write {
                    local.read(offset as usize, &mut buf).and_then(|()| target.write(at, &buf))
                } else {
                    target.read(at, &mut buf).and_then(|()| local.write(offset as usize, &buf))
                };
                if copied.is_err() {
                    self.complete(qpn, wr_id, WcStatus::Other(WC_REM_INV_REQ_ERR), WcKind::Unknown, 0);
                    self.error_both(qpn);
                    return true;
                }
                if write {
                    self.stats.writes_placed += 1;
                }
                let kind = if write { WcKind::Write } else { WcKind::Read };
                self.complete(qpn, wr_id, WcStatus::Success, kind, len);
            }
            WorkRequest::Send { offset, len, .. } => {
                let r = peer.unwrap_or_default();
                let Some(recv) = self.qps.get_mut(&r).and_then(|p| p.rq.pop_front()) else {
                    // RNR: waits for a RECV.
                    return false;
                };
                pop(self);
                if len > recv.len {
                    self.complete(r, recv.wr_id, WcStatus::Other(WC_LOC_LEN_ERR), WcKind::Unknown, 0);
                    self.complete(qpn, wr_id, WcStatus::Other(WC_REM_INV_REQ_ERR), WcKind::Unknown, 0);
                    self.error_both(qpn);
                    return true;
                }
                let mut buf = vec![0u8; len as usize];
                let ok = local
                    .map(|l| {
                        l.read(offset as usize, &mut buf).and_then(|()| recv.region.write(recv.offset as usize, &buf))
                    })
                    .is_some_and(|r| r.is_ok());
                if !ok {
                    self.complete(r, recv.wr_id, WcStatus::Other(WC_LOC_LEN_ERR), WcKind::Unknown, 0);
                    self.complete(qpn, wr_id, WcStatus::Other(WC_REM_INV_REQ_ERR), WcKind::Unknown, 0);
                    self.error_both(qpn);
                    return true;
                }
                self.complete(r, recv.wr_id, WcStatus::Success, WcKind::Recv, len);
                self.complete(qpn, wr_id, WcStatus::Success, WcKind::Send, 0);
            }
            WorkRequest::Recv { .. } => {
                // Never on the send queue.
                pop(self);
            }
        }
        true
    }
}

impl FakeNic {
    fn with<R>(&self, f: impl FnOnce(&mut Fabric, usize) -> R) -> R {
        let mut fab = lock(&self.fabric.inner);
        f(&mut fab, self.nic)
    }

    fn new_window(&self, pd_wide: bool) -> Result<MwId, VerbsError> {
        self.with(|f, nic| {
            f.next_key += 0x100;
            let rkey = f.next_key;
            let n = &mut f.nics[nic];
            n.next_mw += 1;
            let id = MwId(n.next_mw);
            n.mws.insert(id, Mw { rkey, pd_wide, ..Mw::default() });
            Ok(id)
        })
    }
}

fn local_region(n: &Nic, op: &'static str, mr: MrId, offset: u64, len: u32) -> Result<Arc<dyn Region>, VerbsError> {
    let m = n.mrs.get(&mr).ok_or_else(|| bad(op, format!("unknown memory region {}", mr.0)))?;
    if offset.checked_add(u64::from(len)).is_none_or(|e| e > m.region.len() as u64) {
        return Err(bad(op, format!("{offset}+{len} is past the region's {} bytes", m.region.len())));
    }
    Ok(Arc::clone(&m.region))
}

impl Engine for FakeNic {
    fn register(&self, region: Arc<dyn Region>, access: MrAccess) -> Result<MrInfo, VerbsError> {
        if region.is_empty() {
            return Err(bad("ibv_reg_mr", "an empty region"));
        }
        self.with(|f, nic| {
            f.next_key += 0x100;
            let rkey = f.next_key;
            let n = &mut f.nics[nic];
            n.next_mr += 1;
            let id = MrId(n.next_mr);
            let addr = region.addr();
            n.mrs.insert(id, Mr { region, access, rkey });
            Ok(MrInfo { id, addr, rkey })
        })
    }

    fn deregister(&self, mr: MrId) {
        self.with(|f, nic| f.nics[nic].mrs.remove(&mr));
    }

    fn alloc_window(&self) -> Result<MwId, VerbsError> {
        self.new_window(false)
    }

    fn alloc_pd_window(&self) -> Result<MwId, VerbsError> {
        self.new_window(true)
    }

    fn free_window(&self, mw: MwId) {
        self.with(|f, nic| f.nics[nic].mws.remove(&mw));
    }

    fn create_qp_with_psn(&self, mtu: u32, psn: u32) -> Result<Endpoint, VerbsError> {
        // The fake delivers in order without sequence numbers; the PSN is
        // only reported.
        Ok(Endpoint { psn: psn & 0x00ff_ffff, ..self.create_qp(mtu)? })
    }

    fn create_qp(&self, mtu: u32) -> Result<Endpoint, VerbsError> {
        self.with(|f, nic| {
            f.next_qpn += 1;
            let qpn = f.next_qpn;
            f.qps
                .insert(qpn, Qp { nic, state: QpState::Reset, remote: None, sq: VecDeque::new(), rq: VecDeque::new() });
            let mut gid = [0u8; 16];
            gid[15] = nic as u8;
            Ok(Endpoint { qpn, psn: qpn & 0x00ff_ffff, gid: Gid(gid), mtu })
        })
    }

    fn destroy_qp(&self, qp: QpId) {
        self.with(|f, nic| {
            if f.qps.get(&qp.0).is_some_and(|q| q.nic == nic) {
                f.qps.remove(&qp.0);
            }
        });
    }

    fn connect(&self, qp: QpId, remote: &Endpoint) -> Result<(), VerbsError> {
        self.with(|f, nic| {
            let q = f.qps.get_mut(&qp.0).filter(|q| q.nic == nic).ok_or_else(|| bad("connect", "no such QP"))?;
            if q.state != QpState::Reset {
                return Err(bad("connect", format!("the QP is in {:?}, not Reset", q.state)));
            }
            q.remote = Some(remote.qpn);
            q.state = QpState::ReadyToSend;
            f.run();
            Ok(())
        })
    }

    fn post(&self, qp: QpId, wr_id: u64, wr: WorkRequest) -> Result<Option<u32>, VerbsError> {
        self.with(|f, nic| {
            let state =
                f.qps.get(&qp.0).filter(|q| q.nic == nic).map(|q| q.state).ok_or_else(|| bad("post", "no such QP"))?;
            let n = &f.nics[nic];
            let (local, key) = match wr {
                WorkRequest::Write { local, offset, len, .. } | WorkRequest::Read { local, offset, len, .. } => {
                    (Some(local_region(n, "post", local, offset, len)?), 0)
                }
                WorkRequest::Send { local, offset, len } | WorkRequest::Recv { local, offset, len } => {
                    (Some(local_region(n, "post", local, offset, len)?), 0)
                }
                WorkRequest::Heartbeat | WorkRequest::Invalidate { .. } => (None, 0),
                WorkRequest::Bind { window, mr, offset, len } => {
                    let region = local_region(n, "post BIND_MW", mr, offset, len)?;
                    let mw = n.mws.get(&window).ok_or_else(|| bad("post BIND_MW", "unknown window"))?;
                    if mw.pending || mw.grant.is_some() {
                        return Err(bad("post BIND_MW", "the window is not unbound"));
                    }
                    // The key's low 8 bits (the consumer's part) move on.
                    (Some(region), (mw.rkey & 0xffff_ff00) | (mw.rkey.wrapping_add(1) & 0xff))
                }
            };
            if let WorkRequest::Invalidate { window } = wr {
                let mw = n.mws.get(&window).ok_or_else(|| bad("post LOCAL_INV", "unknown window"))?;
                if mw.pending || mw.grant.is_none() {
                    return Err(bad("post LOCAL_INV", "the window is not bound"));
                }
            }
            if state == QpState::Error {
                // Posted on a QP in ERR: flushed at once.
                f.complete(qp.0, wr_id, WcStatus::Flushed, WcKind::Unknown, 0);
                return Ok((key != 0).then_some(key));
            }
            if let WorkRequest::Bind { window, .. } | WorkRequest::Invalidate { window } = wr {
                if let Some(mw) = f.nics[nic].mws.get_mut(&window) {
                    mw.pending = true;
                }
            }
            let q = f.qps.get_mut(&qp.0).ok_or_else(|| bad("post", "no such QP"))?;
            match (wr, local) {
                (WorkRequest::Recv { offset, len, .. }, Some(region)) => {
                    q.rq.push_back(Recv { wr_id, region, offset, len })
                }
                (_, local) if state == QpState::ReadyToSend => q.sq.push_back(Queued { wr_id, wr, local, key }),
                _ => return Err(bad("post", format!("the QP is in {state:?}"))),
            }
            f.run();
            Ok((key != 0).then_some(key))
        })
    }

    fn poll(&self, max: usize) -> Result<Vec<Completion>, VerbsError> {
        self.with(|f, nic| {
            f.run();
            let mut out = Vec::new();
            while out.len() < max {
                let mut ready: Vec<u32> =
                    f.nics[nic].cq.iter().filter(|(_, q)| !q.is_empty()).map(|(n, _)| *n).collect();
                if ready.is_empty() {
                    break;
                }
                ready.sort_unstable();
                let pick = ready[(f.next_rand() % ready.len() as u64) as usize];
                if let Some(c) = f.nics[nic].cq.get_mut(&pick).and_then(VecDeque::pop_front) {
                    out.push(c);
                }
            }
            Ok(out)
        })
    }

    fn to_error(&self, qp: QpId) -> Result<(), VerbsError> {
        self.with(|f, nic| {
            if f.qps.get(&qp.0).is_none_or(|q| q.nic != nic) {
                return Err(bad("modify_qp ERR", "no such QP"));
            }
            f.error(qp.0);
            Ok(())
        })
    }

    fn qp_state(&self, qp: QpId) -> Result<QpState, VerbsError> {
        self.with(|f, nic| {
            f.qps.get(&qp.0).filter(|q| q.nic == nic).map(|q| q.state).ok_or_else(|| bad("ibv_query_qp", "no such QP"))
        })
    }
}
