//! The target half of Mooncake's RDMA transport: a [`TargetHook`] that
//! answers the Connection exchange (creates and connects one queue pair per
//! peer queue pair) and writes the RDMA part of our metadata.
//!
//! What it publishes is [`Publish`]:
//!
//! - [`Publish::Registrations`]: what a real Mooncake target publishes, each
//!   registered buffer under its memory region's own remote key, to every
//!   peer, for as long as it is registered. That is what plain interop needs
//!   and what the hazard's positive control is made of: a key that does not
//!   change with the tenancy lets a late WRITE of an old request land in the
//!   next one's slot.
//! - [`Publish::Grants`]: only what was granted to the requesting peer
//!   ([`RdmaTarget::grant`]), each grant under a key of its own that
//!   [`RdmaTarget::revoke`] ends at the NIC. The metadata is answered per
//!   peer, so a peer's retry after a revocation (a real Mooncake initiator
//!   re-fetches the metadata and retries with whatever key it finds) finds
//!   only what is granted to *it*; the caller keeps a revoked slot away from
//!   that peer until a proof covers its retries (core's
//!   [`RetryShadows`](kv_transfer_core::drain::RetryShadows)).
//!
//! A grant is a **type-1 memory window** of its own over the buffer's one
//! registration (made `LOCAL_WRITE | MW_BIND` only, so its own key grants
//! nothing remote): bound by a `BIND_MW` on a queue pair pair the target
//! keeps connected to itself for the purpose, its key good through every
//! queue pair of the protection domain, as it must be: a Mooncake initiator
//! stripes its slices over its two queue pairs, and a type-2 window would
//! grant through one only. The key is published once the bind completed
//! (admission before exposure); [`RdmaTarget::revoke`] frees the window
//! (`ibv_dealloc_mw`), after which the NIC refuses the key. A fresh window
//! per grant, never a rebound one, so no key of an ended grant comes back
//! by the 8-bit key's wrap on that window.
//!
//! Peers are told apart by the segment name their own metadata declares
//! (all Mooncake's handshake carries), checked against the address TCP
//! vouches for: a metadata request gets a peer's grants only from the IP in
//! that peer's `ip:port` name ([`RdmaTargetConfig::grants_by_declared_name`]
//! is the old behaviour). An impostor on that peer's own host still can
//! read its keys, and a key read is good through any queue pair of our one
//! protection domain; the drain protocol's tokens still decide settlement,
//! not the name. A Connection under a NIC path whose queue pairs live is
//! refused (first wins, [`RdmaTarget::pairs_refused`]), so no one replaces
//! another peer's queue pairs.

use kv_transfer_core::hash::HashMap;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use backend_verbs::{Endpoint, Engine, Gid, MrAccess, MrId, MwId, QpId, WcStatus, WorkRequest};

use super::VouchedRange;
use crate::error::EngineError;
use crate::proto::rdma::{format_gid, parse_gid, MAX_QPS_PER_ENDPOINT};
use crate::proto::{BufferDesc, ConnectionDesc, DeviceDesc, SegmentDesc};
use crate::server::TargetHook;

/// Peers (NIC paths) a target keeps queue pairs for at once; a Connection
/// from one more is refused.
pub const MAX_PEERS: usize = 1024;

/// NIC paths paired from one source address at once (each holds queue
/// pairs at the target); a Connection for one more is refused and counted,
/// so one address cannot take every pairing.
pub const MAX_PEERS_PER_ADDR: usize = 64;

/// The location name Mooncake gives host memory, in buffer names and in the
/// priority matrix (an initiator picks the target's device through it).
const HOST_LOCATION: &str = "cpu:0";

/// What the target's metadata holds (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Publish {
    /// Every registered buffer under its region's key, to every peer
    /// (Mooncake's own behaviour).
    #[default]
    Registrations,
    /// Only the grants of the requesting peer, each under its own key.
    Grants,
}

/// Options of the RDMA target.
#[derive(Debug, Clone)]
pub struct RdmaTargetConfig {
    /// The device name peers see (`rxe_lo`).
    pub device: String,
    /// Path MTU offered (min(active, 4096)).
    pub mtu: u32,
    /// What the metadata holds.
    pub publish: Publish,
    /// The old behaviour, for the hostile tests' positive control only: a
    /// Connection under a NIC path that has live queue pairs replaces (and
    /// destroys) them, so anyone who names another peer's NIC path tears
    /// that peer's endpoint down. Off: the first pairing wins while any of
    /// its queue pairs is alive; only a NIC path whose queue pairs are all
    /// in ERR (a Mooncake initiator reconnecting after an error) pairs anew.
    pub replace_live_pairs: bool,
    /// The old behaviour, for the hostile tests' positive control only: a
    /// metadata request gets the grants of whatever peer name it declares.
    /// Off ([`Publish::Grants`]): only if it comes from the address in that
    /// name (`ip:port`, an IP literal), so a third party on another host
    /// cannot read a peer's keys by claiming its name.
    pub grants_by_declared_name: bool,
    /// Most NIC paths paired from one source address at once
    /// ([`MAX_PEERS_PER_ADDR`]; `usize::MAX`, the old behaviour, lets one
    /// address take all [`MAX_PEERS`]).
    pub max_peers_per_addr: usize,
}

impl Default for RdmaTargetConfig {
    fn default() -> Self {
        Self {
            device: String::new(),
            mtu: 4096,
            publish: Publish::default(),
            replace_live_pairs: false,
            grants_by_declared_name: false,
            max_peers_per_addr: MAX_PEERS_PER_ADDR,
        }
    }
}

/// A grant's handle ([`RdmaTarget::grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantId(pub u64);

/// What a grant gives one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    peer: String,
    addr: u64,
    len: u64,
    /// Its type-1 window.
    mw: MwId,
    rkey: u32,
}

/// How long a bind may take before the grant fails.
const BIND_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct State {
    /// Registered buffers' memory regions: start → (length, memory region,
    /// its key). [`Publish::Registrations`]: remote access, published;
    /// [`Publish::Grants`]: windows only, never published.
    regions: BTreeMap<u64, (u64, MrId, u32)>,
    /// The queue pair binds are posted on (one of a pair connected to each
    /// other), made at the first grant.
    binder: Option<(QpId, QpId)>,
    next_wr: u64,
    /// Every buffer registered with the engine: start → length.
    registered: BTreeMap<u64, u64>,
    /// Queue pairs per peer NIC path (a peer pairs again only once its old
    /// ones are all in ERR, which they then replace), with the source
    /// address that paired them.
    peers: HashMap<String, (Vec<QpId>, IpAddr)>,
    /// NIC paths paired per source address.
    per_addr: HashMap<IpAddr, usize>,
    /// Our GID, learnt from the first queue pair created.
    gid: Option<Gid>,
    grants: BTreeMap<GrantId, Grant>,
    next_grant: u64,
}

/// The RDMA target (see the module docs). Give it an engine of its own:
/// the initiator's [`super::RdmaTransport`] polls the engine it is given.
pub struct RdmaTarget {
    engine: Arc<dyn Engine>,
    cfg: RdmaTargetConfig,
    state: Mutex<State>,
    /// One bind at a time: its poller then sees only its own completion
    /// (nothing else is posted on the target's engine).
    binding: Mutex<()>,
    /// Connections refused because their NIC path has live queue pairs.
    pairs_refused: std::sync::atomic::AtomicU64,
    /// Metadata requests answered without grants: the peer name they
    /// declared is not their source address.
    grants_withheld: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for RdmaTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTarget").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

impl RdmaTarget {
    /// A target over `engine`.
    pub fn new(engine: Arc<dyn Engine>, cfg: RdmaTargetConfig) -> Arc<Self> {
        Arc::new(Self {
            engine,
            cfg,
            state: Mutex::default(),
            binding: Mutex::new(()),
            pairs_refused: Default::default(),
            grants_withheld: Default::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Grants `[addr, addr+len)` to `peer` (the segment name its metadata
    /// declares) under a type-1 window of its own, published from now on in
    /// the metadata that peer fetches ([`Publish::Grants`]) and returned
    /// once the bind completed (the NIC honours the key). The range must lie
    /// in memory registered with the engine; the caller vouched for it then.
    pub fn grant(&self, peer: &str, addr: u64, len: u64) -> Result<(GrantId, u32), EngineError> {
        let verbs = |e: backend_verbs::VerbsError| EngineError::Verbs(e.to_string());
        let len32 = u32::try_from(len).ok().filter(|l| *l > 0).ok_or(EngineError::InvalidRegion { addr, len })?;
        let (mr, offset) = {
            let st = self.lock();
            let inside = |(a, (l, _, _)): (&u64, &(u64, MrId, u32))| {
                addr >= *a && addr.checked_add(len).is_some_and(|e| e <= a + l)
            };
            let region = st.regions.iter().find(|r| inside(*r)).map(|(a, (_, mr, _))| (*mr, addr - a));
            region.ok_or(EngineError::RegionNotRegistered(addr))?
        };
        let _one = self.binding.lock().unwrap_or_else(|e| e.into_inner());
        let (qp, wr_id) = self.binder()?;
        let mw = self.engine.alloc_pd_window().map_err(verbs)?;
        let bound = self
            .engine
            .post(qp, wr_id, WorkRequest::Bind { window: mw, mr, offset, len: len32 })
            .map_err(verbs)
            .and_then(|key| key.ok_or_else(|| EngineError::Verbs("the bind returned no key".into())))
            .and_then(|key| self.wait_bind(wr_id).map(|()| key));
        let rkey = match bound {
            Ok(k) => k,
            Err(e) => {
                self.engine.free_window(mw);
                // A failed bind leaves the binder in ERR (or unknown): the
                // next grant makes a new pair rather than fail forever.
                self.drop_binder();
                return Err(e);
            }
        };
        let mut st = self.lock();
        st.next_grant += 1;
        let id = GrantId(st.next_grant);
        st.grants.insert(id, Grant { peer: peer.to_string(), addr, len, mw, rkey });
        tracing::debug!(peer, addr, len, rkey, "RDMA grant (type-1 window)");
        Ok((id, rkey))
    }

    /// The binder queue pair and a fresh work request id; the pair is made
    /// (two queue pairs of our engine, connected to each other) at first use.
    fn binder(&self) -> Result<(QpId, u64), EngineError> {
        let verbs = |e: backend_verbs::VerbsError| EngineError::Verbs(e.to_string());
        let mut st = self.lock();
        st.next_wr += 1;
        let wr_id = st.next_wr;
        if let Some((a, _)) = st.binder {
            return Ok((a, wr_id));
        }
        let a = self.engine.create_qp(self.cfg.mtu).map_err(verbs)?;
        let b = match self.engine.create_qp(self.cfg.mtu) {
            Ok(b) => b,
            Err(e) => {
                self.engine.destroy_qp(QpId(a.qpn));
                return Err(verbs(e));
            }
        };
        let joined = self.engine.connect(QpId(a.qpn), &b).and_then(|()| self.engine.connect(QpId(b.qpn), &a));
        if let Err(e) = joined {
            self.engine.destroy_qp(QpId(a.qpn));
            self.engine.destroy_qp(QpId(b.qpn));
            return Err(verbs(e));
        }
        st.gid.get_or_insert(a.gid);
        st.binder = Some((QpId(a.qpn), QpId(b.qpn)));
        Ok((QpId(a.qpn), wr_id))
    }

    /// Destroys the binder pair (its requests complete flushed).
    fn drop_binder(&self) {
        if let Some((a, b)) = self.lock().binder.take() {
            self.engine.destroy_qp(a);
            self.engine.destroy_qp(b);
        }
    }

    /// Waits (bounded) for the completion of bind `wr_id`.
    fn wait_bind(&self, wr_id: u64) -> Result<(), EngineError> {
        let deadline = Instant::now() + BIND_TIMEOUT;
        loop {
            let done = self.engine.poll(16).map_err(|e| EngineError::Verbs(e.to_string()))?;
            if let Some(c) = done.iter().find(|c| c.wr_id == wr_id) {
                return if c.status == WcStatus::Success {
                    Ok(())
                } else {
                    Err(EngineError::Verbs(format!("bind of a grant's window: {:?}", c.status)))
                };
            }
            if Instant::now() >= deadline {
                return Err(EngineError::Verbs(format!("bind of a grant's window: no completion in {BIND_TIMEOUT:?}")));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Ends a grant: once this returns the NIC refuses its key (its window
    /// is freed), and the peer's metadata no longer holds it. `false` if
    /// there was none.
    pub fn revoke(&self, id: GrantId) -> bool {
        let Some(g) = self.lock().grants.remove(&id) else { return false };
        // ibv_dealloc_mw returns once the NIC no longer grants the key.
        self.engine.free_window(g.mw);
        tracing::debug!(peer = %g.peer, addr = g.addr, rkey = g.rkey, "RDMA grant revoked");
        true
    }

    /// Queue pairs currently paired with peers.
    pub fn paired_queue_pairs(&self) -> usize {
        self.lock().peers.values().map(|(q, _)| q.len()).sum()
    }

    /// Connections refused so far because their NIC path was paired
    /// already with live queue pairs (first wins), their address had its
    /// NIC paths paired ([`RdmaTargetConfig::max_peers_per_addr`]), or all
    /// [`MAX_PEERS`] were.
    pub fn pairs_refused(&self) -> u64 {
        self.pairs_refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Metadata requests answered without grants so far: they declared a
    /// peer name whose address is not theirs.
    pub fn grants_withheld(&self) -> u64 {
        self.grants_withheld.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether any of these queue pairs can still carry requests (not in
    /// ERR; one whose state cannot be read counts as alive).
    fn any_alive(&self, qps: &[QpId]) -> bool {
        qps.iter().any(|qp| !matches!(self.engine.qp_state(*qp), Ok(backend_verbs::QpState::Error)))
    }

    fn refuse(why: impl Into<String>) -> Vec<u8> {
        let why = why.into();
        tracing::debug!(why, "RDMA connection refused");
        ConnectionDesc {
            local_gid: String::new(),
            local_lid: 0,
            local_nic_path: String::new(),
            payload: String::new(),
            peer_nic_path: String::new(),
            qp_num: Vec::new(),
            ready_ack: None,
            reply_msg: why,
        }
        .to_json()
    }

    fn pair(&self, req: &ConnectionDesc, from: IpAddr) -> Result<ConnectionDesc, String> {
        if req.qp_num.is_empty() || req.qp_num.len() > MAX_QPS_PER_ENDPOINT {
            return Err(format!("{} queue pairs offered", req.qp_num.len()));
        }
        let gid = Gid(parse_gid(&req.local_gid).map_err(|e| e.to_string())?);
        let mut st = self.lock();
        if !st.peers.contains_key(&req.local_nic_path) && st.peers.len() >= MAX_PEERS {
            self.pairs_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(format!("{MAX_PEERS} peers paired already"));
        }
        // The NIC path is only what the message declares: a second pairing
        // under it while the first one's queue pairs live would let anyone
        // tear another peer's endpoint down (and pair in its place).
        let live = st.peers.get(&req.local_nic_path).is_some_and(|(old, _)| self.any_alive(old));
        if live && !self.cfg.replace_live_pairs {
            self.pairs_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(nic_path = %req.local_nic_path, "Connection under a NIC path with live queue pairs refused");
            return Err(format!("{} is paired already (first wins)", req.local_nic_path));
        }
        let new_path = !st.peers.contains_key(&req.local_nic_path);
        let cap = self.cfg.max_peers_per_addr;
        if new_path && st.per_addr.get(&from).copied().unwrap_or(0) >= cap {
            self.pairs_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(%from, cap, "Connection refused: this address has its NIC paths paired");
            return Err(format!("{from} has {cap} NIC paths paired already"));
        }
        let mut ours: Vec<Endpoint> = Vec::with_capacity(req.qp_num.len());
        let made = (|| {
            for theirs in &req.qp_num {
                let ep = self.engine.create_qp_with_psn(self.cfg.mtu, 0).map_err(|e| e.to_string())?;
                ours.push(ep);
                let remote = Endpoint { qpn: *theirs, psn: 0, gid, mtu: self.cfg.mtu };
                self.engine.connect(QpId(ep.qpn), &remote).map_err(|e| e.to_string())?;
            }
            Ok::<(), String>(())
        })();
        if let Err(e) = made {
            // We post nothing on a target's queue pairs.
            for ep in &ours {
                self.engine.destroy_qp(QpId(ep.qpn));
            }
            return Err(e);
        }
        st.gid.get_or_insert(ours[0].gid);
        let qps = ours.iter().map(|e| QpId(e.qpn)).collect();
        match st.peers.insert(req.local_nic_path.clone(), (qps, from)) {
            Some((old, was)) => {
                for qp in old {
                    self.engine.destroy_qp(qp);
                }
                if was != from {
                    if let Some(n) = st.per_addr.get_mut(&was) {
                        *n = n.saturating_sub(1);
                    }
                    *st.per_addr.entry(from).or_insert(0) += 1;
                }
            }
            None => *st.per_addr.entry(from).or_insert(0) += 1,
        }
        Ok(ConnectionDesc {
            local_gid: format_gid(&ours[0].gid.0),
            local_lid: 0,
            local_nic_path: req.peer_nic_path.clone(),
            payload: String::new(),
            peer_nic_path: req.local_nic_path.clone(),
            qp_num: ours.iter().map(|e| e.qpn).collect(),
            ready_ack: Some(false),
            reply_msg: String::new(),
        })
    }

    /// Our GID: from a queue pair made for the purpose if no peer paired yet.
    fn gid(&self) -> Option<Gid> {
        if let Some(g) = self.lock().gid {
            return Some(g);
        }
        let ep = self.engine.create_qp(self.cfg.mtu).ok()?;
        self.engine.destroy_qp(QpId(ep.qpn));
        Some(*self.lock().gid.get_or_insert(ep.gid))
    }
}

impl TargetHook for RdmaTarget {
    /// The data path is RDMA (the metadata says `tcp_data_port` 0, as a real
    /// Mooncake RDMA target's does): the engine's TCP data server refuses
    /// every request, or a peer could write by address past the keys.
    fn serves_tcp_data(&self) -> bool {
        false
    }

    fn descriptor(&self, mut base: SegmentDesc, peer: Option<&str>, from: Option<IpAddr>) -> SegmentDesc {
        let gid = self.gid().map(|g| format_gid(&g.0)).unwrap_or_default();
        base.protocol = "rdma".into();
        base.tcp_data_port = 0;
        base.tcp_data_host = None;
        base.tcp_proto_version = Some(1);
        base.devices = vec![DeviceDesc { gid, lid: 0, name: self.cfg.device.clone() }];
        base.priority_matrix = Some(serde_json::json!({ HOST_LOCATION: [[self.cfg.device], []] }));
        let st = self.lock();
        match self.cfg.publish {
            Publish::Registrations => base.buffers.retain_mut(|b| match st.regions.get(&b.addr) {
                Some((len, _, rkey)) if *len == b.length => {
                    b.name = HOST_LOCATION.into();
                    b.rkey = vec![*rkey];
                    b.lkey = vec![*rkey];
                    true
                }
                // Registered with the engine but not (yet) with the NIC.
                _ => false,
            }),
            Publish::Grants => {
                // A name is only what the request declares: its grants go
                // out only to a request from that name's own address (or on
                // a connection we dialed to it ourselves: `from` None).
                let vouched = self.cfg.grants_by_declared_name
                    || match (peer, from) {
                        (_, None) => true,
                        (Some(name), Some(ip)) => name.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip() == ip),
                        (None, Some(_)) => false,
                    };
                if !vouched {
                    self.grants_withheld.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(
                        ?peer,
                        ?from,
                        "metadata request declares a peer name from another address: no grants"
                    );
                }
                let peer = peer.filter(|_| vouched);
                base.buffers = st
                    .grants
                    .values()
                    .filter(|g| Some(g.peer.as_str()) == peer)
                    .map(|g| BufferDesc {
                        name: HOST_LOCATION.into(),
                        addr: g.addr,
                        length: g.len,
                        rkey: vec![g.rkey],
                        lkey: vec![g.rkey],
                    })
                    .collect();
            }
        }
        base
    }

    fn connection(&self, request: &[u8], from: IpAddr) -> Vec<u8> {
        let req = match ConnectionDesc::from_json(request) {
            Ok(r) => r,
            Err(e) => return Self::refuse(e.to_string()),
        };
        if req.ready_ack == Some(true) {
            // The ready round: the pairing is done; an empty record says so.
            return b"{}\n".to_vec();
        }
        match self.pair(&req, from) {
            Ok(reply) => {
                tracing::debug!(peer = %req.local_nic_path, qps = ?reply.qp_num, "RDMA endpoint paired (target)");
                reply.to_json()
            }
            Err(e) => Self::refuse(e),
        }
    }

    fn registered(&self, addr: u64, len: u64) -> Result<(), EngineError> {
        self.lock().registered.insert(addr, len);
        let range = VouchedRange { addr, len: len as usize };
        // With grants nothing is reachable until granted: the region's own
        // key grants nothing remote, windows bound over it do.
        let access = match self.cfg.publish {
            Publish::Registrations => MrAccess::RemoteWriteRead,
            Publish::Grants => MrAccess::WindowsOnly,
        };
        match self.engine.register(Arc::new(range), access) {
            Ok(info) => {
                self.lock().regions.insert(addr, (len, info.id, info.rkey));
                Ok(())
            }
            Err(e) => {
                self.lock().registered.remove(&addr);
                Err(EngineError::Verbs(e.to_string()))
            }
        }
    }

    fn unregistered(&self, addr: u64) {
        let (region, grants) = {
            let mut st = self.lock();
            let len = st.registered.remove(&addr).unwrap_or(0);
            let inside = |g: &Grant| g.addr >= addr && g.addr + g.len <= addr + len;
            let grants: Vec<GrantId> = st.grants.iter().filter(|(_, g)| inside(g)).map(|(id, _)| *id).collect();
            (st.regions.remove(&addr), grants)
        };
        // Every key into the region ends before the caller may free it.
        for id in grants {
            self.revoke(id);
        }
        if let Some((_, mr, _)) = region {
            // ibv_dereg_mr returns once the NIC no longer grants the key.
            self.engine.deregister(mr);
        }
    }
}

impl crate::adapter::TenancyKeys for RdmaTarget {
    fn grant(&self, peer: &str, addr: u64, len: u64) -> Result<(u64, u32), EngineError> {
        RdmaTarget::grant(self, peer, addr, len).map(|(id, key)| (id.0, key))
    }

    fn revoke(&self, grant: u64) -> bool {
        RdmaTarget::revoke(self, GrantId(grant))
    }
}
