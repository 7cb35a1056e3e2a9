//! The race's one algorithm; a backend's rig ([`RaceRig`]) supplies only
//! what differs: how its NICs connect, how a round's writes are held, what
//! its exposures may refuse, and which of its counters the report carries.

use super::{
    check_lease, fill_lease, finish_report, record_consumed, stale_slots, step_err, tags_of, RaceConfig, RaceError,
    RaceReport, Rng,
};
use crate::payload::Tag;
use crate::wait::{poll_until, wait_until};
use backend_tcp_sim::block_on;
use kv_transfer_core::{
    Exposed, RemoteSlots, Reserved, Settled, SlotLease, SlotPool, Transfer, TransferHandle, TransferOptions,
};
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Which prefill worker a step concerns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Prefill {
    /// Prefill 0: writes the first tenants' bytes; a held round holds its writes.
    First,
    /// Prefill 1: writes (or, pulled, is read for) the next tenants' bytes.
    Next,
}

/// The race's three sides, connected, and their pools.
pub(crate) struct Sides<X> {
    /// The decode side.
    pub decode: X,
    /// Prefill 0 ([`Prefill::First`]).
    pub p0: X,
    /// Prefill 1 ([`Prefill::Next`]).
    pub p1: X,
    /// The decode side's pool, the one the race is about.
    pub dpool: SlotPool,
    /// Prefill 0's source pool.
    pub p0pool: SlotPool,
    /// Prefill 1's source pool.
    pub p1pool: SlotPool,
}

impl<X> Sides<X> {
    fn prefill(&self, p: Prefill) -> &X {
        match p {
            Prefill::First => &self.p0,
            Prefill::Next => &self.p1,
        }
    }
    fn source_pool(&self, p: Prefill) -> &SlotPool {
        match p {
            Prefill::First => &self.p0pool,
            Prefill::Next => &self.p1pool,
        }
    }
}

/// What one backend supplies to the race: its sides, connected, and the
/// few steps whose mechanism differs.
pub(crate) trait RaceRig {
    /// The backend's `Transfer` (decode and both prefill workers).
    type Xfer: Transfer;
    /// How long next tenants wait for a round's aborted slots before taking
    /// whatever is free; `None`: until they are back (bounded by the run's
    /// wait, a wait that gives up counted as a timeout). A backend whose
    /// held writes cannot end before [`release`](Self::release) (Mooncake
    /// over TCP cannot revoke) must not wait for them.
    const RECLAIM_WAIT: Option<Duration> = None;
    /// Whether a hold holds prefill 1's writes too (the simulator's gate is
    /// at the decode NIC): its pushed bytes then race the held writes when
    /// the gate opens, and are awaited only after.
    const HOLD_CATCHES_NEXT: bool = false;
    /// Whether decode may pull a next tenant's bytes (a READ from prefill 1).
    const CAN_PULL: bool = false;

    /// The sides.
    fn sides(&self) -> &Sides<Self::Xfer>;
    /// Exposes a decode lease to prefill `to`. `Ok(None)`: refused for now
    /// (the lease is released; the request counts as refused by admission).
    fn expose(
        &mut self,
        lease: SlotLease<Reserved>,
        to: Prefill,
        wait: Duration,
    ) -> Result<Option<(SlotLease<Exposed>, RemoteSlots)>, RaceError>;
    /// Exposes a prefill 1 source lease to decode, for a pull
    /// (only called where [`CAN_PULL`](Self::CAN_PULL)).
    fn expose_source(&mut self, src: SlotLease<Reserved>) -> Result<(SlotLease<Exposed>, RemoteSlots), RaceError> {
        src.release();
        Err(step_err("this backend's race does not pull"))
    }
    /// Starts holding this round's prefill 0 writes; false: cannot now.
    fn hold(&mut self) -> bool;
    /// A held round, between its kept and its doomed posts (verbs queues
    /// its blocker here).
    fn between_posts(&mut self, _wait: Duration) -> Result<(), RaceError> {
        Ok(())
    }
    /// A held round whose first posts are out: whether the hold has them
    /// (bounded by `wait`).
    fn holding(&self, _wait: Duration) -> bool {
        true
    }
    /// Lets whatever was held go, and ends what held it (every round, and
    /// once more at the end of the run).
    fn release(&mut self, _rep: &mut RaceReport, _wait: Duration) {}
    /// The end of a round: what the backend needs back before the next one
    /// (bounded by `wait`; false: it gave up).
    fn end_round(&self, _wait: Duration) -> bool {
        true
    }
    /// Fills the report's backend counters at the end of the run.
    fn finish(&self, rep: &mut RaceReport);
}

/// A first tenant: exposed to prefill 0, written by it.
struct First {
    id: u64,
    exposed: Option<SlotLease<Exposed>>,
    remote: RemoteSlots,
    /// `None`: the post was refused.
    handle: Option<TransferHandle>,
    doomed: bool,
    written: bool,
}

enum NextData {
    /// Pulled by decode (already settled, `None` if the READ failed);
    /// prefill 1's exposure settles on its notify.
    Pulled { lease: Option<SlotLease<Settled>>, source: SlotLease<Exposed> },
    /// Pushed by prefill 1.
    Pushed { exposed: SlotLease<Exposed>, handle: Option<TransferHandle>, written: bool },
}

/// A next tenant: slots reserved after a round's aborts.
struct Next {
    tags: Vec<Tag>,
    /// Its slots, to tell an old write that landed in memory no tenant held.
    slots: Vec<u32>,
    data: NextData,
}

struct Run<'a, R> {
    cfg: &'a RaceConfig,
    rig: R,
    rng: Rng,
    rep: RaceReport,
    next_id: u64,
    wait: Duration,
}

/// Runs the race on the rig `start` builds, calling `progress(done, total)`
/// after every round.
pub(crate) fn run<R: RaceRig>(
    cfg: &RaceConfig,
    start: impl FnOnce(&RaceConfig) -> Result<R, RaceError>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RaceReport, RaceError> {
    super::check_config(cfg)?;
    let mut run = Run {
        cfg,
        rig: start(cfg)?,
        rng: Rng::new(cfg.seed),
        rep: RaceReport { config: Some(cfg.clone()), ..RaceReport::default() },
        next_id: 0,
        wait: Duration::from_millis(cfg.timeout_ms.max(1)),
    };
    let t0 = Instant::now();
    // Bounded: each round serves or refuses `round` first tenants.
    let max_rounds = cfg.requests / cfg.round as u64 + 2;
    let mut rounds = 0;
    while run.rep.requests + run.rep.admission_rejected < cfg.requests && rounds < max_rounds {
        run.round()?;
        rounds += 1;
        progress(run.rep.requests.min(cfg.requests), cfg.requests);
    }
    let elapsed = t0.elapsed();
    let Run { mut rep, mut rig, wait, .. } = run;
    rig.release(&mut rep, wait);
    finish_report(&mut rep, &rig.sides().dpool, wait, elapsed);
    rig.finish(&mut rep);
    Ok(rep)
}

impl<R: RaceRig> Run<'_, R> {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn opts(&self) -> TransferOptions {
        TransferOptions::default().with_digest(self.cfg.digest)
    }

    /// Prefill `from` writes `tags`' payloads into `remote`; `None`: the
    /// post was refused (its source lease released).
    fn post(&mut self, from: Prefill, remote: &RemoteSlots, tags: &[Tag]) -> Result<Option<TransferHandle>, RaceError> {
        let k = self.cfg.slots_per_request;
        // A source lease whose handle was given up on (`await_within`) comes
        // back only when its operation ends, never before (on a lossy link
        // that can take a TCP retransmission or two): wait for it, bounded,
        // rather than fail the run on a pool sized without slack.
        let pool = self.rig.sides().source_pool(from).clone();
        let enough = || pool.metrics().free >= k as u64;
        if !enough() && !wait_until(self.wait, enough) {
            self.rep.timeouts += 1;
        }
        let mut src = pool.reserve(k).map_err(|e| step_err(format!("{from:?} reserve: {e}")))?;
        fill_lease(&mut src, tags, self.cfg.slot_size)?;
        Ok(match block_on(self.rig.sides().prefill(from).write(src, remote, self.opts())) {
            Ok(h) => Some(h),
            Err(e) => {
                e.lease.release();
                None
            }
        })
    }

    /// Waits for `h`; whether its operation succeeded.
    fn await_handle(&mut self, h: Option<TransferHandle>) -> bool {
        h.is_some_and(|h| super::await_within(h, self.wait, &mut self.rep))
    }

    fn round(&mut self) -> Result<(), RaceError> {
        let (cfg, k) = (self.cfg, self.cfg.slots_per_request);
        let held = self.rng.chance(cfg.hold_rate) && self.rig.hold();
        if held {
            self.rep.held_rounds += 1;
        }
        // First tenants: reserve, expose to prefill 0, which writes (in a
        // held round, once all are exposed: the kept requests first, then
        // the doomed ones, the backend's hold between them).
        let mut firsts = Vec::with_capacity(cfg.round);
        for _ in 0..cfg.round {
            let (id, doomed) = (self.id(), self.rng.chance(cfg.abort_rate));
            let Ok(lease) = self.rig.sides().dpool.reserve(k) else {
                self.rep.admission_rejected += 1;
                continue;
            };
            let Some((exposed, remote)) = self.rig.expose(lease, Prefill::First, self.wait)? else {
                self.rep.admission_rejected += 1;
                continue;
            };
            // Unheld, each write goes out as soon as its slots are exposed.
            let handle = if held { None } else { self.post(Prefill::First, &remote, &tags_of(id, &remote))? };
            firsts.push(First { id, exposed: Some(exposed), remote, handle, doomed, written: false });
        }
        if held {
            for doomed in [false, true] {
                if doomed {
                    self.rig.between_posts(self.wait)?;
                }
                for f in firsts.iter_mut().filter(|f| f.doomed == doomed) {
                    f.handle = self.post(Prefill::First, &f.remote, &tags_of(f.id, &f.remote))?;
                }
            }
        }
        if held && !firsts.is_empty() && !self.rig.holding(self.wait) {
            self.rep.timeouts += 1;
        }
        // The aborts, with the doomed writes in flight.
        let mut n_aborted = 0;
        for f in firsts.iter_mut().filter(|f| f.doomed) {
            drop(f.exposed.take());
            n_aborted += 1;
        }
        self.rep.aborted += n_aborted;
        self.rep.peak_quarantined = self.rep.peak_quarantined.max(self.rig.sides().dpool.metrics().quarantined);
        // Next tenants, once the aborted slots are back (under `safe` only
        // with a proof; the free list is LIFO, so they get the same slots).
        let mut nexts = Vec::new();
        if n_aborted > 0 {
            let dpool = self.rig.sides().dpool.clone();
            let back = || dpool.metrics().quarantined == 0;
            match R::RECLAIM_WAIT {
                None if !wait_until(self.wait, back) => self.rep.timeouts += 1,
                None => {}
                Some(d) => {
                    wait_until(d.min(self.wait), back);
                }
            }
            // One path per round: a pushed write held at the decode gate
            // would hold a pulled READ's response behind it.
            let pull = R::CAN_PULL && self.rng.chance(0.5);
            for _ in 0..n_aborted {
                if let Some(n) = self.next_tenant(pull)? {
                    nexts.push(n);
                }
            }
        }
        if !R::HOLD_CATCHES_NEXT {
            self.await_pushed(&mut nexts);
        }
        self.rig.release(&mut self.rep, self.wait);
        // Every prefill operation reaches its terminal status (bounded).
        for f in &mut firsts {
            f.written = self.await_handle(f.handle.take());
        }
        self.await_pushed(&mut nexts);
        // Under `safe`, a held round's doomed writes that succeeded in slots
        // no next tenant took landed while those slots were quarantined
        // (under `naive` they may have been free: not counted).
        if held && !cfg.policy.is_naive() {
            let taken: HashSet<u32> = nexts.iter().flat_map(|n| n.slots.iter().copied()).collect();
            for f in firsts.iter().filter(|f| f.doomed && f.written) {
                let missed = f.remote.slots.iter().filter(|s| !taken.contains(&s.slot.0)).count();
                self.rep.stale_writes_quarantined += missed as u64;
            }
        }
        // Consumers read and check every byte of what was written.
        for mut f in firsts {
            match f.exposed.take() {
                Some(exposed) => self.consume(exposed, f.written, &tags_of(f.id, &f.remote), false),
                None => self.rep.requests += 1,
            }
        }
        for n in nexts {
            self.rep.reassigned += 1;
            match n.data {
                NextData::Pulled { lease, source } => {
                    match lease {
                        Some(l) => self.check(l, &n.tags, true),
                        None => {
                            self.rep.requests += 1;
                            self.rep.transfer_failures += 1;
                        }
                    }
                    if let Some(s) = super::settle_within(source, self.wait, &mut self.rep) {
                        s.release();
                    }
                }
                NextData::Pushed { exposed, written, .. } => self.consume(exposed, written, &n.tags, true),
            }
        }
        if !self.rig.end_round(self.wait) {
            self.rep.timeouts += 1;
        }
        Ok(())
    }

    /// Awaits the next tenants' pushed writes not awaited yet.
    fn await_pushed(&mut self, nexts: &mut [Next]) {
        for n in nexts {
            if let NextData::Pushed { handle, written, .. } = &mut n.data {
                if let Some(h) = handle.take() {
                    *written = super::await_within(h, self.wait, &mut self.rep);
                }
            }
        }
    }

    /// A next tenant: reserves decode slots and gets its bytes from prefill
    /// 1, pulled (a READ by decode, awaited here) or pushed (a WRITE,
    /// awaited with the round's). `None`: refused by admission.
    fn next_tenant(&mut self, pull: bool) -> Result<Option<Next>, RaceError> {
        let (k, size) = (self.cfg.slots_per_request, self.cfg.slot_size);
        let id = self.id();
        let Ok(lease) = self.rig.sides().dpool.reserve(k) else {
            self.rep.admission_rejected += 1;
            return Ok(None);
        };
        if pull {
            let tags: Vec<Tag> = lease.tenancies().iter().map(|t| Tag::new(id, t.slot.0, t.generation.0)).collect();
            let slots = lease.tenancies().iter().map(|t| t.slot.0).collect();
            let mut src = self.rig.sides().source_pool(Prefill::Next).reserve(k).map_err(step_err)?;
            fill_lease(&mut src, &tags, size)?;
            let (source, sremote) = self.rig.expose_source(src)?;
            let settled = match block_on(self.rig.sides().decode.read(lease, &sremote, self.opts())) {
                Ok(mut h) => match poll_until(std::pin::Pin::new(&mut h), self.wait) {
                    Some(Ok(out)) if out.result.is_ok() => Some(out.lease),
                    Some(Ok(out)) => {
                        out.lease.release();
                        None
                    }
                    _ => {
                        self.rep.timeouts += 1;
                        None
                    }
                },
                Err(e) => {
                    e.lease.release();
                    None
                }
            };
            return Ok(Some(Next { tags, slots, data: NextData::Pulled { lease: settled, source } }));
        }
        let Some((exposed, remote)) = self.rig.expose(lease, Prefill::Next, self.wait)? else {
            self.rep.admission_rejected += 1;
            return Ok(None);
        };
        let tags = tags_of(id, &remote);
        let handle = self.post(Prefill::Next, &remote, &tags)?;
        let slots = remote.slots.iter().map(|s| s.slot.0).collect();
        Ok(Some(Next { tags, slots, data: NextData::Pushed { exposed, handle, written: false } }))
    }

    /// A consumer: settles `exposed` and, if its transfer succeeded, checks
    /// every byte against `tags`.
    fn consume(&mut self, exposed: SlotLease<Exposed>, written: bool, tags: &[Tag], reassigned: bool) {
        match super::settle_within(exposed, self.wait, &mut self.rep) {
            Some(settled) if written => self.check(settled, tags, reassigned),
            Some(settled) => {
                // Not data: a serving engine retries a failed transfer.
                self.rep.requests += 1;
                self.rep.transfer_failures += 1;
                settled.release();
            }
            None => self.rep.requests += 1,
        }
    }

    /// Checks a settled lease's bytes against `tags` and releases it. In a
    /// reassigned slot, bytes of another request (or bytes changed after
    /// their digest) are an old write that landed after the reassignment.
    fn check(&mut self, settled: SlotLease<Settled>, tags: &[Tag], reassigned: bool) {
        let size = self.cfg.slot_size;
        if reassigned {
            self.rep.stale_writes_landed += stale_slots(&settled, tags, size);
        }
        let c = check_lease(&settled, tags, size);
        record_consumed(&mut self.rep, c);
        settled.release();
    }
}
