//! The engine's tables: what sits behind the one engine lock ([`State`]:
//! registrations, peers, notification windows, transfers not yet
//! terminal, filed inbound statuses, counters) and the shared `Inner` that
//! the engine, its sessions and the transport's threads hold.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar};

use super::mori::{EngineConfig, EngineStats};
use super::{InboundHook, MessageHook, PeerLostHook};
use crate::status::{StatusCode, StatusUpdater};
use crate::transport::MoriTransport;
use crate::types::{EngineDesc, EngineKey, InboundStatus, MemoryDesc, MemoryId, Tag, TransferUniqueId};
use crate::util::{HashMap, HashSet};
use crate::window::{NotifWindow, UidAllocator};

pub(super) struct LocalMem {
    pub(super) desc: MemoryDesc,
    pub(super) in_flight: usize,
}

pub(super) struct Peer {
    pub(super) desc: EngineDesc,
    pub(super) next_seq: u32,
    /// Transfer ids towards this peer that are not terminal (a second
    /// transfer with the same id is refused: its notification would be filed
    /// under the first one's key).
    pub(super) pending: HashSet<TransferUniqueId>,
    pub(super) fenced: bool,
}

impl Peer {
    pub(super) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The next notification sequence number towards this peer.
    pub(super) fn next_seq(&mut self) -> u32 {
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        seq
    }
}

pub(super) struct Transfer {
    pub(super) uid: TransferUniqueId,
    pub(super) tag: Tag,
    pub(super) remote: EngineKey,
    pub(super) local_mem: MemoryId,
    /// Posted as several work requests (ids with [`MULTI_WR`], in `wr_owner`).
    pub(super) multi: bool,
    /// The sequence number of the notification the transport carries with
    /// the data: on success it was delivered already; on failure the
    /// engine sends it, under this number.
    pub(super) carried: Option<u32>,
    pub(super) outstanding: usize,
    pub(super) error: Option<(StatusCode, String)>,
    pub(super) updater: StatusUpdater,
}

/// A status change to apply once the engine lock is released (listeners run user code).
pub(super) struct Finished {
    pub(super) updater: StatusUpdater,
    pub(super) code: StatusCode,
    pub(super) message: String,
}

impl Finished {
    pub(super) fn apply(self) {
        self.updater.set(self.code, self.message);
    }
}

#[derive(Default)]
pub(super) struct State {
    pub(super) memory: HashMap<MemoryId, LocalMem>,
    pub(super) next_mem_id: MemoryId,
    pub(super) peers: HashMap<EngineKey, Peer>,
    pub(super) windows: HashMap<EngineKey, NotifWindow>,
    /// Transfers not yet terminal, by engine-internal id. A one-segment
    /// transfer's work request carries that id as its `wr_id`; the work
    /// requests of a batch get ids with [`MULTI_WR`] set, mapped in `wr_owner`.
    pub(super) transfers: HashMap<u64, Transfer>,
    pub(super) next_transfer: u64,
    pub(super) wr_owner: HashMap<u64, u64>,
    pub(super) next_wr: u64,
    pub(super) inbound: HashMap<(EngineKey, TransferUniqueId), VecDeque<InboundStatus>>,
    /// Threads in `wait_inbound_status` (the condvar is signalled only for them).
    pub(super) inbound_waiters: usize,
    pub(super) stats: EngineStats,
}

/// Top bit of a `wr_id` that belongs to a multi-segment transfer (looked up
/// in `wr_owner`); without it the `wr_id` is the transfer's own id.
pub(super) const MULTI_WR: u64 = 1 << 63;

pub(super) struct Inner {
    pub(super) key: EngineKey,
    pub(super) config: EngineConfig,
    pub(super) transport: Arc<dyn MoriTransport>,
    pub(super) transport_name: String,
    pub(super) transport_info: Vec<u8>,
    /// The transport delivers a one-segment WRITE's notification with its data.
    pub(super) carries_notifications: bool,
    pub(super) uids: UidAllocator,
    pub(super) state: std::sync::Mutex<State>,
    /// Signalled whenever an inbound status is filed.
    pub(super) inbound_cv: Condvar,
    pub(super) inbound_hook: std::sync::Mutex<Option<InboundHook>>,
    pub(super) message_hook: std::sync::Mutex<Option<MessageHook>>,
    pub(super) peer_lost_hook: std::sync::Mutex<Option<PeerLostHook>>,
    pub(super) shutdown: AtomicBool,
}
