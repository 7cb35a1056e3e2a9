//! Random operation sequences against a small reference model.
//!
//! Invariants after every step: free + leased + quarantined = capacity (and
//! the pool's own consistency check); a slot whose exposure has no proof is
//! never free; generations only grow; the pool's free and quarantined counts
//! equal the model's.
#![cfg(not(loom))]

use kv_transfer_core::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

const CAP: usize = 6;

#[derive(Clone, Debug)]
enum Step {
    Reserve(usize),
    Expose(usize, u32),
    Abort(usize),
    Complete(usize),
    Revoke(usize),
    Fence(u32),
    TrySettle(usize),
    /// The backend completes the lease's own operation: settle with a proof of exactly its tenancies.
    SettleOwn(usize),
    Release(usize),
    Escalate(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0..=CAP + 1).prop_map(Step::Reserve),
        3 => (0..8usize, 0..3u32).prop_map(|(i, p)| Step::Expose(i, p)),
        2 => (0..8usize).prop_map(Step::Abort),
        3 => (0..32usize).prop_map(Step::Complete),
        1 => (0..32usize).prop_map(Step::Revoke),
        1 => (0..3u32).prop_map(Step::Fence),
        2 => (0..8usize).prop_map(Step::TrySettle),
        2 => (0..8usize).prop_map(Step::SettleOwn),
        2 => (0..8usize).prop_map(Step::Release),
        1 => (0..50u64).prop_map(Step::Escalate),
    ]
}

enum Held {
    Reserved(SlotLease<Reserved>),
    Exposed(SlotLease<Exposed>, u32),
    Settled(SlotLease<Settled>),
}

#[derive(Default)]
struct Model {
    /// Tenancies exposed and not yet proven, with their peer, live or quarantined.
    unproven: HashMap<Tenancy, u32>,
    /// Of those, the ones whose lease was aborted.
    quarantined: HashSet<Tenancy>,
    /// Every tenancy ever exposed, to pick proofs (including stale ones) from.
    history: Vec<Tenancy>,
    leased_slots: usize,
    max_generation: HashMap<SlotId, u64>,
}

impl Model {
    fn free(&self) -> usize {
        CAP - self.leased_slots - self.quarantined.len()
    }
    /// A proof arrived for `t`: a live exposure becomes proven, a quarantined slot free.
    fn prove(&mut self, t: Tenancy) {
        if self.unproven.remove(&t).is_some() {
            self.quarantined.remove(&t);
        }
    }
}

fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let clock = Arc::new(ManualClock::new());
    let region = Arc::new(HostRegion::new(CAP * 64).unwrap());
    let ladder = EscalationLadder {
        drain: Duration::from_millis(5),
        revoke: Duration::from_millis(5),
        fence: Duration::from_millis(5),
    };
    let (pool, authority) =
        SlotPool::new(region, PoolConfig::new(64).with_ladder(ladder).with_clock(clock.clone())).unwrap();
    let mut held: Vec<Held> = Vec::new();
    let mut m = Model::default();

    for s in steps {
        match s {
            Step::Reserve(n) => {
                let expect_ok = n >= 1 && n <= m.free();
                match pool.reserve(n) {
                    Ok(lease) => {
                        prop_assert!(expect_ok, "reserve({n}) succeeded with {} free in the model", m.free());
                        for t in lease.tenancies() {
                            let last = m.max_generation.insert(t.slot, t.generation.0).unwrap_or(0);
                            prop_assert!(t.generation.0 > last, "generation did not grow");
                        }
                        m.leased_slots += n;
                        held.push(Held::Reserved(lease));
                    }
                    Err(e) => {
                        prop_assert!(!expect_ok, "reserve({n}) refused ({e}) with {} free", m.free());
                    }
                }
            }
            Step::Expose(i, peer) => {
                if i < held.len() {
                    if let Held::Reserved(_) = &held[i] {
                        let Held::Reserved(lease) = held.remove(i) else { unreachable!() };
                        let (exposed, remote) = authority.expose(lease, PeerId(peer), 1, "m", Default::default());
                        for t in remote.tenancies() {
                            m.unproven.insert(t, peer);
                            m.history.push(t);
                        }
                        held.push(Held::Exposed(exposed, peer));
                    }
                }
            }
            Step::Abort(i) => {
                if i < held.len() {
                    if let Held::Exposed(..) = &held[i] {
                        let Held::Exposed(lease, _) = held.remove(i) else { unreachable!() };
                        m.leased_slots -= lease.len();
                        for t in lease.tenancies() {
                            if m.unproven.contains_key(t) {
                                m.quarantined.insert(*t);
                            }
                        }
                        lease.abort();
                    }
                }
            }
            Step::Complete(k) | Step::Revoke(k) => {
                if let Some(&t) = m.history.get(k % m.history.len().max(1)) {
                    let proof: Settlement = match s {
                        Step::Complete(_) => authority.completed(&[t]).into(),
                        _ => authority.revoked(&[t]).into(),
                    };
                    let was_waiting = m.unproven.contains_key(&t);
                    let r = authority.deliver(proof);
                    prop_assert_eq!(r.settled, usize::from(was_waiting));
                    prop_assert_eq!(r.stale, usize::from(!was_waiting));
                    m.prove(t);
                }
            }
            Step::Fence(peer) => {
                let hit: Vec<Tenancy> = m.unproven.iter().filter(|(_, p)| **p == peer).map(|(t, _)| *t).collect();
                let r = authority.deliver(authority.fenced(PeerId(peer)));
                prop_assert_eq!(r.settled, hit.len());
                for t in hit {
                    m.prove(t);
                }
            }
            Step::TrySettle(i) => {
                if i < held.len() {
                    if let Held::Exposed(..) = &held[i] {
                        let Held::Exposed(lease, peer) = held.remove(i) else { unreachable!() };
                        let expect = lease.tenancies().iter().all(|t| !m.unproven.contains_key(t));
                        match lease.try_settled() {
                            Ok(settled) => {
                                prop_assert!(expect, "settled without proofs");
                                held.push(Held::Settled(settled));
                            }
                            Err(lease) => {
                                prop_assert!(!expect, "proven lease did not settle");
                                held.push(Held::Exposed(lease, peer));
                            }
                        }
                    }
                }
            }
            Step::SettleOwn(i) => {
                if i < held.len() {
                    if let Held::Exposed(..) = &held[i] {
                        let Held::Exposed(lease, _) = held.remove(i) else { unreachable!() };
                        let proof = authority.completed_lease(&lease);
                        match lease.settle(proof) {
                            Ok(settled) => {
                                for t in settled.tenancies() {
                                    m.prove(*t);
                                }
                                held.push(Held::Settled(settled));
                            }
                            Err(e) => return Err(TestCaseError::fail(format!("own proof refused: {}", e.reason))),
                        }
                    }
                }
            }
            Step::Release(i) => {
                if i < held.len() {
                    match held.remove(i) {
                        Held::Reserved(l) => {
                            m.leased_slots -= l.len();
                            l.release();
                        }
                        Held::Settled(l) => {
                            m.leased_slots -= l.len();
                            l.release();
                        }
                        other => held.push(other),
                    }
                }
            }
            Step::Escalate(ms) => {
                clock.advance(Duration::from_millis(ms));
                for a in authority.poll_escalations() {
                    for t in &a.tenancies {
                        prop_assert!(m.quarantined.contains(t), "escalation for a slot not in quarantine");
                    }
                }
            }
        }

        // Invariants.
        if let Err(e) = pool.check_invariants() {
            return Err(TestCaseError::fail(e));
        }
        let snap = pool.metrics();
        prop_assert_eq!(snap.free as usize, m.free());
        prop_assert_eq!(snap.quarantined as usize, m.quarantined.len());
        prop_assert_eq!(snap.free + snap.leased + snap.quarantined, CAP as u64);
        for t in m.unproven.keys() {
            prop_assert!(!pool.slot_is_free(t.slot), "slot {:?} free while exposed without proof", t.slot);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn pool_matches_model(steps in proptest::collection::vec(step(), 1..60)) {
        run(steps)?;
    }
}
