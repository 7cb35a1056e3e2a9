//! [`MoriEngine`]: construction (attaching the transport, push delivery,
//! the progress thread), its configuration and counters, and its
//! [`IoEngine`] impl, which hands each call to the engine's `Inner`
//! (registry, submit and progress live in their own modules).

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar};
use std::thread;
use std::time::{Duration, Instant};

use super::session::EngineSession;
use super::state::{Inner, State};
use super::{InboundHook, IoEngine, IoSession, MessageHook, PeerLostHook};
use crate::error::EngineError;
use crate::status::{StatusCode, TransferStatus};
use crate::transport::{MoriTransport, OpKind};
use crate::types::{
    BatchRequest, EngineDesc, EngineKey, InboundStatus, MemoryDesc, MemoryRegion, Segment, Tag, TransferUniqueId,
};
use crate::util::lock;
use crate::window::UidAllocator;

/// Configuration of a [`MoriEngine`].
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Host name published in the descriptor.
    pub hostname: String,
    /// Out-of-band host address published in the descriptor.
    pub host: String,
    /// Out-of-band port published in the descriptor.
    pub port: u16,
    /// First transfer id the allocator hands out (tests start near `u64::MAX`).
    pub uid_start: TransferUniqueId,
    /// First notification sequence number towards every peer (tests start near `u32::MAX`).
    pub notif_seq_start: u32,
    /// How long one transport poll of the progress thread may block.
    pub poll_interval: Duration,
    /// Most notifications held ahead of a gap before the window skips it.
    pub notif_window: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            hostname: "localhost".to_owned(),
            host: "127.0.0.1".to_owned(),
            port: 0,
            uid_start: 0,
            notif_seq_start: 0,
            poll_interval: Duration::from_millis(5),
            notif_window: 4096,
        }
    }
}

/// Counters of a [`MoriEngine`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Transfers accepted for posting.
    pub transfers_posted: u64,
    /// Transfers rejected at once (their status was an error from the start).
    pub transfers_rejected: u64,
    /// Posted transfers that ended in `SUCCESS`.
    pub transfers_succeeded: u64,
    /// Posted transfers that ended in an error.
    pub transfers_failed: u64,
    /// Transfers not yet terminal.
    pub transfers_pending: u64,
    /// Notifications handed to the transport.
    pub notifications_sent: u64,
    /// Notifications the transport refused (the target will not learn of that transfer).
    pub notifications_send_failed: u64,
    /// Inbound notifications filed for `pop_inbound_status`.
    pub notifications_received: u64,
    /// Inbound notifications dropped as duplicate or stale.
    pub notifications_duplicate: u64,
    /// Sequence numbers the window gave up on (lost notifications).
    pub notifications_skipped: u64,
    /// Completions whose `wr_id` matched no posted operation.
    pub stray_completions: u64,
    /// Hooks that panicked (caught; the peer concerned was fenced).
    pub hook_panics: u64,
}

/// The engine: MORI-IO semantics over a [`MoriTransport`], with the hazards
/// closed (see the crate docs).
///
/// It owns a progress thread that polls the transport, completes statuses and
/// files inbound notifications. A transport with push delivery
/// ([`MoriTransport::set_event_sink`]) hands completions and notifications to
/// the engine on its own thread instead (no thread hop per transfer); the
/// progress thread then only sees what `poll` still reports. Dropping the engine stops accepting transfers;
/// the progress thread keeps polling until every pending transfer is terminal,
/// then exits (a transfer that never completes keeps it alive, honestly
/// `IN_PROGRESS`).
pub struct MoriEngine {
    inner: Arc<Inner>,
}

impl fmt::Debug for MoriEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MoriEngine")
            .field("key", &self.inner.key)
            .field("transport", &self.inner.transport_name)
            .finish()
    }
}

impl MoriEngine {
    /// Creates an engine named `key` over `transport` and starts its progress thread.
    pub fn new(
        key: impl Into<EngineKey>,
        config: EngineConfig,
        transport: Arc<dyn MoriTransport>,
    ) -> Result<Self, EngineError> {
        let key = key.into();
        if key.as_str().is_empty() {
            return Err(EngineError::InvalidArgs("empty engine key".to_owned()));
        }
        let transport_info = transport.attach(&key)?;
        let inner = Arc::new(Inner {
            transport_name: transport.name(),
            carries_notifications: transport.carries_notifications(),
            uids: UidAllocator::new(config.uid_start),
            key,
            config,
            transport,
            transport_info,
            state: std::sync::Mutex::new(State::default()),
            inbound_cv: Condvar::new(),
            inbound_hook: std::sync::Mutex::new(None),
            message_hook: std::sync::Mutex::new(None),
            peer_lost_hook: std::sync::Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        // Push delivery where the transport offers it: events are applied on
        // the transport's thread, with no hop through the progress thread.
        let weak = Arc::downgrade(&inner);
        inner.transport.set_event_sink(Some(Arc::new(move |e| {
            if let Some(inner) = weak.upgrade() {
                inner.handle_event(e);
            }
        })));
        let worker = Arc::clone(&inner);
        thread::Builder::new()
            .name(format!("mori-progress-{}", inner.key))
            .spawn(move || worker.progress_loop())
            .map_err(|e| EngineError::BadState(format!("cannot start progress thread: {e}")))?;
        Ok(Self { inner })
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        let state = lock(&self.inner.state);
        let mut stats = state.stats;
        stats.transfers_pending = state.transfers.len() as u64;
        stats
    }

    /// Transfers not yet terminal.
    pub fn pending_transfers(&self) -> usize {
        lock(&self.inner.state).transfers.len()
    }

    /// Inbound statuses filed and not yet popped.
    pub fn inbound_len(&self) -> usize {
        lock(&self.inner.state).inbound.values().map(VecDeque::len).sum()
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }
}

impl Drop for MoriEngine {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::Release);
    }
}

impl IoEngine for MoriEngine {
    fn key(&self) -> EngineKey {
        self.inner.key.clone()
    }

    fn engine_desc(&self) -> EngineDesc {
        self.inner.engine_desc()
    }

    fn register_remote_engine(&self, desc: &EngineDesc) -> Result<(), EngineError> {
        self.inner.register_remote_engine(desc)
    }

    fn deregister_remote_engine(&self, key: &EngineKey) -> Result<(), EngineError> {
        self.inner.deregister_remote_engine(key)
    }

    fn fence_remote_engine(&self, key: &EngineKey) -> Result<(), EngineError> {
        self.inner.fence_remote_engine(key)
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<MemoryDesc, EngineError> {
        self.inner.register_memory(region)
    }

    fn deregister_memory(&self, desc: &MemoryDesc) -> Result<(), EngineError> {
        self.inner.deregister_memory(desc)
    }

    fn allocate_transfer_unique_id(&self) -> TransferUniqueId {
        self.inner.uids.allocate()
    }

    fn read(
        &self,
        local: &MemoryDesc,
        local_offset: u64,
        remote: &MemoryDesc,
        remote_offset: u64,
        size: u64,
        uid: TransferUniqueId,
        tag: Tag,
    ) -> TransferStatus {
        self.inner.submit(OpKind::Read, local, remote, &[Segment::new(local_offset, remote_offset, size)], uid, tag)
    }

    fn write(
        &self,
        local: &MemoryDesc,
        local_offset: u64,
        remote: &MemoryDesc,
        remote_offset: u64,
        size: u64,
        uid: TransferUniqueId,
        tag: Tag,
    ) -> TransferStatus {
        self.inner.submit(OpKind::Write, local, remote, &[Segment::new(local_offset, remote_offset, size)], uid, tag)
    }

    fn batch_read(&self, requests: &[BatchRequest]) -> Vec<TransferStatus> {
        requests
            .iter()
            .map(|r| self.inner.submit(OpKind::Read, &r.local, &r.remote, &r.segments, r.uid, r.tag))
            .collect()
    }

    fn batch_write(&self, requests: &[BatchRequest]) -> Vec<TransferStatus> {
        requests
            .iter()
            .map(|r| self.inner.submit(OpKind::Write, &r.local, &r.remote, &r.segments, r.uid, r.tag))
            .collect()
    }

    fn create_session(&self, local: &MemoryDesc, remote: &MemoryDesc) -> Result<Box<dyn IoSession>, EngineError> {
        let state = lock(&self.inner.state);
        if self.inner.shutdown.load(Ordering::Acquire) {
            return Err(EngineError::BadState("engine is shut down".to_owned()));
        }
        self.inner.check_local(&state, local).map_err(|(code, msg)| to_engine_error(code, msg))?;
        if !state.peers.contains_key(&remote.engine_key) {
            return Err(EngineError::NotFound(format!("remote engine {} is not registered", remote.engine_key)));
        }
        Ok(Box::new(EngineSession { inner: Arc::clone(&self.inner), local: local.clone(), remote: remote.clone() }))
    }

    fn pop_inbound_status(&self, remote: &EngineKey, uid: TransferUniqueId) -> Option<InboundStatus> {
        pop_inbound(&mut lock(&self.inner.state), remote, uid)
    }

    fn wait_inbound_status(
        &self,
        remote: &EngineKey,
        uid: TransferUniqueId,
        timeout: Duration,
    ) -> Option<InboundStatus> {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = lock(&self.inner.state);
        loop {
            if let Some(status) = pop_inbound(&mut state, remote, uid) {
                return Some(status);
            }
            let left = match deadline {
                Some(deadline) => deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?,
                None => Duration::from_secs(3600),
            };
            state.inbound_waiters += 1;
            state = self.inner.inbound_cv.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
            state.inbound_waiters -= 1;
        }
    }

    fn set_inbound_hook(&self, hook: Option<InboundHook>) {
        *lock(&self.inner.inbound_hook) = hook;
    }

    fn send_message(&self, to: &EngineKey, bytes: Vec<u8>) -> Result<(), EngineError> {
        if !lock(&self.inner.state).peers.contains_key(to) {
            return Err(EngineError::NotFound(format!("remote engine {to} is not registered")));
        }
        self.inner.transport.send_message(to, bytes)?;
        Ok(())
    }

    fn set_message_hook(&self, hook: Option<MessageHook>) {
        *lock(&self.inner.message_hook) = hook;
    }

    fn set_peer_lost_hook(&self, hook: Option<PeerLostHook>) {
        *lock(&self.inner.peer_lost_hook) = hook;
    }

    fn grant_access(
        &self,
        mem: &MemoryDesc,
        remote: &EngineKey,
        slot: u32,
        generation: u64,
    ) -> Result<Option<u64>, EngineError> {
        {
            let state = lock(&self.inner.state);
            self.inner.check_local(&state, mem).map_err(|(code, msg)| to_engine_error(code, msg))?;
            if !state.peers.contains_key(remote) {
                return Err(EngineError::NotFound(format!("remote engine {remote} is not registered")));
            }
        }
        Ok(self.inner.transport.grant(mem.id, remote, slot, generation)?)
    }

    fn withdraw_access(&self, mem: &MemoryDesc, slot: u32, generation: u64) -> Result<(), EngineError> {
        self.inner.transport.withdraw(mem.id, slot, generation)?;
        Ok(())
    }

    fn revoke_access(&self, mem: &MemoryDesc, slot: u32, generation: u64) -> Result<bool, EngineError> {
        Ok(self.inner.transport.revoke(mem.id, slot, generation)?)
    }
}

fn pop_inbound(state: &mut State, remote: &EngineKey, uid: TransferUniqueId) -> Option<InboundStatus> {
    let key = (remote.clone(), uid);
    let queue = state.inbound.get_mut(&key)?;
    let status = queue.pop_front();
    if queue.is_empty() {
        state.inbound.remove(&key);
    }
    status
}

pub(super) fn to_engine_error(code: StatusCode, message: String) -> EngineError {
    match code {
        StatusCode::NotFound => EngineError::NotFound(message),
        StatusCode::GpuOp => EngineError::Gpu(message),
        StatusCode::BadState => EngineError::BadState(message),
        _ => EngineError::InvalidArgs(message),
    }
}
