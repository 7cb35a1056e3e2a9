//! The initiator: [`MoriTransfer`]'s post (shapes, route, the claim on
//! the remote tenancies, one MORI transfer per slot) and the per-operation
//! state from post to proof ([`OpState`], [`OpDone`]): each status reports
//! to `on_status`, and the last one completes the operation (`finish`),
//! or hands it to the driver to fence the peer when a code proved nothing.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kv_transfer_core::drain::{self, AbortTracker, OpEnd};
use kv_transfer_core::{
    check_shapes, Completer, Op, PeerId, PoolId, PostError, PostErrorKind, RejectReason, RemoteSlots, Reserved,
    SlotLease, Tenancy, TransferError, TransferHandle, TransferOptions,
};
use smallvec::SmallVec;

use super::driver::Job;
use super::state::{inc, OpHub, PoolEntry};
use super::wire::pack_tag;
use super::{MoriTransfer, BACKEND, TOMBSTONES};
use crate::status::{StatusCode, StatusListener, TransferStatus};
use crate::types::{BatchRequest, MemoryDesc, Segment, Tag};
use crate::util::lock;

/// Remote tenancies of one post (one, usually: kept inline).
type Tenancies = SmallVec<[Tenancy; 2]>;

/// One posted operation, from post to proof.
pub(super) struct OpState {
    /// The adapter's op table, queue and counters.
    hub: Arc<OpHub>,
    /// One lock for what the last status hands over: the completer and the
    /// first error.
    done: Mutex<OpDone>,
    remaining: AtomicUsize,
    unknown: AtomicBool,
    /// The op's id in the drain protocol's abort tracker.
    id: u64,
    pub(super) peer: PeerId,
    /// The target's pool (what its ABORT names) and the exposure's token.
    remote_pool: PoolId,
    token: drain::ExposureToken,
    remote: Tenancies,
    settle: bool,
    pub(super) pool: Arc<PoolEntry>,
}

struct OpDone {
    completer: Option<Completer>,
    error: Option<(StatusCode, String)>,
    /// Statuses that did not end in `SUCCESS`.
    failed: usize,
    /// The op's statuses, kept until it finishes: a status whose updater
    /// is gone (never terminal) keeps its listener, and with it this op and
    /// its lease, parked for good (a leak, never a reuse).
    statuses: SmallVec<[TransferStatus; 1]>,
}

impl OpState {
    /// What `finish` needs, taken once: the completer, the first error and
    /// how many statuses failed.
    pub(super) fn take_done(&self) -> (Option<Completer>, Option<(StatusCode, String)>, usize) {
        let mut done = lock(&self.done);
        done.statuses.clear();
        (done.completer.take(), done.error.take(), done.failed)
    }
}

pub(super) struct OpTable {
    /// Core's initiator side of the drain protocol: which remote tenancies
    /// have a transfer of ours in flight (at most one each), which were
    /// handed back or aborted, and which ABORTs wait for which ops.
    pub(super) aborts: AbortTracker<PeerId>,
    next_op: u64,
    /// Ops whose status proved nothing and whose peer could not be fenced:
    /// kept (with their leases) for good.
    pub(super) parked: Vec<Arc<OpState>>,
    /// The hot counters, kept under the lock every post and every finish
    /// takes anyway (atomics shared by the posting threads and the
    /// completing one would move a cache line per transfer).
    pub(super) posts: u64,
    pub(super) transfers: u64,
    pub(super) transfers_succeeded: u64,
    pub(super) ops_completed: u64,
}

impl Default for OpTable {
    fn default() -> Self {
        Self {
            aborts: AbortTracker::new(TOMBSTONES),
            next_op: 0,
            parked: Vec::new(),
            posts: 0,
            transfers: 0,
            transfers_succeeded: 0,
            ops_completed: 0,
        }
    }
}

impl MoriTransfer {
    pub(super) fn post_inner(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        let inner = &self.inner;
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        let (entry, rdesc, peer) = match inner.route(local.pool().id(), &remote.endpoint, remote.key) {
            Ok(r) => r,
            Err(kind) => return Err(PostError { lease: local, kind }),
        };
        // Every remote slot must lie inside the remote memory (its offset is
        // then `addr - rdesc.addr`, computed again below).
        for s in &remote.slots {
            let inside = s
                .addr
                .checked_sub(rdesc.addr)
                .is_some_and(|off| off.checked_add(remote.slot_size).is_some_and(|e| e <= rdesc.size));
            if !inside {
                let kind = PostErrorKind::Descriptor(format!("slot {} lies outside the remote memory", s.slot.0));
                return Err(PostError { lease: local, kind });
            }
        }
        let remote_ts: Tenancies = remote.slots.iter().map(|s| s.tenancy()).collect();
        let op_id = {
            let mut ops = lock(&inner.hub.ops);
            ops.next_op += 1;
            let id = ops.next_op;
            // Claim every remote tenancy, or none: at most one transfer of
            // ours per remote tenancy, none to one handed back or aborted.
            if let Err(refusal) = ops.aborts.admit(id, &peer, remote, true) {
                drop(ops);
                inc(&inner.hub.counters.posts_refused_tombstone);
                let kind = PostErrorKind::Descriptor(format!("{refusal}: post a fresh descriptor"));
                return Err(PostError { lease: local, kind });
            }
            ops.posts += 1;
            ops.transfers += remote_ts.len() as u64;
            id
        };
        let exposed = entry.authority.expose_local(local, peer);
        let (handle, completer) = TransferHandle::pair(exposed);
        // One MORI transfer per slot, built while the completer still lends
        // its lease's tenancies.
        let plan = {
            let lease_ts = completer.lease().tenancies();
            let segment = |lt: &Tenancy, rs: &kv_transfer_core::RemoteSlot| {
                Segment::new(u64::from(lt.slot.0) * entry.slot_size, rs.addr - rdesc.addr, entry.slot_size)
            };
            // The remote memory as this slot's access names it: under the
            // slot's own key where the target keys each tenancy.
            let keyed = |rs: &kv_transfer_core::RemoteSlot| match rs.key {
                Some(k) if k != rdesc.rkey => MemoryDesc { rkey: k, ..rdesc.clone() },
                _ => rdesc.clone(),
            };
            match (lease_ts, remote.slots.as_slice()) {
                // One slot, the usual post: MORI's single-transfer call, no request vectors.
                ([lt], [rs]) => Plan::One {
                    remote: keyed(rs),
                    segment: segment(lt, rs),
                    uid: inner.engine.allocate_transfer_unique_id(),
                    tag: pack_tag(rdesc.id, rs.tenancy(), opts.notify),
                },
                _ => Plan::Many(
                    lease_ts
                        .iter()
                        .zip(&remote.slots)
                        .map(|(lt, rs)| BatchRequest {
                            local: entry.desc.clone(),
                            remote: keyed(rs),
                            segments: vec![segment(lt, rs)],
                            uid: inner.engine.allocate_transfer_unique_id(),
                            tag: pack_tag(rdesc.id, rs.tenancy(), opts.notify),
                        })
                        .collect(),
                ),
            }
        };
        let n = remote_ts.len();
        let state = Arc::new(OpState {
            hub: inner.hub.clone(),
            done: Mutex::new(OpDone { completer: Some(completer), error: None, failed: 0, statuses: SmallVec::new() }),
            remaining: AtomicUsize::new(n),
            unknown: AtomicBool::new(false),
            id: op_id,
            peer,
            remote_pool: remote.pool,
            token: remote.token,
            remote: remote_ts,
            settle: opts.notify,
            pool: entry,
        });
        // Each status reports to `on_status` once it is no longer pending
        // (at once if the engine refused it), then is kept by the op.
        let listen = |st: TransferStatus| {
            st.on_complete_shared(state.clone());
            keep(&state, st);
        };
        let l = &state.pool.desc;
        let statuses = match (plan, op) {
            (Plan::One { remote: r, segment: s, uid, tag }, Op::Write) => {
                listen(inner.engine.write(l, s.local_offset, &r, s.remote_offset, s.size, uid, tag));
                return Ok(handle);
            }
            (Plan::One { remote: r, segment: s, uid, tag }, Op::Read) => {
                listen(inner.engine.read(l, s.local_offset, &r, s.remote_offset, s.size, uid, tag));
                return Ok(handle);
            }
            (Plan::Many(requests), Op::Write) => inner.engine.batch_write(&requests),
            (Plan::Many(requests), Op::Read) => inner.engine.batch_read(&requests),
        };
        if statuses.len() != n {
            // The engine answered for fewer (or more) transfers than asked:
            // nothing proves the others are over. Treat as unknown.
            tracing::error!(asked = n, got = statuses.len(), "engine returned a wrong number of statuses");
            state.unknown.store(true, Ordering::Release);
        }
        let missing = n.saturating_sub(statuses.len());
        for _ in 0..missing {
            state.clone().on_status(StatusCode::Unknown(u32::MAX), "");
        }
        for st in statuses.into_iter().take(n) {
            listen(st);
        }
        Ok(handle)
    }
}

/// Keeps `st` with its op until the op finishes (see [`OpDone::statuses`]);
/// an op that finished already (its statuses were terminal at once) does
/// not need it.
fn keep(op: &OpState, st: TransferStatus) {
    let mut done = lock(&op.done);
    if done.completer.is_some() {
        done.statuses.push(st);
    }
}

/// The MORI calls of one post.
enum Plan {
    /// One slot: `write` / `read`.
    One { remote: MemoryDesc, segment: Segment, uid: u64, tag: Tag },
    /// Several: `batch_write` / `batch_read`, one transfer per slot.
    Many(Vec<BatchRequest>),
}

impl StatusListener for OpState {
    fn on_status(self: Arc<Self>, code: StatusCode, message: &str) {
        on_status(&self, code, message);
    }
}

fn on_status(op: &Arc<OpState>, code: StatusCode, message: &str) {
    let hub = &op.hub;
    if !code.is_success() {
        match code {
            StatusCode::Unknown(_) => inc(&hub.counters.transfers_unknown),
            _ => inc(&hub.counters.transfers_failed),
        }
        let mut done = lock(&op.done);
        done.failed += 1;
        done.error.get_or_insert_with(|| (code, message.to_owned()));
    }
    if matches!(code, StatusCode::Unknown(_)) {
        op.unknown.store(true, Ordering::Release);
    }
    if op.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
        return;
    }
    // Every status left the pending states.
    if op.unknown.load(Ordering::Acquire) {
        // The driver fences the peer; if it is gone (the adapter was
        // dropped), the job stays queued with the op: parked.
        hub.jobs.push(Job::Fence(op.clone()));
        return;
    }
    let (completer, error, failed) = op.take_done();
    let proof = match &completer {
        Some(c) => op.pool.authority.completed(c.lease().tenancies()),
        None => op.pool.authority.completed(&[]),
    };
    finish(op, (completer, error, failed), proof.into());
}

/// A target's refusal carried in an engine message (`RDMA_OP` with the
/// transport's words, "rejected by the target: <reason>") as core's typed
/// rejection; any other error stays the engine's.
pub(super) fn to_transfer_error(code: StatusCode, message: String) -> TransferError {
    const PREFIX: &str = "rejected by the target: ";
    if code == StatusCode::RdmaOp {
        if let Some(at) = message.find(PREFIX) {
            let reason = match message[at + PREFIX.len()..].trim() {
                "out of bounds" => Some(RejectReason::OutOfBounds),
                "unknown key" => Some(RejectReason::UnknownKey),
                "stale generation" => Some(RejectReason::StaleGeneration),
                "zero length" => Some(RejectReason::ZeroLength),
                "oversize" => Some(RejectReason::Oversize),
                _ => None,
            };
            if let Some(r) = reason {
                return TransferError::Rejected(r);
            }
        }
    }
    TransferError::Engine { engine: BACKEND, code: i64::from(code.raw()), message }
}

/// Completes `op` (its completer, with the first error if a status failed;
/// what [`OpState::take_done`] returned) with `proof` and clears its bookkeeping.
pub(super) fn finish(
    op: &Arc<OpState>,
    (completer, error, failed): (Option<Completer>, Option<(StatusCode, String)>, usize),
    proof: kv_transfer_core::Settlement,
) {
    let result = match error {
        None => Ok(()),
        Some((code, message)) => Err(to_transfer_error(code, message)),
    };
    let hub = &op.hub;
    let acks = {
        let mut ops = lock(&hub.ops);
        ops.ops_completed += 1;
        ops.transfers_succeeded += op.remote.len().saturating_sub(failed) as u64;
        // An unknown status proves nothing about the target: never acked.
        let end = if op.unknown.load(Ordering::Acquire) { OpEnd::Unproven } else { OpEnd::Proven };
        let acks = ops.aborts.finished(op.id, end);
        if op.settle {
            // Handed back: the target settles from its inbound status.
            ops.aborts.tombstone(&op.peer, op.remote_pool, op.token, &op.remote);
        }
        acks
    };
    for a in acks {
        hub.jobs.push(Job::SendTo(a.to, a.msg));
    }
    if let Some(c) = completer {
        if let Err(e) = c.complete(proof, result) {
            tracing::error!(error = %e, "operation's proof did not settle its lease");
        }
    }
}
