//! Model checks of the concurrent paths (run with `RUSTFLAGS="--cfg loom"`).
//!
//! A `nic_busy` flag stands for the NIC: it is set while a write may still
//! land and cleared (with release ordering) before the backend delivers the
//! proof. Whoever gets the slot next must see it cleared.
#![cfg(loom)]

use kv_transfer_core::*;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use std::sync::Arc;

fn setup(capacity: usize) -> (SlotPool, SettlementAuthority) {
    let region = Arc::new(HostRegion::new(capacity * 64).unwrap());
    SlotPool::new(region, PoolConfig::new(64)).unwrap()
}

#[test]
fn abort_vs_completion_vs_reuse() {
    loom::model(|| {
        let (pool, authority) = setup(1);
        let (exposed, remote) = authority.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "p", Default::default());
        let nic_busy = Arc::new(AtomicBool::new(true));

        let app = thread::spawn(move || exposed.abort());
        let nic = {
            let busy = nic_busy.clone();
            thread::spawn(move || {
                busy.store(false, Ordering::Release);
                authority.deliver(authority.completed(&remote.tenancies()));
            })
        };
        let next = {
            let pool = pool.clone();
            let busy = nic_busy.clone();
            thread::spawn(move || {
                if let Ok(lease) = pool.reserve(1) {
                    assert!(!busy.load(Ordering::Acquire), "slot reused while the NIC may still write");
                    lease.release();
                }
            })
        };
        app.join().unwrap();
        nic.join().unwrap();
        next.join().unwrap();
        pool.check_invariants().unwrap();
        assert_eq!(pool.metrics().free, 1, "slot lost");
    });
}

#[test]
fn fence_vs_abort_vs_settle_two_leases() {
    loom::model(|| {
        let (pool, authority) = setup(2);
        let (a, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(7), 1, "p", Default::default());
        let (b, _) = authority.expose(pool.reserve(1).unwrap(), PeerId(7), 1, "p", Default::default());
        let nic_busy = Arc::new(AtomicBool::new(true));

        let aborter = thread::spawn(move || a.abort());
        let fencer = {
            let busy = nic_busy.clone();
            thread::spawn(move || {
                busy.store(false, Ordering::Release);
                authority.deliver(authority.fenced(PeerId(7)));
            })
        };
        let settler = {
            let busy = nic_busy.clone();
            thread::spawn(move || match b.try_settled() {
                Ok(settled) => {
                    assert!(!busy.load(Ordering::Acquire), "settled before the fence");
                    settled.release();
                }
                Err(still_exposed) => still_exposed.abort(),
            })
        };
        aborter.join().unwrap();
        fencer.join().unwrap();
        settler.join().unwrap();
        pool.check_invariants().unwrap();
        // The fence settles everything exposed to peer 7, whatever the order.
        assert_eq!(pool.metrics().free, 2, "a fenced slot was not reclaimed");
    });
}

#[test]
fn concurrent_reserve_and_release_never_double_allocate() {
    loom::model(|| {
        let (pool, _authority) = setup(2);
        let held = pool.reserve(1).unwrap();
        let p1 = pool.clone();
        let t1 = thread::spawn(move || p1.reserve(1).ok().map(|l| l.tenancies()[0]));
        let t2 = thread::spawn(move || held.release());
        let p3 = pool.clone();
        let t3 = thread::spawn(move || p3.reserve(1).ok().map(|l| l.tenancies()[0]));
        let a = t1.join().unwrap();
        t2.join().unwrap();
        let b = t3.join().unwrap();
        if let (Some(a), Some(b)) = (a, b) {
            assert_ne!(a, b, "one tenancy handed out twice");
        }
        pool.check_invariants().unwrap();
        assert_eq!(pool.metrics().free, 2);
    });
}
