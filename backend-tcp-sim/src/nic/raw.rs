//! Raw one-sided accesses, outside any lease (for conformance tests and for
//! backends such as MORI that build their own semantics on this fabric):
//! where one goes ([`RawAccess`]), how its terminal status comes back (a
//! [`RawHandle`] to wait on, a [`RawCallback`], or a [`RawCompletions`]
//! queue), and posting one (`NicInner::post_raw`). The public `SimNic`
//! methods that post them live with the handle, in `mod.rs`.

use super::conn::{Dest, OpDone, OpEntry, Outgoing, Src, WrEntry};
use super::{lock, NicError, NicInner};
#[cfg(doc)]
use super::{MessageHook, SimNic};
use crate::stats::inc;
use crate::wire::{self, AccessHeader, Body};
use bytes::Bytes;
use kv_transfer_core::{Generation, PeerId, RemoteSlots, SlotId, Tenancy, TransferError};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Called once with a raw operation's terminal status ([`SimNic::write_raw_with`]):
/// `Ok(Some(bytes))` for a read, `Ok(None)` for a write.
///
/// It runs on a NIC thread (the connection's receiver, a teardown, or the
/// poster's own thread when the connection was already fenced), so the same
/// rules as for a [`MessageHook`] apply.
pub type RawCallback = Box<dyn FnOnce(Result<Option<Bytes>, TransferError>) + Send>;

/// A completion queue for raw operations ([`SimNic::write_raw_registered`]):
/// one shared object receives the terminal status of every operation posted
/// to it, by the token given at post time, so a post allocates no callback
/// (what a verbs CQ is to its work requests).
///
/// It runs where a [`RawCallback`] runs, under the same rules.
pub trait RawCompletions: Send + Sync {
    /// The operation posted with `token` is terminal: `Ok(None)` for a write.
    fn complete(&self, token: u64, result: Result<Option<Bytes>, TransferError>);
}

/// Where a raw access goes (see [`SimNic::write_raw`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawAccess {
    /// Target region's key.
    pub key: u64,
    /// Target address.
    pub addr: u64,
    /// Slot named by the access.
    pub slot: SlotId,
    /// Generation named by the access.
    pub generation: Generation,
}

impl RawAccess {
    /// The `index`-th slot of a descriptor.
    pub fn of(remote: &RemoteSlots, index: usize) -> Option<Self> {
        let s = remote.slots.get(index)?;
        Some(Self { key: remote.key, addr: s.addr, slot: s.slot, generation: s.generation })
    }

    /// The wire header of an access of `len` bytes here, as work request `wr_id`.
    pub fn header(&self, wr_id: u64, len: u32) -> AccessHeader {
        AccessHeader { wr_id, key: self.key, addr: self.addr, slot: self.slot, generation: self.generation, len }
    }
}

#[derive(Default)]
struct RawSlot {
    done: Mutex<Option<Result<Option<Bytes>, TransferError>>>,
    cv: Condvar,
}

/// Completion of a raw access: [`wait`](RawHandle::wait) for its terminal status.
#[derive(Clone)]
pub struct RawHandle {
    slot: Arc<RawSlot>,
}

impl std::fmt::Debug for RawHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawHandle").field("done", &lock(&self.slot.done).is_some()).finish()
    }
}

impl RawHandle {
    /// A handle and the callback that completes it.
    pub(super) fn pair() -> (Self, RawCallback) {
        let slot = Arc::new(RawSlot::default());
        let s = slot.clone();
        let done: RawCallback = Box::new(move |res| {
            *lock(&s.done) = Some(res);
            s.cv.notify_all();
        });
        (Self { slot }, done)
    }

    /// Waits up to `timeout` for the terminal status: `Ok(Some(bytes))` for a
    /// read, `Ok(None)` for a write. `None` if still in flight.
    pub fn wait(&self, timeout: Duration) -> Option<Result<Option<Bytes>, TransferError>> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.slot.done);
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = match self.slot.cv.wait_timeout(g, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl NicInner {
    pub(super) fn post_raw(
        self: &Arc<Self>,
        peer: PeerId,
        a: RawAccess,
        data: Option<Src>,
        read_len: u32,
        imm: Option<wire::Immediate>,
        done: OpDone,
    ) -> Result<(), NicError> {
        let conn = self.conn(peer).ok_or(NicError::UnknownPeer(peer))?;
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let len = match &data {
            None => read_len as usize,
            Some(Src::Owned(b)) => b.len(),
            Some(Src::Local { len, .. }) => *len,
        };
        if len > wire::MAX_PAYLOAD as usize {
            return Err(NicError::TooLarge(len));
        }
        let h = a.header(wr_id, len as u32);
        let (body, pl, dest) = match (&data, imm) {
            (Some(_), None) => (Body::Write(h), len, None),
            (Some(_), Some(imm)) => (Body::WriteImm(h, imm), len, None),
            (None, _) => (Body::Read(h), 0, Some(Dest::Buf(len))),
        };
        let head = wire::encode_head(&body, pl).map_err(|e| NicError::Handshake(e.to_string()))?;
        let entry = OpEntry {
            done,
            reg: None,
            remaining: 1,
            err: None,
            data: None,
            notify: None,
            digest_local: false,
            read_digests: Vec::new(),
            sent_any: false,
        };
        let wr = WrEntry {
            op: op_id,
            pool: None,
            tenancy: Tenancy::new(a.slot, a.generation),
            sent: false,
            on_wire: false,
            early: None,
            aborted: false,
            dest,
        };
        inc(&self.counters.wrs_posted);
        self.submit(&conn, op_id, entry, vec![(wr_id, wr)], vec![Outgoing::Wr { wr_id, op: op_id, head, src: data }]);
        Ok(())
    }
}
