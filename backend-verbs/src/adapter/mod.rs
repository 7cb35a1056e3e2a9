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
//!   Every side-channel connection starts with core's mutual handshake
//!   under the cluster key ([`VerbsConfig::cluster_key`]), bound to the
//!   address dialed: a relay that makes a peer dial it is refused
//!   (`auth_address_mismatch`), and a confirmation is bound to the asker's
//!   own address.
//!
//! The `naive` positive control
//! registers the pool's memory with remote access and hands out its own key
//! (no window, nothing at the NIC tells tenancies apart) and frees an aborted
//! slot at once.

mod channel;
mod driver;
mod handshake;
mod post;
mod state;
mod target;
use state::*;

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

use channel::descriptor_name;
pub use channel::{
    fresh_ticket, parse_descriptor, read_opening, Confirm, Deadline, Descriptor, Hello, Nonce, Opening, Ticket,
    AUTH_CONTEXT, MAX_CANDIDATES, MAX_NAME, NONE_CONFIRMED, TICKET_LEN,
};
pub use handshake::{PeerIdentity, SideChannelLimits};
use kv_transfer_core::auth::{AcceptorConfig, AuthCounters, AuthError, AuthStats, ClusterKey, Identity, KeyError};

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
    /// The deployment's cluster key, which every side-channel connection's
    /// handshake proves both ends hold. `None`: [`ClusterKey::from_env`]
    /// when the adapter is built (its error is the adapter's; no variable
    /// set: the public single-host key, with a warning).
    pub cluster_key: Option<ClusterKey>,
    /// The positive control only (issue 46): addresses, a relay's, that
    /// this side takes as its own, i.e. the address binding off for them:
    /// its acceptor takes a handshake that dialed one of them, and it
    /// confirms a nonce it sent on a connection dialed to one of them to
    /// any asker holding the ticket (the behaviour before issue 46). Keep
    /// it empty.
    pub positive_control_addresses: Vec<String>,
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
            cluster_key: None,
            positive_control_addresses: Vec::new(),
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
    /// No cluster key: the deployment's variables are set but wrong.
    #[error("cluster key: {0}")]
    Key(#[from] KeyError),
    /// A side-channel connection's handshake was refused (another cluster
    /// key, a relay, a replay, ...).
    #[error("side-channel handshake: {0}")]
    Auth(#[from] AuthError),
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
        let key = match &cfg.cluster_key {
            Some(k) => k.clone(),
            None => ClusterKey::from_env()?,
        };
        let listener = TcpListener::bind(&cfg.listen)?;
        let acceptor = listener.try_clone()?;
        let ticket = fresh_ticket();
        let addr = listener.local_addr()?.to_string();
        // The acceptor answers to the address its descriptor publishes (and,
        // as the positive control only, to those the config adds); one
        // replay cache for every handshake of this listener.
        let mut auth = AcceptorConfig::new(key, AUTH_CONTEXT, Identity::new(cfg.name.clone(), addr.clone()));
        auth.addresses.extend(cfg.positive_control_addresses.iter().cloned());
        let descriptor = Descriptor { name: cfg.name.clone(), addr, ticket }.encode();
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
            auth,
            auth_counters: AuthCounters::default(),
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

    /// The side channel's handshakes (both ways), by outcome (also in
    /// [`counters`](Self::counters), as `auth_*`).
    pub fn auth_stats(&self) -> AuthStats {
        self.inner.auth_counters.snapshot()
    }

    /// Counters, by name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let d = self.inner.drain_counters.snapshot();
        let a = self.inner.auth_counters.snapshot();
        let mut out = vec![
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
            // Handshakes in flight closed to make room at the total.
            ("side_channel_evicted", g(&c.side_channel_evicted)),
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
        ];
        // Side-channel handshakes under the cluster key, both ways:
        // established, and refused by cause (a relay is an address
        // mismatch; `auth_refused_by_peer`: the other end refused ours).
        out.extend(a.fields());
        out
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
