//! Batches and task status, shaped like Mooncake's `BatchDesc`/`TransferStatus`.

use kv_transfer_core::hash::HashMap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::error::{EngineError, TaskError};
use crate::proto::ProtoVersion;

/// Mooncake's `TransferStatusEnum`, same numbering.
///
/// Only [`TransferStatus::Completed`] and [`TransferStatus::Failed`] are
/// finished. [`TransferStatus::Timeout`] is *not* terminal: the transfer may
/// still be running and touching memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum TransferStatus {
    /// Submitted, not started.
    Waiting = 0,
    /// Running.
    Pending = 1,
    /// Invalid (unused by this engine; kept for numbering).
    Invalid = 2,
    /// Canceled (the classic engine has no cancel; never produced here).
    Canceled = 3,
    /// Finished successfully. Against a v2 peer the bytes were applied (WRITE)
    /// or received in full (READ); against a v1 peer a WRITE only left our socket.
    Completed = 4,
    /// Still running past the configured transfer timeout. NOT terminal.
    Timeout = 5,
    /// Finished with an error; this process will not touch the task's memory
    /// any more.
    Failed = 6,
}

impl TransferStatus {
    /// Whether the task is finished (COMPLETED or FAILED) — the only states in
    /// which its local memory is no longer touched by the engine.
    pub fn is_finished(self) -> bool {
        matches!(self, TransferStatus::Completed | TransferStatus::Failed)
    }
}

impl TryFrom<i32> for TransferStatus {
    type Error = i32;
    /// Unknown values are returned as the error.
    fn try_from(v: i32) -> Result<Self, i32> {
        Ok(match v {
            0 => TransferStatus::Waiting,
            1 => TransferStatus::Pending,
            2 => TransferStatus::Invalid,
            3 => TransferStatus::Canceled,
            4 => TransferStatus::Completed,
            5 => TransferStatus::Timeout,
            6 => TransferStatus::Failed,
            other => return Err(other),
        })
    }
}

/// Status report of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStatus {
    /// The status.
    pub status: TransferStatus,
    /// Bytes transferred (length once COMPLETED, else 0).
    pub transferred_bytes: u64,
    /// Why it FAILED, when it did.
    pub error: Option<TaskError>,
    /// Framing version of the target: with [`ProtoVersion::V1`] a COMPLETED
    /// WRITE proves nothing about the remote memory.
    pub proto: ProtoVersion,
}

#[derive(Debug)]
struct Task {
    status: TransferStatus,
    bytes: u64,
    error: Option<TaskError>,
    submitted: Instant,
    proto: ProtoVersion,
}

/// Runs once every task of a batch is finished, given each task's final
/// status in task order ([`crate::TransferEngine::on_batch_finished`]).
pub type BatchHook = Box<dyn FnOnce(&mut dyn Iterator<Item = TaskStatus>) + Send>;

/// The engine's batches by id.
pub(crate) type BatchMap = Mutex<HashMap<u64, Arc<BatchState>>>;

/// A hook waiting for its batch, and the map the batch is freed from when
/// it runs (weak: a hook never keeps the engine's tables alive).
struct Waiting {
    hook: BatchHook,
    batches: Weak<BatchMap>,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiting(hook)")
    }
}

/// One batch: a capacity and the tasks submitted so far.
#[derive(Debug)]
pub(crate) struct BatchState {
    pub(crate) id: u64,
    pub(crate) capacity: usize,
    tasks: Mutex<Tasks>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Tasks {
    list: Vec<Task>,
    freed: bool,
    hook: Option<Waiting>,
}

impl std::ops::Deref for Tasks {
    type Target = Vec<Task>;
    fn deref(&self) -> &Vec<Task> {
        &self.list
    }
}

impl std::ops::DerefMut for Tasks {
    fn deref_mut(&mut self) -> &mut Vec<Task> {
        &mut self.list
    }
}

impl BatchState {
    pub(crate) fn new(id: u64, capacity: usize) -> Self {
        Self {
            id,
            capacity,
            tasks: Mutex::new(Tasks { list: Vec::with_capacity(capacity), freed: false, hook: None }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends `protos.len()` WAITING tasks; returns the first index.
    pub(crate) fn reserve(&self, protos: &[ProtoVersion]) -> Result<usize, EngineError> {
        let mut t = self.lock();
        if t.freed {
            return Err(EngineError::UnknownBatch(self.id));
        }
        if t.len() + protos.len() > self.capacity {
            return Err(EngineError::BatchFull {
                batch: self.id,
                capacity: self.capacity,
                used: t.len(),
                adding: protos.len(),
            });
        }
        let first = t.len();
        let now = Instant::now();
        t.extend(protos.iter().map(|&proto| Task {
            status: TransferStatus::Waiting,
            bytes: 0,
            error: None,
            submitted: now,
            proto,
        }));
        Ok(first)
    }

    pub(crate) fn mark_pending(&self, task: usize) {
        if let Some(t) = self.lock().get_mut(task) {
            if t.status == TransferStatus::Waiting {
                t.status = TransferStatus::Pending;
            }
        }
    }

    pub(crate) fn finish(&self, task: usize, r: Result<u64, TaskError>) {
        let mut g = self.lock();
        if let Some(t) = g.get_mut(task) {
            if !t.status.is_finished() {
                match r {
                    Ok(n) => {
                        t.status = TransferStatus::Completed;
                        t.bytes = n;
                    }
                    Err(e) => {
                        t.status = TransferStatus::Failed;
                        t.error = Some(e);
                    }
                }
            }
        }
        let done = Self::take_if_done(&mut g);
        drop(g);
        self.cv.notify_all();
        if let Some((waiting, tasks)) = done {
            self.run_hook(waiting, tasks);
        }
    }

    /// Has `hook` run once every task submitted so far is finished: now, in
    /// this thread, if they are (and there is one), else from the thread
    /// that finishes the last. The batch is freed from `batches` then.
    pub(crate) fn on_finished(&self, hook: BatchHook, batches: Weak<BatchMap>) -> Result<(), EngineError> {
        let mut g = self.lock();
        if g.freed || g.hook.is_some() {
            return Err(EngineError::UnknownBatch(self.id));
        }
        g.hook = Some(Waiting { hook, batches });
        let done = Self::take_if_done(&mut g);
        drop(g);
        if let Some((waiting, tasks)) = done {
            self.run_hook(waiting, tasks);
        }
        Ok(())
    }

    /// The waiting hook and the tasks, taken (the batch freed), once a hook
    /// waits and every task submitted is finished.
    fn take_if_done(g: &mut Tasks) -> Option<(Waiting, Vec<Task>)> {
        if g.hook.is_none() || g.list.is_empty() || !g.list.iter().all(|t| t.status.is_finished()) {
            return None;
        }
        g.freed = true;
        Some((g.hook.take()?, std::mem::take(&mut g.list)))
    }

    /// Outside the batch's lock: frees the batch from the engine's map (its
    /// lock is taken before a batch's, in `free_batch_id`), then runs the hook.
    fn run_hook(&self, waiting: Waiting, tasks: Vec<Task>) {
        if let Some(map) = waiting.batches.upgrade() {
            map.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
        }
        let mut statuses = tasks.into_iter().map(|t| TaskStatus {
            status: t.status,
            transferred_bytes: t.bytes,
            error: t.error,
            proto: t.proto,
        });
        (waiting.hook)(&mut statuses);
    }

    fn report(&self, t: &Task, timeout: Option<Duration>) -> TaskStatus {
        let mut status = t.status;
        if !status.is_finished() && timeout.is_some_and(|d| t.submitted.elapsed() > d) {
            status = TransferStatus::Timeout;
        }
        TaskStatus { status, transferred_bytes: t.bytes, error: t.error.clone(), proto: t.proto }
    }

    pub(crate) fn status(&self, task: usize, timeout: Option<Duration>) -> Result<TaskStatus, EngineError> {
        let g = self.lock();
        let t = g.get(task).ok_or(EngineError::UnknownTask { batch: self.id, task })?;
        Ok(self.report(t, timeout))
    }

    pub(crate) fn wait(
        &self,
        task: usize,
        wait: Duration,
        timeout: Option<Duration>,
    ) -> Result<TaskStatus, EngineError> {
        let deadline = Instant::now() + wait;
        let mut g = self.lock();
        loop {
            let t = g.get(task).ok_or(EngineError::UnknownTask { batch: self.id, task })?;
            let now = Instant::now();
            if t.status.is_finished() || now >= deadline {
                return Ok(self.report(t, timeout));
            }
            g = self.cv.wait_timeout(g, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Marks the batch freed if every task is finished; else the count of
    /// unfinished tasks. A freed batch accepts no more submissions.
    pub(crate) fn try_free(&self) -> Result<(), usize> {
        let mut g = self.lock();
        let unfinished = g.iter().filter(|t| !t.status.is_finished()).count();
        if unfinished > 0 {
            return Err(unfinished);
        }
        g.freed = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn batch_in(map: &Arc<BatchMap>, id: u64, tasks: usize) -> Arc<BatchState> {
        let b = Arc::new(BatchState::new(id, tasks));
        b.reserve(&vec![ProtoVersion::V2; tasks]).unwrap();
        map.lock().unwrap().insert(id, b.clone());
        b
    }

    type Seen = Arc<Mutex<Vec<Vec<TransferStatus>>>>;

    /// A hook that records the statuses it is given, and whether it was
    /// dropped without running.
    fn recording() -> (BatchHook, Seen, Arc<AtomicBool>) {
        struct Unrun(Arc<AtomicBool>, bool);
        impl Drop for Unrun {
            fn drop(&mut self) {
                self.0.store(!self.1, Ordering::SeqCst);
            }
        }
        let seen: Seen = Arc::default();
        let dropped_unrun = Arc::new(AtomicBool::new(false));
        let guard = Unrun(dropped_unrun.clone(), false);
        let s = seen.clone();
        let hook: BatchHook = Box::new(move |statuses| {
            let mut ran = guard; // the whole guard, not just its field
            ran.1 = true;
            s.lock().unwrap().push(statuses.map(|st| st.status).collect());
        });
        (hook, seen, dropped_unrun)
    }

    #[test]
    fn a_hook_runs_once_when_the_last_task_finishes_and_frees_the_batch() {
        let map: Arc<BatchMap> = Arc::default();
        let b = batch_in(&map, 1, 2);
        let (hook, seen, _) = recording();
        b.on_finished(hook, Arc::downgrade(&map)).unwrap();
        b.finish(0, Ok(10));
        assert!(seen.lock().unwrap().is_empty(), "a task still runs: nothing is finished");
        b.finish(1, Err(TaskError::Dropped));
        assert_eq!(*seen.lock().unwrap(), vec![vec![TransferStatus::Completed, TransferStatus::Failed]]);
        assert!(map.lock().unwrap().is_empty(), "the batch is freed when its hook runs");
        // A late report changes nothing; the freed batch takes no hook.
        b.finish(1, Ok(1));
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert!(b.on_finished(recording().0, Arc::downgrade(&map)).is_err());
    }

    #[test]
    fn a_hook_set_after_every_task_finished_runs_at_once() {
        let map: Arc<BatchMap> = Arc::default();
        let b = batch_in(&map, 2, 1);
        b.finish(0, Ok(4));
        let (hook, seen, _) = recording();
        b.on_finished(hook, Arc::downgrade(&map)).unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![vec![TransferStatus::Completed]]);
        assert!(map.lock().unwrap().is_empty());
    }

    #[test]
    fn a_task_past_its_timeout_keeps_the_hook_waiting_and_a_dropped_batch_drops_it_unrun() {
        let map: Arc<BatchMap> = Arc::default();
        let b = batch_in(&map, 3, 1);
        b.mark_pending(0);
        let (hook, seen, dropped_unrun) = recording();
        b.on_finished(hook, Arc::downgrade(&map)).unwrap();
        // TIMEOUT is reported, and is not finished: the hook keeps waiting.
        assert_eq!(b.status(0, Some(Duration::ZERO)).unwrap().status, TransferStatus::Timeout);
        assert!(seen.lock().unwrap().is_empty());
        assert!(!dropped_unrun.load(Ordering::SeqCst));
        drop(map);
        drop(b);
        assert!(seen.lock().unwrap().is_empty());
        assert!(dropped_unrun.load(Ordering::SeqCst), "the hook is dropped, never run, with its batch");
    }
}
