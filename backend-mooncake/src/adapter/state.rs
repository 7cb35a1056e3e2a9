//! The adapter's shared state: what the posting threads, the control
//! thread (the drain driver's executor), the operations' waiters and the
//! senders all reach through one `Arc<Inner>`.

use super::*;
use std::collections::VecDeque;

#[derive(Debug)]
pub(super) struct PeerInfo {
    /// Shared with the abort tracker's entries (a post clones no string).
    pub(super) name: Arc<str>,
    pub(super) segment: SegmentId,
    pub(super) proto: ProtoVersion,
}

#[derive(Debug, Default)]
pub(super) struct Peers {
    pub(super) by_id: HashMap<PeerId, PeerInfo>,
    pub(super) by_name: HashMap<Arc<str>, PeerId>,
    pub(super) next: u32,
}

pub(super) struct PoolEntry {
    pub(super) authority: SettlementAuthority,
    pub(super) region: Arc<dyn Region>,
}

/// Initiator side: core's abort tracker, keyed by the target's segment
/// name, and the control messages waiting to be sent (one retry policy).
pub(super) struct Inflight {
    pub(super) tracker: AbortTracker<Arc<str>>,
    pub(super) outbox: Outbox<Arc<str>>,
    pub(super) next: u64,
}

pub(super) struct Job {
    pub(super) id: u64,
    pub(super) batch: BatchId,
    pub(super) tasks: Range<usize>,
    pub(super) completer: Completer,
    /// The DONE to send after the data (boxed: a job without one stays
    /// small, and moves through the queues without copying a message it
    /// does not carry; with one, one allocation replaces those copies).
    pub(super) notify: Option<Box<Notify>>,
    /// The exposure carried a key per tenancy: a refusal by the target's
    /// NIC then means the tenancy's key ended (a stale generation).
    pub(super) keyed: bool,
}

/// A DONE due after an operation's data.
pub(super) struct Notify {
    /// The target's segment.
    pub(super) seg: SegmentId,
    /// Its name (the abort tracker's key for it).
    pub(super) endpoint: Arc<str>,
    pub(super) msg: ControlMessage,
    /// Whether to digest the local slots into the message.
    pub(super) digests: bool,
}

/// What a waiter thread is handed.
pub(super) enum Work {
    /// An operation to wait for, task by task (an engine without
    /// completion hooks, [`TransferEngine::batch_hooks`]).
    Wait(Job),
    /// An operation whose tasks all finished (the engine's hook saw them
    /// and freed the batch), with a DONE to send: a send may block for the
    /// engine's handshake timeout, so never on the engine's thread.
    Notify(Job, Ending),
}

impl Work {
    pub(super) fn into_job(self) -> Job {
        match self {
            Work::Wait(job) | Work::Notify(job, _) => job,
        }
    }
}

/// How an operation's tasks ended, gathered task by task.
#[derive(Debug, Default)]
pub(super) struct Ending {
    /// A task ran under protocol v1: its COMPLETED proves nothing about the
    /// target's memory.
    pub(super) v1: bool,
    /// A task FAILED mid-connection or for an unknown reason: it may have
    /// left bytes in the target's socket that the target still applies.
    pub(super) uncertain: bool,
    /// The first failure.
    pub(super) failure: Option<TransferError>,
}

impl Ending {
    /// Adds a finished task's status (`keyed`: the exposure carried a key
    /// per tenancy).
    pub(super) fn add(&mut self, st: &TaskStatus, keyed: bool) {
        self.v1 |= st.proto == ProtoVersion::V1;
        if st.status == TransferStatus::Failed {
            self.uncertain |= !matches!(
                st.error,
                Some(TaskError::AddrRejected)
                    | Some(TaskError::Connect(_))
                    | Some(TaskError::Dropped)
                    | Some(TaskError::NoRemoteKey { .. })
                    | Some(TaskError::RemoteAccess)
            );
            if self.failure.is_none() {
                self.failure = Some(map_task_error(&st.error, keyed));
            }
        }
    }

    /// What the operation's end proves about the target's memory: nothing
    /// if a task ran under v1 or failed mid-connection (then no ABORT_ACK
    /// ever names its tenancies).
    pub(super) fn proof(&self) -> OpEnd {
        if self.v1 || self.uncertain {
            OpEnd::Unproven
        } else {
            OpEnd::Proven
        }
    }
}

/// `keyed`: the exposure carried a key per tenancy.
fn map_task_error(e: &Option<TaskError>, keyed: bool) -> TransferError {
    match e {
        // The target's NIC refused a key of the tenancy's own: it ended.
        Some(TaskError::RemoteAccess) if keyed => TransferError::Rejected(RejectReason::StaleGeneration),
        Some(TaskError::AddrRejected) | Some(TaskError::NoRemoteKey { .. }) | Some(TaskError::RemoteAccess) => {
            TransferError::Rejected(RejectReason::OutOfBounds)
        }
        Some(TaskError::Connect(m)) | Some(TaskError::Connection(m)) | Some(TaskError::Rdma(m)) => {
            TransferError::Transport(m.clone())
        }
        Some(other) => TransferError::Engine {
            engine: "mooncake",
            code: TransferStatus::Failed as i64,
            message: other.to_string(),
        },
        None => TransferError::Engine {
            engine: "mooncake",
            code: TransferStatus::Failed as i64,
            message: "task FAILED".into(),
        },
    }
}

/// One waiter thread's jobs: a post hands its operation over here (a lock,
/// a push, a wake-up only when the thread may be asleep: cheaper than a
/// channel), and the thread takes them in order.
#[derive(Default)]
pub(super) struct JobQueue {
    state: Mutex<JobQueueState>,
    cv: Condvar,
}

#[derive(Default)]
struct JobQueueState {
    jobs: VecDeque<Work>,
    /// The thread has left (shutdown): nothing queued from now on runs.
    closed: bool,
    /// The thread is waiting for a job.
    sleeping: bool,
}

impl JobQueue {
    /// Queues `job`; gives it back if the thread has left.
    pub(super) fn push(&self, job: Work) -> Option<Work> {
        let mut s = lock(&self.state);
        if s.closed {
            return Some(job);
        }
        s.jobs.push_back(job);
        let wake = s.sleeping;
        drop(s);
        if wake {
            self.cv.notify_one();
        }
        None
    }

    /// The next job, waiting up to `wait` for one.
    pub(super) fn pop(&self, wait: Duration) -> Option<Work> {
        let mut s = lock(&self.state);
        if s.jobs.is_empty() {
            s.sleeping = true;
            s = self
                .cv
                .wait_timeout_while(s, wait, |s| s.jobs.is_empty())
                .map(|r| r.0)
                .unwrap_or_else(|e| e.into_inner().0);
            s.sleeping = false;
        }
        s.jobs.pop_front()
    }

    /// The thread leaves: later pushes are refused, and what is queued is
    /// handed back (to be abandoned: quarantined, never released).
    pub(super) fn close(&self) -> Vec<Work> {
        let mut s = lock(&self.state);
        s.closed = true;
        s.jobs.drain(..).collect()
    }
}

pub(super) struct Inner {
    pub(super) engine: Arc<dyn TransferEngine>,
    /// The framing our own descriptor advertises: what every initiator uses
    /// towards us. With V1 no initiator's completion proves anything.
    pub(super) self_proto: ProtoVersion,
    pub(super) cfg: AdapterConfig,
    pub(super) segment_name: String,
    pub(super) pools: Arc<Mutex<HashMap<PoolId, PoolEntry>>>,
    pub(super) peers: Mutex<Peers>,
    /// Target side of core's drain protocol (core's driver: the exposure
    /// table, the pools' authorities, the ladder).
    pub(super) drain: Mutex<Driver>,
    pub(super) drain_counters: Arc<DrainCounters>,
    /// Per-tenancy keys and retry shadows (with [`AdapterConfig::keys`]).
    pub(super) grants: Mutex<keys::Grants>,
    /// The slot ranges the engine's data server may serve (exposed now).
    pub(super) ranges: Mutex<ranges::OpenRanges>,
    pub(super) inflight: Arc<Mutex<Inflight>>,
    /// ABORT_ACKs and ABORTs waiting for a sender thread.
    pub(super) sender: sender::SendQueues,
    pub(super) counters: Arc<Counters>,
    /// Wakes the control thread: posting threads, the pools' quarantines,
    /// and (where the engine can) each notification received.
    pub(super) wake: Arc<Wake>,
    /// Whether the engine wakes the control thread on each notification
    /// (then it sleeps until something is due instead of polling).
    pub(super) notify_wakes: AtomicBool,
    pub(super) stop: AtomicBool,
    /// One queue per waiter thread (`initiator`), round robin.
    pub(super) jobs: Arc<[JobQueue]>,
    /// The engine settles operations through completion hooks
    /// ([`TransferEngine::batch_hooks`]); else the waiters wait for them.
    pub(super) hooks: bool,
    /// What the engine's completion hooks settle operations with.
    pub(super) settler: Arc<Settler>,
    pub(super) next_driver: AtomicUsize,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The control thread's wake-up: a flag and its condition variable.
#[derive(Default)]
pub(super) struct Wake {
    pub(super) woken: Mutex<bool>,
    pub(super) cv: Condvar,
}

impl Wake {
    pub(super) fn wake(&self) {
        *lock(&self.woken) = true;
        self.cv.notify_one();
    }
    /// Sleeps until woken or for `wait`, whichever comes first.
    pub(super) fn sleep(&self, wait: Duration) {
        let mut woken = lock(&self.woken);
        if !*woken && !wait.is_zero() {
            woken = self.cv.wait_timeout(woken, wait).map(|r| r.0).unwrap_or_else(|e| e.into_inner().0);
        }
        *woken = false;
    }
}

impl Inner {
    pub(super) fn caps(&self) -> Capabilities {
        lock(&self.drain).capabilities()
    }

    pub(super) fn wake(&self) {
        self.wake.wake();
    }

    /// Before a settlement of `tenancies` is delivered: the data server
    /// stops serving their slots (and waits out requests inside them).
    /// Returns the tenancies that must not be released: a request did not
    /// leave their range in time (counted; they stay quarantined).
    pub(super) fn close_ranges(
        &self,
        pool: PoolId,
        tenancies: &[kv_transfer_core::Tenancy],
    ) -> Vec<kv_transfer_core::Tenancy> {
        if tenancies.is_empty() {
            return Vec::new();
        }
        let stuck = lock(&self.ranges).close(self.engine.as_ref(), pool, tenancies);
        bump(&self.counters.ranges_stuck, stuck.len() as u64);
        stuck
    }

    pub(super) fn add_peer(&self, name: &str) -> Result<PeerId, AdapterError> {
        let segment = self.engine.open_segment(name)?;
        let proto = self.engine.segment_info(segment)?.proto;
        let mut peers = lock(&self.peers);
        if let Some(id) = peers.by_name.get(name).copied() {
            if let Some(p) = peers.by_id.get_mut(&id) {
                p.segment = segment;
                p.proto = proto;
            }
            return Ok(id);
        }
        let id = PeerId(peers.next);
        peers.next += 1;
        let shared: Arc<str> = Arc::from(name);
        peers.by_name.insert(shared.clone(), id);
        peers.by_id.insert(id, PeerInfo { name: shared, segment, proto });
        drop(peers);
        if proto == ProtoVersion::V1 {
            bump(&self.counters.v1_peers, 1);
            tracing::warn!(
                peer = name,
                "peer speaks Mooncake TCP protocol v1: its completions prove nothing about remote memory; \
                 exposures to it settle only by a fence, which this transport cannot give"
            );
        }
        Ok(id)
    }

    /// An exposure with a key per slot (an RDMA target's grants): if our
    /// copy of the target's metadata holds another key for a slot, it is
    /// from an earlier tenancy (ended, and refused at the NIC): fetch the
    /// metadata again. A key still missing then was revoked meanwhile.
    pub(super) fn fresh_keys(&self, seg: SegmentId, remote: &RemoteSlots) -> Result<(), PostErrorKind> {
        // Mooncake TCP exposures carry no keys: nothing to compare, and no
        // copy of the descriptor on every post.
        if remote.slots.iter().all(|r| r.key.is_none()) {
            return Ok(());
        }
        let stale = |desc: &crate::proto::SegmentDesc| {
            remote.slots.iter().any(|r| {
                r.key.is_some_and(|k| {
                    !desc.buffers.iter().any(|b| {
                        b.contains(r.addr, remote.slot_size) && b.rkey.first().is_some_and(|h| u64::from(*h) == k)
                    })
                })
            })
        };
        let info = self.engine.segment_info(seg).map_err(|e| engine_err(&e))?;
        if !stale(&info.desc) {
            return Ok(());
        }
        self.engine.open_segment(&info.desc.name).map_err(|e| engine_err(&e))?;
        let info = self.engine.segment_info(seg).map_err(|e| engine_err(&e))?;
        if stale(&info.desc) {
            return Err(PostErrorKind::Descriptor("the target no longer grants these slots' keys".into()));
        }
        Ok(())
    }

    pub(super) fn peer_by_name(&self, name: &str) -> Option<(PeerId, SegmentId, ProtoVersion)> {
        let peers = lock(&self.peers);
        let id = *peers.by_name.get(name)?;
        peers.by_id.get(&id).map(|p| (id, p.segment, p.proto))
    }

    /// The shared name of the peer named `name`, if this side added it.
    pub(super) fn peer_name(&self, name: &str) -> Option<Arc<str>> {
        let peers = lock(&self.peers);
        let id = *peers.by_name.get(name)?;
        peers.by_id.get(&id).map(|p| p.name.clone())
    }

    /// The peer named `name` (added if new): its id, segment and shared name.
    pub(super) fn peer_for(&self, name: &str) -> Result<(PeerId, SegmentId, Arc<str>), EngineError> {
        let known = |name: &str| {
            let peers = lock(&self.peers);
            let id = *peers.by_name.get(name)?;
            peers.by_id.get(&id).map(|p| (id, p.segment, p.name.clone()))
        };
        if let Some(found) = known(name) {
            return Ok(found);
        }
        match self.add_peer(name) {
            Ok(_) => known(name).ok_or(EngineError::BadSegmentName(name.into())),
            Err(AdapterError::Engine(e)) => Err(e),
            Err(e) => Err(EngineError::NotifyRejected(e.to_string())),
        }
    }

    /// Sends a control message as a notification (text form, in chunks).
    pub(super) fn send(&self, seg: SegmentId, msg: &ControlMessage) -> bool {
        let mut ok = true;
        for m in msg.clone().chunks() {
            ok &= self.send_one(seg, &m);
        }
        ok
    }

    pub(super) fn send_one(&self, seg: SegmentId, msg: &ControlMessage) -> bool {
        let text = match msg.encode_text() {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "control message cannot be encoded");
                return false;
            }
        };
        match self.engine.send_notify(seg, &text) {
            Ok(()) => true,
            Err(e) => {
                bump(&self.counters.notify_failed, 1);
                tracing::warn!(error = %e, kind = ?msg.kind, "adapter notification failed");
                false
            }
        }
    }
}

pub(super) fn engine_err(e: &EngineError) -> PostErrorKind {
    PostErrorKind::Engine(e.to_string())
}
