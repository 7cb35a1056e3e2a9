//! The contract's rules, one test each where a test can state them. Each
//! test is named `ruleN_...` after the rule of `docs/DESIGN.md` it proves.

use futures::executor::block_on;
use futures::FutureExt;
use kv_transfer_core::*;
use std::sync::Arc;
use std::time::Duration;

const SLOT: usize = 256;

fn pool_with(capacity: usize, clock: Arc<ManualClock>) -> (SlotPool, SettlementAuthority) {
    let region = Arc::new(HostRegion::new(capacity * SLOT).unwrap());
    let ladder = EscalationLadder {
        drain: Duration::from_millis(10),
        revoke: Duration::from_millis(10),
        fence: Duration::from_millis(10),
    };
    SlotPool::new(region, PoolConfig::new(SLOT).with_ladder(ladder).with_clock(clock)).unwrap()
}

fn pool(capacity: usize) -> (SlotPool, SettlementAuthority) {
    pool_with(capacity, Arc::new(ManualClock::new()))
}

#[test]
fn rule5_generations_grow_on_every_lease() {
    let (pool, _a) = pool(1);
    let mut last = 0;
    for _ in 0..5 {
        let lease = pool.reserve(1).unwrap();
        let g = lease.tenancies()[0].generation.0;
        assert!(g > last, "generation {g} did not grow past {last}");
        last = g;
        lease.release();
    }
}

#[test]
fn rule6_admission_is_all_or_nothing_and_typed() {
    let (pool, _a) = pool(4);
    let held = pool.reserve(3).unwrap();
    assert_eq!(pool.reserve(2).unwrap_err(), AdmissionError::OverCapacity { requested: 2, available: 1 });
    assert_eq!(pool.reserve(5).unwrap_err(), AdmissionError::TooLarge { requested: 5, capacity: 4 });
    assert_eq!(pool.reserve(0).unwrap_err(), AdmissionError::Empty);
    // The refusals took nothing.
    assert_eq!(pool.metrics().free, 1);
    assert_eq!(pool.metrics().admission_rejected, 3);
    drop(held);
    assert_eq!(pool.metrics().free, 4);
    pool.check_invariants().unwrap();
}

// ----- reserve_slots: the caller names the slots (an engine's own page allocator) -----

fn slots_of(lease: &SlotLease<Reserved>) -> Vec<SlotId> {
    lease.tenancies().iter().map(|t| t.slot).collect()
}

#[test]
fn rule6_reserve_slots_is_all_or_nothing_and_names_the_busy_slot() {
    let (pool, authority) = pool(4);
    // Slot 2 exposed, then aborted: quarantined until a proof.
    let lease = pool.reserve_slots(&[SlotId(2)]).unwrap();
    assert_eq!(lease.tenancies(), [Tenancy::new(SlotId(2), Generation(1))]);
    let (exposed, remote) = authority.expose(lease, PeerId(7), 1, "t", Default::default());
    exposed.abort();
    assert_eq!(pool.metrics().quarantined, 1);

    let request = [SlotId(0), SlotId(2), SlotId(3)];
    assert_eq!(
        pool.reserve_slots(&request).unwrap_err(),
        AdmissionError::SlotBusy { slot: SlotId(2), quarantined: true }
    );
    // Nothing was taken: the free slots named before and after it are still free.
    let m = pool.metrics();
    assert_eq!((m.free, m.leased, m.quarantined, m.leases, m.admission_rejected), (3, 0, 1, 1, 1));
    assert!(pool.slot_is_free(SlotId(0)) && pool.slot_is_free(SlotId(3)));
    assert_eq!(pool.generation(SlotId(0)), Some(Generation(0)));
    pool.check_invariants().unwrap();

    // A leased slot, and a live exposure, are busy but not quarantined.
    let held = pool.reserve_slots(&[SlotId(1)]).unwrap();
    assert_eq!(
        pool.reserve_slots(&[SlotId(3), SlotId(1)]).unwrap_err(),
        AdmissionError::SlotBusy { slot: SlotId(1), quarantined: false }
    );
    let live = authority.expose_local(held, PeerId(7));
    assert_eq!(
        pool.reserve_slots(&[SlotId(1)]).unwrap_err(),
        AdmissionError::SlotBusy { slot: SlotId(1), quarantined: false }
    );
    assert_eq!(pool.metrics().free, 2);
    live.abort();

    // Once the proof is delivered the same call succeeds, in the order
    // given, and slot 2 is under a generation one higher.
    authority.deliver(authority.completed(&remote.tenancies()));
    let lease = pool.reserve_slots(&request).unwrap();
    assert_eq!(slots_of(&lease), request);
    assert_eq!(lease.tenancies()[1].generation, Generation(remote.tenancies()[0].generation.0 + 1));
    assert_eq!(lease.tenancies()[0].generation, Generation(1));
    let m = pool.metrics();
    assert_eq!((m.free, m.leased, m.quarantined), (0, 3, 1));
    pool.check_invariants().unwrap();
    lease.release();
    assert_eq!(pool.metrics().free, 3);
    pool.check_invariants().unwrap();
}

#[test]
fn rule6_reserve_slots_refuses_unknown_and_duplicate_slots() {
    let (pool, _a) = pool(4);
    assert_eq!(pool.reserve_slots(&[]).unwrap_err(), AdmissionError::Empty);
    assert_eq!(
        pool.reserve_slots(&[SlotId(1), SlotId(4)]).unwrap_err(),
        AdmissionError::NoSuchSlot { slot: SlotId(4), capacity: 4 }
    );
    assert_eq!(
        pool.reserve_slots(&[SlotId(u32::MAX)]).unwrap_err(),
        AdmissionError::NoSuchSlot { slot: SlotId(u32::MAX), capacity: 4 }
    );
    assert_eq!(
        pool.reserve_slots(&[SlotId(0), SlotId(1), SlotId(0)]).unwrap_err(),
        AdmissionError::DuplicateSlot { slot: SlotId(0) }
    );
    // The first offending slot, in the order given, is the one named.
    assert_eq!(
        pool.reserve_slots(&[SlotId(1), SlotId(1), SlotId(9)]).unwrap_err(),
        AdmissionError::DuplicateSlot { slot: SlotId(1) }
    );
    assert_eq!(
        pool.reserve_slots(&[SlotId(9), SlotId(1), SlotId(1)]).unwrap_err(),
        AdmissionError::NoSuchSlot { slot: SlotId(9), capacity: 4 }
    );
    // More slots than the pool has: some must repeat.
    assert_eq!(
        pool.reserve_slots(&[SlotId(0), SlotId(1), SlotId(2), SlotId(3), SlotId(2)]).unwrap_err(),
        AdmissionError::DuplicateSlot { slot: SlotId(2) }
    );
    let e = AdmissionError::DuplicateSlot { slot: SlotId(3) }.to_string();
    assert!(e.contains("slot 3") && e.contains("twice"), "{e}");
    let e = AdmissionError::SlotBusy { slot: SlotId(3), quarantined: true }.to_string();
    assert!(e.contains("slot 3") && e.contains("quarantined"), "{e}");

    // The refusals took nothing, were counted, and left the free list as it
    // was: `reserve` still hands out slot 0 first.
    let m = pool.metrics();
    assert_eq!((m.free, m.leased, m.leases, m.admission_rejected), (4, 0, 0, 7));
    pool.check_invariants().unwrap();
    for s in 0..4 {
        assert_eq!(pool.generation(SlotId(s)), Some(Generation(0)));
    }
    let all = pool.reserve(4).unwrap();
    assert_eq!(slots_of(&all), [SlotId(0), SlotId(1), SlotId(2), SlotId(3)]);
}

/// What the model below holds for one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Model {
    Free,
    Held,
    Quarantined,
}

#[test]
fn rule6_reserve_and_reserve_slots_interleaved_never_lease_a_slot_twice() {
    const CAP: usize = 16;
    let (pool, authority) = pool(CAP);
    // A fixed linear congruential generator: deterministic and bounded.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |bound: usize| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) as usize) % bound
    };
    let mut model = [Model::Free; CAP];
    let mut last_gen = [0u64; CAP];
    let mut leases: Vec<SlotLease<Reserved>> = Vec::new();
    let mut pending: Vec<Vec<Tenancy>> = Vec::new();
    let (mut granted_named, mut refused_named) = (0, 0);

    for step in 0..2_000 {
        let mut granted = None;
        match next(6) {
            0 => {
                let n = 1 + next(4);
                let free = model.iter().filter(|m| **m == Model::Free).count();
                match pool.reserve(n) {
                    Ok(lease) => granted = Some(lease),
                    Err(e) => {
                        assert!(n > free, "step {step}: reserve({n}) refused with {free} free: {e}");
                        assert_eq!(e, AdmissionError::OverCapacity { requested: n, available: free });
                    }
                }
            }
            1 | 2 => {
                // Mostly valid requests, sometimes naming a busy, repeated or unknown slot.
                let request: Vec<SlotId> = (0..1 + next(4)).map(|_| SlotId(next(CAP + 1) as u32)).collect();
                let mut seen = [false; CAP + 1];
                let expected = request.iter().find_map(|&s| {
                    let i = s.0 as usize;
                    let e = if i >= CAP {
                        Some(AdmissionError::NoSuchSlot { slot: s, capacity: CAP })
                    } else if seen[i] {
                        Some(AdmissionError::DuplicateSlot { slot: s })
                    } else if model[i] != Model::Free {
                        Some(AdmissionError::SlotBusy { slot: s, quarantined: model[i] == Model::Quarantined })
                    } else {
                        None
                    };
                    seen[i] = true;
                    e
                });
                match (pool.reserve_slots(&request), expected) {
                    (Ok(lease), None) => {
                        assert_eq!(slots_of(&lease), request, "step {step}: tenancies out of order");
                        granted_named += 1;
                        granted = Some(lease);
                    }
                    (Err(e), Some(want)) => {
                        assert_eq!(e, want, "step {step}: {request:?}");
                        refused_named += 1;
                    }
                    (got, want) => panic!(
                        "step {step}: {request:?}: got {:?}, expected {want:?}",
                        got.map(|l| l.tenancies().to_vec())
                    ),
                }
            }
            3 if !leases.is_empty() => {
                let lease = leases.swap_remove(next(leases.len()));
                for t in lease.tenancies() {
                    model[t.slot.0 as usize] = Model::Free;
                }
                lease.release();
            }
            4 if !leases.is_empty() => {
                let lease = leases.swap_remove(next(leases.len()));
                let (exposed, remote) = authority.expose(lease, PeerId(1), 1, "t", Default::default());
                exposed.abort();
                for t in remote.tenancies() {
                    model[t.slot.0 as usize] = Model::Quarantined;
                }
                pending.push(remote.tenancies());
            }
            5 if !pending.is_empty() => {
                let ts = pending.swap_remove(next(pending.len()));
                let r = authority.deliver(authority.completed(&ts));
                assert_eq!(r.reclaimed, ts.len());
                for t in ts {
                    model[t.slot.0 as usize] = Model::Free;
                }
            }
            _ => {}
        }
        if let Some(lease) = granted {
            for t in lease.tenancies() {
                let i = t.slot.0 as usize;
                assert_eq!(model[i], Model::Free, "step {step}: slot {i} leased while not free");
                assert!(t.generation.0 > last_gen[i], "step {step}: slot {i} reused generation {}", t.generation.0);
                last_gen[i] = t.generation.0;
                model[i] = Model::Held;
            }
            leases.push(lease);
        }

        pool.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        // Every slot is held by at most one lease or quarantine, and the pool agrees with the model.
        let mut owners = [0u32; CAP];
        for t in leases.iter().flat_map(|l| l.tenancies()).chain(pending.iter().flatten()) {
            owners[t.slot.0 as usize] += 1;
        }
        for i in 0..CAP {
            assert_eq!(owners[i], u32::from(model[i] != Model::Free), "step {step}: slot {i}");
            assert_eq!(pool.slot_is_free(SlotId(i as u32)), model[i] == Model::Free, "step {step}: slot {i}");
        }
        let m = pool.metrics();
        let count = |s: Model| model.iter().filter(|m| **m == s).count() as u64;
        assert_eq!(
            (m.free, m.leased, m.quarantined),
            (count(Model::Free), count(Model::Held), count(Model::Quarantined))
        );
    }
    assert!(granted_named > 100 && refused_named > 100, "{granted_named} granted, {refused_named} refused");
}

#[test]
fn rule1_an_aborted_exposure_stays_quarantined_until_a_proof() {
    let (pool, authority) = pool(2);
    let (exposed, remote) = authority.expose(pool.reserve(2).unwrap(), PeerId(9), 1, "t", Default::default());
    exposed.abort();
    let m = pool.metrics();
    assert_eq!((m.free, m.quarantined, m.quarantined_total), (0, 2, 2));
    assert!(matches!(pool.reserve(1), Err(AdmissionError::OverCapacity { .. })));
    // Half a proof frees half.
    let ts = remote.tenancies();
    let r = authority.deliver(authority.completed(&ts[..1]));
    assert_eq!((r.settled, r.reclaimed, r.stale), (1, 1, 0));
    assert_eq!(pool.metrics().free, 1);
    authority.deliver(authority.revoked(&ts[1..]));
    let m = pool.metrics();
    assert_eq!((m.free, m.quarantined, m.settled_completed, m.settled_revoked), (2, 0, 1, 1));
    assert_eq!(m.abort_to_reclaim.count, 1);
    pool.check_invariants().unwrap();
}

#[test]
fn rule4_dropping_an_exposed_lease_is_an_abort_not_a_release() {
    let (pool, authority) = pool(1);
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    drop(exposed);
    assert_eq!(pool.metrics().free, 0);
    assert_eq!(pool.metrics().quarantined, 1);
    authority.deliver(authority.completed(&remote.tenancies()));
    assert_eq!(pool.metrics().free, 1);
}

#[test]
fn rule4_forgetting_an_exposed_lease_leaks_but_never_frees() {
    let (pool, authority) = pool(1);
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    std::mem::forget(exposed);
    assert_eq!(pool.metrics().free, 0);
    // A proof for a forgotten live exposure marks it proven; the slot stays
    // with the (leaked) lease, so it is still not free: a leak, not a reuse.
    authority.deliver(authority.completed(&remote.tenancies()));
    assert_eq!(pool.metrics().free, 0);
    assert!(pool.reserve(1).is_err());
}

#[test]
fn rule2_a_timer_never_frees_it_only_escalates() {
    let clock = Arc::new(ManualClock::new());
    let (pool, authority) = pool_with(1, clock.clone());
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(3), 1, "t", Default::default());
    exposed.abort();
    let mut steps = Vec::new();
    for _ in 0..10 {
        for a in authority.poll_escalations() {
            assert_eq!(a.peer, PeerId(3));
            assert_eq!(a.tenancies, remote.tenancies());
            steps.push(a.step);
        }
        clock.advance(Duration::from_millis(7));
        assert_eq!(pool.metrics().free, 0, "a deadline freed a quarantined slot");
    }
    // The ladder, then (exhausted) the ABORT asked for again: never a free.
    assert_eq!(
        steps[..4],
        [EscalationStep::RequestDrain, EscalationStep::Revoke, EscalationStep::Fence, EscalationStep::Exhausted]
    );
    assert!(steps[4..].iter().all(|s| *s == EscalationStep::RequestDrain), "{steps:?}");
    let m = pool.metrics();
    assert_eq!((m.quarantined, m.quarantine_stuck), (1, 1));
    // A long pause asks once, not once per missed interval.
    clock.advance(Duration::from_secs(3600));
    let again: Vec<_> = authority.poll_escalations().into_iter().map(|a| a.step).collect();
    assert_eq!(again, [EscalationStep::RequestDrain]);
    assert!(authority.poll_escalations().is_empty());
    assert_eq!(pool.metrics().free, 0);
    // Only a proof ends it, even after the ladder is exhausted.
    authority.deliver(authority.fenced(PeerId(3)));
    let m = pool.metrics();
    assert_eq!((m.free, m.quarantined, m.quarantine_stuck, m.settled_fenced), (1, 0, 0, 1));
}

#[test]
fn rule2_the_escalation_hook_fires_on_quarantine() {
    let (pool, authority) = pool(1);
    let fired = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let f = fired.clone();
    authority.on_quarantine(move || {
        f.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    let (exposed, _r) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    exposed.abort();
    assert_eq!(fired.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn rule5_stale_proofs_are_dropped_and_counted() {
    let (pool, authority) = pool(1);
    let (exposed, old) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    authority.deliver(authority.completed(&old.tenancies()));
    exposed.try_settled().unwrap().release();
    // Next tenancy of the same slot.
    let (exposed, new) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    assert_eq!(new.slots[0].slot, old.slots[0].slot);
    assert!(new.slots[0].generation > old.slots[0].generation);
    // A late ack for the old tenancy must not settle the new one.
    assert!(!authority.accept(old.tenancies()[0]));
    let r = authority.deliver(authority.completed(&old.tenancies()));
    assert_eq!((r.settled, r.stale), (0, 1));
    let exposed = exposed.try_settled().expect_err("stale ack settled a new tenancy");
    assert!(authority.accept(new.tenancies()[0]));
    assert_eq!(pool.metrics().stale_rejected, 2);
    drop(exposed);
}

#[test]
fn rule1_a_proof_from_another_pool_settles_nothing() {
    let (pool, _authority) = pool(1);
    let (_other_pool, other) = self::pool(1);
    let (exposed, remote) = other.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    let forged = other.completed(&remote.tenancies());
    let err = exposed.settle(forged).unwrap_err();
    assert_eq!(err.reason, SettleErrorReason::ForeignProof);
    err.lease.abort();
    let r = other.deliver(other.fenced(PeerId(1)));
    assert_eq!(r.settled, 0);
    assert_eq!(pool.metrics().quarantined, 1);
}

#[test]
fn rule1_settling_needs_a_proof_covering_every_slot() {
    let (pool, authority) = pool(2);
    let (exposed, remote) = authority.expose(pool.reserve(2).unwrap(), PeerId(1), 1, "t", Default::default());
    let ts = remote.tenancies();
    let err = exposed.settle(authority.completed(&ts[..1])).unwrap_err();
    assert_eq!(err.reason, SettleErrorReason::Incomplete);
    let settled = err.lease.settle(authority.completed(&ts[1..])).unwrap();
    assert_eq!(settled.len(), 2);
}

#[test]
fn rule1_a_fence_settles_every_exposure_to_that_peer_only() {
    let (pool, authority) = pool(4);
    let (a, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    let (b, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    let (c, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(2), 1, "t", Default::default());
    let (d, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    d.abort();
    let r = authority.deliver(authority.fenced(PeerId(1)));
    assert_eq!((r.settled, r.reclaimed), (3, 1));
    a.try_settled().unwrap().release();
    b.try_settled().unwrap().release();
    let c = c.try_settled().expect_err("a fence of peer 1 settled peer 2's exposure");
    assert_eq!(pool.metrics().free, 3);
    drop(c);
    pool.check_invariants().unwrap();
}

#[test]
fn rule3_the_settled_future_waits_for_the_proof() {
    let (pool, authority) = pool(1);
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    let mut fut = exposed.settled();
    assert!((&mut fut).now_or_never().is_none());
    let a2 = authority.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        a2.deliver(a2.completed(&remote.tenancies()));
    });
    let settled = block_on(fut);
    t.join().unwrap();
    assert_eq!(settled.tenancies().len(), 1);
}

#[test]
fn rule3_local_reads_and_writes_are_bounded_to_the_lease() {
    let (pool, authority) = pool(2);
    let mut lease = pool.reserve(1).unwrap();
    lease.write_at(0, 0, b"hello").unwrap();
    assert!(matches!(lease.write_at(1, 0, b"x"), Err(AccessError::NoSuchSlot { .. })));
    assert!(matches!(lease.write_at(0, SLOT - 1, b"xy"), Err(AccessError::OutOfSlot { .. })));
    assert!(matches!(lease.write_at(0, usize::MAX, b"xy"), Err(AccessError::OutOfSlot { .. })));
    let exposed = authority.expose_local(lease, PeerId(1));
    let settled = exposed.settle(authority.completed(&pool_tenancies(&pool, 0))).unwrap();
    assert_eq!(&settled.bytes().unwrap()[..5], b"hello");
}

fn pool_tenancies(pool: &SlotPool, slot: u32) -> Vec<Tenancy> {
    vec![Tenancy::new(SlotId(slot), pool.generation(SlotId(slot)).unwrap())]
}

#[test]
fn slot_addresses_map_both_ways() {
    let (pool, _a) = pool(4);
    let base = pool.region().addr();
    assert_eq!(pool.slot_addr(SlotId(2)), Some(base + 2 * SLOT as u64));
    assert_eq!(pool.slot_addr(SlotId(4)), None);
    assert_eq!(pool.slot_at(base + 2 * SLOT as u64 + 5), Some(SlotId(2)));
    assert_eq!(pool.slot_at(base + 4 * SLOT as u64), None);
    assert_eq!(pool.slot_at(base.wrapping_sub(1)), None);
}

#[test]
fn bad_pool_configs_are_typed_errors() {
    let r: Arc<dyn Region> = Arc::new(HostRegion::new(100).unwrap());
    assert_eq!(SlotPool::new(r.clone(), PoolConfig::new(0)).unwrap_err(), PoolError::ZeroSlotSize);
    assert!(matches!(SlotPool::new(r, PoolConfig::new(101)).unwrap_err(), PoolError::RegionTooSmall { .. }));
    assert!(HostRegion::new(0).is_err());
}

#[test]
fn metadata_is_at_most_32_bytes_per_slot() {
    assert!(SlotPool::metadata_bytes_per_slot() <= 32, "{} bytes", SlotPool::metadata_bytes_per_slot());
}

// ----- TransferHandle: the owned-lease pattern -----

#[test]
fn rule4_a_dropped_handle_returns_the_lease_only_after_completion() {
    let (pool, authority) = pool(1);
    let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(1));
    let (handle, completer) = TransferHandle::pair(exposed);
    drop(handle);
    assert!(completer.is_detached());
    // Sentinel: the slot is neither free nor reservable while in flight.
    assert_eq!(pool.metrics().free, 0);
    assert!(pool.reserve(1).is_err());
    let proof = authority.completed_lease(completer.lease());
    completer.complete(proof, Ok(())).unwrap();
    assert_eq!(pool.metrics().free, 1);
    pool.check_invariants().unwrap();
}

#[test]
fn rule4_completion_racing_the_handle_drop_never_loses_or_leaks_a_lease() {
    // Completed first and never polled, dropped first, or both at once on two
    // threads: the lease comes back to the pool exactly once every time.
    let (pool, authority) = pool(1);
    let authority = Arc::new(authority);
    for i in 0..2_000 {
        let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(1));
        let (handle, completer) = TransferHandle::pair(exposed);
        match i % 3 {
            0 => {
                let proof = authority.completed_lease(completer.lease());
                completer.complete(proof, Ok(())).unwrap();
                drop(handle);
            }
            1 => {
                drop(handle);
                let proof = authority.completed_lease(completer.lease());
                completer.complete(proof, Ok(())).unwrap();
            }
            _ => {
                let a = authority.clone();
                let t = std::thread::spawn(move || {
                    let proof = a.completed_lease(completer.lease());
                    completer.complete(proof, Ok(())).unwrap();
                });
                drop(handle);
                t.join().unwrap();
            }
        }
        assert_eq!(pool.metrics().free, 1, "round {i}");
    }
    pool.check_invariants().unwrap();
}

#[test]
fn rule7_a_handle_resolves_only_at_terminal_status_and_returns_the_lease() {
    let (pool, authority) = pool(1);
    let mut lease = pool.reserve(1).unwrap();
    lease.write_at(0, 0, &[7; 4]).unwrap();
    let (handle, completer) = TransferHandle::pair(authority.expose_local(lease, PeerId(1)));
    handle.cancel();
    assert!(completer.cancel_requested());
    let mut handle = handle;
    assert!((&mut handle).now_or_never().is_none(), "cancel must not resolve the handle");
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(10));
        let proof = authority.completed_lease(completer.lease());
        completer.complete(proof, Err(TransferError::Canceled)).unwrap();
    });
    let outcome = block_on(handle).unwrap();
    t.join().unwrap();
    assert_eq!(outcome.result, Err(TransferError::Canceled));
    assert_eq!(&outcome.lease.bytes().unwrap()[..4], &[7; 4]);
    outcome.lease.release();
    assert_eq!(pool.metrics().free, 1);
}

#[test]
fn rule4_a_completer_dropped_without_status_quarantines_and_reports_abandoned() {
    let (pool, authority) = pool(1);
    let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(5));
    let (handle, completer) = TransferHandle::pair(exposed);
    drop(completer);
    assert_eq!(block_on(handle).unwrap_err(), Abandoned { error: None });
    assert_eq!(pool.metrics().quarantined, 1);
    authority.deliver(authority.fenced(PeerId(5)));
    assert_eq!(pool.metrics().free, 1);
}

#[test]
fn rule7_an_abandoned_operation_keeps_its_lease_quarantined_and_reports_the_error() {
    let (pool, authority) = pool(1);
    let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(5));
    let (handle, completer) = TransferHandle::pair(exposed);
    let error = TransferError::Engine { engine: "test", code: -2, message: "backend".into() };
    completer.abandon(error.clone());
    assert_eq!(block_on(handle).unwrap_err(), Abandoned { error: Some(error) });
    assert_eq!((pool.metrics().free, pool.metrics().quarantined), (0, 1));
    authority.deliver(authority.fenced(PeerId(5)));
    assert_eq!(pool.metrics().free, 1);
}

#[test]
fn rule1_completing_with_a_wrong_proof_does_not_free() {
    let (pool, _authority) = pool(1);
    let (_p2, other) = self::pool(1);
    let exposed = other.expose_local(pool.reserve(1).unwrap(), PeerId(5));
    let ts = exposed.tenancies().to_vec();
    let (handle, completer) = TransferHandle::pair(exposed);
    assert_eq!(completer.complete(other.completed(&ts), Ok(())), Err(SettleErrorReason::ForeignProof));
    assert_eq!(block_on(handle).unwrap_err(), Abandoned { error: None });
    assert_eq!(pool.metrics().quarantined, 1);
}

#[test]
fn rule1_a_completed_handle_resolves_at_once_and_only_with_a_settling_proof() {
    let (pool, authority) = pool(2);
    // Finished inside the post: settled now, resolves at the first poll,
    // once; the bytes and the result come back with the lease.
    let mut lease = pool.reserve(1).unwrap();
    lease.write_at(0, 0, &[3; 4]).unwrap();
    let exposed = authority.expose_local(lease, PeerId(2));
    let proof = authority.completed_lease(&exposed);
    let (mut handle, settled) = TransferHandle::completed(exposed, proof, Err(TransferError::Canceled));
    assert_eq!(settled, Ok(()));
    assert!(!handle.cancel_requested());
    handle.cancel();
    let outcome = (&mut handle).now_or_never().expect("ready at once").unwrap();
    assert!((&mut handle).now_or_never().is_none(), "an outcome is handed out once");
    assert_eq!(outcome.result, Err(TransferError::Canceled));
    assert_eq!(&outcome.lease.bytes().unwrap()[..4], &[3; 4]);
    outcome.lease.release();
    assert_eq!(pool.metrics().free, 2);
    // Dropped unpolled: the settled lease goes back.
    let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(2));
    let proof = authority.completed_lease(&exposed);
    drop(TransferHandle::completed(exposed, proof, Ok(())).0);
    assert_eq!(pool.metrics().free, 2);
    // A proof that does not settle it: quarantined, Abandoned, and the reason.
    let (_p2, other) = self::pool(1);
    let exposed = other.expose_local(pool.reserve(1).unwrap(), PeerId(2));
    let ts = exposed.tenancies().to_vec();
    let (handle, settled) = TransferHandle::completed(exposed, other.completed(&ts), Ok(()));
    assert_eq!(settled, Err(SettleErrorReason::ForeignProof));
    assert_eq!(block_on(handle).unwrap_err(), Abandoned { error: None });
    assert_eq!((pool.metrics().free, pool.metrics().quarantined), (1, 1));
    pool.check_invariants().unwrap();
}

#[test]
fn rule3_a_failed_post_hands_the_lease_back() {
    let (pool, _authority) = pool(2);
    let (pool2, _a2) = self::pool(2);
    let lease = pool.reserve(1).unwrap();
    let (_e, remote) = _a2.expose(pool2.reserve(2).unwrap(), PeerId(1), 1, "t", Default::default());
    let kind = check_shapes(&lease, &remote).unwrap_err();
    let err = PostError { lease, kind };
    assert!(err.to_string().contains("descriptor mismatch"));
    let lease = err.lease;
    assert_eq!(pool.metrics().free, 1);
    lease.release();
    assert_eq!(pool.metrics().free, 2);
}

/// A backend that posts synchronously: exposes the lease to peer 1 and hands
/// back a pending handle whose completer it keeps (the "engine").
struct SyncBackend {
    authority: SettlementAuthority,
    completers: std::sync::Mutex<Vec<Completer>>,
    posts: std::sync::atomic::AtomicUsize,
}

impl PostNow for SyncBackend {
    fn post_now(
        &self,
        _op: Op,
        local: SlotLease<Reserved>,
        _remote: &RemoteSlots,
        _opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        self.posts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let (handle, completer) = TransferHandle::pair(self.authority.expose_local(local, PeerId(1)));
        self.completers.lock().unwrap().push(completer);
        Ok(handle)
    }
}

#[test]
fn rule3_a_deferred_post_posts_at_its_first_poll_and_an_unpolled_one_hands_the_lease_back() {
    let (pool, authority) = pool(2);
    let backend =
        SyncBackend { authority: authority.clone(), completers: Default::default(), posts: Default::default() };
    let remote = RemoteSlots {
        endpoint: "peer".into(),
        pool: PoolId(0),
        key: 0,
        slot_size: SLOT as u64,
        memory: Default::default(),
        token: Default::default(),
        slots: vec![],
    };
    let posts = || backend.posts.load(std::sync::atomic::Ordering::SeqCst);

    // Dropped unpolled: nothing was posted, nothing exposed, the slot is free again.
    let unpolled =
        PostFuture::deferred(&backend, Op::Write, pool.reserve(1).unwrap(), &remote, TransferOptions::default());
    assert_eq!((posts(), pool.metrics().free), (0, 1));
    drop(unpolled);
    assert_eq!((posts(), pool.metrics().free, pool.metrics().exposures), (0, 2, 0));

    // Polled: posted once, the lease exposed inside the handle; a second poll
    // of the spent future stays pending (it posts nothing twice).
    let mut post =
        PostFuture::deferred(&backend, Op::Write, pool.reserve(1).unwrap(), &remote, TransferOptions::default());
    let handle = (&mut post).now_or_never().expect("ready at the first poll").expect("posted");
    assert!((&mut post).now_or_never().is_none());
    assert_eq!((posts(), pool.metrics().exposures), (1, 1));
    let completer = backend.completers.lock().unwrap().pop().expect("completer");
    let proof = authority.completed_lease(completer.lease());
    completer.complete(proof, Ok(())).expect("the proof settles the lease");
    block_on(handle).expect("settled").lease.release();
    assert_eq!(pool.metrics().free, 2);
}

#[test]
fn rule2_the_ladder_holds_only_the_steps_the_backend_can_take() {
    use kv_transfer_core::drain::Capabilities;
    let clock = Arc::new(ManualClock::new());
    let ladder = EscalationLadder {
        drain: Duration::from_millis(10),
        revoke: Duration::from_millis(10),
        fence: Duration::from_millis(10),
    };
    let cfg = PoolConfig::new(SLOT).with_ladder(ladder).with_clock(clock.clone());
    let region = Arc::new(HostRegion::new(2 * SLOT).unwrap());
    let (pool, authority) = SlotPool::new(region, cfg.with_capabilities(Capabilities::DRAIN_ONLY)).unwrap();
    assert_eq!(authority.capabilities(), Capabilities::DRAIN_ONLY);
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(3), 1, "t", Default::default());
    exposed.abort();
    let mut steps = Vec::new();
    for _ in 0..6 {
        steps.extend(authority.poll_escalations().into_iter().map(|a| a.step));
        clock.advance(Duration::from_millis(4));
    }
    // Revoke and fence are skipped, never handed over; the drain's budget
    // runs out and the slot is reported stuck.
    assert_eq!(steps, [EscalationStep::RequestDrain, EscalationStep::Exhausted]);
    let m = pool.metrics();
    assert_eq!((m.free, m.quarantined, m.quarantine_stuck), (1, 1, 1));
    // A late proof still frees it.
    authority.deliver(authority.completed(&remote.tenancies()));
    assert_eq!(pool.metrics().free, 2);

    // A backend that can do none of the three: stuck at once.
    let none = Capabilities { drain: false, revoke: false, fence: false };
    let region = Arc::new(HostRegion::new(SLOT).unwrap());
    let (pool, authority) = SlotPool::new(region, PoolConfig::new(SLOT).with_capabilities(none)).unwrap();
    let (exposed, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    exposed.abort();
    let steps: Vec<_> = authority.poll_escalations().into_iter().map(|a| a.step).collect();
    assert_eq!(steps, [EscalationStep::Exhausted]);
    assert_eq!(pool.metrics().quarantine_stuck, 1);
}

/// An ABORT (or its ack) lost on a cut link is asked for again after the
/// ladder is exhausted, at a doubling interval capped at
/// `REDRAIN_MAX_INTERVAL`, so a peer whose link returns can still prove the
/// slots with its ack. Asking frees nothing; a backend that cannot drain is
/// never asked.
#[test]
fn rule2_a_stuck_exposure_is_asked_to_drain_again_and_freed_only_by_the_ack() {
    let clock = Arc::new(ManualClock::new());
    let ladder = EscalationLadder {
        drain: Duration::from_millis(100),
        revoke: Duration::from_millis(10),
        fence: Duration::from_millis(10),
    };
    let cfg = PoolConfig::new(SLOT).with_ladder(ladder).with_clock(clock.clone());
    let region = Arc::new(HostRegion::new(SLOT).unwrap());
    let (pool, authority) = SlotPool::new(region, cfg.with_capabilities(drain::Capabilities::DRAIN_ONLY)).unwrap();
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(3), 1, "t", Default::default());
    exposed.abort();
    assert_eq!(authority.poll_escalations()[0].step, EscalationStep::RequestDrain);
    clock.advance(Duration::from_millis(100));
    assert_eq!(authority.poll_escalations()[0].step, EscalationStep::Exhausted);
    assert_eq!(pool.metrics().quarantine_stuck, 1);
    // Re-drains at 100, 200, 400, ... ms after the exhaustion, capped at 30 s.
    let mut gaps = Vec::new();
    for _ in 0..12 {
        let wait = authority.next_escalation_in().expect("a stuck drainable exposure is asked again");
        gaps.push(wait);
        clock.advance(wait);
        let a = authority.poll_escalations();
        assert_eq!(a.len(), 1);
        assert_eq!(
            (a[0].step, a[0].peer, &a[0].tenancies),
            (EscalationStep::RequestDrain, PeerId(3), &remote.tenancies())
        );
        assert_eq!(pool.metrics().free, 0, "asking again freed the slot");
    }
    assert_eq!(gaps[..3], [Duration::from_millis(100), Duration::from_millis(200), Duration::from_millis(400)]);
    assert_eq!(*gaps.last().unwrap(), REDRAIN_MAX_INTERVAL);
    assert!(gaps.windows(2).all(|w| w[1] >= w[0]));
    // The ack that finally comes is the proof.
    authority.deliver(authority.completed(&remote.tenancies()));
    let m = pool.metrics();
    assert_eq!((m.free, m.quarantined, m.quarantine_stuck), (1, 0, 0));
    assert_eq!(authority.next_escalation_at(), None);

    // Without a drain nothing is asked again.
    let none = drain::Capabilities { drain: false, revoke: false, fence: false };
    let region = Arc::new(HostRegion::new(SLOT).unwrap());
    let cfg = PoolConfig::new(SLOT).with_clock(clock.clone()).with_capabilities(none);
    let (pool, authority) = SlotPool::new(region, cfg).unwrap();
    let (exposed, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    exposed.abort();
    assert_eq!(authority.poll_escalations()[0].step, EscalationStep::Exhausted);
    assert_eq!(authority.next_escalation_at(), None);
    clock.advance(Duration::from_secs(3600));
    assert!(authority.poll_escalations().is_empty());
    assert_eq!(pool.metrics().quarantine_stuck, 1);
}

#[test]
fn rule2_escalation_reads_the_pools_clock_not_the_wall_clock() {
    let clock = Arc::new(ManualClock::new());
    let (pool, authority) = pool_with(1, clock.clone());
    let (exposed, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(3), 1, "t", Default::default());
    exposed.abort();
    assert_eq!(authority.poll_escalations().len(), 1, "the first step is due at the abort");
    // Real time passes well beyond the 10 ms drain budget: nothing is due
    // until the pool's own clock moves.
    std::thread::sleep(Duration::from_millis(30));
    assert!(authority.poll_escalations().is_empty());
    assert_eq!(authority.next_escalation_in(), Some(Duration::from_millis(10)));
    clock.advance(Duration::from_millis(10));
    assert_eq!(authority.poll_escalations()[0].step, EscalationStep::Revoke);
}

#[test]
fn integrity_a_settled_slot_whose_bytes_changed_after_its_done_is_refused() {
    let (pool, authority) = pool(2);
    let (exposed, remote) = authority.expose(pool.reserve(2).unwrap(), PeerId(1), 1, "t", Default::default());
    let ts = remote.tenancies();
    // The sender's bytes: zeroes (what the region holds), then a late write.
    let zero = kv_transfer_core::drain::digest(&remote.token, &[0u8; SLOT]);
    authority.deliver(authority.completed_with_digests(&ts, &[(ts[0], zero), (ts[1], zero)], remote.token));
    let settled = exposed.try_settled().unwrap();
    assert_eq!(settled.bytes().unwrap(), vec![0u8; 2 * SLOT]);
    // A write lands in slot 1 after the DONE (what a stale NIC write does).
    pool.region().write(ts[1].slot.0 as usize * SLOT, &[7u8; 8]).unwrap();
    assert_eq!(settled.bytes().unwrap_err(), AccessError::Integrity { index: 1 });
    let mut one = [0u8; 4];
    assert_eq!(settled.read_at(1, 0, &mut one).unwrap_err(), AccessError::Integrity { index: 1 });
    assert!(settled.read_at(0, 0, &mut one).is_ok(), "the intact slot is readable");
    assert_eq!(pool.metrics().integrity_failures, 2);
    // The lease's own write makes the bytes its own: the digest no longer applies.
    let mut settled = settled;
    settled.write_at(1, 0, &[1u8; 4]).unwrap();
    assert!(settled.bytes().is_ok());
    settled.release();
    pool.check_invariants().unwrap();
}

/// Returns `bytes` with 64 bytes at `at` replaced by `evil` and 4 bytes at
/// `fix` chosen so that the crc32c is unchanged: crc32c is linear over
/// GF(2), so the 32 bits at `fix` can cancel any change (solved here by
/// Gaussian elimination), which is why a checksum is no integrity check
/// against a writer.
fn crc32c_forgery(bytes: &[u8], at: usize, evil: &[u8; 64], fix: usize) -> Vec<u8> {
    let zero = vec![0u8; bytes.len()];
    let lin = |v: &[u8]| crc32c::crc32c(v) ^ crc32c::crc32c(&zero);
    let mut delta = zero.clone();
    for (i, b) in evil.iter().enumerate() {
        delta[at + i] = bytes[at + i] ^ b;
    }
    let target = lin(&delta);
    // Columns: the effect of flipping each bit of the 4 bytes at `fix`.
    let mut rows: Vec<(u32, u32)> = (0..32)
        .map(|bit| {
            let mut v = zero.clone();
            v[fix + bit / 8] = 1 << (bit % 8);
            (lin(&v), 1u32 << bit)
        })
        .collect();
    // Reduce to find a combination of columns equal to `target`.
    let mut basis: Vec<(u32, u32)> = Vec::new();
    for (mut v, mut m) in rows.drain(..) {
        for (bv, bm) in &basis {
            if v ^ bv < v {
                v ^= bv;
                m ^= bm;
            }
        }
        if v != 0 {
            basis.push((v, m));
            basis.sort_by_key(|b| std::cmp::Reverse(b.0));
        }
    }
    let (mut t, mut mask) = (target, 0u32);
    for (bv, bm) in &basis {
        if t ^ bv < t {
            t ^= bv;
            mask ^= bm;
        }
    }
    assert_eq!(t, 0, "the 32 bits at `fix` span every crc difference");
    let mut out = bytes.to_vec();
    out[at..at + 64].copy_from_slice(evil);
    for (i, b) in mask.to_le_bytes().iter().enumerate() {
        out[fix + i] ^= b;
    }
    out
}

#[test]
fn hostile_a_writer_without_the_token_cannot_forge_a_slot_digest() {
    let (pool, authority) = pool(1);
    let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "t", Default::default());
    let ts = remote.tenancies();
    let sent: Vec<u8> = (0..SLOT).map(|i| (i * 7 + 3) as u8).collect();
    pool.region().write(0, &sent).unwrap();
    let mac = kv_transfer_core::drain::digest(&remote.token, &sent);
    authority.deliver(authority.completed_with_digests(&ts, &[(ts[0], mac)], remote.token));
    let settled = exposed.try_settled().unwrap();
    assert_eq!(settled.bytes().unwrap(), sent);
    // A third party that can write the slot replaces 64 bytes and fixes 4
    // others. Positive control: a crc32c digest would pass the forgery.
    let forged = crc32c_forgery(&sent, 16, &[0xee; 64], 200);
    assert_ne!(forged, sent);
    assert_eq!(crc32c::crc32c(&forged), crc32c::crc32c(&sent), "positive control: crc32c is forgeable");
    pool.region().write(0, &forged).unwrap();
    // The MAC, keyed by the exposure's token, refuses it: no byte handed over.
    assert_eq!(settled.bytes().unwrap_err(), AccessError::Integrity { index: 0 });
    assert_eq!(pool.metrics().integrity_failures, 1);
    settled.release();
}

#[test]
fn rule8_remote_sizes_use_checked_arithmetic() {
    let r = RemoteSlots {
        endpoint: "peer".into(),
        pool: PoolId(1),
        key: 0,
        slot_size: u64::MAX,
        memory: Default::default(),
        token: Default::default(),
        slots: vec![
            RemoteSlot { slot: SlotId(0), generation: Generation(1), addr: 0, key: None },
            RemoteSlot { slot: SlotId(1), generation: Generation(1), addr: 0, key: None },
        ],
    };
    assert_eq!(r.len_bytes(), None);
}

#[test]
fn rule8_hostile_a_late_delivered_fence_covers_only_the_exposures_made_before_it_was_minted() {
    let (pool, authority) = pool(3);
    let (old, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(4), 1, "t", Default::default());
    old.abort();
    let (live_old, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(4), 1, "t", Default::default());
    // The fence is minted (its teardown starts) ...
    let fence = authority.fenced(PeerId(4));
    // ... a new exposure to the same peer is made before it is delivered ...
    let (new, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(4), 1, "t", Default::default());
    let r = authority.deliver(fence);
    // ... and only what existed at the mint is settled.
    assert_eq!((r.settled, r.reclaimed), (2, 1));
    live_old.try_settled().expect("covered").release();
    let new = new.try_settled().expect_err("a fence minted before an exposure settled it");
    // A fence minted after it covers it.
    authority.deliver(authority.fenced(PeerId(4)));
    new.try_settled().expect("covered by the later fence").release();
    assert_eq!(pool.metrics().free, 3);
    pool.check_invariants().unwrap();
}
