//! Registered regions and their bindings: what a target NIC knows about its
//! memory. Each slot carries a binding (the generation exposed, the
//! connection it is exposed to, the accesses in flight on it); every remote
//! access passes the checks here (key, length, bounds, generation, peer)
//! before it touches a byte, and a revocation clears a binding and waits
//! for the accesses that already passed to drain.

use super::conn::Conn;
use super::{lock, NicInner};
use crate::stats::inc;
use crate::wire::AccessHeader;
use kv_transfer_core::{Region, RejectReason, SettlementAuthority, SlotId, SlotPool, Tenancy, TransferError};
use std::io::{self, Read};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Marks a binding whose revocation started: every access is rejected while
/// the in-flight applies drain.
const REVOKING: u64 = 1 << 63;

pub(super) struct Binding {
    /// Generation bound for remote access (0 = none; `| REVOKING` = being revoked).
    pub(super) gen: AtomicU64,
    /// The connection the slot is exposed to.
    pub(super) peer: AtomicU32,
    /// Accesses between their generation check and the end of their copy.
    pub(super) inflight: AtomicU32,
}

pub(super) struct Reg {
    pub(super) key: u64,
    pub(super) pool: SlotPool,
    pub(super) authority: SettlementAuthority,
    pub(super) region: Arc<dyn Region>,
    /// Host address of the region's first byte, 0 if not host memory.
    pub(super) base: usize,
    pub(super) addr: u64,
    pub(super) len: usize,
    pub(super) slot_size: usize,
    pub(super) bindings: Box<[Binding]>,
    pub(super) revokers: AtomicU32,
    pub(super) drain: (Mutex<()>, Condvar),
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum RevokeOutcome {
    Revoked,
    NotBound,
    TimedOut,
}

impl Reg {
    pub(super) fn end_access(&self, slot: SlotId) {
        if let Some(b) = self.bindings.get(slot.0 as usize) {
            if b.inflight.fetch_sub(1, Ordering::SeqCst) == 1 && self.revokers.load(Ordering::SeqCst) > 0 {
                let _g = lock(&self.drain.0);
                self.drain.1.notify_all();
            }
        }
    }

    /// Invalidates the binding of `t` and waits (bounded) until no access
    /// that passed the generation check is still copying.
    pub(super) fn revoke(&self, t: Tenancy, wait: Duration) -> RevokeOutcome {
        let Some(b) = self.bindings.get(t.slot.0 as usize) else { return RevokeOutcome::NotBound };
        let g = t.generation.0;
        if b.gen.compare_exchange(g, g | REVOKING, Ordering::SeqCst, Ordering::SeqCst).is_err()
            && b.gen.load(Ordering::SeqCst) != g | REVOKING
        {
            return RevokeOutcome::NotBound;
        }
        let deadline = Instant::now() + wait;
        self.revokers.fetch_add(1, Ordering::SeqCst);
        let mut guard = lock(&self.drain.0);
        let drained = loop {
            if b.inflight.load(Ordering::SeqCst) == 0 {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            guard = match self.drain.1.wait_timeout(guard, (deadline - now).min(Duration::from_millis(10))) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        drop(guard);
        self.revokers.fetch_sub(1, Ordering::SeqCst);
        if !drained {
            return RevokeOutcome::TimedOut;
        }
        let _ = b.gen.compare_exchange(g | REVOKING, 0, Ordering::SeqCst, Ordering::SeqCst);
        RevokeOutcome::Revoked
    }

    /// Reads `len` bytes from `r` into the region at `off`. `Ok(false)`: the
    /// region refused (device memory without a driver).
    pub(super) fn fill_from(&self, r: &mut impl Read, off: usize, len: usize) -> io::Result<bool> {
        if self.base != 0 && off.checked_add(len).is_some_and(|e| e <= self.len) {
            // SAFETY: `[off, off+len)` lies inside the region (checked), whose
            // memory stays allocated while `self.region` lives. Concurrent
            // access to these bytes is what leases rule out; where it still
            // happens (the naive positive control) it races like DMA does.
            let dst = unsafe { std::slice::from_raw_parts_mut((self.base + off) as *mut u8, len) };
            r.read_exact(dst)?;
            return Ok(true);
        }
        // Device memory: received into this thread's host buffer, copied into
        // the slot before the write counts as landed.
        kv_transfer_core::with_staging_buffer(len, |v| {
            r.read_exact(v)?;
            Ok(self.region.write(off, v).is_ok())
        })
    }

    /// Borrow of `[off, off+len)` for sending, or a copy for non-host memory.
    pub(super) fn source(&self, off: usize, len: usize) -> Result<SrcBytes<'_>, TransferError> {
        if self.base != 0 && off.checked_add(len).is_some_and(|e| e <= self.len) {
            // SAFETY: in bounds (checked); the region outlives the borrow
            // (`self` holds it). The operation's lease keeps the slot exposed
            // to this operation until its terminal status, after the send; a
            // raw registered write's caller keeps the bytes unchanged until
            // its completion (`SimNic::write_raw_registered`).
            let s = unsafe { std::slice::from_raw_parts((self.base + off) as *const u8, len) };
            return Ok(SrcBytes::Borrowed(s));
        }
        let mut v = vec![0u8; len];
        self.region.read(off, &mut v).map_err(|e| TransferError::Engine {
            engine: "tcp-sim",
            code: 2,
            message: e.to_string(),
        })?;
        Ok(SrcBytes::Owned(v))
    }
}

pub(super) enum SrcBytes<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl SrcBytes<'_> {
    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Self::Borrowed(s) => s,
            Self::Owned(v) => v,
        }
    }
}

impl NicInner {
    fn count_reject(&self, r: RejectReason, wrong_peer: bool) {
        let c = &self.counters;
        inc(match r {
            _ if wrong_peer => &c.rejected_wrong_peer,
            RejectReason::OutOfBounds => &c.rejected_out_of_bounds,
            RejectReason::UnknownKey => &c.rejected_unknown_key,
            RejectReason::StaleGeneration => &c.rejected_stale_generation,
            RejectReason::ZeroLength => &c.rejected_zero_length,
            RejectReason::Oversize => &c.rejected_oversize,
            _ => &c.rejected_out_of_bounds,
        });
    }

    /// The NIC's checks, in order: key, length, bounds, generation. On
    /// success the access is counted in flight on its slot (safe policy):
    /// call `end_access` when its copy is done.
    pub(super) fn check_access(&self, conn: &Conn, h: &AccessHeader) -> Result<(Arc<Reg>, usize), RejectReason> {
        let res = self.check_access_inner(conn, h);
        if let Err((r, wrong_peer)) = res {
            self.count_reject(r, wrong_peer);
            if r == RejectReason::StaleGeneration {
                if let Some(reg) = self.reg_for_key(h.key) {
                    reg.authority.record_stale(1);
                }
            }
        }
        res.map_err(|e| e.0)
    }

    fn check_access_inner(&self, conn: &Conn, h: &AccessHeader) -> Result<(Arc<Reg>, usize), (RejectReason, bool)> {
        let reg = self.reg_for_key(h.key).ok_or((RejectReason::UnknownKey, false))?;
        let len = h.len as usize;
        if len == 0 {
            return Err((RejectReason::ZeroLength, false));
        }
        if h.len > self.cfg.max_wr_bytes {
            return Err((RejectReason::Oversize, false));
        }
        let oob = (RejectReason::OutOfBounds, false);
        let off = h.addr.checked_sub(reg.addr).ok_or(oob)? as usize;
        match off.checked_add(len) {
            Some(e) if e <= reg.len => {}
            _ => return Err(oob),
        }
        if self.cfg.policy.is_naive() {
            return Ok((reg, off));
        }
        let start = (h.slot.0 as usize).checked_mul(reg.slot_size).ok_or(oob)?;
        if off < start || off + len > start + reg.slot_size {
            return Err(oob);
        }
        let b = reg.bindings.get(h.slot.0 as usize).ok_or(oob)?;
        b.inflight.fetch_add(1, Ordering::SeqCst);
        if b.gen.load(Ordering::SeqCst) != h.generation.0 {
            reg.end_access(h.slot);
            return Err((RejectReason::StaleGeneration, false));
        }
        if b.peer.load(Ordering::SeqCst) != conn.peer.0 {
            reg.end_access(h.slot);
            return Err((RejectReason::UnknownKey, true));
        }
        Ok((reg, off))
    }

    pub(super) fn end_access(&self, reg: &Reg, slot: SlotId) {
        if !self.cfg.policy.is_naive() {
            reg.end_access(slot);
        }
    }
}
