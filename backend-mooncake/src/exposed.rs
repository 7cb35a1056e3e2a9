//! Which registered bytes the TCP data server may touch.
//!
//! Mooncake's TCP protocol carries no key: a request names a virtual address
//! and a size, and a stock Mooncake target serves it if the range lies in any
//! registered buffer. Every byte a target ever registered is then readable and
//! writable by anyone who can reach its data port and read its (public)
//! metadata, settled tenancies included (issue 29, attack 4: a third party
//! read 4,096 of 4,096 bytes of another request's KV by address).
//!
//! An engine driven by the adapter serves only ranges that are exposed now
//! ([`TcpServe::ExposedOnly`]): the adapter opens a slot's range when it
//! exposes the slot ([`crate::TransferEngine::expose_range`]) and closes it
//! before the slot's settlement proof is delivered
//! ([`crate::TransferEngine::unexpose_range`]). Closing waits until no request
//! that was admitted into the range is still touching it: the connections
//! of such requests are shut down first, so the wait is short.
//!
//! What this does not close: the protocol has no key, so a third party that
//! learns a *live* exposure's address can still touch it while it is live.
//! Only a transport with a key per exposure (Mooncake over RDMA with per-grant
//! memory windows, `rdma::RdmaTarget`) closes that.

use kv_transfer_core::hash::HashMap;
use std::collections::BTreeMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::EngineError;
use crate::proto::TcpOpcode;

/// What the TCP data server serves ([`crate::EngineConfig::serve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TcpServe {
    /// Any registered byte until an adapter takes the engine
    /// ([`crate::TransferEngine::serve_exposed_only`], which
    /// [`crate::MooncakeTransfer::new`] calls), exposed ranges only from then
    /// on. A raw engine keeps Mooncake's behaviour; an adapter-driven one is
    /// restricted.
    #[default]
    Auto,
    /// Any registered byte, always (stock Mooncake; the positive control of
    /// the hostile-peer tests). Unsafe against a peer that ignores the
    /// metadata it was given.
    AnyRegistered,
    /// Only ranges currently exposed, from the start.
    ExposedOnly,
}

/// The operations a remote peer may run on an exposed range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeAccess {
    /// Remote READs only (a source range).
    Read,
    /// Remote WRITEs only (a destination slot).
    Write,
    /// Both (core's exposures do not say which way the peer moves bytes).
    ReadWrite,
}

impl RangeAccess {
    fn allows(self, op: TcpOpcode) -> bool {
        matches!((self, op), (RangeAccess::ReadWrite, _) | (RangeAccess::Read, TcpOpcode::Read))
            || matches!((self, op), (RangeAccess::Write, TcpOpcode::Write))
    }
}

/// Handle of one exposed range, from [`crate::TransferEngine::expose_range`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RangeId(pub u64);

const MODE_ANY: u8 = 0;
const MODE_EXPOSED: u8 = 1;
const MODE_ANY_PINNED: u8 = 2;

/// Longest [`ExposedRanges::close`] waits for admitted requests to leave a
/// range after their connections were shut down.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Entry {
    start: u64,
    len: u64,
    access: RangeAccess,
    /// Data connections (by the listener's connection id) with a request
    /// admitted into this range and not finished with its bytes.
    holders: Mutex<Vec<u64>>,
}

#[derive(Debug, Default)]
struct Table {
    /// By start address; ranges never overlap.
    by_start: BTreeMap<u64, Arc<Entry>>,
    by_id: HashMap<u64, u64>,
    next: u64,
    /// Closers waiting for a range's requests to leave it.
    closers: usize,
}

/// The ranges the data server may serve, and the connections inside them.
#[derive(Debug)]
pub(crate) struct ExposedRanges {
    mode: AtomicU8,
    table: Mutex<Table>,
    left: Condvar,
    /// The data listener's live connections, to shut down the holders of a
    /// range being closed.
    conns: Mutex<Option<ConnMap>>,
}

/// A listener's live connections by id.
pub(crate) type ConnMap = Arc<Mutex<HashMap<u64, TcpStream>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request's admission into exposed ranges; dropping it says the request
/// no longer touches their bytes.
#[derive(Debug)]
pub(crate) struct ExposureHold<'a> {
    ranges: &'a ExposedRanges,
    /// The range the request starts in, and those it runs on into.
    first: Arc<Entry>,
    rest: Vec<Arc<Entry>>,
    conn: u64,
}

impl ExposureHold<'_> {
    fn entries(&self) -> impl Iterator<Item = &Arc<Entry>> {
        std::iter::once(&self.first).chain(&self.rest)
    }
}

impl Drop for ExposureHold<'_> {
    fn drop(&mut self) {
        for e in self.entries() {
            let mut h = lock(&e.holders);
            if let Some(i) = h.iter().position(|c| *c == self.conn) {
                h.swap_remove(i);
            }
        }
        // Under the table lock, so a closer waiting on it cannot miss it;
        // only when one waits (a request's end then costs no wake-up call).
        let t = lock(&self.ranges.table);
        if t.closers > 0 {
            self.ranges.left.notify_all();
        }
    }
}

impl ExposedRanges {
    pub(crate) fn new(serve: TcpServe) -> Self {
        let mode = match serve {
            TcpServe::Auto => MODE_ANY,
            TcpServe::AnyRegistered => MODE_ANY_PINNED,
            TcpServe::ExposedOnly => MODE_EXPOSED,
        };
        Self { mode: AtomicU8::new(mode), table: Mutex::default(), left: Condvar::new(), conns: Mutex::new(None) }
    }

    /// The data listener's connection map (set once it runs).
    pub(crate) fn set_conns(&self, conns: ConnMap) {
        *lock(&self.conns) = Some(conns);
    }

    /// From [`TcpServe::Auto`] to exposed ranges only; `AnyRegistered` stays.
    /// Whether the server now serves exposed ranges only.
    pub(crate) fn restrict(&self) -> bool {
        let _ = self.mode.compare_exchange(MODE_ANY, MODE_EXPOSED, Ordering::AcqRel, Ordering::Acquire);
        self.exposed_only()
    }

    pub(crate) fn exposed_only(&self) -> bool {
        self.mode.load(Ordering::Acquire) == MODE_EXPOSED
    }

    /// Opens `[start, start+len)` to remote requests of `access`.
    pub(crate) fn open(&self, start: u64, len: u64, access: RangeAccess) -> Result<RangeId, EngineError> {
        let end = start.checked_add(len).filter(|_| len > 0).ok_or(EngineError::InvalidRegion { addr: start, len })?;
        let mut t = lock(&self.table);
        let before = t.by_start.range(..end).next_back().is_some_and(|(_, e)| e.start + e.len > start);
        if before {
            return Err(EngineError::RegionOverlap { addr: start, len });
        }
        t.next += 1;
        let id = t.next;
        t.by_start.insert(start, Arc::new(Entry { start, len, access, holders: Mutex::default() }));
        t.by_id.insert(id, start);
        Ok(RangeId(id))
    }

    /// Closes a range: no request is admitted into it from now on, and once
    /// this returns no admitted one touches it any more (their connections
    /// are shut down). `false`: unknown id, or a holder did not leave within
    /// [`CLOSE_WAIT`] (logged).
    pub(crate) fn close(&self, id: RangeId) -> bool {
        let mut t = lock(&self.table);
        let Some(start) = t.by_id.remove(&id.0) else { return false };
        let Some(entry) = t.by_start.remove(&start) else { return false };
        let holders = lock(&entry.holders).clone();
        if holders.is_empty() {
            return true;
        }
        drop(t);
        if let Some(conns) = lock(&self.conns).clone() {
            let conns = lock(&conns);
            for c in &holders {
                if let Some(s) = conns.get(c) {
                    tracing::warn!(conn = c, start, "closing an exposure with a request inside it: connection shut");
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        }
        let deadline = Instant::now() + CLOSE_WAIT;
        let mut t = lock(&self.table);
        t.closers += 1;
        let mut left = true;
        while !lock(&entry.holders).is_empty() {
            let now = Instant::now();
            if now >= deadline {
                tracing::error!(start, "a data connection is still inside a closed exposure");
                left = false;
                break;
            }
            t = self.left.wait_timeout(t, deadline - now).map(|r| r.0).unwrap_or_else(|e| e.into_inner().0);
        }
        t.closers -= 1;
        left
    }

    /// Admits a request for `[addr, addr+size)` on connection `conn` if
    /// exposed ranges allowing `op` cover it (adjacent ranges may together).
    pub(crate) fn admit(&self, addr: u64, size: u64, op: TcpOpcode, conn: u64) -> Option<ExposureHold<'_>> {
        let end = addr.checked_add(size).filter(|_| size > 0)?;
        let t = lock(&self.table);
        let covering = |cursor: u64| {
            let (_, e) = t.by_start.range(..=cursor).next_back()?;
            (e.start + e.len > cursor && e.access.allows(op)).then(|| e.clone())
        };
        // One range covers a request in the common case: no list allocated.
        let first = covering(addr)?;
        let mut rest = Vec::new();
        let mut cursor = first.start + first.len;
        while cursor < end {
            let e = covering(cursor)?;
            cursor = e.start + e.len;
            rest.push(e);
        }
        let hold = ExposureHold { ranges: self, first, rest, conn };
        for e in hold.entries() {
            lock(&e.holders).push(conn);
        }
        drop(t);
        Some(hold)
    }

    /// Ranges exposed now.
    pub(crate) fn len(&self) -> usize {
        lock(&self.table).by_start.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_only_inside_exposed_ranges() {
        let r = ExposedRanges::new(TcpServe::ExposedOnly);
        let a = r.open(1000, 100, RangeAccess::ReadWrite).unwrap();
        let _b = r.open(1100, 100, RangeAccess::Write).unwrap();
        assert!(r.open(1050, 10, RangeAccess::Read).is_err(), "overlap");
        assert!(r.admit(1000, 100, TcpOpcode::Read, 1).is_some());
        assert!(r.admit(1000, 200, TcpOpcode::Write, 1).is_some(), "adjacent ranges cover together");
        assert!(r.admit(1000, 200, TcpOpcode::Read, 1).is_none(), "second range is write-only");
        assert!(r.admit(999, 2, TcpOpcode::Read, 1).is_none());
        assert!(r.admit(1150, 51, TcpOpcode::Write, 1).is_none());
        assert!(r.admit(u64::MAX, 2, TcpOpcode::Write, 1).is_none());
        assert!(r.close(a));
        assert!(r.admit(1000, 1, TcpOpcode::Read, 1).is_none());
        assert!(!r.close(a));
        assert_eq!(r.len(), 1);
    }
}
