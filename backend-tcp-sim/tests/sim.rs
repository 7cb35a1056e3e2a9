//! Behaviour of the simulated fabric over loopback. Every wait is bounded.

use backend_tcp_sim::wire::{self, Body, DecodeError, WireStatus};
use backend_tcp_sim::{
    block_on, DelayDist, DropSpec, FaultPlan, Gate, InboundEvent, NicConfig, NicError, RawAccess, RawCompletions,
    ReleasePolicy, SimNic,
};
use bytes::Bytes;
use kv_transfer_core::{
    EscalationLadder, Exposed, Generation, HostRegion, PeerId, PoolConfig, RejectReason, RemoteSlots, SlotLease,
    SlotPool, Transfer, TransferError, TransferOptions,
};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOT: usize = 4096;
const SLOTS: usize = 8;
const WAIT: Duration = Duration::from_secs(10);

struct Pair {
    target: SimNic,
    tpool: SlotPool,
    init: SimNic,
    ipool: SlotPool,
    /// The initiator as the target numbers it.
    peer: PeerId,
}

fn ladder() -> EscalationLadder {
    EscalationLadder {
        drain: Duration::from_millis(150),
        revoke: Duration::from_millis(150),
        fence: Duration::from_millis(500),
    }
}

fn pair_with(target_cfg: NicConfig, init_cfg: NicConfig) -> Pair {
    let target = SimNic::start(target_cfg).unwrap();
    let tpool = target
        .register_pool(Arc::new(HostRegion::new(SLOTS * SLOT).unwrap()), PoolConfig::new(SLOT).with_ladder(ladder()))
        .unwrap();
    let init = SimNic::start(init_cfg).unwrap();
    let ipool = init
        .register_pool(Arc::new(HostRegion::new(SLOTS * SLOT).unwrap()), PoolConfig::new(SLOT).with_ladder(ladder()))
        .unwrap();
    init.connect(target.endpoint()).unwrap();
    let peer = target.wait_for_peer(init.name(), WAIT).unwrap();
    Pair { target, tpool, init, ipool, peer }
}

fn pair() -> Pair {
    pair_with(NicConfig::new("decode"), NicConfig::new("prefill"))
}

fn region_bytes(pool: &SlotPool) -> Vec<u8> {
    let mut v = vec![0u8; pool.region().len()];
    pool.region().read(0, &mut v).unwrap();
    v
}

fn checksum(pool: &SlotPool) -> u64 {
    // FNV-1a over the whole region.
    region_bytes(pool).iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

fn slot_bytes(pool: &SlotPool, slot: u32) -> Vec<u8> {
    let mut v = vec![0u8; pool.slot_size()];
    pool.region().read(slot as usize * pool.slot_size(), &mut v).unwrap();
    v
}

fn filled(pool: &SlotPool, n: usize, byte: u8) -> SlotLease<kv_transfer_core::Reserved> {
    let mut l = pool.reserve(n).unwrap();
    for i in 0..n {
        l.write_at(i, 0, &vec![byte.wrapping_add(i as u8); pool.slot_size()]).unwrap();
    }
    l
}

fn wait_until(what: &str, f: impl FnMut() -> bool) {
    kv_transfer_testkit::wait::wait_for(what, WAIT, f);
}

fn settle_within(lease: SlotLease<Exposed>) -> SlotLease<kv_transfer_core::Settled> {
    let deadline = Instant::now() + WAIT;
    let mut l = lease;
    loop {
        match l.try_settled() {
            Ok(s) => return s,
            Err(back) => l = back,
        }
        assert!(Instant::now() < deadline, "exposure never settled");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn write_multi_slot_then_read_back() {
    let p = pair();
    let (exposed, remote) = p.target.expose(p.tpool.reserve(3).unwrap(), p.peer).unwrap();
    let src = filled(&p.ipool, 3, 0x10);
    let out = block_on(async { p.init.write(src, &remote, TransferOptions::default()).await.unwrap().await }).unwrap();
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    // The NOTIFY settled the exposure with Completed.
    let settled = block_on(exposed.settled());
    let bytes = settled.bytes().unwrap();
    for i in 0..3 {
        assert!(bytes[i * SLOT..(i + 1) * SLOT].iter().all(|&b| b == 0x10 + i as u8));
    }
    assert_eq!(p.tpool.metrics().settled_completed, 3);
    assert!(matches!(p.target.next_event(WAIT), Some(InboundEvent::PeerConnected { .. })));
    assert!(
        matches!(p.target.next_event(WAIT), Some(InboundEvent::Notified { tenancies, .. }) if tenancies.len() == 3)
    );

    // READ: the target exposes those bytes again (same tenancy is gone: a new lease).
    drop(settled);
    let mut l = p.tpool.reserve(2).unwrap();
    l.write_at(0, 0, &[0xA1; SLOT]).unwrap();
    l.write_at(1, 0, &[0xA2; SLOT]).unwrap();
    let (exposed, remote) = p.target.expose(l, p.peer).unwrap();
    let dst = p.ipool.reserve(2).unwrap();
    let out = block_on(async { p.init.read(dst, &remote, TransferOptions::default()).await.unwrap().await }).unwrap();
    assert_eq!(out.result, Ok(()));
    let got = out.lease.bytes().unwrap();
    assert!(got[..SLOT].iter().all(|&b| b == 0xA1) && got[SLOT..].iter().all(|&b| b == 0xA2));
    settle_within(exposed).release();
    let s = p.target.stats();
    assert_eq!((s.writes_applied, s.reads_served, s.notifications_received), (3, 2, 2));
    assert_eq!(p.ipool.check_invariants(), Ok(()));
    assert_eq!(p.tpool.check_invariants(), Ok(()));
}

#[test]
fn bad_accesses_are_typed_and_write_nothing() {
    let p = pair_with(NicConfig::new("decode").with_max_wr_bytes(SLOT as u32), NicConfig::new("prefill"));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(2).unwrap(), p.peer).unwrap();
    let init_peer = p.init.connect(p.target.endpoint()).unwrap();
    let before = checksum(&p.tpool);
    let good = RawAccess::of(&remote, 0).unwrap();
    let other = RawAccess::of(&remote, 1).unwrap();
    let region_end = p.tpool.region().addr() + p.tpool.region().len() as u64;
    let cases: Vec<(&str, RawAccess, Bytes, RejectReason)> = vec![
        (
            "unknown key",
            RawAccess { key: good.key ^ 0xdead, ..good },
            Bytes::from(vec![1; 64]),
            RejectReason::UnknownKey,
        ),
        ("zero length", good, Bytes::new(), RejectReason::ZeroLength),
        ("oversize", good, Bytes::from(vec![1; SLOT + 1]), RejectReason::Oversize),
        (
            "out of region",
            RawAccess { addr: region_end - 8, ..good },
            Bytes::from(vec![1; 64]),
            RejectReason::OutOfBounds,
        ),
        ("below region", RawAccess { addr: 0, ..good }, Bytes::from(vec![1; 64]), RejectReason::OutOfBounds),
        (
            "other slot's range",
            RawAccess { addr: other.addr, ..good },
            Bytes::from(vec![1; 64]),
            RejectReason::OutOfBounds,
        ),
        (
            "straddles slots",
            RawAccess { addr: good.addr + SLOT as u64 - 8, ..good },
            Bytes::from(vec![1; 64]),
            RejectReason::OutOfBounds,
        ),
        (
            "stale generation",
            RawAccess { generation: Generation(good.generation.0 + 1), ..good },
            Bytes::from(vec![1; 64]),
            RejectReason::StaleGeneration,
        ),
        (
            "never exposed slot",
            RawAccess { addr: good.addr + 4 * SLOT as u64, slot: kv_transfer_core::SlotId(good.slot.0 + 4), ..good },
            Bytes::from(vec![1; 64]),
            RejectReason::StaleGeneration,
        ),
    ];
    for (what, access, data, reason) in cases {
        let h = p.init.write_raw(init_peer, access, data).unwrap();
        assert_eq!(h.wait(WAIT), Some(Err(TransferError::Rejected(reason))), "{what}");
        assert_eq!(checksum(&p.tpool), before, "{what}: region changed");
        // Reads are checked the same way.
        let h = p.init.read_raw(init_peer, access, 64).unwrap();
        let want = if reason == RejectReason::ZeroLength || reason == RejectReason::Oversize {
            // A 64-byte read is neither zero-length nor oversize: it is fine
            // at a good address.
            Ok(Some(Bytes::from(vec![0u8; 64])))
        } else {
            Err(TransferError::Rejected(reason))
        };
        assert_eq!(h.wait(WAIT), Some(want), "{what} (read)");
    }
    let s = p.target.stats();
    assert_eq!(s.rejected_unknown_key, 2);
    assert_eq!(s.rejected_zero_length, 1);
    assert_eq!(s.rejected_oversize, 1);
    assert_eq!(s.rejected_out_of_bounds, 8);
    assert_eq!(s.rejected_stale_generation, 4);
    assert_eq!(s.writes_applied, 0);
    // The good access still works and the connection survived every rejection.
    let h = p.init.write_raw(init_peer, good, Bytes::from(vec![7; 64])).unwrap();
    assert_eq!(h.wait(WAIT), Some(Ok(None)));
    assert_eq!(&slot_bytes(&p.tpool, good.slot.0)[..64], &[7; 64]);
    p.target.revoke(&exposed);
    settle_within(exposed).release();
}

/// Opens a raw socket to `nic` and completes the handshake.
fn raw_conn(nic: &SimNic) -> TcpStream {
    let mut s = TcpStream::connect(nic.endpoint()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    wire::authenticate_dialed(
        &mut s,
        &kv_transfer_core::auth::ClusterKey::from_env().expect("the deployment's cluster key"),
        "raw",
        "127.0.0.1:1",
        nic.endpoint(),
    )
    .unwrap();
    let hello = wire::encode_head(&Body::Hello { name: "raw".into(), endpoint: "127.0.0.1:1".into() }, 0).unwrap();
    s.write_all(&hello).unwrap();
    let mut pre = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut pre).unwrap();
    let pf = wire::decode_prefix(&pre).unwrap();
    let mut f = vec![0u8; pf.fields_len()];
    s.read_exact(&mut f).unwrap();
    assert!(matches!(wire::decode_fields(&pf, &f), Ok(Body::Hello { .. })));
    s
}

#[test]
fn malformed_frames_on_the_socket_are_typed_errors() {
    let p = pair();
    let (_exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let before = checksum(&p.tpool);
    let good = RawAccess::of(&remote, 0).unwrap();
    let hdr = good.header(1, 16);
    let mut write16 = wire::encode_head(&Body::Write(hdr), 16).unwrap();
    write16.extend_from_slice(&[0xEE; 16]);

    let mut bad_magic = write16.clone();
    bad_magic[0] = 0;
    let mut unknown_kind = write16.clone();
    unknown_kind[2] = 0x7f;
    let mut oversize = write16.clone();
    oversize[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut short_len = write16.clone();
    short_len[4..8].copy_from_slice(&3u32.to_le_bytes());
    let mut flags = write16.clone();
    flags[3] = 1;
    type Check = fn(&DecodeError) -> bool;
    let cases: Vec<(&str, Vec<u8>, Check)> = vec![
        ("bad magic", bad_magic, |e| matches!(e, DecodeError::BadMagic(_))),
        ("unknown kind", unknown_kind, |e| matches!(e, DecodeError::UnknownKind(0x7f))),
        ("oversize", oversize, |e| matches!(e, DecodeError::Oversize { .. })),
        ("short length", short_len, |e| matches!(e, DecodeError::BadLength { .. })),
        ("flags", flags, |e| matches!(e, DecodeError::BadFlags(1))),
    ];
    for (i, (what, bytes, check)) in cases.into_iter().enumerate() {
        let mut s = raw_conn(&p.target);
        s.write_all(&bytes).unwrap();
        // The NIC tears the connection down: EOF.
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        wait_until(what, || p.target.stats().malformed_frames == i as u64 + 1);
        let e = p.target.last_decode_error().unwrap();
        assert!(check(&e), "{what}: got {e:?}");
        assert_eq!(checksum(&p.tpool), before, "{what}: region changed");
    }
    // Truncated mid-payload: the connection ends, nothing counts as applied.
    let mut s = raw_conn(&p.target);
    s.write_all(&write16[..write16.len() - 5]).unwrap();
    drop(s);
    // A well-formed WRITE on a raw connection is still refused: the slot is
    // exposed to another connection.
    let mut s = raw_conn(&p.target);
    s.write_all(&write16).unwrap();
    let mut pre = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut pre).unwrap();
    let pf = wire::decode_prefix(&pre).unwrap();
    let mut f = vec![0u8; pf.fields_len()];
    s.read_exact(&mut f).unwrap();
    assert_eq!(
        wire::decode_fields(&pf, &f).unwrap(),
        Body::Completion { wr_id: 1, status: WireStatus::Rejected(RejectReason::UnknownKey) }
    );
    // (The truncated frame was refused for the same reason before its payload ran out.)
    wait_until("both raw writes refused", || p.target.stats().rejected_wrong_peer == 2);
    assert_eq!(p.target.stats().writes_applied, 0);
    assert_eq!(checksum(&p.tpool), before);
}

#[test]
fn revoke_then_held_write_is_rejected_and_not_applied() {
    let gate = Gate::closed();
    let faults = FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode").with_faults(faults), NicConfig::new("prefill"));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let slot = remote.slots[0].slot.0;
    let h = block_on(p.init.write(filled(&p.ipool, 1, 0xAA), &remote, TransferOptions::default())).unwrap();
    assert!(gate.wait_for_waiting(1, WAIT));
    assert_eq!(p.target.revoke(&exposed), 1);
    settle_within(exposed).release();
    assert_eq!(p.tpool.metrics().settled_revoked, 1);
    // The slot is reused by a new tenant, exposed to the same peer.
    let mut l = p.tpool.reserve(1).unwrap();
    assert_eq!(l.tenancies()[0].slot.0, slot);
    l.write_at(0, 0, &[0x55; SLOT]).unwrap();
    let (exposed2, _remote2) = p.target.expose(l, p.peer).unwrap();
    gate.open();
    let out = block_on(h).unwrap();
    assert_eq!(out.result, Err(TransferError::Rejected(RejectReason::StaleGeneration)));
    assert!(slot_bytes(&p.tpool, slot).iter().all(|&b| b == 0x55), "late write landed in the new tenancy");
    assert_eq!(p.target.stats().rejected_stale_generation, 1);
    assert_eq!(p.target.stats().writes_applied, 0);
    p.target.revoke(&exposed2);
    settle_within(exposed2).release();
}

#[test]
fn fence_settles_every_exposure_to_the_peer() {
    let gate = Gate::closed();
    let faults = FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode").with_faults(faults), NicConfig::new("prefill"));
    let (e1, r1) = p.target.expose(p.tpool.reserve(2).unwrap(), p.peer).unwrap();
    let (e2, _r2) = p.target.expose(p.tpool.reserve(3).unwrap(), p.peer).unwrap();
    let h = block_on(p.init.write(filled(&p.ipool, 2, 1), &r1, TransferOptions::default())).unwrap();
    assert!(gate.wait_for_waiting(1, WAIT));
    assert!(p.target.fence(p.peer));
    // Every exposure to that peer is proven at once.
    settle_within(e1).release();
    settle_within(e2).release();
    assert_eq!(p.tpool.metrics().settled_fenced, 5);
    assert_eq!(p.tpool.metrics().free, SLOTS as u64);
    // The held write was dropped with the connection; the initiator fails and fences too.
    let out = block_on(h).unwrap();
    assert!(matches!(out.result, Err(TransferError::Transport(_))), "{:?}", out.result);
    out.lease.release();
    assert_eq!(p.target.stats().writes_applied, 0);
    assert!(region_bytes(&p.tpool).iter().all(|&b| b == 0));
    wait_until("initiator fenced", || p.init.stats().fences == 1);
    gate.open();
}

/// Abort while the peer's write is held at the target's gate.
/// Returns whether the late write corrupted the slot's next tenant.
fn abort_with_held_write(policy: ReleasePolicy) -> bool {
    let gate = Gate::closed();
    let faults = FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode").with_faults(faults).with_policy(policy), NicConfig::new("prefill"));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let slot = remote.slots[0].slot.0;
    let h = block_on(p.init.write(filled(&p.ipool, 1, 0xAA), &remote, TransferOptions::default())).unwrap();
    assert!(gate.wait_for_waiting(1, WAIT));
    exposed.abort();
    if policy == ReleasePolicy::Safe {
        // Not free: a NIC may still write.
        assert_eq!(p.tpool.metrics().quarantined, 1);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(p.tpool.metrics().quarantined, 1, "released before any proof");
    }
    // The slot comes back (safe: by revocation after the drain deadline; naive: at once, by a lie).
    wait_until("slot reclaimed", || p.tpool.metrics().free == SLOTS as u64);
    if policy == ReleasePolicy::Safe {
        assert_eq!(p.tpool.metrics().settled_revoked, 1);
        assert_eq!(p.target.stats().aborts_sent, 1);
    } else {
        assert_eq!(p.target.stats().naive_releases, 1);
    }
    // A new tenant gets the same slot and fills it.
    let mut l = p.tpool.reserve(1).unwrap();
    assert_eq!(l.tenancies()[0].slot.0, slot);
    l.write_at(0, 0, &[0x55; SLOT]).unwrap();
    let (exposed2, _r) = p.target.expose(l, p.peer).unwrap();
    gate.open();
    let out = block_on(h).unwrap();
    let corrupted = slot_bytes(&p.tpool, slot).contains(&0xAA);
    if policy == ReleasePolicy::Safe {
        assert_eq!(out.result, Err(TransferError::Rejected(RejectReason::StaleGeneration)));
    }
    p.target.revoke(&exposed2);
    settle_within(exposed2).release();
    corrupted
}

#[test]
fn abort_with_held_write_safe_policy_protects_the_next_tenant() {
    assert!(!abort_with_held_write(ReleasePolicy::Safe));
}

#[test]
fn abort_with_held_write_naive_policy_corrupts_the_next_tenant() {
    // Positive control: the race suite can see the bug the contract prevents.
    assert!(abort_with_held_write(ReleasePolicy::Naive));
}

#[test]
fn abort_without_writes_settles_by_abort_ack() {
    let p = pair();
    let (exposed, _remote) = p.target.expose(p.tpool.reserve(2).unwrap(), p.peer).unwrap();
    exposed.abort();
    wait_until("reclaimed by ABORT_ACK", || p.tpool.metrics().free == SLOTS as u64);
    let m = p.tpool.metrics();
    assert_eq!((m.settled_completed, m.settled_revoked), (2, 0));
    assert_eq!(p.init.stats().abort_acks_sent, 1);
    assert_eq!(p.target.stats().abort_acks_received, 1);
}

#[test]
fn dropped_handle_returns_the_lease_only_after_completion() {
    let gate = Gate::closed();
    let faults = FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode").with_faults(faults), NicConfig::new("prefill"));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let h = block_on(p.init.write(filled(&p.ipool, 1, 3), &remote, TransferOptions::default())).unwrap();
    drop(h);
    assert!(gate.wait_for_waiting(1, WAIT));
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(p.ipool.metrics().free, SLOTS as u64 - 1, "lease came back while the write was in flight");
    gate.open();
    wait_until("local lease back", || p.ipool.metrics().free == SLOTS as u64);
    settle_within(exposed).release();
    assert!(slot_bytes(&p.tpool, 0).iter().all(|&b| b == 3));
}

#[test]
fn cancel_before_send_completes_canceled() {
    let faults = FaultPlan { delay: DelayDist::Fixed { us: 150_000 }, ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode"), NicConfig::new("prefill").with_faults(faults));
    let (e1, r1) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let (e2, r2) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let h1 = block_on(p.init.write(filled(&p.ipool, 1, 1), &r1, TransferOptions::default())).unwrap();
    std::thread::sleep(Duration::from_millis(40)); // the sender sleeps on h1's delay
    let h2 = block_on(p.init.write(filled(&p.ipool, 1, 2), &r2, TransferOptions::default())).unwrap();
    h2.cancel();
    let o2 = block_on(h2).unwrap();
    assert_eq!(o2.result, Err(TransferError::Canceled));
    let o1 = block_on(h1).unwrap();
    assert_eq!(o1.result, Ok(()));
    settle_within(e1).release();
    p.target.revoke(&e2);
    settle_within(e2).release();
    assert_eq!(p.init.stats().wrs_canceled, 1);
}

fn delays_of_run(seed: u64) -> Vec<u64> {
    let faults = FaultPlan {
        seed,
        delay: DelayDist::Uniform { min_us: 0, max_us: 300 },
        reorder_jitter_us: 200,
        ..FaultPlan::default()
    };
    let p = pair_with(NicConfig::new("decode"), NicConfig::new("prefill").with_faults(faults));
    let (e, remote) = p.target.expose(p.tpool.reserve(4).unwrap(), p.peer).unwrap();
    for _ in 0..5 {
        let out = block_on(async {
            p.init.write(filled(&p.ipool, 4, 9), &remote, TransferOptions::notify(false)).await.unwrap().await
        })
        .unwrap();
        assert_eq!(out.result, Ok(()));
    }
    p.target.revoke(&e);
    settle_within(e).release();
    p.init.fault_log().iter().map(|r| r.delay_us).collect()
}

#[test]
fn same_seed_same_fault_schedule() {
    let a = delays_of_run(7);
    let b = delays_of_run(7);
    assert_eq!(a.len(), 20);
    assert_eq!(a, b);
    let plan = FaultPlan {
        seed: 7,
        delay: DelayDist::Uniform { min_us: 0, max_us: 300 },
        reorder_jitter_us: 200,
        ..FaultPlan::default()
    };
    let expected: Vec<u64> = plan.schedule(0, 20).iter().map(|d| d.as_micros() as u64).collect();
    assert_eq!(a, expected);
    assert_ne!(a, delays_of_run(8));
}

#[test]
fn connection_dropped_mid_payload_fails_and_fences() {
    let faults =
        FaultPlan { drop_connection: Some(DropSpec { conn_index: 0, after_bytes: 1000 }), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode"), NicConfig::new("prefill").with_faults(faults));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let slot = remote.slots[0].slot.0;
    let out = block_on(async {
        p.init.write(filled(&p.ipool, 1, 0x42), &remote, TransferOptions::default()).await.unwrap().await
    })
    .unwrap();
    assert!(matches!(out.result, Err(TransferError::Transport(_))), "{:?}", out.result);
    // The target fences the lost connection: its exposure settles (Fenced).
    settle_within(exposed).release();
    assert_eq!(p.tpool.metrics().settled_fenced, 1);
    assert_eq!(p.target.stats().writes_applied, 0);
    // Bytes outside the slot are untouched.
    let all = region_bytes(&p.tpool);
    let (s, e) = (slot as usize * SLOT, (slot as usize + 1) * SLOT);
    assert!(all[..s].iter().chain(&all[e..]).all(|&b| b == 0));
}

#[test]
fn peer_crash_mid_transfer_is_fenced() {
    let gate = Gate::closed();
    let faults = FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode").with_faults(faults), NicConfig::new("prefill"));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let h = block_on(p.init.write(filled(&p.ipool, 1, 0x42), &remote, TransferOptions::default())).unwrap();
    assert!(gate.wait_for_waiting(1, WAIT));
    p.init.crash();
    settle_within(exposed).release();
    assert_eq!(p.tpool.metrics().settled_fenced, 1);
    gate.open();
    assert_eq!(p.target.stats().writes_applied, 0);
    assert!(region_bytes(&p.tpool).iter().all(|&b| b == 0));
    drop(h);
}

#[test]
fn slow_target_throttles_applies() {
    let faults = FaultPlan { slow_target_bytes_per_sec: Some(100 * SLOT as u64), ..FaultPlan::default() };
    let p = pair_with(NicConfig::new("decode").with_faults(faults), NicConfig::new("prefill"));
    let (e, remote) = p.target.expose(p.tpool.reserve(4).unwrap(), p.peer).unwrap();
    let t0 = Instant::now();
    let out = block_on(async {
        p.init.write(filled(&p.ipool, 4, 1), &remote, TransferOptions::default()).await.unwrap().await
    })
    .unwrap();
    assert_eq!(out.result, Ok(()));
    assert!(t0.elapsed() >= Duration::from_millis(35), "{:?}", t0.elapsed());
    settle_within(e).release();
}

#[test]
fn foreign_pool_and_bad_shapes_return_the_lease() {
    let p = pair();
    let (e, remote) = p.target.expose(p.tpool.reserve(2).unwrap(), p.peer).unwrap();
    let (other, _a) =
        kv_transfer_core::SlotPool::new(Arc::new(HostRegion::new(4 * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let err = block_on(p.init.write(other.reserve(2).unwrap(), &remote, TransferOptions::default())).unwrap_err();
    assert_eq!(err.kind, kv_transfer_core::PostErrorKind::ForeignPool);
    err.lease.release();
    let err = block_on(p.init.write(p.ipool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap_err();
    assert!(matches!(err.kind, kv_transfer_core::PostErrorKind::Descriptor(_)));
    err.lease.release();
    let bad = RemoteSlots { endpoint: "127.0.0.1:1".into(), ..remote.clone() };
    let err = block_on(p.init.write(p.ipool.reserve(2).unwrap(), &bad, TransferOptions::default())).unwrap_err();
    assert!(matches!(err.kind, kv_transfer_core::PostErrorKind::Peer(_)));
    err.lease.release();
    assert_eq!(p.ipool.metrics().free, SLOTS as u64);
    p.target.revoke(&e);
    settle_within(e).release();
}

#[test]
fn peer_process_killed_mid_transfer_is_fenced() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let gate = Gate::closed();
    let faults = FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() };
    let target = SimNic::start(NicConfig::new("decode").with_faults(faults)).unwrap();
    let tpool = target.register_pool(Arc::new(HostRegion::new(SLOTS * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sim-peer"))
        .args([target.endpoint(), "killed-peer"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "connected");
    let peer = target.wait_for_peer("killed-peer", WAIT).unwrap();
    let (exposed, remote) = target.expose(tpool.reserve(2).unwrap(), peer).unwrap();
    let desc = serde_json::to_string(&remote).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{desc}").unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "posted");
    assert!(gate.wait_for_waiting(1, WAIT));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // The NIC notices the dead peer even while its write waits at the gate.
    settle_within(exposed).release();
    assert_eq!(tpool.metrics().settled_fenced, 2);
    gate.open();
    assert_eq!(target.stats().writes_applied, 0);
    assert!(region_bytes(&tpool).iter().all(|&b| b == 0));
}

#[test]
fn slow_apply_outlasts_drain_and_revoke_so_the_fence_settles() {
    // One 4 KiB apply takes ~800 ms; the ladder drains for 150 ms, revokes
    // for 150 ms (each revocation waits at most 50 ms), then fences.
    let faults = FaultPlan { slow_target_bytes_per_sec: Some(5 * 1024), ..FaultPlan::default() };
    let cfg = NicConfig { revoke_wait: Duration::from_millis(50), ..NicConfig::new("decode").with_faults(faults) };
    let p = pair_with(cfg, NicConfig::new("prefill"));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let h = block_on(p.init.write(filled(&p.ipool, 1, 0x77), &remote, TransferOptions::default())).unwrap();
    wait_until("apply started", || p.init.stats().wrs_posted == 1);
    std::thread::sleep(Duration::from_millis(30));
    exposed.abort();
    assert_eq!(p.tpool.metrics().quarantined, 1);
    wait_until("reclaimed", || p.tpool.metrics().free == SLOTS as u64);
    let m = p.tpool.metrics();
    let s = p.target.stats();
    assert_eq!(m.settled_fenced, 1, "{m:?} {s:?}");
    assert!(s.revocations_timed_out >= 1, "{s:?}");
    assert_eq!((s.aborts_sent, s.fences), (1, 1));
    let out = block_on(h).unwrap();
    assert!(out.result.is_err(), "{:?}", out.result);
}

#[test]
fn reorder_across_connections_follows_the_seed() {
    // Find a seed whose connection 0 is much slower than connection 1.
    let base = FaultPlan { reorder_jitter_us: 300_000, ..FaultPlan::default() };
    let seed = (0..1000u64)
        .find(|&s| {
            let p = FaultPlan { seed: s, ..base.clone() };
            p.conn_delay(0) > p.conn_delay(1) + Duration::from_millis(150)
        })
        .unwrap();
    let faults = FaultPlan { seed, ..base };
    let target = SimNic::start(NicConfig::new("decode")).unwrap();
    let tpool = target.register_pool(Arc::new(HostRegion::new(SLOTS * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
    let init = SimNic::start(NicConfig::new("prefill").with_faults(faults)).unwrap();
    let c0 = init.connect_new(target.endpoint()).unwrap();
    let c1 = init.connect_new(target.endpoint()).unwrap();
    wait_until("both accepted", || target.peers().len() == 2);
    let peers = target.peers();
    let (e0, r0) = target.expose(tpool.reserve(1).unwrap(), peers[0].peer).unwrap();
    let (e1, r1) = target.expose(tpool.reserve(1).unwrap(), peers[1].peer).unwrap();
    let h0 = init.write_raw(c0, RawAccess::of(&r0, 0).unwrap(), Bytes::from(vec![1; 64])).unwrap();
    let h1 = init.write_raw(c1, RawAccess::of(&r1, 0).unwrap(), Bytes::from(vec![2; 64])).unwrap();
    assert_eq!(h1.wait(WAIT), Some(Ok(None)));
    assert_eq!(h0.wait(Duration::ZERO), None, "the later post on the faster connection should land first");
    assert_eq!(h0.wait(WAIT), Some(Ok(None)));
    for e in [e0, e1] {
        target.revoke(&e);
        settle_within(e).release();
    }
}

/// Application messages ride the data connection: in order, after the
/// frames queued before them, to the hook (with the sender's name) or to the
/// event queue; an oversize one is refused. Raw callbacks run exactly once.
#[test]
fn messages_and_raw_callbacks() {
    let p = pair();
    let init_peer = p.init.peer_by_name(p.target.name()).unwrap();
    // No hook: events.
    p.init.send_message(init_peer, b"one").unwrap();
    let msg = |nic: &SimNic| {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            match nic.next_event(Duration::from_millis(50)) {
                Some(InboundEvent::Message { peer, bytes }) => return Some((peer, bytes)),
                _ => continue,
            }
        }
        None
    };
    assert_eq!(msg(&p.target), Some((p.peer, Bytes::from_static(b"one"))));
    // A hook: every message, in order, with the sender's name.
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = got.clone();
    p.target.set_message_hook(Some(Arc::new(move |peer, name: &str, bytes: &[u8]| {
        g.lock().unwrap().push((peer, name.to_string(), bytes.to_vec()));
    })));
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let access = RawAccess::of(&remote, 0).unwrap();
    // A write, then a message: the message comes after the write was applied.
    let (tx, rx) = std::sync::mpsc::channel();
    p.init.write_raw_with(init_peer, access, Bytes::from(vec![9; 64]), Box::new(move |r| tx.send(r).unwrap())).unwrap();
    for i in 0..100u32 {
        p.init.send_message(init_peer, &i.to_le_bytes()).unwrap();
    }
    assert_eq!(rx.recv_timeout(WAIT), Ok(Ok(None)));
    assert!(rx.recv_timeout(Duration::from_millis(50)).is_err(), "a callback runs once");
    wait_until("100 messages", || got.lock().unwrap().len() == 100);
    for (i, (peer, name, bytes)) in got.lock().unwrap().iter().enumerate() {
        assert_eq!((*peer, name.as_str(), &bytes[..]), (p.peer, p.init.name(), &(i as u32).to_le_bytes()[..]));
    }
    assert_eq!(&slot_bytes(&p.tpool, access.slot.0)[..64], &[9; 64]);
    // A read through a callback; a rejected one too.
    let (tx, rx) = std::sync::mpsc::channel();
    let t2 = tx.clone();
    p.init.read_raw_with(init_peer, access, 64, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    assert_eq!(rx.recv_timeout(WAIT), Ok(Ok(Some(Bytes::from(vec![9; 64])))));
    let stale = RawAccess { generation: Generation(access.generation.0 + 1), ..access };
    p.init.read_raw_with(init_peer, stale, 64, Box::new(move |r| t2.send(r).unwrap())).unwrap();
    assert_eq!(rx.recv_timeout(WAIT), Ok(Err(TransferError::Rejected(RejectReason::StaleGeneration))));
    // Oversize and unknown peer are refused at once.
    let big = vec![0; wire::MAX_CONTROL as usize];
    assert!(matches!(p.init.send_message(init_peer, &big), Err(NicError::TooLarge(_))));
    assert!(matches!(p.init.send_message(PeerId(9999), b""), Err(NicError::UnknownPeer(_))));
    assert!(p.init.is_connected(init_peer) && !p.init.is_connected(PeerId(9999)));
    let s = (p.init.stats(), p.target.stats());
    assert_eq!((s.0.messages_sent, s.1.messages_received), (101, 101));
    p.target.revoke(&exposed);
    settle_within(exposed).release();
}

/// A raw WRITE sent from the initiator's own registered region completes to
/// the completion queue it names, once, with its token; the bytes land. A
/// rejected one completes there too, with the reason; an unknown region, a
/// range outside it or an oversize immediate is refused at once and
/// completes nowhere. A WRITE with an immediate hands the immediate to the
/// target's application after its bytes landed, and a rejected one hands
/// over nothing.
#[test]
fn raw_write_from_a_registered_region_completes_to_its_queue() {
    type Entry = (u64, Result<Option<Bytes>, TransferError>);
    #[derive(Default)]
    struct Queue(std::sync::Mutex<Vec<Entry>>);
    impl RawCompletions for Queue {
        fn complete(&self, token: u64, result: Result<Option<Bytes>, TransferError>) {
            self.0.lock().unwrap().push((token, result));
        }
    }
    let p = pair();
    let init_peer = p.init.peer_by_name(p.target.name()).unwrap();
    let local_key = p.init.key_of(&p.ipool).unwrap();
    p.ipool.region().write(SLOT, &[5; 64]).unwrap();
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    let access = RawAccess::of(&remote, 0).unwrap();
    // The target's application sees each immediate with the bytes it
    // follows already in its slot.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (s, tpool) = (seen.clone(), p.tpool.clone());
    p.target.set_message_hook(Some(Arc::new(move |_, _, imm: &[u8]| {
        // The immediate's first byte names the slot it follows.
        s.lock().unwrap().push((imm.to_vec(), slot_bytes(&tpool, u32::from(imm[0]))[0]));
    })));
    let q = Arc::new(Queue::default());
    p.init.write_raw_registered(init_peer, access, (local_key, SLOT, 64), &[], q.clone(), 7).unwrap();
    wait_until("one completion", || q.0.lock().unwrap().len() == 1);
    assert_eq!(q.0.lock().unwrap()[0], (7, Ok(None)));
    assert_eq!(&slot_bytes(&p.tpool, access.slot.0)[..64], &[5; 64]);
    p.ipool.region().write(SLOT, &[6; 64]).unwrap();
    let imm = [access.slot.0 as u8, 1, 2, 3];
    p.init.write_raw_registered(init_peer, access, (local_key, SLOT, 64), &imm, q.clone(), 8).unwrap();
    wait_until("two completions", || q.0.lock().unwrap().len() == 2);
    assert_eq!(q.0.lock().unwrap()[1], (8, Ok(None)));
    wait_until("the immediate", || seen.lock().unwrap().len() == 1);
    assert_eq!(seen.lock().unwrap()[0], (imm.to_vec(), 6), "the immediate comes after its bytes");
    let stale = RawAccess { generation: Generation(access.generation.0 + 1), ..access };
    p.init.write_raw_registered(init_peer, stale, (local_key, 0, 64), &imm, q.clone(), 9).unwrap();
    wait_until("three completions", || q.0.lock().unwrap().len() == 3);
    assert_eq!(q.0.lock().unwrap()[2], (9, Err(TransferError::Rejected(RejectReason::StaleGeneration))));
    let big = [0u8; wire::MAX_IMM + 1];
    let refused = [
        ((local_key ^ 1, 0, 64), &[][..]),
        ((local_key, SLOTS * SLOT - 32, 64), &[]),
        ((local_key, usize::MAX, 2), &[]),
        ((local_key, 0, 64), &big[..]),
    ];
    for (range, imm) in refused {
        let r = p.init.write_raw_registered(init_peer, access, range, imm, q.clone(), 10);
        assert!(matches!(r, Err(NicError::LocalRange { .. } | NicError::TooLarge(_))), "{range:?}: {r:?}");
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(q.0.lock().unwrap().len(), 3, "a refused post completes nowhere, a posted one once");
    assert_eq!(seen.lock().unwrap().len(), 1, "a rejected write hands no immediate over");
    p.target.revoke(&exposed);
    settle_within(exposed).release();
}

/// Rule 8, through the real wire: a DONE settles an exposure only from the
/// connection it was exposed to, carrying its exposure's token. A third
/// connection that says it is the peer (same HELLO name) and knows the
/// tenancies, or the peer itself with a guessed token, settles nothing; both
/// are counted as forged, and the exposure still settles honestly afterwards.
#[test]
fn hostile_done_without_the_exposures_token_or_from_another_connection_settles_nothing() {
    use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken};
    let p = pair();
    let (exposed, remote) = p.target.expose(p.tpool.reserve(2).unwrap(), p.peer).unwrap();
    let send = |s: &mut TcpStream, token: ExposureToken| {
        let m = ControlMessage::new(ControlKind::Done, remote.pool, token, remote.tenancies());
        s.write_all(&wire::encode_head(&Body::Control(m), 0).unwrap()).unwrap();
    };
    // An impostor with the peer's name and the right token (say it leaked):
    // its connection is not the one the slots were exposed to.
    let mut impostor = raw_conn(&p.target);
    send(&mut impostor, remote.token);
    // Guessed tokens, from the impostor.
    for guess in [ExposureToken::default(), ExposureToken::from_bytes([0xff; 16])] {
        send(&mut impostor, guess);
    }
    wait_until("three forged DONEs counted", || p.target.stats().forged >= 6);
    assert_eq!(p.tpool.metrics().forged_rejected, 6);
    let exposed = exposed.try_settled().expect_err("a forged DONE settled the exposure");
    // The real peer, through its own write with notify: settles.
    let src = filled(&p.ipool, 2, 0x5a);
    let out = block_on(async { p.init.write(src, &remote, TransferOptions::default()).await.unwrap().await }).unwrap();
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    let settled = settle_within(exposed);
    let bytes = settled.bytes().unwrap();
    assert!(bytes[..SLOT].iter().all(|&b| b == 0x5a) && bytes[SLOT..].iter().all(|&b| b == 0x5b));
    settled.release();
}

/// A panic in user code on a receiving thread (here a message hook) does not
/// leave a zombie connection: the connection is marked dead and fenced, its
/// exposures settle `Fenced`, and the peer's pending WRITE ends with an error
/// instead of hanging.
#[test]
fn hostile_a_panicking_hook_fences_the_connection_instead_of_hanging_it() {
    let p = pair();
    let (exposed, remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    p.target.set_message_hook(Some(Arc::new(|_, _, _| panic!("a user hook panics"))));
    p.init.send_message(p.init.peer_by_name("decode").unwrap(), b"boom").unwrap();
    wait_until("the panic counted", || p.target.stats().hook_panics == 1);
    let settled = settle_within(exposed);
    assert_eq!(p.tpool.metrics().settled_fenced, 1);
    settled.release();
    assert!(!p.target.is_connected(p.peer), "the connection must be torn down, not left half alive");
    // The initiator's next WRITE towards the dead connection ends, with an error.
    let h = block_on(p.init.write(filled(&p.ipool, 1, 1), &remote, TransferOptions::default()));
    if let Ok(h) = h {
        let out = block_on(h).unwrap();
        assert!(out.result.is_err(), "a WRITE over a fenced connection cannot succeed");
        out.lease.release();
    }
}

/// The positive control: with the exit path skipped on unwind (`Naive`),
/// the same panic leaves the connection looking alive and its exposure
/// unsettled: the hang the check prevents.
#[test]
fn hostile_a_panicking_hook_positive_control_leaves_a_zombie() {
    let p = pair_with(NicConfig::new("decode").with_policy(ReleasePolicy::Naive), NicConfig::new("prefill"));
    let (exposed, _remote) = p.target.expose(p.tpool.reserve(1).unwrap(), p.peer).unwrap();
    p.target.set_message_hook(Some(Arc::new(|_, _, _| panic!("a user hook panics (positive control)"))));
    p.init.send_message(p.init.peer_by_name("decode").unwrap(), b"boom").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(p.target.stats().hook_panics, 0, "the panic was caught though the check is off");
    assert!(p.target.is_connected(p.peer), "expected a zombie connection without the check");
    let exposed = exposed.try_settled().expect_err("expected the exposure to hang without the check");
    // Teardown: the fence settles it.
    exposed.abort();
}

/// Rule 8, the sending side: a hostile target that answers a large WRITE
/// with a success completion before it read the payload does not settle the
/// source slot while our NIC still sends from it. The completion is parked
/// until every byte left; only then does the handle resolve.
#[test]
fn hostile_an_early_completion_does_not_settle_a_source_slot_still_being_sent() {
    assert!(!early_completion_settles_while_sending(ReleasePolicy::Safe));
}

/// The positive control: with the check off (`Naive`), the same early
/// completion settles the source slot while 16 MiB are still being sent
/// from it.
#[test]
fn hostile_an_early_completion_positive_control_settles_while_sending() {
    assert!(early_completion_settles_while_sending(ReleasePolicy::Naive));
}

/// A hostile target answers a 16 MiB WRITE with success before reading a
/// byte of it; returns whether the source slot settled while the payload
/// was still unread (it checks the parking counter only with the checks on).
fn early_completion_settles_while_sending(policy: ReleasePolicy) -> bool {
    use kv_transfer_core::{Generation, PoolId, RemoteSlot, SlotId};
    const BIG: usize = 16 << 20;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (read_gate_tx, read_gate_rx) = std::sync::mpsc::channel::<()>();
    let hostile = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        wire::authenticate_accepted(
            &mut s,
            &kv_transfer_core::auth::ClusterKey::from_env().expect("the deployment's cluster key"),
            "hostile",
            "127.0.0.1:1",
        )
        .unwrap();
        let read_frame_head = |s: &mut TcpStream| {
            let mut pre = [0u8; wire::PREFIX_LEN];
            s.read_exact(&mut pre).unwrap();
            let p = wire::decode_prefix(&pre).unwrap();
            let mut f = vec![0u8; p.fields_len()];
            s.read_exact(&mut f).unwrap();
            (p, wire::decode_fields(&p, &f).unwrap())
        };
        let (_, hello) = read_frame_head(&mut s);
        assert!(matches!(hello, Body::Hello { .. }));
        let me = Body::Hello { name: "hostile".into(), endpoint: "127.0.0.1:1".into() };
        s.write_all(&wire::encode_head(&me, 0).unwrap()).unwrap();
        let (p, body) = read_frame_head(&mut s);
        let Body::Write(h) = body else { panic!("expected a WRITE") };
        // Success, before reading a byte of the payload.
        s.write_all(&wire::encode_head(&Body::Completion { wr_id: h.wr_id, status: WireStatus::Ok }, 0).unwrap())
            .unwrap();
        // Hold the payload unread until the test has looked.
        read_gate_rx.recv_timeout(WAIT).unwrap();
        let mut sink = vec![0u8; p.payload_len()];
        s.read_exact(&mut sink).unwrap();
    });
    let init = SimNic::start(NicConfig::new("prefill").with_policy(policy)).unwrap();
    let ipool = init.register_pool(Arc::new(HostRegion::new(BIG).unwrap()), PoolConfig::new(BIG)).unwrap();
    let remote = RemoteSlots {
        endpoint: addr,
        pool: PoolId(1),
        key: 1,
        slot_size: BIG as u64,
        memory: Default::default(),
        token: Default::default(),
        slots: vec![RemoteSlot { slot: SlotId(0), generation: Generation(1), addr: 0, key: None }],
    };
    let mut h = block_on(init.write(ipool.reserve(1).unwrap(), &remote, TransferOptions::notify(false))).unwrap();
    if !policy.is_naive() {
        wait_until("the early completion parked", || init.stats().early_completions == 1);
    }
    // Bounded: the payload stays unread until the gate opens below.
    let deadline = std::time::Instant::now() + Duration::from_millis(500);
    let mut early = None;
    while early.is_none() && std::time::Instant::now() < deadline {
        early = kv_transfer_core::poll_until(std::pin::Pin::new(&mut h), Duration::from_millis(10));
    }
    let settled_early = early.is_some();
    read_gate_tx.send(()).unwrap();
    let out = match early {
        Some(out) => out.unwrap(),
        None => block_on(h).unwrap(),
    };
    assert_eq!(out.result, Ok(()));
    out.lease.release();
    hostile.join().unwrap();
    settled_early
}

/// Rule 8: registered memory outlives every binding. In every order of
/// dropping a live exposure, its pool and the NIC (with the peer that could
/// write into it still connected), the region stays allocated while the NIC
/// that binds it lives; once everything is dropped it is freed.
#[test]
fn hostile_memory_outlives_its_binding_whatever_is_dropped_first() {
    const PARTS: [&str; 3] = ["exposure", "pool", "nic"];
    let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    for order in orders {
        let p = pair();
        let Pair { target, tpool, init, ipool, peer } = p;
        let weak = Arc::downgrade(tpool.region());
        let (exposed, _remote) = target.expose(tpool.reserve(1).unwrap(), peer).unwrap();
        let mut parts: Vec<Option<Box<dyn std::any::Any>>> =
            vec![Some(Box::new(exposed)), Some(Box::new(tpool)), Some(Box::new(target))];
        for &i in &order {
            drop(parts[i].take());
            if parts[2].is_some() {
                let named: Vec<&str> = order.iter().map(|&k| PARTS[k]).collect();
                assert!(weak.upgrade().is_some(), "order {named:?}: the region was freed while the NIC binds it");
            }
        }
        let deadline = Instant::now() + WAIT;
        while weak.upgrade().is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(weak.upgrade().is_none(), "order {order:?}: the region leaked after everything was dropped");
        drop((init, ipool));
    }
}

/// Dropping a NIC and its pools frees their memory, after a graceful
/// shutdown and after a crash with operations in flight (a long-running
/// engine restarts its peers: a region kept alive per restart is a leak).
/// The target holds the WRITEs at its gate, so the initiator's operations
/// are waiting for completions when it goes.
#[test]
fn a_dropped_nic_frees_its_regions_also_after_a_crash_with_writes_in_flight() {
    for crash in [false, true] {
        let gate = Gate::closed();
        let target = SimNic::start(
            NicConfig::new("decode").with_faults(FaultPlan { gate: Some(gate.clone()), ..FaultPlan::default() }),
        )
        .unwrap();
        let tpool =
            target.register_pool(Arc::new(HostRegion::new(SLOTS * SLOT).unwrap()), PoolConfig::new(SLOT)).unwrap();
        let init = SimNic::start(NicConfig::new("prefill")).unwrap();
        let region = Arc::new(HostRegion::new(SLOTS * SLOT).unwrap());
        let weak = Arc::downgrade(&region);
        let ipool = init.register_pool(region, PoolConfig::new(SLOT)).unwrap();
        init.connect(target.endpoint()).unwrap();
        let peer = target.wait_for_peer(init.name(), WAIT).unwrap();
        let mut handles = Vec::new();
        let mut exposures = Vec::new();
        for _ in 0..4 {
            let (exposed, remote) = target.expose(tpool.reserve(1).unwrap(), peer).unwrap();
            let src = filled(&ipool, 1, 0x5A);
            handles.push(block_on(init.write(src, &remote, TransferOptions::notify(true))).unwrap());
            exposures.push(exposed);
        }
        assert!(gate.wait_for_waiting(1, WAIT), "no WRITE reached the gate");
        if crash {
            init.crash();
        }
        drop((init, ipool));
        // A handle kept past its NIC's end resolves (it does not pin the region).
        for h in handles {
            let _ = block_on(h);
        }
        gate.open();
        drop(exposures);
        wait_until(&format!("the initiator's region to be freed (crash: {crash})"), || weak.upgrade().is_none());
    }
}
