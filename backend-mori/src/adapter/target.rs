//! The target side and the drain protocol's messages: settlement of
//! exposures from inbound statuses, ABORT / ABORT_ACK through core's
//! control-message codec, fences, and the execution of core's escalation
//! plan. All of it runs on the driver thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kv_transfer_core::drain::{self, ControlKind, ControlMessage, ReleasePolicy};
use kv_transfer_core::{EscalationAction, PeerId, Tenancy};

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
        if !lock(&self.exposures).take(entry.pool.id(), t, peer) {
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
                if !s.code.is_success() && lock(&self.exposures).is_exposed(entry.pool.id(), t, p) {
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
                inc(&self.hub.counters.abort_acks_received);
                let Some(entry) = self.pool_entry(msg.pool) else { return };
                let Some(peer) = self.peer_id(from) else {
                    entry.authority.record_stale(msg.tenancies.len() as u64);
                    return;
                };
                let mut v = lock(&self.exposures).accept(peer, &msg);
                v.settled.retain(|t| self.clear_access(&entry, *t));
                v.deliver(&entry.authority);
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
                    ControlKind::Abort => inc(&self.hub.counters.aborts_sent),
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
        let proofs = self.mint_fences(peer);
        self.deliver_fences(peer, proofs);
    }

    /// `Fenced(peer)` for every pool, minted now: each covers the exposures
    /// to `peer` made so far, and none made later (core's fence epoch).
    fn mint_fences(&self, peer: PeerId) -> Vec<(Arc<PoolEntry>, kv_transfer_core::Fenced)> {
        self.all_pools()
            .into_iter()
            .map(|e| {
                let proof = e.authority.fenced(peer);
                (e, proof)
            })
            .collect()
    }

    fn deliver_fences(&self, peer: PeerId, proofs: Vec<(Arc<PoolEntry>, kv_transfer_core::Fenced)>) {
        lock(&self.exposures).fenced(peer);
        lock(&self.hub.ops).aborts.forget_peer(&peer);
        for (e, proof) in proofs {
            e.authority.deliver(proof);
        }
    }

    /// Fences `peer`; on success delivers `Fenced` to every pool.
    pub(super) fn fence(&self, peer: PeerId) -> bool {
        let Some(key) = self.peer_key(peer) else { return false };
        // Minted before the fence starts, delivered once it is confirmed.
        let proofs = self.mint_fences(peer);
        match self.engine.fence_remote_engine(&key) {
            Ok(()) => {
                inc(&self.hub.counters.fences);
                self.deliver_fences(peer, proofs);
                true
            }
            Err(e) => {
                tracing::error!(peer = %key, error = %e, "fence failed");
                false
            }
        }
    }

    /// Executes core's plan for one escalation action.
    pub(super) fn escalate(&self, entry: &PoolEntry, a: EscalationAction) {
        tracing::debug!(peer = a.peer.0, step = ?a.step, slots = a.tenancies.len(), "escalation");
        let plan = lock(&self.exposures).plan(entry.pool.id(), &a, self.caps, ReleasePolicy::Safe);
        match plan {
            drain::Plan::Nothing => {}
            drain::Plan::SendAbort { peer, messages } => match self.peer_key(peer) {
                Some(key) => messages.into_iter().for_each(|m| self.send(&key, m)),
                None => tracing::warn!(peer = peer.0, "cannot ask an unknown peer to drain"),
            },
            drain::Plan::Revoke { peer, tenancies } => {
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
                let done = lock(&self.exposures).revoked(entry.pool.id(), peer, &confirmed);
                if !done.is_empty() {
                    self.hub.counters.revoked.fetch_add(done.len() as u64, Ordering::Relaxed);
                    entry.authority.deliver(entry.authority.revoked(&done));
                }
            }
            drain::Plan::Fence { peer } => {
                self.fence(peer);
            }
            drain::Plan::Stuck { peer, tenancies } => tracing::error!(
                peer = peer.0,
                slots = tenancies.len(),
                "escalation exhausted: slots stay quarantined (a leak, not a reuse)"
            ),
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }
}
