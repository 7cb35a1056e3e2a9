//! One transfer's life on the initiator: validation (a refusal is
//! terminal at once and still notified), posting its work requests without
//! the lock, accounting their completions (`settle`) and finishing it: the
//! bookkeeping goes, the target's notification leaves (success or
//! failure), and the status change is returned to apply outside the lock.

use std::sync::atomic::Ordering;

use super::mori::EngineStats;
use super::state::{Finished, Inner, LocalMem, Peer, State, Transfer, MULTI_WR};
use crate::status::{StatusCode, TransferStatus};
use crate::transport::{Notification, OpKind, WorkRequest};
use crate::types::{EngineKey, MemoryDesc, MemoryId, Segment, Tag, TransferUniqueId};
use crate::util::{lock, HashMap};

impl Inner {
    fn validate(
        &self,
        memory: &HashMap<MemoryId, LocalMem>,
        local: &MemoryDesc,
        remote: &MemoryDesc,
        segments: &[Segment],
    ) -> Result<(), (StatusCode, String)> {
        if segments.is_empty() {
            return Err((StatusCode::InvalidArgs, "no segments".to_owned()));
        }
        self.check_local_in(memory, local)?;
        for (i, seg) in segments.iter().enumerate() {
            if seg.size == 0 {
                return Err((StatusCode::InvalidArgs, format!("segment {i}: size 0")));
            }
            let fits = |offset: u64, total: u64| offset.checked_add(seg.size).is_some_and(|end| end <= total);
            if !fits(seg.local_offset, local.size) {
                return Err((
                    StatusCode::InvalidArgs,
                    format!("segment {i}: local range {}+{} exceeds {}", seg.local_offset, seg.size, local.size),
                ));
            }
            if !fits(seg.remote_offset, remote.size) {
                return Err((
                    StatusCode::InvalidArgs,
                    format!("segment {i}: remote range {}+{} exceeds {}", seg.remote_offset, seg.size, remote.size),
                ));
            }
        }
        Ok(())
    }

    /// Sends the terminal notification for `uid` to `remote` (whose entry is
    /// `peer`); called with the lock held so sequence numbers leave in order.
    #[allow(clippy::too_many_arguments)]
    fn send_notification(
        &self,
        peer: Option<&mut Peer>,
        stats: &mut EngineStats,
        remote: &EngineKey,
        (uid, seq): (TransferUniqueId, Option<u32>),
        tag: Tag,
        code: StatusCode,
        message: &str,
    ) {
        let Some(peer) = peer else {
            stats.notifications_send_failed += 1;
            return;
        };
        // A number taken already (a carried notification that did not go), or the next one.
        let seq = seq.unwrap_or_else(|| peer.next_seq());
        let notification = Notification { seq, uid, code: code.raw(), message: message.to_owned(), tag };
        match self.transport.notify(remote, notification) {
            Ok(()) => stats.notifications_sent += 1,
            Err(e) => {
                stats.notifications_send_failed += 1;
                tracing::warn!(engine = %self.key, peer = %remote, uid, error = %e, "notification not sent");
            }
        }
    }

    pub(super) fn submit(
        &self,
        op: OpKind,
        local: &MemoryDesc,
        remote: &MemoryDesc,
        segments: &[Segment],
        uid: TransferUniqueId,
        tag: Tag,
    ) -> TransferStatus {
        let mut state = lock(&self.state);
        let peer_key = &remote.engine_key;
        // Refusals: nothing is posted and the status is terminal at once.
        // Admitted, the transfer id is pending towards the peer from here.
        let State { peers, memory, stats, .. } = &mut *state;
        let mut carried = None;
        let refusal = if self.shutdown.load(Ordering::Acquire) {
            Some((StatusCode::BadState, "engine is shut down".to_owned()))
        } else {
            match peers.get_mut(peer_key) {
                None => Some((StatusCode::NotFound, format!("remote engine {peer_key} is not registered"))),
                Some(p) if p.fenced => Some((StatusCode::BadState, format!("remote engine {peer_key} is fenced"))),
                // No notification: it would be filed under the pending transfer's key.
                Some(p) if p.pending.contains(&uid) => {
                    Some((StatusCode::BadState, format!("transfer id {uid} is still pending towards {peer_key}")))
                }
                Some(p) => match self.validate(memory, local, remote, segments) {
                    Ok(()) => {
                        p.pending.insert(uid);
                        // A one-segment WRITE's success notification goes with its
                        // data where the transport carries it (numbered now).
                        if self.carries_notifications && op == OpKind::Write && segments.len() == 1 {
                            carried = Some(p.next_seq());
                        }
                        None
                    }
                    Err((code, message)) => {
                        // Nothing was posted; tell the target anyway so it can stop waiting.
                        self.send_notification(Some(p), stats, peer_key, (uid, None), tag, code, &message);
                        Some((code, message))
                    }
                },
            }
        };
        if let Some((code, message)) = refusal {
            state.stats.transfers_rejected += 1;
            drop(state);
            return TransferStatus::ready(uid, tag, code, message);
        }

        let (status, updater) = TransferStatus::posted(uid, tag);
        let transfer_id = state.next_transfer & !MULTI_WR;
        state.next_transfer = transfer_id.wrapping_add(1) & !MULTI_WR;
        // One segment (the usual transfer): its work request is the transfer.
        let first_wr = if segments.len() == 1 {
            transfer_id
        } else {
            let first = state.next_wr | MULTI_WR;
            for i in 0..segments.len() as u64 {
                state.wr_owner.insert(first.wrapping_add(i) | MULTI_WR, transfer_id);
            }
            state.next_wr = state.next_wr.wrapping_add(segments.len() as u64) & !MULTI_WR;
            first
        };
        state.transfers.insert(
            transfer_id,
            Transfer {
                uid,
                tag,
                remote: peer_key.clone(),
                local_mem: local.id,
                multi: segments.len() > 1,
                carried,
                outstanding: segments.len(),
                error: None,
                updater,
            },
        );
        if let Some(mem) = state.memory.get_mut(&local.id) {
            mem.in_flight += 1;
        }
        state.stats.transfers_posted += 1;
        drop(state);

        // Posted without the lock: a completion may arrive (and re-enter the
        // engine on the transport's thread) before `post` returns.
        let wr_id = |i: usize| if segments.len() == 1 { first_wr } else { first_wr.wrapping_add(i as u64) | MULTI_WR };
        for (i, seg) in segments.iter().enumerate() {
            let wr = WorkRequest {
                wr_id: wr_id(i),
                op,
                local: local.clone(),
                local_offset: seg.local_offset,
                remote: remote.clone(),
                remote_offset: seg.remote_offset,
                len: seg.size,
                tag,
                notification: carried.map(|seq| Notification {
                    seq,
                    uid,
                    code: StatusCode::Success.raw(),
                    message: String::new(),
                    tag,
                }),
            };
            if let Err(e) = self.transport.post(wr) {
                // This request and the ones after it were never posted: no completion will come for them.
                let mut state = lock(&self.state);
                let unposted = segments.len() - i;
                if segments.len() > 1 {
                    for j in i..segments.len() {
                        state.wr_owner.remove(&wr_id(j));
                    }
                }
                let finished = self.settle(&mut state, transfer_id, unposted, Some((e.code(), format!("post: {e}"))));
                drop(state);
                if let Some(finished) = finished {
                    finished.apply();
                }
                break;
            }
        }
        status
    }

    /// Accounts `count` operations of `transfer_id` as terminal; finishes the
    /// transfer when none is left.
    pub(super) fn settle(
        &self,
        state: &mut State,
        transfer_id: u64,
        count: usize,
        error: Option<(StatusCode, String)>,
    ) -> Option<Finished> {
        let transfer = state.transfers.get_mut(&transfer_id)?;
        transfer.outstanding = transfer.outstanding.saturating_sub(count);
        if transfer.error.is_none() {
            transfer.error = error;
        }
        if transfer.outstanding > 0 {
            return None;
        }
        let transfer = state.transfers.remove(&transfer_id)?;
        Some(self.finish_transfer(state, transfer))
    }

    /// A transfer with no operation left: its bookkeeping goes, its
    /// notification leaves, and its status change is returned.
    pub(super) fn finish_transfer(&self, state: &mut State, transfer: Transfer) -> Finished {
        if let Some(mem) = state.memory.get_mut(&transfer.local_mem) {
            mem.in_flight = mem.in_flight.saturating_sub(1);
        }
        let (code, message) = transfer.error.unwrap_or((StatusCode::Success, String::new()));
        if code.is_success() {
            state.stats.transfers_succeeded += 1;
        } else {
            state.stats.transfers_failed += 1;
        }
        let State { peers, stats, .. } = state;
        let mut peer = peers.get_mut(&transfer.remote);
        if let Some(p) = peer.as_deref_mut() {
            p.pending.remove(&transfer.uid);
        }
        match transfer.carried {
            // Delivered with the data, once it landed.
            Some(_) if code.is_success() => stats.notifications_sent += 1,
            seq => {
                self.send_notification(peer, stats, &transfer.remote, (transfer.uid, seq), transfer.tag, code, &message)
            }
        }
        Finished { updater: transfer.updater, code, message }
    }
}
