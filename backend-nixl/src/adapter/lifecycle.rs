//! An operation's lifecycle: the [`Phase`]s an op goes through from admission
//! until its request is terminal and released (or kept for re-posting), who
//! owns it in each, and finishing it ([`Inner::conclude`]: the outcome
//! recorded, what the target must hear queued, the lease completed).
//!
//! ```text
//! Posting   ── finish_inline ─────────► concluded  `Done` in the posting thread, released or kept
//! Posting   ── hand_off ──────────────► Polling    no terminal status yet (or the post failed)
//! Posting   ── hand_off ──────────────► Terminal   terminal status seen, not finished there
//! Polling   ── the driver's poll ─────► Terminal   status seen
//! Terminal  ── claim ─────────────────► Finishing  the driver releases it (finish_terminal)
//! Finishing ── finish_claimed ────────► concluded  released or kept
//! Finishing ── release failed ────────► Terminal   retried next round
//! Finishing ── release: in progress ──► Polling    not terminal after all
//! ```
//!
//! An op stays in `State::ops` in every phase (admission, the outbox and
//! teardown look at all of them) until it is concluded.

use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken, OpEnd, Outgoing};
use kv_transfer_core::{Completer, PoolId, Tenancy, TransferError};

use super::post::CacheKey;
use super::state::{Inner, State};
use super::{BACKEND, NO_NIXL_STATUS};
use crate::engine::{EngineError, ReqId, XferState};

/// Most emptied tenancy lists kept for reuse.
const SPARE_TENANCY_LISTS: usize = 64;

/// An operation from admission until its request is terminal and released (or
/// kept for re-posting). Small: posts that finish in their own thread only
/// insert and remove it.
pub(super) struct InFlight {
    /// The op's id (in `ops` and in the abort tracker).
    pub(super) id: u64,
    pub(super) agent: Arc<str>,
    pub(super) remote_pool: PoolId,
    /// The remote exposure's token (every message about it carries it).
    pub(super) token: ExposureToken,
    pub(super) remote: Vec<Tenancy>,
    pub(super) notify: bool,
    pub(super) notif_attached: bool,
    pub(super) local_pool: PoolId,
    /// Who owns the op now and what is left to do.
    pub(super) phase: Phase,
}

/// Where an op is in its life, and so who may touch it. Every transition
/// happens under the state lock; what a phase's owner does outside it (post,
/// poll, release, complete) only that owner does.
pub(super) enum Phase {
    /// Admitted and being posted ([`Inner::register`]): its posting thread owns
    /// it until it either finishes it itself ([`Inner::finish_inline`]: the
    /// request was `Done` in the post call or in the inline polling) or hands
    /// it to the driver ([`Inner::hand_off`]); until then the driver leaves it
    /// alone, so that thread may poll it without a thread hop.
    Posting,
    /// Handed to the driver with no terminal status seen yet (`IN_PROG`, or the
    /// post itself failed and the request may still run): the driver polls its
    /// status every round until it is terminal.
    Polling(Box<Driven>),
    /// Terminal status seen (by the driver, or by the posting thread before the
    /// hand-off); release still to do (or keeping it for re-posting) and the op
    /// to complete. The driver claims it ([`Inner::finish_terminal`]); back here
    /// when a release failed, to be retried.
    Terminal(Box<Driven>, Terminal),
    /// A thread is releasing and completing it ([`Inner::finish_claimed`]),
    /// outside the lock: no other thread finishes it meanwhile. It leaves
    /// `ops` from here; back to `Terminal` if the release failed, back to
    /// `Polling` if the engine says the request is still in progress after all.
    Finishing(Box<Driven>, Terminal),
}

impl Phase {
    /// The driver's part of the op, once handed off (`None` while `Posting`).
    pub(super) fn driven(&self) -> Option<&Driven> {
        match self {
            Phase::Posting => None,
            Phase::Polling(d) | Phase::Terminal(d, _) | Phase::Finishing(d, _) => Some(d),
        }
    }

    /// `Polling` → `Terminal`: the driver's poll saw a terminal status.
    pub(super) fn polled(&mut self, status: Terminal) {
        *self = match std::mem::replace(self, Phase::Posting) {
            Phase::Polling(d) => Phase::Terminal(d, status),
            other => other,
        };
    }

    /// `Terminal` → `Finishing`: claims the op for this thread. Returns its
    /// request and whether the engine no longer knows it (nothing to release);
    /// `None` if it was not `Terminal` (not the driver's to finish now).
    fn claim(&mut self) -> Option<(ReqId, bool)> {
        let mut claimed = None;
        *self = match std::mem::replace(self, Phase::Posting) {
            Phase::Terminal(d, status) => {
                claimed = Some((d.req, status.1));
                Phase::Finishing(d, status)
            }
            other => other,
        };
        claimed
    }

    /// `Finishing` → back: the release did not happen. `terminal`: the status
    /// stands (`Terminal`, the release is retried); else the request was not
    /// terminal after all (`Polling` again).
    fn unclaim(&mut self, terminal: bool) {
        *self = match std::mem::replace(self, Phase::Posting) {
            Phase::Finishing(d, status) if terminal => Phase::Terminal(d, status),
            Phase::Finishing(d, _) => Phase::Polling(d),
            other => other,
        };
    }

    /// `Finishing` → done: the request is released (or kept); takes out what
    /// concluding the op needs. `None` (nothing changed) if it was not claimed.
    fn take_finished(&mut self) -> Option<(Box<Driven>, Terminal)> {
        match std::mem::replace(self, Phase::Posting) {
            Phase::Finishing(d, status) => Some((d, status)),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// An op's state once the driver polls it (boxed: posts that finish in their
/// own thread never build one).
pub(super) struct Driven {
    pub(super) req: ReqId,
    /// Set when the request may be kept for re-posting after a clean completion.
    pub(super) key: Option<CacheKey>,
    /// Resolves the op's handle: dropped without completing (shutdown gave up
    /// on the op), it quarantines the lease.
    pub(super) completer: Completer,
    /// When the op was handed to the driver.
    pub(super) started: Instant,
    pub(super) post_error: Option<TransferError>,
}

/// How an op ended, for [`Inner::conclude`].
pub(super) struct End {
    pub(super) completer: Completer,
    /// The request, kept for re-posting (else it was released).
    pub(super) key: Option<CacheKey>,
    /// Its terminal status.
    pub(super) terminal: Result<(), TransferError>,
    pub(super) post_error: Option<TransferError>,
}

/// A terminal status as polled: the result (an error proves nothing about the
/// NIC) and whether the engine no longer knows the request.
pub(super) type Terminal = (Result<(), TransferError>, bool);

/// What a status poll says: `None` while the request is in progress
/// (`IN_PROG` is never terminal), else its terminal result (every error and
/// unknown status is an error) and whether the engine no longer knows it.
#[inline]
pub(super) fn terminal(status: Result<XferState, EngineError>) -> Option<Terminal> {
    match status {
        Ok(XferState::InProgress) => None,
        Ok(XferState::Done) => Some((Ok(()), false)),
        Err(e) => Some((Err(engine_error(&e)), matches!(e, EngineError::UnknownRequest(_)))),
    }
}

fn engine_error(e: &EngineError) -> TransferError {
    TransferError::Engine {
        engine: BACKEND,
        code: e.status().map_or(NO_NIXL_STATUS, |s| i64::from(s.to_raw())),
        message: e.to_string(),
    }
}

impl Inner {
    /// What follows NIXL's post of a registered op: until the op is handed over,
    /// the driver leaves it alone, so this thread may poll it (small transfers
    /// then finish without a thread hop) if no other op was in flight (else the
    /// driver is busy anyway, and this thread had better post the next one); a
    /// request terminal here is finished here, anything else goes to the driver.
    /// `(first, polled)`: what the post returned, and a terminal status already
    /// seen by a poll after it (from [`terminal_status`](Self::terminal_status)).
    /// `(reposted, alone)`: the request came from the cache; no other op was in
    /// flight when this one was admitted.
    pub(super) fn after_post(
        &self,
        op_id: u64,
        req: ReqId,
        key: Option<CacheKey>,
        completer: Completer,
        (first, polled): (Result<XferState, EngineError>, Option<Terminal>),
        (reposted, alone): (bool, bool),
    ) {
        // The terminal status seen in this thread, if any.
        let (mut status, mut post_error) = (None, None);
        match first {
            // Completed inside post (CMA on one host).
            Ok(XferState::Done) => status = Some((Ok(()), false)),
            Ok(XferState::InProgress) => {
                status = match polled {
                    Some(t) => Some(t),
                    None if alone && !self.cfg.inline_poll.is_zero() => self.poll_inline(req),
                    None => None,
                };
            }
            // Possibly partly posted: poll to a terminal status, report the post's error.
            Err(e) => post_error = Some(engine_error(&e)),
        }
        let (key, completer) = if matches!(status, Some((Ok(()), _))) && post_error.is_none() {
            // This thread releases (or keeps) the request and completes the op.
            match self.finish_inline(op_id, req, key, completer, reposted) {
                Ok(pending) => {
                    if pending {
                        self.wake.wake();
                    }
                    return;
                }
                // Release failed (so nothing was to be kept): the driver retries it.
                Err(completer) => (None, completer),
            }
        } else {
            (key, completer)
        };
        let driven = Driven { req, key, completer, started: Instant::now(), post_error };
        self.hand_off(op_id, driven, status, reposted);
    }

    /// Hands a posted op that its posting thread did not finish to the driver,
    /// with the terminal status that thread saw, if any.
    #[inline(never)]
    fn hand_off(&self, op_id: u64, driven: Driven, status: Option<Terminal>, reposted: bool) {
        let mut orphan = None;
        {
            let mut guard = self.state();
            let st = &mut *guard;
            match st.ops.get_mut(&op_id) {
                Some(o) => {
                    if o.notify {
                        // Being handed back: no later post may name them.
                        st.aborts.tombstone(&o.agent, o.remote_pool, o.token, &o.remote);
                    }
                    // `Posting` → the driver's: `Polling` until it sees a terminal
                    // status, or `Terminal` at once if this thread saw one (an error,
                    // or `Done` whose release failed here).
                    let d = Box::new(driven);
                    o.phase = match status {
                        Some(status) => Phase::Terminal(d, status),
                        None => Phase::Polling(d),
                    };
                }
                // Drained by a shutdown that gave up on it: dropping its completer
                // (outside the lock) quarantines the lease.
                None => orphan = Some(driven),
            }
            st.m.posted += 1;
            if reposted {
                st.m.reposted += 1;
            }
        }
        drop(orphan);
        self.wake.wake();
    }

    /// Polls a just-posted request from the posting thread for up to
    /// `AdapterConfig::inline_poll`. Returns its terminal status, if one came.
    fn poll_inline(&self, req: ReqId) -> Option<Terminal> {
        // The clock is read only once a poll found the request still in progress.
        let mut deadline = None;
        loop {
            if let Some(t) = self.terminal_status(req) {
                return Some(t);
            }
            let now = Instant::now();
            if now >= *deadline.get_or_insert_with(|| now + self.cfg.inline_poll) {
                return None;
            }
            std::hint::spin_loop();
        }
    }

    /// Polls a posted request once (see [`terminal`]).
    #[inline]
    pub(super) fn terminal_status(&self, req: ReqId) -> Option<Terminal> {
        terminal(self.engine.xfer_status(req))
    }

    /// Finishes, in the posting thread, an op whose request reached `Done` there:
    /// releases the request (or keeps it for re-posting when `key` is set), then
    /// removes the op and completes it. Returns whether messages wait for the
    /// driver; on a failed release, hands the completer back (the driver
    /// retries; nothing was to be kept).
    fn finish_inline(
        &self,
        op_id: u64,
        req: ReqId,
        key: Option<CacheKey>,
        completer: Completer,
        reposted: bool,
    ) -> Result<bool, Completer> {
        if key.is_none() {
            match self.engine.release_xfer(req) {
                Ok(()) | Err(EngineError::UnknownRequest(_)) => {}
                Err(e) => {
                    if !matches!(e, EngineError::StillInProgress(_)) {
                        tracing::warn!(%req, error = %e, "release_xfer failed; retrying");
                        self.state().m.release_failures += 1;
                    }
                    return Err(completer);
                }
            }
        }
        let mut guard = self.state();
        let st = &mut *guard;
        st.m.posted += 1;
        if reposted {
            st.m.reposted += 1;
        }
        let Some(o) = st.ops.remove(&op_id) else {
            // Drained by a shutdown that gave up on it: dropping the completer
            // quarantines the lease.
            return Ok(false);
        };
        if o.notify {
            st.aborts.tombstone(&o.agent, o.remote_pool, o.token, &o.remote);
        }
        // Still `Posting` (this thread's): concluded straight from there.
        Ok(self.conclude(guard, o, End { completer, key, terminal: Ok(()), post_error: None }))
    }

    /// Releases a terminal request and completes its operation. Returns whether it
    /// was finished (false: release failed, retried later).
    pub(super) fn finish_terminal(&self, op_id: u64) -> bool {
        let (req, forgotten) = {
            let mut st = self.state();
            // `Terminal` → `Finishing`: this thread releases it outside the lock.
            match st.ops.get_mut(&op_id).and_then(|o| o.phase.claim()) {
                Some(claimed) => claimed,
                None => return false,
            }
        };
        self.finish_claimed(op_id, req, forgotten)
    }

    /// [`finish_terminal`](Self::finish_terminal) for an op this thread claimed.
    fn finish_claimed(&self, op_id: u64, req: ReqId, forgotten: bool) -> bool {
        let unclaim = |terminal: bool| {
            if let Some(o) = self.state().ops.get_mut(&op_id) {
                o.phase.unclaim(terminal);
            }
        };
        // A clean completion of a cacheable request is kept (terminal) for re-posting.
        let keep = self.cfg.request_cache > 0
            && !forgotten
            && self.state().ops.get(&op_id).is_some_and(
                |o| matches!(&o.phase, Phase::Finishing(d, (Ok(()), _)) if d.key.is_some() && d.post_error.is_none()),
            );
        if !forgotten && !keep {
            match self.engine.release_xfer(req) {
                Ok(()) => {}
                Err(EngineError::StillInProgress(_)) => {
                    // Not terminal after all: back to polling.
                    unclaim(false);
                    return false;
                }
                Err(EngineError::UnknownRequest(_)) => {}
                Err(e) => {
                    tracing::warn!(%req, error = %e, "release_xfer failed; retrying");
                    self.state().m.release_failures += 1;
                    unclaim(true);
                    return false;
                }
            }
        }
        let mut st = self.state();
        // Released (or kept): out of `Finishing` and out of `ops`.
        let Some((d, (terminal, _))) = st.ops.get_mut(&op_id).and_then(|o| o.phase.take_finished()) else {
            return false;
        };
        let Some(o) = st.ops.remove(&op_id) else { return false };
        let Driven { key, completer, post_error, .. } = *d;
        let key = key.filter(|_| keep);
        self.conclude(st, o, End { completer, key, terminal, post_error });
        true
    }

    /// The end of an op: it is out of `ops` and its request terminal and released,
    /// or kept in `key` for re-posting. Records the outcome, queues what the target
    /// must hear, then (outside the lock) releases an evicted cached request and
    /// completes the op. Returns whether messages wait for the driver.
    fn conclude(&self, mut guard: MutexGuard<'_, State>, mut o: InFlight, end: End) -> bool {
        let End { completer, key, terminal, post_error } = end;
        let st = &mut *guard;
        let mut evicted = None;
        if let Some(key) = key {
            evicted = self.keep(st, key);
        }
        // An error *status* proves nothing: NIXL may report it while other
        // parts of the request still run. (A post error followed by a clean
        // terminal status is proven: the request itself finished.)
        let unproven = terminal.is_err();
        let mut result = terminal;
        if let (Some(pe), Ok(())) = (post_error, &result) {
            result = Err(pe);
        }
        let canceled = completer.cancel_requested();
        if result.is_ok() {
            st.m.completed_ok += 1;
        } else {
            st.m.completed_err += 1;
        }
        // What the target must hear, once no other request of ours touches
        // the slots. An unproven end is never acknowledged (core's tracker
        // remembers it and tombstones its tenancies).
        let acks = st.aborts.finished(o.id, if unproven { OpEnd::Unproven } else { OpEnd::Proven });
        for a in acks {
            st.outgoing.push(a);
        }
        let message = match (&result, o.notify, o.notif_attached, canceled) {
            _ if unproven => {
                st.m.failed_unproven += 1;
                None
            }
            (Ok(()), true, true, _) => None,
            (Ok(()), true, false, _) => Some(ControlKind::Done),
            (Err(_), true, _, _) | (_, _, _, true) => Some(ControlKind::AbortAck),
            (_, false, _, false) => None,
        };
        match message {
            Some(ControlKind::Done) => {
                let tenancies = std::mem::take(&mut o.remote);
                let msg = ControlMessage::new(ControlKind::Done, o.remote_pool, o.token, tenancies);
                st.outgoing.push(Outgoing { to: o.agent.clone(), msg });
            }
            Some(_) => {
                let tenancies = std::mem::take(&mut o.remote);
                if let Some(ack) = st.aborts.hand_back(&o.agent, o.remote_pool, o.token, tenancies) {
                    st.outgoing.push(ack);
                }
            }
            None => {}
        }
        if o.remote.capacity() > 0 && st.spare.len() < SPARE_TENANCY_LISTS {
            o.remote.clear();
            st.spare.push(std::mem::take(&mut o.remote));
        }
        let pending = !st.outgoing.is_empty();
        // A proven end: the proof for the lease (no pool, no proof: quarantined).
        let proof = match unproven {
            false => st.pools.get(&o.local_pool).map(|p| p.authority.completed(completer.lease().tenancies())),
            true => None,
        };
        drop(guard);
        if let Some(req) = evicted {
            if !self.release_cached(req) {
                self.state().m.release_failures += 1;
            }
        }
        self.notify_changed();
        if unproven {
            if let Err(e) = result {
                completer.abandon(e);
            }
        } else if let Some(proof) = proof {
            if let Err(e) = completer.complete(proof, result) {
                tracing::error!(error = %e, "completion proof did not settle the lease; it is quarantined");
            }
        }
        // Else (no pool, no proof) the completer is dropped here: the lease is quarantined.
        pending
    }
}
