//! [`SimTransport`]: a [`MoriTransport`] over the TCP simulator's fabric
//! ([`backend_tcp_sim::SimNic`]), so that the engine and the adapter run on a
//! real wire in CI.
//!
//! - **Data** moves with the simulator's one-sided raw operations
//!   ([`SimNic::write_raw_registered`] / [`SimNic::read_raw_with`]), so the
//!   simulated NIC's checks apply to every access: key, length, bounds, and
//!   the generation bound to the slot for the connection the access arrives
//!   on. A write is sent straight from registered memory (no copy) and
//!   completes to its region (a completion queue: no callback per write); a
//!   read lands in a buffer and is copied into the local region before its
//!   completion is reported.
//! - **Per-slot grants**: a region registered with a slot size
//!   ([`MemoryRegion::with_slot_size`]) is also registered with the NIC as a
//!   *shadow* pool of the same layout, every slot of which this transport
//!   holds. [`MoriTransport::grant`] binds a slot's generation to the peer's
//!   connection (the NIC's `expose`), [`MoriTransport::withdraw`] and
//!   [`MoriTransport::revoke`] invalidate the binding (the NIC's `revoke`,
//!   which drains in-flight applies and confirms). The shadow pool's own
//!   generation is moved up to the caller's before binding, so the generation
//!   the NIC checks is the kv-transfer tenancy's. A region without a slot
//!   size is one shadow slot (whole-region checks only).
//! - **Notifications and control messages** ride the data connection as
//!   the simulator's application messages ([`SimNic::send_message`]), like
//!   SEND/RECV on an RC queue pair: one byte of kind (notification or
//!   control message), then the body. They need no socket or thread of
//!   their own, and the simulator's sender batches them with the data. A
//!   message speaks for an engine only if it arrives on the connection this
//!   transport bound to that engine (the one it grants the engine's slots
//!   on: opened to, or accepted from, the endpoint the engine's descriptor
//!   names); the name a connection sent in its HELLO is not an identity,
//!   and an impostor's messages are dropped and counted
//!   ([`SimTransport::impostor_messages`]).
//! - **Carried notifications** ([`MoriTransport::carries_notifications`]): a
//!   one-segment WRITE's success notification is the WRITE's immediate (the
//!   simulator's WRITE_IMM), which the target's NIC hands over as a message
//!   once the bytes landed and never for a refused write; the engine sends
//!   only failures itself. This is MORI's own order (a notification right
//!   behind the data on the queue pair) without a message per transfer.
//! - **Fence** tears down every simulator connection to the peer (joined;
//!   in-flight raw operations fail). Nothing is sent to a fenced peer until
//!   the engine connects it again.
//!
//! Completions: a write completes to its region, a read through a callback
//! ([`SimNic::read_raw_with`]), both on the simulator's receiving thread. With an event sink ([`MoriTransport::set_event_sink`], which the
//! engine installs) the completion, and every inbound notification and
//! message, goes straight to the engine on that thread: no thread waits on
//! a handle and no extra thread hop sits between the NIC and the engine,
//! as with a verbs completion channel. Without a sink, events queue for
//! [`MoriTransport::poll`].

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use backend_tcp_sim::{
    wire, ExposeErrorKind, InboundEvent, NicConfig, NicError, RawAccess, RawCallback, RawCompletions, SimNic,
};
use bytes::Bytes;
use kv_transfer_core::{
    Exposed, Generation, PeerId, PoolConfig, Region, Reserved, SlotId, SlotLease, SlotPool, TransferError,
};

use crate::error::TransportError;
use crate::notify::{decode_notification, encode_notification, encode_notification_head, MSG_NOTIFY, NOTIFY_HEAD};
use crate::region::SimMem;
use crate::transport::{Completion, EventSink, MoriTransport, Notification, OpKind, TransportEvent, WorkRequest};
use crate::types::{EngineDesc, EngineKey, MemoryId, MemoryLocation, MemoryRegion};
use crate::util::{lock, HashMap, HashSet};

/// What MORI over the simulator can prove: drain and ack (its control
/// messages), revoke (the simulated NIC's generation binding) and fence
/// ([`MoriTransport::fence`]), as the
/// simulator itself does.
pub const CAPABILITIES: kv_transfer_core::drain::Capabilities = backend_tcp_sim::CAPABILITIES;

/// Name the simulator transport publishes in [`EngineDesc::transport`].
pub const TCP_SIM: &str = "tcp-sim";

/// First byte of an application message: a control message
/// ([`MoriTransport::send_message`]).
const MSG_CONTROL: u8 = 2;

/// Configuration of a [`SimTransport`].
#[derive(Clone, Debug)]
pub struct SimTransportConfig {
    /// The simulated NIC's configuration (its name is replaced by the engine key).
    pub nic: NicConfig,
    /// How long the engine with the greater key waits for the other to open
    /// the connection before it opens one itself (one connection per pair,
    /// so both sides bind and send on the same one).
    pub connect_wait: Duration,
}

impl Default for SimTransportConfig {
    fn default() -> Self {
        Self { nic: NicConfig::new("mori"), connect_wait: Duration::from_secs(2) }
    }
}

enum Shadow {
    Empty,
    Reserved(SlotLease<Reserved>),
    Exposed(SlotLease<Exposed>),
}

impl Shadow {
    fn generation(&self) -> Option<u64> {
        match self {
            Shadow::Empty => None,
            Shadow::Reserved(l) => l.tenancies().first().map(|t| t.generation.0),
            Shadow::Exposed(l) => l.tenancies().first().map(|t| t.generation.0),
        }
    }
}

struct SimRegionEntry {
    rkey: u64,
    mem: Arc<SimMem>,
    pool: SlotPool,
    /// One lease per shadow slot, all held by this transport; one lock for
    /// the region so that cycling a slot's generation (release, reserve)
    /// always gets the same slot back.
    shadow: Mutex<Vec<Shadow>>,
    busy: AtomicUsize,
    /// Where this region's operations complete to.
    shared: Arc<Shared>,
}

impl SimRegionEntry {
    /// The operation `wr_id` on this region is terminal: a read's bytes are
    /// copied into the region, the in-flight count drops, and the
    /// completion is delivered.
    fn finish(&self, wr_id: u64, read_into: Option<(usize, usize)>, res: Result<Option<Bytes>, TransferError>) {
        let result = match res {
            Ok(data) => match (read_into, data) {
                (Some((off, len)), Some(bytes)) if bytes.len() == len => {
                    self.mem.write(off, &bytes).map_err(|e| TransportError::Remote(e.to_string()))
                }
                (Some(_), _) => Err(TransportError::Remote("read returned an unexpected length".into())),
                (None, _) => Ok(()),
            },
            Err(e) => Err(TransportError::Remote(e.to_string())),
        };
        self.busy.fetch_sub(1, Ordering::AcqRel);
        self.shared.deliver(TransportEvent::Completion(Completion { wr_id, result }));
    }
}

/// A WRITE from a registered region completes here (the region is the
/// simulator's completion queue for it: no callback per operation).
impl RawCompletions for SimRegionEntry {
    fn complete(&self, token: u64, result: Result<Option<Bytes>, TransferError>) {
        self.finish(token, None, result);
    }
}

struct PeerEntry {
    sim_endpoint: String,
}

/// What the NIC's threads deliver to: the engine's sink, or the queue `poll` reads.
#[derive(Default)]
struct Shared {
    events: Mutex<VecDeque<TransportEvent>>,
    events_cv: Condvar,
    sink: RwLock<Option<EventSink>>,
    closed: AtomicBool,
    /// What a post looks up, behind one lock; also which connection speaks
    /// for which engine (`peer_cache`), which an inbound message is checked
    /// against.
    routes: RwLock<Routes>,
    /// Messages dropped because they came from a connection that only
    /// claims an engine's name (see [`Shared::on_message`]).
    impostor_messages: AtomicU64,
    /// Positive control (`ReleasePolicy::Naive` in the NIC's configuration):
    /// take a connection's claimed name as its identity, as before issue 15.
    trust_names: bool,
}

impl Shared {
    fn deliver(&self, e: TransportEvent) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        // Cloned out so that the sink runs without this lock held.
        let sink = self.sink.read().unwrap_or_else(|p| p.into_inner()).clone();
        match sink {
            Some(sink) => sink(e),
            None => self.push_event(e),
        }
    }

    /// An inbound application message: a notification or a control message.
    ///
    /// The sender is the engine this transport bound that connection to:
    /// the connection it grants that engine's slots on and sends to it over
    /// (`peer_cache`, set when the connection was opened to, or accepted
    /// from, the endpoint the engine's descriptor names). A connection's name
    /// is only what it said in its HELLO: a second connection under a bound
    /// engine's name, or one under the name of an engine no connection is
    /// bound to yet, speaks for nobody; its messages are dropped and counted
    /// ([`SimTransport::impostor_messages`]). Every exposure is granted on a
    /// bound connection, so whatever such a message would settle has one.
    fn on_message(&self, peer: PeerId, name: &str, bytes: &[u8]) {
        let from = EngineKey::new(name);
        let bound = self.routes.read().unwrap_or_else(|p| p.into_inner()).peer_cache.get(&from).copied();
        if bound != Some(peer) && !self.trust_names {
            self.impostor_messages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                claimed = %from,
                connection = peer.0,
                bound = ?bound.map(|b| b.0),
                "message from a connection that is not bound to the engine it names dropped"
            );
            return;
        }
        match bytes.split_first() {
            Some((&MSG_NOTIFY, body)) => match decode_notification(body) {
                Some(notification) => self.deliver(TransportEvent::Notification { from, notification }),
                None => tracing::warn!(peer = %from, "malformed notification dropped"),
            },
            Some((&MSG_CONTROL, body)) => self.deliver(TransportEvent::Message { from, bytes: body.to_vec() }),
            _ => tracing::warn!(peer = %from, "unknown message dropped"),
        }
    }

    fn push_event(&self, e: TransportEvent) {
        let mut q = lock(&self.events);
        let was_empty = q.is_empty();
        q.push_back(e);
        drop(q);
        // A poller waits on the condvar only while the queue is empty.
        if was_empty {
            self.events_cv.notify_all();
        }
    }
}

struct Attached {
    key: EngineKey,
    nic: SimNic,
}

#[derive(Default)]
struct Routes {
    regions: HashMap<MemoryId, Arc<SimRegionEntry>>,
    /// Connection last used per peer (checked again when the NIC refuses it).
    peer_cache: HashMap<EngineKey, PeerId>,
}

/// A [`MoriTransport`] over the TCP simulator; see the [module docs](self).
pub struct SimTransport {
    config: SimTransportConfig,
    attached: OnceLock<Attached>,
    shared: Arc<Shared>,
    peers: Mutex<HashMap<EngineKey, PeerEntry>>,
    /// Engine key of each simulator connection (from the NIC's events).
    sim_names: Mutex<HashMap<PeerId, EngineKey>>,
    /// Peers fenced and not connected again: nothing is sent to them.
    fenced: Mutex<HashSet<EngineKey>>,
}

impl fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimTransport").field("key", &self.attached.get().map(|a| &a.key)).finish()
    }
}

impl SimTransport {
    /// A transport; the simulated NIC starts when an engine attaches it.
    pub fn new(config: SimTransportConfig) -> Arc<Self> {
        let trust_names = config.nic.policy.is_naive();
        Arc::new(Self {
            config,
            attached: OnceLock::new(),
            shared: Arc::new(Shared { trust_names, ..Shared::default() }),
            peers: Mutex::new(HashMap::default()),
            sim_names: Mutex::new(HashMap::default()),
            fenced: Mutex::new(HashSet::default()),
        })
    }

    /// The simulated NIC (for its counters and fault controls), once attached.
    pub fn nic(&self) -> Option<&SimNic> {
        self.attached.get().map(|a| &a.nic)
    }

    /// The simulator connection this transport uses towards `remote` (for
    /// raw accesses in tests: [`SimNic::write_raw`]).
    pub fn sim_peer(&self, remote: &EngineKey) -> Result<PeerId, TransportError> {
        self.peer_id(remote)
    }

    /// Simulates the process dying: the NIC crashes (sockets shut, no
    /// goodbyes, no proof minted here) and nothing more is delivered here.
    /// Peers see the connection drop and fence it.
    pub fn crash(&self) {
        self.shared.closed.store(true, Ordering::Release);
        if let Some(att) = self.attached.get() {
            att.nic.crash();
        }
    }

    fn att(&self) -> Result<&Attached, TransportError> {
        self.attached.get().ok_or_else(|| TransportError::State("transport not attached".to_owned()))
    }

    fn routes(&self) -> std::sync::RwLockReadGuard<'_, Routes> {
        self.shared.routes.read().unwrap_or_else(|p| p.into_inner())
    }
    fn routes_mut(&self) -> std::sync::RwLockWriteGuard<'_, Routes> {
        self.shared.routes.write().unwrap_or_else(|p| p.into_inner())
    }

    fn region(&self, id: MemoryId) -> Option<Arc<SimRegionEntry>> {
        self.routes().regions.get(&id).cloned()
    }

    /// The simulator connection to `remote`: the live one if any; otherwise
    /// the engine with the smaller key opens it and the other waits for it
    /// (bounded) before opening one itself.
    fn peer_id(&self, remote: &EngineKey) -> Result<PeerId, TransportError> {
        if let Some(p) = self.routes().peer_cache.get(remote) {
            return Ok(*p);
        }
        let p = self.resolve_peer(remote)?;
        self.routes_mut().peer_cache.insert(remote.clone(), p);
        Ok(p)
    }

    /// Turns the NIC's connection events into [`TransportEvent::PeerLost`]:
    /// the NIC reports a connection lost only after its teardown joined the
    /// connection's threads and failed its operations (its `Fenced`). A peer
    /// counts as lost only when no live connection to it remains.
    fn nic_events(&self) -> Vec<TransportEvent> {
        let mut out = Vec::new();
        let Some(att) = self.attached.get() else { return out };
        // Bounded: the NIC keeps at most a few thousand events.
        while let Some(e) = att.nic.next_event(Duration::ZERO) {
            match e {
                InboundEvent::PeerConnected { peer, name, .. } => {
                    lock(&self.sim_names).insert(peer, EngineKey::new(name));
                }
                InboundEvent::PeerLost { peer } => {
                    let Some(key) = lock(&self.sim_names).remove(&peer) else { continue };
                    // Only the loss of the bound connection unbinds: an
                    // impostor that hangs up changes nothing.
                    if self.routes().peer_cache.get(&key) == Some(&peer) {
                        self.forget_peer(&key);
                    }
                    let endpoint = lock(&self.peers).get(&key).map(|p| p.sim_endpoint.clone());
                    if let Some(endpoint) = endpoint {
                        if Self::live_connection(&att.nic, &key, &endpoint).is_none() {
                            out.push(TransportEvent::PeerLost { peer: key });
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }

    fn forget_peer(&self, remote: &EngineKey) {
        self.routes_mut().peer_cache.remove(remote);
    }

    fn resolve_peer(&self, remote: &EngineKey) -> Result<PeerId, TransportError> {
        let att = self.att()?;
        let endpoint = lock(&self.peers)
            .get(remote)
            .map(|p| p.sim_endpoint.clone())
            .ok_or_else(|| TransportError::UnknownPeer(remote.clone()))?;
        if let Some(p) = Self::live_connection(&att.nic, remote, &endpoint) {
            return Ok(p);
        }
        if att.key > *remote {
            // Bounded: polls every millisecond until `connect_wait` passed.
            let deadline = std::time::Instant::now() + self.config.connect_wait;
            while std::time::Instant::now() < deadline {
                if let Some(p) = Self::live_connection(&att.nic, remote, &endpoint) {
                    return Ok(p);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        att.nic.connect(&endpoint).map_err(|e| TransportError::Remote(format!("connect {remote}: {e}")))
    }

    /// A live connection that is `remote`'s: named so and at the endpoint
    /// its descriptor gave (a connection that only borrows the name, from
    /// anywhere else, is not it). The oldest, if several.
    fn live_connection(nic: &SimNic, remote: &EngineKey, endpoint: &str) -> Option<PeerId> {
        nic.peers().into_iter().find(|p| p.name == remote.as_str() && p.endpoint == endpoint).map(|p| p.peer)
    }

    /// Messages dropped because their connection is not bound to the engine
    /// whose name it claims (a hostile or confused peer).
    pub fn impostor_messages(&self) -> u64 {
        self.shared.impostor_messages.load(Ordering::Relaxed)
    }

    /// Sends an application message (its kind byte first) to `to` over the
    /// data connection. A fenced peer gets nothing until the engine connects
    /// it again.
    fn send_app(&self, to: &EngineKey, msg: &[u8]) -> Result<(), TransportError> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let att = self.att()?;
        // The usual case: the cached connection. A fenced peer has none
        // (`fence` forgets it and the NIC tears the connection down, so a
        // stale entry only refuses and the checks below run).
        let cached = self.routes().peer_cache.get(to).copied();
        if let Some(peer) = cached {
            if msg.len() <= wire::MAX_CONTROL as usize && att.nic.send_message(peer, msg).is_ok() {
                return Ok(());
            }
        }
        if lock(&self.fenced).contains(to) {
            return Err(TransportError::Remote(format!("{to} is fenced")));
        }
        if msg.len() > wire::MAX_CONTROL as usize {
            return Err(TransportError::OutOfBounds);
        }
        let sent = match att.nic.send_message(self.peer_id(to)?, msg) {
            Err(NicError::UnknownPeer(_)) => {
                // The cached connection is gone (lost): resolve again, once.
                self.forget_peer(to);
                att.nic.send_message(self.peer_id(to)?, msg)
            }
            other => other,
        };
        sent.map_err(|e| TransportError::Remote(format!("message to {to}: {e}")))
    }
}

impl Drop for SimTransport {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        if let Some(att) = self.attached.get() {
            att.nic.set_message_hook(None);
            att.nic.shutdown();
        }
        // A region entry points back at `shared` (its completions go there),
        // which holds the routes: emptied once the NIC is down, so the
        // regions (and the memory they keep alive) are freed.
        let mut routes = self.routes_mut();
        routes.regions.clear();
        routes.peer_cache.clear();
    }
}

impl MoriTransport for SimTransport {
    fn name(&self) -> String {
        TCP_SIM.to_owned()
    }

    fn attach(&self, local: &EngineKey) -> Result<Vec<u8>, TransportError> {
        if self.attached.get().is_some() {
            return Err(TransportError::State("transport already attached".to_owned()));
        }
        let mut cfg = self.config.nic.clone();
        cfg.name = local.as_str().to_owned();
        let nic = SimNic::start(cfg).map_err(|e| TransportError::State(format!("simulated NIC: {e}")))?;
        let sh = self.shared.clone();
        nic.set_message_hook(Some(Arc::new(move |peer, name: &str, bytes: &[u8]| sh.on_message(peer, name, bytes))));
        let info = nic.endpoint().as_bytes().to_vec();
        self.attached
            .set(Attached { key: local.clone(), nic })
            .map_err(|_| TransportError::State("transport already attached".to_owned()))?;
        Ok(info)
    }

    fn connect(&self, remote: &EngineDesc) -> Result<(), TransportError> {
        if remote.transport != TCP_SIM {
            return Err(TransportError::Unsupported(format!("peer uses transport {}", remote.transport)));
        }
        let info = String::from_utf8_lossy(&remote.transport_info).into_owned();
        let Some(sim) = info.lines().next().filter(|l| !l.is_empty()) else {
            return Err(TransportError::State(format!("bad transport info from {}", remote.key)));
        };
        lock(&self.peers).insert(remote.key.clone(), PeerEntry { sim_endpoint: sim.to_owned() });
        lock(&self.fenced).remove(&remote.key);
        self.forget_peer(&remote.key);
        let att = self.att()?;
        if att.key < remote.key {
            att.nic.connect(sim).map_err(|e| TransportError::Remote(format!("connect {}: {e}", remote.key)))?;
        }
        Ok(())
    }

    fn disconnect(&self, remote: &EngineKey) -> Result<(), TransportError> {
        self.forget_peer(remote);
        lock(&self.peers).remove(remote);
        Ok(())
    }

    fn register_memory(&self, id: MemoryId, region: &MemoryRegion) -> Result<u64, TransportError> {
        let att = self.att()?;
        // Device memory only through a core region's copies (the NIC
        // stages it); GPU memory known only by address is out of its reach.
        if region.location() != MemoryLocation::Cpu && region.core_region().is_none() {
            return Err(TransportError::Unsupported(
                "the simulator reaches GPU memory only through its copies".to_owned(),
            ));
        }
        let (mem, len) = SimMem::of(region)?;
        let slot_size = match region.slot_size() {
            Some(s) => usize::try_from(s).map_err(|_| TransportError::OutOfBounds)?,
            None => len,
        };
        let pool = att
            .nic
            .register_pool(mem.clone(), PoolConfig::new(slot_size))
            .map_err(|e| TransportError::State(format!("simulated NIC: {e}")))?;
        let rkey = att.nic.key_of(&pool).ok_or_else(|| TransportError::State("pool has no key".to_owned()))?;
        let mut shadow = Vec::with_capacity(pool.capacity());
        for i in 0..pool.capacity() {
            let lease = pool.reserve(1).map_err(|e| TransportError::State(e.to_string()))?;
            if lease.tenancies().first().map(|t| t.slot.0 as usize) != Some(i) {
                return Err(TransportError::State("shadow pool handed out slots out of order".to_owned()));
            }
            shadow.push(Shadow::Reserved(lease));
        }
        let mut routes = self.routes_mut();
        let regions = &mut routes.regions;
        if regions.contains_key(&id) {
            return Err(TransportError::State(format!("memory {id} already registered")));
        }
        regions.insert(
            id,
            Arc::new(SimRegionEntry {
                rkey,
                mem,
                pool,
                shadow: Mutex::new(shadow),
                busy: AtomicUsize::new(0),
                shared: self.shared.clone(),
            }),
        );
        Ok(rkey)
    }

    fn deregister_memory(&self, id: MemoryId) -> Result<(), TransportError> {
        let mut routes = self.routes_mut();
        let regions = &mut routes.regions;
        let Some(r) = regions.get(&id) else {
            return Err(TransportError::UnknownMemory { engine: self.att()?.key.clone(), id });
        };
        let bound = lock(&r.shadow).iter().any(|s| matches!(s, Shadow::Exposed(_)));
        if r.busy.load(Ordering::Acquire) > 0 || bound {
            return Err(TransportError::Busy(id));
        }
        // The simulator has no deregistration: the shadow pool stays
        // registered there with every slot held here and unbound, so no
        // access can land.
        regions.remove(&id);
        Ok(())
    }

    fn post(&self, wr: WorkRequest) -> Result<(), TransportError> {
        let att = self.att()?;
        let remote = &wr.remote.engine_key;
        // One read of the routes: the local region and, usually, the connection.
        let (region, cached_peer) = {
            let routes = self.routes();
            (routes.regions.get(&wr.local.id).cloned(), routes.peer_cache.get(remote).copied())
        };
        let region = region
            .filter(|r| r.rkey == wr.local.rkey)
            .ok_or_else(|| TransportError::UnknownMemory { engine: wr.local.engine_key.clone(), id: wr.local.id })?;
        let len = usize::try_from(wr.len).map_err(|_| TransportError::OutOfBounds)?;
        let off = usize::try_from(wr.local_offset).map_err(|_| TransportError::OutOfBounds)?;
        region.mem.check(off, len).map_err(|_| TransportError::OutOfBounds)?;
        let raw_len = u32::try_from(len).map_err(|_| TransportError::OutOfBounds)?;
        let addr = wr.remote.addr.checked_add(wr.remote_offset).ok_or(TransportError::OutOfBounds)?;
        let access = RawAccess {
            key: wr.remote.rkey,
            addr,
            slot: SlotId((wr.tag.slot & 0xFFFF_FFFF) as u32),
            generation: Generation(wr.tag.generation),
        };
        // A carried notification is the WRITE's immediate: the target's NIC
        // hands it to the target's transport (as a message) once the bytes
        // landed, and only then.
        let mut head = [0u8; NOTIFY_HEAD];
        let imm: Vec<u8>;
        let imm: &[u8] = match &wr.notification {
            None => &[],
            Some(n) if n.message.is_empty() => {
                encode_notification_head(&mut head, n);
                &head
            }
            Some(n) => {
                imm = encode_notification(n);
                &imm
            }
        };
        // A WRITE is sent from the registered region itself (the simulated
        // NIC reads it as it sends) and completes to the region; a READ's
        // bytes are copied in by its callback.
        let submit = |peer: PeerId| match wr.op {
            OpKind::Write => {
                att.nic.write_raw_registered(peer, access, (region.rkey, off, len), imm, region.clone(), wr.wr_id)
            }
            OpKind::Read => {
                let (region, wr_id) = (region.clone(), wr.wr_id);
                let done: RawCallback = Box::new(move |res| region.finish(wr_id, Some((off, len)), res));
                att.nic.read_raw_with(peer, access, raw_len, done)
            }
        };
        region.busy.fetch_add(1, Ordering::AcqRel);
        let peer = match cached_peer {
            Some(p) => Ok(p),
            None => self.peer_id(remote),
        };
        let posted = match peer.map(|p| (p, submit(p))) {
            Ok((_, Err(NicError::UnknownPeer(_)))) => {
                // The cached connection is gone (fenced, lost): resolve again, once.
                self.forget_peer(remote);
                self.peer_id(remote).map(submit)
            }
            other => other.map(|(_, r)| r),
        };
        let posted = match posted {
            Ok(r) => r,
            Err(e) => {
                region.busy.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        posted.map_err(|e| {
            region.busy.fetch_sub(1, Ordering::AcqRel);
            TransportError::Remote(format!("post: {e}"))
        })
    }

    fn notify(&self, to: &EngineKey, notification: Notification) -> Result<(), TransportError> {
        if notification.message.is_empty() {
            // The usual case (success): encoded on the stack, copied once into the frame.
            let mut head = [0u8; NOTIFY_HEAD];
            encode_notification_head(&mut head, &notification);
            return self.send_app(to, &head);
        }
        self.send_app(to, &encode_notification(&notification))
    }

    /// A WRITE's notification rides as its immediate (see `post`).
    fn carries_notifications(&self) -> bool {
        true
    }

    fn set_event_sink(&self, sink: Option<EventSink>) -> bool {
        *self.shared.sink.write().unwrap_or_else(|p| p.into_inner()) = sink;
        // Anything that queued before the sink was installed goes to it now.
        let queued: Vec<TransportEvent> = lock(&self.shared.events).drain(..).collect();
        for e in queued {
            self.shared.deliver(e);
        }
        true
    }

    /// Returns queued events (all of them without an event sink; with one,
    /// only lost connections), waiting at most `timeout` for the first.
    fn poll(&self, max: usize, timeout: Duration) -> Vec<TransportEvent> {
        let max = max.max(1);
        let deadline = Instant::now() + timeout;
        let mut out = self.nic_events();
        let mut events = lock(&self.shared.events);
        // Bounded: every turn returns or waits until the deadline.
        loop {
            while out.len() < max {
                let Some(e) = events.pop_front() else { break };
                out.push(e);
            }
            let now = Instant::now();
            if !out.is_empty() || now >= deadline {
                return out;
            }
            events = self.shared.events_cv.wait_timeout(events, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn fence(&self, remote: &EngineKey) -> Result<(), TransportError> {
        let att = self.att()?;
        // Fenced first, then forgotten: a send that misses the cache from
        // now on sees the fence.
        lock(&self.fenced).insert(remote.clone());
        self.forget_peer(remote);
        // Bounded: one turn per live connection to the peer.
        for p in att.nic.peers().into_iter().filter(|p| p.name == remote.as_str()) {
            att.nic.fence(p.peer);
        }
        Ok(())
    }

    fn send_message(&self, to: &EngineKey, bytes: Vec<u8>) -> Result<(), TransportError> {
        let mut msg = Vec::with_capacity(1 + bytes.len());
        msg.push(MSG_CONTROL);
        msg.extend_from_slice(&bytes);
        self.send_app(to, &msg)
    }

    fn grant(
        &self,
        id: MemoryId,
        remote: &EngineKey,
        slot: u32,
        generation: u64,
    ) -> Result<Option<u64>, TransportError> {
        let att = self.att()?;
        let region = self.region(id).ok_or_else(|| TransportError::UnknownMemory { engine: att.key.clone(), id })?;
        let peer = self.peer_id(remote)?;
        let mut shadow = lock(&region.shadow);
        let idx = slot as usize;
        let entry = shadow.get_mut(idx).ok_or(TransportError::OutOfBounds)?;
        let mut lease = match std::mem::replace(entry, Shadow::Empty) {
            Shadow::Reserved(l) => l,
            Shadow::Exposed(l) => {
                // A grant not withdrawn: revoke it first (confirmed by the NIC).
                att.nic.revoke(&l);
                match l.try_settled() {
                    Ok(s) => s.into_reserved(),
                    Err(l) => {
                        *entry = Shadow::Exposed(l);
                        return Err(TransportError::Busy(id));
                    }
                }
            }
            Shadow::Empty => return Err(TransportError::State("shadow slot lost".to_owned())),
        };
        let current = lease.tenancies().first().map_or(0, |t| t.generation.0);
        if current > generation {
            *entry = Shadow::Reserved(lease);
            return Err(TransportError::State(format!("slot {slot}: generation {generation} is stale")));
        }
        // Bounded by `generation - current`: each turn moves the shadow slot's
        // generation up by one. Every other shadow slot is held, so the slot
        // just released is the one reserve hands back.
        for _ in current..generation {
            drop(lease);
            lease = match region.pool.reserve(1) {
                Ok(l) if l.tenancies().first().map(|t| t.slot.0) == Some(slot) => l,
                Ok(_) | Err(_) => {
                    tracing::error!(slot, "shadow slot could not be cycled");
                    return Err(TransportError::State("shadow slot could not be cycled".to_owned()));
                }
            };
        }
        let exposed = match att.nic.expose(lease, peer) {
            Err(e) if matches!(e.kind, ExposeErrorKind::UnknownPeer(_)) => {
                // The cached connection is gone: resolve again, once.
                self.forget_peer(remote);
                match self.peer_id(remote) {
                    Ok(p) => att.nic.expose(e.lease, p),
                    Err(err) => {
                        *entry = Shadow::Reserved(e.lease);
                        return Err(err);
                    }
                }
            }
            other => other,
        };
        match exposed {
            Ok((exposed, _)) => {
                *entry = Shadow::Exposed(exposed);
                // The region's key and the slot's generation name it.
                Ok(None)
            }
            Err(e) => {
                *entry = Shadow::Reserved(e.lease);
                Err(TransportError::Remote(format!("grant: {}", e.kind)))
            }
        }
    }

    fn withdraw(&self, id: MemoryId, slot: u32, generation: u64) -> Result<(), TransportError> {
        self.revoke(id, slot, generation).map(|_| ())
    }

    fn revoke(&self, id: MemoryId, slot: u32, generation: u64) -> Result<bool, TransportError> {
        let att = self.att()?;
        let region = self.region(id).ok_or_else(|| TransportError::UnknownMemory { engine: att.key.clone(), id })?;
        let mut shadow = lock(&region.shadow);
        let entry = shadow.get_mut(slot as usize).ok_or(TransportError::OutOfBounds)?;
        if entry.generation() != Some(generation) || !matches!(entry, Shadow::Exposed(_)) {
            return Ok(false);
        }
        let Shadow::Exposed(l) = std::mem::replace(entry, Shadow::Empty) else { return Ok(false) };
        att.nic.revoke(&l);
        match l.try_settled() {
            Ok(s) => {
                *entry = Shadow::Reserved(s.into_reserved());
                Ok(true)
            }
            Err(l) => {
                *entry = Shadow::Exposed(l);
                Ok(false)
            }
        }
    }
}
