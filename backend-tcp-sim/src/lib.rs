//! # backend-tcp-sim
//!
//! An RDMA-like fabric over real loopback TCP sockets: the CI stand-in for
//! hardware, where every race of the kv-transfer contract is reproduced.
//!
//! - [`SimNic`]: one per endpoint. Registers regions ([`SimNic::register_pool`]
//!   builds the [`SlotPool`](kv_transfer_core::SlotPool) and keeps its
//!   settlement authority), assigns keys, listens on `127.0.0.1`, connects to
//!   peers with ordered connections (like RC queue pairs).
//! - One-sided WRITE and READ are posted as work requests (one per slot). The
//!   target NIC's own threads apply them into registered memory after checking
//!   key, length, bounds, and the generation bound to the slot for that peer
//!   ([`SimNic::expose`]); a rejected access fails the initiator's completion
//!   with a typed [`RejectReason`](kv_transfer_core::RejectReason), is counted
//!   ([`NicStats`]) and writes nothing. A completion is terminal only after the
//!   target applied the bytes.
//! - NOTIFY follows the data of an operation and settles the target's exposure
//!   (`Completed`). Escalation of aborted exposures runs in a driver thread:
//!   ABORT / ABORT_ACK (`Completed`), revocation of the binding (`Revoked`),
//!   fence of the connection (`Fenced`).
//! - [`SimNic`] implements core's [`Transfer`](kv_transfer_core::Transfer).
//! - For backends that build their own semantics on this fabric (MORI): raw
//!   one-sided accesses outside any lease ([`SimNic::write_raw`], or
//!   [`SimNic::write_raw_with`] with a completion callback run on the NIC's
//!   thread, or [`SimNic::write_raw_registered`] from the NIC's own
//!   registered memory to a [`RawCompletions`] queue: no copy, no callback
//!   to allocate), and application messages on the data connection
//!   ([`SimNic::send_message`], like SEND/RECV on a queue pair), in order with
//!   the data; a burst of small messages leaves as one frame.
//! - A receiving thread wakes the senders it queued work for once per burst
//!   of frames, not once per frame (a condvar wake-up is a syscall).
//! - Faults are seeded and reproducible ([`FaultPlan`], [`Gate`]).
//! - [`ReleasePolicy::Naive`] exists **only** as the race tests' positive
//!   control: it frees aborted slots at once without a proof.
//! - [`wire`] is the pure frame codec (`kvt bench` measures this backend).
//!
//! See [`SimNic`] for a runnable end-to-end example.
//!
//! ## Which proof comes from where
//!
//! | event at the NIC | proof delivered |
//! | --- | --- |
//! | initiator: every WR of an operation reached a terminal completion (target applied or rejected it) | `Completed` for the local lease (via the operation's `Completer`) |
//! | target: NOTIFY from the peer the slots are exposed to (sent only after all its WRs succeeded) | binding cleared, then `Completed` |
//! | target: ABORT_ACK after the escalation's ABORT (the peer waited for its WRs on those tenancies to be terminal) | binding cleared, then `Completed` |
//! | target: escalation `Revoke`, or [`SimNic::revoke`] | binding cleared and in-flight applies drained (bounded by `revoke_wait`), then `Revoked` |
//! | connection lost, malformed frame, escalation `Fence`, or [`SimNic::fence`] | socket shut, both threads joined, then `Fenced(peer)` to every pool; in-flight operations fail with `Transport` |
//!
//! A [`PeerId`](kv_transfer_core::PeerId) names one connection and is never
//! reused; a slot's binding names the connection it is exposed to, so a fence
//! of that connection really ends every access to it.
#![deny(missing_docs)]

mod fault;
mod nic;
mod stats;
pub mod wire;

pub use fault::{splitmix64, DelayDist, DropSpec, FaultPlan, Gate};
pub use nic::{
    ExposeError, ExposeErrorKind, FaultRecord, InboundEvent, ListenerLimits, MessageHook, NicConfig, NicError,
    PeerInfo, RawAccess, RawCallback, RawCompletions, RawHandle, ReleasePolicy, SimNic, CAPABILITIES,
};
pub use stats::NicStats;

/// Runs a future to completion on the current thread (re-exported from core,
/// where the one implementation lives).
pub use kv_transfer_core::block_on;
