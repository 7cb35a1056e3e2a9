//! The simulator's side of core's drain protocol (`kv_transfer_core::drain`):
//! CONTROL frames in (DONE and ABORT_ACK settle exposures through the NIC's
//! [`ExposureTable`], an ABORT goes to the connection's `AbortTracker`), the
//! escalation driver executing core's [`Plan`]s (ABORT, revocation, fence),
//! and teardown, which fences a connection (`Fenced`) as connection loss and
//! shutdown do.

use super::conn::{Conn, OpEntry};
use super::registration::{Reg, RevokeOutcome};
use super::{lock, InboundEvent, NicInner};
use crate::stats::{add, inc};
use crate::wire::Body;
use kv_transfer_core::drain::{ControlKind, ControlMessage, Plan};
use kv_transfer_core::{EscalationAction, PeerId, Tenancy, TransferError};
use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Longest sleep of the escalation driver between checks.
const DRIVER_TICK: Duration = Duration::from_millis(100);

impl NicInner {
    /// Sends a control message (split into frames of at most
    /// [`MAX_TENANCIES`](kv_transfer_core::drain::MAX_TENANCIES) tenancies).
    pub(super) fn send_control(&self, conn: &Conn, msg: ControlMessage) {
        for m in msg.chunks() {
            conn.send_frame(&Body::Control(m));
        }
    }

    /// A CONTROL frame from the peer of `conn` (the connection is the
    /// peer's identity: a name it declared proves nothing).
    pub(super) fn on_control(&self, conn: &Conn, msg: ControlMessage) {
        match msg.kind {
            ControlKind::Done => {
                inc(&self.counters.notifications_received);
                self.settle_from_peer(conn, msg, true);
            }
            ControlKind::AbortAck => {
                inc(&self.counters.abort_acks_received);
                self.settle_from_peer(conn, msg, false);
            }
            ControlKind::Abort => self.on_abort(conn, msg),
        }
    }

    /// DONE (`notify`) or ABORT_ACK: core's exposure table says which named
    /// tenancies the peer may settle (exposed to this connection, under the
    /// message's token); each one's binding is cleared (in-flight applies
    /// drained) before its `Completed` proof.
    fn settle_from_peer(&self, conn: &Conn, msg: ControlMessage, notify: bool) {
        let Some(reg) = self.reg_for_pool(msg.pool) else {
            add(&self.counters.notifications_stale, msg.tenancies.len() as u64);
            return;
        };
        if self.cfg.policy.is_naive() {
            // The positive control checks nothing (the digests still travel:
            // integrity on consume is the second line it is tested against).
            let pairs: Vec<_> = msg.tenancies.iter().copied().zip(msg.digests.iter().copied()).collect();
            reg.authority.deliver(reg.authority.completed_with_digests(&msg.tenancies, &pairs, msg.token));
            if notify {
                self.event(InboundEvent::Notified { peer: conn.peer, key: reg.key, tenancies: msg.tenancies });
            }
            return;
        }
        let mut v = lock(&self.exposures).accept(conn.peer, &msg);
        let mut cleared = Vec::with_capacity(v.settled.len());
        for t in std::mem::take(&mut v.settled) {
            match reg.revoke(t, self.cfg.revoke_wait) {
                RevokeOutcome::Revoked => cleared.push(t),
                // A stalled apply keeps the binding: no proof; the ladder fences.
                RevokeOutcome::TimedOut => inc(&self.counters.revocations_timed_out),
                RevokeOutcome::NotBound => v.stale += 1,
            }
        }
        v.digests.retain(|(t, _)| cleared.contains(t));
        v.settled = cleared;
        add(&self.counters.notifications_stale, (v.stale + v.forged + v.untrusted) as u64);
        add(&self.counters.forged, v.forged as u64);
        v.deliver(&reg.authority);
        if notify {
            self.event(InboundEvent::Notified { peer: conn.peer, key: reg.key, tenancies: v.settled });
        }
    }

    /// ABORT from the target: core's abort tracker answers at once, or once
    /// every operation of ours on those tenancies is terminal; meanwhile
    /// their WRs that have not left yet are canceled.
    fn on_abort(&self, conn: &Conn, msg: ControlMessage) {
        inc(&self.counters.aborts_received);
        let mut st = lock(&conn.st);
        for w in st.wrs.values_mut() {
            if !w.sent && w.pool == Some(msg.pool) && msg.tenancies.contains(&w.tenancy) {
                w.aborted = true;
            }
        }
        let ack = st.aborts.on_abort(&(), msg);
        drop(st);
        if let Some(a) = ack {
            inc(&self.counters.abort_acks_sent);
            self.send_control(conn, a.msg);
        }
    }

    pub(super) fn driver_loop(self: Arc<Self>) {
        loop {
            let dead = {
                let regs = self.all_regs();
                let mut timeout = DRIVER_TICK;
                for r in &regs {
                    if let Some(d) = r.authority.next_escalation_in() {
                        timeout = timeout.min(d);
                    }
                }
                let mut s = lock(&self.signal.m);
                if !s.kicked && s.dead.is_empty() && !timeout.is_zero() {
                    s = match self.signal.cv.wait_timeout(s, timeout) {
                        Ok((g, _)) => g,
                        Err(p) => p.into_inner().0,
                    };
                }
                s.kicked = false;
                std::mem::take(&mut s.dead)
            };
            if self.shutdown.load(Ordering::SeqCst) {
                break;
            }
            for peer in dead {
                self.teardown(peer, "connection lost");
            }
            for reg in self.all_regs() {
                for a in reg.authority.poll_escalations() {
                    self.escalate(&reg, a);
                }
            }
        }
    }

    /// Executes core's plan for one escalation action.
    fn escalate(&self, reg: &Reg, a: EscalationAction) {
        tracing::debug!(peer = a.peer.0, step = ?a.step, slots = a.tenancies.len(), "escalation");
        let plan = lock(&self.exposures).plan(reg.pool.id(), &a, reg.authority.capabilities(), self.cfg.policy);
        if let Some(ts) = plan.release_without_proof() {
            // THE BUG, on purpose (the positive control): a proof without evidence.
            add(&self.counters.naive_releases, ts.len() as u64);
            reg.authority.deliver(reg.authority.completed(ts));
            return;
        }
        #[allow(unreachable_patterns)]
        match plan {
            Plan::Nothing => {}
            Plan::SendAbort { peer, messages } => {
                if let Some(conn) = self.conn(peer) {
                    for m in messages {
                        inc(&self.counters.aborts_sent);
                        self.send_control(&conn, m);
                    }
                }
            }
            Plan::Revoke { peer, tenancies } => {
                self.revoke_tenancies(reg, peer, &tenancies);
            }
            Plan::Fence { peer } => {
                self.teardown(peer, "escalation: fence");
            }
            Plan::Stuck { peer, tenancies } => {
                tracing::error!(
                    peer = peer.0,
                    slots = tenancies.len(),
                    "escalation exhausted: slots stay quarantined (a leak, not a reuse)"
                );
            }
            _ => {}
        }
    }

    /// Revokes `ts` (exposed to `peer`) at the NIC; only confirmed ones
    /// leave the exposure table and get a `Revoked` proof.
    pub(super) fn revoke_tenancies(&self, reg: &Reg, peer: PeerId, ts: &[Tenancy]) -> usize {
        let mut done = Vec::new();
        for t in ts {
            match reg.revoke(*t, self.cfg.revoke_wait) {
                RevokeOutcome::Revoked => done.push(*t),
                RevokeOutcome::TimedOut => inc(&self.counters.revocations_timed_out),
                RevokeOutcome::NotBound => {}
            }
        }
        lock(&self.exposures).revoked(reg.pool.id(), peer, &done);
        if !done.is_empty() {
            add(&self.counters.revocations, done.len() as u64);
            reg.authority.deliver(reg.authority.revoked(&done));
        }
        done.len()
    }

    /// Tears the connection to `peer` down, joins its threads, fails its
    /// operations and delivers `Fenced(peer)` to every pool.
    pub(super) fn teardown(&self, peer: PeerId, reason: &str) -> bool {
        let conn = lock(&self.conns).remove(&peer);
        let Some(conn) = conn else {
            if lock(&self.fenced).contains(&peer) {
                for reg in self.all_regs() {
                    reg.authority.deliver(reg.authority.fenced(peer));
                }
                return true;
            }
            return false;
        };
        // Minted before the teardown starts, delivered once it is joined: each
        // covers the exposures to this connection made so far (core's fence
        // epoch), none made later.
        let proofs: Vec<_> = self
            .all_regs()
            .into_iter()
            .map(|r| {
                let proof = r.authority.fenced(peer);
                (r, proof)
            })
            .collect();
        conn.dead.store(true, Ordering::SeqCst);
        conn.close_tx();
        let _ = conn.stream.shutdown(Shutdown::Both);
        let me = std::thread::current().id();
        for t in lock(&conn.threads).drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        lock(&self.fenced).insert(peer);
        inc(&self.counters.fences);
        let ops: Vec<OpEntry> = {
            let mut st = lock(&conn.st);
            st.closed = true;
            st.wrs.clear();
            st.aborts.forget_peer(&());
            st.ops.drain().map(|(_, o)| o).collect()
        };
        lock(&conn.tx.q).q.clear();
        for op in ops {
            self.finish_op(peer, op, Err(TransferError::Transport(reason.to_string())), true);
        }
        lock(&self.exposures).fenced(peer);
        for (reg, proof) in proofs {
            reg.authority.deliver(proof);
        }
        tracing::debug!(nic = %self.cfg.name, peer = peer.0, reason, "connection fenced");
        self.event(InboundEvent::PeerLost { peer });
        true
    }

    pub(super) fn shutdown_graceful(&self) {
        if self.shutdown.swap(true, Ordering::SeqCst) {
            // Already shut down or crashed: still join what is left.
            self.join_threads();
            return;
        }
        let peers: Vec<PeerId> = lock(&self.conns).keys().copied().collect();
        for p in peers {
            self.teardown(p, "NIC shut down");
        }
        self.join_threads();
    }

    fn join_threads(&self) {
        self.wake_acceptor();
        self.signal.kick();
        let me = std::thread::current().id();
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
