//! Mooncake's RDMA transport, over the verbs engine layer of
//! `backend-verbs` (feature `rdma`).
//!
//! The initiator half, [`RdmaTransport`], is a [`DataTransport`]: the batch
//! logic and the adapter above it are the ones the TCP transport has. Per
//! target segment it pairs [`QPS_PER_ENDPOINT`] RC queue pairs through the
//! P2P handshake's Connection exchange (see [`crate::proto::rdma`]), cuts
//! each task into [`SLICE_SIZE`] slices, posts each as one signaled WRITE
//! or READ under the key the segment's metadata gives for the device, and
//! reports the task once **every slice it posted has completed**: the
//! completion of the last one is the proof that the NIC will not touch the
//! task's memory again, so a failed slice fails the task only after the
//! others have completed or been flushed (its queue pairs are moved to ERR
//! at the first error, which flushes them). No timer reports a task: a dead
//! peer ends the slices through the transport's own retries
//! (`retry_cnt`), which is a completion too.
//!
//! One driver thread owns the queue pairs and the in-flight table, so the
//! lifecycle of a task is one explicit enum ([`Phase`]) changed in one
//! place.

mod target;

pub use target::{GrantId, Publish, RdmaTarget, RdmaTargetConfig, MAX_PEERS};

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use backend_verbs::{Endpoint, Engine, MrAccess, MrId, QpId, WcStatus, WorkRequest};
use kv_transfer_core::{MemoryKind, Region, RegionError};

use crate::client;
use crate::error::{EngineError, TaskError};
use crate::proto::rdma::{format_gid, parse_gid, MAX_QPS_PER_ENDPOINT, QPS_PER_ENDPOINT, SLICE_SIZE};
use crate::proto::{ConnectionDesc, NicPath, TcpOpcode};
use crate::transport::{DataTransport, RemoteSegment, TransportWork};

/// Options of the RDMA transport.
#[derive(Debug, Clone)]
pub struct RdmaTransportConfig {
    /// Our segment name (`host:port` of our handshake server), the first
    /// half of our NIC path; [`RdmaTransport::set_local_segment`] sets it
    /// once the engine listens ([`rdma_engine`] does).
    pub local_segment: String,
    /// The verbs device the engine was opened on (`rxe_lo`), the second half.
    pub device: String,
    /// Path MTU offered (Mooncake: min(active, 4096)).
    pub mtu: u32,
    /// Handshake (Connection exchange) timeout.
    pub handshake_timeout: Duration,
    /// Work requests posted and not yet completed, per queue pair
    /// (Mooncake's max_wr is 256).
    pub max_wr_per_qp: usize,
    /// How long a drop of the transport waits for posted slices to
    /// complete (flushed) before it parks their tasks for good.
    pub drain_on_drop: Duration,
}

impl Default for RdmaTransportConfig {
    fn default() -> Self {
        Self {
            local_segment: String::new(),
            device: String::new(),
            mtu: 4096,
            handshake_timeout: Duration::from_secs(5),
            max_wr_per_qp: 256,
            drain_on_drop: Duration::from_secs(10),
        }
    }
}

/// The task's memory as the verbs engine registers it: the range the
/// caller vouched for when it registered it with the engine
/// ([`crate::MemoryRegion`]), held registered by the task's
/// [`crate::memory::RegionGuard`] until the last slice completed.
#[derive(Debug)]
struct VouchedRange {
    addr: u64,
    len: usize,
}

impl Region for VouchedRange {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        check(offset, dst.len(), self.len)?;
        // SAFETY: in range of memory the caller vouched for (see the module
        // docs of `memory`); a software NIC copies through here.
        unsafe {
            std::ptr::copy_nonoverlapping((self.addr as usize + offset) as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        check(offset, src.len(), self.len)?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (self.addr as usize + offset) as *mut u8, src.len()) };
        Ok(())
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        NonNull::new(self.addr as usize as *mut u8)
    }
}

fn check(offset: usize, len: usize, region_len: usize) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionError::OutOfBounds { offset, len, region_len }),
    }
}

/// Where a task is. Every posted slice completes exactly once, so
/// `outstanding` reaching 0 with nothing left to post is the end.
#[derive(Debug)]
enum Phase {
    /// Slices still to post (`next` is the offset of the first), or posted
    /// and not all completed.
    Running { next: u64 },
    /// A slice failed, or the endpoint broke: nothing more is posted; the
    /// task is reported failed once the slices already posted completed.
    Failing(TaskError),
}

#[derive(Debug)]
struct Task {
    work: TransportWork,
    /// The endpoint its slices go out on.
    endpoint: u64,
    mr: MrId,
    rkey: u32,
    outstanding: usize,
    phase: Phase,
}

/// Queue pairs paired with one target segment.
#[derive(Debug)]
struct PeerEndpoint {
    segment: u64,
    qps: Vec<QpId>,
    /// Posted and not completed, per queue pair.
    posted: Vec<usize>,
    next_qp: usize,
    /// Moved to ERR (a slice failed): nothing more is posted on it.
    broken: bool,
}

#[derive(Debug, Default)]
struct Inbox {
    items: VecDeque<TransportWork>,
    forget: Vec<u64>,
    closed: bool,
}

struct Shared {
    engine: Arc<dyn Engine>,
    cfg: RdmaTransportConfig,
    /// Our segment name (known once the engine's handshake port is bound).
    local_segment: Mutex<String>,
    inbox: Mutex<Inbox>,
    wake: Condvar,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

/// Mooncake's RDMA transport, initiator side (see the module docs).
#[derive(Debug)]
pub struct RdmaTransport {
    shared: Arc<Shared>,
    driver: Mutex<Option<JoinHandle<()>>>,
}

impl RdmaTransport {
    /// Starts the driver over `engine` (which this transport polls: give it
    /// an engine of its own).
    pub fn new(engine: Arc<dyn Engine>, cfg: RdmaTransportConfig) -> std::io::Result<Self> {
        let local_segment = Mutex::new(cfg.local_segment.clone());
        let shared = Arc::new(Shared { engine, cfg, local_segment, inbox: Mutex::default(), wake: Condvar::new() });
        let sh = Arc::clone(&shared);
        let driver = std::thread::Builder::new().name("mc-rdma".into()).spawn(move || Driver::new(sh).run())?;
        Ok(Self { shared, driver: Mutex::new(Some(driver)) })
    }
}

impl RdmaTransport {
    /// Sets our segment name (the engine's, once it listens).
    pub fn set_local_segment(&self, name: &str) {
        *lock(&self.shared.local_segment) = name.to_string();
    }
}

/// The verbs engines of one Mooncake engine over RDMA: the initiator's
/// transport polls its own; the target's queue pairs and memory regions live
/// on the other (both on one device, in practice).
#[derive(Clone)]
pub struct RdmaNics {
    /// For [`RdmaTransport`].
    pub initiator: Arc<dyn Engine>,
    /// For [`RdmaTarget`].
    pub target: Arc<dyn Engine>,
}

/// A Mooncake engine that speaks RDMA both ways: our initiator over
/// [`RdmaTransport`], our target's Connection exchange and metadata through
/// [`RdmaTarget`] publishing `publish`, on the device named `device` (the
/// name peers see).
pub fn rdma_engine(
    cfg: crate::EngineConfig,
    nics: RdmaNics,
    device: &str,
    publish: Publish,
) -> Result<(crate::MooncakeEngine, Arc<RdmaTarget>), EngineError> {
    let target =
        RdmaTarget::new(nics.target, RdmaTargetConfig { device: device.into(), publish, ..Default::default() });
    let tcfg =
        RdmaTransportConfig { device: device.into(), handshake_timeout: cfg.handshake_timeout, ..Default::default() };
    let transport =
        Arc::new(RdmaTransport::new(nics.initiator, tcfg).map_err(|e| EngineError::io("start RDMA transport", e))?);
    let hook: Arc<dyn crate::TargetHook> = target.clone();
    let engine = crate::MooncakeEngine::with_transport(
        crate::EngineConfig { target_hook: Some(hook), ..cfg },
        transport.clone(),
    )?;
    transport.set_local_segment(&crate::TransferEngine::local_segment_name(&engine));
    Ok((engine, target))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        lock(&self.shared.inbox).closed = true;
        self.shared.wake.notify_all();
        if let Some(d) = lock(&self.driver).take() {
            let _ = d.join();
        }
    }
}

impl DataTransport for RdmaTransport {
    fn protocol(&self) -> &'static str {
        "rdma"
    }

    fn submit(&self, work: TransportWork) {
        let mut inbox = lock(&self.shared.inbox);
        if inbox.closed {
            drop(inbox);
            work.completion.finish(Err(TaskError::Dropped));
            return;
        }
        inbox.items.push_back(work);
        drop(inbox);
        self.shared.wake.notify_one();
    }

    fn forget_segment(&self, segment: u64) {
        lock(&self.shared.inbox).forget.push(segment);
        self.shared.wake.notify_one();
    }
}

/// How long the driver sleeps when nothing is in flight and nothing came.
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// Completions taken per poll.
const POLL_BATCH: usize = 64;

struct Driver {
    sh: Arc<Shared>,
    /// By endpoint id; a broken one stays until its flushes are polled.
    endpoints: HashMap<u64, PeerEndpoint>,
    /// The live (not broken) endpoint of each segment.
    by_segment: HashMap<u64, u64>,
    tasks: HashMap<u64, Task>,
    /// wr_id → (task, endpoint, queue pair index).
    slices: HashMap<u64, (u64, u64, usize)>,
    next_task: u64,
    next_endpoint: u64,
    next_wr: u64,
}

impl Driver {
    fn new(sh: Arc<Shared>) -> Self {
        Self {
            sh,
            endpoints: HashMap::new(),
            by_segment: HashMap::new(),
            tasks: HashMap::new(),
            slices: HashMap::new(),
            next_task: 0,
            next_endpoint: 0,
            next_wr: 0,
        }
    }

    fn run(mut self) {
        loop {
            let (items, forget, closed) = {
                let mut inbox = lock(&self.sh.inbox);
                if inbox.items.is_empty() && inbox.forget.is_empty() && !inbox.closed && self.slices.is_empty() {
                    inbox = self
                        .sh
                        .wake
                        .wait_timeout(inbox, IDLE_WAIT)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                (std::mem::take(&mut inbox.items), std::mem::take(&mut inbox.forget), inbox.closed)
            };
            for seg in forget {
                if let Some(ep) = self.by_segment.get(&seg).copied() {
                    self.break_endpoint(ep, "segment closed");
                }
            }
            for work in items {
                self.start(work);
            }
            self.post_ready();
            self.poll();
            if closed {
                self.shutdown();
                return;
            }
            if !self.slices.is_empty() {
                // Busy-polling costs a core; a yield keeps latency low
                // without spinning the CPU a software NIC also needs.
                std::thread::yield_now();
            }
        }
    }

    /// Takes a new task: checks the key, registers the memory, pairs an
    /// endpoint if the segment has none.
    fn start(&mut self, work: TransportWork) {
        work.completion.started();
        let Some(rkey) = remote_key(&work.remote, work.remote_addr, work.len) else {
            let e = TaskError::NoRemoteKey { addr: work.remote_addr, len: work.len };
            return finish(work, Err(e));
        };
        let segment = work.remote.id;
        let endpoint = match self.by_segment.get(&segment) {
            Some(ep) => *ep,
            None => match connect(&self.sh, &work.remote) {
                Ok(ep) => {
                    self.next_endpoint += 1;
                    self.endpoints.insert(self.next_endpoint, ep);
                    self.by_segment.insert(segment, self.next_endpoint);
                    self.next_endpoint
                }
                Err(e) => {
                    tracing::warn!(segment, error = %e, "RDMA connection exchange failed");
                    return finish(work, Err(TaskError::Connect(e.to_string())));
                }
            },
        };
        let range = VouchedRange { addr: work.local_addr, len: work.len as usize };
        let mr = match self.sh.engine.register(Arc::new(range), MrAccess::Local) {
            Ok(info) => info.id,
            Err(e) => return finish(work, Err(TaskError::Connect(format!("register local memory: {e}")))),
        };
        self.next_task += 1;
        let task = Task { work, endpoint, mr, rkey, outstanding: 0, phase: Phase::Running { next: 0 } };
        self.tasks.insert(self.next_task, task);
    }

    /// Posts slices while queue pairs have room, in task order.
    fn post_ready(&mut self) {
        let max = self.sh.cfg.max_wr_per_qp.max(1);
        let mut ids: Vec<u64> = self.tasks.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            while let Some(t) = self.tasks.get_mut(&id) {
                let Phase::Running { next } = t.phase else { break };
                if next >= t.work.len {
                    break;
                }
                let Some(ep) = self.endpoints.get_mut(&t.endpoint).filter(|e| !e.broken) else {
                    t.phase = Phase::Failing(TaskError::Rdma("the endpoint broke before the slice was posted".into()));
                    break;
                };
                let Some(qi) = (0..ep.qps.len()).map(|k| (ep.next_qp + k) % ep.qps.len()).find(|&q| ep.posted[q] < max)
                else {
                    break;
                };
                let len = SLICE_SIZE.min(t.work.len - next) as u32;
                let remote_addr = t.work.remote_addr + next;
                let wr = match t.work.opcode {
                    TcpOpcode::Write => {
                        WorkRequest::Write { local: t.mr, offset: next, len, remote_addr, rkey: t.rkey }
                    }
                    TcpOpcode::Read => WorkRequest::Read { local: t.mr, offset: next, len, remote_addr, rkey: t.rkey },
                };
                self.next_wr += 1;
                match self.sh.engine.post(ep.qps[qi], self.next_wr, wr) {
                    Ok(_) => {
                        ep.posted[qi] += 1;
                        ep.next_qp = (qi + 1) % ep.qps.len();
                        t.outstanding += 1;
                        t.phase = Phase::Running { next: next + u64::from(len) };
                        self.slices.insert(self.next_wr, (id, t.endpoint, qi));
                    }
                    Err(e) => {
                        t.phase = Phase::Failing(TaskError::Rdma(format!("post: {e}")));
                        let ep = t.endpoint;
                        self.break_endpoint(ep, "post failed");
                        break;
                    }
                }
            }
        }
        self.reap();
    }

    fn poll(&mut self) {
        let polled = match self.sh.engine.poll(POLL_BATCH) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "polling the completion queue failed");
                return;
            }
        };
        for c in polled {
            let Some((id, epid, qi)) = self.slices.remove(&c.wr_id) else { continue };
            if let Some(ep) = self.endpoints.get_mut(&epid) {
                ep.posted[qi] = ep.posted[qi].saturating_sub(1);
                if ep.broken && ep.posted.iter().all(|p| *p == 0) {
                    self.endpoints.remove(&epid);
                }
            }
            let Some(t) = self.tasks.get_mut(&id) else { continue };
            t.outstanding -= 1;
            if c.status != WcStatus::Success {
                if matches!(t.phase, Phase::Running { .. }) {
                    t.phase = Phase::Failing(match c.status {
                        WcStatus::RemoteAccess => TaskError::RemoteAccess,
                        s => TaskError::Rdma(format!("completed {s:?}")),
                    });
                }
                self.break_endpoint(epid, "a slice failed");
            }
        }
        self.reap();
    }

    /// Reports every task whose posted slices have all completed and that
    /// has nothing left to post (or is failing).
    fn reap(&mut self) {
        let done: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, t)| {
                t.outstanding == 0
                    && match t.phase {
                        Phase::Running { next } => next >= t.work.len,
                        Phase::Failing(_) => true,
                    }
            })
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let Some(t) = self.tasks.remove(&id) else { continue };
            self.sh.engine.deregister(t.mr);
            let result = match t.phase {
                Phase::Running { .. } => Ok(t.work.len),
                Phase::Failing(e) => Err(e),
            };
            finish(t.work, result);
        }
    }

    /// Moves the segment's queue pairs to ERR (what is posted completes
    /// flushed) and forgets the endpoint: the next task pairs anew, as a
    /// Mooncake initiator does after an error.
    fn break_endpoint(&mut self, endpoint: u64, why: &str) {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else { return };
        if !ep.broken {
            tracing::debug!(segment = ep.segment, why, "RDMA endpoint to ERR");
            ep.broken = true;
            for qp in &ep.qps {
                let _ = self.sh.engine.to_error(*qp);
            }
            if self.by_segment.get(&ep.segment) == Some(&endpoint) {
                self.by_segment.remove(&ep.segment);
            }
        }
        // A broken endpoint with slices posted stays until their flushes are
        // polled (`poll` drops it then); its QPs stay in ERR.
        if ep.posted.iter().all(|p| *p == 0) {
            self.endpoints.remove(&endpoint);
        }
        for t in self.tasks.values_mut().filter(|t| t.endpoint == endpoint) {
            if matches!(t.phase, Phase::Running { .. }) {
                t.phase = Phase::Failing(TaskError::Rdma(format!("endpoint broken: {why}")));
            }
        }
    }

    /// Closing: no more posts; what is posted is flushed and polled, for at
    /// most `drain_on_drop`. A task whose slices did not all complete in
    /// that time is parked for good: its region stays held (it cannot be
    /// unregistered) and its batch never reports it, since nothing proves
    /// the NIC is done with its memory.
    fn shutdown(&mut self) {
        let eps: Vec<u64> = self.endpoints.keys().copied().collect();
        for e in eps {
            self.break_endpoint(e, "transport dropped");
        }
        let until = Instant::now() + self.sh.cfg.drain_on_drop;
        while !self.slices.is_empty() && Instant::now() < until {
            self.poll();
            std::thread::sleep(Duration::from_millis(1));
        }
        self.reap();
        for (_, t) in self.tasks.drain() {
            tracing::error!(outstanding = t.outstanding, "RDMA task parked: its slices never completed");
            std::mem::forget(t.work);
        }
    }
}

fn finish(work: TransportWork, result: Result<u64, TaskError>) {
    let TransportWork { local, remote, completion, .. } = work;
    drop(local);
    drop(remote);
    completion.finish(result);
}

/// The key the segment's metadata gives for `[addr, addr+len)` on its
/// first device (the one our NIC path names).
fn remote_key(seg: &RemoteSegment, addr: u64, len: u64) -> Option<u32> {
    seg.desc.buffer_containing(addr, len).and_then(|b| b.rkey.first().copied())
}

/// Pairs [`QPS_PER_ENDPOINT`] queue pairs with the segment's through the
/// Connection exchange (and its ready round, if the peer has one).
fn connect(sh: &Shared, seg: &RemoteSegment) -> Result<PeerEndpoint, EngineError> {
    let device = seg
        .desc
        .devices
        .first()
        .ok_or_else(|| EngineError::ConnectionRejected(format!("segment {} has no RDMA device", seg.desc.name)))?;
    let hs: SocketAddr = client::resolve_segment(&seg.desc.name)?;
    let verbs = |e: backend_verbs::VerbsError| EngineError::Verbs(e.to_string());
    let mut ours: Vec<Endpoint> = Vec::with_capacity(QPS_PER_ENDPOINT);
    let result = (|| {
        for _ in 0..QPS_PER_ENDPOINT {
            ours.push(sh.engine.create_qp_with_psn(sh.cfg.mtu, 0).map_err(verbs)?);
        }
        let msg = ConnectionDesc {
            local_gid: format_gid(&ours[0].gid.0),
            local_lid: 0,
            local_nic_path: NicPath::new(lock(&sh.local_segment).as_str(), &sh.cfg.device).to_string(),
            payload: String::new(),
            peer_nic_path: NicPath::new(&seg.desc.name, &device.name).to_string(),
            qp_num: ours.iter().map(|e| e.qpn).collect(),
            ready_ack: Some(false),
            reply_msg: String::new(),
        };
        let reply = client::exchange_connection(hs, &msg, sh.cfg.handshake_timeout)?;
        if reply.qp_num.len() != ours.len() || reply.qp_num.len() > MAX_QPS_PER_ENDPOINT {
            return Err(EngineError::ConnectionRejected(format!(
                "{} queue pairs in the reply for our {}",
                reply.qp_num.len(),
                ours.len()
            )));
        }
        let gid = backend_verbs::Gid(parse_gid(&reply.local_gid)?);
        for (mine, theirs) in ours.iter().zip(&reply.qp_num) {
            let remote = Endpoint { qpn: *theirs, psn: 0, gid, mtu: sh.cfg.mtu };
            sh.engine.connect(QpId(mine.qpn), &remote).map_err(verbs)?;
        }
        if reply.ready_ack.is_some() {
            client::exchange_connection(
                hs,
                &ConnectionDesc { ready_ack: Some(true), ..msg },
                sh.cfg.handshake_timeout,
            )?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => {
            tracing::debug!(segment = %seg.desc.name, qps = ?ours.iter().map(|e| e.qpn).collect::<Vec<_>>(), "RDMA endpoint paired");
            Ok(PeerEndpoint {
                segment: seg.id,
                qps: ours.iter().map(|e| QpId(e.qpn)).collect(),
                posted: vec![0; ours.len()],
                next_qp: 0,
                broken: false,
            })
        }
        Err(e) => {
            // None of them carried a work request.
            for e in &ours {
                sh.engine.destroy_qp(QpId(e.qpn));
            }
            Err(e)
        }
    }
}
