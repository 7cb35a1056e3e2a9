//! The target side: pools registered with the agent, peers by their
//! metadata, and exposures, and core's [`Target`] over them.

use super::*;

impl NixlTransfer {
    /// Builds a pool over `region` and registers the region with NIXL. The pool's
    /// authority stays inside the adapter; the region is kept alive (and leaked if
    /// it can never be safely deregistered).
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        let mr = MemRegion::of(region.as_ref()).ok_or(AdapterError::UnsupportedMemory(region.kind()))?;
        if self.inner.state().closing {
            return Err(AdapterError::ShuttingDown);
        }
        let (pool, authority) = SlotPool::new(Arc::clone(&region), config.with_capabilities(CAPABILITIES))?;
        // SAFETY: the region is host memory of this process, or a CUDA
        // device's memory, the kind it says (checked above). The
        // adapter keeps an `Arc` to it until it deregisters it, which it does only
        // when no request of ours and no exposure of it is outstanding; otherwise
        // it leaks the `Arc`, so the memory is never freed while registered. Rust
        // code reaches the bytes only through `Region`'s raw copies.
        let reg = unsafe { self.inner.engine.register_mem(&[mr]) }?;
        let wake = Arc::clone(&self.inner.wake);
        authority.on_quarantine(move || wake.wake());
        let mut st = self.inner.state();
        st.drain.add_pool(authority.clone());
        st.pools.insert(pool.id(), PoolEntry { authority, region, reg });
        Ok(pool)
    }

    /// This agent's metadata, for peers' [`add_peer`](Self::add_peer). Call it
    /// after registering the pools peers will target.
    pub fn local_metadata(&self) -> Result<Vec<u8>, AdapterError> {
        Ok(self.inner.engine.local_metadata()?)
    }

    /// Loads a peer's metadata. Loading the same agent again returns its id.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<PeerId, AdapterError> {
        let name: Arc<str> = self.inner.engine.load_remote_metadata(metadata)?.into();
        let mut st = self.inner.state();
        if let Some(p) = st.names.get(&name) {
            return Ok(*p);
        }
        let id = PeerId(st.next_peer);
        st.next_peer += 1;
        st.peers.insert(id, Arc::clone(&name));
        st.names.insert(name, id);
        Ok(id)
    }

    /// A peer's agent name.
    pub fn peer_name(&self, peer: PeerId) -> Option<String> {
        self.inner.state().peers.get(&peer).map(|s| s.to_string())
    }

    /// Target side: exposes `lease`'s slots to `peer` and describes them. The
    /// exposure settles when the peer's `W`/`R`/`K` message for these tenancies
    /// arrives; aborting it sends the peer an ABORT.
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let mut st = self.inner.state();
        if st.closing {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ShuttingDown });
        }
        let pool = lease.pool().id();
        let Some(entry) = st.pools.get(&pool) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ForeignPool });
        };
        if !st.peers.contains_key(&peer) {
            return Err(ExposeError { lease, kind: ExposeErrorKind::UnknownPeer(peer) });
        }
        let (key, authority) = (entry.reg.0, entry.authority.clone());
        // Under the lock: a message for these tenancies waits until they are
        // recorded. The pool's mark first, the record after, as every
        // backend does (`Driver::expose_with`).
        let token = kv_transfer_core::drain::ExposureToken::random();
        let (exposed, remote) = authority.expose(lease, peer, key, self.inner.name.to_string(), token);
        st.drain.expose_with(pool, exposed.tenancies(), peer, Trust::Proving, token);
        st.m.exposed_slots = st.drain.exposures().len();
        drop(st);
        self.inner.wake.wake();
        Ok((exposed, remote))
    }
}

/// The target side every backend shares. A peer's descriptor is its
/// agent's metadata ([`NixlTransfer::local_metadata`]).
impl Target for NixlTransfer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        NixlTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            AdapterError::UnsupportedMemory(_) => BackendError::Unsupported(e.to_string()),
            AdapterError::ShuttingDown => BackendError::ShuttingDown,
            e => BackendError::Engine { backend: BACKEND, message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        self.local_metadata().map_err(|e| BackendError::Engine { backend: BACKEND, message: e.to_string() })
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        NixlTransfer::add_peer(self, descriptor).map_err(|e| BackendError::Peer(e.to_string()))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        NixlTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        let m = self.metrics();
        kv_transfer_core::named_counters!(m; in_flight, exposed_slots, pending_messages, posted, reposted,
            cached_requests, completed_ok, completed_err, release_failures, messages_received, malformed, foreign,
            stale, settled_by_message, aborts_sent, aborts_received, acks_sent, failed_unproven, acks_withheld,
            deferred_notifs_sent, refused_tombstoned, notif_errors, events_dropped, leaked_registrations)
    }
}
