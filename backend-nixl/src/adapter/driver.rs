//! The driver thread: its loop ([`Inner::drive`]) polls the requests handed to
//! it and finishes those that are terminal, polls notifications (or hands that
//! poll to a thread that keeps re-posting: [`Inner::take_notif_poll`]),
//! handles what peers sent ([`Inner::on_message`]), sends what waits in the
//! outbox ([`Inner::flush_outgoing`]) and runs the pools' escalation
//! ([`Inner::escalate`]); [`Wake`] is how it sleeps and is woken.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kv_transfer_core::drain::{Action, ControlKind, ControlMessage, DecodeError, DrainCounters, Outgoing};
use kv_transfer_core::Tenancy;

use super::lifecycle::Phase;
use super::state::{Inner, State};
use super::{NixlEvent, Progress};
use crate::engine::ReqId;

/// The driver's wake-up: posts, quarantines and shutdown set it, the driver
/// sleeps on it.
pub(super) struct Wake {
    flag: Mutex<bool>,
    /// The driver is blocked in `wait` (only then is a notify worth a syscall).
    waiting: std::sync::atomic::AtomicBool,
    cv: Condvar,
}

impl Wake {
    pub(super) fn new() -> Self {
        Self { flag: Mutex::new(false), waiting: std::sync::atomic::AtomicBool::new(false), cv: Condvar::new() }
    }
    pub(super) fn wake(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        *self.flag.lock().unwrap_or_else(|p| p.into_inner()) = true;
        if self.waiting.load(SeqCst) {
            self.cv.notify_one();
        }
    }
    /// Waits up to `d` for a wake-up; returns whether one came.
    fn wait(&self, d: Duration) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let mut g = self.flag.lock().unwrap_or_else(|p| p.into_inner());
        if !*g {
            // Set under the lock: a `wake` either sets the flag before we look at it
            // or sees `waiting` and notifies after we block.
            self.waiting.store(true, SeqCst);
            g = match self.cv.wait_timeout(g, d) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            self.waiting.store(false, SeqCst);
        }
        std::mem::replace(&mut *g, false)
    }
}

fn slots_overlap(a: &[Tenancy], b: &[Tenancy]) -> bool {
    a.iter().any(|x| b.iter().any(|y| x.slot == y.slot))
}

impl Inner {
    /// Runs the notification poll the driver handed to posting threads, if it
    /// is still due, and keeps what it fetched in [`State::inbox`]; returns
    /// whether anything came (the caller wakes the driver).
    ///
    /// Called by a cached re-post right after its post, under the lock. A
    /// thread that keeps posting holds NIXL's agent lock most of the time (a
    /// small post copies inside the call), so the driver's own periodic
    /// `get_notifs` would block on it and then make the next post block in
    /// turn: a sleep and a wake-up each time, on the posting thread's
    /// critical path. Polled here, between two posts, it costs that thread
    /// one uncontended call instead.
    #[inline]
    pub(super) fn take_notif_poll(&self, st: &mut State) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Relaxed};
        if !self.notif_due.load(Relaxed) || !self.notif_due.swap(false, AcqRel) {
            return false;
        }
        match self.engine.get_notifs() {
            Ok(n) => {
                let fetched = !n.is_empty();
                st.inbox.extend(n);
                fetched
            }
            Err(e) => {
                tracing::debug!(error = %e, "get_notifs failed");
                st.m.notif_errors += 1;
                false
            }
        }
    }

    pub(super) fn drive(&self) {
        let mut last_activity = Instant::now();
        // Poll notifications on the first round.
        let mut last_notif_poll: Option<Instant> = None;
        // A configuration with `poll_min > poll_max` is taken as the other way round.
        let (poll_lo, poll_hi) = (self.cfg.poll_min.min(self.cfg.poll_max), self.cfg.poll_max.max(self.cfg.poll_min));
        let mut backoff = poll_lo;
        let mut escalate_now = true;
        // Notification polls handed to posting threads (see `take_notif_poll`):
        // whether the last due poll was handed over, and `fast_posts` as the
        // last due poll saw it.
        let (mut handed, mut fast_posts_then) = (false, 0u64);
        loop {
            let now = Instant::now();
            let mut progressed = false;
            let (posted, exposures, outgoing, stop, youngest, next_esc, inbox, fast_posts) = {
                let mut st = self.state();
                // Ops being posted or finished by another thread are not the driver's.
                let mine = || {
                    st.ops.iter().filter_map(|(id, o)| match &o.phase {
                        Phase::Polling(d) => Some((id, d, false)),
                        Phase::Terminal(d, _) => Some((id, d, true)),
                        Phase::Posting | Phase::Finishing(..) => None,
                    })
                };
                let posted: Vec<(u64, ReqId, bool)> = mine().map(|(id, d, terminal)| (*id, d.req, terminal)).collect();
                let youngest = mine().map(|(_, d, _)| now.saturating_duration_since(d.started)).min();
                let inbox = std::mem::take(&mut st.inbox);
                (
                    posted,
                    !st.drain.exposures().is_empty(),
                    !st.outgoing.is_empty(),
                    st.stop,
                    youngest,
                    st.next_escalation,
                    inbox,
                    st.fast_posts,
                )
            };
            if stop {
                break;
            }
            // Fetched by a posting thread before anything this round fetches.
            progressed |= !inbox.is_empty();
            for n in inbox {
                self.on_message(&n.agent, &n.msg);
            }
            for (op_id, req, terminal) in &posted {
                if !terminal {
                    let Some(status) = self.terminal_status(*req) else { continue };
                    // `Polling` → `Terminal`: claimed and released just below.
                    if let Some(o) = self.state().ops.get_mut(op_id) {
                        o.phase.polled(status);
                    }
                }
                progressed |= self.finish_terminal(*op_id);
            }
            let notif_every = match self.cfg.progress {
                Progress::Driver if exposures => Duration::ZERO,
                _ if exposures || outgoing || !posted.is_empty() => self.cfg.notif_interval,
                _ => self.cfg.idle_interval,
            };
            if last_notif_poll.map_or(true, |t| now.saturating_duration_since(t) >= notif_every) {
                last_notif_poll = Some(now);
                use std::sync::atomic::Ordering::{AcqRel, Release};
                // Not yet taken: no thread re-posted since it was handed over.
                let untaken = self.notif_due.swap(false, AcqRel);
                let posting = fast_posts != fast_posts_then;
                fast_posts_then = fast_posts;
                // A thread is re-posting (or just took the last one): hand it this
                // poll too. Else poll here; nothing fetched by a posting thread can
                // be newer then, since none took a poll since the last round.
                // Never with polling on every round (`notif_every` zero): the hand
                // over would alternate with polls here.
                if !notif_every.is_zero() && !untaken && (handed || posting) {
                    handed = true;
                    self.notif_due.store(true, Release);
                } else {
                    handed = false;
                    progressed |= self.poll_notifs();
                }
            }
            if escalate_now || next_esc.is_some_and(|t| t <= now) {
                escalate_now = false;
                self.escalate();
            }
            if outgoing {
                progressed |= self.flush_outgoing();
            }
            if progressed {
                last_activity = Instant::now();
                backoff = poll_lo;
                self.notify_changed();
            }
            let busy = !posted.is_empty() || outgoing || (exposures && self.cfg.progress == Progress::Driver);
            let woke = if busy {
                if last_activity.elapsed() < self.cfg.spin {
                    // Bounded polling window right after a post or completion (not
                    // `yield_now`: on a loaded host a yield can cost a whole time slice).
                    std::hint::spin_loop();
                    continue;
                }
                // Sleep at most a sixteenth of the youngest request's age, so a
                // long transfer is seen done within ~6% of its duration.
                let cap = youngest.map_or(poll_hi, |a| a / 16).clamp(poll_lo, poll_hi);
                let d = backoff.min(cap);
                backoff = backoff.saturating_mul(2).clamp(poll_lo, poll_hi);
                self.wake.wait(d)
            } else {
                let mut d = self.cfg.idle_interval;
                if let Some(t) = next_esc {
                    d = d.min(t.saturating_duration_since(Instant::now()));
                }
                self.wake.wait(d.max(Duration::from_micros(100)))
            };
            if woke {
                // A post, a quarantine or a shutdown: look at everything now.
                escalate_now = true;
                last_activity = Instant::now();
                backoff = poll_lo;
            }
        }
    }

    fn poll_notifs(&self) -> bool {
        let notifs = match self.engine.get_notifs() {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(error = %e, "get_notifs failed");
                self.state().m.notif_errors += 1;
                return false;
            }
        };
        let progressed = !notifs.is_empty();
        for n in notifs {
            self.on_message(&n.agent, &n.msg);
        }
        progressed
    }

    /// A notification from `agent` (NIXL names the sending agent: one we
    /// loaded the metadata of, so the name is the transport's, not the
    /// message's; the exposure's token is checked on top of it).
    fn on_message(&self, agent: &str, msg: &[u8]) {
        let mut st = self.state();
        let Some((agent, peer)) = st.names.get_key_value(agent).map(|(a, p)| (Arc::clone(a), *p)) else {
            st.m.foreign += 1;
            return;
        };
        let m = match ControlMessage::decode_text(msg) {
            Ok(m) => m,
            Err(DecodeError::Foreign) => {
                st.m.foreign += 1;
                return;
            }
            Err(e) => {
                tracing::debug!(%agent, error = %e, "malformed notification dropped");
                st.m.malformed += 1;
                return;
            }
        };
        st.m.messages_received += 1;
        match m.kind {
            ControlKind::Abort => {
                // The target gave these up: never post to them again, and
                // answer once every request of ours on them is terminal.
                st.m.aborts_received += 1;
                if let Some(ack) = st.aborts.on_abort(&agent, m) {
                    st.outgoing.push(ack);
                }
            }
            ControlKind::Done | ControlKind::AbortAck => {
                let d = st.drain.on_settling(peer, &m);
                let settled = d.tenancies();
                if !settled.is_empty() {
                    if st.events.len() >= self.cfg.event_capacity {
                        st.events.pop_front();
                        st.m.events_dropped += 1;
                    }
                    st.events.push_back(NixlEvent { peer, pool: m.pool, tenancies: settled.clone(), kind: m.kind });
                }
                drop(st);
                let _ = d.deliver();
                if !settled.is_empty() {
                    self.notify_changed();
                }
            }
        }
    }

    /// Sends the messages whose slots no request of ours touches any more
    /// (core's outbox: one retry policy).
    fn flush_outgoing(&self) -> bool {
        let ready: Vec<(Outgoing<Arc<str>>, u32)> = {
            let mut st = self.state();
            let st = &mut *st;
            let mut ready = Vec::new();
            for (o, attempts) in st.outgoing.take_all() {
                let busy = st.ops.values().any(|op| {
                    op.agent == o.to && op.remote_pool == o.msg.pool && slots_overlap(&op.remote, &o.msg.tenancies)
                });
                if busy {
                    st.outgoing.defer(o, attempts);
                } else {
                    ready.push((o, attempts));
                }
            }
            ready
        };
        let mut sent = false;
        for (o, attempts) in ready {
            let mut ok = true;
            for m in o.msg.clone().chunks() {
                let text = match m.encode_text() {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::error!(error = %e, "control message cannot be encoded");
                        continue;
                    }
                };
                if let Err(e) = self.engine.gen_notif(&o.to, text.as_bytes()) {
                    tracing::debug!(agent = %o.to, error = %e, "gen_notif failed; retrying");
                    ok = false;
                    break;
                }
            }
            let mut st = self.state();
            if ok {
                sent = true;
                match o.msg.kind {
                    ControlKind::AbortAck => st.m.acks_sent += 1,
                    _ => st.m.deferred_notifs_sent += 1,
                }
            } else {
                st.m.notif_errors += 1;
                st.outgoing.retry(o, attempts);
            }
        }
        if sent {
            self.notify_changed();
        }
        sent
    }

    /// Runs due escalation steps of every pool: core's driver's actions
    /// (NIXL's ladder is drain and ack only, so an exhausted one is core's
    /// `quarantine_stuck`).
    fn escalate(&self) {
        // The pools' locks are taken with the state's released: posting
        // threads hold it.
        let due = self.state().drain.due();
        let mut steps = due.collect();
        let actions = {
            let mut st = self.state();
            // Looked at again within 100 ms even if the pool's clock is a
            // test's manual one that moves while the driver sleeps.
            st.next_escalation = steps.next_deadline().map(|d| Instant::now() + d.min(Duration::from_millis(100)));
            st.drain.plan(&mut steps)
        };
        for a in actions {
            match a {
                Action::SendAbort { peer, messages } => {
                    let Some(agent) = self.state().peers.get(&peer).cloned() else { continue };
                    for m in messages {
                        let sent = m
                            .encode_text()
                            .map_err(|e| e.to_string())
                            .and_then(|t| self.engine.gen_notif(&agent, t.as_bytes()).map_err(|e| e.to_string()));
                        match sent {
                            Ok(()) => DrainCounters::add(&self.state().drain.counters().aborts_sent, 1),
                            Err(e) => {
                                tracing::warn!(%agent, error = %e, "sending ABORT failed");
                                self.state().m.notif_errors += 1;
                            }
                        }
                    }
                }
                Action::Deliver(d) => {
                    let _ = d.deliver();
                }
                // Not in NIXL's ladder (CAPABILITIES): core never plans them.
                Action::Revoke { .. } | Action::Fence { .. } => {
                    tracing::error!("NIXL cannot revoke or fence: escalation step dropped");
                }
            }
        }
    }
}
