//! Scenario 2's rig on the Mooncake adapter: the race's one schedule of
//! aborts and reassignments (see [`super`]), through `backend-mooncake`,
//! ours on both sides over Mooncake's TCP protocol (on 127.0.0.1: run it in a
//! network namespace with netem on its loopback to add loss and reordering).
//!
//! Mooncake TCP can neither revoke nor fence: its target checks only that a
//! request lies in registered memory, so a write under an aborted tenancy
//! lands wherever that address is now. The one proof for an aborted
//! exposure is the initiator's ABORT_ACK, sent once its operations on it
//! ended. One decode adapter with a pool twice the round's size, two
//! prefill adapters; prefill 0's engine runs its transport behind a
//! [`GatedTransport`]. Each round:
//!
//! 1. `round` requests reserve decode slots and expose them to prefill 0,
//!    which writes a [tagged](crate::payload) payload into each; in a *held*
//!    round its transport holds them all (posted, not terminal, no byte on
//!    the wire).
//! 2. The doomed requests are aborted with their writes in flight.
//! 3. Next tenants reserve slots at once (the free list is LIFO) and get
//!    their bytes from prefill 1, awaited: under `naive` the aborted slots
//!    came straight back, so the next tenants get them; under `safe` they
//!    stay quarantined until prefill 0's ack, so the next tenants get other
//!    slots (or, when none are free, are refused by admission).
//! 4. The gate opens; prefill 0's writes land; every operation is awaited
//!    and every consumer checks every byte it reads against its own tag.
//!
//! Under `naive` the held writes land after the next tenants' bytes, in
//! their slots: the positive control ([`RaceReport::stale_writes_landed`]).
//! Under `safe` the same writes land in quarantined slots no tenant holds
//! ([`RaceReport::stale_writes_quarantined`]) and the slots come back with
//! the ack: zero foreign bytes.
//!
//! [`run_mooncake_rdma_race`] (feature `mooncake-rdma`) runs the same
//! schedule over Mooncake's RDMA transport on backend-verbs' software NIC,
//! the decode side granting a key per exposure: there the ladder revokes
//! (the slots come back `Revoked`, shadowed for prefill 0, which may retry),
//! and the held writes, released, are refused at the NIC
//! ([`RaceReport::rejected_at_nic`]). Under `naive` the old keys are never
//! ended and the held writes land in the next tenants' slots.

use super::run::{Prefill, RaceRig, Sides};
use super::{setup_err, step_err, RaceConfig, RaceError, RaceReport};
use crate::wait::wait_until;
use backend_mooncake::gate::GatedTransport;
use backend_mooncake::{
    AdapterConfig, DataTransport, EngineConfig, MooncakeEngine, MooncakeTransfer, TcpTransportConfig,
};
use kv_transfer_core::{EscalationLadder, Exposed, PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotPool};
use std::sync::Arc;
use std::time::Duration;

/// How long a round waits for its aborted slots before next tenants take
/// whatever is free.
const RECLAIM_WAIT: Duration = Duration::from_millis(20);

/// What carries the race's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    Tcp,
    #[cfg(feature = "mooncake-rdma")]
    RdmaFake,
    #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
    RdmaDevice,
}

struct Rig {
    #[cfg(feature = "mooncake-rdma")]
    fabric: Option<backend_verbs::FakeFabric>,
    /// Prefill 0's RDMA transport (its refused slices: the stale writes the
    /// target's NIC refused, on a device that keeps no such count for us).
    #[cfg(feature = "mooncake-rdma")]
    p0_rdma: Option<Arc<backend_mooncake::rdma::RdmaTransport>>,
    sides: Sides<MooncakeTransfer>,
    gate: Arc<GatedTransport>,
    p0_peer: PeerId,
    p1_peer: PeerId,
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        local_host: "127.0.0.1".into(),
        tcp: TcpTransportConfig { workers: 2, ..TcpTransportConfig::default() },
        ..EngineConfig::default()
    }
}

fn adapter(engine: MooncakeEngine, policy: super::ReleasePolicy) -> Result<MooncakeTransfer, RaceError> {
    adapter_with(engine, AdapterConfig { release_policy: policy, ..AdapterConfig::default() })
}

fn adapter_with(engine: MooncakeEngine, cfg: AdapterConfig) -> Result<MooncakeTransfer, RaceError> {
    MooncakeTransfer::new(Arc::new(engine), cfg).map_err(setup_err)
}

/// The three adapters' engines, and prefill 0's gate.
struct Engines {
    decode: MooncakeTransfer,
    p0: MooncakeEngine,
    p1: MooncakeEngine,
    gate: Arc<GatedTransport>,
    #[cfg(feature = "mooncake-rdma")]
    p0_rdma: Option<Arc<backend_mooncake::rdma::RdmaTransport>>,
}

fn tcp_engines(policy: super::ReleasePolicy) -> Result<Engines, RaceError> {
    let decode = adapter(MooncakeEngine::new(engine_config()).map_err(setup_err)?, policy)?;
    let ecfg = engine_config();
    let gate = Arc::new(GatedTransport::new(ecfg.tcp.clone()).map_err(setup_err)?);
    let p0 = MooncakeEngine::with_transport(ecfg, gate.clone() as Arc<dyn DataTransport>).map_err(setup_err)?;
    let p1 = MooncakeEngine::new(engine_config()).map_err(setup_err)?;
    Ok(Engines {
        decode,
        p0,
        p1,
        gate,
        #[cfg(feature = "mooncake-rdma")]
        p0_rdma: None,
    })
}

/// The NICs of one Mooncake engine over RDMA.
#[cfg(feature = "mooncake-rdma")]
type NicsFn<'a> = &'a dyn Fn() -> Result<backend_mooncake::rdma::RdmaNics, RaceError>;

#[cfg(feature = "mooncake-rdma")]
fn rdma_engines(nics: NicsFn<'_>, device: &str, policy: super::ReleasePolicy) -> Result<Engines, RaceError> {
    use backend_mooncake::adapter::TenancyKeys;
    use backend_mooncake::rdma::{Publish, RdmaParts};
    let parts =
        || RdmaParts::new(nics()?, device, Publish::Grants, engine_config().handshake_timeout).map_err(setup_err);
    let d = parts()?;
    let keys: Arc<dyn TenancyKeys> = d.target.clone();
    let engine = d.engine(engine_config(), d.transport.clone()).map_err(setup_err)?;
    let decode =
        adapter_with(engine, AdapterConfig { release_policy: policy, keys: Some(keys), ..AdapterConfig::default() })?;
    let p0 = parts()?;
    let p0_rdma = Some(p0.transport.clone());
    let gate = Arc::new(GatedTransport::over(p0.transport.clone()));
    let p0 = p0.engine(engine_config(), gate.clone() as Arc<dyn DataTransport>).map_err(setup_err)?;
    let p1 = parts()?;
    let p1 = p1.engine(engine_config(), p1.transport.clone()).map_err(setup_err)?;
    Ok(Engines { decode, p0, p1, gate, p0_rdma })
}

fn pool(
    t: &MooncakeTransfer,
    memory: kv_transfer_core::SlotMemory,
    slots: usize,
    slot_size: usize,
    ladder: EscalationLadder,
) -> Result<SlotPool, RaceError> {
    let region = super::pool_region(memory, slots, slot_size)?;
    t.register_pool(region, PoolConfig::new(slot_size).with_ladder(ladder)).map_err(setup_err)
}

impl Rig {
    fn start(cfg: &RaceConfig, wire: Wire) -> Result<Self, RaceError> {
        let k = cfg.slots_per_request;
        let safe = super::ReleasePolicy::Safe;
        #[cfg(feature = "mooncake-rdma")]
        let fabric = (wire == Wire::RdmaFake).then(|| backend_verbs::FakeFabric::new(cfg.seed));
        let engines = match wire {
            Wire::Tcp => tcp_engines(cfg.policy)?,
            #[cfg(feature = "mooncake-rdma")]
            Wire::RdmaFake => {
                let f = fabric.clone().ok_or_else(|| setup_err("no fabric"))?;
                let nics = move || Ok(backend_mooncake::rdma::RdmaNics { initiator: f.nic(), target: f.nic() });
                rdma_engines(&nics, "fake0", cfg.policy)?
            }
            #[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
            Wire::RdmaDevice => {
                let env = backend_verbs::LabEnv::from_env();
                let open = || {
                    backend_verbs::DeviceEngine::open(&env.device, 1, env.gid_index)
                        .map(|e| e as Arc<dyn backend_verbs::Engine>)
                        .map_err(setup_err)
                };
                let nics = || Ok(backend_mooncake::rdma::RdmaNics { initiator: open()?, target: open()? });
                rdma_engines(&nics, &env.device, cfg.policy)?
            }
        };
        #[cfg(feature = "mooncake-rdma")]
        let Engines { decode, p0: e0, p1: e1, gate, p0_rdma } = engines;
        #[cfg(not(feature = "mooncake-rdma"))]
        let Engines { decode, p0: e0, p1: e1, gate } = engines;
        let dpool = pool(&decode, cfg.memory, cfg.round * k * 2, cfg.slot_size, super::race_ladder(cfg))?;
        let p0 = adapter(e0, safe)?;
        let p0pool = pool(&p0, cfg.memory, cfg.round * k, cfg.slot_size, EscalationLadder::default())?;
        let p1 = adapter(e1, safe)?;
        let p1pool = pool(&p1, cfg.memory, cfg.round * k * 2, cfg.slot_size, EscalationLadder::default())?;
        let p0_peer = decode.add_peer(p0.segment_name()).map_err(setup_err)?;
        let p1_peer = decode.add_peer(p1.segment_name()).map_err(setup_err)?;
        p0.add_peer(decode.segment_name()).map_err(setup_err)?;
        p1.add_peer(decode.segment_name()).map_err(setup_err)?;
        Ok(Self {
            #[cfg(feature = "mooncake-rdma")]
            fabric,
            #[cfg(feature = "mooncake-rdma")]
            p0_rdma,
            sides: Sides { decode, p0, p1, dpool, p0pool, p1pool },
            gate,
            p0_peer,
            p1_peer,
        })
    }

    fn counter(t: &MooncakeTransfer, name: &str) -> u64 {
        t.metrics().fields().into_iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| v)
    }
}

impl RaceRig for Rig {
    type Xfer = MooncakeTransfer;
    // A held round's writes cannot end before the gate opens, nor can
    // Mooncake over TCP revoke them: next tenants take whatever is free
    // after a short wait (under `safe`, other slots, or none).
    const RECLAIM_WAIT: Option<Duration> = Some(RECLAIM_WAIT);

    fn sides(&self) -> &Sides<Self::Xfer> {
        &self.sides
    }

    fn expose(
        &mut self,
        lease: SlotLease<Reserved>,
        to: Prefill,
        _wait: Duration,
    ) -> Result<Option<(SlotLease<Exposed>, RemoteSlots)>, RaceError> {
        let peer = match to {
            Prefill::First => self.p0_peer,
            Prefill::Next => self.p1_peer,
        };
        match self.sides.decode.expose(lease, peer) {
            Ok(x) => Ok(Some(x)),
            // Over RDMA: a slot revoked while exposed to prefill 0 is not
            // exposed to it again until its ack (it may retry).
            Err(e) if matches!(e.kind, kv_transfer_core::ExposeErrorKind::RetryShadow(_)) => {
                e.lease.release();
                Ok(None)
            }
            Err(e) => Err(step_err(e.kind)),
        }
    }

    fn hold(&mut self) -> bool {
        self.gate.hold()
    }
    fn release(&mut self, _rep: &mut RaceReport, _wait: Duration) {
        self.gate.open();
    }

    /// The aborted slots come back with prefill 0's acks before the next
    /// round (over RDMA: revoked, and their shadows cleared by the acks).
    fn end_round(&self, wait: Duration) -> bool {
        wait_until(wait, || self.sides.dpool.metrics().quarantined == 0 && self.sides.decode.metrics().shadowed == 0)
    }

    fn finish(&self, rep: &mut RaceReport) {
        rep.stale_notifications = self.sides.dpool.metrics().stale_rejected;
        rep.naive_releases = Rig::counter(&self.sides.decode, "naive_releases");
        #[cfg(feature = "mooncake-rdma")]
        match (&self.fabric, &self.p0_rdma) {
            (Some(f), _) => rep.rejected_at_nic = f.stats().rejected_access,
            // On a device: the refusals prefill 0 saw (the target's NIC
            // keeps no count for us).
            (None, Some(t)) => rep.rejected_at_nic = t.refused_slices(),
            (None, None) => {}
        }
    }
}

/// Runs scenario 2 on the Mooncake adapter (ours on both sides, TCP on
/// 127.0.0.1) and reports what consumers found. `progress(done, total)` is
/// called after every round.
///
/// ```
/// use kv_transfer_examples::race::{mooncake::run_mooncake_race, RaceConfig};
/// use backend_tcp_sim::ReleasePolicy;
/// let cfg = RaceConfig { requests: 64, policy: ReleasePolicy::Safe, ..RaceConfig::default() };
/// let r = run_mooncake_race(&cfg, &mut |_, _| {}).unwrap();
/// assert_eq!((r.foreign_requests, r.stale_writes_landed), (0, 0));
/// assert!(r.pool_whole());
/// ```
pub fn run_mooncake_race(cfg: &RaceConfig, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    run(cfg, Wire::Tcp, progress)
}

/// Runs scenario 2 on the Mooncake adapter over Mooncake's RDMA transport
/// on backend-verbs' software NIC, a key per exposure (see the module docs).
///
/// ```
/// use kv_transfer_examples::race::{mooncake::run_mooncake_rdma_race, RaceConfig};
/// use backend_tcp_sim::ReleasePolicy;
/// let cfg = RaceConfig { requests: 64, policy: ReleasePolicy::Safe, ..RaceConfig::default() };
/// let r = run_mooncake_rdma_race(&cfg, &mut |_, _| {}).unwrap();
/// assert_eq!((r.foreign_requests, r.stale_writes_landed), (0, 0));
/// assert!(r.pool_whole());
/// ```
#[cfg(feature = "mooncake-rdma")]
pub fn run_mooncake_rdma_race(cfg: &RaceConfig, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    run(cfg, Wire::RdmaFake, progress)
}

/// Runs scenario 2 on the Mooncake adapter over Mooncake's RDMA transport
/// on a verbs device (`KVT_VERBS_DEVICE`, Soft-RoCE in `scripts/rdma-lab`'s
/// guest), a key per exposure: as [`run_mooncake_rdma_race`], on a real
/// NIC; the refusals counted are those prefill 0 saw.
#[cfg(all(feature = "mooncake-rdma", feature = "verbs"))]
pub fn run_mooncake_rdma_device_race(
    cfg: &RaceConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RaceReport, RaceError> {
    run(cfg, Wire::RdmaDevice, progress)
}

fn run(cfg: &RaceConfig, wire: Wire, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    if wire != Wire::Tcp {
        // TCP stages device slots through host buffers; an RDMA NIC needs
        // them registered (dma-buf, a GPU).
        super::host_memory_only(cfg, "Mooncake RDMA")?;
    }
    super::run::run(cfg, |cfg| Rig::start(cfg, wire), progress)
}
