//! The adapter's driver thread and its queue: the engine's hooks and the
//! operations file jobs (inbound statuses, control messages, lost peers,
//! fences, acks to send), and the thread runs them, then walks the pools'
//! escalations. It sleeps until a job, a kick or the next escalation is due.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use kv_transfer_core::drain::ControlMessage;
use kv_transfer_core::PeerId;

use super::post::{finish, OpState};
use super::state::{inc, Inner};
use crate::types::{EngineKey, InboundStatus};
use crate::util::lock;

/// Longest sleep of the driver between checks.
const DRIVER_TICK: Duration = Duration::from_millis(200);

pub(super) enum Job {
    PeerLost(EngineKey),
    Filed(InboundStatus),
    Message(EngineKey, Vec<u8>),
    Fence(Arc<OpState>),
    /// An ABORT_ACK for a peer, by its number.
    SendTo(PeerId, ControlMessage),
}

#[derive(Default)]
pub(super) struct JobQueue {
    pub(super) q: VecDeque<Job>,
    pub(super) kicked: bool,
    pub(super) shutdown: bool,
}

#[derive(Default)]
pub(super) struct Jobs {
    pub(super) m: Mutex<JobQueue>,
    pub(super) cv: Condvar,
}

impl Jobs {
    pub(super) fn push(&self, j: Job) {
        let mut q = lock(&self.m);
        let was_empty = q.q.is_empty();
        q.q.push_back(j);
        drop(q);
        // The driver waits only on an empty queue.
        if was_empty {
            self.cv.notify_all();
        }
    }
    pub(super) fn kick(&self) {
        lock(&self.m).kicked = true;
        self.cv.notify_all();
    }
}

pub(super) fn driver_loop(weak: Weak<Inner>, jobs: Arc<Jobs>) {
    let mut next: Option<Duration> = None;
    loop {
        let timeout = next.map_or(DRIVER_TICK, |d| d.min(DRIVER_TICK));
        let batch: Vec<Job> = {
            let mut q = lock(&jobs.m);
            if q.q.is_empty() && !q.kicked && !q.shutdown && !timeout.is_zero() {
                q = jobs.cv.wait_timeout(q, timeout).unwrap_or_else(|e| e.into_inner()).0;
            }
            if q.shutdown {
                return;
            }
            q.kicked = false;
            q.q.drain(..).collect()
        };
        let Some(inner) = weak.upgrade() else { return };
        for job in batch {
            match job {
                Job::PeerLost(key) => {
                    if let Some(peer) = inner.peer_id(&key) {
                        inc(&inner.hub.counters.peers_lost);
                        inner.fenced(peer);
                    }
                }
                Job::Filed(st) => inner.on_status(st),
                Job::Message(from, bytes) => inner.on_message(&from, &bytes),
                Job::SendTo(to, msg) => match inner.peer_key(to) {
                    Some(key) => inner.send(&key, msg),
                    None => tracing::warn!(peer = to.0, "ABORT_ACK for a peer no longer known dropped"),
                },
                Job::Fence(op) => {
                    if inner.fence(op.peer) {
                        let proof = op.pool.authority.fenced(op.peer);
                        finish(&op, op.take_done(), proof.into());
                    } else {
                        tracing::error!(peer = op.peer.0, "unknown status and no fence: the operation stays parked");
                        lock(&inner.hub.ops).parked.push(op);
                    }
                }
            }
        }
        // The pools' locks are taken with the driver's released: posting
        // threads take the driver's to expose.
        let due = lock(&inner.drain).due();
        let mut steps = due.collect();
        let actions = lock(&inner.drain).plan(&mut steps);
        next = steps.next_deadline();
        for a in actions {
            inner.execute(a);
        }
    }
}
