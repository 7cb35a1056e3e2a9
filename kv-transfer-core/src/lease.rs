//! `SlotLease<S>`: exclusive use of slots by one request, as a typestate.
//!
//! ```text
//!            reserve(n)
//!  free ───────────────► Reserved ──release/drop──► free
//!                           │  expose(peer) / expose_local(peer)
//!                           ▼
//!                        Exposed ──abort/drop──► quarantine ──proof──► free
//!                           │  settle(proof) / settled().await
//!                           ▼
//!                        Settled ──release/drop──► free
//!                           │  bytes(), read_at(), write_at(), into_reserved()
//! ```
//!
//! Every transition consumes `self`; a failed one hands the lease back inside
//! its error. Only `Reserved` and `Settled` leases can be released or read
//! (rule 3), and dropping an `Exposed` lease quarantines its slots (rule 4).

use crate::ids::{PeerId, Tenancy};
use crate::pool::SlotPool;
use crate::proof::Settlement;
use crate::region::RegionError;
use crate::remote::{RemoteSlot, RemoteSlots};
use smallvec::SmallVec;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::task::{Context, Poll};

pub(crate) type Tenancies = SmallVec<[Tenancy; 2]>;

mod sealed {
    pub trait Sealed {}
}

#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateKind {
    Reserved,
    Exposed,
    Settled,
}

/// A lease's typestate. Sealed: the three states below are all there is.
pub trait LeaseState: sealed::Sealed + Send + Sync + 'static {
    #[doc(hidden)]
    const KIND: StateKind;
}

/// Slots reserved by a request; nothing has been exposed under this tenancy.
#[derive(Debug)]
pub enum Reserved {}
/// Slots some NIC may touch: a posted operation's local side, or handed to a peer.
#[derive(Debug)]
pub enum Exposed {}
/// Slots exposed earlier and proven settled: no NIC can touch them any more.
#[derive(Debug)]
pub enum Settled {}

impl sealed::Sealed for Reserved {}
impl sealed::Sealed for Exposed {}
impl sealed::Sealed for Settled {}
impl LeaseState for Reserved {
    const KIND: StateKind = StateKind::Reserved;
}
impl LeaseState for Exposed {
    const KIND: StateKind = StateKind::Exposed;
}
impl LeaseState for Settled {
    const KIND: StateKind = StateKind::Settled;
}

struct LeaseInner {
    pool: SlotPool,
    tenancies: Tenancies,
    peer: Option<PeerId>,
}

/// Exclusive use of one or more slots by one request, in state `S`.
#[must_use = "dropping a lease releases it (or quarantines it, if exposed)"]
pub struct SlotLease<S: LeaseState> {
    // Transitions move this out without running `Drop` (see `morph`).
    inner: ManuallyDrop<LeaseInner>,
    _state: PhantomData<fn() -> S>,
}

impl<S: LeaseState> fmt::Debug for SlotLease<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("SlotLease");
        d.field("state", &S::KIND);
        let i = &*self.inner;
        d.field("pool", &i.pool.id()).field("tenancies", &i.tenancies.as_slice()).field("peer", &i.peer);
        d.finish()
    }
}

/// Why settling an exposed lease with a given proof failed. The lease comes
/// back unchanged.
#[derive(thiserror::Error)]
#[error("{reason}")]
pub struct SettleError {
    /// The lease, still exposed.
    pub lease: SlotLease<Exposed>,
    /// What was wrong with the proof.
    pub reason: SettleErrorReason,
}

impl fmt::Debug for SettleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SettleError").field("reason", &self.reason).field("lease", &self.lease).finish()
    }
}

/// What was wrong with a proof offered to [`SlotLease::settle`].
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettleErrorReason {
    /// The proof was minted by another pool's authority.
    #[error("proof belongs to another pool")]
    ForeignProof,
    /// The proof does not cover every slot of the lease (it may have settled
    /// some of them; the rest still wait).
    #[error("proof does not cover every slot of the lease")]
    Incomplete,
}

/// Errors of local reads and writes through a lease.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AccessError {
    /// The lease has no slot with this index.
    #[error("lease has {slots} slots; index {index} does not exist")]
    NoSuchSlot {
        /// Index asked for.
        index: usize,
        /// Slots in the lease.
        slots: usize,
    },
    /// The range does not fit in one slot.
    #[error("range {offset}+{len} does not fit in a slot of {slot_size} bytes")]
    OutOfSlot {
        /// Offset inside the slot.
        offset: usize,
        /// Length.
        len: usize,
        /// Slot size.
        slot_size: usize,
    },
    /// The region refused.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The slot's bytes do not match the digest its DONE carried: something
    /// wrote into it after the sender finished. Nothing was handed over.
    #[error("slot {index} of the lease does not match the digest of its DONE")]
    Integrity {
        /// The lease's slot index.
        index: usize,
    },
}

impl<S: LeaseState> SlotLease<S> {
    #[inline]
    pub(crate) fn new(pool: SlotPool, tenancies: Tenancies, peer: Option<PeerId>) -> Self {
        Self { inner: ManuallyDrop::new(LeaseInner { pool, tenancies, peer }), _state: PhantomData }
    }

    fn inner(&self) -> &LeaseInner {
        &self.inner
    }

    /// Moves the lease's contents into another state without running `Drop`.
    #[inline]
    fn morph<T: LeaseState>(self, peer: Option<PeerId>) -> SlotLease<T> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped (ManuallyDrop) nor used after this
        // read, so the contents are moved exactly once: into the new lease.
        let mut inner = unsafe { ManuallyDrop::take(&mut me.inner) };
        inner.peer = peer;
        SlotLease { inner: ManuallyDrop::new(inner), _state: PhantomData }
    }

    /// The pool the slots belong to.
    pub fn pool(&self) -> &SlotPool {
        &self.inner().pool
    }
    /// The tenancies this lease holds, in slot order of the lease.
    pub fn tenancies(&self) -> &[Tenancy] {
        &self.inner().tenancies
    }
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.inner().tenancies.len()
    }
    /// Always false: a lease holds at least one slot.
    pub fn is_empty(&self) -> bool {
        self.inner().tenancies.is_empty()
    }
    /// The peer the lease is exposed to (for `Exposed` leases).
    pub fn peer(&self) -> Option<PeerId> {
        self.inner().peer
    }
    /// Address of the lease's `index`-th slot as the NIC sees it.
    pub fn slot_addr(&self, index: usize) -> Option<u64> {
        let t = self.inner().tenancies.get(index)?;
        self.pool().slot_addr(t.slot)
    }

    fn region_offset(&self, index: usize, offset: usize, len: usize) -> Result<usize, AccessError> {
        let inner = self.inner();
        let slots = inner.tenancies.len();
        let t = inner.tenancies.get(index).ok_or(AccessError::NoSuchSlot { index, slots })?;
        let slot_size = inner.pool.slot_size();
        match offset.checked_add(len) {
            Some(end) if end <= slot_size => Ok(t.slot.0 as usize * slot_size + offset),
            _ => Err(AccessError::OutOfSlot { offset, len, slot_size }),
        }
    }

    fn write_local(&mut self, index: usize, offset: usize, src: &[u8]) -> Result<(), AccessError> {
        let at = self.region_offset(index, offset, src.len())?;
        self.pool().region().write(at, src)?;
        Ok(())
    }

    fn read_local(&self, index: usize, offset: usize, dst: &mut [u8]) -> Result<(), AccessError> {
        let at = self.region_offset(index, offset, dst.len())?;
        self.pool().region().read(at, dst)?;
        Ok(())
    }

    /// A whole slot's bytes, whatever the state (the drain protocol's
    /// digests of a backend's own exposed lease).
    pub(crate) fn read_local_for_backend(&self, index: usize, dst: &mut [u8]) -> Result<(), AccessError> {
        self.read_local(index, 0, dst)
    }

    #[inline]
    fn exposed(self, peer: PeerId) -> SlotLease<Exposed> {
        self.pool().mark_exposed(self.tenancies(), peer);
        self.morph(Some(peer))
    }
}

impl SlotLease<Reserved> {
    /// Gives the slots back. Nothing was exposed, so no proof is needed.
    pub fn release(self) {
        drop(self)
    }

    /// Writes local bytes (the prefill side filling its source slots before
    /// posting). `index` is the slot's position in the lease.
    pub fn write_at(&mut self, index: usize, offset: usize, src: &[u8]) -> Result<(), AccessError> {
        self.write_local(index, offset, src)
    }

    /// Exposes the slots to `peer` and describes them for it (through
    /// [`SettlementAuthority::expose`](crate::SettlementAuthority::expose):
    /// only a backend exposes).
    pub(crate) fn expose(
        self,
        peer: PeerId,
        key: u64,
        endpoint: impl Into<String>,
        token: crate::drain::ExposureToken,
    ) -> (SlotLease<Exposed>, RemoteSlots) {
        let pool = self.pool();
        let slots = self
            .tenancies()
            .iter()
            .map(|t| RemoteSlot {
                slot: t.slot,
                generation: t.generation,
                addr: pool.slot_addr(t.slot).unwrap_or_default(),
                key: None,
            })
            .collect();
        let remote = RemoteSlots {
            endpoint: endpoint.into(),
            pool: pool.id(),
            key,
            slot_size: pool.slot_size() as u64,
            memory: pool.memory(),
            token,
            slots,
        };
        (self.exposed(peer), remote)
    }

    /// Exposes the slots as the local side of an operation posted to `peer`
    /// (through [`SettlementAuthority::expose_local`](crate::SettlementAuthority::expose_local)).
    #[inline]
    pub(crate) fn expose_local(self, peer: PeerId) -> SlotLease<Exposed> {
        self.exposed(peer)
    }
}

impl SlotLease<Exposed> {
    /// Settles with a proof in hand. Fails, handing the lease back, if the
    /// proof is another pool's or does not cover every slot.
    #[inline]
    pub fn settle(self, proof: impl Into<Settlement>) -> Result<SlotLease<Settled>, SettleError> {
        let proof = proof.into();
        if proof.pool != self.pool().id() {
            return Err(SettleError { lease: self, reason: SettleErrorReason::ForeignProof });
        }
        if self.pool().apply_and_settle(&proof, self.tenancies()) {
            Ok(self.morph(None))
        } else {
            Err(SettleError { lease: self, reason: SettleErrorReason::Incomplete })
        }
    }

    /// Waits until the backend delivers proofs covering every slot (an ack,
    /// a revocation or a fence). Dropping the future quarantines the lease.
    pub fn settled(self) -> SettledFuture {
        SettledFuture { lease: Some(self) }
    }

    /// Whether every slot is already proven (non-blocking).
    pub fn try_settled(self) -> Result<SlotLease<Settled>, SlotLease<Exposed>> {
        if self.pool().try_settle(self.tenancies(), None) {
            Ok(self.morph(None))
        } else {
            Err(self)
        }
    }

    /// Abandons the exposure: the slots go to quarantine and the escalation
    /// ladder starts (drain and ack, revoke, fence). They return to the free
    /// list only when a proof arrives; slots already proven return now.
    pub fn abort(self) {
        drop(self)
    }
}

impl SlotLease<Settled> {
    /// Gives the slots back.
    pub fn release(self) {
        drop(self)
    }
    /// Reads bytes of the lease's `index`-th slot. If the slot's DONE
    /// carried a digest, the whole slot is read once, checked against it,
    /// and the range is handed over from that same copy (so a write landing
    /// meanwhile cannot slip between check and read); a mismatch is refused
    /// ([`AccessError::Integrity`]): no byte handed over.
    pub fn read_at(&self, index: usize, offset: usize, dst: &mut [u8]) -> Result<(), AccessError> {
        let Some((t, d)) = self.tenancies().get(index).and_then(|t| Some((*t, self.pool().digest_of(*t)?))) else {
            return self.read_local(index, offset, dst);
        };
        self.region_offset(index, offset, dst.len())?;
        let mut whole = vec![0u8; self.pool().slot_size()];
        self.read_local(index, 0, &mut whole)?;
        if !self.pool().check_digest(t, d, &whole) {
            return Err(AccessError::Integrity { index });
        }
        dst.copy_from_slice(&whole[offset..offset + dst.len()]);
        Ok(())
    }

    /// Checks every slot against the digest its DONE carried, if any: a
    /// write that landed after the DONE (the positive control's bug) shows
    /// here as [`AccessError::Integrity`], counted in `integrity_failures`.
    pub fn verify_integrity(&self) -> Result<(), AccessError> {
        self.bytes().map(drop)
    }

    /// Writes bytes into the lease's `index`-th slot (the slot's digest,
    /// if a DONE carried one, no longer applies and is dropped).
    pub fn write_at(&mut self, index: usize, offset: usize, src: &[u8]) -> Result<(), AccessError> {
        if let Some(t) = self.tenancies().get(index) {
            self.pool().drop_digests(std::slice::from_ref(t));
        }
        self.write_local(index, offset, src)
    }
    /// All slots' bytes, concatenated in lease order, each slot checked
    /// against its digest (if a DONE carried one) on the copy handed over.
    pub fn bytes(&self) -> Result<Vec<u8>, AccessError> {
        let slot_size = self.pool().slot_size();
        let mut out = vec![0u8; slot_size * self.len()];
        for (i, chunk) in out.chunks_mut(slot_size).enumerate() {
            self.read_local(i, 0, chunk)?;
            let t = self.tenancies()[i];
            if let Some(d) = self.pool().digest_of(t) {
                if !self.pool().check_digest(t, d, chunk) {
                    return Err(AccessError::Integrity { index: i });
                }
            }
        }
        Ok(out)
    }
    /// Keeps the slots (same tenancy) for another operation.
    pub fn into_reserved(self) -> SlotLease<Reserved> {
        self.pool().drop_digests(self.tenancies());
        self.morph(None)
    }
}

impl<S: LeaseState> Drop for SlotLease<S> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: `drop` runs once, and transitions (`morph`) never let it
        // run on a lease whose contents they moved out.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        match S::KIND {
            StateKind::Reserved | StateKind::Settled => inner.pool.release_held(&inner.tenancies),
            StateKind::Exposed => {
                let peer = inner.peer.unwrap_or(PeerId(u32::MAX));
                inner.pool.quarantine(&inner.tenancies, peer);
            }
        }
    }
}

/// Future returned by [`SlotLease::settled`]. Owns the lease while waiting.
#[must_use = "futures do nothing unless polled; dropping this quarantines the lease"]
#[derive(Debug)]
pub struct SettledFuture {
    lease: Option<SlotLease<Exposed>>,
}

impl SettledFuture {
    /// Gives up waiting and aborts the lease (quarantine, escalation).
    pub fn abort(mut self) {
        drop(self.lease.take());
    }
}

impl Future for SettledFuture {
    type Output = SlotLease<Settled>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(lease) = self.lease.as_ref() else {
            return Poll::Pending;
        };
        if lease.pool().try_settle(lease.tenancies(), Some(cx.waker())) {
            match self.lease.take() {
                Some(l) => Poll::Ready(l.morph(None)),
                None => Poll::Pending,
            }
        } else {
            Poll::Pending
        }
    }
}
