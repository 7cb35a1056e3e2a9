//! Control messages out (ABORT_ACKs and ABORTs), off the control thread.
//!
//! Sending a Mooncake notification is a handshake round trip to the peer's
//! handshake port, bounded only by the engine's handshake timeout (5 s), and
//! an ABORT_ACK goes to whatever segment name the ABORT declared. Done on
//! the control thread, one forged ABORT naming a listener that never answers
//! stalled every settlement behind it for 5 s (issue 29, attack 9). So the
//! control thread only queues; sender threads send:
//!
//! - one queue per destination, bounded in count and bytes, with a typed,
//!   counted refusal at the cap ([`SendRefusal`]); a destination is served
//!   by one thread at a time, so a black hole holds at most one thread;
//! - two lanes: peers the local side chose (added by `add_peer` or by a
//!   post to them) and strangers (a name only a message declared). Strangers
//!   have their own thread and a cap on how many are queued at once, so they
//!   never delay a known peer's messages, and a stranger is never added to
//!   the peer table (its segment is opened for the send and closed again).

use kv_transfer_core::hash::{HashMap, HashSet};
use std::collections::VecDeque;

use super::*;

/// Which lane a destination is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// A peer the local side chose (in the peer table).
    Known = 0,
    /// A name only a received message declared.
    Stranger = 1,
}

/// One message to send.
pub(super) enum Item {
    /// An ABORT_ACK from the outbox, with the tries made so far (a failed
    /// try goes back to the outbox, whose retry policy decides).
    Ack(Outgoing<Arc<str>>, u32),
    /// An ABORT asked for by the ladder.
    Abort(ControlMessage),
}

impl Item {
    /// Bytes it is charged against its destination's budget: its text form
    /// is about 2 hex digits per byte of the binary one.
    fn cost(&self) -> usize {
        let m = match self {
            Item::Ack(o, _) => &o.msg,
            Item::Abort(m) => m,
        };
        64 + 2 * (48 + m.tenancies.len() * 16)
    }
}

/// Why a message was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SendRefusal {
    /// Its destination's queue is full (count or bytes).
    PeerQueueFull,
    /// Too many strangers have messages queued already.
    TooManyStrangers,
    /// The adapter is shutting down.
    Stopped,
}

/// The budgets of the send queues (from [`AdapterConfig`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct SendLimits {
    pub(super) per_peer: usize,
    pub(super) per_peer_bytes: usize,
    pub(super) strangers: usize,
}

#[derive(Default)]
struct LaneState {
    by_dest: HashMap<String, (VecDeque<Item>, usize)>,
    /// Destinations with something queued and no thread on them.
    ready: VecDeque<String>,
    busy: HashSet<String>,
}

#[derive(Default)]
struct State {
    lanes: [LaneState; 2],
    stop: bool,
}

/// The per-destination send queues.
pub(super) struct SendQueues {
    state: Mutex<State>,
    cv: Condvar,
    limits: SendLimits,
}

impl SendQueues {
    pub(super) fn new(limits: SendLimits) -> Self {
        Self { state: Mutex::default(), cv: Condvar::new(), limits }
    }

    /// Queues `item` for `dest`, or refuses it at a cap (never waits).
    pub(super) fn push(&self, lane: Lane, dest: &str, item: Item) -> Result<(), SendRefusal> {
        let mut s = lock(&self.state);
        if s.stop {
            return Err(SendRefusal::Stopped);
        }
        let l = &mut s.lanes[lane as usize];
        if lane == Lane::Stranger && !l.by_dest.contains_key(dest) && l.by_dest.len() >= self.limits.strangers {
            return Err(SendRefusal::TooManyStrangers);
        }
        let cost = item.cost();
        let (q, bytes) = l.by_dest.entry(dest.to_string()).or_default();
        if q.len() >= self.limits.per_peer || bytes.saturating_add(cost) > self.limits.per_peer_bytes {
            if q.is_empty() {
                l.by_dest.remove(dest);
            }
            return Err(SendRefusal::PeerQueueFull);
        }
        let first = q.is_empty();
        q.push_back(item);
        *bytes += cost;
        if first && !l.busy.contains(dest) {
            l.ready.push_back(dest.to_string());
        }
        drop(s);
        self.cv.notify_all();
        Ok(())
    }

    /// The next message of `lane` and its destination, which no other
    /// thread serves until [`done`](Self::done); `None` once stopped.
    fn next(&self, lane: Lane) -> Option<(String, Item)> {
        let mut s = lock(&self.state);
        loop {
            if s.stop {
                return None;
            }
            let l = &mut s.lanes[lane as usize];
            while let Some(dest) = l.ready.pop_front() {
                let Some((q, bytes)) = l.by_dest.get_mut(&dest) else { continue };
                let Some(item) = q.pop_front() else { continue };
                *bytes = bytes.saturating_sub(item.cost());
                l.busy.insert(dest.clone());
                return Some((dest, item));
            }
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The thread is done with `dest` for now.
    fn done(&self, lane: Lane, dest: &str) {
        let mut s = lock(&self.state);
        let l = &mut s.lanes[lane as usize];
        l.busy.remove(dest);
        match l.by_dest.get(dest) {
            Some((q, _)) if !q.is_empty() => {
                l.ready.push_back(dest.to_string());
                drop(s);
                self.cv.notify_all();
            }
            _ => {
                l.by_dest.remove(dest);
            }
        }
    }

    /// Messages queued now, in all.
    pub(super) fn queued(&self) -> usize {
        let s = lock(&self.state);
        s.lanes.iter().map(|l| l.by_dest.values().map(|(q, _)| q.len()).sum::<usize>()).sum()
    }

    /// Stops every sender thread (what is queued is dropped: giving up
    /// frees nothing).
    pub(super) fn stop(&self) {
        lock(&self.state).stop = true;
        self.cv.notify_all();
    }
}

/// Queues a message for `dest` in the lane the peer table says, counting a
/// refusal.
pub(super) fn enqueue(inner: &Inner, dest: &str, item: Item) {
    let lane = if inner.peer_by_name(dest).is_some() { Lane::Known } else { Lane::Stranger };
    if let Err(why) = inner.sender.push(lane, dest, item) {
        bump(&inner.counters.sends_refused, 1);
        tracing::warn!(to = dest, ?lane, ?why, "control message refused: send queue budget spent");
    }
}

/// One sender thread of `lane`.
pub(super) fn sender_loop(inner: &Arc<Inner>, lane: Lane) {
    while let Some((dest, item)) = inner.sender.next(lane) {
        send_item(inner, lane, &dest, item);
        inner.sender.done(lane, &dest);
    }
}

fn send_item(inner: &Arc<Inner>, lane: Lane, dest: &str, item: Item) {
    let msg = match &item {
        Item::Ack(o, _) => &o.msg,
        Item::Abort(m) => m,
    };
    let sent = match inner.peer_by_name(dest) {
        Some((_, seg, _)) => inner.send(seg, msg),
        None if lane == Lane::Stranger => send_to_stranger(inner, dest, msg),
        None => {
            tracing::debug!(to = dest, "peer gone before its message was sent");
            false
        }
    };
    match item {
        Item::Ack(o, attempts) => {
            if sent {
                bump(&inner.counters.abort_acks_sent, 1);
            } else {
                lock(&inner.inflight).outbox.retry(o, attempts);
            }
        }
        Item::Abort(_) => {
            if sent {
                kv_transfer_core::drain::DrainCounters::add(&inner.drain_counters.aborts_sent, 1);
                tracing::debug!(peer = %dest, "ABORT sent");
            }
        }
    }
}

/// A name we never chose: opened for this one send and closed again, so
/// it costs the peer and engine tables nothing.
fn send_to_stranger(inner: &Arc<Inner>, dest: &str, msg: &ControlMessage) -> bool {
    let seg = match inner.engine.open_segment(dest) {
        Ok(s) => s,
        Err(e) => {
            bump(&inner.counters.notify_failed, 1);
            tracing::warn!(to = dest, error = %e, "control message to an unreachable stranger");
            return false;
        }
    };
    let sent = inner.send(seg, msg);
    // Added meanwhile by a post of ours: it is a peer now, keep it.
    if inner.peer_by_name(dest).is_none() {
        let _ = inner.engine.close_segment(seg);
    }
    sent
}
