//! The initiator's side of a post: admission under the lock (peer, tombstones,
//! overlap), the request cache (a completed request re-posted by the next
//! identical post, the common case finished under the lock:
//! [`Inner::finish_fast`]), creating a request and its descriptors, and
//! registering the op, which the [lifecycle](super::lifecycle) takes from there.

use std::sync::Arc;

use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{
    check_shapes, Completed, Exposed, MemoryKind, Op, PeerId, PoolId, PostError, PostErrorKind, PostNow, RemoteSlot,
    RemoteSlots, Reserved, SlotLease, TransferHandle, TransferOptions,
};

use super::lifecycle::{terminal, InFlight, Phase};
use super::state::{Inner, State};
use super::NixlTransfer;
use crate::engine::{EngineError, MemRegion, ReqId, XferOp, XferSpec, XferState};

/// A request kept for re-posting, and what it moves: re-posted only for an
/// identical post.
pub(super) struct CacheKey {
    pub(super) agent: Arc<str>,
    pub(super) op: XferOp,
    /// The first (local, remote) descriptor pair: most posts have just one,
    /// contiguous slots being merged.
    pub(super) first: (MemRegion, MemRegion),
    /// The other pairs.
    pub(super) rest: Vec<(MemRegion, MemRegion)>,
    pub(super) req: ReqId,
}

/// Local and remote slot addresses paired into descriptors, merging runs that
/// are contiguous on both sides.
struct Descriptors<I: Iterator<Item = (u64, u64)>> {
    pairs: I,
    slot: u64,
    next: Option<(u64, u64)>,
    /// The memory each side's descriptors name (DRAM, or a GPU's VRAM).
    local: MemRegion,
    remote: MemRegion,
}

impl<I: Iterator<Item = (u64, u64)>> Descriptors<I> {
    fn new(pairs: I, slot: u64, local: MemRegion, remote: MemRegion) -> Self {
        Self { pairs, slot, next: None, local, remote }
    }
}

/// A descriptor of `kind` memory (its address and length set later).
#[inline]
fn memory(kind: MemoryKind) -> MemRegion {
    match kind {
        MemoryKind::Device { ordinal } => MemRegion::vram(0, 0, ordinal),
        _ => MemRegion::new(0, 0),
    }
}

/// The descriptors of a post: the lease's slots paired with the remote ones.
fn descriptors<'a>(
    local: &'a SlotLease<Reserved>,
    remote: &'a RemoteSlots,
) -> Descriptors<impl Iterator<Item = (u64, u64)> + 'a> {
    let pairs = (0..local.len()).filter_map(|i| local.slot_addr(i)).zip(remote.slots.iter().map(|s| s.addr));
    Descriptors::new(pairs, remote.slot_size, memory(local.pool().memory()), memory(remote.memory))
}

impl<I: Iterator<Item = (u64, u64)>> Iterator for Descriptors<I> {
    type Item = (MemRegion, MemRegion);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let (la, ra) = self.next.take().or_else(|| self.pairs.next())?;
        let mut len = self.slot;
        for (l, r) in self.pairs.by_ref() {
            if l == la + len && r == ra + len {
                len += self.slot;
            } else {
                self.next = Some((l, r));
                break;
            }
        }
        Some((self.local.like(la as usize, len as usize), self.remote.like(ra as usize, len as usize)))
    }
}

impl PostNow for NixlTransfer {
    fn post_now(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        self.inner.post(op, local, remote, opts)
    }
}

impl Inner {
    #[allow(clippy::result_large_err)]
    fn post(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError> {
        if let Err(kind) = check_shapes(&local, remote) {
            return Err(PostError { lease: local, kind });
        }
        let xop = if op == Op::Write { XferOp::Write } else { XferOp::Read };
        // The first descriptor pair, and whether it is the only one (what a cache
        // lookup compares first).
        let (first, single) = if self.cfg.request_cache > 0 {
            let mut d = descriptors(&local, remote);
            (d.next(), d.next().is_none())
        } else {
            (None, false)
        };
        // Admission under the lock: peer, tombstones, overlap.
        let mut guard = self.state();
        let st = &mut *guard;
        let (agent_id, peer, overlap) = match Self::admit(st, &local, remote) {
            Ok(a) => a,
            Err(kind) => return Err(PostError { lease: local, kind }),
        };
        // A notification attached to the request carries one DONE of at most
        // the codec's tenancies; a larger one goes deferred, in chunks.
        let attach = opts.notify && !overlap && remote.slots.len() <= kv_transfer_core::drain::MAX_TENANCIES;
        // A completed request with the very same descriptors, peer and no
        // notification: re-post it instead of creating one.
        let hit = match first {
            Some(first) if !attach => st.cache.iter().rposition(|c| {
                c.first == first
                    && c.op == xop
                    && Arc::as_ptr(&c.agent).cast::<u8>() == agent_id
                    && if c.rest.is_empty() {
                        single
                    } else {
                        !single && descriptors(&local, remote).skip(1).eq(c.rest.iter().copied())
                    }
            }),
            _ => None,
        };
        if let (Some(i), false) = (hit, opts.notify) {
            // The common case: re-post under the lock (NIXL's post holds the
            // agent's own lock anyway, so no engine call could run meanwhile). If
            // NIXL finished it inside its post, or (no other op of ours in flight,
            // inline polling on) at the one status poll that follows it still
            // under the lock, it stays cached and the op is complete: nothing else
            // ever saw it, so nothing else has to be told.
            let req = st.cache[i].req;
            let alone = st.ops.is_empty();
            let exposed = match st.pools.get(&local.pool().id()) {
                Some(p) => p.authority.expose_local(local, peer),
                None => return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool }),
            };
            let (mut first, status) = self.engine.post_xfer_polled(req, alone && !self.cfg.inline_poll.is_zero());
            st.fast_posts += 1;
            let fetched = self.take_notif_poll(st);
            let mut polled = None;
            match status.and_then(terminal) {
                Some((Ok(()), _)) => first = Ok(XferState::Done),
                // An error status: terminal, unproven; the driver finishes it.
                other => polled = other,
            }
            if matches!(first, Ok(XferState::Done)) {
                st.m.posted += 1;
                st.m.reposted += 1;
                st.m.completed_ok += 1;
                // Most recently completed last.
                if i + 1 != st.cache.len() {
                    let key = st.cache.remove(i);
                    st.cache.push(key);
                }
                let proof = st.pools.get(&exposed.pool().id()).map(|p| p.authority.completed(exposed.tenancies()));
                let pending = fetched || !st.outgoing.is_empty();
                drop(guard);
                return Ok(self.finish_fast(exposed, proof, pending));
            }
            // Not finished inside the post: the request is this op's alone, and the
            // op one like any other from here.
            let (handle, completer) = TransferHandle::pair(exposed);
            let key = st.cache.remove(i);
            let agent = key.agent.clone();
            let op_id = Self::register(st, agent, remote, &opts, false, completer.lease().pool().id());
            drop(guard);
            if fetched {
                self.wake.wake();
            }
            self.after_post(op_id, req, Some(key), completer, (first, polled), (true, alone));
            return Ok(handle);
        }
        let Some(agent) = st.peers.get(&peer).cloned() else {
            return Err(PostError { lease: local, kind: PostErrorKind::Peer(format!("{peer:?} was removed")) });
        };
        let Some(authority) = st.pools.get(&local.pool().id()).map(|p| p.authority.clone()) else {
            return Err(PostError { lease: local, kind: PostErrorKind::ForeignPool });
        };
        // Taking it out of the cache makes it this post's alone.
        let cached = hit.map(|i| st.cache.remove(i));
        // A placeholder that aborts, teardown and other posts see.
        let alone = st.ops.is_empty();
        let op_id = Self::register(st, agent.clone(), remote, &opts, attach, local.pool().id());
        drop(guard);
        let reposted = cached.is_some();
        // Nothing is exposed by creating a request: a failure hands the lease back.
        let (req, key) = match cached {
            Some(c) => (c.req, Some(c)),
            None => match self.create_request(xop, &local, remote, agent, attach) {
                Ok(created) => created,
                Err(e) => {
                    self.state().ops.remove(&op_id);
                    self.notify_changed();
                    self.wake.wake();
                    return Err(PostError { lease: local, kind: PostErrorKind::Engine(e.to_string()) });
                }
            },
        };
        let (handle, completer) = TransferHandle::pair(authority.expose_local(local, peer));
        // From here the request may run: it is finished only at a terminal status.
        let first = self.engine.post_xfer(req);
        self.after_post(op_id, req, key, completer, (first, None), (reposted, alone));
        Ok(handle)
    }

    /// Records an admitted op (its posting thread's until handed to the driver).
    fn register(
        st: &mut State,
        agent: Arc<str>,
        remote: &RemoteSlots,
        opts: &TransferOptions,
        attach: bool,
        local_pool: PoolId,
    ) -> u64 {
        let id = st.next_op;
        st.next_op += 1;
        // Admitted under this lock already (`admit`'s tombstone check): an
        // ABORT from now on waits for this op.
        let _ = st.aborts.admit(id, &agent, remote, false);
        let mut ts = st.spare.pop().unwrap_or_default();
        ts.extend(remote.slots.iter().map(RemoteSlot::tenancy));
        st.ops.insert(
            id,
            InFlight {
                id,
                agent,
                remote_pool: remote.pool,
                token: remote.token,
                remote: ts,
                notify: opts.notify,
                notif_attached: attach,
                local_pool,
                // Its posting thread's until it finishes it or hands it off.
                phase: Phase::Posting,
            },
        );
        id
    }

    /// Puts a completed request back into the cache; returns the one evicted.
    #[inline]
    pub(super) fn keep(&self, st: &mut State, key: CacheKey) -> Option<ReqId> {
        st.cache.push(key);
        (st.cache.len() > self.cfg.request_cache).then(|| st.cache.remove(0).req)
    }

    /// The end of a post finished under the lock (called without it).
    fn finish_fast(&self, exposed: SlotLease<Exposed>, proof: Option<Completed>, pending: bool) -> TransferHandle {
        let handle = match proof {
            // Settled now; the handle resolves at its first poll (no completer).
            Some(proof) => {
                let (handle, settled) = TransferHandle::completed(exposed, proof, Ok(()));
                if let Err(e) = settled {
                    tracing::error!(error = %e, "completion proof did not settle the lease; it is quarantined");
                }
                handle
            }
            // No pool, no proof: dropping the completer quarantines the lease.
            None => TransferHandle::pair(exposed).0,
        };
        if pending {
            self.wake.wake();
        }
        handle
    }

    /// Admission of a post, under the lock: the local pool is ours, the peer
    /// known, no remote tenancy tombstoned, and no notifying request of ours on
    /// the same remote slots. Returns the address of the peer's agent name (the
    /// one `Arc` of `names`, which the cache and ops hold clones of: compared by
    /// address), its id, and whether another request of ours touches those slots.
    fn admit(
        st: &mut State,
        local: &SlotLease<Reserved>,
        remote: &RemoteSlots,
    ) -> Result<(*const u8, PeerId, bool), PostErrorKind> {
        if st.closing {
            return Err(PostErrorKind::ShuttingDown);
        }
        if !st.pools.contains_key(&local.pool().id()) {
            return Err(PostErrorKind::ForeignPool);
        }
        if st.last_peer.as_ref().map_or(true, |(a, _)| **a != *remote.endpoint) {
            let Some((agent, peer)) = st.names.get_key_value(remote.endpoint.as_str()) else {
                return Err(PostErrorKind::Peer(format!("agent {:?} was never added", remote.endpoint)));
            };
            st.last_peer = Some((Arc::clone(agent), *peer));
        }
        let Some((agent, peer)) = &st.last_peer else {
            return Err(PostErrorKind::Peer(format!("agent {:?} was never added", remote.endpoint)));
        };
        let (agent_id, peer) = (Arc::as_ptr(agent).cast::<u8>(), *peer);
        if let Err(refusal) = st.aborts.check(agent, remote) {
            st.m.refused_tombstoned += 1;
            return Err(PostErrorKind::Descriptor(refusal.to_string()));
        }
        let mut overlap = false;
        for o in st.ops.values() {
            if o.remote_pool == remote.pool
                && Arc::as_ptr(&o.agent).cast::<u8>() == agent_id
                && o.remote.iter().any(|x| remote.slots.iter().any(|y| x.slot == y.slot))
            {
                if o.notify {
                    return Err(PostErrorKind::Descriptor(
                        "remote slots are being handed back by a notifying request".into(),
                    ));
                }
                overlap = true;
            }
        }
        Ok((agent_id, peer, overlap))
    }

    /// Creates the request of a post that found none to re-post. Nothing is
    /// exposed by this. Returns it, with its cache entry when it may be kept.
    #[inline(never)]
    fn create_request(
        &self,
        xop: XferOp,
        local: &SlotLease<Reserved>,
        remote: &RemoteSlots,
        agent: Arc<str>,
        attach: bool,
    ) -> Result<(ReqId, Option<CacheKey>), EngineError> {
        let (l, r): (Vec<MemRegion>, Vec<MemRegion>) = descriptors(local, remote).unzip();
        // The DONE NIXL sends once the data is flushed (a notification
        // attached to the request): core's codec, text form.
        let done = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
        let spec = XferSpec {
            op: xop,
            local: l,
            remote: r,
            remote_agent: agent.to_string(),
            notif: if attach { done.encode_text().ok().map(String::into_bytes) } else { None },
        };
        let req = self.engine.create_xfer(&spec)?;
        let mut descs = spec.local.iter().copied().zip(spec.remote.iter().copied());
        let key = match descs.next() {
            Some(first) if self.cfg.request_cache > 0 && !attach => {
                Some(CacheKey { agent, op: xop, first, rest: descs.collect(), req })
            }
            _ => None,
        };
        Ok((req, key))
    }

    /// Releases a cached (completed, terminal) request.
    /// Returns whether it worked (the caller counts failures: it may hold the lock).
    pub(super) fn release_cached(&self, req: ReqId) -> bool {
        match self.engine.release_xfer(req) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%req, error = %e, "releasing a cached request failed");
                false
            }
        }
    }
}
