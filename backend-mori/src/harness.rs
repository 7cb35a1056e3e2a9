//! Building blocks for test harnesses (the race suite, the bench, examples):
//! a prefill side and a decode side of the MORI backend on the TCP
//! simulator's fabric, connected to each other.
//!
//! ```
//! use backend_mori::harness::{sim_pair, PairConfig};
//! use backend_tcp_sim::block_on;
//! use kv_transfer_core::{Transfer, TransferOptions};
//!
//! let pair = sim_pair(&PairConfig::new(4, 4096)).unwrap();
//! // Decode reserves and exposes two slots to prefill.
//! let (exposed, remote) = pair.decode.transfer.expose(pair.decode.pool.reserve(2).unwrap(), pair.prefill_at_decode).unwrap();
//! // Prefill fills two slots and writes them; the inbound statuses settle decode's exposure.
//! let mut src = pair.prefill.pool.reserve(2).unwrap();
//! src.write_at(0, 0, &[1u8; 4096]).unwrap();
//! src.write_at(1, 0, &[2u8; 4096]).unwrap();
//! let out = block_on(async { pair.prefill.transfer.write(src, &remote, TransferOptions::default()).await.unwrap().await }).unwrap();
//! assert_eq!(out.result, Ok(()));
//! let settled = block_on(exposed.settled());
//! let bytes = settled.bytes().unwrap();
//! assert!(bytes[..4096].iter().all(|&b| b == 1) && bytes[4096..].iter().all(|&b| b == 2));
//! ```

use std::sync::Arc;

use kv_transfer_core::{EscalationLadder, HostRegion, PeerId, PoolConfig, Region, SlotPool};

use crate::adapter::{AdapterError, MoriTransfer};
use crate::engine::{EngineConfig, IoEngine, MoriEngine};
use crate::error::EngineError;
use crate::sim::{SimTransport, SimTransportConfig, TCP_SIM};
use crate::types::{EngineDesc, EngineKey};

/// One side: engine, transport, adapter and its pool.
#[derive(Debug)]
pub struct MoriSide<T = SimTransport> {
    /// The adapter (implements `kv_transfer_core::Transfer`).
    pub transfer: MoriTransfer,
    /// The pool registered with it.
    pub pool: SlotPool,
    /// The engine under the adapter.
    pub engine: Arc<MoriEngine>,
    /// The transport under the engine (the simulator's: its `nic()` gives
    /// the simulated NIC's counters).
    pub transport: Arc<T>,
}

impl<T> Clone for MoriSide<T> {
    fn clone(&self) -> Self {
        Self {
            transfer: self.transfer.clone(),
            pool: self.pool.clone(),
            engine: self.engine.clone(),
            transport: self.transport.clone(),
        }
    }
}

impl<T: crate::MoriTransport + 'static> MoriSide<T> {
    /// An engine named `key` on `transport`, an adapter over it (able to
    /// prove what `caps` says) and a pool over `region`.
    pub fn on(
        key: &str,
        region: Arc<dyn Region>,
        pool: PoolConfig,
        transport: Arc<T>,
        caps: kv_transfer_core::drain::Capabilities,
        engine: EngineConfig,
    ) -> Result<Self, AdapterError> {
        let engine = Arc::new(MoriEngine::new(key, engine, transport.clone())?);
        let transfer = MoriTransfer::new(engine.clone(), caps)?;
        let pool = transfer.register_pool(region, pool)?;
        Ok(Self { transfer, pool, engine, transport })
    }

    /// Makes `self` and `other` known to each other; returns `(other as
    /// numbered by self, self as numbered by other)`.
    pub fn connect<U>(&self, other: &MoriSide<U>) -> Result<(PeerId, PeerId), AdapterError> {
        let a = self.transfer.add_peer(&other.engine.engine_desc())?;
        let b = other.transfer.add_peer(&self.engine.engine_desc())?;
        Ok((a, b))
    }
}

impl MoriSide {
    /// An engine named `key` on a fresh [`SimTransport`], an adapter over it
    /// and a pool over `region`.
    pub fn on_sim(
        key: &str,
        region: Arc<dyn Region>,
        pool: PoolConfig,
        transport: SimTransportConfig,
        engine: EngineConfig,
    ) -> Result<Self, AdapterError> {
        Self::on(key, region, pool, SimTransport::new(transport), crate::sim::CAPABILITIES, engine)
    }
}

#[cfg(feature = "verbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "verbs")))]
impl MoriSide<crate::verbs::VerbsTransport> {
    /// An engine named `key` on a fresh [`crate::verbs::VerbsTransport`] over
    /// `nic`, an adapter over it and a pool over `region`.
    pub fn on_verbs(
        key: &str,
        region: Arc<dyn Region>,
        pool: PoolConfig,
        transport: crate::verbs::VerbsTransportConfig,
        nic: Arc<dyn backend_verbs::Engine>,
        engine: EngineConfig,
    ) -> Result<Self, AdapterError> {
        let caps = crate::verbs::capabilities(transport.access);
        let t = crate::verbs::VerbsTransport::new(transport, nic).map_err(EngineError::from)?;
        Self::on(key, region, pool, t, caps, engine)
    }
}

/// The descriptor of a peer that is only a simulator connection (a raw
/// wire client that sent a HELLO named `name`, announcing `sim_endpoint`):
/// registering it with [`MoriTransfer::add_peer`] lets the adapter expose
/// slots to that connection. It has no control channel (its endpoint refuses),
/// so ABORT never reaches it and its exposures settle by revocation or fence.
pub fn raw_sim_peer_desc(name: &str, sim_endpoint: &str) -> EngineDesc {
    EngineDesc {
        key: EngineKey::new(name),
        hostname: "raw".to_owned(),
        host: "127.0.0.1".to_owned(),
        port: 0,
        transport: TCP_SIM.to_owned(),
        transport_info: format!("{sim_endpoint}\n127.0.0.1:9").into_bytes(),
        notif_seq_start: 0,
    }
}

/// What [`sim_pair`] builds.
#[derive(Clone, Debug)]
pub struct PairConfig {
    /// Slots in each side's pool.
    pub slots: usize,
    /// Bytes per slot.
    pub slot_size: usize,
    /// Escalation ladder of both pools.
    pub ladder: EscalationLadder,
    /// Transport configuration (both sides).
    pub transport: SimTransportConfig,
    /// Engine configuration (both sides).
    pub engine: EngineConfig,
    /// Engine keys: (prefill, decode).
    pub keys: (String, String),
    /// A gate on the decode side's NIC: holds incoming writes while closed
    /// (`Gate::hold` / `Gate::open`).
    pub decode_gate: Option<backend_tcp_sim::Gate>,
}

impl PairConfig {
    /// `slots` slots of `slot_size` bytes on each side, default ladder and configurations.
    pub fn new(slots: usize, slot_size: usize) -> Self {
        Self {
            slots,
            slot_size,
            ladder: EscalationLadder::default(),
            transport: SimTransportConfig::default(),
            engine: EngineConfig::default(),
            keys: ("prefill".to_owned(), "decode".to_owned()),
            decode_gate: None,
        }
    }
}

/// A connected prefill/decode pair on the simulator's fabric.
#[derive(Clone, Debug)]
pub struct SimPair {
    /// The prefill side (initiator of writes).
    pub prefill: MoriSide,
    /// The decode side (exposes slots).
    pub decode: MoriSide,
    /// Decode as the prefill adapter numbers it.
    pub decode_at_prefill: PeerId,
    /// Prefill as the decode adapter numbers it (pass it to `decode.transfer.expose`).
    pub prefill_at_decode: PeerId,
}

/// Builds and connects a prefill side and a decode side.
pub fn sim_pair(cfg: &PairConfig) -> Result<SimPair, AdapterError> {
    let len = cfg.slots.checked_mul(cfg.slot_size).ok_or_else(|| AdapterError::Region("pool too large".to_owned()))?;
    let region = |_: ()| -> Result<Arc<dyn Region>, AdapterError> {
        Ok(Arc::new(HostRegion::new(len).map_err(|e| AdapterError::Engine(EngineError::InvalidArgs(e.to_string())))?))
    };
    let pool = PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder);
    let prefill = MoriSide::on_sim(&cfg.keys.0, region(())?, pool.clone(), cfg.transport.clone(), cfg.engine.clone())?;
    let mut dt = cfg.transport.clone();
    if let Some(g) = &cfg.decode_gate {
        dt.nic.faults.gate = Some(g.clone());
    }
    let decode = MoriSide::on_sim(&cfg.keys.1, region(())?, pool, dt, cfg.engine.clone())?;
    let (decode_at_prefill, prefill_at_decode) = prefill.connect(&decode)?;
    Ok(SimPair { prefill, decode, decode_at_prefill, prefill_at_decode })
}

/// The tag an initiator's adapter puts on a transfer that asks the target to
/// settle tenancy `t` of the target's memory `mem` (for raw peers in tests).
pub fn settle_tag(mem: u32, t: kv_transfer_core::Tenancy) -> crate::types::Tag {
    crate::adapter::pack_tag(mem, t, true)
}

/// A peer under a test's direct control: a simulator connection to one
/// engine, over which it sends MORI notifications
/// the real engines would not (replays, old and future generations, unknown
/// codes). Register [`RawMoriPeer::desc`] with the engine's adapter
/// ([`MoriTransfer::add_peer`]) before exposing to it.
pub struct RawMoriPeer {
    nic: backend_tcp_sim::SimNic,
    peer: kv_transfer_core::PeerId,
    desc: EngineDesc,
    next_seq: u32,
    next_uid: u64,
}

impl std::fmt::Debug for RawMoriPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawMoriPeer").field("key", &self.desc.key).finish()
    }
}

impl RawMoriPeer {
    /// Connects a peer named `name` to the engine described by `target`
    /// (its simulator NIC).
    pub fn connect(name: &str, target: &EngineDesc) -> Result<Self, crate::error::TransportError> {
        use crate::error::TransportError;
        let info = String::from_utf8_lossy(&target.transport_info).into_owned();
        let Some(sim) = info.lines().next().filter(|l| !l.is_empty()) else {
            return Err(TransportError::State("target is not on the simulator".into()));
        };
        let nic = backend_tcp_sim::SimNic::start(backend_tcp_sim::NicConfig::new(name))
            .map_err(|e| TransportError::State(e.to_string()))?;
        let peer = nic.connect(sim).map_err(|e| TransportError::Remote(e.to_string()))?;
        let desc = EngineDesc {
            key: EngineKey::new(name),
            hostname: "raw".to_owned(),
            host: "127.0.0.1".to_owned(),
            port: 0,
            transport: TCP_SIM.to_owned(),
            transport_info: nic.endpoint().as_bytes().to_vec(),
            notif_seq_start: 0,
        };
        Ok(Self { nic, peer, desc, next_seq: 0, next_uid: 0 })
    }

    /// Its descriptor, to register with the target's adapter.
    pub fn desc(&self) -> &EngineDesc {
        &self.desc
    }

    /// Its simulated NIC.
    pub fn nic(&self) -> &backend_tcp_sim::SimNic {
        &self.nic
    }

    /// Sends one notification with the next sequence number and transfer id.
    pub fn notify(&mut self, code: crate::StatusCode, tag: crate::types::Tag) -> Result<(), crate::TransportError> {
        let n = crate::transport::Notification {
            seq: self.next_seq,
            uid: self.next_uid,
            code: code.raw(),
            message: String::new(),
            tag,
        };
        self.next_seq = self.next_seq.wrapping_add(1);
        self.next_uid = self.next_uid.wrapping_add(1);
        let msg = crate::notify::encode_notification(&n);
        self.nic.send_message(self.peer, &msg).map_err(|e| crate::TransportError::Remote(e.to_string()))
    }
}

/// What a throughput loop needs (kvt's loopback rig): an initiator's
/// [`MoriTransfer`] and pool, and a target's exposure of `slots` slots, both
/// in this process on the simulator's fabric.
///
/// ```
/// use backend_mori::harness::LoopbackRig;
/// let rig = LoopbackRig::new(4, 4096).unwrap();
/// assert_eq!(rig.remote().slots.len(), 4);
/// assert_eq!(rig.initiator_pool().capacity(), 4);
/// rig.teardown();
/// ```
#[derive(Debug)]
pub struct LoopbackRig {
    pair: SimPair,
    exposed: Option<kv_transfer_core::SlotLease<kv_transfer_core::Exposed>>,
    remote: kv_transfer_core::RemoteSlots,
}

impl LoopbackRig {
    /// `slots` slots of `block` bytes a side; the target exposes all of its slots.
    pub fn new(slots: usize, block: usize) -> Result<Self, AdapterError> {
        let mut cfg = PairConfig::new(slots, block);
        cfg.keys = ("kvt-initiator".to_owned(), "kvt-target".to_owned());
        let pair = sim_pair(&cfg)?;
        let lease = pair
            .decode
            .pool
            .reserve(slots)
            .map_err(|e| AdapterError::Engine(EngineError::InvalidArgs(e.to_string())))?;
        let (exposed, remote) = pair
            .decode
            .transfer
            .expose(lease, pair.prefill_at_decode)
            .map_err(|e| AdapterError::Engine(EngineError::BadState(e.kind.to_string())))?;
        Ok(Self { pair, exposed: Some(exposed), remote })
    }

    /// The initiator's adapter (clone it into an `Arc<dyn Transfer>`).
    pub fn transfer(&self) -> MoriTransfer {
        self.pair.prefill.transfer.clone()
    }

    /// The initiator's pool.
    pub fn initiator_pool(&self) -> SlotPool {
        self.pair.prefill.pool.clone()
    }

    /// The target's exposure.
    pub fn remote(&self) -> &kv_transfer_core::RemoteSlots {
        &self.remote
    }

    /// Both sides.
    pub fn pair(&self) -> &SimPair {
        &self.pair
    }

    /// Aborts the target's exposure (the initiator, with nothing in flight,
    /// acks the ABORT and the slots settle) and shuts both sides down.
    pub fn teardown(mut self) {
        if let Some(e) = self.exposed.take() {
            e.abort();
        }
        let pool = self.pair.decode.pool.clone();
        // Bounded: 2 s at most for the ABORT / ABORT_ACK round trip.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while pool.metrics().quarantined > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}
