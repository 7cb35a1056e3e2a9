//! The race on the TCP simulator: one decode NIC with a pool, two prefill
//! NICs on loopback (separate [`SimNic`]s, separate connections).
//!
//! A held round holds every incoming WRITE at the decode NIC's [`Gate`]
//! (prefill 1's pushed bytes too: they race the held writes when it opens).
//! Prefill 0 delays each WR by a seeded amount up to
//! [`RaceConfig::delay_max_us`]. Decode may pull a next tenant's bytes (a
//! READ, which lands before the gate opens). A stale write under `safe` is
//! refused at the decode NIC (stale generation); a connection the ladder
//! fences is dialled again, as a serving engine would.

use super::run::{Prefill, RaceRig, Sides};
use super::{race_ladder, setup_err, step_err, RaceConfig, RaceError, RaceReport};
use crate::wait::wait_until;
use backend_tcp_sim::{splitmix64, DelayDist, FaultPlan, Gate, NicConfig, SimNic};
use kv_transfer_core::{EscalationLadder, Exposed, PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotPool};
use std::time::Duration;

struct SimRig {
    sides: Sides<SimNic>,
    gate: Gate,
    /// Prefill 0 as decode numbers it (a new one after a fence).
    p0_peer: PeerId,
    /// Prefill 1 as decode numbers it.
    p1_peer: PeerId,
    /// Decode as prefill 1 numbers it.
    decode_at_p1: PeerId,
    p0name: String,
    reconnects: u64,
}

fn pool(nic: &SimNic, cfg: &RaceConfig, slots: usize, ladder: EscalationLadder) -> Result<SlotPool, RaceError> {
    let region = super::pool_region(cfg.memory, slots, cfg.slot_size)?;
    nic.register_pool(region, PoolConfig::new(cfg.slot_size).with_ladder(ladder)).map_err(setup_err)
}

impl SimRig {
    fn start(cfg: &RaceConfig) -> Result<Self, RaceError> {
        let gate = Gate::new();
        let k = cfg.slots_per_request;
        let ladder = race_ladder(cfg);
        let tag = splitmix64(cfg.seed) % 1_000_000;
        let dname = format!("race-decode-{tag}");
        let decode = SimNic::start(NicConfig::new(dname.clone()).with_policy(cfg.policy).with_faults(FaultPlan {
            seed: cfg.seed,
            gate: Some(gate.clone()),
            ..FaultPlan::default()
        }))
        .map_err(setup_err)?;
        let dpool = pool(&decode, cfg, cfg.round * k * 2, ladder)?;
        let delay = if cfg.delay_max_us == 0 {
            DelayDist::None
        } else {
            DelayDist::Uniform { min_us: 0, max_us: cfg.delay_max_us }
        };
        let p0name = format!("race-prefill0-{tag}");
        let p0 = SimNic::start(NicConfig::new(p0name.clone()).with_faults(FaultPlan {
            seed: cfg.seed,
            delay,
            ..FaultPlan::default()
        }))
        .map_err(setup_err)?;
        let p0pool = pool(&p0, cfg, cfg.round * k, EscalationLadder::default())?;
        let p1 = SimNic::start(NicConfig::new(format!("race-prefill1-{tag}"))).map_err(setup_err)?;
        let p1pool = pool(&p1, cfg, cfg.round * k * 2, ladder)?;
        p0.connect(decode.endpoint()).map_err(setup_err)?;
        let wait = Duration::from_millis(cfg.timeout_ms);
        let p0_peer = decode.wait_for_peer(&p0name, wait).ok_or_else(|| setup_err("prefill 0 did not connect"))?;
        let p1_peer = decode.connect(p1.endpoint()).map_err(setup_err)?;
        let decode_at_p1 = p1.wait_for_peer(&dname, wait).ok_or_else(|| setup_err("decode did not reach prefill 1"))?;
        let sides = Sides { decode, p0, p1, dpool, p0pool, p1pool };
        Ok(Self { sides, gate, p0_peer, p1_peer, decode_at_p1, p0name, reconnects: 0 })
    }

    /// Prefill 0 dials again after a fence; decode's new peer for it.
    fn reconnect_p0(&mut self, wait: Duration) -> Result<(), RaceError> {
        self.sides.p0.connect_new(self.sides.decode.endpoint()).map_err(setup_err)?;
        let ok = wait_until(wait, || {
            self.sides.decode.peers().iter().any(|p| p.name == self.p0name && p.peer != self.p0_peer)
        });
        let peer = self.sides.decode.peers().into_iter().filter(|p| p.name == self.p0name).map(|p| p.peer).max();
        match peer {
            Some(p) if ok => {
                self.p0_peer = p;
                self.reconnects += 1;
                Ok(())
            }
            _ => Err(setup_err("prefill 0 could not reconnect")),
        }
    }
}

impl RaceRig for SimRig {
    type Xfer = SimNic;
    const HOLD_CATCHES_NEXT: bool = true;
    const CAN_PULL: bool = true;

    fn sides(&self) -> &Sides<Self::Xfer> {
        &self.sides
    }

    fn expose(
        &mut self,
        lease: SlotLease<Reserved>,
        to: Prefill,
        wait: Duration,
    ) -> Result<Option<(SlotLease<Exposed>, RemoteSlots)>, RaceError> {
        if to == Prefill::Next {
            return self.sides.decode.expose(lease, self.p1_peer).map(Some).map_err(|e| step_err(e.kind));
        }
        match self.sides.decode.expose(lease, self.p0_peer) {
            Ok(x) => Ok(Some(x)),
            // The connection was fenced (the ladder's last step): dial
            // again, as a serving engine would, and go on.
            Err(e) => {
                self.reconnect_p0(wait)?;
                self.sides
                    .decode
                    .expose(e.lease, self.p0_peer)
                    .map(Some)
                    .map_err(|e| step_err(format!("{} (decode NIC: {:?})", e.kind, self.sides.decode.stats())))
            }
        }
    }

    fn expose_source(&mut self, src: SlotLease<Reserved>) -> Result<(SlotLease<Exposed>, RemoteSlots), RaceError> {
        self.sides.p1.expose(src, self.decode_at_p1).map_err(|e| step_err(e.kind))
    }

    fn hold(&mut self) -> bool {
        self.gate.hold();
        true
    }
    fn holding(&self, wait: Duration) -> bool {
        self.gate.wait_for_waiting(1, wait)
    }
    fn release(&mut self, _rep: &mut RaceReport, _wait: Duration) {
        self.gate.open();
    }

    fn finish(&self, rep: &mut RaceReport) {
        let s = self.sides.decode.stats();
        rep.rejected_at_nic = s.rejected_stale_generation + s.rejected_wrong_peer;
        rep.stale_notifications = s.notifications_stale;
        rep.naive_releases = s.naive_releases;
        rep.fences = s.fences;
        rep.reconnects = self.reconnects;
    }
}

/// Runs the race on the TCP simulator and reports what consumers found.
/// `progress(done, total)` is called after every round.
///
/// ```
/// use kv_transfer_examples::race::{run_race, RaceConfig};
/// use backend_tcp_sim::ReleasePolicy;
/// let cfg = RaceConfig { requests: 64, policy: ReleasePolicy::Safe, ..RaceConfig::default() };
/// let r = run_race(&cfg, &mut |_, _| {}).unwrap();
/// assert_eq!(r.foreign_requests, 0);
/// assert!(r.pool_whole());
/// ```
pub fn run_race(cfg: &RaceConfig, progress: &mut dyn FnMut(u64, u64)) -> Result<RaceReport, RaceError> {
    super::run::run(cfg, SimRig::start, progress)
}
