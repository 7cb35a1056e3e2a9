//! The simulated NIC: registered regions with keys, connections that keep
//! order like RC queue pairs, one-sided WRITE/READ applied by the NIC's own
//! threads, notifications, revocation, fencing, and the escalation driver.
//!
//! Threads: one acceptor and one escalation driver per NIC; one per
//! inbound handshake while it runs (capped in all and per source address,
//! each by a whole-handshake deadline: `NicConfig::listener`); one sender
//! and one receiver per connection (established connections capped per
//! source address). Everything blocks with bounded waits (no
//! busy spin); data moves with vectored writes straight from registered
//! memory and is received straight into registered memory.
//!
//! This file holds the public handle ([`SimNic`] and its methods), the
//! NIC's shared state (`NicInner`, with its table lookups) and the driver's
//! wake-up (`Signal`). The rest, one job a file, as `impl NicInner` blocks
//! where it is the NIC's own work:
//!
//! - `types`: the public value types (configuration, errors, events, peer
//!   and fault records).
//! - `registration`: registered regions, the per-slot bindings, and the
//!   target's access checks (key, length, bounds, generation, peer).
//! - `conn`: per-connection state (work requests, operations, pending
//!   aborts), the send queue and its doorbells.
//! - `connect`: handshake, connecting, accepting, starting a connection's
//!   threads.
//! - `post`: posting a lease's operation and application messages.
//! - `raw`: raw accesses outside any lease and their completions.
//! - `tx`: the sender thread.
//! - `rx`: the receiver thread, which applies accesses as the target and
//!   completes work requests as the initiator.
//! - `control`: settlement from the peer (NOTIFY, ABORT, ABORT_ACK), the
//!   escalation driver, revocation, teardown (fence) and shutdown.

mod conn;
mod connect;
mod control;
mod post;
mod raw;
mod registration;
mod rx;
mod tx;
mod types;

pub use raw::{RawAccess, RawCallback, RawCompletions, RawHandle};
pub use types::{
    ExposeError, ExposeErrorKind, FaultRecord, InboundEvent, ListenerLimits, MessageHook, NicConfig, NicError,
    PeerInfo, ReleasePolicy,
};

use crate::stats::{Counters, NicStats};
use crate::wire::{self, DecodeError};
use bytes::Bytes;
use conn::{Conn, OpDone, Src};
use kv_transfer_core::{
    Exposed, Op, PeerId, PoolConfig, PoolId, PostError, PostNow, Region, RemoteSlots, Reserved, SlotLease, SlotPool,
    TransferHandle, TransferOptions,
};
// Named in the docs; the impl comes from `impl_transfer_via_post_now!`.
use kv_transfer_core::drain::{Capabilities, DrainCounters, Driver, Trust};
#[cfg(doc)]
use kv_transfer_core::Transfer;
use kv_transfer_core::{BackendError, Target};
use registration::{Binding, Reg};

/// What the simulator proves: drain and ack (ABORT / ABORT_ACK), revoke (the
/// generation unbound at the NIC, in-flight applies waited for), fence
/// (socket shut, both threads joined).
pub const CAPABILITIES: Capabilities = Capabilities::ALL;
use std::collections::VecDeque;
use std::net::{Shutdown, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Inbound events kept for [`SimNic::next_event`]; older ones are dropped.
const MAX_EVENTS: usize = 4096;

/// The work-request tables are hit on every post and completion: core's
/// foldhash maps, not SipHash.
use kv_transfer_core::hash::{HashMap, HashSet};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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
    /// The cluster key every connection's handshake proves.
    cluster_key: kv_transfer_core::auth::ClusterKey,
    /// The listener's recently seen handshake nonces.
    replay: Arc<kv_transfer_core::auth::ReplayCache>,
    auth_counters: kv_transfer_core::auth::AuthCounters,
    key_salt: u64,
    regs: RwLock<Vec<Arc<Reg>>>,
    conns: Mutex<HashMap<PeerId, Arc<Conn>>>,
    /// Handshakes in flight (the listener's caps).
    gate: kv_transfer_core::PeerGate<std::net::IpAddr, std::net::TcpStream>,
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
    /// A second handle on the listening socket: shutting it down wakes the
    /// acceptor's `accept` from any thread, whatever network namespace the
    /// caller is in (a wake-up connection from the caller would not reach a
    /// NIC started inside another namespace).
    listener_handle: Option<TcpListener>,
    fault_log: Mutex<Vec<FaultRecord>>,
    last_decode_error: Mutex<Option<DecodeError>>,
    /// Target side of core's drain protocol: every tenancy exposed to a
    /// connection, under its token.
    /// Core's drain: the exposure table, the pools' authorities, the ladder.
    drain: Mutex<Driver>,
    drain_counters: Arc<DrainCounters>,
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
        let cluster_key = match &cfg.cluster_key {
            Some(k) => k.clone(),
            None => kv_transfer_core::auth::ClusterKey::from_env()?,
        };
        let listener = TcpListener::bind(&cfg.listen)?;
        let endpoint = listener.local_addr()?.to_string();
        static NICS: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let salt = crate::fault::splitmix64(
            now ^ (u64::from(std::process::id()) << 32)
                ^ crate::fault::splitmix64(NICS.fetch_add(1, Ordering::Relaxed)),
        );
        let drain = Driver::new(CAPABILITIES, cfg.policy);
        let drain_counters = drain.counters();
        let drain = Mutex::new(drain);
        let gate = kv_transfer_core::PeerGate::new(cfg.listener.handshakes, cfg.listener.per_address);
        let inner = Arc::new(NicInner {
            cfg,
            endpoint,
            cluster_key,
            replay: Default::default(),
            auth_counters: Default::default(),
            key_salt: salt & 0xFFFF_FFFF_0000_0000,
            regs: RwLock::new(Vec::new()),
            conns: Mutex::new(HashMap::default()),
            gate,
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
            listener_handle: listener.try_clone().ok(),
            fault_log: Mutex::new(Vec::new()),
            last_decode_error: Mutex::new(None),
            drain,
            drain_counters,
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

    /// Counts of this NIC's peer handshakes, both ways: established, and
    /// each refusal by kind (wrong key, replayed, relayed, ...).
    pub fn auth_stats(&self) -> kv_transfer_core::auth::AuthStats {
        self.inner.auth_counters.snapshot()
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
        self.inner.counters.snapshot(&self.inner.drain_counters)
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
        let slot_size = config.slot_size;
        let (pool, authority) = SlotPool::new(region.clone(), config.with_capabilities(CAPABILITIES))?;
        let signal = self.inner.signal.clone();
        authority.on_quarantine(move || signal.kick());
        lock(&self.inner.drain).add_pool(authority.clone());
        let key = self.inner.key_salt | self.inner.next_key.fetch_add(1, Ordering::Relaxed);
        let base = region.host_ptr().map_or(0, |p| p.as_ptr() as usize);
        let bindings = (0..pool.capacity())
            .map(|_| Binding { gen: AtomicU64::new(0), peer: AtomicU32::new(0), inflight: AtomicU32::new(0) })
            .collect();
        let reg = Reg {
            key,
            pool: pool.clone(),
            authority,
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
        // The pool's mark first, the drain table's record after
        // (`Driver::expose_with`): a loss of this peer handled in between
        // then fences the mark, or finds the record.
        let token = kv_transfer_core::drain::ExposureToken::random();
        let pool = reg.pool.id();
        let out = reg.authority.expose(lease, peer, reg.key, self.inner.endpoint.clone(), token);
        lock(&self.inner.drain).expose_with(pool, out.0.tenancies(), peer, Trust::Proving, token);
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
        let Some(peer) = lease.peer() else { return 0 };
        self.inner.revoke_tenancies(&reg, peer, lease.tenancies())
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

/// The target side every backend shares. A peer's descriptor is its
/// listening endpoint (`127.0.0.1:port`); adding it connects to it (or finds
/// the connection it opened to us).
impl Target for SimNic {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        SimNic::register_pool(self, region, config).map_err(|e| match e {
            NicError::Pool(p) => BackendError::Pool(p),
            NicError::ShuttingDown => BackendError::ShuttingDown,
            e => BackendError::Engine { backend: "tcp-sim", message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        Ok(self.endpoint().as_bytes().to_vec())
    }
    /// The connection the peer opened to us if there is one (a dialer's
    /// handshake returns only once the connection is registered at the
    /// accepting side, so both sides adding each other end on one
    /// connection), otherwise a new one.
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        let endpoint =
            std::str::from_utf8(descriptor).map_err(|_| BackendError::Peer("endpoint is not UTF-8".into()))?;
        self.connect(endpoint).map_err(|e| BackendError::Peer(format!("{endpoint}: {e}")))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        SimNic::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.stats().fields()
    }
}

impl NicInner {
    fn reg_for_pool(&self, id: PoolId) -> Option<Arc<Reg>> {
        self.regs.read().unwrap_or_else(|p| p.into_inner()).iter().find(|r| r.pool.id() == id).cloned()
    }
    fn reg_for_key(&self, key: u64) -> Option<Arc<Reg>> {
        self.regs.read().unwrap_or_else(|p| p.into_inner()).iter().find(|r| r.key == key).cloned()
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
}
