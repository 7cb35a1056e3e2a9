//! The transport trait under the engine.
//!
//! A [`MoriTransport`] is the NIC: it registers memory, posts one-sided reads
//! and writes between registered regions of two engines, carries small
//! notification messages to a remote engine, and reports completions and
//! inbound notifications when polled. It knows nothing of transfer ids, batch
//! statuses or sessions; the engine ([`crate::MoriEngine`]) builds those on top.
//!
//! # Contract
//!
//! - `post` either refuses the request at once (`Err`; the request was not
//!   posted and will produce no completion) or accepts it (`Ok`); every
//!   accepted request produces **exactly one** [`Completion`] with its `wr_id`,
//!   reported by a later `poll`, and it touches memory only before that
//!   completion is reported. An error completion is terminal too: the
//!   operation no longer touches memory.
//! - A notification is delivered at most once. The engine sends it only after
//!   it saw the completions of every operation of the transfer, so the data of
//!   a successful write has landed before the target can see the notification.
//!   A transport that [carries notifications](MoriTransport::carries_notifications)
//!   takes a one-segment WRITE's success notification with the data instead,
//!   and delivers it once the bytes landed, never for a refused write; the
//!   engine then sends only a failure, under the same sequence number (the
//!   target's window drops whichever copy comes second).
//! - `deregister_memory` refuses ([`TransportError::Busy`]) while an accepted
//!   operation that touches the region (as local or, where the transport can
//!   tell, as remote memory) has not completed.
//! - Methods are called from several threads; `poll` from the engine's
//!   progress thread only. No method may call back into the engine (the
//!   event sink aside, below), and `notify` and `post` should not block for
//!   long (the engine calls `notify` under its lock so that sequence numbers
//!   leave in order).
//! - Push delivery is optional: a transport that accepts an [`EventSink`]
//!   ([`MoriTransport::set_event_sink`]) hands completions, notifications and
//!   messages to it from its own threads (a completion channel's thread, a
//!   receive loop), never while holding a lock that its methods take, and
//!   `poll` then reports only the rest. The engine's sink may call `post`,
//!   `notify` and `send_message` from inside; it never calls `fence`.
//! - `fence` is optional (the default refuses with
//!   [`TransportError::Unsupported`]; real MORI has no such call). A transport
//!   that implements it tears the connection to the peer down and returns only
//!   once no operation between the two engines can touch memory any more, in
//!   either direction; every accepted operation towards the peer still gets
//!   its completion (a flush error if it had not run). A later `connect`
//!   re-establishes the connection.
//!
//! # Plugging in a transport
//!
//! The loopback ([`crate::loopback`]) is the in-process reference. A TCP
//! simulator transport maps `register_memory` to a region registration of the
//! simulated NIC (its region key becomes the descriptor's `rkey`), `post` to a
//! posted work request on the connection to `wr.remote.engine_key`, completion
//! queue entries to [`TransportEvent::Completion`], and carries notifications as
//! a message on the same connection (after the data, so ordering holds even
//! without the engine's wait). `attach` returns what a peer needs to connect
//! (its listen address), published in [`crate::EngineDesc::transport_info`];
//! `connect` is given the peer's descriptor. A verbs transport does the same
//! with memory regions, RC queue pairs and SEND/RECV for notifications.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::TransportError;
use crate::status::StatusCode;
use crate::types::{EngineDesc, EngineKey, MemoryDesc, MemoryId, MemoryRegion, Tag, TransferUniqueId};

/// Direction of a one-sided operation, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OpKind {
    /// Copy local bytes into the remote region.
    Write,
    /// Copy remote bytes into the local region.
    Read,
}

/// One posted one-sided operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Identifies the completion; chosen by the engine, unique among posted requests.
    pub wr_id: u64,
    /// Write or read.
    pub op: OpKind,
    /// Local region (registered with this transport).
    pub local: MemoryDesc,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Remote region (registered with the remote engine's transport).
    pub remote: MemoryDesc,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
    /// The transfer's tag (see [`Tag`]): a transport that checks access per
    /// slot and generation names the remote slot with it.
    pub tag: Tag,
    /// A notification to deliver with the data (only to a transport that
    /// [carries notifications](MoriTransport::carries_notifications), only on
    /// a WRITE): the target receives it once the bytes landed, and only
    /// then; a refused write delivers nothing (the engine then sends the
    /// failure itself, with the same sequence number).
    pub notification: Option<Notification>,
}

/// The terminal completion of one posted operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// `Ok` if the bytes moved, the error otherwise.
    pub result: Result<(), TransportError>,
}

/// The message an initiating engine sends to the target engine when a
/// transfer reached a terminal status, success **or failure**.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notification {
    /// Sequence number per (initiator, target) pair; wraps (`u32`).
    pub seq: u32,
    /// Initiator's transfer id.
    pub uid: TransferUniqueId,
    /// Raw MORI status code (decoded with [`StatusCode::from_raw`], so an
    /// unknown value stays an error).
    pub code: u32,
    /// Initiator's message.
    pub message: String,
    /// Caller's tag.
    pub tag: Tag,
}

impl Notification {
    /// The decoded status code.
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_raw(self.code)
    }
}

/// What `poll` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// A posted operation reached its terminal completion.
    Completion(Completion),
    /// A notification from a remote engine arrived.
    Notification {
        /// The sending engine.
        from: EngineKey,
        /// The message.
        notification: Notification,
    },
    /// The connection to a peer was lost and the transport confirms, as
    /// for a completed [`MoriTransport::fence`], that nothing between the
    /// two engines can touch memory any more (the receiving side is joined,
    /// or the queue pair is in error and flushed). Not in MORI.
    PeerLost {
        /// The peer.
        peer: EngineKey,
    },
    /// A control message from a remote engine arrived (not in MORI; see
    /// [`MoriTransport::send_message`]).
    Message {
        /// The sending engine.
        from: EngineKey,
        /// The bytes, uninterpreted.
        bytes: Vec<u8>,
    },
}

/// Where a push-capable transport delivers events
/// ([`MoriTransport::set_event_sink`]).
pub type EventSink = std::sync::Arc<dyn Fn(TransportEvent) + Send + Sync>;

/// The transport under an engine; see the [module docs](self) for the contract.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait MoriTransport: Send + Sync {
    /// Transport name for descriptors and logs (`"loopback"`, `"tcp-sim"`, `"rdma"`).
    fn name(&self) -> String;

    /// Binds the transport to its engine; called once by the engine's
    /// constructor. Returns the bytes a peer needs to reach this engine
    /// (published in [`EngineDesc::transport_info`]).
    fn attach(&self, local: &EngineKey) -> Result<Vec<u8>, TransportError>;

    /// Makes `remote` reachable (connect a queue pair, open a socket).
    fn connect(&self, remote: &EngineDesc) -> Result<(), TransportError>;

    /// Forgets `remote`. The engine calls it only when no transfer with that
    /// peer is pending.
    fn disconnect(&self, remote: &EngineKey) -> Result<(), TransportError>;

    /// Registers a region under the engine-chosen `id`; returns its access key.
    fn register_memory(&self, id: MemoryId, region: &MemoryRegion) -> Result<u64, TransportError>;

    /// Deregisters region `id`. Refuses with [`TransportError::Busy`] while
    /// accepted operations on it have not completed.
    fn deregister_memory(&self, id: MemoryId) -> Result<(), TransportError>;

    /// Posts one operation; see the module docs for the completion guarantee.
    fn post(&self, wr: WorkRequest) -> Result<(), TransportError>;

    /// Sends a notification to `to`.
    fn notify(&self, to: &EngineKey, notification: Notification) -> Result<(), TransportError>;

    /// Returns up to `max` events, waiting at most `timeout` for the first one.
    fn poll(&self, max: usize, timeout: Duration) -> Vec<TransportEvent>;

    /// Whether `post` delivers a WRITE's [`WorkRequest::notification`] to the
    /// target behind its data, once the bytes landed and only then (a
    /// simulated WRITE_WITH_IMM; on verbs, a SEND posted right behind the
    /// WRITE on the same RC queue pair, which a failed WRITE never lets
    /// through). The default does not: the engine then sends every
    /// notification itself, after the transfer's completion.
    fn carries_notifications(&self) -> bool {
        false
    }

    /// Asks for push delivery: from now on, completions, notifications and
    /// messages go to `sink` as they happen (`None`: back to `poll`). Returns
    /// whether the transport does this; the default does not, and every
    /// event then comes from `poll`.
    fn set_event_sink(&self, sink: Option<EventSink>) -> bool {
        let _ = sink;
        false
    }

    /// Tears down the connection to `remote` and returns once nothing between
    /// the two engines can touch memory any more (see the module docs). The
    /// default refuses: the transport cannot fence.
    fn fence(&self, remote: &EngineKey) -> Result<(), TransportError> {
        Err(TransportError::Unsupported(format!("transport cannot fence {remote}")))
    }

    /// Sends a small control message to `to` (delivered at most once, in
    /// order per peer, as [`TransportEvent::Message`]). Not in MORI; the
    /// kv-transfer adapter carries ABORT / ABORT_ACK with it. The default
    /// refuses.
    fn send_message(&self, to: &EngineKey, bytes: Vec<u8>) -> Result<(), TransportError> {
        let _ = bytes;
        Err(TransportError::Unsupported(format!("transport cannot send messages to {to}")))
    }

    /// Grants `remote` access to one slot of region `id` under `generation`
    /// (region registered with a slot size). A transport that checks access
    /// per slot and generation binds it; from then on an access naming another
    /// generation is rejected. Returns the key that grants this tenancy, where
    /// the transport keys each one (verbs: a memory window's); the initiator
    /// then posts with it in [`WorkRequest::remote`]'s `rkey`. `None`: the
    /// region's key covers it. The default does nothing (MORI: one key for
    /// the whole region, no per-slot check).
    fn grant(
        &self,
        id: MemoryId,
        remote: &EngineKey,
        slot: u32,
        generation: u64,
    ) -> Result<Option<u64>, TransportError> {
        let _ = (id, remote, slot, generation);
        Ok(None)
    }

    /// Withdraws a grant after its tenancy was settled (no confirmation
    /// needed: the proof came from elsewhere). The default does nothing.
    fn withdraw(&self, id: MemoryId, slot: u32, generation: u64) -> Result<(), TransportError> {
        let _ = (id, slot, generation);
        Ok(())
    }

    /// Revokes a grant and confirms: `Ok(true)` only once no access under it
    /// can land any more (in-flight ones drained, later ones rejected).
    /// `Ok(false)`: not bound (or the drain timed out), nothing is proven. The
    /// default refuses: MORI cannot revoke per slot.
    fn revoke(&self, id: MemoryId, slot: u32, generation: u64) -> Result<bool, TransportError> {
        let _ = (id, slot, generation);
        Err(TransportError::Unsupported("transport cannot revoke per slot".to_owned()))
    }
}
