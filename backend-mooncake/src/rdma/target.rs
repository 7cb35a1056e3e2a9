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
//! A grant is a memory registration of its own, not a memory window: a
//! type-2 window grants access through one queue pair only, and a Mooncake
//! initiator stripes its slices over its two (a window bound on one refuses
//! the slices of the other); a type-1 window (any queue pair of the
//! protection domain, which rxe supports) is the lighter way to the same
//! property, and the next step. Either way the NIC refuses a revoked key.
//!
//! Peers are told apart by the segment name their own metadata declares:
//! all Mooncake's handshake carries. A peer that can reach our handshake
//! port and claims another's name can read the keys granted to it; the
//! drain protocol's tokens still decide settlement, not the name.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use backend_verbs::{Endpoint, Engine, Gid, MrAccess, MrId, QpId};

use super::VouchedRange;
use crate::error::EngineError;
use crate::proto::rdma::{format_gid, parse_gid, MAX_QPS_PER_ENDPOINT};
use crate::proto::{BufferDesc, ConnectionDesc, DeviceDesc, SegmentDesc};
use crate::server::TargetHook;

/// Peers (NIC paths) a target keeps queue pairs for at once; a Connection
/// from one more is refused.
pub const MAX_PEERS: usize = 1024;

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
}

impl Default for RdmaTargetConfig {
    fn default() -> Self {
        Self { device: String::new(), mtu: 4096, publish: Publish::default() }
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
    mr: MrId,
    rkey: u32,
}

#[derive(Debug, Default)]
struct State {
    /// Registered buffers published under their region's key
    /// ([`Publish::Registrations`]): start → (length, memory region, its key).
    regions: BTreeMap<u64, (u64, MrId, u32)>,
    /// Every buffer registered with the engine: start → length.
    registered: BTreeMap<u64, u64>,
    /// Queue pairs per peer NIC path (a peer that pairs again replaces its
    /// old ones, as a Mooncake target does).
    peers: HashMap<String, Vec<QpId>>,
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
}

impl std::fmt::Debug for RdmaTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTarget").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

impl RdmaTarget {
    /// A target over `engine`.
    pub fn new(engine: Arc<dyn Engine>, cfg: RdmaTargetConfig) -> Arc<Self> {
        Arc::new(Self { engine, cfg, state: Mutex::default() })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Grants `[addr, addr+len)` to `peer` (the segment name its metadata
    /// declares) under a key of its own, published from now on in the
    /// metadata that peer fetches ([`Publish::Grants`]). The range must lie
    /// in memory registered with the engine; the caller vouched for it then.
    pub fn grant(&self, peer: &str, addr: u64, len: u64) -> Result<(GrantId, u32), EngineError> {
        if len == 0 {
            return Err(EngineError::InvalidRegion { addr, len });
        }
        let inside =
            self.lock().registered.iter().any(|(a, l)| addr >= *a && addr.checked_add(len).is_some_and(|e| e <= a + l));
        if !inside {
            return Err(EngineError::RegionNotRegistered(addr));
        }
        let range = VouchedRange { addr, len: len as usize };
        let info = self
            .engine
            .register(Arc::new(range), MrAccess::RemoteWriteRead)
            .map_err(|e| EngineError::Verbs(e.to_string()))?;
        let mut st = self.lock();
        st.next_grant += 1;
        let id = GrantId(st.next_grant);
        st.grants.insert(id, Grant { peer: peer.to_string(), addr, len, mr: info.id, rkey: info.rkey });
        tracing::debug!(peer, addr, len, rkey = info.rkey, "RDMA grant");
        Ok((id, info.rkey))
    }

    /// Ends a grant: once this returns the NIC refuses its key, and the
    /// peer's metadata no longer holds it. `false` if there was none.
    pub fn revoke(&self, id: GrantId) -> bool {
        let Some(g) = self.lock().grants.remove(&id) else { return false };
        // ibv_dereg_mr returns once the NIC no longer grants the key.
        self.engine.deregister(g.mr);
        tracing::debug!(peer = %g.peer, addr = g.addr, rkey = g.rkey, "RDMA grant revoked");
        true
    }

    /// Queue pairs currently paired with peers.
    pub fn paired_queue_pairs(&self) -> usize {
        self.lock().peers.values().map(Vec::len).sum()
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

    fn pair(&self, req: &ConnectionDesc) -> Result<ConnectionDesc, String> {
        if req.qp_num.is_empty() || req.qp_num.len() > MAX_QPS_PER_ENDPOINT {
            return Err(format!("{} queue pairs offered", req.qp_num.len()));
        }
        let gid = Gid(parse_gid(&req.local_gid).map_err(|e| e.to_string())?);
        let mut st = self.lock();
        if !st.peers.contains_key(&req.local_nic_path) && st.peers.len() >= MAX_PEERS {
            return Err(format!("{MAX_PEERS} peers paired already"));
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
        if let Some(old) = st.peers.insert(req.local_nic_path.clone(), qps) {
            for qp in old {
                self.engine.destroy_qp(qp);
            }
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

    fn descriptor(&self, mut base: SegmentDesc, peer: Option<&str>) -> SegmentDesc {
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

    fn connection(&self, request: &[u8]) -> Vec<u8> {
        let req = match ConnectionDesc::from_json(request) {
            Ok(r) => r,
            Err(e) => return Self::refuse(e.to_string()),
        };
        if req.ready_ack == Some(true) {
            // The ready round: the pairing is done; an empty record says so.
            return b"{}\n".to_vec();
        }
        match self.pair(&req) {
            Ok(reply) => {
                tracing::debug!(peer = %req.local_nic_path, qps = ?reply.qp_num, "RDMA endpoint paired (target)");
                reply.to_json()
            }
            Err(e) => Self::refuse(e),
        }
    }

    fn registered(&self, addr: u64, len: u64) -> Result<(), EngineError> {
        self.lock().registered.insert(addr, len);
        if self.cfg.publish == Publish::Grants {
            // Nothing is reachable until granted.
            return Ok(());
        }
        let range = VouchedRange { addr, len: len as usize };
        match self.engine.register(Arc::new(range), MrAccess::RemoteWriteRead) {
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
