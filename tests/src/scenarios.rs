//! The scenarios, each a function over a [`Backend`]. Each returns `Ok(())`
//! or a [`Failure`] saying what was expected and what was seen; none panics.

use crate::ensure;
use crate::harness::{Backend, Failure, PrefillSide, Provides, RawSpec, Rig, RigConfig};
use kv_transfer_core::{
    AdmissionError, EscalationLadder, Exposed, MetricsSnapshot, PostErrorKind, RejectReason, RemoteSlots, Settled,
    SlotLease, SlotPool, Tenancy, TransferError, TransferHandle, TransferOptions, TransferOutcome,
};
use kv_transfer_testkit::payload::{fill, verify, SlotCheck, Tag};
use kv_transfer_testkit::wait::{poll_until, wait_until};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(10);

fn ladder(drain_ms: u64, revoke_ms: u64, fence_ms: u64) -> EscalationLadder {
    EscalationLadder {
        drain: Duration::from_millis(drain_ms),
        revoke: Duration::from_millis(revoke_ms),
        fence: Duration::from_millis(fence_ms),
    }
}

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Failure + '_ {
    move |e| Failure(format!("{what}: {e}"))
}

fn wait_handle(h: Option<TransferHandle>) -> Result<Option<TransferOutcome>, Failure> {
    let Some(mut h) = h else { return Ok(None) };
    match poll_until(std::pin::Pin::new(&mut h), WAIT) {
        Some(Ok(out)) => Ok(Some(out)),
        Some(Err(e)) => Err(Failure(format!("the prefill operation was abandoned: {e}"))),
        None => Err(Failure(format!("the prefill operation did not reach a terminal status within {WAIT:?}"))),
    }
}

fn settle(exposed: SlotLease<Exposed>) -> Result<SlotLease<Settled>, Failure> {
    let mut f = Box::pin(exposed.settled());
    poll_until(f.as_mut(), WAIT).ok_or_else(|| Failure(format!("the exposure was not settled within {WAIT:?}")))
}

/// Checks every byte of a settled lease against request `request`'s tags.
pub fn check_settled(lease: &SlotLease<Settled>, request: u64) -> SlotCheck {
    let mut c = SlotCheck::default();
    let mut buf = vec![0u8; lease.pool().slot_size()];
    for (i, t) in lease.tenancies().iter().enumerate() {
        match lease.read_at(i, 0, &mut buf) {
            Ok(()) => c.merge(verify(&buf, Tag::new(request, t.slot.0, t.generation.0))),
            Err(_) => c.garbage_bytes += buf.len(),
        }
    }
    c
}

/// Bytes of one slot, read straight from the region (an inspection the
/// test does behind the pool's back, to see what a NIC left there).
fn slot_bytes(pool: &SlotPool, t: Tenancy) -> Vec<u8> {
    let mut v = vec![0u8; pool.slot_size()];
    let _ = pool.region().read(t.slot.0 as usize * pool.slot_size(), &mut v);
    v
}

fn region_bytes(pool: &SlotPool) -> Vec<u8> {
    let mut v = vec![0u8; pool.region().len()];
    let _ = pool.region().read(0, &mut v);
    v
}

/// Whether `new` holds the same slots as `old`, each under a newer generation.
fn same_slots_newer(old: &[Tenancy], new: &[Tenancy]) -> bool {
    old.len() == new.len() && new.iter().all(|n| old.iter().any(|o| o.slot == n.slot && n.generation > o.generation))
}

fn wait_whole(pool: &SlotPool) -> Result<MetricsSnapshot, Failure> {
    let ok = wait_until(WAIT, || {
        let m = pool.metrics();
        m.quarantined == 0 && m.free == m.capacity
    });
    let m = pool.metrics();
    ensure!(ok, "the pool did not come back whole: {} free of {}, {} quarantined", m.free, m.capacity, m.quarantined);
    Ok(m)
}

/// Writes `request` through the rig, waits for it and for the exposure's
/// settlement, and checks every byte the consumer reads.
fn serve(rig: &Rig, exposed: SlotLease<Exposed>, remote: &RemoteSlots, request: u64) -> Result<(), Failure> {
    let out = wait_handle(rig.write_tagged(remote, request)?)?;
    if let Some(out) = out {
        ensure!(out.result.is_ok(), "request {request}'s write failed: {:?}", out.result);
        out.lease.release();
    }
    let settled = settle(exposed)?;
    let c = check_settled(&settled, request);
    ensure!(c.is_clean(), "request {request} read {c:?}");
    settled.release();
    Ok(())
}

/// Checks that `rig` provides what its backend declared for this cell
/// (`what`: the capability, `has`: what the rig says).
fn declared(rig: &Rig, what: &str, has: bool) -> Result<(), Failure> {
    ensure!(has, "[{}] the backend declares {what}, but its rig does not provide it", rig.backend);
    Ok(())
}

/// Scenario 1, drain path: abort while writes are in flight. The slots are
/// not reused before a proof (the peer's ABORT_ACK); the next tenant's
/// bytes are intact.
pub fn abort_in_flight(b: &dyn Backend) -> Result<(), Failure> {
    abort_in_flight_path(b, "drain")
}

/// Scenario 1, revoke path: the same, the ladder revoking after a 1 ms drain.
pub fn abort_in_flight_revoked(b: &dyn Backend) -> Result<(), Failure> {
    abort_in_flight_path(b, "revoke")
}

fn abort_in_flight_path(b: &dyn Backend, path: &str) -> Result<(), Failure> {
    {
        let l = if path == "drain" { ladder(30_000, 30_000, 30_000) } else { ladder(1, 30_000, 30_000) };
        let rig = b.rig(&RigConfig { decode_slots: 4, ladder: l, ..RigConfig::default() })?;
        if path == "revoke" {
            declared(&rig, "revocation", rig.behaviour.can_revoke)?;
        }
        let pool = rig.decode_pool.clone();
        let held = rig.faults.hold_writes();
        let (exposed, remote) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
        let first: Vec<Tenancy> = remote.tenancies();
        let h = rig.write_tagged(&remote, 1)?;
        ensure!(!held || rig.faults.wait_held(WAIT), "[{path}] the write never reached the decode side");
        exposed.abort();
        let m = pool.metrics();
        // Without held writes (verbs: the NIC places them) the write and
        // its DONE may beat the abort: those slots settle Completed first.
        ensure!(
            m.quarantined_total >= 2 || (!held && m.quarantined_total + m.settled_completed >= 2),
            "[{path}] aborted exposed slots were not quarantined: {m:?}"
        );
        if path == "drain" && held {
            ensure!(m.quarantined == 2, "[{path}] expected 2 quarantined slots, saw {}", m.quarantined);
            ensure!(first.iter().all(|t| !pool.slot_is_free(t.slot)), "[{path}] an aborted slot is on the free list");
            match pool.reserve(4) {
                Err(AdmissionError::OverCapacity { available: 2, .. }) => {}
                other => return Err(Failure(format!("[{path}] quarantined slots were handed out: {other:?}"))),
            }
            let other = pool.reserve(2).map_err(err("reserve"))?;
            ensure!(
                other.tenancies().iter().all(|t| first.iter().all(|f| f.slot != t.slot)),
                "[{path}] a quarantined slot was reused"
            );
            other.release();
        }
        if path == "revoke" {
            // Still held: only the revocation (after the 1 ms drain) can settle.
            ensure!(wait_until(WAIT, || pool.metrics().quarantined == 0), "[revoke] the slots were never revoked");
        }
        rig.faults.release_writes();
        let out = wait_handle(h)?;
        let m = wait_whole(&pool)?;
        match path {
            "drain" if held => {
                ensure!(m.settled_completed >= 2, "[drain] expected a Completed proof (ABORT_ACK), saw {m:?}");
                if let Some(o) = &out {
                    ensure!(o.result.is_ok(), "[drain] the held write should land in its own tenancy: {:?}", o.result);
                }
            }
            _ if !held => {
                // A backend that cannot hold writes (verbs: the NIC places
                // them) races the write's DONE against the revocation:
                // either proof will do, and the bytes are checked below.
                ensure!(
                    m.settled_revoked + m.settled_completed >= 2,
                    "[{path}] expected Revoked or Completed, saw {m:?}; {}",
                    rig.faults.diagnostics()
                );
            }
            _ => {
                ensure!(
                    m.settled_revoked >= 2,
                    "[revoke] expected a Revoked proof, saw {m:?}; {}",
                    rig.faults.diagnostics()
                );
                if let Some(o) = &out {
                    ensure!(
                        o.result == Err(TransferError::Rejected(RejectReason::StaleGeneration)),
                        "[revoke] the late write should be rejected as stale: {:?}",
                        o.result
                    );
                }
            }
        }
        drop(out);
        // The next tenant gets the same slots and reads only its own bytes.
        let (exposed, remote) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
        let again: Vec<Tenancy> = remote.tenancies();
        ensure!(
            same_slots_newer(&first, &again),
            "[{path}] expected the next tenant on the same slots with newer generations: {first:?} -> {again:?}"
        );
        serve(&rig, exposed, &remote, 2)?;
        wait_whole(&pool)?;
    }
    Ok(())
}

/// Scenario 3: the prefill side dies mid-transfer (`process`: a real child
/// process, killed). The aborted slots stay quarantined until a proof
/// settles them: the fence (the two slots never written can have no other),
/// or, for a slot whose write the target had received whole before it
/// noticed the crash, a completion notification that rode behind that data
/// (MORI's carried notifications). Then the pool is whole and the next
/// tenant's bytes are its own.
pub fn peer_crash(b: &dyn Backend, process: bool) -> Result<(), Failure> {
    peer_crash_run(b, process, true)
}

/// Scenario 3 on a backend without a fence: after the crash nothing can
/// prove that the dead peer's writes are over, so the aborted slots stay
/// quarantined (never freed by a timer).
pub fn peer_crash_without_fence(b: &dyn Backend) -> Result<(), Failure> {
    peer_crash_run(b, false, false)
}

fn peer_crash_run(b: &dyn Backend, process: bool, fence: bool) -> Result<(), Failure> {
    if process && !b.provides().prefill_process {
        // The conformance harness lists this case as ignored (not applicable).
        return Err(Failure(format!("[{}] scenario 3 (killed process): no out-of-process prefill worker", b.name())));
    }
    let cfg = RigConfig {
        decode_slots: 8,
        ladder: ladder(600_000, 600_000, 600_000),
        prefill_process: process,
        ..RigConfig::default()
    };
    let mut rig = b.rig(&cfg)?;
    let pool = rig.decode_pool.clone();
    let held = rig.faults.hold_writes();
    let (exposed, remote) = rig.expose(pool.reserve(4).map_err(err("reserve"))?)?;
    let tenancies = remote.tenancies();
    // Two of the four slots are written.
    let written = RemoteSlots { slots: remote.slots[..2].to_vec(), ..remote.clone() };
    let _h = rig.write_tagged(&written, 7)?;
    ensure!(!held || rig.faults.wait_held(WAIT), "the prefill side's writes never arrived");
    exposed.abort();
    let m = pool.metrics();
    // Without held writes (verbs) the written slots may settle by their DONE
    // first, and a backend that revokes at once settles the rest.
    ensure!(
        m.quarantined == 4 || (!held && m.quarantined + m.settled_completed + m.settled_revoked >= 4),
        "expected 4 quarantined slots before the crash, saw {m:?}"
    );
    rig.crash_prefill()?;
    rig.faults.release_writes();
    if !fence {
        ensure!(!rig.behaviour.can_fence, "[{}] a rig with a fence runs the fenced cell", rig.backend);
        // Nothing can prove that the dead peer's writes are over: the slots stay quarantined.
        std::thread::sleep(Duration::from_millis(200));
        let m = pool.metrics();
        ensure!(
            m.quarantined == 4 && m.free == m.capacity - 4,
            "without a fence the aborted slots must stay quarantined after the crash, saw {m:?}"
        );
        return Ok(());
    }
    declared(&rig, "a fence", rig.behaviour.can_fence)?;
    let m = wait_whole(&pool)?;
    // A backend whose ladder revokes first (verbs: `LOCAL_INV` is local and
    // certain) settles the unwritten slots by revocation before the fence.
    // Without held writes the peer may even acknowledge the ABORT before it
    // dies: its ABORT_ACK is a proof too.
    let fenced_or_revoked = m.settled_fenced + m.settled_revoked;
    let proven = fenced_or_revoked + m.settled_completed;
    ensure!(
        proven >= 4 && (!held || fenced_or_revoked >= 2),
        "the quarantined slots should be settled by a fence or revocation (the unwritten ones at least), saw {m:?}"
    );
    // The next tenant: its own bytes, and nothing of the dead peer's arrives later.
    let mut lease = pool.reserve(4).map_err(err("reserve"))?;
    for (i, t) in lease.tenancies().to_vec().iter().enumerate() {
        let mut buf = vec![0u8; pool.slot_size()];
        fill(&mut buf, Tag::new(8, t.slot.0, t.generation.0));
        lease.write_at(i, 0, &buf).map_err(err("local write"))?;
    }
    std::thread::sleep(Duration::from_millis(50));
    for t in lease.tenancies() {
        let c = verify(&slot_bytes(&pool, *t), Tag::new(8, t.slot.0, t.generation.0));
        ensure!(c.is_clean(), "stale bytes after the fence in slot {}: {c:?}", t.slot.0);
    }
    ensure!(
        lease.tenancies().iter().all(|t| tenancies.iter().any(|o| o.slot == t.slot)),
        "expected the same slots back"
    );
    lease.release();
    wait_whole(&pool)?;
    Ok(())
}

/// Scenario 4: a stale ack (old generation) is dropped and counted and never
/// settles the new tenancy of the same slot.
pub fn stale_ack(b: &dyn Backend) -> Result<(), Failure> {
    let rig = b.rig(&RigConfig { decode_slots: 4, ladder: ladder(1, 30_000, 30_000), ..RigConfig::default() })?;
    let pool = rig.decode_pool.clone();
    // The old tenancy's write is held past its abort, and the aborted
    // tenancy is reassigned: that takes a revocation.
    declared(&rig, "revocation", rig.behaviour.can_revoke)?;
    declared(&rig, "held writes", rig.faults.hold_writes())?;
    if rig.behaviour.shadows_revoked_slots {
        return stale_ack_past_a_retry_shadow(&rig);
    }
    let (a, remote_a) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
    let h = rig.write_tagged(&remote_a, 1)?;
    ensure!(rig.faults.wait_held(WAIT), "the write never arrived");
    let stale0 = pool.metrics().stale_rejected;
    a.abort();
    ensure!(wait_until(WAIT, || pool.metrics().quarantined == 0), "the aborted slots were not revoked");
    let (b_exp, remote_b) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
    ensure!(
        same_slots_newer(&remote_a.tenancies(), &remote_b.tenancies()),
        "expected the new tenancy on the same slots"
    );
    // What the new tenancy's slots hold before the old write is let go.
    let before = region_bytes(&pool);
    rig.faults.release_writes();
    let breaks = rig.behaviour.stale_write_breaks_connection;
    match wait_handle(h)? {
        Some(out) => ensure!(
            out.result == Err(TransferError::Rejected(RejectReason::StaleGeneration)),
            "the old tenancy's write should be rejected as stale, got {:?}",
            out.result
        ),
        None if breaks => return Err(Failure("the refusal is seen at the initiator: no handle".into())),
        None => {}
    }
    if breaks {
        // RC: the refused WRITE ended the queue pair; the ACK behind it was
        // flushed, and the new tenancy (exposed on that queue pair) settles
        // by the fence alone. Nothing landed in it: its bytes are as before.
        let s = settle(b_exp).map_err(|f| Failure(format!("{}; {}", f.0, rig.faults.diagnostics())))?;
        ensure!(region_bytes(&pool) == before, "the refused write changed the new tenancy's slots");
        s.release();
        wait_whole(&pool)?;
        return Ok(());
    }
    // Two stale WRs rejected at the NIC, then the ABORT_ACK naming two old tenancies.
    ensure!(
        wait_until(WAIT, || pool.metrics().stale_rejected >= stale0 + 4),
        "stale write and ack not both counted: {} -> {}",
        stale0,
        pool.metrics().stale_rejected
    );
    std::thread::sleep(Duration::from_millis(20));
    let b_exp = match b_exp.try_settled() {
        Ok(_) => return Err(Failure("the stale ack settled the new tenancy".into())),
        Err(e) => e,
    };
    serve(&rig, b_exp, &remote_b, 2)?;
    wait_whole(&pool)?;
    Ok(())
}

/// Scenario 4 on a backend whose revoked slots are refused to their peer
/// until its ack ([`Behaviour::shadows_revoked_slots`](crate::harness::Behaviour::shadows_revoked_slots)): the old tenancy's write
/// is held, aborted and revoked; the same slots' new tenancy goes to
/// another peer (the raw one). The held write, released, is refused and
/// lands nothing; the old peer's ABORT_ACK that follows names the old
/// tenancies only and settles nothing of the new one; the new tenancy's
/// own peer settles it.
fn stale_ack_past_a_retry_shadow(rig: &Rig) -> Result<(), Failure> {
    let pool = rig.decode_pool.clone();
    let mut other = rig.faults.raw_peer().ok_or_else(|| Failure("a shadowing backend needs a raw peer".into()))??;
    let (a, remote_a) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
    let h = rig.write_tagged(&remote_a, 1)?;
    ensure!(rig.faults.wait_held(WAIT), "the write never arrived");
    a.abort();
    ensure!(wait_until(WAIT, || pool.metrics().quarantined == 0), "the aborted slots were not revoked");
    let (b_exp, remote_b) = rig.faults.expose_to_raw(pool.reserve(2).map_err(err("reserve"))?)?;
    ensure!(
        same_slots_newer(&remote_a.tenancies(), &remote_b.tenancies()),
        "expected the new tenancy on the same slots"
    );
    let before = region_bytes(&pool);
    let stale0 = pool.metrics().stale_rejected;
    rig.faults.release_writes();
    match wait_handle(h)? {
        Some(out) => ensure!(
            out.result == Err(TransferError::Rejected(RejectReason::StaleGeneration)),
            "the old tenancy's write should be refused as stale, got {:?}",
            out.result
        ),
        None => return Err(Failure("no handle for the old tenancy's write".into())),
    }
    ensure!(region_bytes(&pool) == before, "the refused write changed the new tenancy's slots");
    // The old peer's ABORT_ACK (its write is over) names the two old
    // tenancies: counted stale, and it settles nothing of the new one.
    ensure!(
        wait_until(WAIT, || pool.metrics().stale_rejected >= stale0 + 2),
        "the old peer's ack was not counted as stale: {} -> {}; {}",
        stale0,
        pool.metrics().stale_rejected,
        rig.faults.diagnostics()
    );
    std::thread::sleep(Duration::from_millis(20));
    let b_exp = match b_exp.try_settled() {
        Ok(_) => return Err(Failure("the stale ack settled the new tenancy".into())),
        Err(e) => e,
    };
    other.notify(&remote_b, &remote_b.tenancies())?;
    let s = settle(b_exp)?;
    ensure!(region_bytes(&pool) == before, "the new tenancy's slots changed without a write");
    s.release();
    wait_whole(&pool)?;
    Ok(())
}

/// Scenario 4, notification half: a peer replays the NOTIFY of a slot's
/// previous tenancy, and names past and future generations; each is dropped
/// and counted, and only the NOTIFY of the current tenancy settles it.
pub fn stale_notify_replay(b: &dyn Backend) -> Result<(), Failure> {
    let rig = b.rig(&RigConfig { decode_slots: 4, ladder: ladder(1, 30_000, 30_000), ..RigConfig::default() })?;
    let Some(peer) = rig.faults.raw_peer() else { return declared(&rig, "a raw peer", false) };
    let mut peer = peer?;
    let rig = &rig;
    let pool = rig.decode_pool.clone();
    let (first, r1) = rig.faults.expose_to_raw(pool.reserve(1).map_err(err("reserve"))?)?;
    peer.notify(&r1, &r1.tenancies())?;
    let s = settle(first)?;
    s.release();
    let (second, r2) = rig.faults.expose_to_raw(pool.reserve(1).map_err(err("reserve"))?)?;
    let (old, new) = (r1.tenancies()[0], r2.tenancies()[0]);
    ensure!(old.slot == new.slot && new.generation > old.generation, "expected the same slot, newer generation");
    let future = Tenancy::new(new.slot, kv_transfer_core::Generation(new.generation.0 + 1));
    let stale0 = pool.metrics().stale_rejected;
    let mut second = second;
    for (what, t) in [("replayed", old), ("future", future)] {
        let before = pool.metrics().stale_rejected;
        peer.notify(&r2, &[t])?;
        ensure!(
            wait_until(WAIT, || pool.metrics().stale_rejected > before),
            "a {what} NOTIFY was not counted as stale; {}",
            rig.faults.diagnostics()
        );
        second = match second.try_settled() {
            Ok(_) => return Err(Failure(format!("a {what} NOTIFY settled the current tenancy"))),
            Err(e) => e,
        };
    }
    ensure!(pool.metrics().stale_rejected >= stale0 + 2, "stale notifications not counted");
    peer.notify(&r2, &[new])?;
    settle(second)?.release();
    wait_whole(&pool)?;
    Ok(())
}

/// Scenario 5's rig: two decode slots exposed, and the region's bytes before
/// anything bad arrives.
struct BadInput {
    rig: Rig,
    pool: SlotPool,
    exposed: SlotLease<Exposed>,
    remote: RemoteSlots,
    before: Vec<u8>,
}

impl BadInput {
    fn new(b: &dyn Backend) -> Result<Self, Failure> {
        let rig = b.rig(&RigConfig { decode_slots: 8, ladder: ladder(1, 30_000, 30_000), ..RigConfig::default() })?;
        let pool = rig.decode_pool.clone();
        let (exposed, remote) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
        let before = region_bytes(&pool);
        Ok(Self { rig, pool, exposed, remote, before })
    }

    /// The exposure, aborted, still settles and the pool comes back whole.
    fn settle(rig: &Rig, pool: &SlotPool, exposed: SlotLease<Exposed>) -> Result<(), Failure> {
        exposed.abort();
        wait_whole(pool).map_err(|f| Failure(format!("{}; {}", f.0, rig.faults.diagnostics())))?;
        Ok(())
    }
}

/// Scenario 5, posts: every bad post the initiator must refuse gets a
/// typed error and hands the lease back; target memory is unchanged.
pub fn bad_input(b: &dyn Backend) -> Result<(), Failure> {
    let BadInput { rig, pool, exposed, remote, before } = BadInput::new(b)?;
    let size = pool.slot_size();
    let Some(PrefillSide { transfer: t, pool: ppool }) = &rig.prefill else {
        return Err(Failure(format!("[{}] an in-process rig without its prefill side", rig.backend)));
    };
    {
        type Case<'a> = (&'a str, usize, RemoteSlots, fn(&PostErrorKind) -> bool);
        let mut cases: Vec<Case> = vec![
            ("slot count mismatch", 1, remote.clone(), |k| matches!(k, PostErrorKind::Descriptor(_))),
            ("slot size mismatch", 2, RemoteSlots { slot_size: size as u64 / 2, ..remote.clone() }, |k| {
                matches!(k, PostErrorKind::Descriptor(_))
            }),
            ("unreachable peer", 2, RemoteSlots { endpoint: "127.0.0.1:1".into(), ..remote.clone() }, |k| {
                matches!(k, PostErrorKind::Peer(_))
            }),
        ];
        for (what, n, r, expect) in cases.drain(..) {
            let src = ppool.reserve(n).map_err(err("reserve"))?;
            match kv_transfer_examples_block_on(t.write(src, &r, TransferOptions::default())) {
                Err(e) if expect(&e.kind) => e.lease.release(),
                Err(e) => return Err(Failure(format!("{what}: wrong error {:?}", e.kind))),
                Ok(_) => return Err(Failure(format!("{what}: the post was accepted"))),
            }
        }
        let foreign = pool.reserve(2).map_err(err("reserve"))?;
        match kv_transfer_examples_block_on(t.write(foreign, &remote, TransferOptions::default())) {
            Err(e) if e.kind == PostErrorKind::ForeignPool => e.lease.release(),
            Err(e) => return Err(Failure(format!("foreign pool: wrong error {:?}", e.kind))),
            Ok(_) => return Err(Failure("foreign pool: the post was accepted".into())),
        }
        let m = ppool.metrics();
        ensure!(m.free == m.capacity, "a refused post kept prefill slots: {m:?}");
    }
    ensure!(region_bytes(&pool) == before, "a refused post changed target memory");
    BadInput::settle(&rig, &pool, exposed)
}

/// Scenario 5, the wire: raw one-sided accesses the target NIC must reject
/// (unknown key, out of bounds, another slot, old and future generations,
/// zero length, oversize), each with its typed reason; memory unchanged.
pub fn bad_input_raw_accesses(b: &dyn Backend) -> Result<(), Failure> {
    let BadInput { rig, pool, exposed, remote, before } = BadInput::new(b)?;
    let size = pool.slot_size();
    let s0 = remote.slots[0];
    let s1 = remote.slots[1];
    let good = RawSpec { key: remote.key, addr: s0.addr, slot: s0.slot.0, generation: s0.generation.0 };
    let end = pool.region().addr() + pool.region().len() as u64;
    let cases: Vec<(&str, RawSpec, usize, RejectReason)> = vec![
        ("unknown key", RawSpec { key: remote.key ^ 0x5a5a_0000, ..good }, size, RejectReason::UnknownKey),
        ("past the region", RawSpec { addr: end, ..good }, size, RejectReason::OutOfBounds),
        (
            "before the region",
            RawSpec { addr: pool.region().addr().wrapping_sub(size as u64), ..good },
            size,
            RejectReason::OutOfBounds,
        ),
        ("another slot's address", RawSpec { addr: s1.addr, ..good }, size, RejectReason::OutOfBounds),
        ("straddling two slots", RawSpec { addr: s0.addr + size as u64 / 2, ..good }, size, RejectReason::OutOfBounds),
        ("old generation", RawSpec { generation: s0.generation.0 - 1, ..good }, size, RejectReason::StaleGeneration),
        ("future generation", RawSpec { generation: s0.generation.0 + 1, ..good }, size, RejectReason::StaleGeneration),
        ("zero length", good, 0, RejectReason::ZeroLength),
        ("oversize", good, size * 4 + 1, RejectReason::Oversize),
    ];
    for (what, spec, len, reason) in cases {
        match rig.faults.raw_write(spec, vec![0xee; len]) {
            None => return declared(&rig, "raw accesses", false),
            Some(Err(TransferError::Rejected(r))) if r == reason => {}
            Some(other) => return Err(Failure(format!("{what}: expected Rejected({reason:?}), got {other:?}"))),
        }
        ensure!(region_bytes(&pool) == before, "{what}: the rejected access changed target memory");
    }
    BadInput::settle(&rig, &pool, exposed)
}

/// Scenario 5, malformed frames: bytes that are no valid frame make the
/// decode side drop (and count) them and tear that connection down; memory
/// unchanged, and the exposure still settles.
pub fn bad_input_malformed_frames(b: &dyn Backend) -> Result<(), Failure> {
    let BadInput { rig, pool, exposed, before, .. } = BadInput::new(b)?;
    let Some(r) = rig.faults.send_malformed() else { return declared(&rig, "malformed frames", false) };
    r?;
    ensure!(region_bytes(&pool) == before, "a malformed frame changed target memory");
    BadInput::settle(&rig, &pool, exposed)
}

fn kv_transfer_examples_block_on<F: std::future::Future>(f: F) -> F::Output {
    backend_tcp_sim::block_on(f)
}

/// Scenario 6: a burst above capacity is refused before anything is
/// exposed; every request served reads only its own bytes.
pub fn admission_overload(b: &dyn Backend) -> Result<(), Failure> {
    let rig = b.rig(&RigConfig { decode_slots: 8, ..RigConfig::default() })?;
    let pool = rig.decode_pool.clone();
    let exposures0 = pool.metrics().exposures;
    let mut served = Vec::new();
    let mut refused = 0;
    for req in 1..=10u64 {
        match pool.reserve(2) {
            Ok(l) => served.push((req, l)),
            Err(AdmissionError::OverCapacity { requested: 2, .. }) => refused += 1,
            Err(e) => return Err(Failure(format!("request {req}: unexpected refusal {e:?}"))),
        }
    }
    ensure!(served.len() == 4 && refused == 6, "expected 4 served and 6 refused, got {} and {refused}", served.len());
    let m = pool.metrics();
    ensure!(
        m.admission_rejected == 6 && m.exposures == exposures0 && m.free == 0,
        "refusals exposed or held something: {m:?}"
    );
    ensure!(
        matches!(pool.reserve(9), Err(AdmissionError::TooLarge { .. })),
        "a request larger than the pool must be TooLarge"
    );
    ensure!(matches!(pool.reserve(0), Err(AdmissionError::Empty)), "an empty request must be refused");
    let mut live = Vec::new();
    for (req, lease) in served {
        let (exposed, remote) = rig.expose(lease)?;
        let h = rig.write_tagged(&remote, req)?;
        live.push((req, exposed, h));
    }
    for (req, exposed, h) in live {
        if let Some(out) = wait_handle(h)? {
            ensure!(out.result.is_ok(), "request {req}: {:?}", out.result);
        }
        let s = settle(exposed)?;
        let c = check_settled(&s, req);
        ensure!(c.is_clean(), "request {req} read {c:?}");
        s.release();
    }
    wait_whole(&pool)?;
    Ok(())
}

/// Scenario 7: dropping a `TransferHandle` or an exposed lease frees nothing
/// early; `mem::forget` leaks a slot but never frees one.
pub fn dropped_handles(b: &dyn Backend) -> Result<(), Failure> {
    let rig = b.rig(&RigConfig { decode_slots: 8, ladder: ladder(30_000, 30_000, 30_000), ..RigConfig::default() })?;
    let pool = rig.decode_pool.clone();
    if !rig.faults.hold_writes() {
        // The conformance harness lists this case as ignored (not applicable).
        return Err(Failure(format!("[{}] dropped_handles: needs writes held at the decode side", rig.backend)));
    }
    // A dropped handle: the prefill slots stay out until the terminal status.
    let (exposed, remote) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
    let h = rig.write_tagged(&remote, 1)?;
    ensure!(rig.faults.wait_held(WAIT), "the write never arrived");
    if let (Some(h), Some(ppool)) = (h, rig.prefill.as_ref().map(|p| &p.pool)) {
        let out_before = ppool.metrics().leased;
        drop(h);
        std::thread::sleep(Duration::from_millis(20));
        ensure!(ppool.metrics().leased == out_before, "dropping the handle returned its slots early");
        rig.faults.release_writes();
        ensure!(
            wait_until(WAIT, || ppool.metrics().free == ppool.metrics().capacity),
            "the handle's lease never came back"
        );
    } else {
        rig.faults.release_writes();
    }
    let s = settle(exposed)?;
    ensure!(check_settled(&s, 1).is_clean(), "request 1 read foreign bytes");
    s.release();
    // A dropped exposed lease: quarantined, freed only by a proof.
    rig.faults.hold_writes();
    let (exposed, remote) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
    let h = rig.write_tagged(&remote, 2)?;
    ensure!(rig.faults.wait_held(WAIT), "the write never arrived");
    let settled0 = pool.metrics();
    drop(exposed);
    std::thread::sleep(Duration::from_millis(20));
    let m = pool.metrics();
    ensure!(m.quarantined == 2 && m.free == m.capacity - 2, "a dropped exposed lease was freed without proof: {m:?}");
    rig.faults.release_writes();
    drop(wait_handle(h)?);
    let m = wait_whole(&pool)?;
    ensure!(
        m.settled_completed + m.settled_revoked + m.settled_fenced
            >= settled0.settled_completed + settled0.settled_revoked + settled0.settled_fenced + 2,
        "the dropped lease's slots came back without a proof: {m:?}"
    );
    // mem::forget may leak, never free.
    let (exposed, _remote) = rig.expose(pool.reserve(1).map_err(err("reserve"))?)?;
    std::mem::forget(exposed);
    std::thread::sleep(Duration::from_millis(50));
    let m = pool.metrics();
    ensure!(m.free == m.capacity - 1, "a forgotten exposed lease was freed: {m:?}");
    Ok(())
}

/// Scenario 8: a peer that never acks. The ladder escalates (drain, then
/// revoke; where revocation cannot drain, then fence) and no slot is ever
/// freed by the timer alone.
pub fn never_acks(b: &dyn Backend) -> Result<(), Failure> {
    // Part 1: the write is held, so no ack comes; revocation settles.
    let rig = b.rig(&RigConfig { decode_slots: 4, ladder: ladder(100, 30_000, 30_000), ..RigConfig::default() })?;
    let pool = rig.decode_pool.clone();
    let revoke = rig.behaviour.can_revoke;
    declared(&rig, "held writes", rig.faults.hold_writes())?;
    {
        let (exposed, remote) = rig.expose(pool.reserve(2).map_err(err("reserve"))?)?;
        let h = rig.write_tagged(&remote, 1)?;
        ensure!(rig.faults.wait_held(WAIT), "the write never arrived");
        let t0 = Instant::now();
        let m0 = pool.metrics();
        exposed.abort();
        if revoke {
            watch_until_free(&pool, 2, t0, Duration::from_millis(100))?;
            let m = pool.metrics();
            ensure!(m.settled_revoked >= 2, "expected a Revoked proof, saw {m:?}");
            rig.faults.release_writes();
            drop(wait_handle(h)?);
        } else {
            // No revocation: past the revoke step the slots stay quarantined
            // while the write is held; only the peer's drain and ack frees them.
            while t0.elapsed() < Duration::from_millis(300) {
                let m = pool.metrics();
                ensure!(
                    m.quarantined == 2 && m.free == m.capacity - 2,
                    "slots were freed {:?} after the abort with no proof possible: {m:?}",
                    t0.elapsed()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            rig.faults.release_writes();
            drop(wait_handle(h)?);
            let m = wait_whole(&pool)?;
            ensure!(
                m.settled_completed >= m0.settled_completed + 2,
                "expected the drained peer's ack (Completed) to settle, saw {m:?}"
            );
        }
        wait_whole(&pool)?;
    }
    Ok(())
}

/// Scenario 8, a stalled peer: it stalls mid-payload, so revocation cannot
/// drain, and the fence settles; where there is no fence, the ladder ends
/// with the slot stuck, never freed.
pub fn stalled_peer_never_acks(b: &dyn Backend) -> Result<(), Failure> {
    let Provides { revoke, fence, .. } = b.provides();
    let rig = b.rig(&RigConfig {
        decode_slots: 4,
        ladder: if fence { ladder(50, 100, 30_000) } else { ladder(50, 100, 100) },
        can_hold: false,
        ..RigConfig::default()
    })?;
    ensure!(
        (rig.behaviour.can_revoke, rig.behaviour.can_fence) == (revoke, fence),
        "[{}] the backend declares revoke={revoke} fence={fence}, its rig says otherwise",
        rig.backend
    );
    let pool = rig.decode_pool.clone();
    let lease = pool.reserve(1).map_err(err("reserve"))?;
    let Some(r) = rig.faults.expose_to_stalled_peer(lease) else { return declared(&rig, "a stalled peer", false) };
    let (exposed, guard) = r?;
    std::thread::sleep(Duration::from_millis(20));
    let t0 = Instant::now();
    let m0 = pool.metrics();
    exposed.abort();
    if !fence {
        ensure!(
            wait_until(WAIT, || pool.metrics().quarantine_stuck >= 1),
            "the ladder never reached its end: {:?}; {}",
            pool.metrics(),
            rig.faults.diagnostics()
        );
        // The ladder holds only the steps the backend can take (here: drain,
        // and revoke if it can), so it ends after their budgets, not before.
        let budget = Duration::from_millis(if revoke { 150 } else { 50 });
        ensure!(t0.elapsed() >= budget, "the ladder ended early: {:?} (budget {budget:?})", t0.elapsed());
        let m = pool.metrics();
        let proofs = |m: &MetricsSnapshot| m.settled_completed + m.settled_revoked + m.settled_fenced;
        ensure!(
            m.quarantined == 1 && m.free == m.capacity - 1 && proofs(&m) == proofs(&m0),
            "without revoke or fence the stalled exposure must stay quarantined, saw {m:?}"
        );
        eprintln!("[{}] never_acks: no revoke, no fence; the ladder ended with the slot stuck (checked)", rig.backend);
        drop(guard);
        return Ok(());
    }
    watch_until_free(&pool, 1, t0, Duration::from_millis(150))?;
    let m = pool.metrics();
    ensure!(
        m.settled_fenced >= 1,
        "expected the fence to settle the stalled exposure, saw {m:?}; {}",
        rig.faults.diagnostics()
    );
    drop(guard);
    wait_whole(&pool)?;
    Ok(())
}

/// Watches the pool until `n` quarantined slots are freed, checking that no
/// slot is freed before `min` (the ladder's first escalation) nor without a
/// proof counted with it.
fn watch_until_free(pool: &SlotPool, n: u64, t0: Instant, min: Duration) -> Result<(), Failure> {
    let proofs = |m: &MetricsSnapshot| m.settled_completed + m.settled_revoked + m.settled_fenced;
    let m0 = pool.metrics();
    let deadline = t0 + Duration::from_secs(20);
    loop {
        let m = pool.metrics();
        // A backend may settle slot by slot (one proof per invalidation):
        // every slot freed so far needs its proof.
        let freed = m.free.saturating_sub(m0.free);
        if freed > 0 {
            ensure!(t0.elapsed() >= min, "slots were freed {:?} after the abort, before any escalation", t0.elapsed());
            ensure!(proofs(&m) >= proofs(&m0) + freed, "slots were freed without a proof: {m0:?} -> {m:?}");
            if freed >= n {
                return Ok(());
            }
        }
        ensure!(Instant::now() < deadline, "the quarantined slots were never settled: {m:?}");
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Scenario 2's configuration: `KVT_RACE_ITERS` requests per policy
/// (default 10,000) and `KVT_RACE_SEED` (default `0x5eed`).
pub fn race_config(policy: kv_transfer_core::drain::ReleasePolicy) -> kv_transfer_examples::race::RaceConfig {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    kv_transfer_examples::race::RaceConfig {
        requests: env("KVT_RACE_ITERS").unwrap_or(10_000),
        seed: env("KVT_RACE_SEED").unwrap_or(0x5eed),
        policy,
        ..kv_transfer_examples::race::RaceConfig::default()
    }
}

/// Scenario 2, positive control: under `naive` the race must show stale
/// writes landing in reassigned slots and consumers reading them, or the
/// safe run proves nothing.
pub fn race_positive_control(r: &kv_transfer_examples::race::RaceReport, wanted: u64) -> Result<(), Failure> {
    eprintln!(
        "naive: {} requests in {:.1} s ({:.0}/s), {} consumed foreign bytes, {} stale writes landed",
        r.requests, r.elapsed_s, r.requests_per_s, r.foreign_requests, r.stale_writes_landed
    );
    ensure!(r.requests >= wanted, "served {} of {wanted} requests", r.requests);
    ensure!(
        r.foreign_requests > 0 && r.stale_writes_landed > 0,
        "positive control failed: naive showed no corruption: {r:#?}"
    );
    Ok(())
}

/// Scenario 2, the contract: under `safe` no consumer reads a foreign or
/// torn byte, stale writes happened (the NIC refused them, or, where the
/// backend cannot revoke, they landed in slots still quarantined), and the
/// pool comes back whole.
pub fn race_safe(r: &kv_transfer_examples::race::RaceReport, wanted: u64) -> Result<(), Failure> {
    eprintln!(
        "safe: {} requests in {:.1} s ({:.0}/s), {} rejected at the NIC, {} landed in quarantine, {} fences, {} \
         failed transfers, peak quarantined {}",
        r.requests,
        r.elapsed_s,
        r.requests_per_s,
        r.rejected_at_nic,
        r.stale_writes_quarantined,
        r.fences,
        r.transfer_failures,
        r.peak_quarantined
    );
    ensure!(r.requests >= wanted, "served {} of {wanted} requests", r.requests);
    ensure!(r.aborted > 0 && r.reassigned > 0, "the schedule exercised nothing: {r:#?}");
    ensure!(r.foreign_requests == 0 && r.foreign_bytes == 0, "safe policy consumed foreign bytes: {r:#?}");
    ensure!(r.stale_writes_landed == 0, "a stale write landed in a reassigned slot: {r:#?}");
    ensure!(r.garbage_requests == 0, "a consumer read torn or missing bytes: {r:#?}");
    // Verbs fails kept transfers legitimately: a refused stale write puts
    // its queue pair in ERR, and the fence flushes what else was on it.
    ensure!(r.transfer_failures == 0 || r.fences > 0, "a kept request's transfer failed with no fence: {r:#?}");
    ensure!(
        r.rejected_at_nic + r.stale_writes_quarantined > 0,
        "no stale write happened (none rejected at the NIC, none landed in quarantine): {r:#?}"
    );
    ensure!(r.pool_whole(), "the pool leaked: {r:#?}");
    ensure!(r.timeouts == 0, "a bounded wait gave up: {r:#?}");
    Ok(())
}

/// Scenario 2 through `b`'s own race, under `policy`, checked.
pub fn reassignment_race(b: &dyn Backend, policy: kv_transfer_core::drain::ReleasePolicy) -> Result<(), Failure> {
    let run = b.race().map_err(|why| Failure(format!("{} has no race here: needs {why}", b.name())))?;
    let mut cfg = kv_transfer_examples::race::RaceConfig { memory: b.memory(), ..race_config(policy) };
    if let (Err(_), Some(n)) = (std::env::var("KVT_RACE_ITERS"), b.race_requests()) {
        cfg.requests = n;
    }
    let r = run(&cfg, &mut |_, _| {}).map_err(err("race"))?;
    if policy.is_naive() {
        return race_positive_control(&r, cfg.requests);
    }
    race_safe(&r, cfg.requests)?;
    // A backend that revokes refuses the stale writes at its NIC: the race
    // proved nothing about its keys or windows unless some were refused.
    ensure!(
        !b.provides().revoke || r.rejected_at_nic > 0,
        "{} revokes, yet no stale write was refused at the NIC: {r:#?}",
        b.name()
    );
    Ok(())
}
