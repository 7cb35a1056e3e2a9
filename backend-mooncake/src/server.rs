//! Target side: the P2P handshake server and the TCP data server.

use kv_transfer_core::hash::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::EngineError;
use crate::exposed::ExposedRanges;
use crate::limits::{AddrCounts, Admitted, ConnLimits, ConnRefusal, NotifyLimits, NotifyQueue};
use crate::memory::MemoryRegistry;
use crate::proto::{
    BufferDesc, HandshakeFrame, HandshakeType, NotifyDesc, NotifyReply, ProbeReply, RequestHeader, SegmentDesc,
    StatusWord, TcpOpcode, HEADER_LEN, MAX_HANDSHAKE_LEN,
};

/// What a target adds to the handshake server for a transport other than
/// TCP (Mooncake's RDMA: [`crate::rdma::RdmaTarget`], feature `rdma`): the
/// transport's part of the metadata, per requesting peer, and the answer to
/// a Connection exchange; told of every region registered and unregistered
/// so that what remote peers may reach follows the registry.
pub trait TargetHook: Send + Sync + std::fmt::Debug {
    /// Our descriptor as `peer` (the segment name its own metadata gave,
    /// if it sent any) is to see it; `base` is the TCP descriptor. `from`:
    /// the source address of the request that asks (a name is only what a
    /// request declares, the address is what TCP vouched for); `None` when
    /// we send it ourselves, on a connection we dialed to that peer.
    fn descriptor(&self, base: SegmentDesc, peer: Option<&str>, from: Option<IpAddr>) -> SegmentDesc;
    /// The reply to a Connection message (`request` is its JSON body;
    /// `from` the source address of its connection, what TCP vouched for).
    fn connection(&self, request: &[u8], from: IpAddr) -> Vec<u8>;
    /// `[addr, addr+len)` was registered with the engine.
    fn registered(&self, addr: u64, len: u64) -> Result<(), EngineError>;
    /// The region at `addr` is being unregistered: once this returns, no
    /// remote peer may reach it.
    fn unregistered(&self, addr: u64);
    /// Whether the TCP data server may place requests into registered
    /// memory. A target whose data path is another transport (RDMA, whose
    /// keys are per tenancy) says `false`: TCP carries no key, so a request
    /// on it would reach any registered byte, revoked tenancies included.
    fn serves_tcp_data(&self) -> bool {
        true
    }
}

/// Who to wake when a notification is queued ([`crate::TransferEngine::set_notify_waker`]).
#[derive(Default)]
pub(crate) struct WakerSlot(Mutex<Option<crate::engine::NotifyWaker>>);

impl WakerSlot {
    pub(crate) fn set(&self, wake: crate::engine::NotifyWaker) {
        *lock(&self.0) = Some(wake);
    }
    /// Calls the waker, if one is set (outside the slot's lock).
    fn wake(&self) {
        let wake = lock(&self.0).clone();
        if let Some(wake) = wake {
            wake();
        }
    }
}

impl std::fmt::Debug for WakerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if lock(&self.0).is_some() { "WakerSlot(set)" } else { "WakerSlot(none)" })
    }
}

/// Shared state the servers need.
#[derive(Debug)]
pub(crate) struct ServerShared {
    pub(crate) registry: Arc<MemoryRegistry>,
    pub(crate) notifies: Mutex<NotifyQueue>,
    /// Called after each notification is queued (the adapter's control thread).
    pub(crate) notify_waker: WakerSlot,
    pub(crate) notify_limits: NotifyLimits,
    pub(crate) segment_name: String,
    pub(crate) data_host: String,
    pub(crate) data_port: u16,
    pub(crate) data_limits: ConnLimits,
    pub(crate) handshake_limits: ConnLimits,
    pub(crate) stop: AtomicBool,
    pub(crate) advertised_version: u32,
    pub(crate) stats: TargetCounters,
    pub(crate) hook: Option<Arc<dyn TargetHook>>,
    /// What the data server may touch ([`crate::TcpServe`]).
    pub(crate) ranges: ExposedRanges,
    /// Sealed notifications' key, name and counters ([`crate::sealed`]).
    pub(crate) auth: crate::sealed::NotifyAuth,
    /// The IPs of segments this engine opened (how many each): the peers it
    /// chose, told apart from strangers at accept ([`crate::limits`]).
    pub(crate) chosen: Mutex<HashMap<IpAddr, usize>>,
}

macro_rules! target_counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Target-side counters (see [`TargetStats`]).
        #[derive(Debug, Default)]
        pub(crate) struct TargetCounters { $(pub(crate) $name: AtomicU64,)* }

        /// What the data and handshake servers have served and refused so
        /// far. A non-zero `v1_requests` means some initiator speaks v1: its
        /// completions prove nothing about our memory (it cannot learn of a
        /// rejection or of when bytes were applied).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct TargetStats { $($(#[$doc])* pub $name: u64,)* }

        impl TargetCounters {
            pub(crate) fn snapshot(&self) -> TargetStats {
                TargetStats { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

target_counters! {
    /// Accepted requests without the v2 flag.
    v1_requests,
    /// Accepted requests with the v2 flag.
    v2_requests,
    /// Rejected requests (outside registered memory, outside every exposed
    /// range, size 0, bad opcode).
    rejected,
    /// Of `rejected`: inside registered memory but outside every range
    /// exposed for that operation ([`crate::TcpServe::ExposedOnly`]).
    unexposed_rejected,
    /// Bytes applied by remote WRITEs.
    bytes_written,
    /// Bytes served to remote READs.
    bytes_read,
    /// Connections (data or handshake) closed at accept: the port's
    /// `max_conns` was reached.
    conns_refused_global,
    /// Connections closed at accept: their address's `max_conns_per_addr`
    /// was reached.
    conns_refused_per_addr,
    /// Connections closed at accept: strangers (addresses of no segment
    /// this engine opened) held their share of the port
    /// (`max_stranger_conns`).
    conns_refused_strangers,
    /// Connections of strangers closed, unserved, to make room at a full
    /// port for a newer one (`ConnLimits::evict_unserved_strangers`).
    conns_evicted_unserved,
    /// Connections closed for sending nothing within `idle_timeout`.
    idle_closed,
    /// Connections closed for a request not finished within `request_timeout`.
    deadline_closed,
    /// Notifications refused (answered not `success`): their address's
    /// budget, or the queue's, was spent.
    notifies_refused,
    /// Notifications dropped to make room (legacy queue only).
    notifies_dropped,
    /// Sealed notifications accepted: their sender proved its name
    /// ([`crate::sealed`]; refusals are in the engine's `auth_stats`).
    sealed_notifies,
    /// Ranges exposed to the data server now (a gauge).
    ranges_exposed,
    /// Bytes of notifications queued now (a gauge).
    notify_bytes_queued,
}

impl ServerShared {
    /// A segment at `ip` was opened (`true`) or closed (`false`).
    pub(crate) fn choose(&self, ip: IpAddr, opened: bool) {
        let mut g = lock(&self.chosen);
        if opened {
            *g.entry(ip).or_insert(0) += 1;
        } else if let Some(n) = g.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                g.remove(&ip);
            }
        }
    }

    fn admitted_as(&self, ip: IpAddr) -> Admitted {
        if lock(&self.chosen).contains_key(&ip) {
            Admitted::Chosen
        } else {
            Admitted::Stranger
        }
    }
    /// Our descriptor as `peer` is to see it: the TCP one, or what the
    /// target hook makes of it.
    pub(crate) fn published(&self, peer: Option<&str>, from: Option<IpAddr>) -> SegmentDesc {
        match &self.hook {
            Some(hook) => hook.descriptor(self.descriptor(), peer, from),
            None => self.descriptor(),
        }
    }

    /// Our segment descriptor as 0.3.13.post1 sends it.
    pub(crate) fn descriptor(&self) -> SegmentDesc {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        SegmentDesc {
            name: self.segment_name.clone(),
            protocol: "tcp".into(),
            tcp_data_port: self.data_port,
            tcp_proto_version: Some(self.advertised_version),
            tcp_data_host: Some(self.data_host.clone()),
            rdma_server_name: Some(String::new()),
            timestamp: Some(secs.to_string()),
            buffers: self
                .registry
                .regions()
                .into_iter()
                .map(|(addr, length)| BufferDesc {
                    name: self.segment_name.clone(),
                    addr,
                    length,
                    rkey: Vec::new(),
                    lkey: Vec::new(),
                })
                .collect(),
            devices: Vec::new(),
            priority_matrix: None,
            kvt_notify_auth: Some(crate::sealed::SEALED_NOTIFY_VERSION),
        }
    }
}

/// A listening thread; stopped and joined on drop.
#[derive(Debug)]
pub(crate) struct Listener {
    addr: SocketAddr,
    /// A second handle on the listening socket: shutting it down wakes the
    /// blocking `accept` whatever network namespace the dropping thread is
    /// in (a wake-up connection from another namespace never arrives).
    handle: Option<TcpListener>,
    shared: Arc<ServerShared>,
    thread: Option<JoinHandle<()>>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    live: Arc<AtomicUsize>,
}

impl Listener {
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept: shut the listener down (accept returns
        // EINVAL), and connect as well where shutdown is not enough.
        if let Some(l) = &self.handle {
            use std::os::fd::AsRawFd;
            // SAFETY: shutdown(2) on a socket this listener owns.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Fence: tear down every connection and wait until no connection
        // thread can touch registered memory any more.
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).values() {
            let _ = c.shutdown(Shutdown::Both);
        }
        while self.live.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// One accepted connection, as its handler sees it.
pub(crate) struct Conn {
    /// The listener's id for it (what [`ExposedRanges`] shuts down by).
    pub(crate) id: u64,
    /// The source address: a peer's identity here (see [`crate::limits`]).
    pub(crate) peer: SocketAddr,
    /// The listener's counts, where this connection is marked served.
    counts: Arc<Mutex<AddrCounts>>,
    /// Marked already: the shared counts' lock is taken once per
    /// connection, not on every request of the data path.
    marked: std::sync::atomic::AtomicBool,
}

impl Conn {
    /// A request was served on this connection: it is no longer one a
    /// newcomer may evict at a full port (`evict_unserved_strangers`).
    pub(crate) fn served(&self) {
        if !self.marked.swap(true, Ordering::Relaxed) {
            lock(&self.counts).served(self.id);
        }
    }
}

type Handler = fn(TcpStream, &ServerShared, &Conn);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn spawn_listener(
    listener: TcpListener,
    shared: Arc<ServerShared>,
    name: &'static str,
    limits: ConnLimits,
    handler: Handler,
) -> Result<Listener, EngineError> {
    let addr = listener.local_addr().map_err(|e| EngineError::io("local_addr", e))?;
    let handle = listener.try_clone().ok();
    let sh = shared.clone();
    let live = Arc::new(AtomicUsize::new(0));
    let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
    if name == "data" {
        shared.ranges.set_conns(conns.clone());
    }
    let counts: Arc<Mutex<AddrCounts>> = Arc::default();
    let (live_l, conns_l) = (live.clone(), conns.clone());
    let mut next_id = 0u64;
    let thread = std::thread::Builder::new()
        .name(format!("mc-{name}-accept"))
        .spawn(move || {
            for conn in listener.incoming() {
                if sh.stop.load(Ordering::SeqCst) {
                    break;
                }
                let stream = match conn {
                    Ok(s) => s,
                    // The listener was shut down (drop): nothing more to accept.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                    Err(_) => continue,
                };
                let Ok(peer) = stream.peer_addr() else { continue };
                // Refused at once, before a thread or a byte of buffer is
                // spent on it: the caps are what bound both.
                let who = sh.admitted_as(peer.ip());
                let id = next_id + 1;
                let admitted = lock(&counts).admit(id, peer.ip(), who, &limits);
                let evicted = match admitted {
                    Ok(evicted) => evicted,
                    Err(why) => {
                        let c = match why {
                            ConnRefusal::Global => &sh.stats.conns_refused_global,
                            ConnRefusal::PerAddr => &sh.stats.conns_refused_per_addr,
                            ConnRefusal::Strangers => &sh.stats.conns_refused_strangers,
                        };
                        c.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(port = name, %peer, ?why, "connection refused at a cap");
                        drop(stream);
                        continue;
                    }
                };
                next_id = id;
                if let Some(old) = evicted.and_then(|old| lock(&conns_l).remove(&old)) {
                    // Its handler's next read fails and its thread ends.
                    let _ = old.shutdown(Shutdown::Both);
                    sh.stats.conns_evicted_unserved.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(port = name, %peer, "the oldest unserved stranger closed to make room");
                }
                let Ok(clone) = stream.try_clone() else {
                    lock(&counts).release(id);
                    continue;
                };
                lock(&conns_l).insert(id, clone);
                live.fetch_add(1, Ordering::AcqRel);
                let sh2 = sh.clone();
                let (live2, conns2, counts2) = (live.clone(), conns_l.clone(), counts.clone());
                let spawned = std::thread::Builder::new().name("mc-conn".into()).spawn(move || {
                    handler(stream, &sh2, &Conn { id, peer, counts: counts2.clone(), marked: Default::default() });
                    lock(&conns2).remove(&id);
                    lock(&counts2).release(id);
                    live2.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    lock(&conns_l).remove(&id);
                    lock(&counts).release(id);
                    live.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })
        .map_err(|e| EngineError::io("spawn listener", e))?;
    Ok(Listener { addr, handle, shared, thread: Some(thread), conns, live: live_l })
}

/// Starts the handshake server on `bind`.
pub(crate) fn start_handshake(bind: SocketAddr, shared: Arc<ServerShared>) -> Result<Listener, EngineError> {
    let l = TcpListener::bind(bind).map_err(|e| EngineError::io(format!("bind handshake {bind}"), e))?;
    let limits = shared.handshake_limits;
    spawn_listener(l, shared, "handshake", limits, serve_handshake)
}

/// Starts the data server on an already bound listener.
pub(crate) fn start_data(l: TcpListener, shared: Arc<ServerShared>) -> Result<Listener, EngineError> {
    let limits = shared.data_limits;
    spawn_listener(l, shared, "data", limits, serve_data)
}

/// Which deadline ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Idle,
    Request,
}

/// A connection under its port's deadlines: before a request's first byte
/// the idle timeout applies, from it on the whole-request deadline, which
/// every read and write is bounded by (a peer trickling one byte at a time
/// cannot stretch it).
struct Timed<'a> {
    s: &'a TcpStream,
    limits: ConnLimits,
    /// A request's first byte came and its last has not been handled.
    in_request: bool,
    deadline: Option<Instant>,
    expired: Option<Expiry>,
}

impl<'a> Timed<'a> {
    fn new(s: &'a TcpStream, limits: ConnLimits) -> Self {
        Self { s, limits, in_request: false, deadline: None, expired: None }
    }

    /// A request started (its first byte came): its deadline runs.
    fn begin(&mut self) {
        if !self.in_request {
            self.in_request = true;
            self.deadline = self.limits.request_timeout.map(|t| Instant::now() + t);
        }
    }

    /// The request ended: the idle timeout applies again.
    fn end(&mut self) {
        self.in_request = false;
        self.deadline = None;
    }

    /// The timeout of the next socket call.
    fn timeout(&mut self) -> std::io::Result<Option<Duration>> {
        if !self.in_request {
            return Ok(self.limits.idle_timeout);
        }
        let Some(d) = self.deadline else { return Ok(None) };
        let now = Instant::now();
        if now >= d {
            self.expired = Some(Expiry::Request);
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        // A zero timeout means "none" to the socket: at least 1 ms.
        Ok(Some((d - now).max(Duration::from_millis(1))))
    }

    fn timed_out(&mut self, e: &std::io::Error) {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            self.expired = Some(if self.in_request { Expiry::Request } else { Expiry::Idle });
        }
    }

    /// Counts the deadline that closed the connection, if one did.
    fn count(&self, sh: &ServerShared) {
        match self.expired {
            Some(Expiry::Idle) => sh.stats.idle_closed.fetch_add(1, Ordering::Relaxed),
            Some(Expiry::Request) => sh.stats.deadline_closed.fetch_add(1, Ordering::Relaxed),
            None => 0,
        };
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let t = self.timeout()?;
        self.s.set_read_timeout(t)?;
        match (&mut &*self.s).read(buf) {
            Ok(n) => {
                if n > 0 {
                    self.begin();
                }
                Ok(n)
            }
            Err(e) => {
                self.timed_out(&e);
                Err(e)
            }
        }
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.begin();
        let t = self.timeout()?;
        self.s.set_write_timeout(t)?;
        (&mut &*self.s).write(buf).inspect_err(|e| self.timed_out(e))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn serve_handshake(s: TcpStream, sh: &ServerShared, conn: &Conn) {
    // A sealed notification is a conversation of small messages (see
    // `crate::sealed`): no Nagle delay on our side of it.
    let _ = s.set_nodelay(true);
    let mut t = Timed::new(&s, sh.handshake_limits);
    serve_handshake_on(&mut t, sh, conn);
    t.count(sh);
}

fn serve_handshake_on(s: &mut Timed<'_>, sh: &ServerShared, conn: &Conn) {
    let frame = match HandshakeFrame::read_from(s, MAX_HANDSHAKE_LEN) {
        Ok(f) => f,
        Err(e) => {
            tracing::debug!(error = %e, "bad handshake frame");
            return;
        }
    };
    let value: Result<serde_json::Value, _> = serde_json::from_slice(&frame.json);
    if value.is_err() {
        tracing::debug!("handshake with malformed JSON");
        return;
    }
    let reply: Vec<u8> = match frame.kind {
        HandshakeType::Metadata => {
            // The peer's own descriptor names it; any other shape is answered
            // as an anonymous peer.
            let peer = value.as_ref().ok().and_then(|v| v.get("name")).and_then(|n| n.as_str());
            sh.published(peer, Some(conn.peer.ip())).to_json()
        }
        HandshakeType::Notify => match NotifyDesc::from_json(&frame.json) {
            Ok(n) => to_json_line(&queue_notify(sh, conn, n)),
            Err(_) => return,
        },
        HandshakeType::SealedNotify => return serve_sealed(s, sh, conn),
        HandshakeType::Probe => to_json_line(&ProbeReply { status: "success".into() }),
        HandshakeType::Connection => match &sh.hook {
            Some(hook) => hook.connection(&frame.json, conn.peer.ip()),
            // RDMA QP exchange; nothing to do for TCP.
            None => b"{}\n".to_vec(),
        },
        HandshakeType::OldProtocol => b"{}\n".to_vec(),
    };
    if HandshakeFrame::new(frame.kind, reply).write_to(s).is_err() {
        return;
    }
    conn.served();
    let _ = s.s.shutdown(Shutdown::Write);
    // Wait (bounded by the whole-handshake deadline) for the client to close.
    let mut b = [0u8; 64];
    let _ = s.read(&mut b);
}

/// A sealed notification's connection ([`crate::sealed`]): the handshake,
/// then notifications on its session, each answered, until the dialer
/// closes it, the idle deadline passes or one is refused.
fn serve_sealed(s: &mut Timed<'_>, sh: &ServerShared, conn: &Conn) {
    let Some(mut inbound) = sh.auth.accept(s, conn.peer.ip()) else { return };
    // A key holder's session: it has proven itself, and is kept.
    conn.served();
    loop {
        s.end();
        let Some(n) = sh.auth.next(s, &mut inbound) else { return };
        sh.stats.sealed_notifies.fetch_add(1, Ordering::Relaxed);
        let reply = to_json_line(&queue_notify(sh, conn, n));
        if HandshakeFrame::new(HandshakeType::Notify, reply).write_to(s).is_err() {
            return;
        }
    }
}

/// Queues a notification under the sender address's budget (never evicting
/// another's); the reply says whether it was queued.
fn queue_notify(sh: &ServerShared, conn: &Conn, n: NotifyDesc) -> NotifyReply {
    let from = n.name.clone();
    let pushed = lock(&sh.notifies).push(conn.peer.ip(), n, &sh.notify_limits);
    match pushed {
        Ok(dropped) => {
            if dropped > 0 {
                sh.stats.notifies_dropped.fetch_add(dropped as u64, Ordering::Relaxed);
                tracing::warn!(dropped, "notify queue full, dropped the oldest (legacy queue)");
            }
            tracing::debug!(from = %from, "notify received");
            sh.notify_waker.wake();
            NotifyReply::success()
        }
        Err(why) => {
            sh.stats.notifies_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %conn.peer, from = %from, ?why, "notify refused: queue budget spent");
            NotifyReply { notify_msg: format!("rejected: notify queue budget spent ({why:?})") }
        }
    }
}

fn to_json_line<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut out = serde_json::to_vec(v).unwrap_or_default();
    out.push(b'\n');
    out
}

fn serve_data(s: TcpStream, sh: &ServerShared, conn: &Conn) {
    let _ = s.set_nodelay(true);
    let mut t = Timed::new(&s, sh.data_limits);
    serve_data_on(&mut t, sh, conn);
    t.count(sh);
}

fn serve_data_on(s: &mut Timed<'_>, sh: &ServerShared, conn: &Conn) {
    let peer = conn.peer;
    // Fixed for the engine's life: whether any request here may be placed.
    let tcp_data = sh.hook.as_ref().map_or(true, |h| h.serves_tcp_data());
    loop {
        s.end();
        let mut hb = [0u8; HEADER_LEN];
        match read_full(s, &mut hb, &sh.stop) {
            Ok(true) => {}
            Ok(false) => return, // clean EOF between requests
            Err(e) => {
                tracing::debug!(?peer, error = %e, "data connection closed");
                return;
            }
        }
        let (hdr, v2) = match RequestHeader::decode(&hb) {
            Ok(h) => (Some(h), h.v2),
            Err(_) => (None, hb[16] & 0x80 != 0),
        };
        let guard = hdr.filter(|_| tcp_data).and_then(|h| sh.registry.acquire(h.addr, h.size));
        // Inside registered memory is not enough under `ExposedOnly`: the
        // range must be exposed now for this operation.
        let exposure = match (hdr, &guard) {
            (Some(h), Some(_)) if sh.ranges.exposed_only() => {
                sh.ranges.admit(h.addr, h.size, h.opcode, conn.id).map(Some)
            }
            _ => Some(None),
        };
        let (Some(h), Some(guard), Some(exposure)) = (hdr, guard, exposure) else {
            let unexposed = hdr.is_some() && tcp_data && sh.ranges.exposed_only();
            if unexposed {
                sh.stats.unexposed_rejected.fetch_add(1, Ordering::Relaxed);
            }
            tracing::warn!(?peer, ?hdr, tcp_data, unexposed, "rejecting request outside what this target serves");
            sh.stats.rejected.fetch_add(1, Ordering::Relaxed);
            if v2 {
                let _ = s.write_all(&StatusWord::AddrRejected.encode());
            }
            return;
        };
        let ctr = if v2 { &sh.stats.v2_requests } else { &sh.stats.v1_requests };
        ctr.fetch_add(1, Ordering::Relaxed);
        let ok = match h.opcode {
            TcpOpcode::Write => {
                // SAFETY: the range lies inside a region held by `guard`; this
                // thread is the only engine writer of it for this request.
                let Some(filled) = (unsafe { guard.fill(h.addr, h.size, |dst| read_exact_stop(s, dst, &sh.stop)) })
                else {
                    return;
                };
                match filled {
                    Ok(()) => {
                        // Out of the exposure before the status word: the
                        // initiator's DONE (which closes the exposure) can
                        // only follow it.
                        drop(exposure);
                        sh.stats.bytes_written.fetch_add(h.size, Ordering::Relaxed);
                        !v2 || s.write_all(&StatusWord::Ok.encode()).is_ok()
                    }
                    Err(_) => false,
                }
            }
            TcpOpcode::Read => {
                // SAFETY: as above; we only read the bytes.
                let sent = unsafe {
                    guard.with_bytes(h.addr, h.size, |src| {
                        (!v2 || s.write_all(&StatusWord::Ok.encode()).is_ok()) && s.write_all(src).is_ok()
                    })
                };
                let Some(ok) = sent else { return };
                drop(exposure);
                if ok {
                    sh.stats.bytes_read.fetch_add(h.size, Ordering::Relaxed);
                }
                ok
            }
        };
        drop(guard);
        if !ok {
            tracing::debug!(?peer, "data connection failed mid-request");
            return;
        }
        conn.served();
    }
}

/// Reads exactly `buf`; `Ok(false)` on EOF before the first byte.
fn read_full(s: &mut impl Read, buf: &mut [u8], stop: &AtomicBool) -> std::io::Result<bool> {
    let mut have = 0;
    while have < buf.len() {
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        match s.read(&mut buf[have..]) {
            Ok(0) if have == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => have += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn read_exact_stop(s: &mut impl Read, buf: &mut [u8], stop: &AtomicBool) -> std::io::Result<()> {
    if read_full(s, buf, stop)? || buf.is_empty() {
        Ok(())
    } else {
        Err(std::io::ErrorKind::UnexpectedEof.into())
    }
}
