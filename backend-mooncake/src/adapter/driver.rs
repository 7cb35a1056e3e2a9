//! The control thread: Mooncake notifications in (core's drain codec, text
//! form), DONE / ABORT_ACK through the target's exposure table, ABORT through
//! the initiator's abort tracker, the outbox of ABORT_ACKs, and core's plans
//! at each escalation step (drain, and with RDMA keys revoke; never fence).

use super::*;

pub(super) fn control_loop(inner: &Arc<Inner>) {
    while !inner.stop.load(Ordering::Acquire) {
        for n in inner.engine.get_notifies() {
            handle_notify(inner, &n.name, &n.notify_msg, n.proven);
        }
        flush_outbox(inner);
        // The pools' locks are taken with the driver's released: posting
        // threads take the driver's to expose.
        let due = lock(&inner.drain).due();
        let mut steps = due.collect();
        let actions = lock(&inner.drain).plan(&mut steps);
        for a in actions {
            execute(inner, a);
        }
        // With an engine that wakes us on each notification, nothing needs
        // polling: sleep until the drain's next deadline or a wake-up.
        let wakes = inner.notify_wakes.load(Ordering::Relaxed);
        let mut wait = if wakes { inner.cfg.idle_wait } else { inner.cfg.poll_interval };
        if let Some(d) = steps.next_deadline() {
            wait = wait.min(d);
        }
        inner.wake.sleep(wait);
    }
}

/// `proven`: the handshake of a sealed notification proved `from`;
/// otherwise it is only what the notification declares.
fn handle_notify(inner: &Arc<Inner>, from: &str, text: &str, proven: bool) {
    let msg = match ControlMessage::decode_text(text.as_bytes()) {
        Ok(m) => m,
        Err(DecodeError::Foreign) => {
            bump(&inner.counters.notifies_foreign, 1);
            tracing::debug!(from, "notification not for the adapter; dropped");
            return;
        }
        Err(e) => {
            bump(&inner.counters.notifies_malformed, 1);
            tracing::warn!(from, error = %e, "malformed adapter notification; dropped");
            return;
        }
    };
    bump(&inner.counters.notifies_received, 1);
    match msg.kind {
        ControlKind::Done | ControlKind::AbortAck => settle_from_peer(inner, from, &msg),
        ControlKind::Abort => on_abort(inner, from, proven, msg),
    }
}

/// Target side: a DONE or ABORT_ACK whose notification says it is from
/// `from`. The name is only where to look: the exposure table settles a
/// tenancy only for the peer it was exposed to *and* with its token.
fn settle_from_peer(inner: &Arc<Inner>, from: &str, msg: &ControlMessage) {
    let n = msg.tenancies.len() as u64;
    let Some((peer, _, _)) = inner.peer_by_name(from) else {
        bump(&inner.counters.unknown_sender_or_pool, n);
        tracing::warn!(from, "completion from an unknown peer; dropped");
        return;
    };
    if !lock(&inner.pools).contains_key(&msg.pool) {
        bump(&inner.counters.unknown_sender_or_pool, n);
        return;
    }
    let mut d = lock(&inner.drain).on_settling(peer, msg);
    let settled = d.tenancies();
    if let Some(keys) = &inner.cfg.keys {
        // Keys end before the slots can go back to the pool; the peer's word
        // also covers its retries of a revoked tenancy.
        let mut g = lock(&inner.grants);
        g.settled(keys, msg.pool, &settled);
        bump(&inner.counters.shadows_cleared, g.accept(peer, msg) as u64);
    }
    // The data server stops serving the slots before they can go back; a
    // slot a request is still inside is not released.
    let stuck = inner.close_ranges(msg.pool, &settled);
    d.retain(|t| !stuck.contains(&t));
    let _ = d.deliver();
}

/// Initiator side: an ABORT from `from` (a segment name we answer to; an
/// ABORT_ACK only ever names tenancies of our own operations' ends).
///
/// Only a sealed ABORT counts: its sender proved `from` with the cluster
/// key, so the state it buys is its own share, never another peer's. A
/// plain one (any name, from anyone) is dropped and counted
/// (`aborts_unproven`); the target that sent it keeps its slots quarantined
/// and asks again, as for any lost message.
///
/// With [`AdapterConfig::aborts_only_from_known_peers`](super::AdapterConfig),
/// only a peer this side chose (a segment it opened: `add_peer`, or a post
/// to its descriptor) buys abort state here; an ABORT under any other name
/// is dropped and counted (`aborts_from_strangers`), so made-up names buy
/// nothing. Dropping it is safe (the target keeps its slots quarantined and
/// asks again), but it answers only once this side knows the peer. Without
/// it, core's tracker caps the peers that unsolicited ABORTs create state for.
fn on_abort(inner: &Arc<Inner>, from: &str, proven: bool, msg: ControlMessage) {
    bump(&inner.counters.aborts_received, 1);
    if !proven && !inner.cfg.accept_unproven_aborts {
        bump(&inner.counters.aborts_unproven, 1);
        tracing::debug!(from, "ABORT whose sender no handshake proved; dropped");
        return;
    }
    let known = inner.peer_name(from);
    let known = if inner.cfg.aborts_only_from_known_peers { known } else { known.or_else(|| Some(Arc::from(from))) };
    let Some(name) = known else {
        bump(&inner.counters.aborts_from_strangers, 1);
        tracing::debug!(from, "ABORT from a name this side never dialed; dropped");
        return;
    };
    let ack = lock(&inner.inflight).tracker.on_abort(&name, msg);
    inner.settler.queue_acks(ack.into_iter().collect());
}

/// Hands the queued ABORT_ACKs to the sender threads (core's one retry
/// policy: a failed try comes back to the outbox). The control thread
/// itself never makes a network call, unless the positive control
/// ([`AdapterConfig::send_on_control_thread`]) asks for the old behaviour.
fn flush_outbox(inner: &Arc<Inner>) {
    let due = lock(&inner.inflight).outbox.take_all();
    for (o, attempts) in due {
        if !inner.cfg.send_on_control_thread {
            let to = o.to.clone();
            sender::enqueue(inner, &to, sender::Item::Ack(o, attempts));
            continue;
        }
        let sent = match inner.peer_for(&o.to) {
            Ok((_, seg, _)) => inner.send(seg, &o.msg),
            Err(e) => {
                tracing::warn!(to = %o.to, error = %e, "ABORT_ACK to an unreachable peer");
                false
            }
        };
        if sent {
            bump(&inner.counters.abort_acks_sent, 1);
        } else {
            lock(&inner.inflight).outbox.retry(o, attempts);
        }
    }
}

/// Executes one of core's drain actions (drain, and with RDMA keys
/// revoke; never fence).
fn execute(inner: &Arc<Inner>, action: Action) {
    match action {
        Action::Deliver(d) => {
            // The positive control frees without ending anything: the slot's
            // range stays open (the bug it reproduces) until it is exposed again.
            let _ = d.deliver();
        }
        Action::SendAbort { peer, messages } => {
            let seg = lock(&inner.peers).by_id.get(&peer).map(|p| (p.segment, p.name.clone()));
            match seg {
                Some((_, name)) if !inner.cfg.send_on_control_thread => {
                    for m in messages {
                        sender::enqueue(inner, &name, sender::Item::Abort(m));
                    }
                }
                Some((seg, name)) => {
                    for m in &messages {
                        if inner.send(seg, m) {
                            DrainCounters::add(&inner.drain_counters.aborts_sent, 1);
                            tracing::debug!(peer = %name, "ABORT sent");
                        }
                    }
                }
                None => tracing::debug!(peer = peer.0, "no peer to ask to drain"),
            }
        }
        Action::Revoke { pool, peer, tenancies } => {
            let Some(keys) = &inner.cfg.keys else { return };
            let with_tokens: Vec<_> = {
                let drain = lock(&inner.drain);
                tenancies.iter().filter_map(|t| drain.exposures().token_of(pool, *t, peer).map(|k| (*t, k))).collect()
            };
            let confirmed = lock(&inner.grants).revoke(keys, pool, peer, &with_tokens);
            // A slot a data request is still inside is not proven (fail closed).
            let stuck = inner.close_ranges(pool, &confirmed);
            let ts: Vec<_> = confirmed.into_iter().filter(|t| !stuck.contains(t)).collect();
            let d = lock(&inner.drain).revoked(pool, peer, &ts);
            tracing::debug!(peer = peer.0, slots = ts.len(), "keys revoked; slots shadowed for that peer");
            let _ = d.deliver();
        }
        // Not in this backend's ladder (its capabilities): core never plans it.
        Action::Fence { peer } => tracing::error!(peer = peer.0, "Mooncake cannot fence: escalation step dropped"),
    }
}
