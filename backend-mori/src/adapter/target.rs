//! The target side and the drain protocol's messages: settlement of
//! exposures from inbound statuses, ABORT / ABORT_ACK through core's
//! control-message codec, fences, and the execution of core's escalation
//! plan. All of it runs on the driver thread.

use kv_transfer_core::drain::{self, Action, ControlKind, ControlMessage, DrainCounters};
use kv_transfer_core::{PeerId, Tenancy};

use super::state::{inc, Inner, PoolEntry};
use super::wire::unpack_tag;
use super::TOMBSTONES;
use crate::types::{EngineKey, InboundStatus};
use crate::util::lock;

impl Inner {
    /// Settles `t` of `entry` from an inbound status of `peer` (the engine
    /// binds it to the peer's connection): `Completed` if it is that peer's
    /// current exposure, else stale. Returns whether it settled.
    fn settle_by_status(&self, entry: &PoolEntry, peer: PeerId, t: Tenancy) -> bool {
        if !lock(&self.drain).take(entry.pool.id(), t, peer) {
            entry.authority.record_stale(1);
            return false;
        }
        if !self.clear_access(entry, t) {
            return false;
        }
        entry.authority.deliver(entry.authority.completed(&[t]));
        true
    }

    /// Ends the peer's access to `t` before its `Completed` proof. On a
    /// transport that can revoke, only a confirmed revocation will do: a
    /// write still applying at our NIC (a peer that reports success while
    /// its own WRITE is stalled mid-payload) keeps the slot out of reuse,
    /// and the ladder's fence settles it. A transport that cannot revoke
    /// (MORI on RDMA) has nothing to clear: the peer's status is the proof.
    fn clear_access(&self, entry: &PoolEntry, t: Tenancy) -> bool {
        if !self.caps.revoke {
            let _ = self.engine.withdraw_access(&entry.desc, t.slot.0, t.generation.0);
            return true;
        }
        match self.engine.revoke_access(&entry.desc, t.slot.0, t.generation.0) {
            Ok(true) => true,
            other => {
                tracing::warn!(slot = t.slot.0, result = ?other, "access not confirmed revoked: no proof, the slot stays out");
                false
            }
        }
    }

    pub(super) fn on_status(&self, s: InboundStatus) {
        let c = &self.hub.counters;
        let (settle, mem, t) = unpack_tag(s.tag);
        if !settle {
            inc(&c.inbound_no_settle);
            return;
        }
        if !s.code.is_terminal() {
            inc(&c.inbound_unknown);
            tracing::warn!(peer = %s.remote, uid = s.uid, code = %s.code, "inbound status proves nothing");
            return;
        }
        let Some(entry) = self.pool_by_mem(mem) else {
            inc(&c.inbound_stale);
            return;
        };
        match self.peer_id(&s.remote) {
            Some(p) => {
                if !s.code.is_success() && lock(&self.drain).exposures().is_exposed(entry.pool.id(), t, p) {
                    // Recorded before the proof, so the application sees it
                    // as soon as the slot is settled.
                    inc(&c.inbound_failed);
                    let mut f = lock(&self.failed);
                    let k = (entry.pool.id(), t);
                    if f.set.insert(k) {
                        f.order.push_back(k);
                        if f.order.len() > TOMBSTONES {
                            if let Some(old) = f.order.pop_front() {
                                f.set.remove(&old);
                            }
                        }
                    }
                }
                if self.settle_by_status(&entry, p, t) {
                    inc(&c.inbound_settled);
                } else {
                    inc(&c.inbound_stale);
                }
            }
            None => {
                inc(&c.inbound_stale);
                entry.authority.record_stale(1);
            }
        }
    }

    /// A control message of core's drain protocol from `from` (the engine
    /// binds messages to the peer's connection).
    pub(super) fn on_message(&self, from: &EngineKey, bytes: &[u8]) {
        let msg = match ControlMessage::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(peer = %from, error = %e, "malformed control message dropped");
                return;
            }
        };
        match msg.kind {
            ControlKind::Abort => {
                inc(&self.hub.counters.aborts_received);
                let ack = match self.peer_id(from) {
                    Some(peer) => lock(&self.hub.ops).aborts.on_abort(&peer, msg),
                    // A peer never added has no transfer of ours to wait for.
                    None => Some(drain::Outgoing {
                        to: PeerId(0),
                        msg: ControlMessage::new(ControlKind::AbortAck, msg.pool, msg.token, msg.tenancies),
                    }),
                };
                if let Some(a) = ack {
                    self.send(from, a.msg);
                }
            }
            ControlKind::AbortAck => {
                let Some(peer) = self.peer_id(from) else {
                    if let Some(entry) = self.pool_entry(msg.pool) {
                        entry.authority.record_stale(msg.tenancies.len() as u64);
                    }
                    return;
                };
                let mut d = lock(&self.drain).on_settling(peer, &msg);
                if let Some(entry) = self.pool_entry(msg.pool) {
                    d.retain(|t| self.clear_access(&entry, t));
                }
                let _ = d.deliver();
            }
            // This adapter's DONE is the engine's inbound status.
            ControlKind::Done => tracing::warn!(peer = %from, "unexpected DONE message dropped"),
        }
    }

    pub(super) fn send(&self, to: &EngineKey, msg: ControlMessage) {
        let kind = msg.kind;
        for m in msg.chunks() {
            let bytes = match m.encode() {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "control message cannot be encoded");
                    return;
                }
            };
            match self.engine.send_message(to, bytes) {
                Ok(()) => match kind {
                    ControlKind::Abort => DrainCounters::add(&self.drain_counters.aborts_sent, 1),
                    ControlKind::AbortAck => inc(&self.hub.counters.abort_acks_sent),
                    ControlKind::Done => {}
                },
                Err(e) => tracing::warn!(peer = %to, error = %e, "control message not sent"),
            }
        }
    }

    /// The connection to `peer` is torn down (and the transport confirmed
    /// it): `Fenced` for every exposure to it, in every pool.
    pub(super) fn fenced(&self, peer: PeerId) {
        let mut drain = lock(&self.drain);
        let proofs = drain.fence_proofs(peer);
        let d = drain.lost(proofs);
        drop(drain);
        lock(&self.hub.ops).aborts.forget_peer(&peer);
        let _ = d.deliver();
    }

    /// Fences `peer`; on success delivers `Fenced` to every pool.
    pub(super) fn fence(&self, peer: PeerId) -> bool {
        let Some(key) = self.peer_key(peer) else { return false };
        // Minted before the fence starts, delivered once it is confirmed.
        let proofs = lock(&self.drain).fence_proofs(peer);
        match self.engine.fence_remote_engine(&key) {
            Ok(()) => {
                let d = lock(&self.drain).fenced(proofs);
                lock(&self.hub.ops).aborts.forget_peer(&peer);
                let _ = d.deliver();
                true
            }
            Err(e) => {
                tracing::error!(peer = %key, error = %e, "fence failed");
                false
            }
        }
    }

    /// Executes one of core's drain actions.
    pub(super) fn execute(&self, a: Action) {
        match a {
            Action::SendAbort { peer, messages } => match self.peer_key(peer) {
                Some(key) => messages.into_iter().for_each(|m| self.send(&key, m)),
                None => tracing::warn!(peer = peer.0, "cannot ask an unknown peer to drain"),
            },
            Action::Revoke { pool, peer, tenancies } => {
                let Some(entry) = self.pool_entry(pool) else { return };
                // Only a revocation the transport confirmed is a proof.
                let mut confirmed = Vec::new();
                for t in &tenancies {
                    match self.engine.revoke_access(&entry.desc, t.slot.0, t.generation.0) {
                        Ok(true) => confirmed.push(*t),
                        Ok(false) => {}
                        Err(e) => {
                            tracing::debug!(error = %e, "revocation unavailable: the ladder moves on to the fence");
                            break;
                        }
                    }
                }
                let d = lock(&self.drain).revoked(pool, peer, &confirmed);
                let _ = d.deliver();
            }
            Action::Fence { peer } => {
                self.fence(peer);
            }
            Action::Deliver(d) => {
                let _ = d.deliver();
            }
        }
    }
}
