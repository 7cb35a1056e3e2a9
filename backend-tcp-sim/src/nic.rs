//! The simulated NIC: registered regions with keys, connections that keep
//! order like RC queue pairs, one-sided WRITE/READ applied by the NIC's own
//! threads, notifications, revocation, fencing, and the escalation driver.
//!
//! Threads: one acceptor and one escalation driver per NIC; one sender and
//! one receiver per connection. Everything blocks with bounded waits (no
//! busy spin); data moves with vectored writes straight from registered
//! memory and is received straight into registered memory.

use crate::fault::FaultPlan;
use crate::stats::{add, inc, Counters, NicStats};
use crate::wire::{self, AccessHeader, Body, DecodeError, TenancyList, WireStatus, PREFIX_LEN};
use bytes::Bytes;
use kv_transfer_core::{
    check_shapes, Clock, Completer, EscalationAction, EscalationStep, Exposed, Generation, Op, PeerId, PoolConfig,
    PoolError, PoolId, PostError, PostErrorKind, PostNow, Region, RejectReason, RemoteSlots, Reserved,
    SettlementAuthority, SlotId, SlotLease, SlotPool, Tenancy, TransferError, TransferHandle, TransferOptions,
};
// Named in the docs; the impl comes from `impl_transfer_via_post_now!`.
#[cfg(doc)]
use kv_transfer_core::Transfer;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Marks a binding whose revocation started: every access is rejected while
/// the in-flight applies drain.
const REVOKING: u64 = 1 << 63;
/// Items the sender takes from its queue at once (≤ 2 iovecs each).
const MAX_BATCH: usize = 256;
/// Inbound events kept for [`SimNic::next_event`]; older ones are dropped.
const MAX_EVENTS: usize = 4096;
/// Longest sleep of the escalation driver between checks.
const DRIVER_TICK: Duration = Duration::from_millis(100);

/// `HashMap` with foldhash's fast hasher (seeded per process) instead of
/// SipHash: the work-request tables are hit on every post and completion.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// `HashSet` with the same hasher.
type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How the NIC releases quarantined slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReleasePolicy {
    /// The contract: generation checks at the NIC, and slots leave quarantine
    /// only with a real proof (ABORT_ACK, revocation, fence).
    #[default]
    Safe,
    /// **POSITIVE CONTROL FOR RACE TESTS ONLY. NEVER USE IT TO MOVE DATA.**
    ///
    /// Behaves like SGLang before its fix: the NIC checks only key and bounds
    /// (one rkey per region, no generations), and the moment an exposed lease
    /// is aborted the backend mints a `Completed` proof it has no evidence
    /// for, so the slots go straight back to the free list while a peer's
    /// write may still land in them. Race tests run it to show that they can
    /// observe the corruption the safe policy prevents.
    Naive,
}

/// Configuration of a [`SimNic`].
#[derive(Clone, Debug)]
pub struct NicConfig {
    /// Name announced to peers in the handshake.
    pub name: String,
    /// Address to listen on (loopback; port 0 picks one).
    pub listen: String,
    /// Release policy (keep [`ReleasePolicy::Safe`] unless writing a positive control).
    pub policy: ReleasePolicy,
    /// Faults injected by this NIC.
    pub faults: FaultPlan,
    /// Longest WRITE/READ this NIC accepts as a target; longer ones are
    /// rejected with [`RejectReason::Oversize`].
    pub max_wr_bytes: u32,
    /// How long a revocation waits for in-flight applies to drain before it
    /// gives up (and the ladder moves on to the fence).
    pub revoke_wait: Duration,
    /// Bound on the handshake of a new connection.
    pub handshake_timeout: Duration,
    /// `SO_SNDBUF` / `SO_RCVBUF` of each connection (`None`: the kernel's
    /// autotuning). 4 MiB by default: it lifts loopback throughput markedly.
    pub socket_buffer: Option<usize>,
}

impl NicConfig {
    /// A safe NIC named `name` on `127.0.0.1:0` with no faults.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            listen: "127.0.0.1:0".into(),
            policy: ReleasePolicy::Safe,
            faults: FaultPlan::default(),
            max_wr_bytes: 16 << 20,
            revoke_wait: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(5),
            socket_buffer: Some(4 << 20),
        }
    }
    /// Replaces the release policy.
    pub fn with_policy(mut self, policy: ReleasePolicy) -> Self {
        self.policy = policy;
        self
    }
    /// Replaces the fault plan.
    pub fn with_faults(mut self, faults: FaultPlan) -> Self {
        self.faults = faults;
        self
    }
    /// Replaces the largest accepted access.
    pub fn with_max_wr_bytes(mut self, max: u32) -> Self {
        self.max_wr_bytes = max;
        self
    }
}

/// Errors of NIC management calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NicError {
    /// A socket call failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer did not complete the handshake.
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// No live connection to this peer.
    #[error("unknown or disconnected peer {0:?}")]
    UnknownPeer(PeerId),
    /// Larger than a frame can carry.
    #[error("{0} bytes is more than a frame can carry")]
    TooLarge(usize),
    /// The NIC is shut down (or crashed).
    #[error("NIC is shut down")]
    ShuttingDown,
    /// No region of this NIC has this key (or the range lies outside it).
    #[error("no registered range {len} bytes at {offset} in region {key:#x}")]
    LocalRange {
        /// The key asked for.
        key: u64,
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
    },
}

/// Why [`SimNic::expose`] refused. The lease comes back unexposed.
pub type ExposeError = kv_transfer_core::ExposeError<ExposeErrorKind>;

/// Reasons of an [`ExposeError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExposeErrorKind {
    /// The lease's pool was not registered with this NIC.
    #[error("pool not registered with this NIC")]
    ForeignPool,
    /// No live connection to this peer.
    #[error("unknown or disconnected peer {0:?}")]
    UnknownPeer(PeerId),
    /// The NIC is shut down.
    #[error("NIC is shut down")]
    ShuttingDown,
}

/// Something that happened at this NIC that the application may care about.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InboundEvent {
    /// A connection came up (opened or accepted).
    PeerConnected {
        /// The peer as this NIC numbers it.
        peer: PeerId,
        /// The peer's name.
        name: String,
        /// The peer's listening endpoint.
        endpoint: String,
    },
    /// A peer notified that an operation on these tenancies completed (the
    /// data is in place); the exposures were settled with `Completed`.
    Notified {
        /// The peer.
        peer: PeerId,
        /// Key of the region.
        key: u64,
        /// Tenancies settled (stale ones left out).
        tenancies: Vec<Tenancy>,
    },
    /// The connection to the peer was torn down and fenced.
    PeerLost {
        /// The peer.
        peer: PeerId,
    },
    /// An application message from the peer ([`SimNic::send_message`]),
    /// reported here when no [`MessageHook`] is set.
    Message {
        /// The peer.
        peer: PeerId,
        /// The bytes, uninterpreted.
        bytes: Bytes,
    },
}

/// Receives the application messages of every connection
/// ([`SimNic::set_message_hook`]): the peer, its name, and the bytes (valid
/// for the call only: the receiver reuses its buffer).
///
/// It runs on the connection's receiving thread, in the order the frames
/// arrived, so it must return quickly and must not wait on this NIC (no
/// `fence`, `revoke` or `shutdown` from inside it). Sending is fine: it only
/// queues.
pub type MessageHook = Arc<dyn Fn(PeerId, &str, &[u8]) + Send + Sync>;

/// Called once with a raw operation's terminal status ([`SimNic::write_raw_with`]):
/// `Ok(Some(bytes))` for a read, `Ok(None)` for a write.
///
/// It runs on a NIC thread (the connection's receiver, a teardown, or the
/// poster's own thread when the connection was already fenced), so the same
/// rules as for a [`MessageHook`] apply.
pub type RawCallback = Box<dyn FnOnce(Result<Option<Bytes>, TransferError>) + Send>;

/// A completion queue for raw operations ([`SimNic::write_raw_registered`]):
/// one shared object receives the terminal status of every operation posted
/// to it, by the token given at post time, so a post allocates no callback
/// (what a verbs CQ is to its work requests).
///
/// It runs where a [`RawCallback`] runs, under the same rules.
pub trait RawCompletions: Send + Sync {
    /// The operation posted with `token` is terminal: `Ok(None)` for a write.
    fn complete(&self, token: u64, result: Result<Option<Bytes>, TransferError>);
}

/// A live connection, as [`SimNic::peers`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer as this NIC numbers it (never reused).
    pub peer: PeerId,
    /// The peer's name.
    pub name: String,
    /// The peer's listening endpoint.
    pub endpoint: String,
    /// Index of the connection at this NIC (what [`DropSpec`](crate::DropSpec) names).
    pub index: u32,
}

/// One decision of the fault plan, as the NIC applied it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRecord {
    /// Connection index.
    pub conn: u32,
    /// WR sequence number on that connection.
    pub seq: u64,
    /// Delay applied before sending, µs.
    pub delay_us: u64,
}

/// Where a raw access goes (see [`SimNic::write_raw`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawAccess {
    /// Target region's key.
    pub key: u64,
    /// Target address.
    pub addr: u64,
    /// Slot named by the access.
    pub slot: SlotId,
    /// Generation named by the access.
    pub generation: Generation,
}

impl RawAccess {
    /// The `index`-th slot of a descriptor.
    pub fn of(remote: &RemoteSlots, index: usize) -> Option<Self> {
        let s = remote.slots.get(index)?;
        Some(Self { key: remote.key, addr: s.addr, slot: s.slot, generation: s.generation })
    }

    /// The wire header of an access of `len` bytes here, as work request `wr_id`.
    pub fn header(&self, wr_id: u64, len: u32) -> AccessHeader {
        AccessHeader { wr_id, key: self.key, addr: self.addr, slot: self.slot, generation: self.generation, len }
    }
}

#[derive(Default)]
struct RawSlot {
    done: Mutex<Option<Result<Option<Bytes>, TransferError>>>,
    cv: Condvar,
}

/// Completion of a raw access: [`wait`](RawHandle::wait) for its terminal status.
#[derive(Clone)]
pub struct RawHandle {
    slot: Arc<RawSlot>,
}

impl std::fmt::Debug for RawHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawHandle").field("done", &lock(&self.slot.done).is_some()).finish()
    }
}

impl RawHandle {
    /// A handle and the callback that completes it.
    fn pair() -> (Self, RawCallback) {
        let slot = Arc::new(RawSlot::default());
        let s = slot.clone();
        let done: RawCallback = Box::new(move |res| {
            *lock(&s.done) = Some(res);
            s.cv.notify_all();
        });
        (Self { slot }, done)
    }

    /// Waits up to `timeout` for the terminal status: `Ok(Some(bytes))` for a
    /// read, `Ok(None)` for a write. `None` if still in flight.
    pub fn wait(&self, timeout: Duration) -> Option<Result<Option<Bytes>, TransferError>> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.slot.done);
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = match self.slot.cv.wait_timeout(g, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

// ---------------------------------------------------------------------------
// Registered regions and their bindings

struct Binding {
    /// Generation bound for remote access (0 = none; `| REVOKING` = being revoked).
    gen: AtomicU64,
    /// The connection the slot is exposed to.
    peer: AtomicU32,
    /// Accesses between their generation check and the end of their copy.
    inflight: AtomicU32,
}

struct Reg {
    key: u64,
    pool: SlotPool,
    authority: SettlementAuthority,
    clock: Arc<dyn Clock>,
    region: Arc<dyn Region>,
    /// Host address of the region's first byte, 0 if not host memory.
    base: usize,
    addr: u64,
    len: usize,
    slot_size: usize,
    bindings: Box<[Binding]>,
    revokers: AtomicU32,
    drain: (Mutex<()>, Condvar),
}

#[derive(Debug, PartialEq, Eq)]
enum RevokeOutcome {
    Revoked,
    NotBound,
    TimedOut,
}

impl Reg {
    fn end_access(&self, slot: SlotId) {
        if let Some(b) = self.bindings.get(slot.0 as usize) {
            if b.inflight.fetch_sub(1, Ordering::SeqCst) == 1 && self.revokers.load(Ordering::SeqCst) > 0 {
                let _g = lock(&self.drain.0);
                self.drain.1.notify_all();
            }
        }
    }

    /// Whether `t` is bound here for remote access by `peer` (revoking or not).
    fn is_bound(&self, t: Tenancy, peer: PeerId) -> bool {
        self.bindings.get(t.slot.0 as usize).is_some_and(|b| {
            b.gen.load(Ordering::SeqCst) & !REVOKING == t.generation.0 && b.peer.load(Ordering::SeqCst) == peer.0
        })
    }

    /// Invalidates the binding of `t` and waits (bounded) until no access
    /// that passed the generation check is still copying.
    fn revoke(&self, t: Tenancy, wait: Duration) -> RevokeOutcome {
        let Some(b) = self.bindings.get(t.slot.0 as usize) else { return RevokeOutcome::NotBound };
        let g = t.generation.0;
        if b.gen.compare_exchange(g, g | REVOKING, Ordering::SeqCst, Ordering::SeqCst).is_err()
            && b.gen.load(Ordering::SeqCst) != g | REVOKING
        {
            return RevokeOutcome::NotBound;
        }
        let deadline = Instant::now() + wait;
        self.revokers.fetch_add(1, Ordering::SeqCst);
        let mut guard = lock(&self.drain.0);
        let drained = loop {
            if b.inflight.load(Ordering::SeqCst) == 0 {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            guard = match self.drain.1.wait_timeout(guard, (deadline - now).min(Duration::from_millis(10))) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        drop(guard);
        self.revokers.fetch_sub(1, Ordering::SeqCst);
        if !drained {
            return RevokeOutcome::TimedOut;
        }
        let _ = b.gen.compare_exchange(g | REVOKING, 0, Ordering::SeqCst, Ordering::SeqCst);
        RevokeOutcome::Revoked
    }

    /// Reads `len` bytes from `r` into the region at `off`. `Ok(false)`: the
    /// region refused (device memory without a driver).
    fn fill_from(&self, r: &mut impl Read, off: usize, len: usize) -> io::Result<bool> {
        if self.base != 0 && off.checked_add(len).is_some_and(|e| e <= self.len) {
            // SAFETY: `[off, off+len)` lies inside the region (checked), whose
            // memory stays allocated while `self.region` lives. Concurrent
            // access to these bytes is what leases rule out; where it still
            // happens (the naive positive control) it races like DMA does.
            let dst = unsafe { std::slice::from_raw_parts_mut((self.base + off) as *mut u8, len) };
            r.read_exact(dst)?;
            return Ok(true);
        }
        let mut v = vec![0u8; len];
        r.read_exact(&mut v)?;
        Ok(self.region.write(off, &v).is_ok())
    }

    /// Borrow of `[off, off+len)` for sending, or a copy for non-host memory.
    fn source(&self, off: usize, len: usize) -> Result<SrcBytes<'_>, TransferError> {
        if self.base != 0 && off.checked_add(len).is_some_and(|e| e <= self.len) {
            // SAFETY: in bounds (checked); the region outlives the borrow
            // (`self` holds it). The operation's lease keeps the slot exposed
            // to this operation until its terminal status, after the send; a
            // raw registered write's caller keeps the bytes unchanged until
            // its completion (`SimNic::write_raw_registered`).
            let s = unsafe { std::slice::from_raw_parts((self.base + off) as *const u8, len) };
            return Ok(SrcBytes::Borrowed(s));
        }
        let mut v = vec![0u8; len];
        self.region.read(off, &mut v).map_err(|e| TransferError::Engine {
            engine: "tcp-sim",
            code: 2,
            message: e.to_string(),
        })?;
        Ok(SrcBytes::Owned(v))
    }
}

enum SrcBytes<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl SrcBytes<'_> {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Borrowed(s) => s,
            Self::Owned(v) => v,
        }
    }
}

// ---------------------------------------------------------------------------
// Connections

enum Src {
    Local { reg: Arc<Reg>, off: usize, len: usize },
    Owned(Bytes),
}

enum Outgoing {
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
enum Dest {
    Local { reg: Arc<Reg>, off: usize, len: usize },
    Buf(usize),
}

struct WrEntry {
    op: u64,
    key: u64,
    tenancy: Tenancy,
    sent: bool,
    aborted: bool,
    dest: Option<Dest>,
}

enum OpDone {
    Lease(Completer),
    Raw(RawCallback),
    Queue(Arc<dyn RawCompletions>, u64),
}

struct OpEntry {
    done: OpDone,
    reg: Option<Arc<Reg>>,
    remaining: usize,
    err: Option<TransferError>,
    data: Option<Bytes>,
    notify: Option<TenancyList>,
    sent_any: bool,
}

impl OpEntry {
    fn cancel_requested(&self) -> bool {
        match &self.done {
            OpDone::Lease(c) => c.cancel_requested(),
            OpDone::Raw(_) | OpDone::Queue(..) => false,
        }
    }
}

struct PendingAbort {
    list: TenancyList,
    waiting: HashSet<u64>,
}

#[derive(Default)]
struct ConnState {
    closed: bool,
    wrs: HashMap<u64, WrEntry>,
    ops: HashMap<u64, OpEntry>,
    aborts: Vec<PendingAbort>,
}

#[derive(Default)]
struct TxQueue {
    q: VecDeque<Outgoing>,
    closed: bool,
    /// The sender is asleep on the condvar and nobody has rung for it yet.
    /// A busy (or already rung) sender is not woken again: a condvar
    /// notification is a syscall, paid per queued item otherwise.
    waiting: bool,
}

/// A connection's send queue and the condvar its sender sleeps on.
#[derive(Default)]
struct Tx {
    q: Mutex<TxQueue>,
    cv: Condvar,
}

impl Tx {
    /// Queues an application message: appended to the Message frame at the
    /// back of the queue if there is one with room (the sender has not taken
    /// it yet), so a burst of small messages leaves as one frame.
    fn push_message(self: &Arc<Self>, msg: &[u8]) {
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
    fn push(self: &Arc<Self>, items: impl IntoIterator<Item = Outgoing>) {
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
    static DOORBELLS: std::cell::RefCell<Option<Vec<Arc<Tx>>>> = const { std::cell::RefCell::new(None) };
}

/// Wakes `tx`'s sender now, or at the end of the current burst on a
/// receiving thread.
fn ring(tx: &Arc<Tx>) {
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
fn ring_before_read(r: &BufReader<TcpStream>, len: usize) {
    if r.buffer().len() < len {
        ring_deferred();
    }
}

/// Rings every deferred doorbell of this thread.
fn ring_deferred() {
    let due = DOORBELLS.with(|d| d.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default());
    for tx in due {
        tx.cv.notify_one();
    }
}

struct Conn {
    peer: PeerId,
    index: u32,
    name: String,
    endpoint: String,
    stream: TcpStream,
    tx: Arc<Tx>,
    st: Mutex<ConnState>,
    dead: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Conn {
    fn send(&self, item: Outgoing) {
        self.tx.push(std::iter::once(item));
    }
    fn send_frame(&self, body: &Body) {
        match wire::encode_head(body, 0) {
            Ok(f) => self.send(Outgoing::Frame(f)),
            Err(e) => tracing::warn!(error = %e, "cannot encode frame"),
        }
    }
    fn close_tx(&self) {
        lock(&self.tx.q).closed = true;
        self.tx.cv.notify_all();
    }
}

// ---------------------------------------------------------------------------
// The NIC

#[derive(Default)]
struct SignalState {
    kicked: bool,
    dead: Vec<PeerId>,
}

#[derive(Default)]
struct Signal {
    m: Mutex<SignalState>,
    cv: Condvar,
}

impl Signal {
    fn kick(&self) {
        lock(&self.m).kicked = true;
        self.cv.notify_all();
    }
    fn dead(&self, peer: PeerId) {
        lock(&self.m).dead.push(peer);
        self.cv.notify_all();
    }
}

struct NicInner {
    cfg: NicConfig,
    endpoint: String,
    key_salt: u64,
    regs: RwLock<Vec<Arc<Reg>>>,
    conns: Mutex<HashMap<PeerId, Arc<Conn>>>,
    fenced: Mutex<HashSet<PeerId>>,
    next_peer: AtomicU32,
    next_conn_index: AtomicU32,
    next_wr: AtomicU64,
    next_op: AtomicU64,
    next_key: AtomicU64,
    message_hook: RwLock<Option<MessageHook>>,
    signal: Arc<Signal>,
    counters: Counters,
    events: Mutex<VecDeque<InboundEvent>>,
    events_cv: Condvar,
    shutdown: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    fault_log: Mutex<Vec<FaultRecord>>,
    last_decode_error: Mutex<Option<DecodeError>>,
}

struct Owner {
    inner: Arc<NicInner>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.inner.shutdown_graceful();
    }
}

/// A simulated RDMA NIC over loopback TCP. Cheap to clone; the NIC shuts
/// down (fencing every connection) when the last clone is dropped.
///
/// ```
/// use backend_tcp_sim::{block_on, NicConfig, SimNic};
/// use kv_transfer_core::{HostRegion, PoolConfig, Transfer, TransferOptions};
/// use std::sync::Arc;
///
/// // Decode side: a NIC with a registered pool.
/// let decode = SimNic::start(NicConfig::new("decode")).unwrap();
/// let dpool = decode.register_pool(Arc::new(HostRegion::new(4 * 4096).unwrap()), PoolConfig::new(4096)).unwrap();
/// // Prefill side.
/// let prefill = SimNic::start(NicConfig::new("prefill")).unwrap();
/// let ppool = prefill.register_pool(Arc::new(HostRegion::new(4 * 4096).unwrap()), PoolConfig::new(4096)).unwrap();
///
/// // Prefill connects; decode learns the peer and exposes two slots to it.
/// prefill.connect(decode.endpoint()).unwrap();
/// let peer = decode.wait_for_peer("prefill", std::time::Duration::from_secs(5)).unwrap();
/// let (exposed, remote) = decode.expose(dpool.reserve(2).unwrap(), peer).unwrap();
///
/// // Prefill fills two slots and writes them; the NOTIFY settles decode's exposure.
/// let mut src = ppool.reserve(2).unwrap();
/// src.write_at(0, 0, &[1u8; 4096]).unwrap();
/// src.write_at(1, 0, &[2u8; 4096]).unwrap();
/// let out = block_on(async { prefill.write(src, &remote, TransferOptions::default()).await.unwrap().await }).unwrap();
/// assert_eq!(out.result, Ok(()));
///
/// let settled = block_on(exposed.settled());
/// let bytes = settled.bytes().unwrap();
/// assert!(bytes[..4096].iter().all(|&b| b == 1) && bytes[4096..].iter().all(|&b| b == 2));
/// ```
#[derive(Clone)]
pub struct SimNic {
    inner: Arc<NicInner>,
    _owner: Arc<Owner>,
}

impl std::fmt::Debug for SimNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimNic").field("name", &self.inner.cfg.name).field("endpoint", &self.inner.endpoint).finish()
    }
}

impl SimNic {
    /// Starts a NIC: binds its listener and starts its acceptor and
    /// escalation driver.
    pub fn start(cfg: NicConfig) -> Result<SimNic, NicError> {
        let listener = TcpListener::bind(&cfg.listen)?;
        let endpoint = listener.local_addr()?.to_string();
        static NICS: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let salt = crate::fault::splitmix64(
            now ^ (u64::from(std::process::id()) << 32)
                ^ crate::fault::splitmix64(NICS.fetch_add(1, Ordering::Relaxed)),
        );
        let inner = Arc::new(NicInner {
            cfg,
            endpoint,
            key_salt: salt & 0xFFFF_FFFF_0000_0000,
            regs: RwLock::new(Vec::new()),
            conns: Mutex::new(HashMap::default()),
            fenced: Mutex::new(HashSet::default()),
            next_peer: AtomicU32::new(1),
            next_conn_index: AtomicU32::new(0),
            next_wr: AtomicU64::new(1),
            next_op: AtomicU64::new(1),
            next_key: AtomicU64::new(1),
            message_hook: RwLock::new(None),
            signal: Arc::new(Signal::default()),
            counters: Counters::default(),
            events: Mutex::new(VecDeque::new()),
            events_cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            fault_log: Mutex::new(Vec::new()),
            last_decode_error: Mutex::new(None),
        });
        let a = inner.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("sim-accept-{}", inner.cfg.name))
            .spawn(move || a.accept_loop(listener))?;
        let d = inner.clone();
        let driver = std::thread::Builder::new()
            .name(format!("sim-driver-{}", inner.cfg.name))
            .spawn(move || d.driver_loop())?;
        lock(&inner.threads).extend([acceptor, driver]);
        Ok(SimNic { _owner: Arc::new(Owner { inner: inner.clone() }), inner })
    }

    /// The NIC's name.
    pub fn name(&self) -> &str {
        &self.inner.cfg.name
    }
    /// Where the NIC listens (`127.0.0.1:port`); [`RemoteSlots::endpoint`] carries it.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }
    /// The release policy.
    pub fn policy(&self) -> ReleasePolicy {
        self.inner.cfg.policy
    }
    /// A snapshot of the counters.
    pub fn stats(&self) -> NicStats {
        self.inner.counters.snapshot()
    }
    /// The last frame decoding error seen on any connection.
    pub fn last_decode_error(&self) -> Option<DecodeError> {
        lock(&self.inner.last_decode_error).clone()
    }
    /// The fault decisions applied so far (per-WR delays), in order per connection.
    pub fn fault_log(&self) -> Vec<FaultRecord> {
        lock(&self.inner.fault_log).clone()
    }

    /// Registers `region`, builds its [`SlotPool`] (keeping the pool's
    /// settlement authority inside the NIC) and assigns it a key.
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, NicError> {
        if self.inner.shutdown.load(Ordering::SeqCst) {
            return Err(NicError::ShuttingDown);
        }
        let clock = config.clock.clone();
        let slot_size = config.slot_size;
        let (pool, authority) = SlotPool::new(region.clone(), config)?;
        let signal = self.inner.signal.clone();
        authority.on_quarantine(move || signal.kick());
        let key = self.inner.key_salt | self.inner.next_key.fetch_add(1, Ordering::Relaxed);
        let base = region.host_ptr().map_or(0, |p| p.as_ptr() as usize);
        let bindings = (0..pool.capacity())
            .map(|_| Binding { gen: AtomicU64::new(0), peer: AtomicU32::new(0), inflight: AtomicU32::new(0) })
            .collect();
        let reg = Reg {
            key,
            pool: pool.clone(),
            authority,
            clock,
            addr: region.addr(),
            len: region.len(),
            region,
            base,
            slot_size,
            bindings,
            revokers: AtomicU32::new(0),
            drain: (Mutex::new(()), Condvar::new()),
        };
        self.inner.regs.write().unwrap_or_else(|p| p.into_inner()).push(Arc::new(reg));
        Ok(pool)
    }

    /// The key of a pool registered here.
    pub fn key_of(&self, pool: &SlotPool) -> Option<u64> {
        self.inner.reg_for_pool(pool.id()).map(|r| r.key)
    }

    /// A connection to the NIC listening at `endpoint`: an existing live one
    /// (opened or accepted) if there is one, otherwise a new one.
    pub fn connect(&self, endpoint: &str) -> Result<PeerId, NicError> {
        if let Some(c) = self.inner.conn_for_endpoint(endpoint) {
            return Ok(c.peer);
        }
        self.connect_new(endpoint)
    }

    /// Always opens a new connection to `endpoint` (a new [`PeerId`]).
    pub fn connect_new(&self, endpoint: &str) -> Result<PeerId, NicError> {
        self.inner.connect_new(endpoint).map(|c| c.peer)
    }

    /// Live connections.
    pub fn peers(&self) -> Vec<PeerInfo> {
        let mut v: Vec<_> = lock(&self.inner.conns)
            .values()
            .map(|c| PeerInfo { peer: c.peer, name: c.name.clone(), endpoint: c.endpoint.clone(), index: c.index })
            .collect();
        v.sort_by_key(|p| p.peer);
        v
    }

    /// A live connection to a NIC named `name`.
    pub fn peer_by_name(&self, name: &str) -> Option<PeerId> {
        self.peers().into_iter().find(|p| p.name == name).map(|p| p.peer)
    }

    /// Waits (bounded, polling every ms) for a connection from a NIC named `name`.
    pub fn wait_for_peer(&self, name: &str, timeout: Duration) -> Option<PeerId> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(p) = self.peer_by_name(name) {
                return Some(p);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Exposes a lease to `peer` for remote access: binds each slot's
    /// generation to the peer's connection at the NIC, then exposes the lease
    /// (core's `expose`) with this region's key and this NIC's endpoint.
    /// From here on the slots leave the lease only with a proof: a NOTIFY or
    /// ABORT_ACK from the peer (`Completed`), a revocation (`Revoked`) or a
    /// fence (`Fenced`).
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        if self.inner.shutdown.load(Ordering::SeqCst) {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ShuttingDown });
        }
        let Some(reg) = self.inner.reg_for_pool(lease.pool().id()) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ForeignPool });
        };
        let conns = lock(&self.inner.conns);
        if !conns.get(&peer).is_some_and(|c| !c.dead.load(Ordering::SeqCst)) {
            return Err(ExposeError { lease, kind: ExposeErrorKind::UnknownPeer(peer) });
        }
        for t in lease.tenancies() {
            if let Some(b) = reg.bindings.get(t.slot.0 as usize) {
                b.peer.store(peer.0, Ordering::SeqCst);
                b.gen.store(t.generation.0, Ordering::SeqCst);
            }
        }
        let out = lease.expose(peer, reg.key, self.inner.endpoint.clone());
        drop(conns);
        tracing::trace!(peer = peer.0, slots = out.0.len(), "exposed at NIC");
        Ok(out)
    }

    /// Revokes remote access to an exposed lease: clears its bindings, waits
    /// (bounded by `revoke_wait`) for in-flight applies to drain, and delivers
    /// a `Revoked` proof. Returns how many slots were revoked; the lease can
    /// then be settled with `try_settled()` if all were.
    pub fn revoke(&self, lease: &SlotLease<Exposed>) -> usize {
        let Some(reg) = self.inner.reg_for_pool(lease.pool().id()) else { return 0 };
        self.inner.revoke_tenancies(&reg, lease.tenancies())
    }

    /// Fences the connection to `peer`: shuts it down, joins its threads,
    /// fails its in-flight operations (`Transport`) and delivers a `Fenced`
    /// proof for every exposure to that peer. Returns whether there was a
    /// connection (or an earlier fence) to prove.
    pub fn fence(&self, peer: PeerId) -> bool {
        self.inner.teardown(peer, "fenced on request")
    }

    /// Wakes the escalation driver now (after advancing a manual clock).
    pub fn kick(&self) {
        self.inner.signal.kick();
    }

    /// Waits (bounded) for the next inbound event.
    pub fn next_event(&self, timeout: Duration) -> Option<InboundEvent> {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.inner.events);
        loop {
            if let Some(e) = q.pop_front() {
                return Some(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            q = match self.inner.events_cv.wait_timeout(q, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Simulates the process dying: every socket is shut down without
    /// goodbyes, threads stop, no proof is minted here. Peers see their
    /// connections drop and fence them.
    pub fn crash(&self) {
        let inner = &self.inner;
        inner.shutdown.store(true, Ordering::SeqCst);
        let conns: Vec<_> = lock(&inner.conns).values().cloned().collect();
        for c in conns {
            c.dead.store(true, Ordering::SeqCst);
            let _ = c.stream.shutdown(Shutdown::Both);
            c.close_tx();
        }
        inner.wake_acceptor();
        inner.signal.kick();
    }

    /// Shuts down gracefully: fences every connection (proofs delivered),
    /// stops the threads. Also runs when the last clone is dropped.
    pub fn shutdown(&self) {
        self.inner.shutdown_graceful();
    }

    /// Posts a raw one-sided WRITE of `data` to `access` over the connection
    /// to `peer`, outside any lease (for conformance tests and backends that
    /// build their own semantics on this fabric; the data is owned, so no
    /// local slot is involved).
    pub fn write_raw(&self, peer: PeerId, access: RawAccess, data: Bytes) -> Result<RawHandle, NicError> {
        let (handle, done) = RawHandle::pair();
        self.inner.post_raw(peer, access, Some(Src::Owned(data)), 0, None, OpDone::Raw(done))?;
        Ok(handle)
    }

    /// Posts a raw one-sided READ of `len` bytes at `access`.
    pub fn read_raw(&self, peer: PeerId, access: RawAccess, len: u32) -> Result<RawHandle, NicError> {
        let (handle, done) = RawHandle::pair();
        self.inner.post_raw(peer, access, None, len, None, OpDone::Raw(done))?;
        Ok(handle)
    }

    /// [`write_raw`](Self::write_raw) with a completion callback instead of a
    /// handle: `on_done` runs exactly once if this returns `Ok`, never if it
    /// returns `Err`. For backends that drive their own completion queue, so
    /// that no thread has to wait on a handle (see [`RawCallback`] for where
    /// it runs).
    pub fn write_raw_with(
        &self,
        peer: PeerId,
        access: RawAccess,
        data: Bytes,
        on_done: RawCallback,
    ) -> Result<(), NicError> {
        self.inner.post_raw(peer, access, Some(Src::Owned(data)), 0, None, OpDone::Raw(on_done))
    }

    /// A raw one-sided WRITE of `len` bytes at `offset` of this NIC's own
    /// region `local_key` (registered with [`register_pool`](Self::register_pool)),
    /// sent from that memory as a lease's WRITE is (no copy into an owned
    /// buffer), completing to `cq` with `token` (no callback to allocate).
    ///
    /// With a non-empty `imm` (at most [`wire::MAX_IMM`] bytes) it is a
    /// WRITE_WITH_IMM: once the target applied the bytes, and only then, its
    /// application receives `imm` as a message ([`MessageHook`]), in order
    /// with the connection's other messages; a refused write delivers
    /// nothing there (its completion here carries the reason).
    ///
    /// The caller keeps those bytes unchanged, and the region registered,
    /// until the completion: the NIC reads them while it sends. `cq`
    /// receives exactly one completion if this returns `Ok`, none if it
    /// returns `Err`.
    pub fn write_raw_registered(
        &self,
        peer: PeerId,
        access: RawAccess,
        (local_key, offset, len): (u64, usize, usize),
        imm: &[u8],
        cq: Arc<dyn RawCompletions>,
        token: u64,
    ) -> Result<(), NicError> {
        let imm = match imm {
            [] => None,
            b => Some(wire::Immediate::new(b).ok_or(NicError::TooLarge(b.len()))?),
        };
        let bad = || NicError::LocalRange { key: local_key, offset, len };
        let reg = self.inner.reg_for_key(local_key).ok_or_else(bad)?;
        if !offset.checked_add(len).is_some_and(|end| end <= reg.len) {
            return Err(bad());
        }
        let src = Src::Local { reg, off: offset, len };
        self.inner.post_raw(peer, access, Some(src), 0, imm, OpDone::Queue(cq, token))
    }

    /// [`read_raw`](Self::read_raw) with a completion callback; see
    /// [`write_raw_with`](Self::write_raw_with).
    pub fn read_raw_with(
        &self,
        peer: PeerId,
        access: RawAccess,
        len: u32,
        on_done: RawCallback,
    ) -> Result<(), NicError> {
        self.inner.post_raw(peer, access, None, len, None, OpDone::Raw(on_done))
    }

    /// Sends an application message to `peer` on the data connection, after
    /// every frame already queued there (like a SEND on an RC queue pair).
    /// Delivered at most once, in order, to the peer's [`MessageHook`] (or
    /// as [`InboundEvent::Message`]). At most [`wire::MAX_CONTROL`] bytes.
    pub fn send_message(&self, peer: PeerId, msg: &[u8]) -> Result<(), NicError> {
        self.inner.send_message(peer, msg)
    }

    /// Whether the connection to `peer` is up (not torn down or lost).
    pub fn is_connected(&self, peer: PeerId) -> bool {
        self.inner.conn(peer).is_some_and(|c| !c.dead.load(Ordering::SeqCst))
    }

    /// Where inbound application messages go: the hook, or (with `None`) the
    /// event queue ([`next_event`](Self::next_event)).
    pub fn set_message_hook(&self, hook: Option<MessageHook>) {
        *self.inner.message_hook.write().unwrap_or_else(|p| p.into_inner()) = hook;
    }
}

impl PostNow for SimNic {
    /// Registers the operation (one WR per slot) with the connection to
    /// `remote.endpoint` (opened on first use, blocking briefly) and returns
    /// at once; the NIC's receiver completes it at its terminal status.
    fn post_now(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        self.inner.post(op, local, remote, opts)
    }
}

kv_transfer_core::impl_transfer_via_post_now!(SimNic, "tcp-sim");

impl NicInner {
    fn reg_for_pool(&self, id: PoolId) -> Option<Arc<Reg>> {
        self.regs.read().unwrap_or_else(|p| p.into_inner()).iter().find(|r| r.pool.id() == id).cloned()
    }
    fn reg_for_key(&self, key: u64) -> Option<Arc<Reg>> {
        self.regs.read().unwrap_or_else(|p| p.into_inner()).iter().find(|r| r.key == key).cloned()
    }
    fn all_regs(&self) -> Vec<Arc<Reg>> {
        self.regs.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn conn(&self, peer: PeerId) -> Option<Arc<Conn>> {
        lock(&self.conns).get(&peer).filter(|c| !c.dead.load(Ordering::SeqCst)).cloned()
    }
    fn conn_for_endpoint(&self, endpoint: &str) -> Option<Arc<Conn>> {
        lock(&self.conns)
            .values()
            .filter(|c| c.endpoint == endpoint && !c.dead.load(Ordering::SeqCst))
            .min_by_key(|c| c.peer)
            .cloned()
    }

    fn event(&self, e: InboundEvent) {
        let mut q = lock(&self.events);
        if q.len() >= MAX_EVENTS {
            q.pop_front();
        }
        q.push_back(e);
        drop(q);
        self.events_cv.notify_all();
    }

    fn hello(&self) -> Result<Vec<u8>, NicError> {
        wire::encode_head(&Body::Hello { name: self.cfg.name.clone(), endpoint: self.endpoint.clone() }, 0)
            .map_err(|e| NicError::Handshake(e.to_string()))
    }

    fn read_hello(&self, s: &mut TcpStream) -> Result<(String, String), NicError> {
        let mut pre = [0u8; PREFIX_LEN];
        s.read_exact(&mut pre)?;
        let p = wire::decode_prefix(&pre).map_err(|e| NicError::Handshake(e.to_string()))?;
        let mut f = vec![0u8; p.fields_len()];
        s.read_exact(&mut f)?;
        match wire::decode_fields(&p, &f) {
            Ok(Body::Hello { name, endpoint }) => Ok((name, endpoint)),
            Ok(other) => Err(NicError::Handshake(format!("expected HELLO, got {:?}", other.kind()))),
            Err(e) => Err(NicError::Handshake(e.to_string())),
        }
    }

    fn connect_new(self: &Arc<Self>, endpoint: &str) -> Result<Arc<Conn>, NicError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(NicError::ShuttingDown);
        }
        let mut s = TcpStream::connect(endpoint)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(self.cfg.handshake_timeout))?;
        s.write_all(&self.hello()?)?;
        let (name, ep) = self.read_hello(&mut s)?;
        s.set_read_timeout(None)?;
        inc(&self.counters.connections_opened);
        self.add_conn(s, name, ep)
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for s in listener.incoming() {
            if self.shutdown.load(Ordering::SeqCst) {
                break;
            }
            let Ok(mut s) = s else { continue };
            let res = (|| -> Result<(), NicError> {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(self.cfg.handshake_timeout))?;
                let (name, ep) = self.read_hello(&mut s)?;
                s.write_all(&self.hello()?)?;
                s.set_read_timeout(None)?;
                inc(&self.counters.connections_accepted);
                self.add_conn(s, name, ep)?;
                Ok(())
            })();
            if let Err(e) = res {
                inc(&self.counters.malformed_frames);
                tracing::debug!(error = %e, "inbound handshake failed");
            }
        }
    }

    fn wake_acceptor(&self) {
        let _ = TcpStream::connect_timeout(
            &match self.endpoint.parse() {
                Ok(a) => a,
                Err(_) => return,
            },
            Duration::from_millis(200),
        );
    }

    fn add_conn(self: &Arc<Self>, s: TcpStream, name: String, endpoint: String) -> Result<Arc<Conn>, NicError> {
        set_socket_buffers(&s, self.cfg.socket_buffer);
        let peer = PeerId(self.next_peer.fetch_add(1, Ordering::SeqCst));
        let index = self.next_conn_index.fetch_add(1, Ordering::SeqCst);
        let rx_stream = s.try_clone()?;
        let tx_stream = s.try_clone()?;
        let conn = Arc::new(Conn {
            peer,
            index,
            name: name.clone(),
            endpoint: endpoint.clone(),
            stream: s,
            tx: Arc::default(),
            st: Mutex::new(ConnState::default()),
            dead: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        let mut conns = lock(&self.conns);
        if self.shutdown.load(Ordering::SeqCst) {
            let _ = conn.stream.shutdown(Shutdown::Both);
            return Err(NicError::ShuttingDown);
        }
        let (n1, c1) = (self.clone(), conn.clone());
        let rx = std::thread::Builder::new()
            .name(format!("sim-rx-{}-{}", self.cfg.name, peer.0))
            .spawn(move || n1.rx_loop(c1, rx_stream))?;
        let (n2, c2) = (self.clone(), conn.clone());
        let tx = std::thread::Builder::new()
            .name(format!("sim-tx-{}-{}", self.cfg.name, peer.0))
            .spawn(move || n2.tx_loop(c2, tx_stream))?;
        lock(&conn.threads).extend([rx, tx]);
        conns.insert(peer, conn.clone());
        drop(conns);
        tracing::debug!(nic = %self.cfg.name, peer = peer.0, remote = %name, "connection up");
        self.event(InboundEvent::PeerConnected { peer, name, endpoint });
        Ok(conn)
    }

    // ----- posting -----

    fn post(
        self: &Arc<Self>,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(PostError { lease: local, kind: PostErrorKind::ShuttingDown });
        }
        let Some(reg) = self.reg_for_pool(local.pool().id()) else {
            return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool });
        };
        if reg.slot_size > wire::MAX_PAYLOAD as usize {
            return Err(PostError { lease: local, kind: PostErrorKind::Unsupported("slots larger than 64 MiB") });
        }
        let conn = match self.conn_for_endpoint(&remote.endpoint) {
            Some(c) => c,
            None => match self.connect_new(&remote.endpoint) {
                Ok(c) => c,
                Err(e) => return Err(PostError { lease: local, kind: PostErrorKind::Peer(e.to_string()) }),
            },
        };
        let span = tracing::trace_span!("post", ?op, peer = conn.peer.0, slots = local.len());
        let _e = span.enter();
        let exposed = local.expose_local(conn.peer);
        let (handle, completer) = TransferHandle::pair(exposed);
        let ts: Vec<Tenancy> = completer.lease().tenancies().to_vec();
        let notify = opts.notify.then(|| TenancyList { key: remote.key, tenancies: remote.tenancies() });
        let mut items = Vec::with_capacity(ts.len());
        let mut wrs = Vec::with_capacity(ts.len());
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let len = reg.slot_size;
        for (t, rs) in ts.iter().zip(&remote.slots) {
            let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
            let off = t.slot.0 as usize * len;
            let h = AccessHeader {
                wr_id,
                key: remote.key,
                addr: rs.addr,
                slot: rs.slot,
                generation: rs.generation,
                len: len as u32,
            };
            let (body, pl, src, dest) = match op {
                Op::Write => (Body::Write(h), len, Some(Src::Local { reg: reg.clone(), off, len }), None),
                Op::Read => (Body::Read(h), 0, None, Some(Dest::Local { reg: reg.clone(), off, len })),
            };
            let head = match wire::encode_head(&body, pl) {
                Ok(h) => h,
                Err(e) => {
                    // Unreachable by the size check above; fail honestly anyway.
                    let proof = reg.authority.completed_lease(completer.lease());
                    let _ = completer.complete(proof, Err(TransferError::Transport(e.to_string())));
                    return Ok(handle);
                }
            };
            items.push(Outgoing::Wr { wr_id, op: op_id, head, src });
            wrs.push((
                wr_id,
                WrEntry { op: op_id, key: remote.key, tenancy: rs.tenancy(), sent: false, aborted: false, dest },
            ));
        }
        add(&self.counters.wrs_posted, wrs.len() as u64);
        let entry = OpEntry {
            done: OpDone::Lease(completer),
            reg: Some(reg),
            remaining: wrs.len(),
            err: None,
            data: None,
            notify,
            sent_any: false,
        };
        self.submit(&conn, op_id, entry, wrs, items);
        Ok(handle)
    }

    fn post_raw(
        self: &Arc<Self>,
        peer: PeerId,
        a: RawAccess,
        data: Option<Src>,
        read_len: u32,
        imm: Option<wire::Immediate>,
        done: OpDone,
    ) -> Result<(), NicError> {
        let conn = self.conn(peer).ok_or(NicError::UnknownPeer(peer))?;
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let len = match &data {
            None => read_len as usize,
            Some(Src::Owned(b)) => b.len(),
            Some(Src::Local { len, .. }) => *len,
        };
        if len > wire::MAX_PAYLOAD as usize {
            return Err(NicError::TooLarge(len));
        }
        let h = a.header(wr_id, len as u32);
        let (body, pl, dest) = match (&data, imm) {
            (Some(_), None) => (Body::Write(h), len, None),
            (Some(_), Some(imm)) => (Body::WriteImm(h, imm), len, None),
            (None, _) => (Body::Read(h), 0, Some(Dest::Buf(len))),
        };
        let head = wire::encode_head(&body, pl).map_err(|e| NicError::Handshake(e.to_string()))?;
        let entry = OpEntry { done, reg: None, remaining: 1, err: None, data: None, notify: None, sent_any: false };
        let wr = WrEntry {
            op: op_id,
            key: a.key,
            tenancy: Tenancy::new(a.slot, a.generation),
            sent: false,
            aborted: false,
            dest,
        };
        inc(&self.counters.wrs_posted);
        self.submit(&conn, op_id, entry, vec![(wr_id, wr)], vec![Outgoing::Wr { wr_id, op: op_id, head, src: data }]);
        Ok(())
    }

    fn send_message(&self, peer: PeerId, msg: &[u8]) -> Result<(), NicError> {
        if msg.len() + wire::RECORD_PREFIX > wire::MAX_CONTROL as usize {
            return Err(NicError::TooLarge(msg.len()));
        }
        let conn = self.conn(peer).filter(|c| !c.dead.load(Ordering::SeqCst)).ok_or(NicError::UnknownPeer(peer))?;
        inc(&self.counters.messages_sent);
        conn.tx.push_message(msg);
        Ok(())
    }

    fn on_message(
        &self,
        conn: &Conn,
        r: &mut BufReader<TcpStream>,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), RxExit> {
        ring_before_read(r, len);
        buf.resize(len, 0);
        r.read_exact(buf)?;
        let msgs = wire::split_messages(buf)?;
        add(&self.counters.messages_received, msgs.len() as u64);
        let hook = self.message_hook.read().unwrap_or_else(|p| p.into_inner()).clone();
        for m in msgs {
            self.deliver_message(conn, hook.as_ref(), m);
        }
        Ok(())
    }

    /// One application message (a record, or a WRITE's immediate) to the
    /// hook, or to the event queue without one.
    fn deliver_message(&self, conn: &Conn, hook: Option<&MessageHook>, m: &[u8]) {
        match hook {
            Some(h) => h(conn.peer, &conn.name, m),
            None => self.event(InboundEvent::Message { peer: conn.peer, bytes: Bytes::copy_from_slice(m) }),
        }
    }

    fn submit(&self, conn: &Arc<Conn>, op_id: u64, entry: OpEntry, wrs: Vec<(u64, WrEntry)>, items: Vec<Outgoing>) {
        let mut st = lock(&conn.st);
        if st.closed {
            // Torn down and joined already: nothing of this connection can
            // touch the lease any more.
            drop(st);
            self.finish_op(conn.peer, entry, Err(TransferError::Transport("connection fenced".into())), true);
            return;
        }
        st.ops.insert(op_id, entry);
        st.wrs.extend(wrs);
        drop(st);
        conn.tx.push(items);
    }

    // ----- sender -----

    fn tx_loop(self: Arc<Self>, conn: Arc<Conn>, mut stream: TcpStream) {
        let faults = &self.cfg.faults;
        let delays = faults.has_delays();
        let mut budget = faults.drop_connection.filter(|d| d.conn_index == conn.index).map(|d| d.after_bytes);
        let mut seq = 0u64;
        let mut batch: Vec<Outgoing> = Vec::with_capacity(MAX_BATCH);
        'outer: loop {
            {
                let mut q = lock(&conn.tx.q);
                while q.q.is_empty() && !q.closed {
                    q.waiting = true;
                    q = match conn.tx.cv.wait(q) {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                    q.waiting = false;
                }
                if q.closed {
                    break;
                }
                let n = q.q.len().min(MAX_BATCH);
                batch.extend(q.q.drain(..n));
            }
            // Decide which WRs go: a canceled op that sent nothing yet, or a WR
            // the target asked to abort before it left, completes as canceled.
            let mut canceled = Vec::new();
            {
                let mut st = lock(&conn.st);
                let st = &mut *st;
                batch.retain(|item| {
                    let Outgoing::Wr { wr_id, op, .. } = item else { return true };
                    let aborted = st.wrs.get(wr_id).is_some_and(|w| w.aborted);
                    let Some(o) = st.ops.get_mut(op) else { return false };
                    if aborted || (!o.sent_any && o.cancel_requested()) {
                        canceled.push((*wr_id, aborted));
                        return false;
                    }
                    o.sent_any = true;
                    if let Some(w) = st.wrs.get_mut(wr_id) {
                        w.sent = true;
                    }
                    true
                });
            }
            // Build the gather list; flush before every faulted delay.
            let mut sources: Vec<Result<SrcBytes<'_>, TransferError>> = Vec::new();
            for item in &batch {
                if let Outgoing::Wr { src: Some(Src::Local { reg, off, len }), .. } = item {
                    sources.push(reg.source(*off, *len));
                }
            }
            let mut failed_src = Vec::new();
            let mut slices: Vec<&[u8]> = Vec::with_capacity(batch.len() * 2);
            let mut src_i = 0;
            for item in &batch {
                match item {
                    Outgoing::Frame(f) => slices.push(f),
                    Outgoing::Data { head, payload } => {
                        slices.push(head);
                        slices.push(payload);
                    }
                    Outgoing::Messages { head, records } => {
                        slices.push(head);
                        slices.push(records);
                    }
                    Outgoing::Wr { wr_id, head, src, .. } => {
                        let body: Option<&[u8]> = match src {
                            None => None,
                            Some(Src::Owned(b)) => Some(b),
                            Some(Src::Local { .. }) => {
                                let s = &sources[src_i];
                                src_i += 1;
                                match s {
                                    Ok(s) => Some(s.as_slice()),
                                    Err(e) => {
                                        failed_src.push((*wr_id, e.clone()));
                                        continue;
                                    }
                                }
                            }
                        };
                        if delays {
                            let d = faults.wr_delay(conn.index, seq);
                            {
                                let mut log = lock(&self.fault_log);
                                if log.len() < 1_000_000 {
                                    log.push(FaultRecord { conn: conn.index, seq, delay_us: d.as_micros() as u64 });
                                }
                            }
                            if !d.is_zero() {
                                if let Err(()) = self.flush(&conn, &mut stream, &mut slices, &mut budget) {
                                    break 'outer;
                                }
                                std::thread::sleep(d);
                            }
                        }
                        seq += 1;
                        slices.push(head);
                        if let Some(b) = body {
                            slices.push(b);
                        }
                    }
                }
            }
            if let Err(()) = self.flush(&conn, &mut stream, &mut slices, &mut budget) {
                break;
            }
            drop(slices);
            drop(sources);
            batch.clear();
            for (wr_id, aborted) in canceled {
                let e = if aborted {
                    TransferError::Engine { engine: "tcp-sim", code: 1, message: "aborted by the target".into() }
                } else {
                    TransferError::Canceled
                };
                inc(&self.counters.wrs_canceled);
                self.wr_terminal(&conn, wr_id, Err(e));
            }
            for (wr_id, e) in failed_src {
                self.wr_terminal(&conn, wr_id, Err(e));
            }
        }
        conn.dead.store(true, Ordering::SeqCst);
        self.signal.dead(conn.peer);
    }

    /// Writes the gathered slices (and clears them). On a socket error, or
    /// when the drop-connection fault's budget runs out, shuts the socket
    /// down and returns `Err`.
    fn flush(
        &self,
        conn: &Conn,
        stream: &mut TcpStream,
        slices: &mut Vec<&[u8]>,
        budget: &mut Option<u64>,
    ) -> Result<(), ()> {
        let total: u64 = slices.iter().map(|s| s.len() as u64).sum();
        let mut limit = total;
        let mut cut = false;
        if let Some(b) = budget {
            if total >= *b {
                limit = *b;
                cut = true;
            }
            *b -= limit;
        }
        let res = write_all_vectored(stream, slices, limit);
        slices.clear();
        if res.is_err() || cut {
            if cut {
                tracing::debug!(peer = conn.peer.0, "fault: dropping connection mid-stream");
            }
            let _ = stream.shutdown(Shutdown::Both);
            return Err(());
        }
        Ok(())
    }

    // ----- receiver -----

    fn rx_loop(self: Arc<Self>, conn: Arc<Conn>, stream: TcpStream) {
        DOORBELLS.with(|d| *d.borrow_mut() = Some(Vec::new()));
        let mut r = BufReader::with_capacity(8 << 10, stream);
        let mut fields = Vec::with_capacity(wire::READ_FIELDS);
        let res: Result<(), RxExit> = (|| loop {
            if r.buffer().is_empty() {
                // About to block on the socket: wake the senders owed.
                ring_deferred();
            }
            let mut pre = [0u8; PREFIX_LEN];
            r.read_exact(&mut pre)?;
            let p = wire::decode_prefix(&pre)?;
            fields.resize(p.fields_len(), 0);
            r.read_exact(&mut fields)?;
            let body = wire::decode_fields(&p, &fields)?;
            match body {
                Body::Write(h) => {
                    self.on_write(&conn, &mut r, h)?;
                }
                Body::WriteImm(h, imm) => {
                    // The immediate reaches the application only once the data landed.
                    if self.on_write(&conn, &mut r, h)? {
                        inc(&self.counters.messages_received);
                        let hook = self.message_hook.read().unwrap_or_else(|p| p.into_inner()).clone();
                        self.deliver_message(&conn, hook.as_ref(), imm.as_bytes());
                    }
                }
                Body::Read(h) => self.on_read(&conn, h),
                Body::ReadResp { wr_id, status } => self.on_read_resp(&conn, &mut r, wr_id, status, p.payload_len())?,
                Body::Completion { wr_id, status } => {
                    let res = match status {
                        WireStatus::Ok => Ok(None),
                        s => Err(status_error(s)),
                    };
                    self.wr_terminal(&conn, wr_id, res);
                }
                Body::Notify(l) => {
                    inc(&self.counters.notifications_received);
                    self.settle_from_peer(&conn, l, true);
                }
                Body::Abort(l) => self.on_abort(&conn, l),
                Body::AbortAck(l) => {
                    inc(&self.counters.abort_acks_received);
                    self.settle_from_peer(&conn, l, false);
                }
                Body::Message => self.on_message(&conn, &mut r, p.payload_len(), &mut fields)?,
                Body::Hello { .. } => {}
            }
        })();
        match res {
            Err(RxExit::Decode(e)) => {
                inc(&self.counters.malformed_frames);
                tracing::debug!(peer = conn.peer.0, error = %e, "malformed frame: tearing the connection down");
                *lock(&self.last_decode_error) = Some(e);
            }
            Err(RxExit::Io(e)) => tracing::trace!(peer = conn.peer.0, error = %e, "connection closed"),
            Err(RxExit::Closed) | Ok(()) => {}
        }
        ring_deferred();
        DOORBELLS.with(|d| *d.borrow_mut() = None);
        conn.dead.store(true, Ordering::SeqCst);
        let _ = conn.stream.shutdown(Shutdown::Both);
        self.signal.dead(conn.peer);
    }

    fn count_reject(&self, r: RejectReason, wrong_peer: bool) {
        let c = &self.counters;
        inc(match r {
            _ if wrong_peer => &c.rejected_wrong_peer,
            RejectReason::OutOfBounds => &c.rejected_out_of_bounds,
            RejectReason::UnknownKey => &c.rejected_unknown_key,
            RejectReason::StaleGeneration => &c.rejected_stale_generation,
            RejectReason::ZeroLength => &c.rejected_zero_length,
            RejectReason::Oversize => &c.rejected_oversize,
            _ => &c.rejected_out_of_bounds,
        });
    }

    /// The NIC's checks, in order: key, length, bounds, generation. On
    /// success the access is counted in flight on its slot (safe policy):
    /// call `end_access` when its copy is done.
    fn check_access(&self, conn: &Conn, h: &AccessHeader) -> Result<(Arc<Reg>, usize), RejectReason> {
        let res = self.check_access_inner(conn, h);
        if let Err((r, wrong_peer)) = res {
            self.count_reject(r, wrong_peer);
            if r == RejectReason::StaleGeneration {
                if let Some(reg) = self.reg_for_key(h.key) {
                    reg.authority.record_stale(1);
                }
            }
        }
        res.map_err(|e| e.0)
    }

    fn check_access_inner(&self, conn: &Conn, h: &AccessHeader) -> Result<(Arc<Reg>, usize), (RejectReason, bool)> {
        let reg = self.reg_for_key(h.key).ok_or((RejectReason::UnknownKey, false))?;
        let len = h.len as usize;
        if len == 0 {
            return Err((RejectReason::ZeroLength, false));
        }
        if h.len > self.cfg.max_wr_bytes {
            return Err((RejectReason::Oversize, false));
        }
        let oob = (RejectReason::OutOfBounds, false);
        let off = h.addr.checked_sub(reg.addr).ok_or(oob)? as usize;
        match off.checked_add(len) {
            Some(e) if e <= reg.len => {}
            _ => return Err(oob),
        }
        if self.cfg.policy == ReleasePolicy::Naive {
            return Ok((reg, off));
        }
        let start = (h.slot.0 as usize).checked_mul(reg.slot_size).ok_or(oob)?;
        if off < start || off + len > start + reg.slot_size {
            return Err(oob);
        }
        let b = reg.bindings.get(h.slot.0 as usize).ok_or(oob)?;
        b.inflight.fetch_add(1, Ordering::SeqCst);
        if b.gen.load(Ordering::SeqCst) != h.generation.0 {
            reg.end_access(h.slot);
            return Err((RejectReason::StaleGeneration, false));
        }
        if b.peer.load(Ordering::SeqCst) != conn.peer.0 {
            reg.end_access(h.slot);
            return Err((RejectReason::UnknownKey, true));
        }
        Ok((reg, off))
    }

    fn end_access(&self, reg: &Reg, slot: SlotId) {
        if self.cfg.policy == ReleasePolicy::Safe {
            reg.end_access(slot);
        }
    }

    fn completion(conn: &Conn, wr_id: u64, status: WireStatus) {
        conn.send_frame(&Body::Completion { wr_id, status });
    }

    /// Applies (or refuses) a WRITE and answers it; returns whether its
    /// bytes landed.
    fn on_write(&self, conn: &Conn, r: &mut BufReader<TcpStream>, h: AccessHeader) -> Result<bool, RxExit> {
        let len = h.len as usize;
        // The payload read may block (and so may a gate or a slow target).
        ring_before_read(r, len);
        // With a gate, the WRITE has arrived at the NIC (payload buffered) and
        // waits there, before any check, until the test opens the gate. While
        // it waits, the NIC still notices the peer going away.
        let mut held = None;
        if let Some(g) = &self.cfg.faults.gate {
            let mut buf = vec![0u8; len];
            r.read_exact(&mut buf)?;
            let sock = r.get_ref();
            let gone = || conn.dead.load(Ordering::SeqCst) || self.shutdown.load(Ordering::SeqCst) || peer_gone(sock);
            if !g.pass(gone) {
                return Err(RxExit::Closed);
            }
            held = Some(buf);
        }
        match self.check_access(conn, &h) {
            Err(reason) => {
                if held.is_none() {
                    io::copy(&mut r.by_ref().take(len as u64), &mut io::sink())?;
                }
                tracing::debug!(peer = conn.peer.0, ?reason, slot = h.slot.0, gen = h.generation.0, "write rejected");
                Self::completion(conn, h.wr_id, WireStatus::Rejected(reason));
                Ok(false)
            }
            Ok((reg, off)) => {
                let res = match &held {
                    Some(b) => reg.fill_from(&mut b.as_slice(), off, len),
                    None => reg.fill_from(r, off, len),
                };
                // A slow target is slow *while applying*: the access stays in
                // flight, so a revocation has to wait for it.
                if let Some(rate) = self.cfg.faults.slow_target_bytes_per_sec.filter(|r| *r > 0) {
                    std::thread::sleep(Duration::from_secs_f64(len as f64 / rate as f64));
                }
                self.end_access(&reg, h.slot);
                let applied = res?;
                if applied {
                    inc(&self.counters.writes_applied);
                    add(&self.counters.bytes_applied, len as u64);
                }
                Self::completion(conn, h.wr_id, if applied { WireStatus::Ok } else { WireStatus::TargetError });
                Ok(applied)
            }
        }
    }

    fn on_read(&self, conn: &Conn, h: AccessHeader) {
        let head = |status: WireStatus, n: usize| wire::encode_head(&Body::ReadResp { wr_id: h.wr_id, status }, n);
        let (status, payload) = match self.check_access(conn, &h) {
            Err(reason) => (WireStatus::Rejected(reason), Bytes::new()),
            Ok((reg, off)) => {
                let mut v = vec![0u8; h.len as usize];
                let ok = reg.region.read(off, &mut v).is_ok();
                self.end_access(&reg, h.slot);
                if ok {
                    inc(&self.counters.reads_served);
                    add(&self.counters.bytes_read, v.len() as u64);
                    (WireStatus::Ok, Bytes::from(v))
                } else {
                    (WireStatus::TargetError, Bytes::new())
                }
            }
        };
        match head(status, payload.len()) {
            Ok(head) => conn.send(Outgoing::Data { head, payload }),
            Err(e) => tracing::warn!(error = %e, "cannot encode read response"),
        }
    }

    fn on_read_resp(
        &self,
        conn: &Conn,
        r: &mut BufReader<TcpStream>,
        wr_id: u64,
        status: WireStatus,
        payload_len: usize,
    ) -> Result<(), RxExit> {
        ring_before_read(r, payload_len);
        let dest = lock(&conn.st).wrs.get(&wr_id).and_then(|w| w.dest.clone());
        let res = match (status, dest) {
            (WireStatus::Ok, Some(Dest::Local { reg, off, len })) if len == payload_len => {
                if reg.fill_from(r, off, len)? {
                    Ok(None)
                } else {
                    Err(TransferError::Engine { engine: "tcp-sim", code: 2, message: "local region refused".into() })
                }
            }
            (WireStatus::Ok, Some(Dest::Buf(len))) if len == payload_len => {
                let mut v = vec![0u8; len];
                r.read_exact(&mut v)?;
                Ok(Some(Bytes::from(v)))
            }
            (s, _) => {
                io::copy(&mut r.by_ref().take(payload_len as u64), &mut io::sink())?;
                Err(match s {
                    WireStatus::Ok => TransferError::Transport("read response of unexpected length".into()),
                    s => status_error(s),
                })
            }
        };
        self.wr_terminal(conn, wr_id, res);
        Ok(())
    }

    /// A WR reached its terminal status.
    fn wr_terminal(&self, conn: &Conn, wr_id: u64, res: Result<Option<Bytes>, TransferError>) {
        let mut st = lock(&conn.st);
        let Some(wr) = st.wrs.remove(&wr_id) else {
            tracing::debug!(peer = conn.peer.0, wr_id, "completion for an unknown work request dropped");
            return;
        };
        let mut acks = Vec::new();
        st.aborts.retain_mut(|a| {
            a.waiting.remove(&wr_id);
            if a.waiting.is_empty() {
                acks.push(std::mem::replace(&mut a.list, TenancyList { key: 0, tenancies: Vec::new() }));
                false
            } else {
                true
            }
        });
        match &res {
            Ok(_) => inc(&self.counters.wrs_ok),
            Err(_) => inc(&self.counters.wrs_failed),
        }
        let mut finished = None;
        if let Some(op) = st.ops.get_mut(&wr.op) {
            op.remaining = op.remaining.saturating_sub(1);
            match res {
                Ok(Some(b)) => op.data = Some(b),
                Ok(None) => {}
                Err(e) => {
                    op.err.get_or_insert(e);
                }
            }
            if op.remaining == 0 {
                finished = st.ops.remove(&wr.op);
            }
        }
        drop(st);
        for l in acks {
            inc(&self.counters.abort_acks_sent);
            conn.send_frame(&Body::AbortAck(l));
        }
        if let Some(mut op) = finished {
            let result = match op.err.take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            if result.is_ok() {
                if let Some(l) = op.notify.take() {
                    inc(&self.counters.notifications_sent);
                    conn.send_frame(&Body::Notify(l));
                }
            }
            self.finish_op(conn.peer, op, result, false);
        }
    }

    /// Hands an operation its terminal status. `fenced`: the connection is
    /// torn down and joined, so the proof is `Fenced`; otherwise every WR
    /// reached a terminal status and the proof is `Completed`.
    fn finish_op(&self, peer: PeerId, op: OpEntry, result: Result<(), TransferError>, fenced: bool) {
        match op.done {
            OpDone::Lease(c) => {
                let Some(reg) = op.reg else { return };
                let res = if fenced {
                    c.complete(reg.authority.fenced(peer), result)
                } else {
                    let proof = reg.authority.completed_lease(c.lease());
                    c.complete(proof, result)
                };
                if let Err(e) = res {
                    tracing::warn!(error = %e, "operation's proof did not settle its lease");
                }
            }
            OpDone::Raw(done) => done(result.map(|()| op.data)),
            OpDone::Queue(cq, token) => cq.complete(token, result.map(|()| op.data)),
        }
    }

    /// NOTIFY (`notify`) or ABORT_ACK from the peer: settle the tenancies it
    /// names that are bound to it here, after clearing their bindings.
    fn settle_from_peer(&self, conn: &Conn, l: TenancyList, notify: bool) {
        let Some(reg) = self.reg_for_key(l.key) else {
            add(&self.counters.notifications_stale, l.tenancies.len() as u64);
            return;
        };
        let mut ok = Vec::with_capacity(l.tenancies.len());
        for t in &l.tenancies {
            let valid = match self.cfg.policy {
                ReleasePolicy::Naive => true,
                ReleasePolicy::Safe => {
                    reg.is_bound(*t, conn.peer) && reg.revoke(*t, self.cfg.revoke_wait) == RevokeOutcome::Revoked
                }
            };
            if valid {
                ok.push(*t);
            } else {
                inc(&self.counters.notifications_stale);
                reg.authority.record_stale(1);
            }
        }
        if !ok.is_empty() {
            reg.authority.deliver(reg.authority.completed(&ok));
        }
        if notify {
            self.event(InboundEvent::Notified { peer: conn.peer, key: l.key, tenancies: ok });
        }
    }

    /// ABORT from the target: cancel what has not left yet, ack once every
    /// WR aimed at these tenancies is terminal.
    fn on_abort(&self, conn: &Conn, l: TenancyList) {
        inc(&self.counters.aborts_received);
        let set: HashSet<Tenancy> = l.tenancies.iter().copied().collect();
        let mut st = lock(&conn.st);
        let mut waiting = HashSet::default();
        for (id, w) in st.wrs.iter_mut() {
            if w.key == l.key && set.contains(&w.tenancy) {
                if !w.sent {
                    w.aborted = true;
                }
                waiting.insert(*id);
            }
        }
        if waiting.is_empty() {
            drop(st);
            inc(&self.counters.abort_acks_sent);
            conn.send_frame(&Body::AbortAck(l));
        } else {
            st.aborts.push(PendingAbort { list: l, waiting });
        }
    }

    // ----- escalation -----

    fn driver_loop(self: Arc<Self>) {
        loop {
            let dead = {
                let regs = self.all_regs();
                let mut timeout = DRIVER_TICK;
                for r in &regs {
                    if let Some(at) = r.authority.next_escalation_at() {
                        timeout = timeout.min(at.saturating_duration_since(r.clock.now()));
                    }
                }
                let mut s = lock(&self.signal.m);
                if !s.kicked && s.dead.is_empty() && !timeout.is_zero() {
                    s = match self.signal.cv.wait_timeout(s, timeout) {
                        Ok((g, _)) => g,
                        Err(p) => p.into_inner().0,
                    };
                }
                s.kicked = false;
                std::mem::take(&mut s.dead)
            };
            if self.shutdown.load(Ordering::SeqCst) {
                break;
            }
            for peer in dead {
                self.teardown(peer, "connection lost");
            }
            for reg in self.all_regs() {
                for a in reg.authority.poll_escalations(reg.clock.now()) {
                    self.escalate(&reg, a);
                }
            }
        }
    }

    fn escalate(&self, reg: &Reg, a: EscalationAction) {
        tracing::debug!(peer = a.peer.0, step = ?a.step, slots = a.tenancies.len(), "escalation");
        if self.cfg.policy == ReleasePolicy::Naive {
            if a.step == EscalationStep::RequestDrain {
                // THE BUG, on purpose: a proof without evidence.
                add(&self.counters.naive_releases, a.tenancies.len() as u64);
                reg.authority.deliver(reg.authority.completed(&a.tenancies));
            }
            return;
        }
        match a.step {
            EscalationStep::RequestDrain => {
                let ts: Vec<Tenancy> = a.tenancies.iter().copied().filter(|t| reg.is_bound(*t, a.peer)).collect();
                if ts.is_empty() {
                    return;
                }
                if let Some(conn) = self.conn(a.peer) {
                    for chunk in ts.chunks(wire::MAX_TENANCIES) {
                        inc(&self.counters.aborts_sent);
                        conn.send_frame(&Body::Abort(TenancyList { key: reg.key, tenancies: chunk.to_vec() }));
                    }
                }
            }
            EscalationStep::Revoke => {
                self.revoke_tenancies(reg, &a.tenancies);
            }
            EscalationStep::Fence => {
                self.teardown(a.peer, "escalation: fence");
            }
            EscalationStep::Exhausted => {
                tracing::error!(
                    peer = a.peer.0,
                    slots = a.tenancies.len(),
                    "escalation exhausted: slots stay quarantined (a leak, not a reuse)"
                );
            }
        }
    }

    fn revoke_tenancies(&self, reg: &Reg, ts: &[Tenancy]) -> usize {
        let mut done = Vec::new();
        for t in ts {
            match reg.revoke(*t, self.cfg.revoke_wait) {
                RevokeOutcome::Revoked => done.push(*t),
                RevokeOutcome::TimedOut => inc(&self.counters.revocations_timed_out),
                RevokeOutcome::NotBound => {}
            }
        }
        if !done.is_empty() {
            add(&self.counters.revocations, done.len() as u64);
            reg.authority.deliver(reg.authority.revoked(&done));
        }
        done.len()
    }

    /// Tears the connection to `peer` down, joins its threads, fails its
    /// operations and delivers `Fenced(peer)` to every pool.
    fn teardown(&self, peer: PeerId, reason: &str) -> bool {
        let conn = lock(&self.conns).remove(&peer);
        let Some(conn) = conn else {
            if lock(&self.fenced).contains(&peer) {
                for reg in self.all_regs() {
                    reg.authority.deliver(reg.authority.fenced(peer));
                }
                return true;
            }
            return false;
        };
        conn.dead.store(true, Ordering::SeqCst);
        conn.close_tx();
        let _ = conn.stream.shutdown(Shutdown::Both);
        let me = std::thread::current().id();
        for t in lock(&conn.threads).drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        lock(&self.fenced).insert(peer);
        inc(&self.counters.fences);
        let ops: Vec<OpEntry> = {
            let mut st = lock(&conn.st);
            st.closed = true;
            st.wrs.clear();
            st.aborts.clear();
            st.ops.drain().map(|(_, o)| o).collect()
        };
        lock(&conn.tx.q).q.clear();
        for op in ops {
            self.finish_op(peer, op, Err(TransferError::Transport(reason.to_string())), true);
        }
        for reg in self.all_regs() {
            reg.authority.deliver(reg.authority.fenced(peer));
        }
        tracing::debug!(nic = %self.cfg.name, peer = peer.0, reason, "connection fenced");
        self.event(InboundEvent::PeerLost { peer });
        true
    }

    fn shutdown_graceful(&self) {
        if self.shutdown.swap(true, Ordering::SeqCst) {
            // Already shut down or crashed: still join what is left.
            self.join_threads();
            return;
        }
        let peers: Vec<PeerId> = lock(&self.conns).keys().copied().collect();
        for p in peers {
            self.teardown(p, "NIC shut down");
        }
        self.join_threads();
    }

    fn join_threads(&self) {
        self.wake_acceptor();
        self.signal.kick();
        let me = std::thread::current().id();
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

/// Whether the peer closed or reset the socket, even with unread data
/// still queued (the kernel's TCP state says so without consuming anything).
fn peer_gone(s: &TcpStream) -> bool {
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    // SAFETY: `tcp_info` is plain data; zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket owned by `s`; `info` and `len` are live
    // and `len` holds the buffer's size.
    let rc = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    if rc != 0 {
        return true;
    }
    // Anything but ESTABLISHED: the peer sent FIN (CLOSE_WAIT), reset, or we closed.
    info.tcpi_state != 1
}

/// Sets `SO_SNDBUF` and `SO_RCVBUF` (best effort).
fn set_socket_buffers(s: &TcpStream, bytes: Option<usize>) {
    let Some(n) = bytes else { return };
    let n = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: `fd` is an open socket owned by `s`; the option value is a
        // live `c_int` whose size is passed along.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&n as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(opt, "setsockopt failed");
        }
    }
}

fn status_error(s: WireStatus) -> TransferError {
    match s {
        WireStatus::Rejected(r) => TransferError::Rejected(r),
        WireStatus::TargetError => {
            TransferError::Engine { engine: "tcp-sim", code: 2, message: "target could not access its memory".into() }
        }
        WireStatus::Ok => TransferError::Transport("unexpected status".into()),
    }
}

enum RxExit {
    Io(io::Error),
    Decode(DecodeError),
    Closed,
}

impl From<io::Error> for RxExit {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<DecodeError> for RxExit {
    fn from(e: DecodeError) -> Self {
        Self::Decode(e)
    }
}

/// Writes the first `limit` bytes of `bufs` with vectored writes.
fn write_all_vectored(stream: &mut TcpStream, bufs: &[&[u8]], limit: u64) -> io::Result<()> {
    let (mut idx, mut pos) = (0usize, 0usize);
    let mut left = limit;
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(bufs.len().min(1024));
    while left > 0 && idx < bufs.len() {
        iov.clear();
        let mut room = left;
        let mut i = idx;
        let mut p = pos;
        while i < bufs.len() && iov.len() < 1024 && room > 0 {
            let s = &bufs[i][p..];
            let take = (s.len() as u64).min(room) as usize;
            if take > 0 {
                iov.push(IoSlice::new(&s[..take]));
            }
            room -= take as u64;
            i += 1;
            p = 0;
        }
        if iov.is_empty() {
            break;
        }
        let n = match stream.write_vectored(&iov) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        left -= n as u64;
        let mut n = n;
        while n > 0 && idx < bufs.len() {
            let rem = bufs[idx].len() - pos;
            if n >= rem {
                n -= rem;
                idx += 1;
                pos = 0;
            } else {
                pos += n;
                n = 0;
            }
        }
        while idx < bufs.len() && bufs[idx].len() == pos {
            idx += 1;
            pos = 0;
        }
    }
    Ok(())
}
