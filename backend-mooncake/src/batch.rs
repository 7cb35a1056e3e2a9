//! Batches and task status, shaped like Mooncake's `BatchDesc`/`TransferStatus`.

use std::sync::{Condvar, Mutex};
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
            tasks: Mutex::new(Tasks { list: Vec::with_capacity(capacity), freed: false }),
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
        drop(g);
        self.cv.notify_all();
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
