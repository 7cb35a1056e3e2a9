//! Scenario 2 on the Mooncake adapter: the same schedule of aborts and
//! reassignments as the simulator's race, through `backend-mooncake`, ours
//! on both sides over Mooncake's TCP protocol (on 127.0.0.1: run it in a
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

use super::{
    check_config, check_lease, fill_lease, finish_report, record_consumed, run_rounds, setup_err,
    slots_with_foreign_bytes, step_err, tags_of, RaceConfig, RaceError, RaceReport, Rng,
};
use crate::payload::Tag;
use crate::wait::wait_until;
use backend_mooncake::gate::GatedTransport;
use backend_mooncake::{
    AdapterConfig, DataTransport, EngineConfig, MooncakeEngine, MooncakeTransfer, TcpTransportConfig,
};
use backend_tcp_sim::block_on;
use kv_transfer_core::{
    EscalationLadder, Exposed, PeerId, PoolConfig, RemoteSlots, Reserved, Settled, SlotLease, SlotPool, Transfer,
    TransferHandle, TransferOptions,
};
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
    decode: MooncakeTransfer,
    p0: MooncakeTransfer,
    p1: MooncakeTransfer,
    gate: Arc<GatedTransport>,
    dpool: SlotPool,
    p0pool: SlotPool,
    p1pool: SlotPool,
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
            decode,
            p0,
            p1,
            gate,
            dpool,
            p0pool,
            p1pool,
            p0_peer,
            p1_peer,
        })
    }

    fn counter(t: &MooncakeTransfer, name: &str) -> u64 {
        t.metrics().fields().into_iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| v)
    }
}

/// A first tenant: exposed to prefill 0, written by it.
struct First {
    id: u64,
    exposed: Option<SlotLease<Exposed>>,
    remote: RemoteSlots,
    handle: Option<TransferHandle>,
    doomed: bool,
}

/// A next tenant: exposed to prefill 1, written by it before the gate opens.
struct Next {
    tags: Vec<Tag>,
    exposed: SlotLease<Exposed>,
    written: bool,
    /// Its slots, to recognize an old write that landed in them.
    slots: Vec<u32>,
}

struct Run<'a> {
    cfg: &'a RaceConfig,
    rig: Rig,
    rng: Rng,
    rep: RaceReport,
    next_id: u64,
    wait: Duration,
}

impl super::Rounds for Run<'_> {
    fn round(&mut self) -> Result<(), RaceError> {
        Run::round(self)
    }
    fn report(&self) -> &RaceReport {
        &self.rep
    }
}

impl Run<'_> {
    fn settle(&mut self, exposed: SlotLease<Exposed>) -> Option<SlotLease<Settled>> {
        super::settle_within(exposed, self.wait, &mut self.rep)
    }

    /// Waits for `h`; whether the operation succeeded.
    fn await_handle(&mut self, h: TransferHandle) -> bool {
        super::await_within(h, self.wait, &mut self.rep)
    }

    fn write(
        &mut self,
        from_p1: bool,
        mut src: SlotLease<Reserved>,
        remote: &RemoteSlots,
        tags: &[Tag],
    ) -> Result<Option<TransferHandle>, RaceError> {
        fill_lease(&mut src, tags, self.cfg.slot_size)?;
        let t = if from_p1 { &self.rig.p1 } else { &self.rig.p0 };
        Ok(match block_on(t.write(src, remote, TransferOptions::default())) {
            Ok(h) => Some(h),
            Err(e) => {
                e.lease.release();
                None
            }
        })
    }

    fn round(&mut self) -> Result<(), RaceError> {
        let (cfg, k, size) = (self.cfg, self.cfg.slots_per_request, self.cfg.slot_size);
        let held = self.rng.chance(cfg.hold_rate) && self.rig.gate.hold();
        if held {
            self.rep.held_rounds += 1;
        }
        let mut firsts = Vec::with_capacity(cfg.round);
        for _ in 0..cfg.round {
            self.next_id += 1;
            let (id, doomed) = (self.next_id, self.rng.chance(cfg.abort_rate));
            let Ok(lease) = self.rig.dpool.reserve(k) else {
                self.rep.admission_rejected += 1;
                continue;
            };
            let (exposed, remote) = match self.rig.decode.expose(lease, self.rig.p0_peer) {
                Ok(x) => x,
                // Over RDMA: a slot revoked while exposed to prefill 0 is
                // not exposed to it again until its ack (it may retry).
                Err(e) if matches!(e.kind, kv_transfer_core::ExposeErrorKind::RetryShadow(_)) => {
                    e.lease.release();
                    self.rep.admission_rejected += 1;
                    continue;
                }
                Err(e) => return Err(step_err(e.kind)),
            };
            let src = self.rig.p0pool.reserve(k).map_err(|e| step_err(format!("prefill 0 reserve: {e}")))?;
            let handle = self.write(false, src, &remote, &tags_of(id, &remote))?;
            firsts.push(First { id, exposed: Some(exposed), remote, handle, doomed });
        }
        // The aborts, with the writes in flight (held: not even sent).
        let mut n_aborted = 0u64;
        for f in firsts.iter_mut().filter(|f| f.doomed) {
            drop(f.exposed.take());
            n_aborted += 1;
        }
        self.rep.aborted += n_aborted;
        self.rep.peak_quarantined = self.rep.peak_quarantined.max(self.rig.dpool.metrics().quarantined);
        // The aborted slots come back when their proof does (under `naive`:
        // at the adapter's first escalation step, on its control thread).
        // A held round's cannot come back before the gate opens: wait a
        // little, then next tenants take whatever is free; prefill 1's
        // bytes arrive and are awaited before the gate opens.
        let dpool = self.rig.dpool.clone();
        wait_until(RECLAIM_WAIT.min(self.wait), || dpool.metrics().quarantined == 0);
        let mut nexts = Vec::new();
        let mut posted = Vec::new();
        for _ in 0..n_aborted {
            self.next_id += 1;
            let id = self.next_id;
            let Ok(lease) = self.rig.dpool.reserve(k) else {
                self.rep.admission_rejected += 1;
                continue;
            };
            let (exposed, remote) = self.rig.decode.expose(lease, self.rig.p1_peer).map_err(|e| step_err(e.kind))?;
            let tags = tags_of(id, &remote);
            let src = self.rig.p1pool.reserve(k).map_err(|e| step_err(format!("prefill 1 reserve: {e}")))?;
            posted.push(self.write(true, src, &remote, &tags)?);
            let slots = remote.slots.iter().map(|s| s.slot.0).collect();
            nexts.push(Next { tags, exposed, written: false, slots });
        }
        for (n, h) in nexts.iter_mut().zip(posted) {
            n.written = h.is_some_and(|h| self.await_handle(h));
        }
        self.rig.gate.open();
        // Every prefill 0 operation reaches its terminal status (bounded).
        let mut written = Vec::with_capacity(firsts.len());
        for f in &mut firsts {
            let ok = match f.handle.take() {
                Some(h) => self.await_handle(h),
                None => false,
            };
            written.push(ok);
        }
        // A held round's doomed writes went out after the next tenants' bytes
        // had landed: those not in a next tenant's slot landed in memory no
        // tenant held (the hazard itself is counted at consume time).
        if held {
            let taken: std::collections::HashSet<u32> = nexts.iter().flat_map(|n| n.slots.iter().copied()).collect();
            for (f, ok) in firsts.iter().zip(&written) {
                if f.doomed && *ok {
                    let missed = f.remote.slots.iter().filter(|s| !taken.contains(&s.slot.0)).count();
                    self.rep.stale_writes_quarantined += missed as u64;
                }
            }
        }
        // Consumers read and check every byte of what was written.
        for (mut f, ok) in firsts.into_iter().zip(written) {
            let Some(exposed) = f.exposed.take() else {
                self.rep.requests += 1;
                continue;
            };
            self.consume(exposed, ok, &tags_of(f.id, &f.remote), size, false);
        }
        for n in nexts {
            self.rep.reassigned += 1;
            self.consume(n.exposed, n.written, &n.tags, size, true);
        }
        // The aborted slots come back with prefill 0's acks before the next
        // round (over RDMA: revoked, and their shadows cleared by the acks).
        let dpool = self.rig.dpool.clone();
        let decode = &self.rig.decode;
        if !wait_until(self.wait, || dpool.metrics().quarantined == 0 && decode.metrics().shadowed == 0) {
            self.rep.timeouts += 1;
        }
        Ok(())
    }

    /// A consumer: settles `exposed` and, if its transfer succeeded, checks
    /// every byte against `tags` (for a reassigned slot, foreign bytes are an
    /// old write that landed after the reassignment).
    fn consume(&mut self, exposed: SlotLease<Exposed>, written: bool, tags: &[Tag], size: usize, reassigned: bool) {
        match self.settle(exposed) {
            Some(settled) if written => {
                if reassigned {
                    self.rep.stale_writes_landed += slots_with_foreign_bytes(&settled, tags, size);
                }
                let c = check_lease(&settled, tags, size);
                record_consumed(&mut self.rep, c);
                settled.release();
            }
            Some(settled) => {
                self.rep.requests += 1;
                self.rep.transfer_failures += 1;
                settled.release();
            }
            None => self.rep.requests += 1,
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
    check_config(cfg)?;
    if wire != Wire::Tcp {
        // TCP stages device slots through host buffers; an RDMA NIC needs
        // them registered (dma-buf, a GPU).
        super::host_memory_only(cfg, "Mooncake RDMA")?;
    }
    let rig = Rig::start(cfg, wire)?;
    let mut run = Run {
        cfg,
        rig,
        rng: Rng::new(cfg.seed),
        rep: RaceReport { config: Some(cfg.clone()), ..RaceReport::default() },
        next_id: 0,
        wait: Duration::from_millis(cfg.timeout_ms.max(1)),
    };
    let elapsed = run_rounds(cfg, &mut run, progress)?;
    let Run { mut rep, rig, wait, .. } = run;
    rig.gate.open();
    finish_report(&mut rep, &rig.dpool, wait, elapsed);
    rep.stale_notifications = rig.dpool.metrics().stale_rejected;
    rep.naive_releases = Rig::counter(&rig.decode, "naive_releases");
    #[cfg(feature = "mooncake-rdma")]
    match (&rig.fabric, &rig.p0_rdma) {
        (Some(f), _) => rep.rejected_at_nic = f.stats().rejected_access,
        // On a device: the refusals prefill 0 saw (the target's NIC keeps
        // no count for us).
        (None, Some(t)) => rep.rejected_at_nic = t.refused_slices(),
        (None, None) => {}
    }
    drop(rig);
    Ok(rep)
}
