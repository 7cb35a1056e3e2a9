//! The simulator's side of core's drain protocol (`kv_transfer_core::drain`):
//! CONTROL frames in (DONE and ABORT_ACK settle exposures through the NIC's
//! drain [`Driver`](kv_transfer_core::drain::Driver), an ABORT goes to the
//! connection's `AbortTracker`), the driver thread executing core's
//! [`Action`]s (ABORT, revocation, fence),
//! and teardown, which fences a connection (`Fenced`) as connection loss and
//! shutdown do.

use super::conn::{Conn, OpEntry};
use super::registration::{Reg, RevokeOutcome};
use super::{lock, InboundEvent, NicInner};
use crate::stats::inc;
use crate::wire::Body;
use kv_transfer_core::drain::{Action, ControlKind, ControlMessage, DrainCounters};
use kv_transfer_core::{PeerId, Tenancy, TransferError};
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
            ControlKind::Done => self.settle_from_peer(conn, msg, true),
            ControlKind::AbortAck => self.settle_from_peer(conn, msg, false),
            ControlKind::Abort => self.on_abort(conn, msg),
        }
    }

    /// DONE (`notify`) or ABORT_ACK: core's drain driver says which named
    /// tenancies the peer may settle (exposed to this connection, under the
    /// message's token); each one's binding is cleared (in-flight applies
    /// drained) before its `Completed` proof. The positive control clears
    /// nothing (its stale writes must still land).
    fn settle_from_peer(&self, conn: &Conn, msg: ControlMessage, notify: bool) {
        let mut d = lock(&self.drain).on_settling(conn.peer, &msg);
        let Some(reg) = d.pool().and_then(|p| self.reg_for_pool(p)) else {
            let _ = d.deliver();
            return;
        };
        if !self.cfg.policy.is_naive() {
            let mut not_bound = 0;
            d.retain(|t| match reg.revoke(t, self.cfg.revoke_wait) {
                RevokeOutcome::Revoked => true,
                // A stalled apply keeps the binding: no proof; the ladder fences.
                RevokeOutcome::TimedOut => {
                    inc(&self.counters.revocations_timed_out);
                    false
                }
                RevokeOutcome::NotBound => {
                    not_bound += 1;
                    false
                }
            });
            d.add_stale(not_bound);
        }
        let settled = d.tenancies();
        let _ = d.deliver();
        if notify {
            self.event(InboundEvent::Notified { peer: conn.peer, key: reg.key, tenancies: settled });
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

    /// The drain's one loop: connection losses, then core's driver's
    /// actions, then sleep until its next deadline or a kick.
    pub(super) fn driver_loop(self: Arc<Self>) {
        let mut next: Option<Duration> = None;
        loop {
            let dead = {
                let timeout = next.map_or(DRIVER_TICK, |d| d.min(DRIVER_TICK));
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
            // The pools' locks are taken with the driver's released: posting
            // threads take the driver's to expose.
            let due = lock(&self.drain).due();
            let mut steps = due.collect();
            let actions = lock(&self.drain).plan(&mut steps);
            next = steps.next_deadline();
            for a in actions {
                self.execute(a);
            }
        }
    }

    /// Executes one of core's drain actions.
    fn execute(&self, a: Action) {
        match a {
            Action::SendAbort { peer, messages } => {
                if let Some(conn) = self.conn(peer) {
                    for m in messages {
                        DrainCounters::add(&self.drain_counters.aborts_sent, 1);
                        self.send_control(&conn, m);
                    }
                }
            }
            Action::Revoke { pool, peer, tenancies } => {
                if let Some(reg) = self.reg_for_pool(pool) {
                    self.revoke_tenancies(&reg, peer, &tenancies);
                }
            }
            Action::Fence { peer } => {
                self.teardown(peer, "escalation: fence");
            }
            Action::Deliver(d) => {
                let _ = d.deliver();
            }
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
        let n = done.len();
        let _ = lock(&self.drain).revoked(reg.pool.id(), peer, &done).deliver();
        n
    }

    /// Tears the connection to `peer` down, joins its threads, fails its
    /// operations and delivers `Fenced(peer)` to every pool.
    pub(super) fn teardown(&self, peer: PeerId, reason: &str) -> bool {
        let conn = lock(&self.conns).remove(&peer);
        let Some(conn) = conn else {
            if lock(&self.fenced).contains(&peer) {
                // Already torn down: nothing can arrive from it.
                let mut drain = lock(&self.drain);
                let proofs = drain.fence_proofs(peer);
                let d = drain.lost(proofs);
                drop(drain);
                let _ = d.deliver();
                return true;
            }
            return false;
        };
        // Minted before the teardown starts, delivered once it is joined.
        let proofs = lock(&self.drain).fence_proofs(peer);
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
        let d = lock(&self.drain).fenced(proofs);
        let _ = d.deliver();
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
