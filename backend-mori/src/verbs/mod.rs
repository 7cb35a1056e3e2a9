//! [`VerbsTransport`]: a [`MoriTransport`] on RDMA verbs, so that MORI-IO's
//! semantics (the engine layer and the adapter above it, unchanged) run on a
//! real NIC. It drives any [`backend_verbs::Engine`]: libibverbs
//! (`backend_verbs::DeviceEngine`, Soft-RoCE in `scripts/rdma-lab`'s guest)
//! or `backend-verbs`' software NIC ([`backend_verbs::FakeFabric`]) on any
//! host.
//!
//! # MORI's data path, as MORI-IO's RDMA backend has it
//!
//! - Each pair of engines is one connection of [`VerbsTransportConfig::qps`]
//!   RC queue pairs (2 by default), set up over a TCP side channel (see
//!   `handshake`), which stays open as the connection's lifeline.
//! - Data: one RDMA WRITE or READ per posted operation, on the queue pair
//!   its remote key names (below).
//! - Notifications: a SEND of the engine's notification. A one-segment
//!   WRITE's success notification is posted right behind the WRITE on the
//!   same queue pair ([`MoriTransport::carries_notifications`]): MORI's own
//!   order, data WRITEs then a SEND on each queue pair used. RC delivers the
//!   SEND only after the WRITE placed its bytes, and a WRITE the target
//!   refuses puts the queue pair in ERR, which flushes the SEND: the target
//!   never hears of a success that did not land. Other notifications (a
//!   batch's, a failure's) and control messages go on queue pair 0 once the
//!   engine saw the transfer's completions.
//! - Receives: [`RECV_DEPTH`] posted per queue pair, reposted as they
//!   complete; a SEND is taken as its connection's engine only once that
//!   connection is bound to it (see `handshake`); otherwise it is dropped
//!   and counted ([`VerbsTransportStats::unbound_messages`], or
//!   [`VerbsTransportStats::impostor_messages`] for a connection that
//!   claimed a registered engine under another ticket).
//!
//! # What is closed: a memory window per tenancy
//!
//! MORI registers the KV pool once and hands every peer the region's key.
//! With [`Access::WindowPerTenancy`] (the default) the pool is registered
//! `LOCAL_WRITE | MW_BIND` only, so its own key grants nothing remote;
//! [`MoriTransport::grant`] binds a type-2 memory window over the one slot
//! for the one tenancy, on one queue pair of the peer's connection, waits
//! for the bind's completion, and returns the window's key (bits 0..32)
//! with the queue pair's index (bits 32..40) and [`WINDOW_KEY`]. The adapter
//! hands it to the peer in the slot's [`kv_transfer_core::RemoteSlot::key`];
//! the initiator's transport posts on that queue pair with that key.
//!
//! - [`MoriTransport::revoke`] posts `LOCAL_INV` of the window and returns
//!   `true` once it completed (the NIC refuses the key from then on), or
//!   once the window's queue pair is in ERR (a type-2 window works only
//!   through its queue pair). A late WRITE under the old key fails with
//!   `REM_ACCESS_ERR` and leaves the memory unchanged.
//! - [`MoriTransport::fence`] moves the connection's queue pairs to ERR,
//!   closes the side channel, and returns once every request posted on them
//!   completed (flushed): nothing more leaves or lands through them.
//! - An error completion on a connection (a refused access, a retry that ran
//!   out, a side channel closed by the peer) does the same and then reports
//!   [`TransportEvent::PeerLost`], so the adapter holds a `Fenced` proof.
//!
//! [`Access::RegionKey`] is MORI's own behaviour (the region's key for
//! everything, no per-slot check, no revocation): the positive control.
//!
//! # Threads and locks
//!
//! One thread polls the NIC's completions and keeps this transport's books;
//! events queue for [`MoriTransport::poll`] (no push delivery: the engine
//! holds its lock while it fences, and a fence waits for this thread). One
//! thread accepts side-channel connections; each handshake runs on a thread
//! of its own (capped in all and per source address, by a whole-handshake
//! deadline: [`VerbsTransportConfig::side_channel`]), which then watches the
//! connection's lifeline. Every other wait (a bind, an invalidation, a
//! fence, a dialed handshake) is bounded by [`VerbsTransportConfig::timeout`].

mod accept;
mod handshake;
#[cfg(test)]
mod hostile_tests;
use accept::accept_loop;
mod ops;

use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use backend_verbs::adapter::{fresh_ticket, parse_descriptor, Deadline, Descriptor, SideChannelLimits, Ticket};
use backend_verbs::{Completion as Wc, Endpoint, Engine, MrAccess, MrId, MwId, QpId, WcStatus, WorkRequest as Wr};
use kv_transfer_core::auth::{AcceptorConfig, AuthCounters, AuthStats, ClusterKey, DialerConfig, Identity};
use kv_transfer_core::drain::{Capabilities, ReleasePolicy};
use kv_transfer_core::{HostRegion, Region};

use crate::error::TransportError;
use crate::notify::{decode_notification, encode_notification, MSG_NOTIFY};
use crate::region::SimMem;
use crate::transport::{Completion, MoriTransport, Notification, OpKind, TransportEvent, WorkRequest};
use crate::types::{EngineDesc, EngineKey, MemoryId, MemoryLocation, MemoryRegion};
use crate::util::{lock, HashMap};
use handshake::{read_ready, read_ticket, tickets_match, write_all, Offer, READY};

/// Name this transport publishes in [`EngineDesc::transport`].
pub const RDMA: &str = "rdma";

/// Bit of a key returned by [`MoriTransport::grant`] that marks it a
/// window's (bits 32..40: the queue pair's index, bits 0..32: the rkey).
pub const WINDOW_KEY: u64 = 1 << 40;

/// Receives posted per queue pair.
pub const RECV_DEPTH: usize = 64;
/// Send buffers per transport (a SEND holds one until its completion).
pub const SEND_BUFFERS: usize = 256;
/// Bytes of one SEND: a kind byte and a control message of core's drain
/// protocol at its largest (a notification is far smaller; its text is cut
/// to fit).
pub const MAX_MESSAGE: usize = 1 + kv_transfer_core::drain::MAX_LEN;

/// The protocol of the side channel's handshake under the cluster key
/// (core's [`kv_transfer_core::auth`]).
pub const AUTH_CONTEXT: &str = "kvt-mori-verbs-side-channel";

/// First byte of a SEND: a control message ([`MoriTransport::send_message`]).
const MSG_CONTROL: u8 = 2;

/// What the adapter over this transport can prove.
pub const fn capabilities(access: Access) -> Capabilities {
    match access {
        // Drain (control messages), revoke (window invalidation), fence
        // (queue pairs to ERR, flushed).
        Access::WindowPerTenancy => Capabilities::ALL,
        Access::RegionKey => Capabilities { drain: true, revoke: false, fence: true },
    }
}

/// How exposed memory is keyed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Access {
    /// A memory window per tenancy (the default): see the module docs.
    #[default]
    WindowPerTenancy,
    /// MORI's own: the region's key grants every peer all of it for as long
    /// as it is registered (the positive control).
    RegionKey,
}

/// Configuration of a [`VerbsTransport`].
#[derive(Clone, Debug)]
pub struct VerbsTransportConfig {
    /// Where the side channel listens (`host:port`; port 0: any).
    pub listen: String,
    /// RC queue pairs per connection (1..=8).
    pub qps: usize,
    /// Path MTU (256..4096).
    pub mtu: u32,
    /// How exposed memory is keyed.
    pub access: Access,
    /// Bound of every wait: a handshake step, a bind, an invalidation, a fence.
    pub timeout: Duration,
    /// Keep [`ReleasePolicy::Safe`]. `Naive` is the hostile-peer scenarios'
    /// positive control only: a connection is bound to the engine its hello
    /// names whatever ticket it presents, so an impostor displaces the
    /// engine it names.
    pub policy: ReleasePolicy,
    /// Caps and deadlines of the side channel's acceptor (handshakes at
    /// once, per source address, whole-handshake deadline, idle bound;
    /// `serial` is the positive control: one handshake at a time on the
    /// accepting thread, as before).
    pub side_channel: SideChannelLimits,
    /// The deployment's cluster key, which every side-channel connection's
    /// handshake (core's [`kv_transfer_core::auth`], before anything else
    /// on it) proves both ends hold. `None`: [`ClusterKey::from_env`] when
    /// the transport is built (its error is [`TransportError::Key`]; no
    /// variable set: the public single-host key, with a warning).
    pub cluster_key: Option<ClusterKey>,
    /// The positive control only: addresses (a relay's) that this side's
    /// acceptor takes as its own, i.e. the handshake's address binding off
    /// for them. Keep it empty.
    pub positive_control_addresses: Vec<String>,
}

impl Default for VerbsTransportConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".to_owned(),
            qps: 2,
            mtu: 1024,
            access: Access::WindowPerTenancy,
            timeout: Duration::from_secs(5),
            policy: ReleasePolicy::Safe,
            side_channel: SideChannelLimits::default(),
            cluster_key: None,
            positive_control_addresses: Vec::new(),
        }
    }
}

/// Counters of a [`VerbsTransport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerbsTransportStats {
    /// Connections set up (dialed or accepted).
    pub connections: u64,
    /// Side-channel connections refused (a bad hello, a wrong ticket).
    pub refused_hellos: u64,
    /// SENDs that arrived on a connection not bound to an engine (dropped).
    pub unbound_messages: u64,
    /// Hellos that claimed a registered engine with another ticket.
    pub impostor_hellos: u64,
    /// SENDs that arrived on such an impostor's connection (dropped).
    pub impostor_messages: u64,
    /// Windows bound.
    pub windows_bound: u64,
    /// Windows invalidated (confirmed).
    pub windows_invalidated: u64,
    /// Connections drained after an error (reported `PeerLost`).
    pub connections_lost: u64,
    /// Fences completed.
    pub fences: u64,
    /// Error completions of data operations.
    pub data_errors: u64,
    /// Side-channel connections closed at once: handshakes at their cap.
    pub handshakes_busy: u64,
    /// Side-channel handshakes in flight closed to make room at the total
    /// for a newer connection (`SideChannelLimits::evict_oldest`).
    pub handshakes_evicted: u64,
    /// Side-channel connections closed at once: their address's cap.
    pub handshakes_per_address: u64,
    /// Side-channel connections closed at once: their address's
    /// connections bound to no engine at their cap.
    pub claims_refused: u64,
    /// The side channel's handshakes under the cluster key (both ways), by
    /// outcome ([`VerbsTransport::auth_stats`]).
    pub auth: AuthStats,
}

/// A connection's lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConnState {
    /// The acceptor waits for the dialer's [`READY`].
    Handshaking,
    /// Up, claiming an engine whose descriptor is not registered yet.
    Unbound { ticket: Ticket },
    /// Up, claiming a registered engine under another ticket: never bound.
    /// Kept open until its lifeline closes, so that every SEND it makes is
    /// dropped and counted ([`VerbsTransportStats::impostor_messages`]).
    Impostor,
    /// Up and bound to its engine.
    Bound,
    /// Queue pairs in ERR, waiting for every posted request's completion;
    /// `report`: then tell the engine ([`TransportEvent::PeerLost`]).
    Draining { report: bool },
    /// Nothing posted on it can complete any more.
    Down,
}

struct Conn {
    /// The engine it claims (bound: is).
    peer: EngineKey,
    qps: Vec<QpId>,
    state: ConnState,
    /// Requests posted on its queue pairs (receives included) not completed.
    outstanding: usize,
    /// Its receive buffers (`RECV_DEPTH` per queue pair).
    recv: (MrId, Arc<HostRegion>),
    /// The side channel, kept to close it.
    stream: TcpStream,
}

/// A posted request, until its completion.
#[derive(Clone, Copy, Debug)]
enum Pending {
    /// `windowed`: under a memory window's key (a refusal then means the
    /// tenancy it was granted for is over).
    Data {
        conn: u64,
        engine_wr: u64,
        mem: MemoryId,
        windowed: bool,
    },
    Send {
        conn: u64,
        buf: usize,
    },
    Recv {
        conn: u64,
        buf: usize,
    },
    Bind {
        conn: u64,
        tenancy: (MemoryId, u32, u64),
    },
    Invalidate {
        conn: u64,
        tenancy: (MemoryId, u32, u64),
    },
}

impl Pending {
    fn conn(self) -> u64 {
        match self {
            Pending::Data { conn, .. }
            | Pending::Send { conn, .. }
            | Pending::Recv { conn, .. }
            | Pending::Bind { conn, .. }
            | Pending::Invalidate { conn, .. } => conn,
        }
    }
}

/// A tenancy's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WindowState {
    Binding,
    Bound,
    /// `LOCAL_INV` posted; `wait`: someone waits for its confirmation.
    Invalidating,
    /// The bind failed.
    Failed,
}

struct Window {
    mw: MwId,
    conn: u64,
    qp_index: usize,
    state: WindowState,
}

struct Registered {
    mr: MrId,
    rkey: u64,
    len: u64,
    slot_size: u64,
    /// Data operations posted on it, not completed.
    busy: usize,
    /// Keeps the memory alive while the NIC may touch it.
    _mem: Arc<SimMem>,
}

#[derive(Default)]
struct State {
    next_wr: u64,
    next_conn: u64,
    wrs: HashMap<u64, Pending>,
    conns: HashMap<u64, Conn>,
    /// The connection bound to each engine.
    bound: HashMap<EngineKey, u64>,
    /// Descriptors of the engines the local engine registered.
    peers: HashMap<EngineKey, Descriptor>,
    regions: HashMap<MemoryId, Registered>,
    windows: HashMap<(MemoryId, u32, u64), Window>,
    spare_windows: Vec<MwId>,
    send_free: Vec<usize>,
    stats: VerbsTransportStats,
}

impl State {
    fn wr_id(&mut self) -> u64 {
        self.next_wr = self.next_wr.wrapping_add(1);
        self.next_wr
    }
}

struct Shared {
    nic: Arc<dyn Engine>,
    cfg: VerbsTransportConfig,
    ticket: Ticket,
    local: OnceLock<EngineKey>,
    /// The send buffers (`SEND_BUFFERS` of `MAX_MESSAGE` bytes).
    send: (MrId, Arc<HostRegion>),
    st: Mutex<State>,
    /// Signalled when a bind or invalidation completes, a connection
    /// changes state, or a connection drained.
    changed: Condvar,
    events: Mutex<VecDeque<TransportEvent>>,
    event_ready: Condvar,
    closed: AtomicBool,
    polls: AtomicU64,
    /// Handshakes in flight, in all and per source address.
    gate: kv_transfer_core::PeerGate<std::net::IpAddr, std::net::TcpStream>,
    /// The cluster key (resolved when the transport is built).
    key: ClusterKey,
    /// The side channel's own address (what its descriptor publishes).
    addr: String,
    /// The acceptor's side of the handshake (set at attach, when this
    /// side's name is known; one replay cache for every handshake of the
    /// listener).
    auth: OnceLock<AcceptorConfig>,
    /// Handshakes under the cluster key, both ways, by outcome.
    auth_counters: AuthCounters,
}

/// MORI's transport on RDMA verbs; see the [module docs](self).
pub struct VerbsTransport {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    listener: Mutex<Option<TcpListener>>,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport").field("local", &self.shared.local.get()).finish_non_exhaustive()
    }
}

fn verbs_err(e: backend_verbs::VerbsError) -> TransportError {
    TransportError::Remote(format!("verbs: {e}"))
}

fn io_err(what: &str, e: std::io::Error) -> TransportError {
    TransportError::State(format!("{what}: {e}"))
}

impl VerbsTransport {
    /// A transport on `nic`, its side channel listening at `cfg.listen`.
    pub fn new(cfg: VerbsTransportConfig, nic: Arc<dyn Engine>) -> Result<Arc<Self>, TransportError> {
        if cfg.qps == 0 || cfg.qps > handshake::MAX_QPS {
            return Err(TransportError::State(format!("{} queue pairs (1..={})", cfg.qps, handshake::MAX_QPS)));
        }
        let key = match &cfg.cluster_key {
            Some(k) => k.clone(),
            None => ClusterKey::from_env()?,
        };
        let ring = HostRegion::new(SEND_BUFFERS * MAX_MESSAGE).map_err(|e| TransportError::State(e.to_string()))?;
        let ring = Arc::new(ring);
        let info = nic.register(ring.clone(), MrAccess::Local).map_err(verbs_err)?;
        let listener = TcpListener::bind(&cfg.listen).map_err(|e| io_err("side channel", e))?;
        listener.set_nonblocking(true).map_err(|e| io_err("side channel", e))?;
        let addr = listener.local_addr().map_err(|e| io_err("side channel", e))?.to_string();
        let st = State { send_free: (0..SEND_BUFFERS).rev().collect(), ..State::default() };
        let cfg_gate = (cfg.side_channel.handshakes, cfg.side_channel.per_address);
        let shared = Arc::new(Shared {
            nic,
            cfg,
            ticket: fresh_ticket(),
            local: OnceLock::new(),
            send: (info.id, ring),
            st: Mutex::new(st),
            changed: Condvar::new(),
            events: Mutex::new(VecDeque::new()),
            event_ready: Condvar::new(),
            closed: AtomicBool::new(false),
            polls: AtomicU64::new(0),
            gate: kv_transfer_core::PeerGate::new(cfg_gate.0, cfg_gate.1),
            key,
            addr,
            auth: OnceLock::new(),
            auth_counters: AuthCounters::default(),
        });
        let sh = shared.clone();
        let poller = std::thread::Builder::new()
            .name("mori-verbs-cq".into())
            .spawn(move || sh.poll_loop())
            .map_err(|e| io_err("thread", e))?;
        Ok(Arc::new(Self { shared, threads: Mutex::new(vec![poller]), listener: Mutex::new(Some(listener)) }))
    }

    /// Counters.
    pub fn stats(&self) -> VerbsTransportStats {
        let mut s = self.shared.st().stats;
        s.auth = self.shared.auth_counters.snapshot();
        s
    }

    /// The side channel's handshakes under the cluster key (both ways), by
    /// outcome (also in [`stats`](Self::stats)).
    pub fn auth_stats(&self) -> AuthStats {
        self.shared.auth_counters.snapshot()
    }

    /// The side channel's address.
    pub fn side_channel(&self) -> Option<String> {
        lock(&self.listener).as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string())
    }

    /// The queue pairs of the connection bound to `remote` (empty if none):
    /// for tests that hold or break them on a software NIC.
    pub fn queue_pairs(&self, remote: &EngineKey) -> Vec<u32> {
        let st = self.shared.st();
        st.bound
            .get(remote)
            .and_then(|c| st.conns.get(c))
            .map(|c| c.qps.iter().map(|q| q.0).collect())
            .unwrap_or_default()
    }

    /// Stops as a crashed process would: every queue pair to ERR and every
    /// side channel closed at once, with no goodbye; peers learn it from
    /// their lifelines (or their next request).
    pub fn crash(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let mut st = self.shared.st();
        for c in st.conns.values_mut() {
            for q in &c.qps {
                let _ = self.shared.nic.to_error(*q);
            }
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Shared {
    fn st(&self) -> MutexGuard<'_, State> {
        lock(&self.st)
    }

    fn push(&self, e: TransportEvent) {
        lock(&self.events).push_back(e);
        self.event_ready.notify_one();
    }

    fn local(&self) -> Result<&EngineKey, TransportError> {
        self.local.get().ok_or_else(|| TransportError::State("transport not attached".to_owned()))
    }

    /// Waits on `changed` until `done` holds or the timeout passes.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        mut done: impl FnMut(&mut State) -> bool,
    ) -> (MutexGuard<'a, State>, bool) {
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            if done(&mut st) {
                return (st, true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (st, false);
            }
            st = self.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Posts `wr` on `qp` of connection `conn`, booked as `p`.
    fn post_on(&self, st: &mut State, conn: u64, qp: QpId, wr: Wr, p: Pending) -> Result<Option<u32>, TransportError> {
        let id = st.wr_id();
        let key = self.nic.post(qp, id, wr).map_err(verbs_err)?;
        st.wrs.insert(id, p);
        if let Some(c) = st.conns.get_mut(&conn) {
            c.outstanding += 1;
        }
        Ok(key)
    }

    /// The bound connection to `remote`, if it is up.
    fn conn_to(&self, st: &State, remote: &EngineKey) -> Result<u64, TransportError> {
        st.bound
            .get(remote)
            .copied()
            .filter(|c| st.conns.get(c).is_some_and(|c| c.state == ConnState::Bound))
            .ok_or_else(|| TransportError::UnknownPeer(remote.clone()))
    }

    /// SEND of `kind` + `body` on queue pair `qp_index` of `conn`.
    fn send_on(&self, st: &mut State, conn: u64, qp_index: usize, bytes: &[u8]) -> Result<(), TransportError> {
        if bytes.len() > MAX_MESSAGE {
            return Err(TransportError::OutOfBounds);
        }
        let qp = st.conns.get(&conn).and_then(|c| c.qps.get(qp_index).copied()).ok_or(TransportError::OutOfBounds)?;
        let buf = st.send_free.pop().ok_or_else(|| TransportError::Remote("all send buffers in flight".to_owned()))?;
        let at = buf * MAX_MESSAGE;
        if let Err(e) = self.send.1.write(at, bytes) {
            st.send_free.push(buf);
            return Err(TransportError::State(e.to_string()));
        }
        let wr = Wr::Send { local: self.send.0, offset: at as u64, len: bytes.len() as u32 };
        self.post_on(st, conn, qp, wr, Pending::Send { conn, buf }).map(|_| ()).inspect_err(|_| st.send_free.push(buf))
    }

    /// Moves `conn`'s queue pairs to ERR and closes its side channel; it is
    /// down once every request posted on it completed.
    fn start_drain(&self, st: &mut State, conn: u64, report: bool) {
        let Some(c) = st.conns.get_mut(&conn) else { return };
        if matches!(c.state, ConnState::Draining { .. } | ConnState::Down) {
            return;
        }
        let was_bound = c.state == ConnState::Bound;
        c.state = ConnState::Draining { report: report && was_bound };
        for q in &c.qps {
            if let Err(e) = self.nic.to_error(*q) {
                tracing::warn!(qp = q.0, error = %e, "queue pair not moved to ERR");
            }
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        tracing::info!(peer = %c.peer, report, "connection draining");
        self.settle_drain(st, conn);
        self.changed.notify_all();
    }

    /// A draining connection with nothing posted is down.
    fn settle_drain(&self, st: &mut State, conn: u64) {
        let Some(c) = st.conns.get_mut(&conn) else { return };
        let ConnState::Draining { report } = c.state else { return };
        if c.outstanding > 0 {
            return;
        }
        c.state = ConnState::Down;
        let peer = c.peer.clone();
        let recv_mr = c.recv.0;
        self.nic.deregister(recv_mr);
        if st.bound.get(&peer) == Some(&conn) {
            st.bound.remove(&peer);
        }
        st.conns.remove(&conn);
        if report {
            st.stats.connections_lost += 1;
            self.push(TransportEvent::PeerLost { peer });
        }
        self.changed.notify_all();
    }

    fn poll_loop(self: Arc<Self>) {
        let mut idle = 0u32;
        while !self.closed.load(Ordering::Acquire) {
            let cs = match self.nic.poll(64) {
                Ok(cs) => cs,
                Err(e) => {
                    tracing::error!(error = %e, "completion queue poll failed");
                    Vec::new()
                }
            };
            self.polls.fetch_add(1, Ordering::Relaxed);
            if cs.is_empty() {
                // Spin briefly, then sleep: a completion is usually close
                // behind a post, and an idle NIC should not cost a core.
                idle = idle.saturating_add(1);
                if idle > 64 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            idle = 0;
            let mut st = self.st();
            for c in cs {
                self.on_completion(&mut st, c);
            }
        }
    }

    fn on_completion(&self, st: &mut State, wc: Wc) {
        let Some(p) = st.wrs.remove(&wc.wr_id) else {
            tracing::warn!(wr_id = wc.wr_id, "completion for no posted request");
            return;
        };
        let conn = p.conn();
        if let Some(c) = st.conns.get_mut(&conn) {
            c.outstanding = c.outstanding.saturating_sub(1);
        }
        let ok = wc.status.is_success();
        let draining = st.conns.get(&conn).map_or(true, |c| matches!(c.state, ConnState::Draining { .. }));
        match p {
            Pending::Data { engine_wr, mem, windowed, .. } => {
                if let Some(r) = st.regions.get_mut(&mem) {
                    r.busy = r.busy.saturating_sub(1);
                }
                let result = match wc.status {
                    _ if ok => Ok(()),
                    // The target's NIC refused the key: a window's tenancy
                    // is over (invalidated); the region's key is not
                    // registered any more. In the words the adapter types
                    // as core's rejection.
                    WcStatus::RemoteAccess => {
                        st.stats.data_errors += 1;
                        let why = if windowed { "stale generation" } else { "unknown key" };
                        Err(TransportError::Remote(format!(
                            "work completion RemoteAccess: rejected by the target: {why}"
                        )))
                    }
                    status => {
                        st.stats.data_errors += 1;
                        Err(TransportError::Remote(format!("work completion {status:?}")))
                    }
                };
                self.push(TransportEvent::Completion(Completion { wr_id: engine_wr, result }));
            }
            Pending::Send { buf, .. } => st.send_free.push(buf),
            Pending::Recv { buf, .. } if ok => self.on_receive(st, conn, buf, wc.byte_len as usize, wc.qp_num),
            Pending::Recv { .. } => {}
            Pending::Bind { tenancy, .. } => {
                if let Some(w) = st.windows.get_mut(&tenancy) {
                    w.state = if ok { WindowState::Bound } else { WindowState::Failed };
                }
                if ok {
                    st.stats.windows_bound += 1;
                }
                self.changed.notify_all();
            }
            Pending::Invalidate { tenancy, .. } => {
                if let Some(w) = st.windows.remove(&tenancy) {
                    if ok {
                        st.stats.windows_invalidated += 1;
                        st.spare_windows.push(w.mw);
                    } else {
                        // Flushed: its queue pair is in ERR, the window still
                        // bound to it (and good for nothing); not reused.
                        self.nic.free_window(w.mw);
                    }
                }
                self.changed.notify_all();
            }
        }
        if !ok && !draining && wc.status != WcStatus::Flushed {
            tracing::warn!(status = ?wc.status, "error completion: the connection is drained");
        }
        if !ok && !draining {
            self.start_drain(st, conn, true);
        }
        self.settle_drain(st, conn);
    }

    fn on_receive(&self, st: &mut State, conn: u64, buf: usize, len: usize, qp_num: u32) {
        let Some(c) = st.conns.get(&conn) else { return };
        let mut bytes = vec![0u8; len.min(MAX_MESSAGE)];
        let read = c.recv.1.read(buf * MAX_MESSAGE, &mut bytes);
        let (state, peer, recv_mr) = (c.state, c.peer.clone(), c.recv.0);
        // The buffer goes back to the queue pair it came from.
        if matches!(state, ConnState::Bound | ConnState::Unbound { .. } | ConnState::Impostor | ConnState::Handshaking)
        {
            let wr = Wr::Recv { local: recv_mr, offset: (buf * MAX_MESSAGE) as u64, len: MAX_MESSAGE as u32 };
            if let Err(e) = self.post_on(st, conn, QpId(qp_num), wr, Pending::Recv { conn, buf }) {
                tracing::warn!(error = %e, "receive not reposted");
            }
        }
        if state == ConnState::Impostor {
            st.stats.impostor_messages += 1;
            tracing::warn!(claimed = %peer, "SEND from an impostor's connection dropped");
            return;
        }
        if state != ConnState::Bound || read.is_err() {
            st.stats.unbound_messages += 1;
            return;
        }
        match bytes.split_first() {
            Some((&MSG_NOTIFY, body)) => match decode_notification(body) {
                Some(notification) => self.push(TransportEvent::Notification { from: peer, notification }),
                None => tracing::warn!(peer = %peer, "malformed notification dropped"),
            },
            Some((&MSG_CONTROL, body)) => self.push(TransportEvent::Message { from: peer, bytes: body.to_vec() }),
            _ => tracing::warn!(peer = %peer, "unknown SEND dropped"),
        }
    }

    /// Sets up the queue pairs of a new connection: created, connected to
    /// `theirs`, receives posted. Returns its id (state `state`).
    fn open_conn(
        &self,
        peer: EngineKey,
        ours: &[Endpoint],
        theirs: &[Endpoint],
        stream: &TcpStream,
        state: ConnState,
    ) -> Result<u64, TransportError> {
        if ours.len() != theirs.len() {
            return Err(TransportError::Remote(format!("{} queue pairs offered, {} asked", theirs.len(), ours.len())));
        }
        for (o, t) in ours.iter().zip(theirs) {
            if let Err(e) = self.nic.connect(QpId(o.qpn), t) {
                ours.iter().for_each(|q| self.nic.destroy_qp(QpId(q.qpn)));
                return Err(verbs_err(e));
            }
        }
        let ring =
            HostRegion::new(ours.len() * RECV_DEPTH * MAX_MESSAGE).map_err(|e| TransportError::State(e.to_string()))?;
        let ring = Arc::new(ring);
        let info = self.nic.register(ring.clone(), MrAccess::Local).map_err(verbs_err)?;
        let stream = stream.try_clone().map_err(|e| io_err("side channel", e))?;
        let mut st = self.st();
        st.next_conn += 1;
        let id = st.next_conn;
        let qps: Vec<QpId> = ours.iter().map(|e| QpId(e.qpn)).collect();
        st.conns.insert(id, Conn { peer, qps: qps.clone(), state, outstanding: 0, recv: (info.id, ring), stream });
        for (i, qp) in qps.iter().enumerate() {
            for j in 0..RECV_DEPTH {
                let buf = i * RECV_DEPTH + j;
                let wr = Wr::Recv { local: info.id, offset: (buf * MAX_MESSAGE) as u64, len: MAX_MESSAGE as u32 };
                if let Err(e) = self.post_on(&mut st, id, *qp, wr, Pending::Recv { conn: id, buf }) {
                    self.start_drain(&mut st, id, false);
                    return Err(e);
                }
            }
        }
        st.stats.connections += 1;
        Ok(id)
    }

    fn create_qps(&self) -> Result<Vec<Endpoint>, TransportError> {
        let mut eps = Vec::with_capacity(self.cfg.qps);
        for _ in 0..self.cfg.qps {
            match self.nic.create_qp(self.cfg.mtu) {
                Ok(e) => eps.push(e),
                Err(e) => {
                    eps.iter().for_each(|q| self.nic.destroy_qp(QpId(q.qpn)));
                    return Err(verbs_err(e));
                }
            }
        }
        Ok(eps)
    }

    /// Dials `d` and sets up a bound connection to it.
    fn dial(self: &Arc<Self>, d: &Descriptor) -> Result<(u64, TcpStream), TransportError> {
        let local = self.local()?.clone();
        let addr = d
            .addr
            .to_socket_addrs()
            .map_err(|e| io_err("side channel address", e))?
            .next()
            .ok_or_else(|| TransportError::Remote(format!("no address for {}", d.addr)))?;
        let mut s = TcpStream::connect_timeout(&addr, self.cfg.timeout)
            .map_err(|e| TransportError::Remote(format!("side channel to {}: {e}", d.addr)))?;
        s.set_read_timeout(Some(self.cfg.timeout)).map_err(|e| io_err("side channel", e))?;
        let _ = s.set_nodelay(true);
        // The whole exchange by one deadline (a trickling answer restarts
        // no timeout).
        let deadline = Instant::now() + self.cfg.timeout;
        // Core's handshake first: both ends prove the cluster key, this
        // side names the address it dialed, and the other end must prove
        // the descriptor's name. Nothing else is written before it.
        let auth = DialerConfig {
            key: self.key.clone(),
            context: AUTH_CONTEXT.into(),
            me: Identity::new(local.as_str(), self.addr.clone()),
            dialed: d.addr.clone(),
            expect_name: Some(d.name.clone()),
        };
        kv_transfer_core::auth::dial(&mut Deadline::new(&s, deadline, self.cfg.timeout), auth, &self.auth_counters)?;
        let ours = self.create_qps()?;
        let mut hello = Offer { key: local.as_str().to_owned(), endpoints: ours.clone(), ticket: d.ticket }.encode()?;
        hello.extend_from_slice(&self.ticket);
        let answer = write_all(&mut s, &hello, self.cfg.timeout)
            .and_then(|()| Offer::read_from(&mut Deadline::new(&s, deadline, self.cfg.timeout)));
        let theirs = match answer {
            Ok(o) if o.key == d.name => o,
            Ok(o) => {
                ours.iter().for_each(|q| self.nic.destroy_qp(QpId(q.qpn)));
                return Err(TransportError::Remote(format!("dialed {}, {} answered", d.name, o.key)));
            }
            Err(e) => {
                ours.iter().for_each(|q| self.nic.destroy_qp(QpId(q.qpn)));
                return Err(e);
            }
        };
        let id = self.open_conn(EngineKey::new(&d.name), &ours, &theirs.endpoints, &s, ConnState::Handshaking)?;
        if let Err(e) = write_all(&mut s, &[READY], self.cfg.timeout) {
            self.start_drain(&mut self.st(), id, false);
            return Err(e);
        }
        let mut st = self.st();
        self.bind(&mut st, id);
        self.changed.notify_all();
        drop(st);
        Ok((id, s))
    }

    /// The acceptor's half of a handshake on `s`.
    /// Every read of it is bounded by the whole-handshake deadline
    /// (`side_channel.deadline`, from accept to READY) and the idle bound.
    fn accept_one(self: &Arc<Self>, mut s: TcpStream) -> Result<(u64, TcpStream), TransportError> {
        s.set_nonblocking(false).map_err(|e| io_err("side channel", e))?;
        let _ = s.set_nodelay(true);
        let limits = &self.cfg.side_channel;
        let deadline = Instant::now() + limits.deadline;
        // Core's handshake before anything else is read: the dialer proves
        // the cluster key and that it dialed this side's address (a relay's
        // handshake is refused); counted either way.
        let auth = self.auth.get().ok_or_else(|| TransportError::State("transport not attached".to_owned()))?;
        let from = s.peer_addr().ok().map(|a| a.ip());
        let est = kv_transfer_core::auth::accept(
            &mut Deadline::new(&s, deadline, limits.idle),
            auth,
            from,
            &self.auth_counters,
        )?;
        let offer = Offer::read_from(&mut Deadline::new(&s, deadline, limits.idle))?;
        let theirs = read_ticket(&mut Deadline::new(&s, deadline, limits.idle))?;
        if offer.key != est.peer.identity.name {
            return Err(TransportError::Auth {
                refusal: crate::error::AuthRefusal::NameMismatch,
                detail: format!("an offer from {:?}, whose handshake proved {:?}", offer.key, est.peer.identity.name),
            });
        }
        if !tickets_match(&offer.ticket, &self.ticket) {
            return Err(TransportError::Remote(format!("a hello from {:?} without this side's ticket", offer.key)));
        }
        if offer.endpoints.len() != self.cfg.qps {
            return Err(TransportError::Remote(format!(
                "{} queue pairs (this side: {})",
                offer.endpoints.len(),
                self.cfg.qps
            )));
        }
        let local = self.local()?.clone();
        let ours = self.create_qps()?;
        let peer = EngineKey::new(&offer.key);
        let id = self.open_conn(peer.clone(), &ours, &offer.endpoints, &s, ConnState::Handshaking)?;
        let answer = Offer { key: local.as_str().to_owned(), endpoints: ours, ticket: [0; 16] }.encode();
        if let Err(e) = answer
            .and_then(|a| write_all(&mut s, &a, self.cfg.timeout))
            .and_then(|()| read_ready(&mut Deadline::new(&s, deadline, limits.idle)))
        {
            self.start_drain(&mut self.st(), id, false);
            return Err(e);
        }
        let mut st = self.st();
        let bind = st.peers.get(&peer).map(|d| tickets_match(&d.ticket, &theirs));
        match bind {
            Some(true) => self.bind(&mut st, id),
            Some(false) => self.impostor(&mut st, id),
            None => {
                if let Some(c) = st.conns.get_mut(&id) {
                    c.state = ConnState::Unbound { ticket: theirs };
                }
            }
        }
        self.changed.notify_all();
        drop(st);
        Ok((id, s))
    }

    /// Binds connection `id` to the engine it claims; an older one bound to
    /// that engine is drained (the peer reconnected after a fence, or after
    /// its NIC put the old queue pairs in ERR).
    fn bind(&self, st: &mut State, id: u64) {
        let Some(c) = st.conns.get_mut(&id) else { return };
        c.state = ConnState::Bound;
        let peer = c.peer.clone();
        if let Some(old) = st.bound.insert(peer, id).filter(|o| *o != id) {
            self.start_drain(st, old, true);
        }
    }

    /// Connection `id` claims a registered engine but presented another
    /// ticket: it is marked an impostor's (never bound; what it sends is
    /// dropped and counted). The positive control binds it instead.
    fn impostor(&self, st: &mut State, id: u64) {
        if self.cfg.policy.is_naive() {
            tracing::error!("NAIVE POSITIVE CONTROL: binding a connection that presented another engine's ticket");
            self.bind(st, id);
            return;
        }
        st.stats.impostor_hellos += 1;
        if let Some(c) = st.conns.get_mut(&id) {
            tracing::warn!(claimed = %c.peer, "a hello under a registered engine's name with another ticket");
            c.state = ConnState::Impostor;
        }
    }

    /// Watches connection `id`'s lifeline: when the peer closes it, the
    /// connection is drained.
    fn watch(self: &Arc<Self>, id: u64, mut s: TcpStream) {
        use std::io::Read;
        let _ = s.set_read_timeout(None);
        let mut b = [0u8; 64];
        // Bounded: each read returns on data, EOF or error; the peer sends
        // nothing after READY, so the first return ends it.
        for _ in 0..1024 {
            match s.read(&mut b) {
                Ok(n) if n > 0 => continue,
                _ => break,
            }
        }
        if !self.closed.load(Ordering::Acquire) {
            self.start_drain(&mut self.st(), id, true);
        }
    }

    fn spawn(self: &Arc<Self>, threads: &Mutex<Vec<JoinHandle<()>>>, name: &str, f: impl FnOnce() + Send + 'static) {
        match std::thread::Builder::new().name(name.to_owned()).spawn(f) {
            Ok(h) => {
                let mut t = lock(threads);
                t.retain(|h| !h.is_finished());
                t.push(h);
            }
            Err(e) => tracing::error!(error = %e, "thread not started"),
        }
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        self.crash();
        self.shared.event_ready.notify_all();
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}
