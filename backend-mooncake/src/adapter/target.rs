//! The target side: pools registered with the engine, peers by segment
//! name, and exposures (a slot's range opened to the data server, a key per
//! tenancy where the engine has them), and core's [`Target`] over them.

use super::*;

impl MooncakeTransfer {
    /// Registers `region` with the engine and builds a pool over it. The
    /// pool's settlement authority stays inside the adapter.
    ///
    /// The adapter keeps the region alive until the engine can no longer
    /// touch it (see [`Drop`](MooncakeTransfer#impl-Drop-for-MooncakeTransfer)).
    ///
    /// Device memory (no host pointer) is staged by the TCP transport through
    /// host buffers; an engine on another transport refuses it
    /// ([`crate::EngineError::StagingUnsupported`]).
    pub fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, AdapterError> {
        let (pool, authority) = SlotPool::new(region.clone(), config.with_capabilities(self.inner.caps()))?;
        let mr = match region.host_ptr() {
            // SAFETY: the region is owned by the `Arc` the adapter keeps in
            // `pools` until the engine unregistered it (or forever, leaked, if
            // it never can: see `Drop`); every byte the engine touches lies in
            // a slot that is exposed, so no lease reads or writes it meanwhile.
            Some(_) => unsafe { MemoryRegion::new(region.addr(), region.len() as u64) },
            None => MemoryRegion::staged(region.clone()),
        };
        self.inner.engine.register_memory(mr)?;
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        authority.on_quarantine(move || {
            if let Some(i) = weak.upgrade() {
                i.wake();
            }
        });
        lock(&self.inner.drain).add_pool(authority.clone());
        lock(&self.inner.pools).insert(pool.id(), PoolEntry { authority, region });
        Ok(pool)
    }

    /// Opens (or refreshes) the peer with this segment name and returns its
    /// id. A v1 peer is warned about once and counted.
    pub fn add_peer(&self, segment_name: &str) -> Result<PeerId, AdapterError> {
        self.inner.add_peer(segment_name)
    }

    /// The protocol version a peer speaks, if known.
    pub fn peer_proto(&self, peer: PeerId) -> Option<ProtoVersion> {
        lock(&self.inner.peers).by_id.get(&peer).map(|p| p.proto)
    }

    /// Target side: exposes a reserved lease to `peer` and describes it (the
    /// endpoint is our segment name; addresses are the slots' virtual
    /// addresses, as Mooncake's host segments use them). The exposure settles
    /// when that peer sends `W` or `K` for it; if aborted, see the ladder in
    /// the module docs. On error the lease comes back unexposed.
    pub fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let (v1, name) = match lock(&self.inner.peers).by_id.get(&peer) {
            Some(p) => (p.proto == ProtoVersion::V1 || self.inner.self_proto == ProtoVersion::V1, p.name.clone()),
            None => return Err(ExposeError { lease, kind: ExposeErrorKind::UnknownPeer(peer) }),
        };
        let pools = lock(&self.inner.pools);
        let Some(entry) = pools.get(&lease.pool().id()) else {
            return Err(ExposeError { lease, kind: ExposeErrorKind::ForeignPool });
        };
        let mut slot_keys: Option<Vec<u32>> = None;
        let size = lease.pool().slot_size() as u64;
        let slots: Vec<(kv_transfer_core::Tenancy, u64, u64)> = lease
            .tenancies()
            .iter()
            .enumerate()
            .filter_map(|(i, t)| lease.slot_addr(i).map(|a| (*t, a, size)))
            .collect();
        let pool_id = lease.pool().id();
        if let Some(keys) = &self.inner.cfg.keys {
            // Each slot its own key, granted to this peer only; refused if
            // the slot is shadowed for it.
            match lock(&self.inner.grants).expose(keys, pool_id, &slots, peer, &name) {
                Ok(k) => slot_keys = Some(k),
                Err(kind) => {
                    if matches!(kind, ExposeErrorKind::RetryShadow(_)) {
                        bump(&self.inner.counters.shadow_refusals, 1);
                    }
                    return Err(ExposeError { lease, kind });
                }
            }
        }
        // The data server may touch these slots from now until their
        // settlement (admission before exposure: opened before the peer
        // learns the addresses).
        if let Err(e) = lock(&self.inner.ranges).open(self.inner.engine.as_ref(), pool_id, &slots) {
            if let Some(keys) = &self.inner.cfg.keys {
                let ts: Vec<_> = slots.iter().map(|(t, _, _)| *t).collect();
                lock(&self.inner.grants).settled(keys, pool_id, &ts);
            }
            return Err(ExposeError { lease, kind: ExposeErrorKind::Engine(e.to_string()) });
        }
        // The trust is fixed now: a v1 peer's exposure is never upgraded by a
        // later refresh of the peer (it settles only by a proof its word is not).
        let trust = if v1 { Trust::Unproving } else { Trust::Proving };
        // The pool's mark first, the drain table's record after
        // (`Driver::expose_with`): a loss of this peer handled in between
        // then fences the mark, or finds the record.
        let token = kv_transfer_core::drain::ExposureToken::random();
        let (exposed, mut remote) = entry.authority.expose(lease, peer, 0, self.inner.segment_name.clone(), token);
        lock(&self.inner.drain).expose_with(pool_id, exposed.tenancies(), peer, trust, token);
        drop(pools);
        if let Some(k) = slot_keys {
            // The peer checks its copy of our metadata against these.
            for (r, key) in remote.slots.iter_mut().zip(k) {
                r.key = Some(u64::from(key));
            }
        }
        if v1 {
            bump(&self.inner.counters.v1_exposures, 1);
            // Warned once per peer in `add_peer`; counted per exposure.
            tracing::debug!(
                peer = peer.0,
                slots = exposed.len(),
                "exposure to a protocol-v1 peer: its completions prove nothing; it settles only by a fence"
            );
        }
        Ok((exposed, remote))
    }
}

/// The target side every backend shares. A peer's descriptor is its
/// segment name (`ip:port` of its handshake listener).
impl Target for MooncakeTransfer {
    fn capabilities(&self) -> Capabilities {
        self.inner.caps()
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        MooncakeTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            e @ AdapterError::Engine(EngineError::StagingUnsupported { .. }) => {
                BackendError::Unsupported(e.to_string())
            }
            e => BackendError::Engine { backend: "mooncake", message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        Ok(self.segment_name().as_bytes().to_vec())
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        let name =
            std::str::from_utf8(descriptor).map_err(|_| BackendError::Peer("segment name is not UTF-8".into()))?;
        MooncakeTransfer::add_peer(self, name).map_err(|e| BackendError::Peer(format!("{name}: {e}")))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        MooncakeTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.metrics().fields()
    }
}
