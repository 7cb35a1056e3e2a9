//! Settlement, abort and escalation, kept together: NOTIFY and ABORT_ACK
//! from the peer settle exposures here (`Completed`), an ABORT from the
//! target is answered once the work requests it names are terminal, the
//! escalation driver walks the ladder (ABORT, revocation, fence), and a
//! teardown fences a connection (`Fenced`) as connection loss and
//! shutdown do.

use super::conn::{Conn, OpEntry, PendingAbort};
use super::registration::{Reg, RevokeOutcome};
use super::{lock, HashSet, InboundEvent, NicInner, ReleasePolicy};
use crate::stats::{add, inc};
use crate::wire::{self, Body, TenancyList};
use kv_transfer_core::{EscalationAction, EscalationStep, PeerId, Tenancy, TransferError};
use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Longest sleep of the escalation driver between checks.
const DRIVER_TICK: Duration = Duration::from_millis(100);

impl NicInner {
    /// NOTIFY (`notify`) or ABORT_ACK from the peer: settle the tenancies it
    /// names that are bound to it here, after clearing their bindings.
    pub(super) fn settle_from_peer(&self, conn: &Conn, l: TenancyList, notify: bool) {
        let Some(reg) = self.reg_for_key(l.key) else {
            add(&self.counters.notifications_stale, l.tenancies.len() as u64);
            return;
        };
        let mut ok = Vec::with_capacity(l.tenancies.len());
        for t in &l.tenancies {
            let valid = match self.cfg.policy {
                ReleasePolicy::Naive => true,
                ReleasePolicy::Safe => {
                    reg.is_bound(*t, conn.peer) && reg.revoke(*t, self.cfg.revoke_wait) == RevokeOutcome::Revoked
                }
            };
            if valid {
                ok.push(*t);
            } else {
                inc(&self.counters.notifications_stale);
                reg.authority.record_stale(1);
            }
        }
        if !ok.is_empty() {
            reg.authority.deliver(reg.authority.completed(&ok));
        }
        if notify {
            self.event(InboundEvent::Notified { peer: conn.peer, key: l.key, tenancies: ok });
        }
    }

    /// ABORT from the target: cancel what has not left yet, ack once every
    /// WR aimed at these tenancies is terminal.
    pub(super) fn on_abort(&self, conn: &Conn, l: TenancyList) {
        inc(&self.counters.aborts_received);
        let set: HashSet<Tenancy> = l.tenancies.iter().copied().collect();
        let mut st = lock(&conn.st);
        let mut waiting = HashSet::default();
        for (id, w) in st.wrs.iter_mut() {
            if w.key == l.key && set.contains(&w.tenancy) {
                if !w.sent {
                    w.aborted = true;
                }
                waiting.insert(*id);
            }
        }
        if waiting.is_empty() {
            drop(st);
            inc(&self.counters.abort_acks_sent);
            conn.send_frame(&Body::AbortAck(l));
        } else {
            st.aborts.push(PendingAbort { list: l, waiting });
        }
    }

    pub(super) fn driver_loop(self: Arc<Self>) {
        loop {
            let dead = {
                let regs = self.all_regs();
                let mut timeout = DRIVER_TICK;
                for r in &regs {
                    if let Some(at) = r.authority.next_escalation_at() {
                        timeout = timeout.min(at.saturating_duration_since(r.clock.now()));
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
                for a in reg.authority.poll_escalations(reg.clock.now()) {
                    self.escalate(&reg, a);
                }
            }
        }
    }

    fn escalate(&self, reg: &Reg, a: EscalationAction) {
        tracing::debug!(peer = a.peer.0, step = ?a.step, slots = a.tenancies.len(), "escalation");
        if self.cfg.policy == ReleasePolicy::Naive {
            if a.step == EscalationStep::RequestDrain {
                // THE BUG, on purpose: a proof without evidence.
                add(&self.counters.naive_releases, a.tenancies.len() as u64);
                reg.authority.deliver(reg.authority.completed(&a.tenancies));
            }
            return;
        }
        match a.step {
            EscalationStep::RequestDrain => {
                let ts: Vec<Tenancy> = a.tenancies.iter().copied().filter(|t| reg.is_bound(*t, a.peer)).collect();
                if ts.is_empty() {
                    return;
                }
                if let Some(conn) = self.conn(a.peer) {
                    for chunk in ts.chunks(wire::MAX_TENANCIES) {
                        inc(&self.counters.aborts_sent);
                        conn.send_frame(&Body::Abort(TenancyList { key: reg.key, tenancies: chunk.to_vec() }));
                    }
                }
            }
            EscalationStep::Revoke => {
                self.revoke_tenancies(reg, &a.tenancies);
            }
            EscalationStep::Fence => {
                self.teardown(a.peer, "escalation: fence");
            }
            EscalationStep::Exhausted => {
                tracing::error!(
                    peer = a.peer.0,
                    slots = a.tenancies.len(),
                    "escalation exhausted: slots stay quarantined (a leak, not a reuse)"
                );
            }
        }
    }

    pub(super) fn revoke_tenancies(&self, reg: &Reg, ts: &[Tenancy]) -> usize {
        let mut done = Vec::new();
        for t in ts {
            match reg.revoke(*t, self.cfg.revoke_wait) {
                RevokeOutcome::Revoked => done.push(*t),
                RevokeOutcome::TimedOut => inc(&self.counters.revocations_timed_out),
                RevokeOutcome::NotBound => {}
            }
        }
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
            st.aborts.clear();
            st.ops.drain().map(|(_, o)| o).collect()
        };
        lock(&conn.tx.q).q.clear();
        for op in ops {
            self.finish_op(peer, op, Err(TransferError::Transport(reason.to_string())), true);
        }
        for reg in self.all_regs() {
            reg.authority.deliver(reg.authority.fenced(peer));
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
