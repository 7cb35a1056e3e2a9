//! The target half of Mooncake's RDMA transport: a [`TargetHook`] that
//! answers the Connection exchange (creates and connects one queue pair per
//! peer queue pair) and writes the RDMA part of our metadata.
//!
//! [`RdmaTarget`] publishes what a real Mooncake target publishes: each
//! registered buffer under its memory region's own remote key, to every
//! peer, for as long as it is registered. That is what interop needs and
//! what the hazard's positive control is made of: a key that does not change
//! with the tenancy lets a late WRITE of an old request land in the next
//! one's slot.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use backend_verbs::{Endpoint, Engine, Gid, MrAccess, MrId, QpId};

use super::VouchedRange;
use crate::error::EngineError;
use crate::proto::rdma::{format_gid, parse_gid, MAX_QPS_PER_ENDPOINT};
use crate::proto::{ConnectionDesc, DeviceDesc, SegmentDesc};
use crate::server::TargetHook;

/// Peers (NIC paths) a target keeps queue pairs for at once; a Connection
/// from one more is refused.
pub const MAX_PEERS: usize = 1024;

/// The location name Mooncake gives host memory, in buffer names and in the
/// priority matrix (an initiator picks the target's device through it).
const HOST_LOCATION: &str = "cpu:0";

/// Options of the RDMA target.
#[derive(Debug, Clone)]
pub struct RdmaTargetConfig {
    /// The device name peers see (`rxe_lo`).
    pub device: String,
    /// Path MTU offered (min(active, 4096)).
    pub mtu: u32,
}

impl Default for RdmaTargetConfig {
    fn default() -> Self {
        Self { device: String::new(), mtu: 4096 }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Registered buffers: start → (length, memory region, its key).
    regions: BTreeMap<u64, (u64, MrId, u32)>,
    /// Queue pairs per peer NIC path (a peer that pairs again replaces its
    /// old ones, as a Mooncake target does).
    peers: HashMap<String, Vec<QpId>>,
    /// Our GID, learnt from the first queue pair created.
    gid: Option<Gid>,
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
    fn descriptor(&self, mut base: SegmentDesc, _peer: Option<&str>) -> SegmentDesc {
        let gid = self.gid().map(|g| format_gid(&g.0)).unwrap_or_default();
        base.protocol = "rdma".into();
        base.tcp_data_port = 0;
        base.tcp_data_host = None;
        base.tcp_proto_version = Some(1);
        base.devices = vec![DeviceDesc { gid, lid: 0, name: self.cfg.device.clone() }];
        base.priority_matrix = Some(serde_json::json!({ HOST_LOCATION: [[self.cfg.device], []] }));
        let st = self.lock();
        base.buffers.retain_mut(|b| match st.regions.get(&b.addr) {
            Some((len, _, rkey)) if *len == b.length => {
                b.name = HOST_LOCATION.into();
                b.rkey = vec![*rkey];
                b.lkey = vec![*rkey];
                true
            }
            // Registered with the engine but not (yet) with the NIC.
            _ => false,
        });
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
        let range = VouchedRange { addr, len: len as usize };
        let info = self
            .engine
            .register(Arc::new(range), MrAccess::RemoteWriteRead)
            .map_err(|e| EngineError::Verbs(e.to_string()))?;
        self.lock().regions.insert(addr, (len, info.id, info.rkey));
        Ok(())
    }

    fn unregistered(&self, addr: u64) {
        if let Some((_, mr, _)) = self.lock().regions.remove(&addr) {
            // ibv_dereg_mr returns once the NIC no longer grants the key.
            self.engine.deregister(mr);
        }
    }
}
