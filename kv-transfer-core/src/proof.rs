//! Settlement proofs and the authority that mints them.
//!
//! A proof says no NIC can touch some slots any more for some tenancy. There
//! are exactly three (DESIGN.md): `Completed`, `Revoked`, `Fenced`. Their
//! fields are private and they have no public constructor: only a pool's
//! [`SettlementAuthority`], which the backend keeps, can make one, and each
//! carries its pool's id so it cannot settle another pool's slots.

use crate::drain::{Digest, ExposureToken};
use crate::escalation::EscalationAction;
use crate::ids::{PeerId, PoolId, Tenancy};
use crate::lease::{Exposed, Reserved, SlotLease, Tenancies};
use crate::pool::{DeliveryReport, SlotPool};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ProofScope {
    Tenancies(Tenancies),
    /// Tenancies with a digest of each one's bytes (a DONE that carried
    /// them): boxed, so the common proof stays as small as it was.
    Digested(Box<Digested>),
    /// Every exposure to a peer that existed when the proof was minted (the
    /// pool's fence epoch then; see [`SlotPool::fence_epoch`]).
    Peer(PeerId, u16),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Digested {
    pub(crate) tenancies: Tenancies,
    pub(crate) digests: Vec<(Tenancy, Digest)>,
    /// The exposure token the digests are keyed by.
    pub(crate) key: ExposureToken,
}

/// A tenancy and the digest of its bytes.
pub(crate) type TenancyDigest = (Tenancy, Digest);

impl ProofScope {
    /// The tenancies a tenancy-scoped proof names, and their digests if any
    /// (`None` for a peer-wide proof).
    pub(crate) fn tenancies(&self) -> Option<(&[Tenancy], &[TenancyDigest])> {
        match self {
            Self::Tenancies(ts) => Some((ts, &[])),
            Self::Digested(d) => Some((&d.tenancies, &d.digests)),
            Self::Peer(..) => None,
        }
    }

    /// The token a digested proof's digests are keyed by.
    pub(crate) fn digest_key(&self) -> Option<ExposureToken> {
        match self {
            Self::Digested(d) => Some(d.key),
            _ => None,
        }
    }
}

/// Which of the three proofs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SettlementKind {
    /// Every operation that touched the slots reached a terminal status.
    Completed,
    /// The access key for the tenancy was invalidated and the backend
    /// confirmed no later access can land.
    Revoked,
    /// The connection to the peer is torn down and nothing more can arrive.
    Fenced,
}

/// Any of the three proofs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settlement {
    pub(crate) pool: PoolId,
    pub(crate) kind: SettlementKind,
    pub(crate) scope: ProofScope,
}

impl Settlement {
    /// Which proof this is.
    pub fn kind(&self) -> SettlementKind {
        self.kind
    }
    /// The pool it was minted for.
    pub fn pool(&self) -> PoolId {
        self.pool
    }
}

macro_rules! proof_type {
    ($(#[$doc:meta])* $name:ident, $kind:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $name(Settlement);

        impl From<$name> for Settlement {
            fn from(p: $name) -> Settlement {
                p.0
            }
        }

        impl $name {
            /// The pool it was minted for.
            pub fn pool(&self) -> PoolId {
                self.0.pool
            }
        }
    };
}

proof_type!(
    /// Proof that every operation on some tenancies reached a terminal status
    /// (observed locally, or acknowledged by the remote initiator after it
    /// observed terminal status for all its operations on them).
    Completed,
    Completed
);
proof_type!(
    /// Proof that the access key for some tenancies was invalidated and the
    /// backend confirmed no later access can land.
    Revoked,
    Revoked
);
proof_type!(
    /// Proof that the connection to one peer is torn down and nothing more
    /// from it can arrive. Settles every exposure to that peer.
    Fenced,
    Fenced
);

/// The backend's capability to settle a pool's slots. Returned once by
/// [`SlotPool::new`]; clones share it.
///
/// ```
/// use kv_transfer_core::{HostRegion, PoolConfig, SlotPool, PeerId};
/// use std::sync::Arc;
///
/// let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(4 * 64).unwrap()), PoolConfig::new(64)).unwrap();
/// let lease = pool.reserve(2).unwrap();
/// let (exposed, remote) = authority.expose(lease, PeerId(7), 0xfeed, "127.0.0.1:9000", Default::default());
/// assert_eq!(remote.slots.len(), 2);
/// // ... the peer writes, then acknowledges both tenancies ...
/// authority.deliver(authority.completed(&remote.tenancies()));
/// let settled = exposed.try_settled().expect("both slots proven");
/// assert_eq!(settled.bytes().unwrap().len(), 128);
/// settled.release();
/// assert_eq!(pool.metrics().free, 4);
/// ```
#[derive(Clone, Debug)]
pub struct SettlementAuthority {
    pub(crate) pool: SlotPool,
}

impl SettlementAuthority {
    /// The pool this authority settles.
    pub fn pool(&self) -> &SlotPool {
        &self.pool
    }

    #[inline]
    fn mint(&self, kind: SettlementKind, scope: ProofScope) -> Settlement {
        Settlement { pool: self.pool.id(), kind, scope }
    }

    /// A `Completed` proof for these tenancies. Mint it only when every
    /// operation touching them reached a terminal status.
    #[inline]
    pub fn completed(&self, tenancies: &[Tenancy]) -> Completed {
        Completed(self.mint(SettlementKind::Completed, ProofScope::Tenancies(Tenancies::from_slice(tenancies))))
    }
    /// A `Completed` proof for these tenancies whose DONE carried a digest
    /// of each one's bytes: the pool keeps them with the settled tenancies,
    /// and reading a settled lease checks its bytes against them.
    /// `key` is the token the digests were taken under ([`crate::drain::digest`]).
    pub fn completed_with_digests(
        &self,
        tenancies: &[Tenancy],
        digests: &[(Tenancy, Digest)],
        key: ExposureToken,
    ) -> Completed {
        let d = Digested { tenancies: Tenancies::from_slice(tenancies), digests: digests.to_vec(), key };
        Completed(self.mint(SettlementKind::Completed, ProofScope::Digested(Box::new(d))))
    }
    /// A `Completed` proof covering an exposed lease's slots.
    #[inline]
    pub fn completed_lease(&self, lease: &SlotLease<Exposed>) -> Completed {
        self.completed(lease.tenancies())
    }
    /// A `Revoked` proof. Mint it only once the access key for these
    /// tenancies is invalid and no access can land any more.
    pub fn revoked(&self, tenancies: &[Tenancy]) -> Revoked {
        Revoked(self.mint(SettlementKind::Revoked, ProofScope::Tenancies(Tenancies::from_slice(tenancies))))
    }
    /// A `Fenced` proof for everything exposed to `peer` *so far*. Deliver
    /// it only once the connection is torn down and its receiving side joined
    /// or flushed; mint it before the teardown starts. What it covers is
    /// fixed now: an exposure to the same peer made after this call is not
    /// settled by it, however late it is delivered (rule 8).
    pub fn fenced(&self, peer: PeerId) -> Fenced {
        let epoch = self.pool.next_fence_epoch();
        Fenced(self.mint(SettlementKind::Fenced, ProofScope::Peer(peer, epoch)))
    }

    /// Applies a proof: live exposures it covers become settleable (their
    /// `settled()` futures wake), quarantined slots it covers return to the
    /// free list. Tenancies it names that are not awaiting settlement (stale
    /// generation, already settled) are dropped and counted (rule 5).
    /// A proof minted by another pool's authority does nothing and is
    /// reported as entirely stale.
    pub fn deliver(&self, proof: impl Into<Settlement>) -> DeliveryReport {
        let proof = proof.into();
        if proof.pool != self.pool.id() {
            let stale = proof.scope.tenancies().map_or(1, |(t, _)| t.len());
            self.pool.record_stale(stale as u64);
            return DeliveryReport { stale, ..DeliveryReport::default() };
        }
        self.pool.apply(&proof)
    }

    /// Whether a notification or ack naming `t` concerns a tenancy that still
    /// waits for settlement. If not, it is counted as stale and `false` is
    /// returned: drop the message.
    pub fn accept(&self, t: Tenancy) -> bool {
        let ok = self.pool.is_awaiting_settlement(t);
        if !ok {
            self.pool.record_stale(1);
        }
        ok
    }

    /// Counts stale accesses the backend rejected by itself (for example at
    /// the NIC, where the generation bound to a key no longer matches).
    pub fn record_stale(&self, n: u64) {
        self.pool.record_stale(n)
    }

    /// Counts DONE / ABORT_ACK tenancies dropped as forged (wrong peer or
    /// token): `forged_rejected` in the pool's metrics.
    pub fn record_forged(&self, n: u64) {
        self.pool.record_forged(n)
    }

    /// Escalation steps that are due now, by the pool's own clock (so a pool
    /// built with a [`ManualClock`](crate::ManualClock) escalates only when
    /// the test advances it). Never frees anything: each action asks the
    /// backend for a proof. The ladder holds only the steps the pool's
    /// [`Capabilities`](crate::drain::Capabilities) allow.
    pub fn poll_escalations(&self) -> Vec<EscalationAction> {
        self.pool.poll_escalations()
    }

    /// When the next escalation step falls due, if any (on the pool's clock).
    pub fn next_escalation_at(&self) -> Option<Instant> {
        self.pool.next_escalation_at()
    }

    /// How long until the next escalation step falls due, by the pool's
    /// clock: what a driver sleeps at most.
    pub fn next_escalation_in(&self) -> Option<std::time::Duration> {
        self.pool.next_escalation_in()
    }

    /// The capabilities the pool's ladder was built from.
    pub fn capabilities(&self) -> crate::drain::Capabilities {
        self.pool.inner.capabilities
    }

    /// Exposes a reserved lease to `peer` and describes it: the backend's
    /// access `key` for this tenancy, its `endpoint` (how the peer reaches
    /// this side) and the exposure's `token` (from its
    /// [`ExposureTable`](crate::drain::ExposureTable)). From here on the slots
    /// leave the lease only with a proof. Only the backend, which holds the
    /// authority, can expose: an application goes through its
    /// [`Target::expose`](crate::Target::expose).
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
        key: u64,
        endpoint: impl Into<String>,
        token: crate::drain::ExposureToken,
    ) -> (SlotLease<Exposed>, crate::RemoteSlots) {
        lease.expose(peer, key, endpoint, token)
    }

    /// Exposes a reserved lease as the local side of an operation posted to
    /// `peer` (a backend does this when the lease moves into a transfer).
    #[inline]
    pub fn expose_local(&self, lease: SlotLease<Reserved>, peer: PeerId) -> SlotLease<Exposed> {
        lease.expose_local(peer)
    }

    /// Called (outside the pool's lock) whenever slots enter quarantine, so a
    /// backend's driver can wake and poll escalations.
    ///
    /// The hook runs on whichever thread dropped or aborted the lease, which
    /// may be inside the backend's own code (a `Completer` dropped while the
    /// backend holds a lock). It must not block or take locks the backend
    /// may hold: set a flag, notify a condvar, unpark a thread.
    pub fn on_quarantine(&self, hook: impl Fn() + Send + Sync + 'static) {
        self.pool.set_escalation_hook(Some(Arc::new(hook)))
    }
}
