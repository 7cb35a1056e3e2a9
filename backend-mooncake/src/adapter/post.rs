//! The initiator side's post: checks, admission by the abort tracker
//! before anything is submitted, the engine's batch, and the operation
//! handed to the engine's completion hook or a waiter thread (`initiator`).

use super::*;
use std::cell::Cell;

thread_local! {
    /// The engine requests of a post, kept for the thread's next post: in
    /// steady state a post allocates no list (an early return drops it,
    /// and the next post allocates again).
    static REQUESTS: Cell<Vec<TransferRequest>> = const { Cell::new(Vec::new()) };
}

kv_transfer_core::impl_transfer_via_post_now!(MooncakeTransfer, "mooncake");

// The post never waits (the engine queues the batch; its completion hook
// or a waiter thread settles it), so `Transfer::write` needs no boxed
// future per post.
impl PostNow for MooncakeTransfer {
    fn post_now(
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
        let authority = match lock(&inner.pools).get(&local.pool().id()) {
            Some(e) => e.authority.clone(),
            None => return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool }),
        };
        if inner.stop.load(Ordering::Acquire) {
            return Err(PostError { lease: local, kind: PostErrorKind::ShuttingDown });
        }
        let (peer, seg, name) = match inner.peer_for(&remote.endpoint) {
            Ok(p) => p,
            Err(e) => return Err(PostError { lease: local, kind: PostErrorKind::Peer(e.to_string()) }),
        };
        if let Err(kind) = inner.fresh_keys(seg, remote) {
            return Err(PostError { lease: local, kind });
        }
        let slot = remote.slot_size;
        let opcode = match op {
            Op::Read => TcpOpcode::Read,
            Op::Write => TcpOpcode::Write,
        };
        // Slots next to each other on both sides go as one request (a
        // serving engine's pages mostly are: one request per run, not per
        // page). Not with a key per slot: each slot's key covers only it.
        let coalesce = remote.slots.iter().all(|s| s.key.is_none());
        // This thread's list from its last post (empty, its capacity kept).
        let mut reqs = REQUESTS.take();
        for (i, r) in remote.slots.iter().enumerate() {
            let Some(source) = local.slot_addr(i) else {
                return Err(PostError { lease: local, kind: PostErrorKind::Descriptor("local slot missing".into()) });
            };
            if coalesce {
                if let Some(last) = reqs.last_mut().filter(|l| runs_on(l, source, r.addr)) {
                    last.length += slot;
                    continue;
                }
            }
            reqs.push(TransferRequest { opcode, source, target_id: seg, target_offset: r.addr, length: slot });
        }
        let batch = match inner.engine.allocate_batch_id(reqs.len()) {
            Ok(b) => b,
            Err(e) => return Err(PostError { lease: local, kind: engine_err(&e) }),
        };
        // Register the operation before anything is submitted, under the same
        // lock that records aborts: an ABORT either sees this op (and waits
        // for it) or this post sees the abort (and refuses).
        let id = {
            let mut fl = lock(&inner.inflight);
            fl.next += 1;
            let id = fl.next;
            if let Err(refusal) = fl.tracker.admit(id, &name, remote, false) {
                drop(fl);
                bump(&inner.counters.posts_to_aborted, 1);
                let _ = inner.engine.free_batch_id(batch);
                return Err(PostError { lease: local, kind: PostErrorKind::Descriptor(refusal.to_string()) });
            }
            id
        };
        let exposed = authority.expose_local(local, peer);
        let mut submitted = inner.engine.submit_transfer(batch, &reqs);
        if let Err(EngineError::TargetOutOfRange { .. }) = submitted {
            // The target may have registered memory since we fetched its
            // descriptor: refresh once (submit is all or nothing, so a retry
            // cannot double-post).
            if inner.engine.open_segment(&remote.endpoint).is_ok() {
                submitted = inner.engine.submit_transfer(batch, &reqs);
            }
        }
        let tasks = match submitted {
            Ok(r) => r,
            Err(e) => {
                // Nothing was queued (submit is all or nothing): no operation
                // touches the slots, so `Completed` is vacuously true.
                lock(&inner.inflight).tracker.finished(id, OpEnd::Proven);
                let _ = inner.engine.free_batch_id(batch);
                inner.wake();
                let proof = authority.completed_lease(&exposed);
                let lease = match exposed.settle(proof) {
                    Ok(s) => s.into_reserved(),
                    Err(err) => {
                        // Cannot happen (own pool, full cover). If it did, the
                        // lease must not come back unsettled: it is handed to a
                        // completer that is dropped, so it is quarantined and
                        // the handle resolves `Abandoned`.
                        let (h, c) = TransferHandle::pair(err.lease);
                        drop(c);
                        return Ok(h);
                    }
                };
                return Err(PostError { lease, kind: engine_err(&e) });
            }
        };
        reqs.clear();
        REQUESTS.set(reqs);
        bump(&inner.counters.posts, 1);
        let (handle, completer) = TransferHandle::pair(exposed);
        let notify = opts.notify.then(|| {
            let done = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
            Box::new(Notify { seg, endpoint: name.clone(), msg: done, digests: opts.digest && op == Op::Write })
        });
        let keyed = remote.slots.iter().any(|s| s.key.is_some());
        let job = Job { id, batch, tasks, completer, notify, keyed };
        if inner.hooks {
            // Settled by the engine's thread when the last task finishes (or
            // here, if it has): no hand-off to a waiter for an operation
            // without a DONE.
            if let Err(e) = inner.engine.on_batch_finished(batch, InEngine::hook(job, inner.settler.clone())) {
                // Our batch, just submitted: cannot happen. The hook was
                // dropped unrun, so the operation is abandoned (quarantined).
                tracing::error!(batch, error = %e, "the engine refused the completion hook");
            }
            return Ok(handle);
        }
        let n = inner.jobs.len().max(1);
        let k = inner.next_driver.fetch_add(1, Ordering::Relaxed) % n;
        if let Some(work) = inner.jobs.get(k).and_then(|q| q.push(Work::Wait(job))) {
            // Waiter gone (shutdown): the operation is in the engine, so it
            // is abandoned (quarantined), never released.
            inner.settler.abandon(work.into_job());
        }
        Ok(handle)
    }
}

/// Longest request a run of slots is merged into (a request is one
/// deadline at the target: a run past this starts a new request).
const MAX_RUN_BYTES: u64 = 16 << 20;

/// Whether the slot at `source` (local) and `target` (remote) continues
/// `last` on both sides, within [`MAX_RUN_BYTES`].
fn runs_on(last: &TransferRequest, source: u64, target: u64) -> bool {
    last.source.checked_add(last.length) == Some(source)
        && last.target_offset.checked_add(last.length) == Some(target)
        && last.length < MAX_RUN_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(source: u64, target: u64, length: u64) -> TransferRequest {
        TransferRequest { opcode: TcpOpcode::Write, source, target_id: 1, target_offset: target, length }
    }

    #[test]
    fn a_slot_joins_the_run_only_if_both_sides_continue_it() {
        let last = req(0x1000, 0x9000, 256);
        assert!(runs_on(&last, 0x1100, 0x9100));
        assert!(!runs_on(&last, 0x1100, 0x9200), "the remote side jumps");
        assert!(!runs_on(&last, 0x1200, 0x9100), "the local side jumps");
        assert!(!runs_on(&last, 0x0f00, 0x8f00), "backwards is a new run");
        assert!(!runs_on(&req(0, 0, MAX_RUN_BYTES), MAX_RUN_BYTES, MAX_RUN_BYTES), "a run stops at its cap");
        assert!(!runs_on(&req(u64::MAX - 1, 0, 256), 0, 256), "no wrap-around");
    }
}
