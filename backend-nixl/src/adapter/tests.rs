//! The adapter over `MockNixlEngine`s that behave as badly as real NIXL: release
//! that "succeeds" while writes continue, `IN_PROG` forever, every error collapsed
//! to -2, a notification lost when a request is released early. Two mocks share an
//! in-memory "wire" for the notifications, so both sides of a transfer run.

use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken};
use kv_transfer_core::{Generation, SlotId};

/// A control message as the adapters send it (core's codec, text form).
fn msg(kind: ControlKind, pool: PoolId, token: ExposureToken, ts: &[Tenancy]) -> Vec<u8> {
    ControlMessage::new(kind, pool, token, ts.to_vec()).encode_text().expect("encodes").into_bytes()
}

fn kind_of(m: &[u8]) -> Option<ControlKind> {
    ControlMessage::decode_text(m).ok().map(|m| m.kind)
}
use super::*;
use crate::engine::{NixlError, NixlOp, Notification, RegId, Status, XferState};
use crate::MockNixlEngine;
use futures::FutureExt;
use kv_transfer_core::{
    EscalationLadder, HostRegion, PostError, PostErrorKind, Transfer, TransferError, TransferHandle, TransferOptions,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::MutexGuard;

const SLOT: usize = 4096;

fn backend_err(op: NixlOp) -> EngineError {
    EngineError::Nixl(NixlError { op, status: Status::Backend })
}

/// How the mock NIC behaves for each request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Behaviour {
    /// `InProgress` for this many polls, then `Done`.
    DoneAfter(u32),
    /// `InProgress` for this many polls, then -2.
    FailAfter(u32),
    /// `InProgress` forever.
    Forever,
}

#[derive(Default)]
struct Req {
    notif: Option<Vec<u8>>,
    polls: u32,
    done: bool,
    failed: bool,
    released: bool,
    remote_agent: String,
}

/// Shared state of both mocks: requests of the initiator, notification queues.
#[derive(Default)]
struct Sim {
    next: u64,
    reqs: HashMap<u64, Req>,
    behaviour: Option<Behaviour>,
    /// Release calls on requests whose last status was not terminal.
    early_releases: u32,
    releases: Vec<u64>,
    /// Pool `leased` gauge seen by each release (must still hold the lease).
    leased_at_release: Vec<u64>,
    watch_pool: Option<SlotPool>,
    /// Notifications to each agent.
    inbox: HashMap<String, VecDeque<Notification>>,
    /// Every gen_notif: (from, to, msg).
    sent: Vec<(String, String, Vec<u8>)>,
    post_fails: bool,
    create_fails: bool,
    notifs_fail: bool,
    deregistered: u32,
    invalidated: u32,
    /// ABORT_ACKs sent while some request was not terminal.
    acks_while_in_flight: u32,
    /// Order of posts, releases, invalidations, deregistrations.
    log: Vec<String>,
    /// Every `get_notifs`: (agent, whether its driver thread called it, notifications returned).
    notif_polls: Vec<(&'static str, bool, usize)>,
}

type Shared = Arc<Mutex<Sim>>;

fn lock(s: &Shared) -> MutexGuard<'_, Sim> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// The mock's post (every post reports `IN_PROG`).
fn sim_post(s: &Shared, id: ReqId) -> Result<XferState, EngineError> {
    let mut g = lock(s);
    g.log.push(format!("post {}", id.0));
    if let Some(r) = g.reqs.get_mut(&id.0) {
        // A re-post starts the request over.
        r.polls = 0;
        r.done = false;
    }
    if g.post_fails {
        return Err(EngineError::PostFailed {
            id,
            source: NixlError { op: NixlOp::PostXferReq, status: Status::Backend },
        });
    }
    Ok(XferState::InProgress)
}

/// The mock's status poll, as the `Sim`'s behaviour says; `name` is the
/// polling agent (the sender of the request's notification).
fn sim_status(s: &Shared, name: &'static str, id: ReqId) -> Result<XferState, EngineError> {
    let mut guard = lock(s);
    let g = &mut *guard;
    let b = g.behaviour.unwrap_or(Behaviour::DoneAfter(0));
    let Some(r) = g.reqs.get_mut(&id.0) else { return Err(EngineError::UnknownRequest(id)) };
    if r.released {
        return Err(EngineError::UnknownRequest(id));
    }
    r.polls += 1;
    match b {
        Behaviour::DoneAfter(n) if r.polls > n => {
            if !r.done {
                r.done = true;
                // NIXL sends the notification once the data is flushed, while polled.
                if let Some(msg) = r.notif.clone() {
                    let to = r.remote_agent.clone();
                    g.inbox.entry(to).or_default().push_back(Notification { agent: name.into(), msg });
                }
            }
            Ok(XferState::Done)
        }
        Behaviour::FailAfter(n) if r.polls > n => {
            r.failed = true;
            Err(backend_err(NixlOp::GetXferStatus))
        }
        _ => Ok(XferState::InProgress),
    }
}

/// A mock engine named `name` on the shared wire; `peer` is the agent its
/// `load_remote_metadata` returns.
fn mock(sim: &Shared, name: &'static str, peer: &'static str) -> MockNixlEngine {
    let mut m = MockNixlEngine::new();
    m.expect_agent_name().return_const(name.to_string());
    m.expect_register_mem().returning(|_| Ok(RegId(1)));
    m.expect_local_metadata().returning(move || Ok(name.as_bytes().to_vec()));
    m.expect_load_remote_metadata().returning(move |_| Ok(peer.to_string()));
    let s = sim.clone();
    m.expect_deregister().returning(move |_| {
        lock(&s).log.push("deregister".into());
        lock(&s).deregistered += 1;
        Ok(())
    });
    let s = sim.clone();
    m.expect_invalidate_remote_metadata().returning(move |_| {
        lock(&s).log.push("invalidate".into());
        lock(&s).invalidated += 1;
        Ok(())
    });
    let s = sim.clone();
    m.expect_create_xfer().returning(move |spec| {
        let mut g = lock(&s);
        if g.create_fails {
            return Err(backend_err(NixlOp::CreateXferReq));
        }
        g.next += 1;
        let id = g.next;
        g.reqs.insert(id, Req { notif: spec.notif.clone(), remote_agent: spec.remote_agent.clone(), ..Req::default() });
        Ok(ReqId(id))
    });
    let s = sim.clone();
    m.expect_post_xfer().returning(move |id| sim_post(&s, id));
    let s = sim.clone();
    m.expect_xfer_status().returning(move |id| sim_status(&s, name, id));
    // What the trait's default does, over the same simulation.
    let s = sim.clone();
    m.expect_post_xfer_polled().returning(move |id, poll| {
        if poll {
            lock(&s).log.push(format!("post+poll {}", id.0));
        }
        let posted = sim_post(&s, id);
        let polled = (poll && matches!(posted, Ok(XferState::InProgress))).then(|| sim_status(&s, name, id));
        (posted, polled)
    });
    let s = sim.clone();
    m.expect_release_xfer().returning(move |id| {
        let mut guard = lock(&s);
        let g = &mut *guard;
        let leased = g.watch_pool.as_ref().map_or(0, |p| p.metrics().leased);
        g.leased_at_release.push(leased);
        g.releases.push(id.0);
        g.log.push(format!("release {}", id.0));
        let Some(r) = g.reqs.get_mut(&id.0) else { return Err(EngineError::UnknownRequest(id)) };
        // Raw NIXL: release "succeeds" whatever the state; an in-progress request
        // keeps writing and its notification is lost.
        let early = !(r.done || r.failed);
        r.released = true;
        if early {
            r.notif = None;
            g.early_releases += 1;
        }
        Ok(())
    });
    let s = sim.clone();
    m.expect_get_notifs().returning(move || {
        let mut g = lock(&s);
        if g.notifs_fail {
            return Err(backend_err(NixlOp::GetNotifs));
        }
        let fetched: Vec<Notification> = g.inbox.get_mut(name).map(|q| q.drain(..).collect()).unwrap_or_default();
        let by_driver = std::thread::current().name().is_some_and(|t| t.starts_with("nixl-driver-"));
        g.notif_polls.push((name, by_driver, fetched.len()));
        Ok(fetched)
    });
    let s = sim.clone();
    m.expect_gen_notif().returning(move |to, msg| {
        let mut g = lock(&s);
        if kind_of(msg) == Some(ControlKind::AbortAck) && g.reqs.values().any(|r| !(r.done || r.failed)) {
            g.acks_while_in_flight += 1;
        }
        g.sent.push((name.into(), to.into(), msg.to_vec()));
        g.inbox.entry(to.into()).or_default().push_back(Notification { agent: name.into(), msg: msg.to_vec() });
        Ok(())
    });
    m
}

/// Short timings; requests go to the driver at once (no inline polling) and are
/// released at completion (no request cache), so each test sees its requests in
/// flight. The inline and cached paths have their own tests.
fn fast() -> AdapterConfig {
    AdapterConfig {
        poll_min: Duration::from_micros(50),
        poll_max: Duration::from_millis(1),
        spin: Duration::ZERO,
        notif_interval: Duration::from_micros(200),
        idle_interval: Duration::from_millis(2),
        teardown_timeout: Duration::from_millis(500),
        inline_poll: Duration::ZERO,
        request_cache: 0,
        ..AdapterConfig::default()
    }
}

struct Pair {
    sim: Shared,
    ini: NixlTransfer,
    tgt: NixlTransfer,
    src: SlotPool,
    dst: SlotPool,
    /// The target's id for the initiator.
    ini_peer: PeerId,
}

fn pair(behaviour: Behaviour, ladder: EscalationLadder) -> Pair {
    let sim: Shared = Arc::default();
    lock(&sim).behaviour = Some(behaviour);
    let ini = NixlTransfer::new(Arc::new(mock(&sim, "ini", "tgt")), fast()).expect("ini");
    let tgt = NixlTransfer::new(Arc::new(mock(&sim, "tgt", "ini")), fast()).expect("tgt");
    let src =
        ini.register_pool(Arc::new(HostRegion::new(8 * SLOT).expect("region")), PoolConfig::new(SLOT)).expect("pool");
    let dst = tgt
        .register_pool(Arc::new(HostRegion::new(8 * SLOT).expect("region")), PoolConfig::new(SLOT).with_ladder(ladder))
        .expect("pool");
    lock(&sim).watch_pool = Some(src.clone());
    ini.add_peer(b"tgt").expect("peer");
    let ini_peer = tgt.add_peer(b"ini").expect("peer");
    Pair { sim, ini, tgt, src, dst, ini_peer }
}

use kv_transfer_testkit::wait::wait_until;

fn write(p: &Pair, n: usize, notify: bool) -> (TransferHandle, SlotLease<Exposed>, RemoteSlots) {
    let (exposed, remote) = p.tgt.expose(p.dst.reserve(n).expect("reserve"), p.ini_peer).expect("expose");
    let lease = p.src.reserve(n).expect("reserve");
    let h = futures::executor::block_on(p.ini.write(lease, &remote, TransferOptions::notify(notify))).expect("post");
    (h, exposed, remote)
}

#[test]
fn released_only_after_terminal_and_lease_only_after_release() {
    let p = pair(Behaviour::DoneAfter(30), EscalationLadder::default());
    let (h, exposed, _) = write(&p, 2, true);
    assert!(p.ini.metrics().in_flight == 1);
    let out = futures::executor::block_on(h).expect("not abandoned");
    assert_eq!(out.result, Ok(()));
    {
        let g = lock(&p.sim);
        assert_eq!(g.early_releases, 0, "released while in progress");
        assert_eq!(g.releases.len(), 1);
        assert_eq!(g.leased_at_release, vec![2], "lease returned before release");
        assert!(g.reqs[&1].polls > 30);
    }
    // The notification reached the target only because the request was polled to
    // its end: the exposure settles from it.
    let settled = futures::executor::block_on(exposed.settled());
    assert_eq!(p.tgt.take_events().len(), 1);
    settled.release();
    out.lease.release();
    assert_eq!(p.src.metrics().free, 8);
    assert_eq!(p.dst.metrics().free, 8);
    assert_eq!(p.tgt.metrics().settled_by_message, 2);
}

#[test]
fn dropped_handle_is_parked_until_terminal_then_released_then_returned() {
    let p = pair(Behaviour::DoneAfter(40), EscalationLadder::default());
    let (h, exposed, _) = write(&p, 3, true);
    h.cancel();
    drop(h);
    assert_eq!(p.src.metrics().leased, 3, "a dropped handle must not free the lease");
    assert!(wait_until(Duration::from_secs(5), || p.src.metrics().free == 8));
    let g = lock(&p.sim);
    assert_eq!(g.early_releases, 0);
    assert_eq!(g.leased_at_release, vec![3]);
    drop(g);
    // Canceled but it succeeded with the notification attached: W settles the target.
    assert!(futures::executor::block_on(exposed.settled()).len() == 3);
}

#[test]
fn in_prog_forever_never_releases_never_frees() {
    let p = pair(Behaviour::Forever, EscalationLadder::default());
    let (mut h, exposed, _) = write(&p, 2, true);
    std::thread::sleep(Duration::from_millis(100));
    assert!((&mut h).now_or_never().is_none(), "resolved without a terminal status");
    h.cancel();
    drop(h);
    std::thread::sleep(Duration::from_millis(50));
    assert!(lock(&p.sim).releases.is_empty(), "released an IN_PROG request");
    assert_eq!(p.src.metrics().leased, 2);
    let m = p.ini.metrics();
    assert_eq!(m.in_flight, 1);
    assert!(m.oldest_in_flight.is_some_and(|d| d >= Duration::from_millis(100)));
    // Shutdown cannot finish it: nothing is released or deregistered, the memory
    // is leaked and the lease quarantined.
    let r = p.ini.shutdown(Duration::from_millis(100));
    assert_eq!(r.in_flight_left, 1);
    assert_eq!(r.leaked, 1);
    assert_eq!(r.deregistered, 0);
    assert!(lock(&p.sim).releases.is_empty());
    assert_eq!(lock(&p.sim).deregistered, 0);
    assert_eq!(p.src.metrics().quarantined, 2);
    assert_eq!(p.src.metrics().free, 6);
    drop(exposed);
}

#[test]
fn errors_collapsed_to_minus_two_are_typed_errors_that_prove_nothing() {
    let p = pair(Behaviour::FailAfter(5), EscalationLadder::default());
    let (h, exposed, remote) = write(&p, 2, true);
    // NIXL may report an error while other parts of the request still run, so
    // the error reaches the caller but settles nothing.
    let abandoned = futures::executor::block_on(h).expect_err("an error status must not settle the lease");
    match &abandoned.error {
        Some(TransferError::Engine { engine, code, .. }) => {
            assert_eq!(*engine, "nixl");
            assert_eq!(*code, -2);
        }
        other => panic!("expected an engine error, got {other:?}"),
    }
    assert_eq!(lock(&p.sim).early_releases, 0);
    assert_eq!(p.src.metrics().quarantined, 2, "the local lease must stay quarantined");
    assert_eq!(p.ini.metrics().failed_unproven, 1);
    // No ack, not even when the target aborts and asks for one: its slots stay
    // quarantined (a leak, reported), never reused.
    let exposed = exposed.try_settled().expect_err("the target settled without proof");
    drop(exposed);
    assert!(
        wait_until(Duration::from_secs(3), || p.ini.metrics().aborts_received >= 1
            && p.ini.metrics().acks_withheld >= 2),
        "{:?}",
        p.ini.metrics()
    );
    assert_eq!(p.ini.metrics().acks_sent, 0);
    assert!(p.tgt.take_events().is_empty());
    assert_eq!(p.dst.metrics().quarantined, 2);
    // Its tenancies are never posted to again.
    let again = futures::executor::block_on(p.ini.write(
        p.src.reserve(2).expect("reserve"),
        &remote,
        TransferOptions::default(),
    ));
    match again {
        Err(PostError { kind: PostErrorKind::Descriptor(_), lease }) => lease.release(),
        other => panic!("post to an unproven tenancy accepted: {other:?}"),
    }
    assert_eq!(p.ini.metrics().refused_tombstoned, 1);
}

#[test]
fn create_failure_returns_lease_unexposed_and_post_failure_waits_for_terminal() {
    let p = pair(Behaviour::DoneAfter(10), EscalationLadder::default());
    let (exposed, remote) = p.tgt.expose(p.dst.reserve(1).expect("reserve"), p.ini_peer).expect("expose");
    lock(&p.sim).create_fails = true;
    let lease = p.src.reserve(1).expect("reserve");
    let e = futures::executor::block_on(p.ini.write(lease, &remote, TransferOptions::notify(false))).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Engine(_)), "{e:?}");
    assert_eq!(p.src.metrics().exposures, 0, "a failed create must not expose the lease");
    e.lease.release();
    lock(&p.sim).create_fails = false;
    lock(&p.sim).post_fails = true;
    let lease = p.src.reserve(1).expect("reserve");
    // A failed post may have posted part of the request: the handle resolves only
    // after a terminal status, with the post's error.
    let h = futures::executor::block_on(p.ini.write(lease, &remote, TransferOptions::notify(false))).expect("handle");
    let out = futures::executor::block_on(h).expect("not abandoned");
    assert!(matches!(out.result, Err(TransferError::Engine { code: -2, .. })), "{:?}", out.result);
    let g = lock(&p.sim);
    assert_eq!(g.early_releases, 0);
    assert!(g.reqs[&1].polls > 10);
    drop(g);
    drop(exposed);
}

#[test]
fn unknown_status_codes_and_notif_errors_are_errors_not_success() {
    let mut m = MockNixlEngine::new();
    m.expect_agent_name().return_const("ini".to_string());
    m.expect_register_mem().returning(|_| Ok(RegId(1)));
    m.expect_load_remote_metadata().returning(|_| Ok("tgt".into()));
    m.expect_create_xfer().returning(|_| Ok(ReqId(1)));
    m.expect_post_xfer().returning(|_| Ok(XferState::InProgress));
    m.expect_xfer_status()
        .returning(|_| Err(EngineError::Nixl(NixlError { op: NixlOp::GetXferStatus, status: Status::Unknown(7) })));
    m.expect_release_xfer().times(1).returning(|_| Ok(()));
    m.expect_get_notifs().returning(|| Err(backend_err(NixlOp::GetNotifs)));
    m.expect_gen_notif().returning(|_, _| Err(backend_err(NixlOp::GenNotif)));
    m.expect_deregister().returning(|_| Ok(()));
    let ini = NixlTransfer::new(Arc::new(m), fast()).expect("ini");
    let pool = ini.register_pool(Arc::new(HostRegion::new(SLOT).expect("r")), PoolConfig::new(SLOT)).expect("pool");
    ini.add_peer(b"tgt").expect("peer");
    let remote = one_remote_slot(PoolId(999_999), kv_transfer_core::MemoryKind::Host);
    let h = futures::executor::block_on(ini.write(pool.reserve(1).expect("r"), &remote, TransferOptions::default()))
        .expect("post");
    // An unknown status code is an error, never success, and proves nothing.
    let abandoned = futures::executor::block_on(h).expect_err("an unknown status must not settle the lease");
    assert!(matches!(abandoned.error, Some(TransferError::Engine { code: 7, .. })), "{abandoned:?}");
    assert_eq!(pool.metrics().quarantined, 1);
    assert!(wait_until(Duration::from_secs(2), || ini.metrics().notif_errors > 0));
    assert_eq!(ini.shutdown(Duration::from_millis(500)).deregistered, 1);
}

#[test]
fn stale_malformed_and_foreign_notifications_are_dropped_and_counted() {
    let p = pair(Behaviour::DoneAfter(0), EscalationLadder::default());
    let (exposed, remote) = p.tgt.expose(p.dst.reserve(2).expect("reserve"), p.ini_peer).expect("expose");
    let pool = remote.pool;
    let t = remote.tenancies();
    let old = Tenancy::new(t[0].slot, Generation(t[0].generation.0 - 1));
    let push = |agent: &str, msg: Vec<u8>| {
        lock(&p.sim).inbox.entry("tgt".into()).or_default().push_back(Notification { agent: agent.into(), msg });
    };
    let done = |pool, ts: &[Tenancy]| msg(ControlKind::Done, pool, remote.token, ts);
    push("ini", done(pool, &[old]));
    push("ini", b"kvt2 nonsense".to_vec());
    push("ini", b"kvt2 00".to_vec());
    push("ini", vec![0xff; 64]);
    push("stranger", done(pool, &t));
    push("ini", done(PoolId(u64::MAX), &t));
    // The driver counts message by message: wait for the last one's count
    // before reading the others (they only ever grow).
    let counted = || {
        let m = p.tgt.metrics();
        m.malformed + m.foreign + m.stale >= 7
    };
    assert!(wait_until(Duration::from_secs(2), counted), "{:?}", p.tgt.metrics());
    let m = p.tgt.metrics();
    assert_eq!((m.malformed, m.foreign, m.stale), (2, 2, 3));
    assert!(p.dst.metrics().stale_rejected >= 1);
    let exposed = exposed.try_settled().expect_err("settled by a stale or foreign message");
    // The right message settles it.
    push("ini", done(pool, &t));
    let settled = futures::executor::block_on(exposed.settled());
    // The same message again is stale.
    push("ini", done(pool, &t));
    assert!(wait_until(Duration::from_secs(2), || p.tgt.metrics().stale == 5));
    settled.release();
}

#[test]
fn abort_asks_the_initiator_who_acks_only_after_terminal() {
    let ladder = EscalationLadder {
        drain: Duration::from_millis(50),
        revoke: Duration::from_millis(50),
        fence: Duration::from_millis(50),
    };
    let p = pair(Behaviour::DoneAfter(150), ladder);
    let (h, exposed, remote) = write(&p, 2, false);
    // The decode side gives up while the write is in flight.
    exposed.abort();
    assert_eq!(p.dst.metrics().quarantined, 2);
    assert!(wait_until(Duration::from_secs(2), || p.ini.metrics().aborts_received == 1));
    // A new post to the aborted tenancies is refused at once.
    let e = futures::executor::block_on(p.ini.write(p.src.reserve(2).expect("r"), &remote, TransferOptions::default()))
        .unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Descriptor(_)));
    e.lease.release();
    let out = futures::executor::block_on(h).expect("not abandoned");
    assert_eq!(out.result, Ok(()));
    // The ack left only after the request was terminal, and it reclaims the slots.
    assert!(wait_until(Duration::from_secs(2), || p.dst.metrics().free == 8));
    let g = lock(&p.sim);
    let ack_at = g
        .sent
        .iter()
        .position(|(from, _, m)| from == "ini" && kind_of(m) == Some(ControlKind::AbortAck))
        .expect("ack sent");
    let abort = g.sent.iter().find(|(from, _, _)| from == "tgt").expect("abort sent");
    assert_eq!(abort.2, msg(ControlKind::Abort, remote.pool, remote.token, &remote.tenancies()));
    assert!(g.reqs[&1].done && g.reqs[&1].released);
    assert_eq!(g.early_releases, 0);
    assert_eq!(g.acks_while_in_flight, 0, "ABORT_ACK sent while the request was in flight");
    drop(g);
    assert!(ack_at > 0);
    assert_eq!(p.dst.metrics().quarantine_stuck, 0);
    out.lease.release();
}

#[test]
fn without_an_ack_revoke_and_fence_make_no_proof_and_slots_stay_quarantined() {
    let ladder = EscalationLadder {
        drain: Duration::from_millis(20),
        revoke: Duration::from_millis(20),
        fence: Duration::from_millis(20),
    };
    let p = pair(Behaviour::Forever, ladder);
    let (h, exposed, _) = write(&p, 1, true);
    exposed.abort();
    assert!(wait_until(Duration::from_secs(3), || p.dst.metrics().quarantine_stuck == 1));
    let m = p.tgt.metrics();
    assert_eq!(m.aborts_sent, 1, "one ABORT: revoke and fence are not in NIXL's ladder (CAPABILITIES)");
    assert_eq!(p.dst.metrics().quarantined, 1);
    assert_eq!(p.dst.metrics().free, 7);
    // The initiator never answers: its request is still in progress.
    assert!(lock(&p.sim).sent.iter().all(|(from, _, _)| from != "ini"));
    // Teardown refuses to invalidate the peer or deregister under the exposure.
    let e = p.tgt.remove_peer(p.ini_peer, Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e, AdapterError::Busy { exposed: 1, .. }), "{e:?}");
    assert_eq!(lock(&p.sim).invalidated, 0);
    let r = p.tgt.shutdown(Duration::from_millis(50));
    assert_eq!((r.exposed_left, r.leaked, r.deregistered), (1, 1, 0));
    drop(h);
}

#[test]
fn layered_writes_defer_the_notification_until_all_are_terminal() {
    let p = pair(Behaviour::DoneAfter(20), EscalationLadder::default());
    let (exposed, remote) = p.tgt.expose(p.dst.reserve(1).expect("reserve"), p.ini_peer).expect("expose");
    let h1 =
        futures::executor::block_on(p.ini.write(p.src.reserve(1).expect("r"), &remote, TransferOptions::notify(false)))
            .expect("post 1");
    let h2 =
        futures::executor::block_on(p.ini.write(p.src.reserve(1).expect("r"), &remote, TransferOptions::notify(true)))
            .expect("post 2");
    // A third write while the notifying one runs is refused: the slot is being handed back.
    let e =
        futures::executor::block_on(p.ini.write(p.src.reserve(1).expect("r"), &remote, TransferOptions::notify(false)))
            .unwrap_err();
    e.lease.release();
    {
        let g = lock(&p.sim);
        assert!(g.reqs[&2].notif.is_none(), "notification attached while another write to the slot was in flight");
    }
    let o1 = futures::executor::block_on(h1).expect("1");
    let o2 = futures::executor::block_on(h2).expect("2");
    let settled = futures::executor::block_on(exposed.settled());
    assert_eq!(p.ini.metrics().deferred_notifs_sent, 1);
    let seen: HashSet<u64> = lock(&p.sim).releases.iter().copied().collect();
    assert_eq!(seen.len(), 2);
    for l in [o1.lease, o2.lease] {
        l.release();
    }
    settled.release();
    p.ini.remove_peer(PeerId(0), Duration::from_millis(200)).expect("peer idle");
    assert_eq!(lock(&p.sim).invalidated, 1);
}

#[test]
fn foreign_pool_and_unknown_peer_hand_the_lease_back() {
    let p = pair(Behaviour::DoneAfter(0), EscalationLadder::default());
    let (other, _) = SlotPool::new(Arc::new(HostRegion::new(SLOT).expect("r")), PoolConfig::new(SLOT)).expect("pool");
    let (exposed, mut remote) = p.tgt.expose(p.dst.reserve(1).expect("reserve"), p.ini_peer).expect("expose");
    let e = futures::executor::block_on(p.ini.write(other.reserve(1).expect("r"), &remote, TransferOptions::default()))
        .unwrap_err();
    assert_eq!(e.kind, PostErrorKind::ForeignPool);
    remote.endpoint = "nobody".into();
    let e = futures::executor::block_on(p.ini.write(p.src.reserve(1).expect("r"), &remote, TransferOptions::default()))
        .unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Peer(_)));
    e.lease.release();
    let e = futures::executor::block_on(p.ini.write(p.src.reserve(2).expect("r"), &remote, TransferOptions::default()))
        .unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::Descriptor(_)));
    e.lease.release();
    assert_eq!(p.src.metrics().free, 8);
    drop(exposed);
}

#[test]
fn cancel_waits_for_terminal_then_acks_with_slot_and_generation() {
    let p = pair(Behaviour::DoneAfter(60), EscalationLadder::default());
    let (h, exposed, remote) = write(&p, 2, false);
    h.cancel();
    let out = futures::executor::block_on(h).expect("not abandoned");
    // NIXL has no cancel: the request ran to its end.
    assert_eq!(out.result, Ok(()));
    let settled = futures::executor::block_on(exposed.settled());
    let g = lock(&p.sim);
    let acks: Vec<&Vec<u8>> = g.sent.iter().filter(|(from, _, _)| from == "ini").map(|(_, _, m)| m).collect();
    assert_eq!(acks, vec![&msg(ControlKind::AbortAck, remote.pool, remote.token, &remote.tenancies())]);
    assert_eq!(g.acks_while_in_flight, 0);
    assert!(g.reqs[&1].polls > 60);
    drop(g);
    assert_eq!(p.tgt.take_events()[0].kind, ControlKind::AbortAck);
    assert_eq!(p.ini.metrics().acks_sent, 1);
    settled.release();
    out.lease.release();
}

#[test]
fn request_cache_reposts_only_completed_requests_and_releases_them_before_teardown() {
    let sim: Shared = Arc::default();
    lock(&sim).behaviour = Some(Behaviour::DoneAfter(5));
    let cfg = AdapterConfig { request_cache: 2, ..fast() };
    let ini = NixlTransfer::new(Arc::new(mock(&sim, "ini", "tgt")), cfg).expect("ini");
    let tgt = NixlTransfer::new(Arc::new(mock(&sim, "tgt", "ini")), fast()).expect("tgt");
    let src = ini.register_pool(Arc::new(HostRegion::new(4 * SLOT).expect("r")), PoolConfig::new(SLOT)).expect("pool");
    let dst = tgt.register_pool(Arc::new(HostRegion::new(4 * SLOT).expect("r")), PoolConfig::new(SLOT)).expect("pool");
    let to_tgt = ini.add_peer(b"tgt").expect("peer");
    let to_ini = tgt.add_peer(b"ini").expect("peer");
    let (exposed, remote) = tgt.expose(dst.reserve(1).expect("r"), to_ini).expect("expose");
    let mut lease = src.reserve(1).expect("r");
    for _ in 0..3 {
        let h = futures::executor::block_on(ini.write(lease, &remote, TransferOptions::notify(false))).expect("post");
        let out = futures::executor::block_on(h).expect("not abandoned");
        assert_eq!(out.result, Ok(()));
        lease = out.lease.into_reserved();
    }
    {
        let g = lock(&sim);
        // One request created, posted three times, never released, never early.
        assert_eq!(g.next, 1);
        assert_eq!(g.log.iter().filter(|l| *l == "post 1").count(), 3);
        assert!(g.releases.is_empty());
        assert_eq!(g.early_releases, 0);
    }
    let m = ini.metrics();
    assert_eq!((m.reposted, m.cached_requests, m.in_flight), (2, 1, 0));
    // A notifying post is never served from the cache (its message differs).
    let h = futures::executor::block_on(ini.write(lease, &remote, TransferOptions::notify(true))).expect("post");
    let out = futures::executor::block_on(h).expect("not abandoned");
    assert_eq!(lock(&sim).next, 2);
    futures::executor::block_on(exposed.settled()).release();
    out.lease.release();
    // Teardown: the cached request is released before the peer is invalidated,
    // and everything before memory is deregistered.
    ini.remove_peer(to_tgt, Duration::from_secs(1)).expect("remove peer");
    let r = ini.shutdown(Duration::from_secs(1));
    assert_eq!((r.deregistered, r.leaked), (1, 0));
    let g = lock(&sim);
    let at = |what: &str| g.log.iter().position(|l| l == what).unwrap_or(usize::MAX);
    assert!(at("release 1") < at("invalidate"), "{:?}", g.log);
    assert!(at("invalidate") < at("deregister"), "{:?}", g.log);
}

/// An initiator whose requests behave as `b` (request cache 4, a 1 s inline
/// window) and a target, a 4-slot pool on each, each the other's peer:
/// `(sim, ini, tgt, src, dst, ini as the target numbers it)`.
fn inline_rig(b: Behaviour) -> (Shared, NixlTransfer, NixlTransfer, SlotPool, SlotPool, PeerId) {
    let sim: Shared = Arc::default();
    lock(&sim).behaviour = Some(b);
    let cfg = AdapterConfig { inline_poll: Duration::from_secs(1), request_cache: 4, ..fast() };
    let ini = NixlTransfer::new(Arc::new(mock(&sim, "ini", "tgt")), cfg).expect("ini");
    let tgt = NixlTransfer::new(Arc::new(mock(&sim, "tgt", "ini")), fast()).expect("tgt");
    let src = ini.register_pool(Arc::new(HostRegion::new(4 * SLOT).expect("r")), PoolConfig::new(SLOT)).expect("pool");
    let dst = tgt.register_pool(Arc::new(HostRegion::new(4 * SLOT).expect("r")), PoolConfig::new(SLOT)).expect("pool");
    ini.add_peer(b"tgt").expect("peer");
    let to_ini = tgt.add_peer(b"ini").expect("peer");
    (sim, ini, tgt, src, dst, to_ini)
}

#[test]
fn inline_poll_finishes_in_the_posting_thread_only_at_a_terminal_status() {
    // Default request cache and a generous inline window: the mock's requests end
    // while the posting thread polls them.
    assert_eq!(AdapterConfig::default().request_cache, 64, "the cache is on by default");
    let (sim, ini, tgt, src, dst, to_ini) = inline_rig(Behaviour::DoneAfter(3));
    let (exposed, remote) = tgt.expose(dst.reserve(1).expect("r"), to_ini).expect("expose");
    let mut lease = src.reserve(1).expect("r");
    for i in 0..3u64 {
        let h = futures::executor::block_on(ini.write(lease, &remote, TransferOptions::notify(false))).expect("post");
        // Finished before `post` returned: the handle is ready, the request was
        // polled to `Done` (never released early), and kept for re-posting.
        let out = h.now_or_never().expect("finished inline").expect("not abandoned");
        assert_eq!(out.result, Ok(()));
        {
            let g = lock(&sim);
            assert!(g.reqs[&1].done && g.reqs[&1].polls > 3);
            assert!(g.releases.is_empty());
            assert_eq!(g.early_releases, 0);
        }
        let m = ini.metrics();
        assert_eq!((m.posted, m.reposted, m.completed_ok, m.in_flight), (i + 1, i, i + 1, 0));
        lease = out.lease.into_reserved();
    }
    // An error status met while polling inline proves nothing: the handle ends
    // `Abandoned`, the lease stays quarantined, and the request is released only
    // once terminal.
    lock(&sim).behaviour = Some(Behaviour::FailAfter(2));
    let (exposed2, remote2) = tgt.expose(dst.reserve(1).expect("r"), to_ini).expect("expose");
    let h =
        futures::executor::block_on(ini.write(src.reserve(1).expect("r"), &remote2, TransferOptions::notify(false)))
            .expect("post");
    let ab = futures::executor::block_on(h).expect_err("abandoned");
    assert!(ab.error.is_some());
    assert!(wait_until(Duration::from_secs(2), || ini.metrics().in_flight == 0));
    assert_eq!(ini.metrics().failed_unproven, 1);
    assert_eq!(src.metrics().quarantined, 1);
    assert_eq!(lock(&sim).early_releases, 0);
    lease.release();
    exposed.abort();
    exposed2.abort();
    // Teardown releases the kept request before deregistering.
    let r = ini.shutdown(Duration::from_secs(1));
    assert_eq!(r.in_flight_left, 0);
    let g = lock(&sim);
    let at = |what: &str| g.log.iter().position(|l| l == what).unwrap_or(usize::MAX);
    assert!(at("release 1") < at("deregister"), "{:?}", g.log);
}

#[test]
fn a_repost_done_at_the_first_status_poll_completes_in_the_post_and_an_error_there_proves_nothing() {
    // Each post returns `IN_PROG`; the first status poll says `Done`. A re-post of
    // a cached request is then finished at the one status poll made under the
    // adapter's lock: no op registered, the request kept (never released), the
    // lease settled only after the terminal status.
    let (sim, ini, tgt, src, dst, to_ini) = inline_rig(Behaviour::DoneAfter(0));
    let (exposed, remote) = tgt.expose(dst.reserve(1).expect("r"), to_ini).expect("expose");
    let mut lease = src.reserve(1).expect("r");
    for i in 0..3u64 {
        let h = futures::executor::block_on(ini.write(lease, &remote, TransferOptions::notify(false))).expect("post");
        let out = h.now_or_never().expect("finished in the post").expect("not abandoned");
        assert_eq!(out.result, Ok(()));
        {
            let g = lock(&sim);
            // Posted, then polled exactly once to `Done` (re-posts included);
            // a re-post and its poll are one engine call.
            assert_eq!((g.reqs[&1].polls, g.reqs[&1].done), (1, true));
            assert_eq!(g.log.iter().filter(|l| *l == "post 1").count() as u64, i + 1);
            assert_eq!(g.log.iter().filter(|l| *l == "post+poll 1").count() as u64, i);
            assert!(g.releases.is_empty());
            assert_eq!(g.early_releases, 0);
        }
        let m = ini.metrics();
        assert_eq!((m.posted, m.reposted, m.completed_ok, m.in_flight, m.cached_requests), (i + 1, i, i + 1, 0, 1));
        lease = out.lease.into_reserved();
    }
    // The same poll meeting an error status: terminal but unproven. The handle
    // ends `Abandoned`, the lease stays quarantined, the request is released
    // (not kept) and never early.
    lock(&sim).behaviour = Some(Behaviour::FailAfter(0));
    let h = futures::executor::block_on(ini.write(lease, &remote, TransferOptions::notify(false))).expect("post");
    let ab = futures::executor::block_on(h).expect_err("abandoned");
    assert!(ab.error.is_some());
    assert!(wait_until(Duration::from_secs(2), || ini.metrics().in_flight == 0));
    let m = ini.metrics();
    assert_eq!((m.failed_unproven, m.reposted, m.cached_requests), (1, 3, 0));
    assert_eq!(src.metrics().quarantined, 1);
    {
        let g = lock(&sim);
        assert_eq!(g.reqs[&1].polls, 1, "the error status was polled once and not lost");
        assert_eq!(g.releases, vec![1]);
        assert_eq!(g.early_releases, 0);
    }
    exposed.abort();
    let r = ini.shutdown(Duration::from_secs(1));
    assert_eq!(r.in_flight_left, 0);
}

#[test]
fn a_thread_that_keeps_reposting_takes_the_drivers_notification_poll_and_loses_nothing() {
    // While a thread keeps re-posting (each re-post done at its first status
    // poll), the initiator's driver hands its periodic `get_notifs` to that
    // thread; what it fetches (here the target's ABORT) is still handled.
    let (sim, ini, tgt, src, dst, to_ini) = inline_rig(Behaviour::DoneAfter(0));
    let (exposed, remote) = tgt.expose(dst.reserve(1).expect("r"), to_ini).expect("expose");
    let (aborted, remote2) = tgt.expose(dst.reserve(1).expect("r"), to_ini).expect("expose");
    let by_poster = |sim: &Shared| lock(sim).notif_polls.iter().filter(|(a, d, _)| *a == "ini" && !*d).count();
    let mut lease = Some(src.reserve(1).expect("r"));
    let mut repost = || {
        let l = lease.take().expect("lease");
        let h = futures::executor::block_on(ini.write(l, &remote, TransferOptions::notify(false))).expect("post");
        let out = h.now_or_never().expect("finished in the post").expect("not abandoned");
        assert_eq!(out.result, Ok(()));
        lease = Some(out.lease.into_reserved());
    };
    // Bounded: at most 20,000 re-posts or 5 s per phase.
    let keep_reposting = |until: &mut dyn FnMut() -> bool, repost: &mut dyn FnMut()| {
        let start = Instant::now();
        for _ in 0..20_000 {
            if until() || start.elapsed() > Duration::from_secs(5) {
                break;
            }
            repost();
        }
        until()
    };
    assert!(keep_reposting(&mut || by_poster(&sim) >= 2, &mut repost), "the posting thread never polled");
    // The target gives a slot up; the ABORT reaches the initiator while it posts.
    aborted.abort();
    assert!(keep_reposting(&mut || ini.metrics().aborts_received == 1, &mut repost), "the ABORT was lost");
    // Handled as when the driver fetches it: the slot is refused and acknowledged.
    let refused =
        futures::executor::block_on(ini.write(src.reserve(1).expect("r"), &remote2, TransferOptions::notify(false)));
    assert!(refused.is_err(), "a post to the aborted slot must be refused");
    assert!(wait_until(Duration::from_secs(2), || lock(&sim).sent.iter().any(|(from, _, m)| from == "ini"
        && *m == msg(ControlKind::AbortAck, remote2.pool, remote2.token, &remote2.tenancies()))));
    // Posting stopped: the driver polls by itself again.
    let driver_polls = || lock(&sim).notif_polls.iter().filter(|(a, d, _)| *a == "ini" && *d).count();
    let before = driver_polls();
    assert!(wait_until(Duration::from_secs(2), || driver_polls() > before + 1), "the driver stopped polling");
    lease.take().expect("lease").release();
    exposed.abort();
    let r = ini.shutdown(Duration::from_secs(1));
    assert_eq!(r.in_flight_left, 0);
}

/// Rule 8 on NIXL: an agent's name is the transport's, but a DONE from the
/// very agent the slots were exposed to (or one that replaced it under its
/// name) settles nothing without the exposure's token; it is counted in the
/// pool's `forged_rejected`, and the real DONE still settles.
#[test]
fn hostile_a_done_from_the_peers_agent_name_without_the_token_settles_nothing() {
    let p = pair(Behaviour::DoneAfter(0), EscalationLadder::default());
    let (exposed, remote) = p.tgt.expose(p.dst.reserve(2).expect("reserve"), p.ini_peer).expect("expose");
    let t = remote.tenancies();
    let push = |msg: Vec<u8>| {
        lock(&p.sim).inbox.entry("tgt".into()).or_default().push_back(Notification { agent: "ini".into(), msg });
    };
    for guess in [ExposureToken::default(), ExposureToken::from_bytes([0x5a; 16])] {
        push(msg(ControlKind::Done, remote.pool, guess, &t));
        push(msg(ControlKind::AbortAck, remote.pool, guess, &t));
    }
    assert!(wait_until(Duration::from_secs(2), || p.dst.metrics().forged_rejected >= 8), "{:?}", p.dst.metrics());
    let exposed = exposed.try_settled().expect_err("a DONE without the token settled the exposure");
    push(msg(ControlKind::Done, remote.pool, remote.token, &t));
    futures::executor::block_on(exposed.settled()).release();
}

/// The second round of hostile peers against the initiator side's abort
/// state (rule 9): ABORTs are pushed into the initiator's notification queue
/// under the decode's agent name (what NIXL lets any agent claim).
mod hostile_aborts {
    use super::*;

    const CAP: usize = 64;

    fn pair_with(behaviour: Behaviour, policy: ReleasePolicy) -> Pair {
        let sim: Shared = Arc::default();
        lock(&sim).behaviour = Some(behaviour);
        let cfg = AdapterConfig { max_aborted: CAP, release_policy: policy, ..fast() };
        let ini = NixlTransfer::new(Arc::new(mock(&sim, "ini", "tgt")), cfg).expect("ini");
        let tgt = NixlTransfer::new(Arc::new(mock(&sim, "tgt", "ini")), fast()).expect("tgt");
        let src = ini.register_pool(Arc::new(HostRegion::new(8 * SLOT).expect("r")), PoolConfig::new(SLOT)).expect("p");
        let dst = tgt.register_pool(Arc::new(HostRegion::new(8 * SLOT).expect("r")), PoolConfig::new(SLOT)).expect("p");
        ini.add_peer(b"tgt").expect("peer");
        let ini_peer = tgt.add_peer(b"ini").expect("peer");
        Pair { sim, ini, tgt, src, dst, ini_peer }
    }

    /// A message into the initiator's queue, claiming the decode's name.
    fn as_decode(p: &Pair, msg: Vec<u8>) {
        lock(&p.sim).inbox.entry("ini".into()).or_default().push_back(Notification { agent: "tgt".into(), msg });
    }

    fn made_up(i: u64) -> ExposureToken {
        let mut b = [0x3c; 16];
        b[..8].copy_from_slice(&i.to_le_bytes());
        ExposureToken::from_bytes(b)
    }

    fn post(p: &Pair, remote: &RemoteSlots) -> Result<TransferHandle, String> {
        match futures::executor::block_on(p.ini.write(
            p.src.reserve(remote.slots.len()).expect("r"),
            remote,
            TransferOptions::default(),
        )) {
            Ok(h) => Ok(h),
            Err(e) => {
                e.lease.release();
                Err(format!("{:?}", e.kind))
            }
        }
    }

    /// Attack 1: the decode aborts an exposure before the initiator posted;
    /// the initiator acks (the slot goes to the next tenant) and tombstones
    /// it; then a flood of ABORTs under made-up tokens, 10x the cap; then the
    /// initiator's late post of the old descriptor.
    fn flood_then_late_post(policy: ReleasePolicy) -> (Result<TransferHandle, String>, Pair) {
        let p = pair_with(Behaviour::DoneAfter(0), policy);
        let (exposed, remote) = p.tgt.expose(p.dst.reserve(1).expect("r"), p.ini_peer).expect("expose");
        exposed.abort();
        assert!(wait_until(Duration::from_secs(5), || p.dst.metrics().free == 8), "acked and freed");
        for i in 0..(10 * CAP) as u64 {
            let t = Tenancy::new(SlotId(100 + i as u32), Generation(1));
            as_decode(&p, msg(ControlKind::Abort, remote.pool, made_up(i), &[t]));
        }
        assert!(wait_until(Duration::from_secs(5), || p.ini.metrics().aborts_received == 1 + 10 * CAP as u64));
        (post(&p, &remote), p)
    }

    #[test]
    fn hostile_abort_flood_under_the_decodes_name_never_evicts_a_real_tombstone() {
        let (late, p) = flood_then_late_post(ReleasePolicy::Safe);
        let Err(e) = late else { panic!("the late post of an aborted tenancy was admitted after the flood") };
        assert!(e.contains("aborted"), "{e}");
        let m = p.ini.metrics().abort_tracker;
        assert_eq!(m.aborts_unverified, CAP as u64, "the flood bought the cap, no more: {m:?}");
        assert_eq!(m.aborts_refused, 9 * CAP as u64 + 1, "{m:?}");
    }

    #[test]
    fn hostile_abort_flood_positive_control_shared_fifo_admits_the_late_post() {
        let (late, _p) = flood_then_late_post(ReleasePolicy::Naive);
        assert!(late.is_ok(), "positive control: the flood should have evicted the tombstone: {:?}", late.err());
    }

    /// Attack 2: an ABORT at generation u64::MAX for the decode's pool under
    /// a made-up token; then an honest exposure of the same slot.
    fn last_generation_then_honest_post(policy: ReleasePolicy) -> Result<(), String> {
        let p = pair_with(Behaviour::DoneAfter(0), policy);
        for s in 0..8 {
            let t = Tenancy::new(SlotId(s), Generation(u64::MAX));
            as_decode(&p, msg(ControlKind::Abort, p.dst.id(), made_up(u64::from(s)), &[t]));
        }
        assert!(wait_until(Duration::from_secs(5), || p.ini.metrics().aborts_received == 8));
        let (exposed, remote) = p.tgt.expose(p.dst.reserve(1).expect("r"), p.ini_peer).expect("expose");
        let h = post(&p, &remote)?;
        let out = futures::executor::block_on(h).expect("not abandoned");
        out.lease.release();
        futures::executor::block_on(exposed.settled()).release();
        Ok(())
    }

    #[test]
    fn hostile_abort_at_the_last_generation_refuses_no_honest_post() {
        assert!(last_generation_then_honest_post(ReleasePolicy::Safe).is_ok());
        let e = last_generation_then_honest_post(ReleasePolicy::Naive).err();
        assert!(e.is_some_and(|e| e.contains("aborted")), "positive control: the pool's slot is dead for good");
    }

    /// Attack 3: the same ABORT, repeated 10,000 times while the operation on
    /// it is in flight: one entry waits, one ABORT_ACK goes out.
    fn repeated_abort(policy: ReleasePolicy) -> (u64, usize) {
        let p = pair_with(Behaviour::DoneAfter(3000), policy);
        let (exposed, remote) = p.tgt.expose(p.dst.reserve(1).expect("r"), p.ini_peer).expect("expose");
        let h = post(&p, &remote).expect("posted");
        let abort = msg(ControlKind::Abort, remote.pool, remote.token, &remote.tenancies());
        for _ in 0..10_000 {
            as_decode(&p, abort.clone());
        }
        assert!(wait_until(Duration::from_secs(10), || p.ini.metrics().aborts_received == 10_000));
        let waiting = p.ini.metrics().pending_aborts;
        let out = futures::executor::block_on(h).expect("not abandoned");
        out.lease.release();
        futures::executor::block_on(exposed.settled()).release();
        assert!(wait_until(Duration::from_secs(10), || p.ini.metrics().in_flight == 0
            && p.ini.metrics().pending_messages == 0));
        let acks = lock(&p.sim)
            .sent
            .iter()
            .filter(|(f, _, m)| f == "ini" && kind_of(m) == Some(ControlKind::AbortAck))
            .count();
        (acks as u64, waiting)
    }

    #[test]
    fn hostile_repeated_abort_while_in_flight_waits_once_and_is_acked_once() {
        let (acks, waiting) = repeated_abort(ReleasePolicy::Safe);
        assert_eq!((acks, waiting), (1, 1));
        // Positive control: every repeat waits apart (the naive initiator
        // also gives its request up at the ABORT, so its acks are withheld).
        let (_, waiting) = repeated_abort(ReleasePolicy::Naive);
        assert_eq!(waiting, 10_000, "positive control: every repeat waits apart");
    }
}

/// A peer's descriptor of one slot (slot 0, generation 1, at 0x10000) of
/// `pool`, in `memory`.
fn one_remote_slot(pool: PoolId, memory: kv_transfer_core::MemoryKind) -> RemoteSlots {
    RemoteSlots {
        endpoint: "tgt".into(),
        pool,
        key: 1,
        slot_size: SLOT as u64,
        memory,
        token: Default::default(),
        slots: vec![kv_transfer_core::RemoteSlot {
            slot: SlotId(0),
            generation: Generation(1),
            addr: 0x10000,
            key: None,
        }],
    }
}

/// Host memory that says it is of another kind (CUDA device 2's, or core's
/// fake device): what the adapter registers and describes is typed by the
/// region's kind, and the test never touches it through its address.
#[derive(Debug)]
struct KindOf(HostRegion, kv_transfer_core::MemoryKind);

impl kv_transfer_core::Region for KindOf {
    fn kind(&self) -> kv_transfer_core::MemoryKind {
        self.1
    }
    fn addr(&self) -> u64 {
        self.0.addr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), kv_transfer_core::RegionError> {
        self.0.read(offset, dst)
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), kv_transfer_core::RegionError> {
        self.0.write(offset, src)
    }
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }
}

/// Device memory is registered as VRAM of its device, and a post's
/// descriptors name each side's memory: the local pool's (VRAM, device 2)
/// and the one the remote descriptor says (VRAM, device 3). Core's fake device,
/// which only staging can reach, is refused by name.
#[test]
fn device_memory_is_registered_and_described_as_vram_of_its_device() {
    use crate::engine::MemType;
    let specs: Arc<Mutex<Vec<crate::engine::XferSpec>>> = Arc::default();
    let mut m = MockNixlEngine::new();
    m.expect_agent_name().return_const("ini".to_string());
    m.expect_register_mem()
        .withf(|r| r.len() == 1 && r[0].mem == MemType::Vram && r[0].dev_id == 2)
        .times(1)
        .returning(|_| Ok(RegId(1)));
    m.expect_load_remote_metadata().returning(|_| Ok("tgt".into()));
    let s = specs.clone();
    m.expect_create_xfer().returning(move |spec| {
        s.lock().unwrap_or_else(|p| p.into_inner()).push(spec.clone());
        Ok(ReqId(1))
    });
    m.expect_post_xfer().returning(|_| Ok(XferState::Done));
    m.expect_post_xfer_polled().returning(|_, _| (Ok(XferState::Done), None));
    m.expect_xfer_status().returning(|_| Ok(XferState::Done));
    m.expect_release_xfer().returning(|_| Ok(()));
    m.expect_get_notifs().returning(|| Ok(Vec::new()));
    m.expect_gen_notif().returning(|_, _| Ok(()));
    m.expect_deregister().returning(|_| Ok(()));
    let ini = NixlTransfer::new(Arc::new(m), fast()).expect("ini");
    let region =
        Arc::new(KindOf(HostRegion::new(2 * SLOT).expect("r"), kv_transfer_core::MemoryKind::Device { ordinal: 2 }));
    let pool = ini.register_pool(region, PoolConfig::new(SLOT)).expect("a device pool");
    assert_eq!(pool.memory(), kv_transfer_core::MemoryKind::Device { ordinal: 2 });
    ini.add_peer(b"tgt").expect("peer");
    // The peer's slots are device 3's: the remote side is typed by the
    // descriptor, the local one by the pool.
    let remote = one_remote_slot(PoolId(7), kv_transfer_core::MemoryKind::Device { ordinal: 3 });
    let h = futures::executor::block_on(ini.write(pool.reserve(1).expect("r"), &remote, TransferOptions::default()))
        .expect("post");
    let _ = futures::executor::block_on(h);
    let specs = specs.lock().unwrap_or_else(|p| p.into_inner());
    let spec = specs.first().expect("a request was created");
    assert!(spec.local.iter().all(|d| d.mem == MemType::Vram && d.dev_id == 2), "{:?}", spec.local);
    assert!(spec.remote.iter().all(|d| d.mem == MemType::Vram && d.dev_id == 3), "{:?}", spec.remote);
    drop(specs);
    let fake = Arc::new(KindOf(HostRegion::new(SLOT).expect("r"), kv_transfer_core::MemoryKind::FAKE_DEVICE));
    assert!(matches!(ini.register_pool(fake, PoolConfig::new(SLOT)), Err(AdapterError::UnsupportedMemory(_))));
}
