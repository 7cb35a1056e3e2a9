//! The initiator side's post: admission, the work requests, and core's
//! `Transfer` through [`PostNow`].

use super::*;

impl Inner {
    pub(super) fn post(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        let Ok(len) = u32::try_from(remote.slot_size) else {
            return Err(PostError { lease: local, kind: PostErrorKind::Descriptor("slots larger than 4 GiB".into()) });
        };
        // A peer being fenced that we dialed is reconnecting: wait for it
        // (bounded by the configured timeout).
        let mut deadline = None;
        let (mut st, peer, qp) = loop {
            let mut st = lock(&self.state);
            let peer = match st.peer_at(&remote.endpoint) {
                Ok(p) => p,
                Err(why) => {
                    drop(st);
                    return Err(PostError { lease: local, kind: PostErrorKind::Peer(why) });
                }
            };
            let Some(p) = st.peers.get(&peer) else {
                drop(st);
                return Err(PostError { lease: local, kind: PostErrorKind::Peer(format!("peer {} is gone", peer.0)) });
            };
            if p.state == PeerState::Live {
                let qp = p.qp;
                break (st, peer, qp);
            }
            // (The clock is read only when a peer is not live.)
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + self.cfg.timeout);
            if p.dialed.is_none() || Instant::now() >= deadline {
                let why = format!("{} is fenced", p.name);
                drop(st);
                return Err(PostError { lease: local, kind: PostErrorKind::Peer(why) });
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(2));
        };
        let pool_id = local.pool().id();
        let Some((mr, authority)) = st.pools.get(&pool_id).map(|e| (e.mr.id, e.authority.clone())) else {
            drop(st);
            return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool });
        };
        st.next_op += 1;
        let op_id = st.next_op;
        // Admitted before anything is posted, under the lock ABORTs are
        // handled in: an ABORT either sees this op and waits for it, or this
        // post sees the abort and is refused.
        if let Err(refusal) = st.aborts.admit(op_id, &peer, remote, false) {
            drop(st);
            return Err(PostError { lease: local, kind: PostErrorKind::Descriptor(refusal.to_string()) });
        }
        let exposed = authority.expose_local(local, peer);
        let (handle, completer) = TransferHandle::pair(exposed);
        let mut posted = 0u32;
        let mut error = None;
        let slot_size = completer.lease().pool().slot_size() as u64;
        for (i, (t, rs)) in completer.lease().tenancies().iter().zip(&remote.slots).enumerate() {
            let off = u64::from(t.slot.0) * slot_size;
            let wr = self.wr_id();
            st.wrs.insert(wr, Pending::OpWr { op: op_id, peer });
            let rkey = remote.key_of(i) as u32;
            let r = match op {
                Op::Write => WorkRequest::Write { local: mr, offset: off, len, remote_addr: rs.addr, rkey },
                Op::Read => WorkRequest::Read { local: mr, offset: off, len, remote_addr: rs.addr, rkey },
            };
            let r = self.engine.post(qp, wr, r);
            match r {
                Ok(_) => posted += 1,
                Err(e) => {
                    st.wrs.remove(&wr);
                    error = Some(OpFailure::Post(e.to_string()));
                    break;
                }
            }
        }
        inc(&self.counters.posts);
        if posted == 0 {
            let acks = st.aborts.finished(op_id, kv_transfer_core::drain::OpEnd::Proven);
            self.send_all(&mut st, acks);
            drop(st);
            // Nothing reached the NIC: the local lease is untouched.
            let proof = authority.completed_lease(completer.lease());
            let msg = error.map_or_else(String::new, |e| e.to_string());
            let _ = completer.complete(proof, Err(TransferError::Transport(msg)));
            return Ok(handle);
        }
        if op == Op::Write && opts.notify && error.is_none() {
            // Behind the WRITEs on the same RC QP: placed before it arrives.
            let msg = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
            match self.send_control(&mut st, peer, qp, &msg) {
                // Handed back: no later post may use these tenancies.
                Ok(()) => st.aborts.tombstone(&peer, remote.pool, remote.token, &remote.tenancies()),
                Err(e) => tracing::warn!(peer = peer.0, error = %e, "DONE not sent"),
            }
        }
        st.ops.insert(op_id, OpEntry { id: op_id, completer, authority, remaining: posted, error });
        Ok(handle)
    }
}

impl PostNow for VerbsTransfer {
    fn post_now(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        self.inner.post(op, local, remote, opts)
    }
}

kv_transfer_core::impl_transfer_via_post_now!(VerbsTransfer, BACKEND);
