//! How the initiator's operations end, and only then settle their local
//! leases: when every task is COMPLETED or FAILED (TIMEOUT is not terminal),
//! the batch is freed, the DONE sent after a clean v2 completion (core's
//! codec), and the abort tracker told how the operation ended.
//!
//! Two ways to learn that every task finished:
//!
//! - the engine's completion hook ([`TransferEngine::on_batch_finished`]),
//!   run on the engine's thread that finished the last task: an operation
//!   without a DONE settles right there, as a raw engine loop's caller would
//!   see it; one with a DONE goes to a waiter thread, since a send may block;
//! - with an engine without hooks, a waiter thread waits for each task in
//!   bounded slices.
//!
//! A hook holds a [`Settler`], never the adapter: an engine thread that
//! dropped the adapter's last reference would drop the engine, and with it
//! join itself.

use super::*;

/// What settling an operation needs, without the engine (the same tables
/// and counters as the adapter's [`Inner`]).
pub(super) struct Settler {
    pub(super) pools: Arc<Mutex<HashMap<PoolId, PoolEntry>>>,
    pub(super) inflight: Arc<Mutex<Inflight>>,
    pub(super) counters: Arc<Counters>,
    pub(super) wake: Arc<Wake>,
    pub(super) jobs: Arc<[JobQueue]>,
}

impl Settler {
    /// Queues ABORT_ACKs for the control thread to hand to the senders, and
    /// wakes it (only then: an operation's end wakes nobody otherwise).
    pub(super) fn queue_acks(&self, acks: Vec<Outgoing<Arc<str>>>) {
        if acks.is_empty() {
            return;
        }
        let mut fl = lock(&self.inflight);
        for a in acks {
            fl.outbox.push(a);
        }
        drop(fl);
        self.wake.wake();
    }

    /// The transfer's result from how its tasks ended, counted.
    fn outcome(&self, ending: &mut Ending) -> Result<(), TransferError> {
        if ending.v1 {
            bump(&self.counters.v1_ops, 1);
        }
        match ending.failure.take() {
            Some(e) => {
                bump(&self.counters.ops_failed, 1);
                Err(e)
            }
            None => {
                bump(&self.counters.ops_completed, 1);
                Ok(())
            }
        }
    }

    /// Every task of operation `id` is finished: our engine no longer
    /// touches the local slots. Tells the tracker what the end proves
    /// (queuing the ABORT_ACKs that waited for it), then settles the lease.
    fn settle(&self, id: u64, completer: Completer, end: OpEnd, result: Result<(), TransferError>) {
        let authority = lock(&self.pools).get(&completer.lease().pool().id()).map(|e| e.authority.clone());
        let acks = lock(&self.inflight).tracker.finished(id, end);
        self.queue_acks(acks);
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

    /// An operation that will never end here: its lease is quarantined,
    /// never released, and its tracker entry stays in flight (an ABORT for
    /// its remote tenancies is never acked).
    pub(super) fn abandon(&self, job: Job) {
        bump(&self.counters.ops_abandoned, 1);
        drop(job);
    }

    /// The engine's hook: every task of `job` finished, and its batch is freed.
    fn finished_by_engine(&self, job: Job, statuses: &mut dyn Iterator<Item = TaskStatus>) {
        let mut ending = Ending::default();
        for st in statuses {
            ending.add(&st, job.keyed);
        }
        if job.notify.is_some() {
            let queue = self.jobs.get(job.id as usize % self.jobs.len().max(1));
            let refused = match queue {
                Some(q) => q.push(Work::Notify(job, ending)),
                None => Some(Work::Notify(job, ending)),
            };
            if let Some(work) = refused {
                // The waiters left (shutdown): no DONE can be sent.
                self.abandon(work.into_job());
            }
            return;
        }
        bump(&self.counters.ops_settled_by_engine, 1);
        let result = self.outcome(&mut ending);
        self.settle(job.id, job.completer, ending.proof(), result);
    }
}

/// An operation in the engine's hands until its hook runs. Dropped unrun
/// (the engine went away first), it is abandoned.
pub(super) struct InEngine {
    job: Option<Job>,
    settler: Arc<Settler>,
}

impl InEngine {
    /// The hook that settles `job` when the engine has finished its tasks.
    pub(super) fn hook(job: Job, settler: Arc<Settler>) -> BatchHook {
        let mut pending = InEngine { job: Some(job), settler };
        Box::new(move |statuses| {
            if let Some(job) = pending.job.take() {
                pending.settler.finished_by_engine(job, statuses);
            }
        })
    }
}

impl Drop for InEngine {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            tracing::warn!(batch = job.batch, "engine dropped before its operation finished: lease quarantined");
            self.settler.abandon(job);
        }
    }
}

/// Waiter thread `i`: runs the work of its queue until shutdown, then
/// abandons what is left in it.
pub(super) fn waiter_loop(inner: &Arc<Inner>, i: usize) {
    let Some(queue) = inner.jobs.get(i) else { return };
    while !inner.stop.load(Ordering::Acquire) {
        match queue.pop(Duration::from_millis(200)) {
            Some(Work::Wait(job)) => wait_for(inner, job),
            Some(Work::Notify(job, ending)) => finish(inner, job, ending),
            None => {}
        }
    }
    for work in queue.close() {
        inner.settler.abandon(work.into_job());
    }
}

/// Waits for each task of `job` (an engine without hooks), frees the batch,
/// and finishes the operation.
fn wait_for(inner: &Arc<Inner>, job: Job) {
    let engine = &inner.engine;
    let batch = job.batch;
    let mut ending = Ending::default();
    let mut lost = false;
    'tasks: for t in job.tasks.clone() {
        let mut saw_timeout = false;
        loop {
            if inner.stop.load(Ordering::Acquire) {
                lost = true;
                break 'tasks;
            }
            match engine.wait_transfer(batch, t, inner.cfg.wait_slice) {
                Ok(st) if st.status.is_finished() => {
                    ending.add(&st, job.keyed);
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
        // No terminal status: the lease stays quarantined and the op
        // registered as in flight.
        inner.settler.abandon(job);
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
                inner.settler.abandon(job);
                return;
            }
            Err(e) => {
                tracing::warn!(batch, error = %e, "free_batch_id failed after every task finished");
                break;
            }
        }
    }
    finish(inner, job, ending);
}

/// Every task of `job` finished and its batch is freed: sends the DONE when
/// one is due, then settles.
fn finish(inner: &Inner, job: Job, mut ending: Ending) {
    let Job { id, batch, completer, notify, .. } = job;
    let mut result = inner.settler.outcome(&mut ending);
    if result.is_ok() {
        if let Some(n) = notify {
            let Notify { seg, endpoint, mut msg, digests } = *n;
            if ending.v1 {
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
    inner.settler.settle(id, completer, ending.proof(), result);
}
