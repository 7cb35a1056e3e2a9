//! Wrap-around safe counters: the transfer id allocator and the target's
//! notification window.
//!
//! MORI allocates transfer ids from a 32-bit counter into a 64-bit id type,
//! and its source admits a bug when its notification index wraps around. Here:
//!
//! - transfer ids are full `u64` and allocated with wrapping arithmetic; they
//!   are only compared for equality (the key is `(remote engine, uid)`), and the
//!   engine refuses a uid that is still pending towards the same peer;
//! - notification sequence numbers are `u32` per (initiator, target) pair,
//!   compared with serial-number arithmetic (RFC 1982): `seq` is *ahead* of
//!   `base` when `seq.wrapping_sub(base) < 2^31`, *behind* otherwise. Nothing
//!   uses `<` on raw values, so `u32::MAX` followed by `0` is in order.

use crate::util::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::TransferUniqueId;

/// Per-engine transfer id allocator (MORI's `AllocateTransferUniqueId`).
#[derive(Debug)]
pub(crate) struct UidAllocator {
    next: AtomicU64,
}

impl UidAllocator {
    pub(crate) fn new(start: TransferUniqueId) -> Self {
        Self { next: AtomicU64::new(start) }
    }

    /// The next id. `fetch_add` on an atomic wraps on overflow by definition.
    pub(crate) fn allocate(&self) -> TransferUniqueId {
        self.next.fetch_add(1, Ordering::Relaxed)
    }
}

/// Half the sequence space: the boundary between "ahead" and "behind".
const HALF: u32 = 1 << 31;

/// How a notification fared in the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// New: deliver it.
    Accept,
    /// Already seen (or older than the window): drop and count.
    Duplicate,
}

/// The target's receive window for one initiator.
///
/// `base` is the oldest sequence number not yet seen; `ahead` holds the numbers
/// seen beyond it (a transport may reorder notifications across queue pairs).
/// If `ahead` grows past `max_ahead` (a notification was lost), the window
/// skips the gap so it never stalls for 2^31 numbers and then flips.
#[derive(Debug)]
pub(crate) struct NotifWindow {
    base: u32,
    ahead: HashSet<u32>,
    max_ahead: usize,
    skipped: u64,
}

impl NotifWindow {
    pub(crate) fn new(base: u32, max_ahead: usize) -> Self {
        Self { base, ahead: HashSet::default(), max_ahead: max_ahead.max(1), skipped: 0 }
    }

    /// Numbers given up on because the window had to skip a gap.
    pub(crate) fn skipped(&self) -> u64 {
        self.skipped
    }

    pub(crate) fn admit(&mut self, seq: u32) -> Admit {
        let distance = seq.wrapping_sub(self.base);
        if distance >= HALF || self.ahead.contains(&seq) {
            return Admit::Duplicate;
        }
        if distance == 0 {
            self.base = self.base.wrapping_add(1);
            self.advance();
        } else {
            self.ahead.insert(seq);
            if self.ahead.len() > self.max_ahead {
                self.skip_gap();
            }
        }
        Admit::Accept
    }

    /// Moves `base` over every number already seen right after it.
    fn advance(&mut self) {
        // In order (the usual case): nothing held ahead, nothing to look up.
        if self.ahead.is_empty() {
            return;
        }
        // Bounded: each turn removes one element of `ahead`.
        while self.ahead.remove(&self.base) {
            self.base = self.base.wrapping_add(1);
        }
    }

    /// Gives up on the missing numbers before the oldest one seen ahead.
    fn skip_gap(&mut self) {
        let base = self.base;
        if let Some(oldest) = self.ahead.iter().copied().min_by_key(|s| s.wrapping_sub(base)) {
            self.skipped += u64::from(oldest.wrapping_sub(base));
            self.base = oldest;
            self.advance();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_allocator_wraps() {
        let alloc = UidAllocator::new(u64::MAX - 1);
        assert_eq!(alloc.allocate(), u64::MAX - 1);
        assert_eq!(alloc.allocate(), u64::MAX);
        assert_eq!(alloc.allocate(), 0);
        assert_eq!(alloc.allocate(), 1);
    }

    #[test]
    fn window_in_order_across_wrap() {
        let mut w = NotifWindow::new(u32::MAX - 3, 16);
        let mut seq = u32::MAX - 3;
        for _ in 0..10 {
            assert_eq!(w.admit(seq), Admit::Accept, "seq {seq}");
            assert_eq!(w.admit(seq), Admit::Duplicate, "dup {seq}");
            seq = seq.wrapping_add(1);
        }
        assert_eq!(w.base, 6);
        assert_eq!(w.admit(u32::MAX), Admit::Duplicate);
    }

    #[test]
    fn window_reordered_across_wrap() {
        let mut w = NotifWindow::new(u32::MAX - 1, 16);
        // u32::MAX-1, u32::MAX, 0, 1 arriving as 1, u32::MAX, 0, u32::MAX-1.
        assert_eq!(w.admit(1), Admit::Accept);
        assert_eq!(w.admit(u32::MAX), Admit::Accept);
        assert_eq!(w.admit(0), Admit::Accept);
        assert_eq!(w.base, u32::MAX - 1);
        assert_eq!(w.admit(u32::MAX - 1), Admit::Accept);
        assert_eq!(w.base, 2);
        assert!(w.ahead.is_empty());
        for s in [u32::MAX - 1, u32::MAX, 0, 1] {
            assert_eq!(w.admit(s), Admit::Duplicate);
        }
    }

    #[test]
    fn window_skips_lost_gap() {
        let mut w = NotifWindow::new(u32::MAX, 2);
        // u32::MAX is lost; 0, 1, 2 arrive.
        assert_eq!(w.admit(0), Admit::Accept);
        assert_eq!(w.admit(1), Admit::Accept);
        assert_eq!(w.admit(2), Admit::Accept);
        assert_eq!(w.base, 3);
        assert_eq!(w.skipped(), 1);
        assert_eq!(w.admit(u32::MAX), Admit::Duplicate);
    }
}
