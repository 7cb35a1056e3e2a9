//! The escalation ladder for quarantined slots.
//!
//! A deadline never frees a slot (DESIGN rule 2). When an exposed lease is
//! aborted or dropped its slots enter quarantine, and the ladder says what the
//! backend should try next, and when: ask the peer to drain and ack, then
//! revoke the access key, then fence the connection. Each step can only
//! produce a proof; the slot leaves quarantine only when one arrives. At the
//! end of the ladder the slot stays quarantined and is counted as stuck.

use crate::drain::Capabilities;
use crate::ids::{PeerId, Tenancy};
use std::time::Duration;

/// Deadlines between the steps of the ladder, measured from the abort.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EscalationLadder {
    /// How long the peer has to drain and acknowledge (ABORT / ABORT_ACK)
    /// before the backend is asked to revoke.
    pub drain: Duration,
    /// How long revocation may take before the backend is asked to fence.
    pub revoke: Duration,
    /// How long the fence may take before the slots are reported stuck.
    pub fence: Duration,
}

impl Default for EscalationLadder {
    /// 2 s to drain, 1 s to revoke, 5 s to fence: generous next to an RDMA
    /// write of a few MiB, short next to a request's lifetime.
    fn default() -> Self {
        Self { drain: Duration::from_secs(2), revoke: Duration::from_secs(1), fence: Duration::from_secs(5) }
    }
}

/// The longest wait between two re-sent ABORTs of a stuck exposure.
///
/// Once the ladder is exhausted, a backend that can drain is asked to send
/// the ABORT again, first after the drain deadline, the interval doubling up
/// to this: a peer cut off when the ABORT (or its ack) was lost answers once
/// its link is back, and that ack is a proof. Asking again frees nothing.
pub const REDRAIN_MAX_INTERVAL: Duration = Duration::from_secs(30);
/// The shortest interval between re-sent ABORTs: a ladder with a very short
/// drain deadline (a race's, a few hundred µs) must not flood a slow peer.
pub(crate) const MIN_REDRAIN_INTERVAL: Duration = Duration::from_millis(100);

/// One rung of the ladder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EscalationStep {
    /// Ask the peer (or the local operation) to stop and drain, then ack.
    RequestDrain,
    /// Invalidate the access key for these tenancies and confirm.
    Revoke,
    /// Tear down the connection to the peer and confirm nothing more arrives.
    Fence,
    /// Nothing left to try: the slots stay quarantined and are reported.
    Exhausted,
}

impl EscalationStep {
    /// Whether a backend with `caps` can take this step (`Exhausted` always).
    pub fn available(self, caps: Capabilities) -> bool {
        match self {
            Self::RequestDrain => caps.drain,
            Self::Revoke => caps.revoke,
            Self::Fence => caps.fence,
            Self::Exhausted => true,
        }
    }

    /// The first step of a ladder for `caps` (`Exhausted` when none is available).
    pub(crate) fn first(caps: Capabilities) -> Self {
        Self::RequestDrain.or_next(caps)
    }

    /// This step if available, else the next available one.
    fn or_next(self, caps: Capabilities) -> Self {
        let mut s = self;
        while !s.available(caps) {
            s = s.successor();
        }
        s
    }

    fn successor(self) -> Self {
        match self {
            Self::RequestDrain => Self::Revoke,
            Self::Revoke => Self::Fence,
            Self::Fence | Self::Exhausted => Self::Exhausted,
        }
    }

    /// The next available step after this one (`None` after `Exhausted`).
    pub(crate) fn next(self, caps: Capabilities) -> Option<Self> {
        match self {
            Self::Exhausted => None,
            s => Some(s.successor().or_next(caps)),
        }
    }

    /// How long this step has before the ladder moves on.
    pub(crate) fn budget(self, ladder: &EscalationLadder) -> Duration {
        match self {
            Self::RequestDrain => ladder.drain,
            Self::Revoke => ladder.revoke,
            Self::Fence => ladder.fence,
            Self::Exhausted => Duration::ZERO,
        }
    }
}

/// Identity of one quarantine entry (one aborted or dropped exposed lease).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuarantineId(pub(crate) u64);

/// Something the backend should do now for a quarantined exposure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EscalationAction {
    /// The entry this concerns.
    pub quarantine: QuarantineId,
    /// The peer the slots were exposed to.
    pub peer: PeerId,
    /// Tenancies still waiting for a proof.
    pub tenancies: Vec<Tenancy>,
    /// What to do.
    pub step: EscalationStep,
}
