//! The contract in one run: a request is aborted while a peer's write may
//! still land; the slot is quarantined, deadlines escalate, and only a proof
//! returns it to the pool.
//!
//! `cargo run -p kv-transfer-core --example lifecycle`

use kv_transfer_core::*;
use std::sync::Arc;
use std::time::Duration;

fn show(pool: &SlotPool, what: &str) {
    let m = pool.metrics();
    println!(
        "{what:<52} free {:>2}  leased {:>2}  quarantined {:>2}  stuck {:>2}",
        m.free, m.leased, m.quarantined, m.quarantine_stuck
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let clock = Arc::new(ManualClock::new());
    let ladder = EscalationLadder {
        drain: Duration::from_millis(100),
        revoke: Duration::from_millis(100),
        fence: Duration::from_millis(500),
    };
    let region = Arc::new(HostRegion::new(8 * 4096)?);
    let (pool, authority) = SlotPool::new(region, PoolConfig::new(4096).with_ladder(ladder).with_clock(clock.clone()))?;
    show(&pool, "decode pool of 8 slots");

    // Admission before exposure.
    match pool.reserve(9) {
        Err(e) => println!("reserve(9): refused before anything is exposed: {e}"),
        Ok(_) => unreachable!(),
    }

    // An earlier request used the slots and finished cleanly.
    pool.reserve(4)?.release();

    let lease = pool.reserve(4)?;
    let (exposed, remote) = authority.expose(lease, PeerId(1), 0xbeef, "prefill-0", Default::default());
    show(&pool, "4 slots exposed to prefill-0");
    println!("descriptor sent to the peer: {}", serde_json_like(&remote));

    // The client goes away. The prefill NIC may still be writing.
    exposed.abort();
    show(&pool, "request aborted: slots quarantined, not free");

    // Deadlines pass. Each one escalates; none frees.
    for _ in 0..4 {
        for action in authority.poll_escalations() {
            println!("  escalation: {:?} for peer {} ({} slots)", action.step, action.peer.0, action.tenancies.len());
        }
        clock.advance(Duration::from_millis(300));
    }
    show(&pool, "ladder exhausted: still quarantined, reported stuck");

    // A late ack from the slot's previous tenancy is stale: dropped, counted.
    let stale = Tenancy::new(remote.slots[0].slot, Generation(remote.slots[0].generation.0 - 1));
    let r = authority.deliver(authority.completed(&[stale]));
    println!("stale ack for {stale}: settled {}, dropped as stale {}", r.settled, r.stale);

    // The peer finally confirms it drained: that proof reclaims the slots.
    authority.deliver(authority.completed(&remote.tenancies()));
    show(&pool, "drain acknowledged (Completed proof)");
    let m = pool.metrics();
    println!(
        "abort-to-reclaim: p50 {} us, p99 {} us; stale rejected {}",
        m.abort_to_reclaim.p50_us, m.abort_to_reclaim.p99_us, m.stale_rejected
    );
    Ok(())
}

fn serde_json_like(r: &RemoteSlots) -> String {
    let slots: Vec<String> =
        r.slots.iter().map(|s| format!("{{slot {}, gen {}, addr {:#x}}}", s.slot.0, s.generation.0, s.addr)).collect();
    format!("endpoint {}, key {:#x}, {} B/slot, [{}]", r.endpoint, r.key, r.slot_size, slots.join(", "))
}
