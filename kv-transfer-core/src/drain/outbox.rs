//! Control messages waiting to be sent, with one retry policy for every
//! backend.

use super::aborts::Outgoing;
use std::collections::VecDeque;

/// How often a backend tries to send one control message before it gives
/// up on it (counted and logged). A given-up ABORT_ACK leaves the target's
/// slots quarantined (its ladder goes on); a given-up DONE leaves its
/// exposure to the target's ladder: nothing is freed by giving up.
pub const MAX_SEND_ATTEMPTS: u32 = 32;

/// Control messages a backend could not send yet, oldest first.
///
/// ```
/// use kv_transfer_core::drain::{ControlKind, ControlMessage, Outbox, Outgoing, MAX_SEND_ATTEMPTS};
/// use kv_transfer_core::*;
/// let mut out: Outbox<&str> = Outbox::default();
/// let msg = ControlMessage::new(ControlKind::AbortAck, PoolId(1), Default::default(), vec![Tenancy::new(SlotId(0), Generation(1))]);
/// out.push(Outgoing { to: "decode", msg });
/// let mut tries = 0;
/// while let Some((o, attempts)) = out.pop() {
///     tries += 1;
///     out.retry(o, attempts); // the send failed
/// }
/// assert_eq!((tries, out.given_up()), (MAX_SEND_ATTEMPTS, 1));
/// ```
#[derive(Debug)]
pub struct Outbox<K> {
    queue: VecDeque<(Outgoing<K>, u32)>,
    given_up: u64,
}

impl<K> Default for Outbox<K> {
    fn default() -> Self {
        Self { queue: VecDeque::new(), given_up: 0 }
    }
}

impl<K> Outbox<K> {
    /// Queues a message for its first attempt.
    pub fn push(&mut self, o: Outgoing<K>) {
        self.queue.push_back((o, 0));
    }
    /// The oldest message and the attempts made so far.
    pub fn pop(&mut self) -> Option<(Outgoing<K>, u32)> {
        self.queue.pop_front()
    }
    /// Every queued message (the caller sends them or puts them back).
    pub fn take_all(&mut self) -> Vec<(Outgoing<K>, u32)> {
        self.queue.drain(..).collect()
    }
    /// Puts a message back after a try that did not send it (`attempts`:
    /// tries made before this one), or gives it up after
    /// [`MAX_SEND_ATTEMPTS`]. Returns whether it was queued again.
    pub fn retry(&mut self, o: Outgoing<K>, attempts: u32) -> bool {
        if attempts + 1 >= MAX_SEND_ATTEMPTS {
            self.given_up += 1;
            tracing::warn!(kind = ?o.msg.kind, attempts = attempts + 1, "control message given up after repeated send failures");
            return false;
        }
        self.queue.push_back((o, attempts + 1));
        true
    }
    /// Puts a message back untried (it must wait, e.g. for operations to drain).
    pub fn defer(&mut self, o: Outgoing<K>, attempts: u32) {
        self.queue.push_back((o, attempts));
    }
    /// Messages queued.
    pub fn len(&self) -> usize {
        self.queue.len()
    }
    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
    /// Messages given up so far.
    pub fn given_up(&self) -> u64 {
        self.given_up
    }
    /// Queued messages, to inspect.
    pub fn iter(&self) -> impl Iterator<Item = &Outgoing<K>> {
        self.queue.iter().map(|(o, _)| o)
    }
}
