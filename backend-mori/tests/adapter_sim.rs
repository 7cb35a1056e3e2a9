//! The MORI adapter over the TCP simulator's fabric ([`SimTransport`]):
//! bytes, settlement from inbound statuses, stale statuses, abort while a
//! write is held, a peer that never acks, a dropped handle, wrap-around.
//! Every wait is bounded.

use std::pin::Pin;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use backend_mori::harness::{sim_pair, MoriSide, PairConfig, SimPair};
use backend_mori::{EngineConfig, IoEngine, MoriEngine, SimTransport, SimTransportConfig, StatusCode, Tag};
use backend_tcp_sim::{block_on, Gate};
use kv_transfer_core::{
    EscalationLadder, Exposed, MetricsSnapshot, RemoteSlot, RemoteSlots, Settled, SlotLease, SlotPool, Transfer,
    TransferHandle, TransferOptions, TransferOutcome,
};

const LONG: Duration = Duration::from_secs(10);
const SLOT: usize = 4096;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn wait_handle(h: &mut TransferHandle, timeout: Duration) -> Option<TransferOutcome> {
    kv_transfer_core::poll_until(Pin::new(h), timeout).map(|out| out.expect("not abandoned"))
}

fn wait_settled(mut l: SlotLease<Exposed>, timeout: Duration) -> Result<SlotLease<Settled>, SlotLease<Exposed>> {
    let deadline = Instant::now() + timeout;
    loop {
        match l.try_settled() {
            Ok(s) => return Ok(s),
            Err(back) => l = back,
        }
        if Instant::now() >= deadline {
            return Err(l);
        }
        thread::sleep(Duration::from_millis(1));
    }
}

fn wait_metrics(pool: &SlotPool, timeout: Duration, f: impl Fn(&MetricsSnapshot) -> bool) -> MetricsSnapshot {
    let deadline = Instant::now() + timeout;
    loop {
        let m = pool.metrics();
        if f(&m) || Instant::now() >= deadline {
            return m;
        }
        thread::sleep(Duration::from_millis(2));
    }
}

fn pair(slots: usize) -> SimPair {
    sim_pair(&PairConfig::new(slots, SLOT)).expect("pair")
}

fn gated_pair(slots: usize, ladder: EscalationLadder) -> (SimPair, Gate) {
    let gate = Gate::closed();
    let mut cfg = PairConfig::new(slots, SLOT);
    cfg.ladder = ladder;
    let plain = cfg.clone();
    let mut gated = cfg.transport.clone();
    gated.nic.faults.gate = Some(gate.clone());
    let region = || Arc::new(kv_transfer_core::HostRegion::new(slots * SLOT).expect("region"));
    let pool = kv_transfer_core::PoolConfig::new(SLOT).with_ladder(ladder);
    let prefill =
        MoriSide::on_sim("prefill", region(), pool.clone(), plain.transport, plain.engine.clone()).expect("prefill");
    let decode = MoriSide::on_sim("decode", region(), pool, gated, plain.engine).expect("decode");
    let (decode_at_prefill, prefill_at_decode) = prefill.connect(&decode).expect("connect");
    (SimPair { prefill, decode, decode_at_prefill, prefill_at_decode }, gate)
}

fn slow_ladder() -> EscalationLadder {
    EscalationLadder { drain: Duration::from_secs(30), revoke: Duration::from_secs(30), fence: Duration::from_secs(30) }
}

#[test]
fn write_then_read_bytes_checked_through_the_adapter() {
    let p = pair(8);
    assert_eq!(p.prefill.transfer.backend(), "mori");

    // WRITE: prefill pushes two slots into decode's exposure.
    let (exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(2).unwrap(), p.prefill_at_decode).expect("expose");
    let mut src = p.prefill.pool.reserve(2).unwrap();
    src.write_at(0, 0, &pattern(SLOT, 1)).unwrap();
    src.write_at(1, 0, &pattern(SLOT, 2)).unwrap();
    let mut h = block_on(p.prefill.transfer.write(src, &remote, TransferOptions::default())).expect("post");
    let out = wait_handle(&mut h, LONG).expect("write completes");
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    let settled = wait_settled(exposed, LONG).expect("inbound statuses settle the exposure");
    let bytes = settled.bytes().unwrap();
    assert_eq!(&bytes[..SLOT], &pattern(SLOT, 1)[..]);
    assert_eq!(&bytes[SLOT..], &pattern(SLOT, 2)[..]);
    settled.release();

    // READ: prefill pulls one slot decode filled.
    let mut filled = p.decode.pool.reserve(1).unwrap();
    filled.write_at(0, 0, &pattern(SLOT, 9)).unwrap();
    let (exposed, remote) = p.decode.transfer.expose(filled, p.prefill_at_decode).expect("expose");
    let dst = p.prefill.pool.reserve(1).unwrap();
    let mut h = block_on(p.prefill.transfer.read(dst, &remote, TransferOptions::default())).expect("post");
    let out = wait_handle(&mut h, LONG).expect("read completes");
    assert_eq!(out.result, Ok(()));
    assert_eq!(out.lease.bytes().unwrap(), pattern(SLOT, 9));
    out.lease.release();
    wait_settled(exposed, LONG).expect("read settles the exposure").release();

    // A second post to a tenancy already settled by its target is refused.
    let src = p.prefill.pool.reserve(1).unwrap();
    let err = block_on(p.prefill.transfer.write(src, &remote, TransferOptions::default())).expect_err("tombstoned");
    err.lease.release();

    let s = p.decode.transfer.stats();
    assert_eq!(s.inbound_settled, 3);
    assert_eq!(s.inbound_stale, 0);
    let m = wait_metrics(&p.decode.pool, LONG, |m| m.free == 8);
    assert_eq!((m.free, m.quarantined, m.settled_completed), (8, 0, 3));
    assert_eq!(wait_metrics(&p.prefill.pool, LONG, |m| m.free == 8).free, 8);
    p.decode.pool.check_invariants().unwrap();
}

#[test]
fn foreign_pool_and_bad_descriptor_hand_the_lease_back() {
    let p = pair(4);
    let (_exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    // The decode pool is not the prefill adapter's.
    let err =
        block_on(p.prefill.transfer.write(p.decode.pool.reserve(1).unwrap(), &remote, TransferOptions::default()))
            .expect_err("foreign");
    assert_eq!(err.kind, kv_transfer_core::PostErrorKind::ForeignPool);
    err.lease.release();
    let mut bad = remote.clone();
    bad.endpoint = "127.0.0.1:1".into();
    let err = block_on(p.prefill.transfer.write(p.prefill.pool.reserve(1).unwrap(), &bad, TransferOptions::default()))
        .expect_err("not a MORI endpoint");
    assert!(matches!(err.kind, kv_transfer_core::PostErrorKind::Peer(_)), "{:?}", err.kind);
    err.lease.release();
    assert_eq!(p.prefill.pool.metrics().free, 4);
}

/// Exposes decode's first free slot, writes it through the adapters, and
/// waits until both ends are settled; returns the tenancy written.
fn write_one_and_settle(p: &SimPair) -> RemoteSlot {
    let (exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    let mut h =
        block_on(p.prefill.transfer.write(p.prefill.pool.reserve(1).unwrap(), &remote, TransferOptions::default()))
            .expect("post");
    wait_handle(&mut h, LONG).expect("done").lease.release();
    wait_settled(exposed, LONG).expect("settled").release();
    remote.slots[0]
}

/// A write under `old` (a tenancy since moved on), straight through the
/// prefill engine with a settling tag: the decode NIC refuses it.
fn late_write_is_refused(p: &SimPair, old: RemoteSlot) {
    let mem = p.decode.transfer.memory_desc(&p.decode.pool).unwrap();
    let local = p.prefill.transfer.memory_desc(&p.prefill.pool).unwrap();
    let tag = Tag::new((1 << 63) | (u64::from(mem.id) << 32) | u64::from(old.slot.0), old.generation.0);
    let uid = p.prefill.engine.allocate_transfer_unique_id();
    let st = p.prefill.engine.write(&local, 0, &mem, old.addr - mem.addr, SLOT as u64, uid, tag);
    assert_eq!(st.wait_for(LONG), StatusCode::RdmaOp, "{}", st.message());
}

#[test]
fn stale_inbound_status_is_dropped_and_counted() {
    let p = pair(1);
    // First tenancy of decode's only slot: written and settled.
    let old = write_one_and_settle(&p);

    // Second tenancy of the same slot, exposed again.
    let (exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    assert_eq!(remote.slots[0].slot, old.slot);
    assert!(remote.slots[0].generation > old.generation);

    // A late write under the old generation, straight through the engine:
    // the simulated NIC rejects it, and its (failed) inbound status names a
    // stale tenancy, so the target drops it.
    late_write_is_refused(&p, old);
    let s = {
        let deadline = Instant::now() + LONG;
        loop {
            let s = p.decode.transfer.stats();
            if s.inbound_stale > 0 || Instant::now() > deadline {
                break s;
            }
            thread::sleep(Duration::from_millis(2));
        }
    };
    assert_eq!(s.inbound_stale, 1);
    let nic = p.decode.transport.nic().unwrap().stats();
    assert!(nic.rejected_stale_generation >= 1, "{nic:?}");
    assert!(p.decode.pool.metrics().stale_rejected >= 1);
    // The current exposure is untouched by the stale status...
    let exposed = exposed.try_settled().expect_err("not settled by a stale status");
    // ...and settles with its own write.
    let mut h =
        block_on(p.prefill.transfer.write(p.prefill.pool.reserve(1).unwrap(), &remote, TransferOptions::default()))
            .expect("post");
    assert_eq!(wait_handle(&mut h, LONG).expect("done").result, Ok(()));
    wait_settled(exposed, LONG).expect("settled").release();
}

/// A one-segment WRITE's success notification rides with its data (the
/// simulator's WRITE_IMM): the initiator's NIC sends no message for it, and
/// the target files it once. A refused write delivers no immediate; the
/// engine then sends the failure itself, under the number it had taken.
#[test]
fn a_carried_notification_arrives_once_and_a_failure_goes_under_its_number() {
    let p = pair(1);
    let nic_messages = |side: &MoriSide| {
        let s = side.transport.nic().unwrap().stats();
        (s.messages_sent, s.messages_received)
    };
    let old = write_one_and_settle(&p);
    assert_eq!(nic_messages(&p.prefill).0, 0, "no separate message for a carried notification");
    assert_eq!(nic_messages(&p.decode).1, 1, "the immediate, once");
    let (sent, got) = (p.prefill.engine.stats(), p.decode.engine.stats());
    assert_eq!((sent.notifications_sent, got.notifications_received, got.notifications_duplicate), (1, 1, 0));

    // A write under a stale generation: refused, so no immediate; the
    // failure goes as a message, and nothing is counted twice.
    let (_exposed, _remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    late_write_is_refused(&p, old);
    let deadline = Instant::now() + LONG;
    while p.decode.engine.stats().notifications_received < 2 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(nic_messages(&p.prefill).0, 1, "the failure, as a message");
    let (sent, got) = (p.prefill.engine.stats(), p.decode.engine.stats());
    assert_eq!((sent.notifications_sent, got.notifications_received, got.notifications_duplicate), (2, 2, 0));
}

#[test]
fn abort_while_a_write_is_held_keeps_the_slot_until_the_write_is_over() {
    let (p, gate) = gated_pair(2, slow_ladder());
    let (exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    let slot = remote.slots[0].slot;
    let mut src = p.prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &pattern(SLOT, 5)).unwrap();
    let mut h = block_on(p.prefill.transfer.write(src, &remote, TransferOptions::default())).expect("post");
    assert!(gate.wait_for_waiting(1, LONG), "write reached the target NIC and waits at the gate");

    // Decode gives up on the request: the slot is quarantined, ABORT goes out.
    exposed.abort();
    let deadline = Instant::now() + LONG;
    while p.prefill.transfer.stats().aborts_received == 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.prefill.transfer.stats().aborts_received, 1);
    // The initiator's write is not terminal: no ack, and the slot stays out of the pool.
    thread::sleep(Duration::from_millis(200));
    assert_eq!(p.prefill.transfer.stats().abort_acks_sent, 0);
    let m = p.decode.pool.metrics();
    assert_eq!((m.quarantined, m.free), (1, 1));
    assert!(!p.decode.pool.slot_is_free(slot));
    let other = p.decode.pool.reserve(1).unwrap();
    assert_ne!(other.tenancies()[0].slot, slot, "the quarantined slot is not handed out");
    assert!(p.decode.pool.reserve(1).is_err());
    other.release();
    assert!(wait_handle(&mut h, Duration::from_millis(50)).is_none());

    // The write lands. The notification riding behind its data settles the
    // slot (`Completed`), and its terminal status lets the initiator ack
    // (whichever reaches the target first frees the slot; the other is stale).
    gate.open();
    let out = wait_handle(&mut h, LONG).expect("write completes");
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    let m = wait_metrics(&p.decode.pool, LONG, |m| m.free == 2);
    assert_eq!((m.free, m.quarantined), (2, 0));
    let deadline = Instant::now() + LONG;
    while p.prefill.transfer.stats().abort_acks_sent == 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.prefill.transfer.stats().abort_acks_sent, 1);
    assert!(m.settled_completed >= 1 && m.settled_revoked == 0 && m.settled_fenced == 0, "{m:?}");
    p.decode.pool.check_invariants().unwrap();
}

#[test]
fn a_peer_that_never_acks_is_revoked_never_timed_out() {
    let ladder = EscalationLadder {
        drain: Duration::from_millis(300),
        revoke: Duration::from_secs(30),
        fence: Duration::from_secs(30),
    };
    let mut cfg = PairConfig::new(2, SLOT);
    cfg.ladder = ladder;
    let decode = MoriSide::on_sim(
        "decode",
        Arc::new(kv_transfer_core::HostRegion::new(2 * SLOT).unwrap()),
        kv_transfer_core::PoolConfig::new(SLOT).with_ladder(ladder),
        SimTransportConfig::default(),
        EngineConfig::default(),
    )
    .expect("decode");
    // The peer is a bare engine with no adapter: control messages reach it
    // and are dropped, it never answers ABORT.
    let silent = Arc::new(
        MoriEngine::new("prefill", EngineConfig::default(), SimTransport::new(SimTransportConfig::default()))
            .expect("engine"),
    );
    let peer = decode.transfer.add_peer(&silent.engine_desc()).expect("peer");
    silent.register_remote_engine(&decode.engine.engine_desc()).expect("silent knows decode");

    let (exposed, _remote) = decode.transfer.expose(decode.pool.reserve(2).unwrap(), peer).expect("expose");
    let t0 = Instant::now();
    exposed.abort();
    thread::sleep(Duration::from_millis(150));
    assert_eq!(decode.pool.metrics().quarantined, 2, "no timer frees before the drain deadline");
    assert_eq!(decode.transfer.stats().aborts_sent, 1);
    let m = wait_metrics(&decode.pool, LONG, |m| m.free == 2);
    assert!(t0.elapsed() >= ladder.drain);
    assert_eq!((m.free, m.quarantined, m.settled_revoked, m.settled_completed), (2, 0, 2, 0), "{m:?}");
    assert_eq!(decode.transfer.stats().revoked, 2);
    // The binding is gone at the NIC: nothing can land under those generations.
    assert!(decode.transport.nic().unwrap().stats().revocations >= 2);
}

#[test]
fn a_dropped_handle_returns_its_lease_only_after_completion() {
    let (p, gate) = gated_pair(2, slow_ladder());
    let (exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    let h = block_on(p.prefill.transfer.write(p.prefill.pool.reserve(1).unwrap(), &remote, TransferOptions::default()))
        .expect("post");
    assert!(gate.wait_for_waiting(1, LONG));
    h.cancel(); // MORI has no cancel: a request only.
    drop(h);
    thread::sleep(Duration::from_millis(100));
    let m = p.prefill.pool.metrics();
    assert_eq!((m.free, m.leased, m.quarantined), (1, 1, 0), "the drain table holds the lease");
    assert_eq!(p.prefill.transfer.stats().ops_draining, 1);
    gate.open();
    let m = wait_metrics(&p.prefill.pool, LONG, |m| m.free == 2);
    assert_eq!((m.free, m.leased, m.quarantined), (2, 0, 0));
    assert_eq!(p.prefill.transfer.stats().ops_draining, 0);
    wait_settled(exposed, LONG).expect("target settled").release();
}

#[test]
fn wrap_around_of_uids_and_sequence_numbers() {
    let mut cfg = PairConfig::new(8, SLOT);
    cfg.engine = EngineConfig { uid_start: u64::MAX - 3, notif_seq_start: u32::MAX - 3, ..EngineConfig::default() };
    let p = sim_pair(&cfg).expect("pair");
    for round in 0..3u8 {
        let (exposed, remote) =
            p.decode.transfer.expose(p.decode.pool.reserve(4).unwrap(), p.prefill_at_decode).expect("expose");
        let mut src = p.prefill.pool.reserve(4).unwrap();
        for i in 0..4 {
            src.write_at(i, 0, &pattern(SLOT, round * 4 + i as u8)).unwrap();
        }
        let mut h = block_on(p.prefill.transfer.write(src, &remote, TransferOptions::default())).expect("post");
        let out = wait_handle(&mut h, LONG).expect("done");
        assert_eq!(out.result, Ok(()));
        out.lease.release();
        let s = wait_settled(exposed, LONG).expect("settled across the wrap");
        for i in 0..4 {
            let mut b = vec![0u8; SLOT];
            s.read_at(i, 0, &mut b).unwrap();
            assert_eq!(b, pattern(SLOT, round * 4 + i as u8));
        }
        s.release();
    }
    let e = p.decode.engine.stats();
    assert_eq!((e.notifications_received, e.notifications_duplicate, e.notifications_skipped), (12, 0, 0));
}

#[test]
fn a_late_write_after_revocation_never_lands_in_the_next_tenancy() {
    let ladder = EscalationLadder {
        drain: Duration::from_millis(100),
        revoke: Duration::from_secs(30),
        fence: Duration::from_secs(30),
    };
    let (p, gate) = gated_pair(2, ladder);
    // Request 1: decode exposes its only slot; prefill's write is held in flight.
    let (exposed, remote1) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    let mut a = p.prefill.pool.reserve(1).unwrap();
    a.write_at(0, 0, &vec![0xAA; SLOT]).unwrap();
    let mut late = block_on(p.prefill.transfer.write(a, &remote1, TransferOptions::default())).expect("post");
    assert!(gate.wait_for_waiting(1, LONG));

    // Request 1 is aborted. The initiator cannot ack (its write is not
    // terminal), so the ladder revokes: the NIC confirms, the slot is free.
    exposed.abort();
    let m = wait_metrics(&p.decode.pool, LONG, |m| m.free == 2);
    assert_eq!((m.free, m.settled_revoked), (2, 1), "{m:?}");

    // Request 2 gets the same slot under a new generation and its own write.
    let (exposed2, remote2) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    assert_eq!(remote2.slots[0].slot, remote1.slots[0].slot);
    let mut b = p.prefill.pool.reserve(1).unwrap();
    b.write_at(0, 0, &vec![0xBB; SLOT]).unwrap();
    let mut fresh = block_on(p.prefill.transfer.write(b, &remote2, TransferOptions::default())).expect("post");

    // The late write arrives first: the NIC rejects its stale generation.
    gate.open();
    let out = wait_handle(&mut late, LONG).expect("late write terminal");
    assert!(out.result.is_err(), "the late write failed honestly: {:?}", out.result);
    out.lease.release();
    let out = wait_handle(&mut fresh, LONG).expect("fresh write terminal");
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    let s = wait_settled(exposed2, LONG).expect("request 2 settles");
    assert_eq!(s.bytes().unwrap(), vec![0xBB; SLOT], "request 2 never sees request 1's bytes");
    s.release();
    assert!(p.decode.transport.nic().unwrap().stats().rejected_stale_generation >= 1);
}

#[test]
fn a_crashed_peer_is_fenced_when_its_connection_is_lost() {
    let gate = Gate::new();
    let mut cfg = PairConfig::new(4, SLOT);
    cfg.ladder = slow_ladder();
    cfg.decode_gate = Some(gate.clone());
    let p = sim_pair(&cfg).expect("pair");
    gate.hold();
    let (exposed, remote) =
        p.decode.transfer.expose(p.decode.pool.reserve(4).unwrap(), p.prefill_at_decode).expect("expose");
    // Two of the four slots are written; the other two only a fence can settle.
    let written = RemoteSlots { slots: remote.slots[..2].to_vec(), ..remote.clone() };
    let _h =
        block_on(p.prefill.transfer.write(p.prefill.pool.reserve(2).unwrap(), &written, TransferOptions::default()))
            .expect("post");
    assert!(gate.wait_for_waiting(1, LONG));
    exposed.abort();
    assert_eq!(p.decode.pool.metrics().quarantined, 4);
    // The prefill process dies; the decode NIC sees the connection drop,
    // tears it down (joined) and the adapter settles with `Fenced`. A write
    // the NIC had received whole before it noticed may still land, and then
    // its notification (which rides behind it) settles that slot `Completed`.
    p.prefill.transport.crash();
    gate.open();
    let m = wait_metrics(&p.decode.pool, LONG, |m| m.free == 4);
    assert_eq!((m.free, m.quarantined, m.settled_fenced + m.settled_completed), (4, 0, 4), "{m:?}");
    assert!(m.settled_fenced >= 2 && m.settled_completed <= 2, "{m:?}");
    assert_eq!(p.decode.transfer.stats().peers_lost, 1);
    // Nothing of the dead peer lands in the next tenancy.
    let lease = p.decode.pool.reserve(4).unwrap();
    thread::sleep(Duration::from_millis(50));
    assert!(lease.tenancies().iter().all(|t| remote.slots.iter().any(|s| s.slot == t.slot)));
}

#[test]
fn hostile_a_stalled_write_across_the_revoke_deadline_is_fenced_not_freed() {
    use backend_tcp_sim::wire::{self, Body};
    use backend_tcp_sim::RawAccess;
    use std::io::{Read, Write};

    let mut cfg = PairConfig::new(2, SLOT);
    cfg.ladder = EscalationLadder {
        drain: Duration::from_millis(50),
        revoke: Duration::from_millis(50),
        fence: Duration::from_secs(30),
    };
    cfg.transport.nic.revoke_wait = Duration::from_millis(200);
    let p = sim_pair(&cfg).expect("pair");
    let nic = p.decode.transport.nic().unwrap().clone();

    // A raw wire client says HELLO and becomes a peer of the decode side.
    let mut s = std::net::TcpStream::connect(nic.endpoint()).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    wire::authenticate_dialed(
        &mut s,
        &kv_transfer_core::auth::ClusterKey::from_env().expect("the deployment's cluster key"),
        "staller",
        "127.0.0.1:9",
        nic.endpoint(),
    )
    .unwrap();
    let hello = wire::encode_head(&Body::Hello { name: "staller".into(), endpoint: "127.0.0.1:9".into() }, 0).unwrap();
    s.write_all(&hello).unwrap();
    let mut pre = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut pre).unwrap();
    let mut f = vec![0u8; wire::decode_prefix(&pre).unwrap().fields_len()];
    s.read_exact(&mut f).unwrap();
    assert!(nic.wait_for_peer("staller", LONG).is_some());
    let peer = p.decode.transfer.add_peer(&backend_mori::harness::raw_sim_peer_desc("staller", "127.0.0.1:9")).unwrap();

    // It starts a WRITE into the exposed slot and stalls halfway.
    let (exposed, remote) = p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), peer).expect("expose");
    let h = RawAccess::of(&remote, 0).unwrap().header(1, SLOT as u32);
    s.write_all(&wire::encode_head(&Body::Write(h), SLOT).unwrap()).unwrap();
    s.write_all(&vec![0x5a; SLOT / 2]).unwrap();
    thread::sleep(Duration::from_millis(50));

    // ABORT cannot reach it, revocation cannot drain the half-applied write:
    // only the fence settles.
    exposed.abort();
    let m = wait_metrics(&p.decode.pool, LONG, |m| m.free == 2);
    assert_eq!((m.free, m.quarantined, m.settled_fenced, m.settled_revoked), (2, 0, 1, 0), "{m:?}");
    assert_eq!(p.decode.transfer.stats().fences, 1);
    assert!(nic.stats().revocations_timed_out >= 1);
    drop(s);
}

#[test]
fn raw_notifications_settle_only_their_own_current_tenancies() {
    use backend_mori::harness::{settle_tag, RawMoriPeer};
    use kv_transfer_core::{Generation, Tenancy};

    let p = pair(4);
    let mut raw = RawMoriPeer::connect("raw", &p.decode.engine.engine_desc()).expect("raw peer");
    let rp = p.decode.transfer.add_peer(raw.desc()).expect("add raw peer");
    let mem = p.decode.transfer.memory_desc(&p.decode.pool).unwrap().id;
    let (to_raw, remote) = p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), rp).expect("expose");
    let (to_prefill, remote_p) =
        p.decode.transfer.expose(p.decode.pool.reserve(1).unwrap(), p.prefill_at_decode).expect("expose");
    let t = remote.slots[0].tenancy();
    let old = Tenancy::new(t.slot, Generation(t.generation.0 - 1));
    let future = Tenancy::new(t.slot, Generation(t.generation.0 + 1));
    for bad in [old, future, remote_p.slots[0].tenancy()] {
        raw.notify(StatusCode::Success, settle_tag(mem, bad)).unwrap();
    }
    raw.notify(StatusCode::Unknown(42), settle_tag(mem, t)).unwrap();
    let deadline = Instant::now() + LONG;
    while p.decode.transfer.stats().inbound_stale + p.decode.transfer.stats().inbound_unknown < 4
        && Instant::now() < deadline
    {
        thread::sleep(Duration::from_millis(2));
    }
    let s = p.decode.transfer.stats();
    assert_eq!((s.inbound_stale, s.inbound_unknown, s.inbound_settled), (3, 1, 0), "{s:?}");
    let to_raw = to_raw.try_settled().expect_err("nothing proven yet");
    let to_prefill = to_prefill.try_settled().expect_err("another peer's tenancy is not settled by this one");
    // Its own, current tenancy settles; a replay of it is stale.
    raw.notify(StatusCode::Success, settle_tag(mem, t)).unwrap();
    raw.notify(StatusCode::Success, settle_tag(mem, t)).unwrap();
    wait_settled(to_raw, LONG).expect("settled by its own notification").release();
    let deadline = Instant::now() + LONG;
    while p.decode.transfer.stats().inbound_stale < 4 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.decode.transfer.stats().inbound_stale, 4);
    assert!(p.decode.pool.metrics().stale_rejected >= 4);
    drop(to_prefill);
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<backend_mori::MoriTransfer>();
    check::<backend_mori::harness::LoopbackRig>();
    check::<backend_mori::harness::SimPair>();
    let rig = backend_mori::harness::LoopbackRig::new(2, SLOT).expect("rig");
    let t: Arc<dyn Transfer> = Arc::new(rig.transfer());
    let mut h = block_on(t.write(
        rig.initiator_pool().reserve(1).unwrap(),
        &rig.remote().clone(),
        TransferOptions::notify(false),
    ))
    .expect_err("two slots exposed, one written: shapes differ");
    h.lease.write_at(0, 0, &[1]).unwrap();
    drop(h);
    rig.teardown();
}

/// Rule 8: registered memory outlives every binding that can touch it.
/// In every order of dropping the adapter, its pool, the engine and its
/// transport, the region stays allocated while the transport (the simulated
/// NIC, which binds it by address) lives, so a peer's late write can never
/// land in freed memory; once everything is dropped it is freed (nothing
/// leaks).
#[test]
fn hostile_memory_outlives_its_binding_whatever_is_dropped_first() {
    use kv_transfer_core::{HostRegion, PoolConfig};
    const PARTS: [&str; 4] = ["adapter", "pool", "engine", "transport"];
    for order in permutations(4) {
        let region: Arc<dyn kv_transfer_core::Region> = Arc::new(HostRegion::new(4 * SLOT).unwrap());
        let weak = Arc::downgrade(&region);
        let side = MoriSide::on_sim(
            "lifetime",
            region,
            PoolConfig::new(SLOT),
            SimTransportConfig::default(),
            EngineConfig::default(),
        )
        .expect("side");
        let MoriSide { transfer, pool, engine, transport } = side;
        let mut parts: Vec<Option<Box<dyn std::any::Any>>> =
            vec![Some(Box::new(transfer)), Some(Box::new(pool)), Some(Box::new(engine)), Some(Box::new(transport))];
        for &i in &order {
            drop(parts[i].take());
            if parts[3].is_some() {
                let named: Vec<&str> = order.iter().map(|&k| PARTS[k]).collect();
                assert!(weak.upgrade().is_some(), "order {named:?}: the region was freed while the NIC binds it");
            }
        }
        // Threads that held a reference (the driver, the NIC's) exit shortly after.
        let deadline = Instant::now() + LONG;
        while weak.upgrade().is_some() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(2));
        }
        assert!(weak.upgrade().is_none(), "order {order:?}: the region leaked after everything was dropped");
    }
}

/// Every order of `0..n` (Heap's algorithm; n! of them, n is small here).
fn permutations(n: usize) -> Vec<Vec<usize>> {
    fn heap(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if k <= 1 {
            out.push(a.clone());
            return;
        }
        for i in 0..k {
            heap(k - 1, a, out);
            let j = if k % 2 == 0 { i } else { 0 };
            a.swap(j, k - 1);
        }
    }
    let mut out = Vec::new();
    heap(n, &mut (0..n).collect(), &mut out);
    out
}
