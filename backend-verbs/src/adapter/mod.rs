//! The adapter: core's [`Transfer`](kv_transfer_core::Transfer) and [`Target`] over verbs, with a
//! memory window per exposed slot and tenancy.
//!
//! - **Expose**: each slot of the lease gets its own type-2 window, bound on
//!   the peer's queue pair over exactly that slot; `RemoteSlots` carries each
//!   window's key ([`RemoteSlot::key`](kv_transfer_core::RemoteSlot)). The
//!   pool's memory is registered `LOCAL_WRITE | MW_BIND`: its own key grants
//!   nothing, so the window's key is the generation at the NIC.
//! - **Completed**: the initiator's WRITEs, then its DONE (core's control
//!   message, with the exposure's token) as a SEND on the same RC queue pair,
//!   which is delivered only after those WRITEs are placed. The DONE settles
//!   only the tenancies exposed to that queue pair's peer under that token
//!   (`ExposureTable`), and only once their windows are invalidated: a
//!   hostile peer cannot write after its own DONE.
//! - **Revoked**: the escalation ladder's revoke is a `LOCAL_INV` of each
//!   tenancy's window; the proof is minted when that work request completed
//!   (from then on the NIC refuses the old key).
//! - **Fenced**: the peer's queue pair moved to ERR (by the ladder, or
//!   because the NIC put it there: a rejected access, a broken link) and
//!   every request posted on it completed flushed.
//!
//! - **Drained** (the ladder's first step): ABORT (core's
//!   codec, per exposure token) as a SEND; the initiator answers ABORT_ACK
//!   once every operation of its own on those tenancies is terminal (core's
//!   `AbortTracker`: admitted before posting, never acknowledged after a
//!   flushed request), and the ACK settles like a DONE (windows invalidated
//!   first).
//!
//! - **Identity**: a peer is the descriptor `add_peer` was given; a
//!   connection it dialed to us counts as that peer's only once the
//!   descriptor's owner, asked at the descriptor's address, confirms it
//!   (see the `handshake` module and [`PeerIdentity`]). The side channel's
//!   acceptor runs handshakes concurrently within [`SideChannelLimits`].
//!
//! The `naive` positive control
//! registers the pool's memory with remote access and hands out its own key
//! (no window, nothing at the NIC tells tenancies apart) and frees an aborted
//! slot at once.

mod channel;
mod driver;
mod handshake;

use kv_transfer_core::hash::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_transfer_core::drain::{Capabilities, ControlKind, ControlMessage, DrainCounters, Driver, ReleasePolicy, Trust};
use kv_transfer_core::{
    check_shapes, BackendError, Completer, ExposeError, ExposeErrorKind, Exposed, HostRegion, Op, PeerId, PoolConfig,
    PoolId, PostError, PostErrorKind, PostNow, Region, RemoteSlots, Reserved, SettlementAuthority, SlotLease, SlotPool,
    Target, TransferError, TransferHandle, TransferOptions,
};

pub use channel::{
    fresh_ticket, parse_descriptor, read_opening, Confirm, Deadline, Descriptor, Hello, Nonce, Opening, Ticket,
    MAX_CANDIDATES, MAX_NAME, NONE_CONFIRMED, TICKET_LEN,
};
pub use handshake::{PeerIdentity, SideChannelLimits};

use crate::engine::Engine;
use crate::error::VerbsError;
use crate::work::{MrAccess, MrId, MrInfo, MwId, QpId, QpState, WorkRequest};

/// What verbs can prove about an aborted exposure, in the ladder's order:
/// drain (ABORT / ABORT_ACK as SENDs; the ACK settles once the windows are
/// invalidated), revoke (`LOCAL_INV` completed) and fence (QP to ERR, every
/// request flushed).
pub const CAPABILITIES: Capabilities = Capabilities::ALL;

/// Remote tenancies remembered as aborted or handed back (per adapter).
const TOMBSTONES: usize = 4096;

/// The backend's name.
pub const BACKEND: &str = "verbs";

/// RECV buffers kept posted per peer (control messages).
const RECVS: u64 = 16;

/// Pre-registered SEND buffers per peer (control messages); past that many
/// SENDs in flight, a message gets a buffer registered for it alone.
const SENDS: u32 = 64;

/// Compares tickets in time independent of where they differ.
fn tickets_match(a: &Ticket, b: &Ticket) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Configuration of a [`VerbsTransfer`].
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// This adapter's name (what peers' descriptors say).
    pub name: String,
    /// The verbs device (`rxe_lo` in the lab).
    pub device: String,
    /// Its port.
    pub port: u8,
    /// The RoCE v2 GID index to use.
    pub gid_index: u8,
    /// Where the side channel listens (`127.0.0.1:0`: any port).
    pub listen: String,
    /// Path MTU offered to peers (the device's port and the peer's offer
    /// may lower it: both ends use the smallest).
    pub mtu: u32,
    /// Keep [`ReleasePolicy::Safe`]; `Naive` is the positive control only.
    pub release_policy: ReleasePolicy,
    /// Bound on a side-channel handshake and on an exposure's binds.
    pub timeout: Duration,
    /// How often an idle peer is probed (a zero-length WRITE): a peer that
    /// died (its process killed, its host gone) fails the probe after the
    /// transport's retries, and is fenced. Zero: no probes (a dead peer is
    /// then fenced only by the ladder).
    pub heartbeat: Duration,
    /// While operations are in flight, poll the completion queue without
    /// sleeping (yielding between polls): the lowest completion latency, at
    /// the cost of a core while busy. Off: sleep 20–50 µs between polls.
    /// Idle, the driver backs off to 1 ms either way.
    pub busy_poll: bool,
    /// Whose word makes an accepted connection a peer's: keep
    /// [`PeerIdentity::Confirmed`]; `DeclaredName` is the positive control.
    pub identity: PeerIdentity,
    /// Caps and deadlines of the side channel's acceptor.
    pub side_channel: SideChannelLimits,
}

impl VerbsConfig {
    /// `name` on `device` (port 1, GID index 1, MTU 1024, loopback side
    /// channel). 1024 is what RoCE runs over 1500-byte Ethernet; 4096 on
    /// Soft-RoCE over loopback hung a 1 MiB run in the lab's guest (not
    /// explained yet).
    pub fn new(name: impl Into<String>, device: impl Into<String>, gid_index: u8) -> Self {
        Self {
            name: name.into(),
            device: device.into(),
            port: 1,
            gid_index,
            listen: "127.0.0.1:0".into(),
            mtu: 1024,
            release_policy: ReleasePolicy::Safe,
            timeout: Duration::from_secs(10),
            heartbeat: Duration::from_millis(200),
            busy_poll: true,
            identity: PeerIdentity::Confirmed,
            side_channel: SideChannelLimits::default(),
        }
    }
}

/// Errors of the adapter's own calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterError {
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The side channel failed.
    #[error("side channel: {0}")]
    Io(#[from] std::io::Error),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] kv_transfer_core::PoolError),
}

/// The adapter's counters.
#[derive(Debug, Default)]
struct Counters {
    posts: AtomicU64,
    ops_ok: AtomicU64,
    ops_failed: AtomicU64,
    remote_access_errors: AtomicU64,
    flushed: AtomicU64,
    binds: AtomicU64,
    invalidations: AtomicU64,
    control_sent: AtomicU64,
    messages_received: AtomicU64,
    malformed: AtomicU64,
    heartbeats: AtomicU64,
    side_channel_refused: AtomicU64,
    side_channel_busy: AtomicU64,
    side_channel_per_address: AtomicU64,
    identity_unconfirmed: AtomicU64,
    claims_refused: AtomicU64,
    confirms_answered: AtomicU64,
    records_dropped: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A peer's lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerState {
    Live,
    /// Its QP is in ERR; the fence is minted once every request flushed.
    Fencing,
    Fenced,
}

struct Peer {
    name: String,
    /// Its descriptor, where we dialed it (we redial after a fence).
    dialed: Option<Descriptor>,
    qp: QpId,
    state: PeerState,
    /// When it was last probed, and whether a probe is out.
    probed: Instant,
    probing: bool,
    /// Its RECV ring: `RECVS` buffers of `MAX_LEN` bytes.
    recv: (MrId, Arc<dyn Region>),
    /// Its SEND ring: `SENDS` buffers of `MAX_LEN` bytes, and those not in
    /// flight (a buffer is reused only once its SEND completed).
    send: (MrId, Arc<dyn Region>),
    send_free: Vec<u32>,
    /// The connection's nonce: ours if we dialed it, theirs if we accepted it.
    nonce: Nonce,
    /// Its descriptor's owner's: we dialed it, or the owner confirmed it
    /// dialed us. Only a confirmed peer has a name in `by_name`.
    confirmed: bool,
    /// Where an accepted connection came from (claims are capped per address).
    from: Option<std::net::IpAddr>,
}

/// A slot's memory window, as this side moved it (the engine enforces the
/// same order: a type-2 window binds only when unbound).
#[derive(Clone, Debug, PartialEq, Eq)]
enum WindowState {
    Unbound,
    /// A bind was posted; its key grants nothing yet.
    Binding,
    /// The key grants the slot, through the peer's QP only.
    Bound,
    /// A `LOCAL_INV` was posted; the key grants access until it completes.
    /// What its completion proves, one entry per path that asked for it
    /// (the ladder's revoke and the peer's ABORT_ACK can race: the second
    /// joins the invalidation in flight).
    Invalidating(Vec<(AfterInvalidate, kv_transfer_core::Tenancy)>),
}

#[derive(Clone, Debug)]
struct Window {
    id: MwId,
    state: WindowState,
}

struct PoolEntry {
    authority: SettlementAuthority,
    mr: MrInfo,
    /// One window per slot (allocated on first use).
    windows: Vec<Option<Window>>,
    /// The peer each slot's window is bound to (on that peer's QP).
    window_peer: Vec<Option<PeerId>>,
}

/// What a settled invalidation proves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AfterInvalidate {
    /// The ladder's revoke: `Revoked`.
    Revoke,
    /// The peer's DONE, now that its window is gone: `Completed`.
    Complete,
    /// An exposure that failed half-way: nothing to prove.
    Nothing,
}

type BindWaiter = Arc<(Mutex<Option<bool>>, Condvar)>;

/// A posted work request, by `wr_id`.
enum Pending {
    /// One WR of operation `op`.
    OpWr {
        op: u64,
        peer: PeerId,
    },
    Bind {
        peer: PeerId,
        done: BindWaiter,
        pool: PoolId,
        slot: u32,
    },
    /// A `LOCAL_INV` of `slot`'s window (what it proves is in the
    /// window's state).
    Invalidate {
        peer: PeerId,
        pool: PoolId,
        slot: u32,
    },
    /// A control message; `slot`: its buffer in the peer's SEND ring.
    Send {
        peer: PeerId,
        slot: Option<u32>,
    },
    Heartbeat {
        peer: PeerId,
    },
    Recv {
        peer: PeerId,
        index: u64,
    },
}

impl Pending {
    fn peer(&self) -> PeerId {
        match self {
            Self::OpWr { peer, .. }
            | Self::Bind { peer, .. }
            | Self::Invalidate { peer, .. }
            | Self::Send { peer, .. }
            | Self::Heartbeat { peer }
            | Self::Recv { peer, .. } => *peer,
        }
    }
}

/// Why an operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum OpFailure {
    /// A later WR of it could not be posted.
    Post(String),
    /// A WR of it completed with this status.
    Status(crate::work::WcStatus),
}

impl std::fmt::Display for OpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Post(e) => write!(f, "post failed: {e}"),
            Self::Status(s) => write!(f, "completed with {s:?}"),
        }
    }
}

struct OpEntry {
    id: u64,
    completer: Completer,
    authority: SettlementAuthority,
    remaining: u32,
    error: Option<OpFailure>,
}

struct State {
    pools: HashMap<PoolId, PoolEntry>,
    peers: HashMap<PeerId, Peer>,
    by_name: HashMap<String, PeerId>,
    next_peer: u32,
    wrs: HashMap<u64, Pending>,
    ops: HashMap<u64, OpEntry>,
    next_op: u64,
    /// Initiator side: which operations touch which remote tenancies, and
    /// when an ABORT may be answered.
    aborts: kv_transfer_core::drain::AbortTracker<PeerId>,
    /// Nonces of handshakes this side is dialing, with the dialed ticket
    /// (a confirmation request may come before the peer is recorded).
    dialing: HashMap<Nonce, Ticket>,
    /// The descriptors `add_peer` was given, by name: who a name is.
    known: HashMap<String, Descriptor>,
}

impl Default for State {
    fn default() -> Self {
        Self {
            pools: HashMap::default(),
            peers: HashMap::default(),
            by_name: HashMap::default(),
            next_peer: 0,
            wrs: HashMap::default(),
            ops: HashMap::default(),
            next_op: 0,
            aborts: kv_transfer_core::drain::AbortTracker::new(TOMBSTONES),
            dialing: HashMap::default(),
            known: HashMap::default(),
        }
    }
}

struct Inner {
    cfg: VerbsConfig,
    engine: Arc<dyn Engine>,
    descriptor: String,
    state: Mutex<State>,
    /// Core's drain: the exposure table, the pools' authorities, the ladder.
    drain: Mutex<Driver>,
    drain_counters: Arc<DrainCounters>,
    stop: AtomicBool,
    /// The listening socket, for the drop to shut down (waking `accept`).
    acceptor: TcpListener,
    /// What a dialer's hello must carry (from this side's descriptor).
    ticket: Ticket,
    next_wr: AtomicU64,
    counters: Counters,
    /// Side-channel handshakes in flight (the acceptor's caps).
    gate: kv_transfer_core::PeerGate<std::net::IpAddr>,
}

/// Core's [`Transfer`](kv_transfer_core::Transfer) and [`Target`] over verbs; see the [module docs](self).
pub struct VerbsTransfer {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for VerbsTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransfer").field("descriptor", &self.inner.descriptor).finish()
    }
}

impl VerbsTransfer {
    /// Opens the device `cfg` names and starts the adapter on it.
    #[cfg(feature = "verbs")]
    #[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
    pub fn new(cfg: VerbsConfig) -> Result<Self, AdapterError> {
        let engine = crate::engine::DeviceEngine::open(&cfg.device, cfg.port, cfg.gid_index)?;
        Self::with_engine(cfg, engine)
    }

    /// Starts the adapter on `engine` (a device, or a
    /// [`FakeFabric`](crate::FakeFabric)'s NIC): the side channel and the
    /// driver thread.
    pub fn with_engine(cfg: VerbsConfig, engine: Arc<dyn Engine>) -> Result<Self, AdapterError> {
        if cfg.name.is_empty() || cfg.name.len() > MAX_NAME || cfg.name.contains('@') {
            return Err(VerbsError::invalid("VerbsTransfer::new", "a name of 1..=256 bytes without '@'").into());
        }
        // Blocking: a connection is served at once (a hostile flood costs
        // the acceptor its handshakes, not a poll interval each); the drop
        // wakes it by shutting a clone of the socket down.
        let listener = TcpListener::bind(&cfg.listen)?;
        let acceptor = listener.try_clone()?;
        let ticket = fresh_ticket();
        let descriptor =
            Descriptor { name: cfg.name.clone(), addr: listener.local_addr()?.to_string(), ticket }.encode();
        let drain = Driver::new(CAPABILITIES, cfg.release_policy);
        let drain_counters = drain.counters();
        let gate = kv_transfer_core::PeerGate::new(cfg.side_channel.handshakes, cfg.side_channel.per_address);
        let inner = Arc::new(Inner {
            cfg,
            engine,
            descriptor,
            state: Mutex::default(),
            drain: Mutex::new(drain),
            drain_counters,
            stop: AtomicBool::new(false),
            acceptor,
            ticket,
            next_wr: AtomicU64::new(1),
            counters: Counters::default(),
            gate,
        });
        let mut threads = Vec::new();
        let i = Arc::clone(&inner);
        threads.push(std::thread::Builder::new().name("verbs-accept".into()).spawn(move || i.accept_loop(listener))?);
        let i = Arc::clone(&inner);
        threads.push(std::thread::Builder::new().name("verbs-driver".into()).spawn(move || i.drive())?);
        Ok(Self { inner, threads: Mutex::new(threads) })
    }

    /// What a peer passes to its [`VerbsTransfer::add_peer`]:
    /// `name@host:port#<ticket>` (the ticket is the secret a dialer's hello
    /// must carry: hand the descriptor only to peers, out of band).
    pub fn descriptor(&self) -> &str {
        &self.inner.descriptor
    }

    /// Registers `region` (host memory) and builds its pool.
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        let access =
            if self.inner.cfg.release_policy.is_naive() { MrAccess::RemoteWriteRead } else { MrAccess::WindowsOnly };
        let mr = self.inner.engine.register(Arc::clone(&region), access)?;
        let (pool, authority) = SlotPool::new(region, config.with_capabilities(CAPABILITIES))?;
        let slots = pool.metrics().capacity as usize;
        let windows = (0..slots).map(|_| None).collect();
        let entry = PoolEntry { authority, mr, windows, window_peer: vec![None; slots] };
        lock(&self.inner.drain).add_pool(entry.authority.clone());
        lock(&self.inner.state).pools.insert(pool.id(), entry);
        Ok(pool)
    }

    /// Adds the peer `descriptor` names (`name@host:port#<ticket>`): the
    /// connection to it if one is up (one we dialed, or one it dialed that
    /// its owner confirmed, asked at the descriptor's address), else a new
    /// one we dial. Never a connection that merely declared the name (see
    /// [`PeerIdentity`]).
    pub fn add_peer(&self, descriptor: &str) -> Result<PeerId, AdapterError> {
        self.inner.add_peer(parse_descriptor(descriptor.as_bytes())?)
    }

    /// Counters, by name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let d = self.inner.drain_counters.snapshot();
        vec![
            ("posts", g(&c.posts)),
            ("ops_ok", g(&c.ops_ok)),
            ("ops_failed", g(&c.ops_failed)),
            ("remote_access_errors", g(&c.remote_access_errors)),
            ("flushed", g(&c.flushed)),
            ("binds", g(&c.binds)),
            ("invalidations", g(&c.invalidations)),
            ("revoked", d.revoked),
            ("fences", d.fences),
            ("control_sent", g(&c.control_sent)),
            ("messages_received", g(&c.messages_received)),
            ("malformed", g(&c.malformed)),
            ("naive_releases", d.naive_releases),
            ("heartbeats", g(&c.heartbeats)),
            ("side_channel_refused", g(&c.side_channel_refused)),
            // Accepted connections closed at once: handshakes at their cap.
            ("side_channel_busy", g(&c.side_channel_busy)),
            // Accepted connections closed at once: their address's cap.
            ("side_channel_per_address", g(&c.side_channel_per_address)),
            // Claims to a name that the name's descriptor owner did not
            // confirm (never given the name).
            ("identity_unconfirmed", g(&c.identity_unconfirmed)),
            // Unconfirmed claims refused at their cap.
            ("claims_refused", g(&c.claims_refused)),
            // Confirmation requests this side answered.
            ("confirms_answered", g(&c.confirms_answered)),
            // Fenced peer records dropped with their rings (nothing names them).
            ("records_dropped", g(&c.records_dropped)),
            // A gauge: peer records (live, fencing, or fenced and still
            // named), each with its QP.
            ("peers", lock(&self.inner.state).peers.len() as u64),
        ]
    }

    /// Sends a control message to `peer` as a SEND on its queue pair (what
    /// the adapter does itself for a DONE; tools and tests send others: the
    /// receiving side checks every message against its exposures' tokens).
    pub fn send_control(&self, peer: PeerId, msg: &ControlMessage) -> Result<(), AdapterError> {
        let mut st = lock(&self.inner.state);
        let qp = st
            .peers
            .get(&peer)
            .filter(|p| p.state == PeerState::Live)
            .map(|p| p.qp)
            .ok_or_else(|| VerbsError::invalid("send_control", format!("peer {} is not live", peer.0)))?;
        Ok(self.inner.send_control(&mut st, peer, qp, msg)?)
    }

    /// The peer a descriptor's name maps to, if connected.
    pub fn peer_named(&self, name: &str) -> Option<PeerId> {
        self.inner.live_peer(name)
    }

    /// One counter by name (0 if unknown).
    pub fn counter(&self, name: &str) -> u64 {
        self.counters().into_iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| v)
    }

    /// Exposes `lease` to `peer`: a window per slot, bound on the peer's
    /// queue pair; returns once every bind completed. On error the lease
    /// comes back unexposed.
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        self.inner.expose(lease, peer)
    }
}

impl Inner {
    fn wr_id(&self) -> u64 {
        self.next_wr.fetch_add(1, Ordering::Relaxed)
    }

    fn live_peer(&self, name: &str) -> Option<PeerId> {
        let st = lock(&self.state);
        st.by_name.get(name).copied().filter(|p| st.peers.get(p).is_some_and(|p| p.state == PeerState::Live))
    }

    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let fail = |lease, kind| Err(ExposeError { lease, kind });
        let engine = |e: &dyn std::fmt::Display| ExposeErrorKind::Engine(e.to_string());
        let pool_id = lease.pool().id();
        let naive = self.cfg.release_policy.is_naive();
        let mut st = lock(&self.state);
        let Some(qp) = st.peers.get(&peer).filter(|p| p.state == PeerState::Live).map(|p| p.qp) else {
            drop(st);
            return fail(lease, ExposeErrorKind::UnknownPeer(peer));
        };
        let slot_size = lease.pool().slot_size();
        let Ok(len) = u32::try_from(slot_size) else {
            drop(st);
            return fail(lease, ExposeErrorKind::Engine("slots larger than 4 GiB".into()));
        };
        let mut keys = Vec::with_capacity(lease.len());
        let mut waiters = Vec::new();
        {
            let State { pools, wrs, .. } = &mut *st;
            let Some(entry) = pools.get_mut(&pool_id) else {
                drop(st);
                return fail(lease, ExposeErrorKind::ForeignPool);
            };
            if naive {
                keys = vec![None; lease.len()];
            } else {
                for t in lease.tenancies() {
                    let i = t.slot.0 as usize;
                    let w = match &mut entry.windows[i] {
                        Some(w) => w,
                        slot @ None => match self.engine.alloc_window() {
                            Ok(id) => slot.insert(Window { id, state: WindowState::Unbound }),
                            Err(e) => {
                                drop(st);
                                return fail(lease, engine(&e));
                            }
                        },
                    };
                    let wr = self.next_wr.fetch_add(1, Ordering::Relaxed);
                    let done: BindWaiter = Arc::new((Mutex::new(None), Condvar::new()));
                    wrs.insert(wr, Pending::Bind { peer, done: Arc::clone(&done), pool: pool_id, slot: t.slot.0 });
                    let bind =
                        WorkRequest::Bind { window: w.id, mr: entry.mr.id, offset: i as u64 * slot_size as u64, len };
                    let posted = if w.state == WindowState::Unbound {
                        self.engine.post(qp, wr, bind).and_then(|k| {
                            k.ok_or_else(|| VerbsError::invalid("post BIND_MW", "the engine returned no key"))
                        })
                    } else {
                        Err(VerbsError::invalid("post BIND_MW", format!("the window is {:?}, not unbound", w.state)))
                    };
                    match posted {
                        Ok(k) => {
                            w.state = WindowState::Binding;
                            keys.push(Some(u64::from(k)));
                            waiters.push((t.slot.0, done));
                        }
                        Err(e) => {
                            wrs.remove(&wr);
                            // The NIC may have put the QP in ERR (a rejected
                            // access) before the driver saw a flushed
                            // completion: fence it now, so the next exposure
                            // goes to the new connection.
                            if self.engine.qp_state(qp).is_ok_and(|s| s == QpState::Error) {
                                self.start_fence(&mut st, peer);
                            }
                            drop(st);
                            // Binds already posted finish in the driver; their
                            // windows are invalidated there (nothing exposed).
                            self.abandon_binds(pool_id, peer, &waiters);
                            return fail(lease, engine(&e));
                        }
                    }
                }
            }
        }
        drop(st);
        // Bounded by the configured timeout.
        let deadline = Instant::now() + self.cfg.timeout;
        let mut ok = true;
        for (_, w) in &waiters {
            let (m, cv) = &**w;
            let mut g = lock(m);
            while g.is_none() && Instant::now() < deadline {
                g = cv.wait_timeout(g, deadline - Instant::now()).unwrap_or_else(|p| p.into_inner()).0;
            }
            ok &= *g == Some(true);
        }
        if !ok {
            self.abandon_binds(pool_id, peer, &waiters);
            return fail(lease, ExposeErrorKind::Engine("a window bind failed or timed out".into()));
        }
        let st = lock(&self.state);
        let Some(entry) = st.pools.get(&pool_id) else {
            drop(st);
            return fail(lease, ExposeErrorKind::ForeignPool);
        };
        // The pool's mark first, the drain table's record after
        // (`Driver::expose_with`): a loss of this peer handled in between
        // then fences the mark, or finds the record.
        let token = kv_transfer_core::drain::ExposureToken::random();
        let key = if naive { u64::from(entry.mr.rkey) } else { 0 };
        let (exposed, mut remote) = entry.authority.expose(lease, peer, key, self.descriptor.clone(), token);
        lock(&self.drain).expose_with(pool_id, exposed.tenancies(), peer, Trust::Proving, token);
        for (s, k) in remote.slots.iter_mut().zip(keys) {
            s.key = k;
        }
        drop(st);
        inc(&self.counters.binds);
        Ok((exposed, remote))
    }

    /// Binds of an exposure that will not happen: each window is taken
    /// back, so the slot can be bound again. A bind still pending is marked
    /// given up, and the driver invalidates its window when it completes; a
    /// bind that completed already is invalidated now (nothing to prove:
    /// its key was never handed out).
    fn abandon_binds(&self, pool: PoolId, peer: PeerId, waiters: &[(u32, BindWaiter)]) {
        // State, then waiter: the driver's order.
        let mut st = lock(&self.state);
        for (slot, w) in waiters {
            let (m, cv) = &**w;
            let mut g = lock(m);
            match *g {
                None => *g = Some(false),
                Some(true) => {
                    drop(g);
                    let t = kv_transfer_core::Tenancy::new(
                        kv_transfer_core::SlotId(*slot),
                        kv_transfer_core::Generation(0),
                    );
                    self.invalidate(&mut st, pool, peer, t, AfterInvalidate::Nothing);
                    continue;
                }
                Some(false) => {}
            }
            cv.notify_all();
        }
    }

    fn post(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        let Ok(Descriptor { name, .. }) = parse_descriptor(remote.endpoint.as_bytes()) else {
            return Err(PostError {
                lease: local,
                kind: PostErrorKind::Peer(format!("bad endpoint {:?}", remote.endpoint)),
            });
        };
        let Ok(len) = u32::try_from(remote.slot_size) else {
            return Err(PostError { lease: local, kind: PostErrorKind::Descriptor("slots larger than 4 GiB".into()) });
        };
        // A peer being fenced that we dialed is reconnecting: wait for it
        // (bounded by the configured timeout).
        let deadline = Instant::now() + self.cfg.timeout;
        let (mut st, peer, qp) = loop {
            let st = lock(&self.state);
            let Some(peer) = st.by_name.get(&name).copied() else {
                drop(st);
                return Err(PostError { lease: local, kind: PostErrorKind::Peer(format!("{name} is not a peer")) });
            };
            let Some(p) = st.peers.get(&peer) else {
                drop(st);
                return Err(PostError { lease: local, kind: PostErrorKind::Peer(format!("{name} is gone")) });
            };
            if p.state == PeerState::Live {
                let qp = p.qp;
                break (st, peer, qp);
            }
            if p.dialed.is_none() || Instant::now() >= deadline {
                drop(st);
                return Err(PostError { lease: local, kind: PostErrorKind::Peer(format!("{name} is fenced")) });
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(2));
        };
        let pool_id = local.pool().id();
        let Some((mr, authority)) = st.pools.get(&pool_id).map(|e| (e.mr.id, e.authority.clone())) else {
            drop(st);
            return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool });
        };
        let offsets: Vec<u64> =
            local.tenancies().iter().map(|t| u64::from(t.slot.0) * local.pool().slot_size() as u64).collect();
        st.next_op += 1;
        let op_id = st.next_op;
        // Admitted before anything is posted, under the lock ABORTs are
        // handled in: an ABORT either sees this op and waits for it, or this
        // post sees the abort and is refused.
        if let Err(refusal) = st.aborts.admit(op_id, &peer, remote, false) {
            drop(st);
            return Err(PostError { lease: local, kind: PostErrorKind::Descriptor(refusal.to_string()) });
        }
        let exposed = authority.expose_local(local, peer);
        let (handle, completer) = TransferHandle::pair(exposed);
        let mut posted = 0u32;
        let mut error = None;
        for (i, (off, rs)) in offsets.iter().zip(&remote.slots).enumerate() {
            let wr = self.wr_id();
            st.wrs.insert(wr, Pending::OpWr { op: op_id, peer });
            let rkey = remote.key_of(i) as u32;
            let r = match op {
                Op::Write => WorkRequest::Write { local: mr, offset: *off, len, remote_addr: rs.addr, rkey },
                Op::Read => WorkRequest::Read { local: mr, offset: *off, len, remote_addr: rs.addr, rkey },
            };
            let r = self.engine.post(qp, wr, r);
            match r {
                Ok(_) => posted += 1,
                Err(e) => {
                    st.wrs.remove(&wr);
                    error = Some(OpFailure::Post(e.to_string()));
                    break;
                }
            }
        }
        inc(&self.counters.posts);
        if posted == 0 {
            let acks = st.aborts.finished(op_id, kv_transfer_core::drain::OpEnd::Proven);
            self.send_all(&mut st, acks);
            drop(st);
            // Nothing reached the NIC: the local lease is untouched.
            let proof = authority.completed_lease(completer.lease());
            let msg = error.map_or_else(String::new, |e| e.to_string());
            let _ = completer.complete(proof, Err(TransferError::Transport(msg)));
            return Ok(handle);
        }
        if op == Op::Write && opts.notify && error.is_none() {
            // Behind the WRITEs on the same RC QP: placed before it arrives.
            let msg = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
            match self.send_control(&mut st, peer, qp, &msg) {
                // Handed back: no later post may use these tenancies.
                Ok(()) => st.aborts.tombstone(&peer, remote.pool, remote.token, &remote.tenancies()),
                Err(e) => tracing::warn!(peer = peer.0, error = %e, "DONE not sent"),
            }
        }
        st.ops.insert(op_id, OpEntry { id: op_id, completer, authority, remaining: posted, error });
        Ok(handle)
    }

    /// Sends each message (ABORT_ACKs now due) to its peer, if live.
    pub(super) fn send_all(&self, st: &mut State, out: Vec<kv_transfer_core::drain::Outgoing<PeerId>>) {
        for o in out {
            let Some(qp) = st.peers.get(&o.to).filter(|p| p.state == PeerState::Live).map(|p| p.qp) else {
                continue;
            };
            if let Err(e) = self.send_control(st, o.to, qp, &o.msg) {
                tracing::warn!(peer = o.to.0, error = %e, "control message not sent");
            }
        }
    }

    /// Posts `msg` as a SEND on `qp`, from a free buffer of the peer's
    /// SEND ring (held until the SEND completes), or, with all of them in
    /// flight, from one registered for it alone.
    fn send_control(&self, st: &mut State, peer: PeerId, qp: QpId, msg: &ControlMessage) -> Result<(), VerbsError> {
        let bytes = msg.encode().map_err(|e| VerbsError::invalid("encode", e.to_string()))?;
        let len = bytes.len() as u32;
        let ring = st.peers.get_mut(&peer).and_then(|p| p.send_free.pop().map(|i| (i, p.send.clone())));
        let (slot, mr, offset) = match ring {
            Some((i, (mr, region))) => {
                let at = i as usize * kv_transfer_core::drain::MAX_LEN;
                region.write(at, &bytes).map_err(|e| VerbsError::invalid("send buffer", e.to_string()))?;
                (Some(i), mr, at as u64)
            }
            None => {
                let region =
                    HostRegion::new(bytes.len()).map_err(|e| VerbsError::invalid("send buffer", e.to_string()))?;
                region.write(0, &bytes).map_err(|e| VerbsError::invalid("send buffer", e.to_string()))?;
                (None, self.engine.register(Arc::new(region), MrAccess::Local)?.id, 0)
            }
        };
        let wr = self.wr_id();
        let posted = self.engine.post(qp, wr, WorkRequest::Send { local: mr, offset, len });
        if slot.is_none() {
            // The engine keeps it registered until the SEND completes.
            self.engine.deregister(mr);
        }
        if let Err(e) = posted {
            self.send_done(st, peer, slot);
            return Err(e);
        }
        st.wrs.insert(wr, Pending::Send { peer, slot });
        inc(&self.counters.control_sent);
        Ok(())
    }

    /// A SEND's buffer is free again (its SEND completed, or never went).
    pub(super) fn send_done(&self, st: &mut State, peer: PeerId, slot: Option<u32>) {
        if let (Some(i), Some(p)) = (slot, st.peers.get_mut(&peer)) {
            p.send_free.push(i);
        }
    }
}

impl PostNow for VerbsTransfer {
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

kv_transfer_core::impl_transfer_via_post_now!(VerbsTransfer, BACKEND);

impl Target for VerbsTransfer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        VerbsTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            e => BackendError::Engine { backend: BACKEND, message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        Ok(self.inner.descriptor.as_bytes().to_vec())
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        let d = std::str::from_utf8(descriptor).map_err(|_| BackendError::Peer("descriptor is not UTF-8".into()))?;
        VerbsTransfer::add_peer(self, d).map_err(|e| BackendError::Peer(e.to_string()))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        VerbsTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        VerbsTransfer::counters(self)
    }
}

impl Drop for VerbsTransfer {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        {
            use std::os::fd::AsRawFd;
            // SAFETY: shutdown(2) on a socket this adapter owns; the
            // acceptor's blocked accept(2) returns and it sees `stop`.
            unsafe { libc::shutdown(self.inner.acceptor.as_raw_fd(), libc::SHUT_RDWR) };
        }
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
        // Every QP to ERR: nothing more lands in this side's memory. The
        // memory itself lives until the last QP, window and request that
        // names it is gone (each holds its region).
        for p in lock(&self.inner.state).peers.values() {
            let _ = self.inner.engine.to_error(p.qp);
        }
    }
}

#[cfg(test)]
mod tests;
