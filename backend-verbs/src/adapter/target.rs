//! The target side: an exposure binds a memory window per slot on the
//! peer's queue pair (or, under `naive`, hands out the pool's own key), and
//! core's [`Target`] over it.

use super::*;

impl Inner {
    pub(super) fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        let fail = |lease, kind| Err(ExposeError { lease, kind });
        let engine = |e: &dyn std::fmt::Display| ExposeErrorKind::Engine(e.to_string());
        let pool_id = lease.pool().id();
        let naive = self.cfg.release_policy.is_naive();
        let mut st = lock(&self.state);
        let Some(qp) = st.peers.get(&peer).filter(|p| p.state == PeerState::Live).map(|p| p.qp) else {
            drop(st);
            return fail(lease, ExposeErrorKind::UnknownPeer(peer));
        };
        let slot_size = lease.pool().slot_size();
        let Ok(len) = u32::try_from(slot_size) else {
            drop(st);
            return fail(lease, ExposeErrorKind::Engine("slots larger than 4 GiB".into()));
        };
        let mut keys = Vec::with_capacity(lease.len());
        let mut waiters = Vec::new();
        {
            let State { pools, wrs, .. } = &mut *st;
            let Some(entry) = pools.get_mut(&pool_id) else {
                drop(st);
                return fail(lease, ExposeErrorKind::ForeignPool);
            };
            if naive {
                keys = vec![None; lease.len()];
            } else {
                for t in lease.tenancies() {
                    let i = t.slot.0 as usize;
                    let w = match &mut entry.windows[i] {
                        Some(w) => w,
                        slot @ None => match self.engine.alloc_window() {
                            Ok(id) => slot.insert(Window { id, state: WindowState::Unbound }),
                            Err(e) => {
                                drop(st);
                                return fail(lease, engine(&e));
                            }
                        },
                    };
                    let wr = self.next_wr.fetch_add(1, Ordering::Relaxed);
                    let done: BindWaiter = Arc::new((Mutex::new(None), Condvar::new()));
                    wrs.insert(wr, Pending::Bind { peer, done: Arc::clone(&done), pool: pool_id, slot: t.slot.0 });
                    let bind =
                        WorkRequest::Bind { window: w.id, mr: entry.mr.id, offset: i as u64 * slot_size as u64, len };
                    let posted = if w.state == WindowState::Unbound {
                        self.engine.post(qp, wr, bind).and_then(|k| {
                            k.ok_or_else(|| VerbsError::invalid("post BIND_MW", "the engine returned no key"))
                        })
                    } else {
                        Err(VerbsError::invalid("post BIND_MW", format!("the window is {:?}, not unbound", w.state)))
                    };
                    match posted {
                        Ok(k) => {
                            w.state = WindowState::Binding;
                            keys.push(Some(u64::from(k)));
                            waiters.push((t.slot.0, done));
                        }
                        Err(e) => {
                            wrs.remove(&wr);
                            // The NIC may have put the QP in ERR (a rejected
                            // access) before the driver saw a flushed
                            // completion: fence it now, so the next exposure
                            // goes to the new connection.
                            if self.engine.qp_state(qp).is_ok_and(|s| s == QpState::Error) {
                                self.start_fence(&mut st, peer);
                            }
                            drop(st);
                            // Binds already posted finish in the driver; their
                            // windows are invalidated there (nothing exposed).
                            self.abandon_binds(pool_id, peer, &waiters);
                            return fail(lease, engine(&e));
                        }
                    }
                }
            }
        }
        drop(st);
        // Bounded by the configured timeout.
        let deadline = Instant::now() + self.cfg.timeout;
        let mut ok = true;
        for (_, w) in &waiters {
            let (m, cv) = &**w;
            let mut g = lock(m);
            while g.is_none() && Instant::now() < deadline {
                g = cv.wait_timeout(g, deadline - Instant::now()).unwrap_or_else(|p| p.into_inner()).0;
            }
            ok &= *g == Some(true);
        }
        if !ok {
            self.abandon_binds(pool_id, peer, &waiters);
            return fail(lease, ExposeErrorKind::Engine("a window bind failed or timed out".into()));
        }
        let st = lock(&self.state);
        let Some(entry) = st.pools.get(&pool_id) else {
            drop(st);
            return fail(lease, ExposeErrorKind::ForeignPool);
        };
        // The pool's mark first, the drain table's record after
        // (`Driver::expose_with`): a loss of this peer handled in between
        // then fences the mark, or finds the record.
        let token = kv_transfer_core::drain::ExposureToken::random();
        let key = if naive { u64::from(entry.mr.rkey) } else { 0 };
        let (exposed, mut remote) = entry.authority.expose(lease, peer, key, self.descriptor.clone(), token);
        lock(&self.drain).expose_with(pool_id, exposed.tenancies(), peer, Trust::Proving, token);
        for (s, k) in remote.slots.iter_mut().zip(keys) {
            s.key = k;
        }
        drop(st);
        inc(&self.counters.binds);
        Ok((exposed, remote))
    }

    /// Binds of an exposure that will not happen: each window is taken
    /// back, so the slot can be bound again. A bind still pending is marked
    /// given up, and the driver invalidates its window when it completes; a
    /// bind that completed already is invalidated now (nothing to prove:
    /// its key was never handed out).
    pub(super) fn abandon_binds(&self, pool: PoolId, peer: PeerId, waiters: &[(u32, BindWaiter)]) {
        // State, then waiter: the driver's order.
        let mut st = lock(&self.state);
        for (slot, w) in waiters {
            let (m, cv) = &**w;
            let mut g = lock(m);
            match *g {
                None => *g = Some(false),
                Some(true) => {
                    drop(g);
                    let t = kv_transfer_core::Tenancy::new(
                        kv_transfer_core::SlotId(*slot),
                        kv_transfer_core::Generation(0),
                    );
                    self.invalidate(&mut st, pool, peer, t, AfterInvalidate::Nothing);
                    continue;
                }
                Some(false) => {}
            }
            cv.notify_all();
        }
    }
}

impl Target for VerbsTransfer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
    fn register_pool(&self, region: Arc<dyn Region>, config: PoolConfig) -> Result<SlotPool, BackendError> {
        VerbsTransfer::register_pool(self, region, config).map_err(|e| match e {
            AdapterError::Pool(p) => BackendError::Pool(p),
            e => BackendError::Engine { backend: BACKEND, message: e.to_string() },
        })
    }
    fn local_descriptor(&self) -> Result<Vec<u8>, BackendError> {
        Ok(self.inner.descriptor.as_bytes().to_vec())
    }
    fn add_peer(&self, descriptor: &[u8]) -> Result<PeerId, BackendError> {
        let d = std::str::from_utf8(descriptor).map_err(|_| BackendError::Peer("descriptor is not UTF-8".into()))?;
        VerbsTransfer::add_peer(self, d).map_err(|e| BackendError::Peer(e.to_string()))
    }
    fn expose(
        &self,
        lease: SlotLease<Reserved>,
        peer: PeerId,
    ) -> Result<(SlotLease<Exposed>, RemoteSlots), ExposeError> {
        VerbsTransfer::expose(self, lease, peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        VerbsTransfer::counters(self)
    }
}
