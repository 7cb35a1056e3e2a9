//! Per-NIC counters.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

kv_transfer_core::backend_counters! {
    /// A snapshot of a NIC's counters ([`SimNic::stats`](crate::SimNic::stats)).
    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[non_exhaustive]
    pub struct NicStats;
    /// WRITEs applied into registered memory (target side).
    writes_applied,
    /// Bytes applied by those WRITEs.
    bytes_applied,
    /// READs served (target side).
    reads_served,
    /// Bytes served by those READs.
    bytes_read,
    /// Accesses rejected: out of bounds (or outside the named slot).
    rejected_out_of_bounds,
    /// Accesses rejected: unknown key.
    rejected_unknown_key,
    /// Accesses rejected: generation not the one bound to the slot (or revoked).
    rejected_stale_generation,
    /// Accesses rejected: arrived on a connection the slot is not exposed to.
    rejected_wrong_peer,
    /// Accesses rejected: zero length.
    rejected_zero_length,
    /// Accesses rejected: longer than the NIC's `max_wr_bytes`.
    rejected_oversize,
    /// Frames that did not decode (the connection is then torn down).
    malformed_frames,
    /// Work requests posted by this NIC (initiator side).
    wrs_posted,
    /// Work requests that completed successfully.
    wrs_ok,
    /// Work requests that completed with an error.
    wrs_failed,
    /// Work requests canceled before they were sent.
    wrs_canceled,
    /// NOTIFY frames sent.
    notifications_sent,
    /// Application messages sent ([`SimNic::send_message`](crate::SimNic::send_message)).
    messages_sent,
    /// Application messages received.
    messages_received,
    /// ABORT frames received.
    aborts_received,
    /// ABORT_ACK frames sent.
    abort_acks_sent,
    /// Revocations that could not drain in time (escalated further).
    revocations_timed_out,
    /// Connections opened by this NIC.
    connections_opened,
    /// Connections accepted by this NIC.
    connections_accepted,
    /// Accepted connections closed at once: handshakes at their cap.
    handshakes_refused_busy,
    /// Handshakes in flight closed to make room at the total for a newer
    /// connection (`ListenerLimits::evict_oldest`).
    handshakes_evicted,
    /// Accepted connections closed at once: their address's handshakes at its cap.
    handshakes_refused_per_address,
    /// Accepted connections closed at once: their address's established
    /// connections at its cap.
    connections_refused_per_address,
    /// WRITE completions that arrived before the WR's bytes had all left
    /// (parked until they had: a source slot settles only once our NIC is
    /// done reading it).
    early_completions,
    /// Connections torn down because a hook or callback panicked on their
    /// receiving thread (the connection is fenced, never left half alive).
    hook_panics,
    ; drain:
    /// NOTIFY frames received.
    notifications_received = |d| d.dones_received,
    /// Tenancies in received NOTIFY / ABORT_ACK frames that were not (or no
    /// longer) bound here, forged, or from a peer that proves nothing.
    notifications_stale = |d| d.stale + d.forged + d.untrusted,
    /// ABORT frames sent (escalation: request drain).
    aborts_sent = |d| d.aborts_sent,
    /// ABORT_ACK frames received.
    abort_acks_received = |d| d.abort_acks_received,
    /// Tenancies revoked (binding cleared, in-flight applies drained).
    revocations = |d| d.revoked,
    /// Connections fenced (torn down and joined).
    fences = |d| d.fences,
    /// Naive policy only: Completed proofs minted without evidence on quarantine.
    naive_releases = |d| d.naive_releases,
    /// DONE / ABORT_ACK tenancies dropped as forged: from a connection they
    /// were not exposed to, or without the exposure's token.
    forged = |d| d.forged,
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}
