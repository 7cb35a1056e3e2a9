//! What comes back from the transport: completions (which settle
//! transfers), inbound notifications (admitted through the peer's window,
//! handed to the hook or filed for `pop_inbound_status`), control messages
//! and lost peers; applied on the progress thread, or on the transport's
//! own thread with push delivery.

use std::collections::hash_map::Entry;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::state::{Finished, Inner, State, MULTI_WR};
use crate::error::TransportError;
use crate::status::StatusCode;
use crate::transport::{Completion, Notification, TransportEvent};
use crate::types::{EngineKey, InboundStatus};
use crate::util::lock;
use crate::window::{Admit, NotifWindow};

impl Inner {
    /// Runs a user hook about `peer`. A panic in it is caught (the caller is
    /// the progress thread or the transport's receiving thread, which must
    /// go on), logged and counted (`EngineStats::hook_panics`), and the peer
    /// is fenced: what it sent was not handled, so nothing it says is trusted
    /// any more. The engine takes no new work for it at once; the transport's
    /// fence runs on a thread of its own (it joins the connection's threads,
    /// one of which may be this one), and its confirmation reaches the
    /// adapter as a lost peer: its exposures settle `Fenced`, its pending
    /// operations end with an error.
    fn run_hook<R>(&self, what: &'static str, peer: &EngineKey, hook: impl FnOnce() -> R) -> Option<R> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook)) {
            Ok(r) => Some(r),
            Err(_) => {
                {
                    let mut state = lock(&self.state);
                    state.stats.hook_panics += 1;
                    if let Some(p) = state.peers.get_mut(peer) {
                        p.fenced = true;
                    }
                }
                tracing::error!(engine = %self.key, %peer, hook = what, "a hook panicked; caught, fencing the peer");
                let (transport, key) = (Arc::clone(&self.transport), peer.clone());
                let spawned = std::thread::Builder::new().name("mori-hook-fence".into()).spawn(move || {
                    if let Err(e) = transport.fence(&key) {
                        tracing::warn!(peer = %key, error = %e, "fence after a hook panic failed");
                    }
                });
                if let Err(e) = spawned {
                    tracing::warn!(%peer, error = %e, "cannot start the fence after a hook panic");
                }
                None
            }
        }
    }

    /// Files an inbound notification; returns what the hook is to be told.
    /// Admits an inbound notification through the peer's window; a
    /// duplicate is dropped.
    fn on_inbound(&self, state: &mut State, from: EngineKey, n: Notification) -> Option<InboundStatus> {
        let window_size = self.config.notif_window;
        let window = match state.windows.get_mut(&from) {
            Some(w) => w,
            None => state.windows.entry(from.clone()).or_insert_with(|| NotifWindow::new(n.seq, window_size)),
        };
        let before = window.skipped();
        let admit = window.admit(n.seq);
        let skipped = window.skipped() - before;
        state.stats.notifications_skipped += skipped;
        if admit == Admit::Duplicate {
            state.stats.notifications_duplicate += 1;
            tracing::debug!(engine = %self.key, peer = %from, seq = n.seq, uid = n.uid, "duplicate notification dropped");
            return None;
        }
        state.stats.notifications_received += 1;
        Some(InboundStatus {
            remote: from,
            uid: n.uid,
            code: n.status_code(),
            message: n.message,
            tag: n.tag,
            seq: n.seq,
        })
    }

    /// Files statuses for `pop_inbound_status` and wakes its waiters.
    fn file_inbound(&self, state: &mut State, statuses: impl IntoIterator<Item = InboundStatus>) {
        for s in statuses {
            state.inbound.entry((s.remote.clone(), s.uid)).or_default().push_back(s);
        }
        if state.inbound_waiters > 0 {
            self.inbound_cv.notify_all();
        }
    }

    pub(super) fn progress_loop(self: Arc<Self>) {
        loop {
            if self.shutdown.load(Ordering::Acquire) && lock(&self.state).transfers.is_empty() {
                break;
            }
            let events = self.transport.poll(256, self.config.poll_interval.max(Duration::from_micros(100)));
            if !events.is_empty() {
                self.handle_events(events);
            }
        }
        // Push delivery ends with this thread, so that the transport's
        // threads stop calling into an engine that is going away.
        self.transport.set_event_sink(None);
        tracing::debug!(engine = %self.key, "progress thread exits");
    }

    /// Accounts one operation's completion; returns the transfer's status
    /// change if it was the last one.
    fn complete_wr(&self, state: &mut State, c: Completion) -> Option<Finished> {
        let error = c.result.err().map(|e| {
            let code = match e {
                TransportError::Unsupported(_) => StatusCode::GpuOp,
                _ => StatusCode::RdmaOp,
            };
            (code, e.to_string())
        });
        if c.wr_id & MULTI_WR == 0 {
            // A one-segment transfer: its work request is the transfer (one lookup).
            if let Entry::Occupied(e) = state.transfers.entry(c.wr_id) {
                if !e.get().multi {
                    let mut transfer = e.remove();
                    transfer.error = error;
                    return Some(self.finish_transfer(state, transfer));
                }
            }
        } else if let Some(transfer_id) = state.wr_owner.remove(&c.wr_id) {
            return self.settle(state, transfer_id, 1, error);
        }
        state.stats.stray_completions += 1;
        tracing::warn!(engine = %self.key, wr_id = c.wr_id, "completion for no posted operation");
        None
    }

    /// One event from the transport's thread (push delivery): completions and
    /// notifications without the batch bookkeeping of [`Self::handle_events`].
    pub(super) fn handle_event(&self, event: TransportEvent) {
        match event {
            TransportEvent::Completion(c) => {
                let finished = self.complete_wr(&mut lock(&self.state), c);
                if let Some(f) = finished {
                    f.apply();
                }
            }
            TransportEvent::Notification { from, notification } => {
                let hook = lock(&self.inbound_hook).clone();
                let status = {
                    let mut state = lock(&self.state);
                    let status = self.on_inbound(&mut state, from, notification);
                    match (&hook, status) {
                        (None, Some(s)) => {
                            self.file_inbound(&mut state, std::iter::once(s));
                            return;
                        }
                        (_, s) => s,
                    }
                };
                if let (Some(hook), Some(status)) = (hook, status) {
                    let peer = status.remote.clone();
                    if let Some(back) = self.run_hook("inbound", &peer, || hook(status)).flatten() {
                        self.file_inbound(&mut lock(&self.state), std::iter::once(back));
                    }
                }
            }
            other => self.handle_events(std::iter::once(other)),
        }
    }

    /// Applies transport events: completions settle transfers, notifications
    /// are filed, messages and lost peers go to their hooks. Runs on the
    /// progress thread, or on the transport's thread with push delivery.
    fn handle_events(&self, events: impl IntoIterator<Item = TransportEvent>) {
        let mut finished = Vec::new();
        let mut inbound = Vec::new();
        let mut messages = Vec::new();
        let mut lost = Vec::new();
        // Taken before the state lock (never under it), so a status goes to
        // the hook first and is filed only if the hook hands it back.
        let hook = lock(&self.inbound_hook).clone();
        let mut state = lock(&self.state);
        for event in events {
            match event {
                TransportEvent::Completion(c) => {
                    if let Some(f) = self.complete_wr(&mut state, c) {
                        finished.push(f);
                    }
                }
                TransportEvent::Notification { from, notification } => {
                    if let Some(status) = self.on_inbound(&mut state, from, notification) {
                        inbound.push(status);
                    }
                }
                TransportEvent::Message { from, bytes } => messages.push((from, bytes)),
                TransportEvent::PeerLost { peer } => {
                    if let Some(p) = state.peers.get_mut(&peer) {
                        p.fenced = true;
                        tracing::info!(engine = %self.key, peer = %peer, "connection to peer lost (fenced)");
                        lost.push(peer);
                    }
                }
            }
        }
        if hook.is_none() && !inbound.is_empty() {
            self.file_inbound(&mut state, inbound.drain(..));
        }
        drop(state);
        if !lost.is_empty() {
            let hook = lock(&self.peer_lost_hook).clone();
            if let Some(hook) = hook {
                for peer in lost {
                    let key = peer.clone();
                    self.run_hook("peer-lost", &key, || hook(peer));
                }
            }
        }
        if !messages.is_empty() {
            let hook = lock(&self.message_hook).clone();
            match hook {
                Some(hook) => {
                    for (from, bytes) in messages {
                        let key = from.clone();
                        self.run_hook("message", &key, || hook(from, bytes));
                    }
                }
                None => tracing::debug!(engine = %self.key, n = messages.len(), "control messages dropped: no hook"),
            }
        }
        if let Some(hook) = hook.filter(|_| !inbound.is_empty()) {
            let back: Vec<InboundStatus> = inbound
                .into_iter()
                .filter_map(|s| {
                    let peer = s.remote.clone();
                    self.run_hook("inbound", &peer, || hook(s)).flatten()
                })
                .collect();
            if !back.is_empty() {
                self.file_inbound(&mut lock(&self.state), back);
            }
        }
        for f in finished {
            f.apply();
        }
    }
}
