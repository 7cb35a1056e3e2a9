//! The one drain protocol every backend shares, sans-IO.
//!
//! What happens to an exposure after an abort is the same for every
//! backend, so it is written once, here, and each backend drives it with
//! the bytes it receives and executes what it returns:
//!
//! - [`ControlMessage`]: the codec of DONE / ABORT / ABORT_ACK (binary, or
//!   armored as text for string notifications), bounded and versioned, with
//!   a typed [`DecodeError`] for every malformed input.
//! - [`ExposureTable`] (target side): which tenancies are exposed to which
//!   peer under which [`ExposureToken`] and [`Trust`]; [`accept`](ExposureTable::accept)
//!   says what a DONE or ABORT_ACK settles, [`plan`](ExposureTable::plan)
//!   what to do at each escalation step.
//! - [`AbortTracker`] (initiator side): which posted operations touch which
//!   remote tenancies; an ABORT is answered once they are all terminal, and
//!   never for one that ended [`OpEnd::Unproven`].
//! - [`RetryShadows`] (target side, for peers that retry after a
//!   revocation, as a real Mooncake initiator over RDMA does): a slot whose
//!   tenancy was revoked while exposed to a peer is not exposed to that peer
//!   again until its own ack or a fence covers its retries.
//! - [`Driver`]: the table, the pools' authorities and the escalation in
//!   one sans-IO state machine per backend, with its timer contract: the
//!   backend feeds it messages, executes its [`Action`]s and sleeps until
//!   its [`next_deadline`](Driver::next_deadline).
//! - [`Capabilities`]: what a backend can prove. The pool's escalation
//!   ladder is built from them ([`PoolConfig::with_capabilities`](crate::PoolConfig::with_capabilities)):
//!   a step the backend cannot take is skipped, and a slot with no step
//!   left is reported stuck, never handed to a backend that can only log.
//!
//! ```text
//!  target (decode)                                  initiator (prefill)
//!  ExposureTable::expose ── RemoteSlots{token} ──►  AbortTracker::admit, post
//!                         ◄── DONE{token} ──────── (after its completions)
//!  accept → Verdict::deliver (Completed)
//!  lease aborted → quarantine → poll_escalations → plan:
//!    SendAbort ────────────── ABORT{token} ──────►  on_abort: tombstone; wait
//!                         ◄── ABORT_ACK{token} ──── finished(op) → ack due
//!    Revoke  (if capable) → revoked → Revoked
//!    Fence   (if capable) → fenced  → Fenced(peer)
//!    Stuck   (ladder exhausted; a late proof still frees the slots)
//! ```

mod aborts;
mod codec;
mod driver;
mod exposures;
mod outbox;
mod shadows;

pub use aborts::{AbortTracker, OpEnd, Outgoing, Refusal, TrackerStats, DEFAULT_MAX_PEERS};
pub use codec::{
    digest, ControlKind, ControlMessage, DecodeError, Digest, EncodeError, ExposureToken, DIGEST_LEN, HEADER_LEN,
    MAGIC, MAX_LEN, MAX_TENANCIES, TEXT_PREFIX, VERSION,
};
pub use driver::{Action, Delivery, DrainCounters, DrainSnapshot, Driver, Due, FenceProofs, Steps};
pub use exposures::{ExposureTable, Plan, Trust, Verdict};
pub use outbox::{Outbox, MAX_SEND_ATTEMPTS};
pub use shadows::{RetryShadows, Shadowed};

/// The digest of each slot of a lease under the remote exposure's `token`,
/// in lease order: the digests a DONE carries ([`ControlMessage::digests`]).
/// A backend calls it on its own exposed local lease once its WRITE
/// completed (nothing can have changed the bytes meanwhile: the lease is
/// exposed to that operation).
pub fn lease_digests<S: crate::LeaseState>(
    lease: &crate::SlotLease<S>,
    token: &ExposureToken,
) -> Result<Vec<Digest>, crate::AccessError> {
    let mut buf = vec![0u8; lease.pool().slot_size()];
    (0..lease.len())
        .map(|i| {
            lease.read_local_for_backend(i, &mut buf)?;
            Ok(digest(token, &buf))
        })
        .collect()
}

/// What a backend can prove about an aborted exposure, beyond an operation's
/// own completion. The escalation ladder holds only these steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Capabilities {
    /// Ask the peer to drain and acknowledge (ABORT / ABORT_ACK).
    pub drain: bool,
    /// Invalidate one tenancy's access and confirm no later access lands.
    pub revoke: bool,
    /// Tear the connection to a peer down and confirm nothing more arrives.
    pub fence: bool,
}

impl Capabilities {
    /// Drain, revoke and fence.
    pub const ALL: Capabilities = Capabilities { drain: true, revoke: true, fence: true };
    /// Drain and acknowledge only (no per-tenancy key, no confirmed fence).
    pub const DRAIN_ONLY: Capabilities = Capabilities { drain: true, revoke: false, fence: false };
}

/// How a backend releases quarantined slots. There is one policy that
/// moves data, [`ReleasePolicy::Safe`]; the other exists only as the race
/// tests' positive control, behind the feature `naive-positive-control`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum ReleasePolicy {
    /// The contract: a slot leaves quarantine only with a proof.
    #[default]
    Safe,
    /// **POSITIVE CONTROL FOR RACE TESTS ONLY. NEVER USE IT TO MOVE DATA.**
    ///
    /// Behaves like the engines before their fixes: the moment an exposed
    /// lease is aborted the backend mints a `Completed` proof it has no
    /// evidence for, so the slots go straight back to the free list while a
    /// peer's write may still land in them (and backends with a per-tenancy
    /// check at the NIC skip it). Tests run it to show they can observe the
    /// corruption the safe policy prevents.
    #[cfg(feature = "naive-positive-control")]
    #[cfg_attr(docsrs, doc(cfg(feature = "naive-positive-control")))]
    Naive,
}

impl ReleasePolicy {
    /// Whether this is the positive control (always false without the feature).
    pub fn is_naive(self) -> bool {
        #[cfg(feature = "naive-positive-control")]
        if self == ReleasePolicy::Naive {
            return true;
        }
        false
    }
}
