//! Per-connection state, shared by a connection's sender and receiver and
//! by the threads that post to it: the work requests and operations in
//! flight, the aborts waiting for their work requests, the send queue
//! ([`Tx`]) and the doorbells that wake its sender (deferred to the end of
//! a burst on a receiving thread).

use super::registration::Reg;
use super::{lock, HashMap, RawCallback, RawCompletions};
use crate::wire::{self, Body};
use bytes::Bytes;
use kv_transfer_core::drain::{AbortTracker, ControlMessage};
use kv_transfer_core::{Completer, PeerId, PoolId, Tenancy, TransferError};
use std::collections::VecDeque;
use std::io::BufReader;
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

pub(super) enum Src {
    Local { reg: Arc<Reg>, off: usize, len: usize },
    Owned(Bytes),
}

pub(super) enum Outgoing {
    Frame(Vec<u8>),
    /// A Message frame: its head and its records, appended to while queued.
    Messages {
        head: Vec<u8>,
        records: Vec<u8>,
    },
    Wr {
        wr_id: u64,
        op: u64,
        head: Vec<u8>,
        src: Option<Src>,
    },
    Data {
        head: Vec<u8>,
        payload: Bytes,
    },
}

#[derive(Clone)]
pub(super) enum Dest {
    Local { reg: Arc<Reg>, off: usize, len: usize },
    Buf(usize),
}

pub(super) struct WrEntry {
    pub(super) op: u64,
    /// The remote pool of a lease operation's WR (an ABORT names it);
    /// `None` for a raw access.
    pub(super) pool: Option<PoolId>,
    pub(super) tenancy: Tenancy,
    pub(super) sent: bool,
    /// Every byte of it is written to the socket: only from then on may its
    /// completion settle anything (a source slot is ours until our NIC is
    /// done reading it, whatever the target says).
    pub(super) on_wire: bool,
    /// A completion that arrived before `on_wire` (a hostile target, or the
    /// sender not yet back from its write): parked, and delivered by the
    /// sender once the WR is on the wire.
    pub(super) early: Option<Result<Option<bytes::Bytes>, TransferError>>,
    pub(super) aborted: bool,
    pub(super) dest: Option<Dest>,
}

pub(super) enum OpDone {
    Lease(Completer),
    Raw(RawCallback),
    Queue(Arc<dyn RawCompletions>, u64),
}

pub(super) struct OpEntry {
    pub(super) done: OpDone,
    pub(super) reg: Option<Arc<Reg>>,
    pub(super) remaining: usize,
    pub(super) err: Option<TransferError>,
    pub(super) data: Option<Bytes>,
    /// The DONE to send once every WR succeeded (with digests of the local
    /// bytes filled in then, if asked for).
    pub(super) notify: Option<Notify>,
    /// A READ that asked for digests: the local slots' digests go with its
    /// `Completed` proof, so a write that lands in them later is caught when
    /// the settled lease is read.
    pub(super) digest_local: bool,
    /// With `digest_local`: each READ response's digest as it came off the
    /// wire, by local region offset (taken before the bytes are placed, so
    /// a write that lands in the slot meanwhile does not enter it).
    pub(super) read_digests: Vec<(usize, kv_transfer_core::drain::Digest)>,
    pub(super) sent_any: bool,
}

impl OpEntry {
    pub(super) fn cancel_requested(&self) -> bool {
        match &self.done {
            OpDone::Lease(c) => c.cancel_requested(),
            OpDone::Raw(_) | OpDone::Queue(..) => false,
        }
    }
}

/// A lease operation's DONE, sent after its last WR succeeded.
pub(super) struct Notify {
    pub(super) msg: ControlMessage,
    /// Digest each slot of the local lease into the DONE (a WRITE asked for it).
    pub(super) digests: bool,
}

/// Tombstones and unproven tenancies remembered per connection.
const REMEMBERED: usize = 1 << 16;

pub(super) struct ConnState {
    pub(super) closed: bool,
    pub(super) wrs: HashMap<u64, WrEntry>,
    pub(super) ops: HashMap<u64, OpEntry>,
    /// Core's initiator side of the drain protocol, for lease operations
    /// posted on this connection (the peer is the connection itself).
    pub(super) aborts: AbortTracker<()>,
}

impl Default for ConnState {
    fn default() -> Self {
        Self { closed: false, wrs: HashMap::default(), ops: HashMap::default(), aborts: AbortTracker::new(REMEMBERED) }
    }
}

#[derive(Default)]
pub(super) struct TxQueue {
    pub(super) q: VecDeque<Outgoing>,
    pub(super) closed: bool,
    /// The sender is asleep on the condvar and nobody has rung for it yet.
    /// A busy (or already rung) sender is not woken again: a condvar
    /// notification is a syscall, paid per queued item otherwise.
    pub(super) waiting: bool,
}

/// A connection's send queue and the condvar its sender sleeps on.
#[derive(Default)]
pub(super) struct Tx {
    pub(super) q: Mutex<TxQueue>,
    pub(super) cv: Condvar,
}

impl Tx {
    /// Queues an application message: appended to the Message frame at the
    /// back of the queue if there is one with room (the sender has not taken
    /// it yet), so a burst of small messages leaves as one frame.
    pub(super) fn push_message(self: &Arc<Self>, msg: &[u8]) {
        let mut q = lock(&self.q);
        if q.closed {
            return;
        }
        if let Some(Outgoing::Messages { head, records }) = q.q.back_mut() {
            if wire::push_message(records, msg).is_ok() {
                head[4..8].copy_from_slice(&(records.len() as u32).to_le_bytes());
                return;
            }
        }
        // Room for a burst of small messages (a MORI notification is 37 bytes).
        let mut records = Vec::with_capacity(512);
        if wire::push_message(&mut records, msg).is_err() {
            return;
        }
        let Ok(head) = wire::encode_head(&Body::Message, records.len()) else { return };
        q.q.push_back(Outgoing::Messages { head, records });
        let wake = std::mem::take(&mut q.waiting);
        drop(q);
        if wake {
            ring(self);
        }
    }

    /// Queues items; wakes the sender if it sleeps (see [`ring`]).
    pub(super) fn push(self: &Arc<Self>, items: impl IntoIterator<Item = Outgoing>) {
        let mut q = lock(&self.q);
        if q.closed {
            return;
        }
        q.q.extend(items);
        let wake = std::mem::take(&mut q.waiting);
        drop(q);
        if wake {
            ring(self);
        }
    }
}

thread_local! {
    /// On a receiving thread: senders owed a wake-up, rung together once the
    /// thread has handled what it already read (before it blocks). A burst
    /// of completion frames then costs one wake-up of each sender it sends
    /// through, not one per frame.
    pub(super) static DOORBELLS: std::cell::RefCell<Option<Vec<Arc<Tx>>>> = const { std::cell::RefCell::new(None) };
}

/// Wakes `tx`'s sender now, or at the end of the current burst on a
/// receiving thread.
pub(super) fn ring(tx: &Arc<Tx>) {
    let deferred = DOORBELLS.with(|d| match d.borrow_mut().as_mut() {
        Some(v) => {
            if !v.iter().any(|t| Arc::ptr_eq(t, tx)) {
                v.push(tx.clone());
            }
            true
        }
        None => false,
    });
    if !deferred {
        tx.cv.notify_one();
    }
}

/// Rings the deferred doorbells before a read of `len` bytes that the
/// buffer does not hold (it may block).
pub(super) fn ring_before_read(r: &BufReader<TcpStream>, len: usize) {
    if r.buffer().len() < len {
        ring_deferred();
    }
}

/// Rings every deferred doorbell of this thread.
pub(super) fn ring_deferred() {
    let due = DOORBELLS.with(|d| d.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default());
    for tx in due {
        tx.cv.notify_one();
    }
}

pub(super) struct Conn {
    pub(super) peer: PeerId,
    pub(super) index: u32,
    pub(super) name: String,
    pub(super) endpoint: String,
    pub(super) stream: TcpStream,
    pub(super) tx: Arc<Tx>,
    pub(super) st: Mutex<ConnState>,
    pub(super) dead: AtomicBool,
    pub(super) threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Conn {
    pub(super) fn send(&self, item: Outgoing) {
        self.tx.push(std::iter::once(item));
    }
    pub(super) fn send_frame(&self, body: &Body) {
        match wire::encode_head(body, 0) {
            Ok(f) => self.send(Outgoing::Frame(f)),
            Err(e) => tracing::warn!(error = %e, "cannot encode frame"),
        }
    }
    pub(super) fn close_tx(&self) {
        lock(&self.tx.q).closed = true;
        self.tx.cv.notify_all();
    }
}
