//! The slot pool: free list, generations, quarantine, admission. A state
//! machine behind one mutex, driven by leases (the application) and by the
//! [`SettlementAuthority`](crate::SettlementAuthority) (the backend).

use crate::clock::{Clock, SystemClock};
use crate::drain::Capabilities;
use crate::escalation::{
    EscalationAction, EscalationLadder, EscalationStep, QuarantineId, MIN_REDRAIN_INTERVAL, REDRAIN_MAX_INTERVAL,
};
use crate::hash::HashMap;
use crate::ids::{Generation, PeerId, PoolId, SlotId, Tenancy};
use crate::lease::{Reserved, SlotLease, Tenancies};
use crate::metrics::{report_counter, Counters, MetricsSnapshot};
use crate::proof::{ProofScope, Settlement, SettlementKind};
use crate::region::{MemoryKind, Region};
use crate::sync::{lock, Mutex, MutexGuard};
use smallvec::SmallVec;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;
use std::time::Instant;

/// Errors of building a pool.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolError {
    /// A slot must hold at least one byte.
    #[error("slot size must be non-zero")]
    ZeroSlotSize,
    /// The region cannot hold a single slot.
    #[error("region of {region_len} bytes cannot hold one slot of {slot_size} bytes")]
    RegionTooSmall {
        /// Region length.
        region_len: usize,
        /// Requested slot size.
        slot_size: usize,
    },
    /// Slot ids are `u32`.
    #[error("region holds {slots} slots; at most {max} are supported", max = u32::MAX)]
    TooManySlots {
        /// Slots the region would hold.
        slots: usize,
    },
}

/// Why `reserve` or `reserve_slots` refused. A refused request never owns a
/// slot (rule 6).
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdmissionError {
    /// Fewer slots are free right now than the request needs.
    #[error("over capacity: {requested} slots requested, {available} free")]
    OverCapacity {
        /// Slots asked for.
        requested: usize,
        /// Slots free at the time.
        available: usize,
    },
    /// The request is larger than the whole pool and can never be served.
    #[error("request of {requested} slots exceeds the pool's capacity of {capacity}")]
    TooLarge {
        /// Slots asked for.
        requested: usize,
        /// Slots in the pool.
        capacity: usize,
    },
    /// A request for zero slots is a caller bug, not a lease.
    #[error("a lease needs at least one slot")]
    Empty,
    /// [`SlotPool::reserve_slots`] named a slot the pool does not have.
    #[error("slot {} does not exist: the pool has {capacity} slots", slot.0)]
    NoSuchSlot {
        /// The slot asked for.
        slot: SlotId,
        /// Slots in the pool.
        capacity: usize,
    },
    /// [`SlotPool::reserve_slots`] named the same slot twice.
    #[error("slot {} is named twice in one request", slot.0)]
    DuplicateSlot {
        /// The slot named twice.
        slot: SlotId,
    },
    /// [`SlotPool::reserve_slots`] named a slot that is not free: the caller
    /// reused a slot this pool still holds.
    #[error(
        "slot {} is not free ({})",
        slot.0,
        if *quarantined { "quarantined until a settlement proof arrives" } else { "leased or exposed" }
    )]
    SlotBusy {
        /// The first slot of the request that is not free.
        slot: SlotId,
        /// Whether it is quarantined, waiting for a settlement proof (its
        /// exposed lease was aborted or dropped); otherwise a lease holds it
        /// (reserved, exposed, proven or settled).
        quarantined: bool,
    },
}

/// Configuration of a pool.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Bytes per slot.
    pub slot_size: usize,
    /// Deadlines of the escalation ladder.
    pub ladder: EscalationLadder,
    /// Time source (the system clock unless a test drives it). Escalation
    /// deadlines are read from it, so a pool with a [`ManualClock`](crate::ManualClock)
    /// escalates only when the test advances it.
    pub clock: Arc<dyn Clock>,
    /// What the backend can prove: the ladder holds only these steps (a
    /// backend sets its own when it registers the pool; all three by default).
    pub capabilities: Capabilities,
}

impl PoolConfig {
    /// Slots of `slot_size` bytes, the default ladder, the system clock.
    pub fn new(slot_size: usize) -> Self {
        Self {
            slot_size,
            ladder: EscalationLadder::default(),
            clock: Arc::new(SystemClock),
            capabilities: Capabilities::ALL,
        }
    }
    /// Replaces the capabilities the ladder is built from.
    pub fn with_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = capabilities;
        self
    }
    /// Replaces the escalation ladder.
    pub fn with_ladder(mut self, ladder: EscalationLadder) -> Self {
        self.ladder = ladder;
        self
    }
    /// Replaces the clock.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
}

// Slot states. A `u8` each, to keep per-slot metadata at 16 bytes.
pub(crate) const FREE: u8 = 0;
/// Leased and not exposed: a `Reserved` or `Settled` lease holds it.
pub(crate) const HELD: u8 = 1;
/// Exposed, no proof yet.
pub(crate) const EXPOSED: u8 = 2;
/// Exposed and proven settled; the lease has not picked the proof up yet.
pub(crate) const PROVEN: u8 = 3;
/// Its lease was aborted or dropped while exposed; waits for a proof.
pub(crate) const QUARANTINED: u8 = 4;
/// Free and named earlier in the same `reserve_slots` call. Transient: set
/// and cleared under one hold of the lock, never seen outside it.
const CLAIMING: u8 = 5;

/// Per-slot metadata: 16 bytes (plus 4 on the free list while free).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotMeta {
    pub(crate) generation: u64,
    /// The peer while `EXPOSED`/`PROVEN`; the quarantine entry while
    /// `QUARANTINED`; its index in [`PoolState::free`] while `FREE` (so a
    /// named slot leaves the free list in O(1): see `PoolState::take_free`).
    pub(crate) aux: u32,
    /// The pool's fence epoch when the slot was exposed: a fence minted
    /// before that does not cover it. (In the struct's padding: 16 bytes still.)
    pub(crate) epoch: u16,
    pub(crate) state: u8,
}

pub(crate) struct QuarantineEntry {
    pub(crate) id: u64,
    pub(crate) peer: PeerId,
    /// The fence epoch of its exposure.
    pub(crate) epoch: u16,
    pub(crate) remaining: Tenancies,
    pub(crate) since: Instant,
    pub(crate) rung: Rung,
}

/// Where one quarantine entry stands on its escalation ladder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rung {
    /// `step` falls due at `at`.
    Climbing { step: EscalationStep, at: Instant },
    /// The ladder is exhausted and the slots are counted stuck. A backend
    /// that can drain is asked again to send the ABORT at `redrain_at`
    /// (the interval doubling from the drain deadline up to
    /// [`REDRAIN_MAX_INTERVAL`](crate::REDRAIN_MAX_INTERVAL)): an ABORT or ABORT_ACK lost on a link that
    /// was cut is asked for again once the link is back, so the peer's ack
    /// can still prove the slots. Asking frees nothing; only the ack does.
    Stuck { redrain_at: Option<Instant>, every: Duration },
}

impl Rung {
    fn is_stuck(&self) -> bool {
        matches!(self, Rung::Stuck { .. })
    }

    /// When this entry next wants the backend's attention.
    fn due_at(&self) -> Option<Instant> {
        match *self {
            Rung::Climbing { at, .. } => Some(at),
            Rung::Stuck { redrain_at, .. } => redrain_at,
        }
    }
}

pub(crate) struct PoolState {
    pub(crate) slots: Vec<SlotMeta>,
    /// The free slots, used as a stack. Changed only through `push_free`,
    /// `pop_free` and `take_free`, which keep each free slot's `aux` equal to
    /// its index here.
    pub(crate) free: Vec<u32>,
    /// Quarantine entries; a slot's `aux` indexes this while quarantined.
    pub(crate) quarantine: Vec<Option<QuarantineEntry>>,
    pub(crate) quarantine_vacant: Vec<u32>,
    pub(crate) next_quarantine_id: u64,
    pub(crate) waiters: HashMap<u32, Waker>,
    /// Digests a DONE carried for settled tenancies, by slot: `(generation,
    /// crc32c)`, checked when the settled lease is read. An entry of an older
    /// generation is ignored (the slot was leased again), so release costs
    /// nothing here; the lease's own writes and `into_reserved` drop its
    /// entries (the same tenancy's bytes are its own again). One entry per
    /// slot at most.
    pub(crate) digests: HashMap<u32, SlotDigest>,
    pub(crate) counters: Counters,
    pub(crate) leased: u64,
    pub(crate) quarantined: u64,
    pub(crate) stuck: u64,
    pub(crate) escalation_hook: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Fenced proofs minted so far (wrapping): an exposure records it, a
    /// fence covers the exposures recorded at or before its own.
    pub(crate) fence_epoch: u16,
}

impl PoolState {
    /// Puts `slot` on the free list (top of the stack) and marks it `FREE`.
    fn push_free(&mut self, slot: u32) {
        let pos = self.free.len() as u32;
        let meta = &mut self.slots[slot as usize];
        meta.state = FREE;
        meta.aux = pos;
        self.free.push(slot);
    }

    /// Takes the slot on top of the free list, if any. The caller sets its
    /// new state.
    fn pop_free(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Takes the named free slot off the free list in O(1): the top of the
    /// stack moves into its place. The caller sets its new state.
    fn take_free(&mut self, slot: u32) {
        let pos = self.slots[slot as usize].aux as usize;
        debug_assert_eq!(self.free.get(pos), Some(&slot), "free-list index of slot {slot} is stale");
        self.free.swap_remove(pos);
        if let Some(&moved) = self.free.get(pos) {
            self.slots[moved as usize].aux = pos as u32;
        }
    }

    /// Gives `slot` (just taken off the free list) a fresh tenancy.
    fn lease_slot(&mut self, slot: u32) -> Tenancy {
        let meta = &mut self.slots[slot as usize];
        meta.generation += 1;
        meta.state = HELD;
        Tenancy::new(SlotId(slot), Generation(meta.generation))
    }
}

pub(crate) struct PoolInner {
    pub(crate) id: PoolId,
    pub(crate) region: Arc<dyn Region>,
    /// The region's kind and base address, read once (a descriptor names them).
    pub(crate) memory: MemoryKind,
    pub(crate) base: u64,
    pub(crate) slot_size: usize,
    pub(crate) capacity: u32,
    pub(crate) ladder: EscalationLadder,
    pub(crate) capabilities: Capabilities,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) state: Mutex<PoolState>,
}

/// A pool of fixed-size KV slots carved from one registered region.
///
/// Cheap to clone (an `Arc`). `reserve` is the only way in; a slot comes back
/// to the free list only from a lease that was never exposed, or with a
/// settlement proof.
///
/// ```
/// use kv_transfer_core::{HostRegion, PoolConfig, SlotPool, AdmissionError};
/// use std::sync::Arc;
///
/// let region = Arc::new(HostRegion::new(8 * 4096).unwrap());
/// let (pool, _authority) = SlotPool::new(region, PoolConfig::new(4096)).unwrap();
/// let lease = pool.reserve(3).unwrap();
/// assert_eq!(pool.metrics().free, 5);
/// assert!(matches!(pool.reserve(6), Err(AdmissionError::OverCapacity { requested: 6, available: 5 })));
/// assert!(matches!(pool.reserve(9), Err(AdmissionError::TooLarge { .. })));
/// lease.release();
/// assert_eq!(pool.metrics().free, 8);
/// ```
#[derive(Clone)]
pub struct SlotPool {
    pub(crate) inner: Arc<PoolInner>,
}

impl fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotPool")
            .field("id", &self.inner.id)
            .field("capacity", &self.inner.capacity)
            .field("slot_size", &self.inner.slot_size)
            .finish_non_exhaustive()
    }
}

/// The digest a DONE carried for a settled tenancy of a slot, with the key
/// (its exposure's token) to check it under.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotDigest {
    pub(crate) generation: u64,
    pub(crate) tag: crate::drain::Digest,
    pub(crate) key: crate::drain::ExposureToken,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// A pool's id: 48 bits from the OS's random source over a 16-bit process
/// counter. Peers see ids (descriptors carry them); a sequential id let a
/// hostile peer name a pool it was never shown in a forged ABORT, so an id is
/// not guessable, and still distinct within a process for 65,536 pools.
fn fresh_pool_id() -> PoolId {
    let n = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed) & 0xffff;
    let mut b = [0u8; 8];
    if let Err(e) = getrandom::fill(&mut b) {
        tracing::error!(error = %e, "OS random source failed: pool id is guessable");
    }
    PoolId((u64::from_le_bytes(b) & !0xffff) | n)
}

/// What a delivered proof did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeliveryReport {
    /// Slots the proof settled (live exposures proven, quarantined slots freed).
    pub settled: usize,
    /// Of those, quarantined slots returned to the free list.
    pub reclaimed: usize,
    /// Tenancies the proof named that are not awaiting settlement (old
    /// generation, never exposed, or already settled): dropped and counted.
    pub stale: usize,
}

impl SlotPool {
    /// Builds a pool over `region` and returns it with the pool's
    /// [`SettlementAuthority`](crate::SettlementAuthority).
    ///
    /// The authority is the only thing that can mint settlement proofs for
    /// this pool. A backend creates the pool when it registers the region,
    /// keeps the authority, and hands the pool to the application.
    pub fn new(
        region: Arc<dyn Region>,
        config: PoolConfig,
    ) -> Result<(SlotPool, crate::SettlementAuthority), PoolError> {
        if config.slot_size == 0 {
            return Err(PoolError::ZeroSlotSize);
        }
        let slots = region.len() / config.slot_size;
        if slots == 0 {
            return Err(PoolError::RegionTooSmall { region_len: region.len(), slot_size: config.slot_size });
        }
        let capacity = u32::try_from(slots).map_err(|_| PoolError::TooManySlots { slots })?;
        let state = PoolState {
            // Popped from the back: slot 0 is handed out first. Each free
            // slot's `aux` is its index on the free list.
            slots: (0..capacity)
                .map(|i| SlotMeta { generation: 0, aux: capacity - 1 - i, epoch: 0, state: FREE })
                .collect(),
            free: (0..capacity).rev().collect(),
            quarantine: Vec::new(),
            quarantine_vacant: Vec::new(),
            next_quarantine_id: 0,
            waiters: HashMap::default(),
            digests: HashMap::default(),
            counters: Counters::default(),
            leased: 0,
            quarantined: 0,
            stuck: 0,
            escalation_hook: None,
            fence_epoch: 0,
        };
        let inner = PoolInner {
            id: fresh_pool_id(),
            memory: region.kind(),
            base: region.addr(),
            region,
            slot_size: config.slot_size,
            capacity,
            ladder: config.ladder,
            capabilities: config.capabilities,
            clock: config.clock,
            state: Mutex::new(state),
        };
        let pool = SlotPool { inner: Arc::new(inner) };
        Ok((pool.clone(), crate::SettlementAuthority { pool }))
    }

    /// This pool's identity.
    pub fn id(&self) -> PoolId {
        self.inner.id
    }
    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.inner.capacity as usize
    }
    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.inner.slot_size
    }
    /// The region the slots are carved from.
    pub fn region(&self) -> &Arc<dyn Region> {
        &self.inner.region
    }
    /// Where the slots live (host memory or a device's).
    pub fn memory(&self) -> MemoryKind {
        self.inner.memory
    }
    /// Address of a slot as the NIC sees it, if the slot exists.
    pub fn slot_addr(&self, slot: SlotId) -> Option<u64> {
        (slot.0 < self.inner.capacity).then(|| self.inner.base + slot.0 as u64 * self.inner.slot_size as u64)
    }
    /// The slot holding address `addr`, if any.
    pub fn slot_at(&self, addr: u64) -> Option<SlotId> {
        let off = addr.checked_sub(self.inner.base)?;
        let idx = off / self.inner.slot_size as u64;
        (idx < self.inner.capacity as u64).then_some(SlotId(idx as u32))
    }
    /// The slot's current generation, if the slot exists.
    pub fn generation(&self, slot: SlotId) -> Option<Generation> {
        let st = lock(&self.inner.state);
        st.slots.get(slot.0 as usize).map(|m| Generation(m.generation))
    }

    /// Reserves `n` slots, all or nothing (rule 6): either a lease on `n`
    /// slots, each under a fresh generation, or a typed refusal before
    /// anything is exposed.
    #[inline]
    pub fn reserve(&self, n: usize) -> Result<SlotLease<Reserved>, AdmissionError> {
        let mut st = lock(&self.inner.state);
        // The admitted case first (free.len() <= capacity, so it implies
        // n <= capacity): one comparison on the common path.
        if n == 0 || n > st.free.len() {
            let capacity = self.capacity();
            let e = if n == 0 {
                AdmissionError::Empty
            } else if n > capacity {
                AdmissionError::TooLarge { requested: n, capacity }
            } else {
                AdmissionError::OverCapacity { requested: n, available: st.free.len() }
            };
            return Err(self.refuse(st, n, e));
        }
        let mut tenancies = Tenancies::with_capacity(n);
        for _ in 0..n {
            // Cannot fail: n <= free.len() was checked under the same lock.
            let Some(idx) = st.pop_free() else { break };
            tenancies.push(st.lease_slot(idx));
        }
        Ok(self.grant(st, tenancies))
    }

    /// Reserves exactly the named slots, all or nothing (rule 6), each under
    /// a fresh generation: the lease's tenancies are in the order given.
    ///
    /// For a caller that allocates slots itself (a serving engine's page
    /// allocator) and tells the pool which ones a request got. A slot that
    /// is not free means the caller reused a slot this pool still holds
    /// (leased, exposed, or quarantined until a proof arrives): that is
    /// refused, never handed out. The refusal names the first offending slot
    /// in the order given; nothing in the pool changes, and it is counted
    /// like any refused admission.
    ///
    /// Costs O(`slots.len()`), whatever the pool's capacity.
    ///
    /// # Errors
    ///
    /// - [`AdmissionError::Empty`]: `slots` is empty.
    /// - [`AdmissionError::NoSuchSlot`]: a slot is not below the capacity.
    /// - [`AdmissionError::DuplicateSlot`]: a slot is named twice.
    /// - [`AdmissionError::SlotBusy`]: a slot is not free; `quarantined`
    ///   says whether it waits for a settlement proof.
    ///
    /// ```
    /// use kv_transfer_core::{AdmissionError, HostRegion, PeerId, PoolConfig, SlotId, SlotPool};
    /// use std::sync::Arc;
    ///
    /// let region = Arc::new(HostRegion::new(8 * 4096).unwrap());
    /// let (pool, authority) = SlotPool::new(region, PoolConfig::new(4096)).unwrap();
    ///
    /// // The engine's allocator gave the request pages 5, 2 and 7.
    /// let lease = pool.reserve_slots(&[SlotId(5), SlotId(2), SlotId(7)]).unwrap();
    /// let slots: Vec<SlotId> = lease.tenancies().iter().map(|t| t.slot).collect();
    /// assert_eq!(slots, [SlotId(5), SlotId(2), SlotId(7)]);
    /// assert_eq!(pool.metrics().free, 5);
    ///
    /// // Exposed, then aborted: the pages are quarantined until a proof.
    /// let (exposed, remote) = authority.expose(lease, PeerId(1), 0x1234, "decode-0", Default::default());
    /// exposed.abort();
    ///
    /// // The engine hands page 2 out again too early: refused, nothing taken.
    /// assert_eq!(
    ///     pool.reserve_slots(&[SlotId(1), SlotId(2)]).unwrap_err(),
    ///     AdmissionError::SlotBusy { slot: SlotId(2), quarantined: true }
    /// );
    /// assert_eq!(pool.metrics().free, 5);
    ///
    /// // Once the peer's drain is proven, the same request is served.
    /// authority.deliver(authority.completed(&remote.tenancies()));
    /// let again = pool.reserve_slots(&[SlotId(1), SlotId(2)]).unwrap();
    /// assert_eq!(again.tenancies()[1].generation.0, 2);
    /// ```
    pub fn reserve_slots(&self, slots: &[SlotId]) -> Result<SlotLease<Reserved>, AdmissionError> {
        let n = slots.len();
        if n == 0 {
            return Err(self.refuse(lock(&self.inner.state), 0, AdmissionError::Empty));
        }
        let capacity = self.capacity();
        // Allocated before the lock; no allocation while slots are CLAIMING.
        let mut tenancies = Tenancies::with_capacity(n);
        let mut st = lock(&self.inner.state);
        // Pass 1: check every slot, marking each free one CLAIMING so that a
        // second mention of it is seen. Undone on refusal.
        let mut refusal = None;
        let mut claimed = 0;
        for &slot in slots {
            let Some(meta) = st.slots.get_mut(slot.0 as usize) else {
                refusal = Some(AdmissionError::NoSuchSlot { slot, capacity });
                break;
            };
            match meta.state {
                FREE => meta.state = CLAIMING,
                CLAIMING => refusal = Some(AdmissionError::DuplicateSlot { slot }),
                s => refusal = Some(AdmissionError::SlotBusy { slot, quarantined: s == QUARANTINED }),
            }
            if refusal.is_some() {
                break;
            }
            claimed += 1;
        }
        if let Some(e) = refusal {
            // The first `claimed` slots are distinct and were FREE; their
            // place on the free list was never touched.
            for slot in &slots[..claimed] {
                st.slots[slot.0 as usize].state = FREE;
            }
            return Err(self.refuse(st, n, e));
        }
        // Pass 2: all distinct and free; take each off the free list.
        for slot in slots {
            st.take_free(slot.0);
            tenancies.push(st.lease_slot(slot.0));
        }
        Ok(self.grant(st, tenancies))
    }

    /// Counts and reports a refused admission (under the lock, then after it).
    fn refuse(&self, mut st: MutexGuard<'_, PoolState>, requested: usize, e: AdmissionError) -> AdmissionError {
        st.counters.admission_rejected += 1;
        drop(st);
        report_counter!("kvt_admission_rejected_total", self.inner.id, 1);
        tracing::debug!(pool = self.inner.id.0, requested, error = %e, "admission refused");
        e
    }

    /// Records a granted admission of `tenancies` (already `HELD`) and
    /// returns its lease.
    #[inline]
    fn grant(&self, mut st: MutexGuard<'_, PoolState>, tenancies: Tenancies) -> SlotLease<Reserved> {
        st.leased += tenancies.len() as u64;
        st.counters.leases += 1;
        drop(st);
        report_counter!("kvt_leases_total", self.inner.id, 1);
        SlotLease::new(self.clone(), tenancies, None)
    }

    /// A snapshot of the pool's gauges and counters.
    pub fn metrics(&self) -> MetricsSnapshot {
        let st = lock(&self.inner.state);
        let c = &st.counters;
        MetricsSnapshot {
            capacity: self.inner.capacity as u64,
            free: st.free.len() as u64,
            leased: st.leased,
            quarantined: st.quarantined,
            quarantine_stuck: st.stuck,
            leases: c.leases,
            admission_rejected: c.admission_rejected,
            exposures: c.exposures,
            settled_completed: c.settled_completed,
            settled_revoked: c.settled_revoked,
            settled_fenced: c.settled_fenced,
            quarantined_total: c.quarantined_total,
            stale_rejected: c.stale_rejected,
            forged_rejected: c.forged_rejected,
            integrity_failures: c.integrity_failures,
            released: c.released,
            abort_to_reclaim: c.abort_to_reclaim.summary(),
        }
    }

    /// Bytes of pool metadata per slot (state table plus free list), for
    /// capacity planning. A free slot's index on the free list (which lets
    /// [`reserve_slots`](Self::reserve_slots) take a named slot in O(1))
    /// lives in the state table, so it costs nothing extra. Quarantine
    /// entries and waiters are extra and proportional to what is in flight,
    /// not to capacity.
    pub fn metadata_bytes_per_slot() -> usize {
        std::mem::size_of::<SlotMeta>() + std::mem::size_of::<u32>()
    }

    /// Whether the slot is on the free list (for tests and debug endpoints).
    #[doc(hidden)]
    pub fn slot_is_free(&self, slot: SlotId) -> bool {
        let st = lock(&self.inner.state);
        st.slots.get(slot.0 as usize).is_some_and(|m| m.state == FREE)
    }

    /// Checks the pool's internal invariants and returns a description of the
    /// first violation. Used by the model checks and property tests; cheap
    /// enough for a debug endpoint (linear in capacity).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = lock(&self.inner.state);
        let mut on_free_list = vec![false; st.slots.len()];
        for (pos, &i) in st.free.iter().enumerate() {
            let i = i as usize;
            if i >= st.slots.len() {
                return Err(format!("free list holds unknown slot {i}"));
            }
            if on_free_list[i] {
                return Err(format!("slot {i} is on the free list twice"));
            }
            on_free_list[i] = true;
            let m = st.slots[i];
            if m.state == FREE && m.aux as usize != pos {
                return Err(format!("free slot {i} is at {pos} on the free list but its index says {}", m.aux));
            }
        }
        let (mut held, mut quarantined) = (0u64, 0u64);
        for (i, m) in st.slots.iter().enumerate() {
            match (m.state, on_free_list[i]) {
                (FREE, true) => {}
                (FREE, false) => return Err(format!("slot {i} is free but lost (not on the free list)")),
                (s, true) => return Err(format!("slot {i} in state {s} is on the free list")),
                (QUARANTINED, false) => quarantined += 1,
                (_, false) => held += 1,
            }
        }
        if held != st.leased || quarantined != st.quarantined {
            return Err(format!(
                "gauges disagree: leased {} vs {held} held, quarantined {} vs {quarantined}",
                st.leased, st.quarantined
            ));
        }
        if st.free.len() as u64 + held + quarantined != self.inner.capacity as u64 {
            return Err("free + leased + quarantined != capacity".into());
        }
        Ok(())
    }

    // ----- transitions used by leases (crate-private) -----

    /// Returns never-exposed (or settled) slots to the free list.
    // `always`: every lease's drop calls it, monomorphized in the caller's
    // crate, where a plain `#[inline]` still left a call (9 instructions of
    // the lease cycle's 346; `cycle_profile` under callgrind).
    #[inline(always)]
    pub(crate) fn release_held(&self, tenancies: &[Tenancy]) {
        let mut st = lock(&self.inner.state);
        let mut n = 0u64;
        for t in tenancies {
            let meta = st.slots[t.slot.0 as usize];
            debug_assert_eq!(meta.generation, t.generation.0);
            debug_assert_eq!(meta.state, HELD);
            st.push_free(t.slot.0);
            n += 1;
        }

        st.leased -= n;
        st.counters.released += n;
        drop(st);
        report_counter!("kvt_released_slots_total", self.inner.id, n);
    }

    #[inline]
    pub(crate) fn mark_exposed(&self, tenancies: &[Tenancy], peer: PeerId) {
        let mut st = lock(&self.inner.state);
        let epoch = st.fence_epoch;
        for t in tenancies {
            let meta = &mut st.slots[t.slot.0 as usize];
            debug_assert_eq!(meta.state, HELD);
            meta.state = EXPOSED;
            meta.aux = peer.0;
            meta.epoch = epoch;
        }
        st.counters.exposures += 1;
        drop(st);
        report_counter!("kvt_exposures_total", self.inner.id, 1);
    }

    /// If every slot of an exposed lease is proven, moves them back to held
    /// and returns true; otherwise registers `waker` (if any) and returns false.
    pub(crate) fn try_settle(&self, tenancies: &[Tenancy], waker: Option<&Waker>) -> bool {
        let mut st = lock(&self.inner.state);
        if Self::settle_locked(&mut st, tenancies) {
            return true;
        }
        if let Some(w) = waker {
            for t in tenancies {
                if st.slots[t.slot.0 as usize].state == EXPOSED {
                    st.waiters.insert(t.slot.0, w.clone());
                }
            }
        }
        false
    }

    fn settle_locked(st: &mut PoolState, tenancies: &[Tenancy]) -> bool {
        let all = tenancies.iter().all(|t| st.slots[t.slot.0 as usize].state == PROVEN);
        if all {
            for t in tenancies {
                st.slots[t.slot.0 as usize].state = HELD;
                if !st.waiters.is_empty() {
                    st.waiters.remove(&t.slot.0);
                }
            }
        }
        all
    }

    /// An exposed lease was aborted or dropped: proven slots go free, the rest
    /// into quarantine, and the backend's escalation hook is told.
    pub(crate) fn quarantine(&self, tenancies: &[Tenancy], peer: PeerId) -> Option<QuarantineId> {
        let now = self.inner.clock.now();
        let _span = tracing::debug_span!("kvt.quarantine", pool = self.inner.id.0, peer = peer.0).entered();
        let mut st = lock(&self.inner.state);
        let mut remaining = Tenancies::new();
        let mut freed = 0u64;
        for t in tenancies {
            st.waiters.remove(&t.slot.0);
            let meta = st.slots[t.slot.0 as usize];
            if meta.state == PROVEN {
                st.push_free(t.slot.0);
                freed += 1;
            } else {
                debug_assert_eq!(meta.state, EXPOSED);
                remaining.push(*t);
            }
        }
        st.leased -= freed + remaining.len() as u64;
        st.counters.released += freed;
        if remaining.is_empty() {
            return None;
        }
        let id = st.next_quarantine_id;
        st.next_quarantine_id += 1;
        let index = match st.quarantine_vacant.pop() {
            Some(i) => i,
            None => {
                st.quarantine.push(None);
                (st.quarantine.len() - 1) as u32
            }
        };
        for t in &remaining {
            let meta = &mut st.slots[t.slot.0 as usize];
            meta.state = QUARANTINED;
            meta.aux = index;
        }
        let n = remaining.len() as u64;
        st.quarantined += n;
        st.counters.quarantined_total += n;
        let epoch = remaining.first().map_or(st.fence_epoch, |t| st.slots[t.slot.0 as usize].epoch);
        st.quarantine[index as usize] = Some(QuarantineEntry {
            id,
            peer,
            epoch,
            remaining,
            since: now,
            rung: Rung::Climbing { step: EscalationStep::first(self.inner.capabilities), at: now },
        });
        let hook = st.escalation_hook.clone();
        let gauge = st.quarantined;
        drop(st);
        tracing::debug!(
            pool = self.inner.id.0,
            peer = peer.0,
            slots = n,
            quarantine = id,
            "exposed lease aborted: slots quarantined until a proof arrives"
        );
        report_counter!("kvt_quarantined_slots_total", self.inner.id, n);
        #[cfg(feature = "metrics")]
        crate::metrics::facade::gauge("kvt_quarantined_slots", self.inner.id, gauge);
        let _ = gauge;
        if let Some(hook) = hook {
            hook();
        }
        Some(QuarantineId(id))
    }

    // ----- transitions used by the authority (crate-private) -----

    pub(crate) fn apply(&self, proof: &Settlement) -> DeliveryReport {
        self.apply_then(proof, |_| ()).0
    }

    /// Applies a proof and, under the same lock, tries to settle `lease`'s
    /// tenancies (one lock round trip for the common settle path).
    #[inline]
    pub(crate) fn apply_and_settle(&self, proof: &Settlement, lease: &[Tenancy]) -> bool {
        if let ProofScope::Tenancies(ts) = &proof.scope {
            if let Some(settled) = self.settle_exact(proof.kind, ts, lease) {
                return settled;
            }
        }
        self.apply_then(proof, |st| Self::settle_locked(st, lease)).1
    }

    /// The common case: a proof naming exactly a live exposed lease's own
    /// tenancies (`proven == lease`, checked in the same pass as the slots).
    /// Same outcome as applying the proof and settling, minus the general
    /// bookkeeping. `None` when the proof names other tenancies, or some
    /// slot is not plainly exposed or proven under that tenancy (then the
    /// general path decides).
    #[inline]
    fn settle_exact(&self, kind: SettlementKind, proven: &[Tenancy], lease: &[Tenancy]) -> Option<bool> {
        if proven.len() != lease.len() {
            return None;
        }
        let mut st = lock(&self.inner.state);
        let mut newly = 0u64;
        for (p, t) in proven.iter().zip(lease) {
            if p != t {
                return None;
            }
            let m = st.slots.get(t.slot.0 as usize)?;
            if m.generation != t.generation.0 {
                return None;
            }
            match m.state {
                EXPOSED => newly += 1,
                PROVEN => {}
                _ => return None,
            }
        }
        for t in lease {
            st.slots[t.slot.0 as usize].state = HELD;
        }

        if !st.waiters.is_empty() {
            for t in lease {
                st.waiters.remove(&t.slot.0);
            }
        }
        match kind {
            SettlementKind::Completed => st.counters.settled_completed += newly,
            SettlementKind::Revoked => st.counters.settled_revoked += newly,
            SettlementKind::Fenced => st.counters.settled_fenced += newly,
        }
        drop(st);
        match kind {
            SettlementKind::Completed => report_counter!("kvt_settled_completed_total", self.inner.id, newly),
            SettlementKind::Revoked => report_counter!("kvt_settled_revoked_total", self.inner.id, newly),
            SettlementKind::Fenced => report_counter!("kvt_settled_fenced_total", self.inner.id, newly),
        }
        Some(true)
    }

    fn apply_then<R>(&self, proof: &Settlement, then: impl FnOnce(&mut PoolState) -> R) -> (DeliveryReport, R) {
        // Read the clock only if a quarantined slot is reclaimed: it is the
        // one costly call on the settle path.
        let mut now: Option<Instant> = None;
        let clock = &self.inner.clock;
        let mut now = || *now.get_or_insert_with(|| clock.now());
        let mut st = lock(&self.inner.state);
        let mut report = DeliveryReport::default();
        let mut wake: SmallVec<[Waker; 2]> = SmallVec::new();
        let mut reclaimed: SmallVec<[std::time::Duration; 1]> = SmallVec::new();
        match &proof.scope {
            ProofScope::Tenancies(_) | ProofScope::Digested(_) => {
                let (ts, digests) = proof.scope.tenancies().unwrap_or_default();
                let digests = (!digests.is_empty()).then_some(digests);
                let key = proof.scope.digest_key().unwrap_or_default();
                for t in ts {
                    let Some(meta) = st.slots.get(t.slot.0 as usize).copied() else {
                        report.stale += 1;
                        continue;
                    };
                    if meta.generation != t.generation.0 {
                        report.stale += 1;
                        continue;
                    }
                    match meta.state {
                        EXPOSED => {
                            st.slots[t.slot.0 as usize].state = PROVEN;
                            if let Some((_, d)) = digests.and_then(|ds| ds.iter().find(|(dt, _)| dt == t)) {
                                st.digests.insert(t.slot.0, SlotDigest { generation: t.generation.0, tag: *d, key });
                            }
                            if !st.waiters.is_empty() {
                                if let Some(w) = st.waiters.remove(&t.slot.0) {
                                    wake.push(w);
                                }
                            }
                            report.settled += 1;
                        }
                        QUARANTINED => {
                            reclaimed.extend(Self::reclaim(&mut st, *t, meta.aux, now()));
                            report.settled += 1;
                            report.reclaimed += 1;
                        }
                        _ => report.stale += 1,
                    }
                }
            }
            ProofScope::Peer(peer, epoch) => {
                for i in 0..st.slots.len() {
                    let meta = st.slots[i];
                    if meta.state == EXPOSED && meta.aux == peer.0 && covers(*epoch, meta.epoch) {
                        st.slots[i].state = PROVEN;
                        if let Some(w) = st.waiters.remove(&(i as u32)) {
                            wake.push(w);
                        }
                        report.settled += 1;
                    }
                }
                for index in 0..st.quarantine.len() {
                    let ts: Tenancies = match &st.quarantine[index] {
                        Some(e) if e.peer == *peer && covers(*epoch, e.epoch) => e.remaining.clone(),
                        _ => continue,
                    };
                    for t in ts {
                        reclaimed.extend(Self::reclaim(&mut st, t, index as u32, now()));
                        report.settled += 1;
                        report.reclaimed += 1;
                    }
                }
            }
        }
        let n = report.settled as u64;
        match proof.kind {
            SettlementKind::Completed => st.counters.settled_completed += n,
            SettlementKind::Revoked => st.counters.settled_revoked += n,
            SettlementKind::Fenced => st.counters.settled_fenced += n,
        }
        st.counters.stale_rejected += report.stale as u64;
        let then = then(&mut st);
        let gauges = (st.quarantined, st.stuck);
        drop(st);
        for w in wake {
            w.wake();
        }
        #[cfg(feature = "metrics")]
        if !reclaimed.is_empty() || report.reclaimed > 0 {
            for d in &reclaimed {
                crate::metrics::facade::latency("kvt_abort_to_reclaim_seconds", self.inner.id, *d);
            }
            crate::metrics::facade::gauge("kvt_quarantined_slots", self.inner.id, gauges.0);
            crate::metrics::facade::gauge("kvt_quarantine_stuck_slots", self.inner.id, gauges.1);
        }
        let _ = (reclaimed, gauges);
        if report.stale > 0 {
            tracing::debug!(pool = self.inner.id.0, stale = report.stale, kind = ?proof.kind, "stale settlement dropped");
            report_counter!("kvt_stale_rejected_total", self.inner.id, report.stale);
        }
        match proof.kind {
            SettlementKind::Completed => report_counter!("kvt_settled_completed_total", self.inner.id, n),
            SettlementKind::Revoked => report_counter!("kvt_settled_revoked_total", self.inner.id, n),
            SettlementKind::Fenced => report_counter!("kvt_settled_fenced_total", self.inner.id, n),
        }
        (report, then)
    }

    /// Frees one quarantined slot on a proof; closes its entry when it was the last.
    /// Returns the abort-to-reclaim latency when the entry closed.
    fn reclaim(st: &mut PoolState, t: Tenancy, index: u32, now: Instant) -> Option<std::time::Duration> {
        st.push_free(t.slot.0);
        st.quarantined -= 1;
        st.counters.released += 1;
        let entry = st.quarantine.get_mut(index as usize).and_then(Option::as_mut)?;
        entry.remaining.retain(|r| *r != t);
        if entry.rung.is_stuck() {
            st.stuck -= 1;
        }
        if entry.remaining.is_empty() {
            let latency = now.saturating_duration_since(entry.since);
            st.counters.abort_to_reclaim.record(latency);
            st.quarantine[index as usize] = None;
            st.quarantine_vacant.push(index);
            tracing::debug!(latency_us = latency.as_micros() as u64, "quarantine cleared by proof");
            return Some(latency);
        }
        None
    }

    pub(crate) fn record_stale(&self, n: u64) {
        lock(&self.inner.state).counters.stale_rejected += n;
        report_counter!("kvt_stale_rejected_total", self.inner.id, n);
    }

    pub(crate) fn is_awaiting_settlement(&self, t: Tenancy) -> bool {
        let st = lock(&self.inner.state);
        st.slots
            .get(t.slot.0 as usize)
            .is_some_and(|m| m.generation == t.generation.0 && matches!(m.state, EXPOSED | PROVEN | QUARANTINED))
    }

    pub(crate) fn set_escalation_hook(&self, hook: Option<Arc<dyn Fn() + Send + Sync>>) {
        lock(&self.inner.state).escalation_hook = hook;
    }

    pub(crate) fn poll_escalations(&self) -> Vec<EscalationAction> {
        let now = self.inner.clock.now();
        let (ladder, caps) = (self.inner.ladder, self.inner.capabilities);
        let _span = tracing::trace_span!("kvt.escalate", pool = self.inner.id.0).entered();
        let mut st = lock(&self.inner.state);
        let mut actions = Vec::new();
        let mut newly_stuck = 0u64;
        for entry in st.quarantine.iter_mut().flatten() {
            let action = |step| EscalationAction {
                quarantine: QuarantineId(entry.id),
                peer: entry.peer,
                tenancies: entry.remaining.to_vec(),
                step,
            };
            // Several rungs may be due at once after a long pause; emit each.
            while let Rung::Climbing { step, at } = entry.rung {
                if at > now {
                    break;
                }
                actions.push(action(step));
                entry.rung = match step.next(caps) {
                    Some(next) => Rung::Climbing { step: next, at: at + step.budget(&ladder) },
                    None => {
                        newly_stuck += entry.remaining.len() as u64;
                        let every = ladder.drain.clamp(MIN_REDRAIN_INTERVAL, REDRAIN_MAX_INTERVAL);
                        Rung::Stuck { redrain_at: caps.drain.then(|| now + every), every }
                    }
                };
            }
            // A stuck entry asks once per due time, counted from now: a long
            // pause does not burst ABORTs.
            if let Rung::Stuck { redrain_at: Some(due), every } = entry.rung {
                if due <= now {
                    actions.push(action(EscalationStep::RequestDrain));
                    let every = (every * 2).min(REDRAIN_MAX_INTERVAL);
                    entry.rung = Rung::Stuck { redrain_at: Some(now + every), every };
                }
            }
        }
        st.stuck += newly_stuck;
        let stuck = st.stuck;
        drop(st);
        #[cfg(feature = "metrics")]
        crate::metrics::facade::gauge("kvt_quarantine_stuck_slots", self.inner.id, stuck);
        let _ = stuck;
        if newly_stuck > 0 {
            tracing::warn!(
                target: "kvt::quarantine_stuck",
                pool = self.inner.id.0,
                slots = newly_stuck,
                drain = caps.drain,
                revoke = caps.revoke,
                fence = caps.fence,
                "quarantine_stuck: no escalation step left that this backend can take; \
                 the slots stay quarantined until a proof arrives"
            );
        }
        actions
    }

    /// Time until the next escalation step falls due, by the pool's clock.
    pub(crate) fn next_escalation_in(&self) -> Option<std::time::Duration> {
        let at = self.next_escalation_at()?;
        Some(at.saturating_duration_since(self.inner.clock.now()))
    }

    pub(crate) fn record_forged(&self, n: u64) {
        lock(&self.inner.state).counters.forged_rejected += n;
        report_counter!("kvt_forged_rejected_total", self.inner.id, n);
    }

    fn forget_digests(st: &mut PoolState, tenancies: &[Tenancy]) {
        for t in tenancies {
            st.digests.remove(&t.slot.0);
        }
    }

    /// The lease's own bytes changed (a write through a settled lease, or it
    /// went back to `Reserved`): the digests said nothing about them any more.
    pub(crate) fn drop_digests(&self, tenancies: &[Tenancy]) {
        let mut st = lock(&self.inner.state);
        if !st.digests.is_empty() {
            Self::forget_digests(&mut st, tenancies);
        }
    }

    /// The epoch a fence minted now covers (exposures recorded at or before
    /// it); exposures from now on record the next one.
    pub(crate) fn next_fence_epoch(&self) -> u16 {
        let mut st = lock(&self.inner.state);
        let e = st.fence_epoch;
        st.fence_epoch = e.wrapping_add(1);
        e
    }

    /// The digest a DONE (or a READ's own completion) recorded for `t`, if any.
    pub(crate) fn digest_of(&self, t: Tenancy) -> Option<SlotDigest> {
        let st = lock(&self.inner.state);
        if st.digests.is_empty() {
            return None;
        }
        st.digests.get(&t.slot.0).filter(|d| d.generation == t.generation.0).copied()
    }

    /// Checks `bytes` (the whole slot of `t`, as they will be handed over)
    /// against `t`'s digest; a mismatch is counted and refused.
    pub(crate) fn check_digest(&self, t: Tenancy, expected: SlotDigest, bytes: &[u8]) -> bool {
        if crate::drain::digest(&expected.key, bytes).ct_eq(&expected.tag) {
            return true;
        }
        lock(&self.inner.state).counters.integrity_failures += 1;
        report_counter!("kvt_integrity_failures_total", self.inner.id, 1);
        tracing::warn!(
            pool = self.inner.id.0,
            slot = t.slot.0,
            "settled slot does not match the digest its DONE carried: bytes withheld"
        );
        false
    }

    pub(crate) fn next_escalation_at(&self) -> Option<Instant> {
        let st = lock(&self.inner.state);
        st.quarantine.iter().flatten().filter_map(|e| e.rung.due_at()).min()
    }
}

/// Whether a fence minted at `fence` covers an exposure recorded at
/// `exposed`: it was made at or before the mint (serial arithmetic, so the
/// 16-bit epoch wraps safely while fewer than 32,768 fences of a pool are
/// minted between an exposure and its proof).
fn covers(fence: u16, exposed: u16) -> bool {
    (fence.wrapping_sub(exposed) as i16) >= 0
}
