//! The RDMA transport's driver thread: pairs endpoints, posts slices, polls
//! completions, reports tasks (see the parent module for what each failure
//! proves).

use kv_transfer_core::hash::HashMap;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_verbs::{Endpoint, MrAccess, MrId, QpId, WcStatus, WorkRequest};

use super::{lock, Shared, VouchedRange};
use crate::client;
use crate::error::{EngineError, TaskError};
use crate::proto::rdma::{format_gid, parse_gid, MAX_QPS_PER_ENDPOINT, QPS_PER_ENDPOINT, SLICE_SIZE};
use crate::proto::{ConnectionDesc, NicPath, TcpOpcode};
use crate::transport::{RemoteSegment, TransportWork};

/// How long the driver sleeps when nothing is in flight and nothing came.
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// Completions taken per poll.
const POLL_BATCH: usize = 64;
/// Times one task's slices may be posted again after being flushed behind
/// another slice's refusal, before the task fails. Each repost follows a
/// refusal, and a refused slice is never posted again, so reposts end by
/// themselves; a slice can sit behind many refused ones (a burst of aborted
/// requests queued ahead of it, two refusals per pairing), so the bound is
/// generous and only stops a peer that refuses without end.
const MAX_REPOSTS: u32 = 256;

/// Where a task is. Every posted slice completes exactly once, so
/// `outstanding` reaching 0 with nothing left to post is the end.
#[derive(Debug)]
enum Phase {
    /// Slices to post, or posted and not all completed.
    Running,
    /// A slice failed: nothing more is posted; the task is reported failed
    /// once the slices already posted completed.
    Failing(TaskError),
}

#[derive(Debug)]
struct Task {
    work: TransportWork,
    mr: MrId,
    /// The key its slices are posted under, for its whole life (a slice
    /// posted again keeps it).
    rkey: u32,
    /// `(offset, len)` of slices not posted (yet, or again).
    unposted: VecDeque<(u64, u32)>,
    outstanding: usize,
    reposts: u32,
    phase: Phase,
}

/// What a queue pair of an endpoint can still carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpUse {
    /// Connected: takes slices.
    Ready,
    /// The target's NIC refused a slice on it: both ends are in ERR, so
    /// what is flushed behind it was not placed.
    Refused,
    /// In ERR for another reason (or moved there by us): a flushed slice
    /// proves nothing.
    Broken,
}

#[derive(Debug)]
struct QueuePairSlot {
    qp: QpId,
    posted: usize,
    state: QpUse,
}

/// Queue pairs paired with one target segment.
#[derive(Debug)]
struct PeerEndpoint {
    segment: u64,
    qps: Vec<QueuePairSlot>,
    next_qp: usize,
}

impl PeerEndpoint {
    fn ready(&self) -> bool {
        self.qps.iter().any(|q| q.state == QpUse::Ready)
    }
    fn idle(&self) -> bool {
        self.qps.iter().all(|q| q.posted == 0)
    }
}

/// One posted slice.
#[derive(Debug, Clone, Copy)]
struct Slice {
    task: u64,
    endpoint: u64,
    qp: usize,
    offset: u64,
    len: u32,
}

pub(super) struct Driver {
    sh: Arc<Shared>,
    /// By endpoint id; one no queue pair of which is ready stays until its
    /// flushes are polled.
    endpoints: HashMap<u64, PeerEndpoint>,
    /// The endpoint new slices to a segment go out on.
    by_segment: HashMap<u64, u64>,
    tasks: HashMap<u64, Task>,
    slices: HashMap<u64, Slice>,
    next_task: u64,
    next_endpoint: u64,
    next_wr: u64,
}

impl Driver {
    pub(super) fn new(sh: Arc<Shared>) -> Self {
        Self {
            sh,
            endpoints: HashMap::default(),
            by_segment: HashMap::default(),
            tasks: HashMap::default(),
            slices: HashMap::default(),
            next_task: 0,
            next_endpoint: 0,
            next_wr: 0,
        }
    }

    pub(super) fn run(mut self) {
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

    /// Takes a new task: checks the key, registers the memory.
    fn start(&mut self, work: TransportWork) {
        work.completion.started();
        let Some(rkey) = remote_key(&work.remote, work.remote_addr, work.len) else {
            let e = TaskError::NoRemoteKey { addr: work.remote_addr, len: work.len };
            return finish(work, Err(e));
        };
        let range = VouchedRange { addr: work.local_addr, len: work.len as usize };
        let mr = match self.sh.engine.register(Arc::new(range), MrAccess::Local) {
            Ok(info) => info.id,
            Err(e) => return finish(work, Err(TaskError::Connect(format!("register local memory: {e}")))),
        };
        let mut unposted = VecDeque::new();
        let mut off = 0;
        while off < work.len {
            let len = SLICE_SIZE.min(work.len - off) as u32;
            unposted.push_back((off, len));
            off += u64::from(len);
        }
        self.next_task += 1;
        let task = Task { work, mr, rkey, unposted, outstanding: 0, reposts: 0, phase: Phase::Running };
        self.tasks.insert(self.next_task, task);
    }

    /// The endpoint new slices to `seg` go out on, paired now if it has
    /// none with a ready queue pair; `None` while its old endpoint still has
    /// slices posted: a target answers a new pairing from the same NIC path
    /// by destroying the old queue pairs (Mooncake's does), which would end
    /// those slices in errors that prove nothing.
    fn endpoint_for(&mut self, seg: &Arc<RemoteSegment>) -> Result<Option<u64>, EngineError> {
        if let Some(id) = self.by_segment.get(&seg.id).copied() {
            match self.endpoints.get(&id) {
                Some(ep) if ep.ready() => return Ok(Some(id)),
                Some(ep) if !ep.idle() => return Ok(None),
                _ => {
                    self.by_segment.remove(&seg.id);
                }
            }
        }
        let ep = connect(&self.sh, seg)?;
        self.next_endpoint += 1;
        self.endpoints.insert(self.next_endpoint, ep);
        self.by_segment.insert(seg.id, self.next_endpoint);
        Ok(Some(self.next_endpoint))
    }

    /// Posts slices while queue pairs have room, in task order.
    fn post_ready(&mut self) {
        let max = self.sh.cfg.max_wr_per_qp.max(1);
        let mut ids: Vec<u64> = self.tasks.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            while let Some(t) = self.tasks.get(&id) {
                if !matches!(t.phase, Phase::Running) || t.unposted.is_empty() {
                    break;
                }
                let remote = Arc::clone(&t.work.remote);
                let epid = match self.endpoint_for(&remote) {
                    Ok(Some(e)) => e,
                    // The old endpoint drains first.
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(segment = remote.id, error = %e, "RDMA connection exchange failed");
                        if let Some(t) = self.tasks.get_mut(&id) {
                            // Nothing goes out on a pairing that failed.
                            t.phase = Phase::Failing(if t.outstanding == 0 && t.reposts == 0 {
                                TaskError::Connect(e.to_string())
                            } else {
                                TaskError::Rdma(format!("pairing again failed: {e}"))
                            });
                        }
                        break;
                    }
                };
                let (Some(t), Some(ep)) = (self.tasks.get_mut(&id), self.endpoints.get_mut(&epid)) else { break };
                let n = ep.qps.len();
                let Some(qi) = (0..n)
                    .map(|k| (ep.next_qp + k) % n)
                    .find(|&q| ep.qps[q].state == QpUse::Ready && ep.qps[q].posted < max)
                else {
                    break;
                };
                let Some((offset, len)) = t.unposted.pop_front() else { break };
                let remote_addr = t.work.remote_addr + offset;
                let wr = match t.work.opcode {
                    TcpOpcode::Write => WorkRequest::Write { local: t.mr, offset, len, remote_addr, rkey: t.rkey },
                    TcpOpcode::Read => WorkRequest::Read { local: t.mr, offset, len, remote_addr, rkey: t.rkey },
                };
                self.next_wr += 1;
                match self.sh.engine.post(ep.qps[qi].qp, self.next_wr, wr) {
                    Ok(_) => {
                        ep.qps[qi].posted += 1;
                        ep.next_qp = (qi + 1) % n;
                        t.outstanding += 1;
                        let s = Slice { task: id, endpoint: epid, qp: qi, offset, len };
                        self.slices.insert(self.next_wr, s);
                    }
                    Err(e) => {
                        t.unposted.push_front((offset, len));
                        t.phase = Phase::Failing(TaskError::Rdma(format!("post: {e}")));
                        self.break_endpoint(epid, "post failed");
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
            let Some(s) = self.slices.remove(&c.wr_id) else { continue };
            let qp_was = self.endpoints.get_mut(&s.endpoint).map(|ep| {
                let q = &mut ep.qps[s.qp];
                q.posted = q.posted.saturating_sub(1);
                q.state
            });
            if let Some(t) = self.tasks.get_mut(&s.task) {
                t.outstanding -= 1;
            }
            match (c.status, qp_was) {
                (WcStatus::Success, _) => {}
                (WcStatus::RemoteAccess, _) => {
                    self.sh.refused_slices.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if let Some(ep) = self.endpoints.get_mut(&s.endpoint) {
                        tracing::debug!(
                            segment = ep.segment,
                            "the target's NIC refused a slice: its queue pair is done"
                        );
                        ep.qps[s.qp].state = QpUse::Refused;
                    }
                    self.fail(s.task, TaskError::RemoteAccess);
                }
                (WcStatus::Flushed, Some(QpUse::Refused)) => self.repost(s),
                _ => {
                    self.fail(s.task, TaskError::Rdma(format!("completed {:?}", c.status)));
                    self.break_endpoint(s.endpoint, "a slice failed");
                }
            }
            self.drop_if_done(s.endpoint);
        }
        self.reap();
    }

    /// A slice flushed behind another's refusal on its queue pair: it was
    /// not placed, so it goes out again on the next pairing, under its own
    /// key (a refused key stays refused; a valid one lands where meant).
    fn repost(&mut self, s: Slice) {
        let Some(t) = self.tasks.get_mut(&s.task) else { return };
        if !matches!(t.phase, Phase::Running) {
            return;
        }
        if t.reposts >= MAX_REPOSTS {
            t.phase = Phase::Failing(TaskError::RemoteAccess);
            return;
        }
        t.reposts += 1;
        t.unposted.push_front((s.offset, s.len));
    }

    fn fail(&mut self, task: u64, e: TaskError) {
        if let Some(t) = self.tasks.get_mut(&task) {
            if matches!(t.phase, Phase::Running) {
                t.phase = Phase::Failing(e);
            }
        }
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
                        Phase::Running => t.unposted.is_empty(),
                        Phase::Failing(_) => true,
                    }
            })
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let Some(t) = self.tasks.remove(&id) else { continue };
            self.sh.engine.deregister(t.mr);
            let result = match t.phase {
                Phase::Running => Ok(t.work.len),
                Phase::Failing(e) => Err(e),
            };
            finish(t.work, result);
        }
    }

    /// Moves the endpoint's queue pairs to ERR (what is posted completes
    /// flushed, proving nothing) and fails the tasks with slices on it; the
    /// next slice to its segment pairs anew, as a Mooncake initiator does
    /// after an error.
    fn break_endpoint(&mut self, endpoint: u64, why: &str) {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else { return };
        tracing::debug!(segment = ep.segment, why, "RDMA endpoint to ERR");
        for q in &mut ep.qps {
            if q.state != QpUse::Broken {
                let _ = self.sh.engine.to_error(q.qp);
                q.state = QpUse::Broken;
            }
        }
        let busy: Vec<u64> = self.slices.values().filter(|s| s.endpoint == endpoint).map(|s| s.task).collect();
        for task in busy {
            self.fail(task, TaskError::Rdma(format!("endpoint broken: {why}")));
        }
        self.drop_if_done(endpoint);
    }

    /// Forgets an endpoint no queue pair of which is ready once nothing is
    /// posted on it any more.
    fn drop_if_done(&mut self, endpoint: u64) {
        let Some(ep) = self.endpoints.get(&endpoint) else { return };
        if !ep.ready() && ep.idle() {
            if self.by_segment.get(&ep.segment) == Some(&endpoint) {
                self.by_segment.remove(&ep.segment);
            }
            self.endpoints.remove(&endpoint);
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
        for t in self.tasks.values_mut() {
            if matches!(t.phase, Phase::Running) {
                t.phase = Phase::Failing(TaskError::Dropped);
            }
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
                qps: ours.iter().map(|e| QueuePairSlot { qp: QpId(e.qpn), posted: 0, state: QpUse::Ready }).collect(),
                next_qp: 0,
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
