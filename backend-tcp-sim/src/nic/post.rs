//! Posting: a lease's WRITE or READ becomes one work request per slot,
//! registered with the connection before its frames are queued
//! (`submit`, which raw accesses use too), and application messages are
//! queued on the data connection.

use super::conn::Notify;
use super::conn::{Conn, Dest, OpDone, OpEntry, Outgoing, Src, WrEntry};
use super::{lock, NicError, NicInner};
use crate::stats::{add, inc};
use crate::wire::{self, AccessHeader, Body};
use kv_transfer_core::drain::{ControlKind, ControlMessage, OpEnd};
use kv_transfer_core::{
    check_shapes, Op, PeerId, PostError, PostErrorKind, RemoteSlots, Reserved, SlotLease, TransferError,
    TransferHandle, TransferOptions,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl NicInner {
    pub(super) fn post(
        self: &Arc<Self>,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(PostError { lease: local, kind: PostErrorKind::ShuttingDown });
        }
        let Some(reg) = self.reg_for_pool(local.pool().id()) else {
            return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool });
        };
        if reg.slot_size > wire::MAX_PAYLOAD as usize {
            return Err(PostError { lease: local, kind: PostErrorKind::Unsupported("slots larger than 64 MiB") });
        }
        let conn = match self.conn_for_endpoint(&remote.endpoint) {
            Some(c) => c,
            None => match self.connect_new(&remote.endpoint) {
                Ok(c) => c,
                Err(e) => return Err(PostError { lease: local, kind: PostErrorKind::Peer(e.to_string()) }),
            },
        };
        let span = tracing::trace_span!("post", ?op, peer = conn.peer.0, slots = local.len());
        let _e = span.enter();
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        // The drain protocol's admission, before anything is exposed: remote
        // tenancies the target aborted, or that were handed back, are refused.
        if let Err(refusal) = lock(&conn.st).aborts.admit(op_id, &(), remote, false) {
            return Err(PostError { lease: local, kind: PostErrorKind::Descriptor(refusal.to_string()) });
        }
        let exposed = reg.authority.expose_local(local, conn.peer);
        let (handle, completer) = TransferHandle::pair(exposed);
        let notify = opts.notify.then(|| Notify {
            msg: ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies()),
            digests: opts.digest && op == Op::Write,
        });
        let n = remote.slots.len();
        let mut items = Vec::with_capacity(n);
        let mut wrs = Vec::with_capacity(n);
        let len = reg.slot_size;
        for (i, rs) in remote.slots.iter().enumerate() {
            // The local tenancy by index (copied): no list of them is kept.
            let Some(t) = completer.lease().tenancies().get(i).copied() else { break };
            let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
            let off = t.slot.0 as usize * len;
            let h = AccessHeader {
                wr_id,
                key: remote.key,
                addr: rs.addr,
                slot: rs.slot,
                generation: rs.generation,
                len: len as u32,
            };
            let (body, pl, src, dest) = match op {
                Op::Write => (Body::Write(h), len, Some(Src::Local { reg: reg.clone(), off, len }), None),
                Op::Read => (Body::Read(h), 0, None, Some(Dest::Local { reg: reg.clone(), off, len })),
            };
            let head = match wire::encode_head(&body, pl) {
                Ok(h) => h,
                Err(e) => {
                    // Unreachable by the size check above; fail honestly anyway.
                    lock(&conn.st).aborts.finished(op_id, OpEnd::Proven);
                    let proof = reg.authority.completed_lease(completer.lease());
                    let _ = completer.complete(proof, Err(TransferError::Transport(e.to_string())));
                    return Ok(handle);
                }
            };
            items.push(Outgoing::Wr { wr_id, op: op_id, head, src });
            wrs.push((
                wr_id,
                WrEntry {
                    op: op_id,
                    pool: Some(remote.pool),
                    tenancy: rs.tenancy(),
                    sent: false,
                    on_wire: false,
                    early: None,
                    aborted: false,
                    dest,
                },
            ));
        }
        add(&self.counters.wrs_posted, wrs.len() as u64);
        let entry = OpEntry {
            done: OpDone::Lease(completer),
            reg: Some(reg),
            remaining: wrs.len(),
            err: None,
            data: None,
            notify,
            digest_local: opts.digest && op == Op::Read,
            read_digests: Vec::new(),
            sent_any: false,
        };
        self.submit(&conn, op_id, entry, wrs, items);
        Ok(handle)
    }

    pub(super) fn submit(
        &self,
        conn: &Arc<Conn>,
        op_id: u64,
        entry: OpEntry,
        wrs: Vec<(u64, WrEntry)>,
        items: Vec<Outgoing>,
    ) {
        let mut st = lock(&conn.st);
        if st.closed {
            // Torn down and joined already: nothing of this connection can
            // touch the lease any more.
            drop(st);
            self.finish_op(conn.peer, entry, Err(TransferError::Transport("connection fenced".into())), true);
            return;
        }
        st.ops.insert(op_id, entry);
        st.wrs.extend(wrs);
        drop(st);
        conn.tx.push(items);
    }

    pub(super) fn send_message(&self, peer: PeerId, msg: &[u8]) -> Result<(), NicError> {
        if msg.len() + wire::RECORD_PREFIX > wire::MAX_CONTROL as usize {
            return Err(NicError::TooLarge(msg.len()));
        }
        let conn = self.conn(peer).filter(|c| !c.dead.load(Ordering::SeqCst)).ok_or(NicError::UnknownPeer(peer))?;
        inc(&self.counters.messages_sent);
        conn.tx.push_message(msg);
        Ok(())
    }
}
