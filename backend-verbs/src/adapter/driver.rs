//! The driver thread: completions matched to what posted them, control
//! messages from RECVs, the escalation ladder, and fences.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_transfer_core::drain::{Action, ControlKind, ControlMessage, OpEnd, Outgoing, MAX_LEN};
use kv_transfer_core::{PeerId, PoolId, RejectReason, Tenancy, TransferError};

use super::{inc, lock, AfterInvalidate, Inner, OpEntry, OpFailure, PeerState, Pending, State};
use super::{Window, WindowState};
use crate::work::{Completion, QpId, WcStatus, WorkRequest};

impl Inner {
    /// Polls the completion queue until stopped: busy while completions
    /// come or operations are in flight (`busy_poll`; else sleeping 20 µs
    /// up to 50 µs), backing off to 1 ms when idle; the ladder and fences
    /// are looked at every millisecond.
    pub(super) fn drive(self: Arc<Self>) {
        let mut idle = Duration::from_micros(20);
        let mut next_tick = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            let polled = match self.engine.poll(32) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "polling the completion queue failed");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let busy = !polled.is_empty();
            for c in polled {
                self.on_completion(c);
            }
            if Instant::now() >= next_tick {
                self.probe_peers();
                self.escalate();
                self.finish_fences(&self);
                next_tick = Instant::now() + Duration::from_millis(1);
            }
            if busy {
                idle = Duration::from_micros(20);
            } else {
                let in_flight = !lock(&self.state).ops.is_empty();
                if in_flight && self.cfg.busy_poll {
                    std::thread::yield_now();
                    continue;
                }
                std::thread::sleep(idle);
                // While operations are in flight, poll as often as a raw
                // loop would (50 µs); otherwise back off to 1 ms.
                let cap = if in_flight { Duration::from_micros(50) } else { Duration::from_millis(1) };
                idle = (idle * 2).min(cap);
            }
        }
    }

    fn on_completion(&self, c: Completion) {
        let mut st = lock(&self.state);
        let Some(p) = st.wrs.remove(&c.wr_id) else {
            tracing::debug!(wr = c.wr_id, "completion of no known request");
            return;
        };
        let ok = c.status.is_success();
        if !ok {
            match c.status {
                WcStatus::RemoteAccess => inc(&self.counters.remote_access_errors),
                WcStatus::Flushed => inc(&self.counters.flushed),
                _ => {}
            }
            // RC: the QP is in ERR now. What was posted on it flushes; the
            // fence is minted once all of it did.
            self.start_fence(&mut st, p.peer());
        }
        match p {
            Pending::OpWr { op, .. } => {
                let done = match st.ops.get_mut(&op) {
                    Some(e) => {
                        e.remaining -= 1;
                        // The first failed completion decides; it outranks a
                        // failed post of a later WR (a flushed WR proves
                        // nothing about the remote side, whatever came before).
                        if !ok && !matches!(e.error, Some(OpFailure::Status(_))) {
                            e.error = Some(OpFailure::Status(c.status));
                        }
                        e.remaining == 0
                    }
                    None => false,
                };
                if done {
                    if let Some(e) = st.ops.remove(&op) {
                        // Proven unless a WR was flushed (or worse): a flushed
                        // WR proves nothing about the remote side, so no
                        // ABORT_ACK is ever sent for its tenancies.
                        let proven = matches!(
                            e.error,
                            None | Some(OpFailure::Post(_)) | Some(OpFailure::Status(WcStatus::RemoteAccess))
                        );
                        let end = if proven { OpEnd::Proven } else { OpEnd::Unproven };
                        let acks = st.aborts.finished(e.id, end);
                        self.send_all(&mut st, acks);
                        drop(st);
                        self.finish_op(e);
                    }
                }
            }
            Pending::Bind { done, pool, slot, peer } => {
                let abandoned = lock(&done.0).is_some();
                let Some(entry) = st.pools.get_mut(&pool) else { return };
                if let Some(w) = entry.windows[slot as usize].as_mut() {
                    if w.state == WindowState::Binding {
                        w.state = if ok { WindowState::Bound } else { WindowState::Unbound };
                    }
                }
                if ok {
                    entry.window_peer[slot as usize] = Some(peer);
                }
                if abandoned && ok {
                    // The exposure was given up: take the grant back.
                    let t = Tenancy::new(kv_transfer_core::SlotId(slot), kv_transfer_core::Generation(0));
                    self.invalidate(&mut st, pool, peer, t, AfterInvalidate::Nothing);
                } else {
                    let (m, cv) = &*done;
                    *lock(m) = Some(ok);
                    cv.notify_all();
                }
            }
            Pending::Invalidate { peer, pool, slot } => {
                let Some(entry) = st.pools.get_mut(&pool) else { return };
                let i = slot as usize;
                let Some(w) = entry.windows[i].as_mut() else { return };
                let after = if ok { WindowState::Unbound } else { WindowState::Bound };
                let proves = match std::mem::replace(&mut w.state, after) {
                    WindowState::Invalidating(proves) => proves,
                    other => {
                        w.state = other;
                        return;
                    }
                };
                if !ok {
                    // The QP is in ERR (fenced above): the fence settles it.
                    return;
                }
                entry.window_peer[i] = None;
                inc(&self.counters.invalidations);
                let authority = entry.authority.clone();
                drop(st);
                for (then, tenancy) in proves {
                    match then {
                        AfterInvalidate::Revoke => {
                            let d = lock(&self.drain).revoked(pool, peer, &[tenancy]);
                            let _ = d.deliver();
                        }
                        AfterInvalidate::Complete => {
                            authority.deliver(authority.completed(&[tenancy]));
                        }
                        AfterInvalidate::Nothing => {}
                    }
                }
            }
            Pending::Send { peer, slot } => self.send_done(&mut st, peer, slot),
            Pending::Heartbeat { peer } => {
                if let Some(p) = st.peers.get_mut(&peer) {
                    p.probing = false;
                    p.probed = Instant::now();
                }
            }
            Pending::Recv { peer, index } => {
                if ok {
                    self.on_recv(&mut st, peer, index, c.byte_len);
                }
            }
        }
    }

    /// A RECV landed: read its control message, post the buffer again.
    fn on_recv(&self, st: &mut State, peer: PeerId, index: u64, len: u32) {
        let Some(p) = st.peers.get(&peer) else { return };
        let (qp, (recv_mr, recv), live) = (p.qp, p.recv.clone(), p.state == PeerState::Live);
        let at = (index * MAX_LEN as u64) as usize;
        let mut bytes = vec![0u8; (len as usize).min(MAX_LEN)];
        let read = recv.read(at, &mut bytes);
        if live {
            let wr = self.wr_id();
            st.wrs.insert(wr, Pending::Recv { peer, index });
            let buffer = WorkRequest::Recv { local: recv_mr, offset: at as u64, len: MAX_LEN as u32 };
            if let Err(e) = self.engine.post(qp, wr, buffer) {
                st.wrs.remove(&wr);
                tracing::warn!(peer = peer.0, error = %e, "reposting a RECV failed");
            }
        }
        inc(&self.counters.messages_received);
        if read.is_err() {
            return;
        }
        let msg = match ControlMessage::decode(&bytes) {
            Ok(m) => m,
            Err(e) => {
                inc(&self.counters.malformed);
                tracing::warn!(peer = peer.0, error = %e, "malformed control message dropped");
                return;
            }
        };
        if msg.kind == ControlKind::Abort {
            // We are the initiator: answered once every operation of ours on
            // those tenancies is terminal (now, if none is in flight).
            if let Some(ack) = st.aborts.on_abort(&peer, msg) {
                self.send_all(st, vec![ack]);
            }
            return;
        }
        let mut d = lock(&self.drain).on_settling(peer, &msg);
        if self.cfg.release_policy.is_naive() {
            let _ = d.deliver();
            return;
        }
        // Completed only once the peer's window is gone: a peer cannot
        // write after its own DONE. Now: the stale and forged counts.
        let settled = d.tenancies();
        d.retain(|_| false);
        let _ = d.deliver();
        for t in settled {
            self.invalidate(st, msg.pool, peer, t, AfterInvalidate::Complete);
        }
    }

    /// Posts the `LOCAL_INV` of `t`'s window (on the QP it was bound on).
    pub(super) fn invalidate(&self, st: &mut State, pool: PoolId, peer: PeerId, t: Tenancy, then: AfterInvalidate) {
        let Some(qp) = st.peers.get(&peer).filter(|p| p.state == PeerState::Live).map(|p| p.qp) else {
            // A peer being fenced: the fence settles it.
            return;
        };
        let Some(entry) = st.pools.get_mut(&pool) else { return };
        let Some(w) = entry.windows[t.slot.0 as usize].as_mut() else { return };
        match &mut w.state {
            WindowState::Bound => {}
            // One is in flight (the ladder's revoke, say, and now the peer's
            // ABORT_ACK): its completion proves this too.
            WindowState::Invalidating(proves) => return proves.push((then, t)),
            _ => return,
        }
        let wr = self.wr_id();
        match self.engine.post(qp, wr, WorkRequest::Invalidate { window: w.id }) {
            Ok(_) => {
                w.state = WindowState::Invalidating(vec![(then, t)]);
                st.wrs.insert(wr, Pending::Invalidate { peer, pool, slot: t.slot.0 });
            }
            Err(e) => {
                tracing::warn!(slot = t.slot.0, error = %e, "posting LOCAL_INV failed: the fence settles it");
                self.start_fence(st, peer);
            }
        }
    }

    /// An operation's every WR is terminal.
    fn finish_op(&self, e: OpEntry) {
        let OpEntry { completer, authority, error, .. } = e;
        match error {
            None => {
                inc(&self.counters.ops_ok);
                let proof = authority.completed_lease(completer.lease());
                let _ = completer.complete(proof, Ok(()));
            }
            Some(OpFailure::Status(WcStatus::RemoteAccess)) => {
                // Our WRs are terminal (nothing more is read from or written
                // to the local slots); the remote NIC refused the key.
                inc(&self.counters.ops_failed);
                let proof = authority.completed_lease(completer.lease());
                let _ = completer.complete(proof, Err(TransferError::Rejected(RejectReason::StaleGeneration)));
            }
            Some(OpFailure::Post(m)) => {
                inc(&self.counters.ops_failed);
                let proof = authority.completed_lease(completer.lease());
                let _ = completer.complete(proof, Err(TransferError::Transport(m)));
            }
            Some(OpFailure::Status(s)) => {
                // Flushed or worse: proves nothing about the remote side;
                // the lease waits for the peer's fence.
                inc(&self.counters.ops_failed);
                completer.abandon(TransferError::Transport(format!("completed with {s:?}")));
            }
        }
    }

    /// Probes every live peer not probed for `heartbeat` (one probe out at
    /// a time): a dead one fails it and is fenced in `on_completion`.
    fn probe_peers(&self) {
        if self.cfg.heartbeat.is_zero() {
            return;
        }
        let mut st = lock(&self.state);
        let due: Vec<(PeerId, QpId)> = st
            .peers
            .iter()
            .filter(|(_, p)| p.state == PeerState::Live && !p.probing && p.probed.elapsed() >= self.cfg.heartbeat)
            .map(|(id, p)| (*id, p.qp))
            .collect();
        for (peer, qp) in due {
            let wr = self.wr_id();
            st.wrs.insert(wr, Pending::Heartbeat { peer });
            match self.engine.post(qp, wr, WorkRequest::Heartbeat) {
                Ok(_) => {
                    inc(&self.counters.heartbeats);
                    if let Some(p) = st.peers.get_mut(&peer) {
                        p.probing = true;
                    }
                }
                Err(e) => {
                    st.wrs.remove(&wr);
                    tracing::warn!(peer = peer.0, error = %e, "posting a heartbeat failed: fencing");
                    self.start_fence(&mut st, peer);
                }
            }
        }
    }

    /// Moves `peer`'s QP to ERR (once): everything posted on it flushes.
    pub(super) fn start_fence(&self, st: &mut State, peer: PeerId) {
        let Some(p) = st.peers.get_mut(&peer) else { return };
        if p.state != PeerState::Live {
            return;
        }
        p.state = PeerState::Fencing;
        if let Err(e) = self.engine.to_error(p.qp) {
            tracing::error!(peer = peer.0, error = %e, "moving the QP to ERR failed");
        }
        tracing::info!(peer = peer.0, name = %p.name, "fencing the peer: its QP is in ERR");
    }

    /// Fences whose QP has nothing posted any more: `Fenced` to every pool,
    /// and the windows bound on that QP dropped (a 2B key works only
    /// through its QP, which is dead).
    fn finish_fences(&self, me: &Arc<Inner>) {
        let mut st = lock(&self.state);
        let fencing: Vec<PeerId> =
            st.peers.iter().filter(|(_, p)| p.state == PeerState::Fencing).map(|(id, _)| *id).collect();
        for peer in fencing {
            // Every request flushed, RECVs aside: a RECV posted after the
            // QP went to ERR never completes (rxe), and nothing can land in
            // a RECV buffer of a QP in ERR.
            if st.wrs.values().any(|w| w.peer() == peer && !matches!(w, Pending::Recv { .. })) {
                continue;
            }
            st.wrs.retain(|_, w| w.peer() != peer);
            let mut redial = None;
            if let Some(p) = st.peers.get_mut(&peer) {
                p.state = PeerState::Fenced;
                redial = p.dialed.clone();
            }
            if let Some(d) = redial {
                // RC: a rejected access costs a reconnect. We dialed this
                // peer, so we dial it again (it waits for us).
                let me = Arc::clone(me);
                let spawned = std::thread::Builder::new().name("verbs-redial".into()).spawn(move || {
                    if me.stop.load(Ordering::Acquire) {
                        return;
                    }
                    let dial = d.addr.parse::<std::net::SocketAddr>().map_err(|e| e.to_string()).and_then(|a| {
                        std::net::TcpStream::connect_timeout(&a, me.cfg.timeout).map_err(|e| e.to_string())
                    });
                    match dial.map(|mut s| me.dial_handshake(&mut s, &d).map_err(|e| e.to_string())) {
                        Ok(Ok(id)) => tracing::info!(peer = %d.name, id = id.0, "reconnected after the fence"),
                        Ok(Err(e)) | Err(e) => tracing::warn!(peer = %d.name, error = %e, "reconnect failed"),
                    }
                });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot start the reconnect");
                }
            }
            // Confirmed (the QP flushed): the proofs cover every exposure to
            // the peer so far (exposing to a peer being fenced is refused).
            let fence = {
                let mut drain = lock(&self.drain);
                let proofs = drain.fence_proofs(peer);
                drain.fenced(proofs)
            };
            st.aborts.forget_peer(&peer);
            let named = st.peers.get(&peer).is_some_and(|p| p.confirmed && st.peer_named(&p.name) == Some(peer));
            if !named {
                self.drop_record(&mut st, peer);
            }
            for entry in st.pools.values_mut() {
                for (i, bound) in entry.window_peer.iter_mut().enumerate() {
                    if *bound == Some(peer) {
                        *bound = None;
                        if let Some(Window { id, .. }) = entry.windows[i].take() {
                            self.engine.free_window(id);
                        }
                    }
                }
            }
            drop(st);
            let _ = fence.deliver();
            st = lock(&self.state);
        }
    }

    /// Drops a fenced peer's record and its control rings, once nothing
    /// can name it (an unconfirmed claim, or a peer whose name a newer
    /// connection took): otherwise each connection a peer opens and loses
    /// keeps its rings (80 buffers of a control message's largest size) for
    /// good (Rule 9). Its QP stays with the engine: RECVs may still be
    /// posted on it.
    pub(super) fn drop_record(&self, st: &mut State, peer: PeerId) {
        if !st.peers.get(&peer).is_some_and(|p| p.state == PeerState::Fenced) {
            return;
        }
        if let Some(p) = st.peers.remove(&peer) {
            self.engine.deregister(p.recv.0);
            self.engine.deregister(p.send.0);
            inc(&self.counters.records_dropped);
        }
    }

    /// The ladder (core's driver): revoke (`LOCAL_INV`), then fence; the
    /// positive control frees at once.
    fn escalate(&self) {
        // The pools' locks are taken with the driver's released: posting
        // threads take the driver's to expose.
        let due = lock(&self.drain).due();
        let mut steps = due.collect();
        let actions = lock(&self.drain).plan(&mut steps);
        for a in actions {
            match a {
                Action::Revoke { pool, peer, tenancies } => {
                    let mut st = lock(&self.state);
                    for t in tenancies {
                        self.invalidate(&mut st, pool, peer, t, AfterInvalidate::Revoke);
                    }
                }
                Action::Fence { peer } => self.start_fence(&mut lock(&self.state), peer),
                Action::SendAbort { peer, messages } => {
                    let out = messages.into_iter().map(|msg| Outgoing { to: peer, msg }).collect();
                    self.send_all(&mut lock(&self.state), out);
                }
                Action::Deliver(d) => {
                    let _ = d.deliver();
                }
            }
        }
    }
}
