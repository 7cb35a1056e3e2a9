//! The initiator's waiter threads: each waits on its operations' tasks with
//! bounded slices until every task is COMPLETED or FAILED (TIMEOUT is not
//! terminal), frees the batch, sends the DONE (core's codec) after a clean
//! v2 completion, tells the abort tracker how the operation ended, and only
//! then settles the local lease.

use super::*;
/// Waiter thread `i`: runs the jobs of its queue until shutdown, then
/// abandons what is left in it (each lease quarantined, never released).
pub(super) fn waiter_loop(inner: &Arc<Inner>, i: usize) {
    let Some(queue) = inner.jobs.get(i) else { return };
    while !inner.stop.load(Ordering::Acquire) {
        if let Some(job) = queue.pop(Duration::from_millis(200)) {
            run_job(inner, job);
        }
    }
    for job in queue.close() {
        bump(&inner.counters.ops_abandoned, 1);
        drop(job.completer);
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

fn run_job(inner: &Arc<Inner>, job: Job) {
    let Job { id, batch, tasks, completer, notify, keyed } = job;
    let engine = &inner.engine;
    let mut failure: Option<TransferError> = None;
    let mut v1 = false;
    // A task that FAILED mid-connection (or for an unknown reason) may have
    // left bytes in the target's socket that the target still applies.
    let mut uncertain = false;
    let mut lost = false;
    'tasks: for t in tasks {
        let mut saw_timeout = false;
        loop {
            if inner.stop.load(Ordering::Acquire) {
                lost = true;
                break 'tasks;
            }
            match engine.wait_transfer(batch, t, inner.cfg.wait_slice) {
                Ok(st) if st.status.is_finished() => {
                    v1 |= st.proto == ProtoVersion::V1;
                    if st.status == TransferStatus::Failed {
                        uncertain |= !matches!(
                            st.error,
                            Some(TaskError::AddrRejected)
                                | Some(TaskError::Connect(_))
                                | Some(TaskError::Dropped)
                                | Some(TaskError::NoRemoteKey { .. })
                                | Some(TaskError::RemoteAccess)
                        );
                        if failure.is_none() {
                            failure = Some(map_task_error(&st.error, keyed));
                        }
                    }
                    continue 'tasks;
                }
                Ok(st) => {
                    if st.status == TransferStatus::Timeout && !saw_timeout {
                        saw_timeout = true;
                        bump(&inner.counters.timeouts_seen, 1);
                        tracing::debug!(batch, task = t, "task in TIMEOUT: not terminal, still waiting");
                    }
                }
                Err(e) => {
                    tracing::error!(batch, task = t, error = %e, "engine lost the task; lease stays quarantined");
                    lost = true;
                    break 'tasks;
                }
            }
        }
    }
    if lost {
        // No terminal status: the completer's drop quarantines the lease, and
        // the op stays registered as in flight, so an ABORT for its remote
        // tenancies is never acked.
        bump(&inner.counters.ops_abandoned, 1);
        drop(completer);
        inner.wake();
        return;
    }
    // Every task is finished, so the batch frees; BatchBusy would mean the
    // engine disagrees, so wait a little and retry (bounded by shutdown).
    loop {
        match engine.free_batch_id(batch) {
            Ok(()) => break,
            Err(EngineError::BatchBusy { .. }) if !inner.stop.load(Ordering::Acquire) => {
                bump(&inner.counters.free_refused, 1);
                std::thread::sleep(inner.cfg.wait_slice.min(Duration::from_millis(10)));
            }
            Err(EngineError::BatchBusy { .. }) => {
                bump(&inner.counters.ops_abandoned, 1);
                drop(completer);
                return;
            }
            Err(e) => {
                tracing::warn!(batch, error = %e, "free_batch_id failed after every task finished");
                break;
            }
        }
    }
    if v1 {
        bump(&inner.counters.v1_ops, 1);
    }
    let mut result = match failure {
        Some(e) => {
            bump(&inner.counters.ops_failed, 1);
            Err(e)
        }
        None => {
            bump(&inner.counters.ops_completed, 1);
            Ok(())
        }
    };
    if result.is_ok() {
        if let Some((seg, endpoint, mut msg, digests)) = notify {
            if v1 {
                tracing::warn!(batch, "operation ran under protocol v1: no completion notification sent");
            } else {
                if digests {
                    msg.digests = drain::lease_digests(completer.lease(), &msg.token).unwrap_or_default();
                }
                if inner.send(seg, &msg) {
                    bump(&inner.counters.done_sent, 1);
                    // Handed back: no later post of ours may name them.
                    lock(&inner.inflight).tracker.tombstone(&endpoint, msg.pool, msg.token, &msg.tenancies);
                } else {
                    result = Err(TransferError::Transport("data completed, but the completion notify failed".into()));
                }
            }
        }
    }
    // Every task is finished: our engine no longer touches the local slots.
    // Its end proves nothing about the target's memory if a task ran under
    // v1 or failed mid-connection: then no ABORT_ACK ever names them.
    let authority = lock(&inner.pools).get(&completer.lease().pool().id()).map(|e| e.authority.clone());
    let end = if v1 || uncertain { OpEnd::Unproven } else { OpEnd::Proven };
    let acks = lock(&inner.inflight).tracker.finished(id, end);
    queue_acks(inner, acks);
    match authority {
        Some(a) => {
            let proof = a.completed_lease(completer.lease());
            if let Err(reason) = completer.complete(proof, result) {
                tracing::error!(?reason, "own proof did not settle own lease");
            }
        }
        None => drop(completer),
    }
}
