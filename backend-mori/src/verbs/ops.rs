//! [`MoriTransport`] for [`VerbsTransport`]: the operations the engine
//! calls (connect, register, post, notify, fence, grant, revoke), over the
//! books kept in the parent module.

use super::*;

impl MoriTransport for VerbsTransport {
    fn name(&self) -> String {
        RDMA.to_owned()
    }

    fn attach(&self, local: &EngineKey) -> Result<Vec<u8>, TransportError> {
        self.shared
            .local
            .set(local.clone())
            .map_err(|_| TransportError::State("transport already attached".to_owned()))?;
        let listener =
            lock(&self.listener).take().ok_or_else(|| TransportError::State("no side channel".to_owned()))?;
        let addr = listener.local_addr().map_err(|e| io_err("side channel", e))?.to_string();
        let d = Descriptor { name: local.as_str().to_owned(), addr, ticket: self.shared.ticket };
        // The acceptor's side of the handshake: this side's name, and the
        // address its descriptor publishes (the positive control adds a
        // relay's); set before the acceptor thread starts.
        let mut auth = AcceptorConfig::new(
            self.shared.key.clone(),
            AUTH_CONTEXT,
            Identity::new(local.as_str(), self.shared.addr.clone()),
        );
        auth.addresses.extend(self.shared.cfg.positive_control_addresses.iter().cloned());
        let _ = self.shared.auth.set(auth);
        // The listener moves to its thread; its address stays readable.
        *lock(&self.listener) = listener.try_clone().ok();
        let sh = self.shared.clone();
        let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let t2 = threads.clone();
        let acceptor = std::thread::Builder::new()
            .name("mori-verbs-accept".into())
            .spawn(move || {
                accept_loop(sh, listener, t2.clone());
                let ts = std::mem::take(&mut *lock(&t2));
                for t in ts {
                    let _ = t.join();
                }
            })
            .map_err(|e| io_err("thread", e))?;
        lock(&self.threads).push(acceptor);
        Ok(d.encode().into_bytes())
    }

    fn connect(&self, remote: &EngineDesc) -> Result<(), TransportError> {
        if remote.transport != RDMA {
            return Err(TransportError::Unsupported(format!("peer uses transport {}", remote.transport)));
        }
        let d = parse_descriptor(&remote.transport_info).map_err(|e| TransportError::State(e.to_string()))?;
        if d.name != remote.key.as_str() {
            return Err(TransportError::State(format!("descriptor of {} names {}", remote.key, d.name)));
        }
        let sh = &self.shared;
        let mut st = sh.st();
        st.peers.insert(remote.key.clone(), d.clone());
        // A connection from it that is still in its handshake: wait for it
        // (bounded) rather than dial a second one.
        let claims = |st: &State, want: fn(&ConnState) -> bool| {
            st.conns.iter().find(|(_, c)| c.peer == remote.key && want(&c.state)).map(|(id, c)| (*id, c.state))
        };
        let (g, _) = sh.wait(st, |st| claims(st, |s| *s == ConnState::Handshaking).is_none());
        st = g;
        if sh.conn_to(&st, &remote.key).is_ok() {
            return Ok(());
        }
        if let Some((id, ConnState::Unbound { ticket })) = claims(&st, |s| matches!(s, ConnState::Unbound { .. })) {
            if tickets_match(&ticket, &d.ticket) {
                sh.bind(&mut st, id);
                sh.changed.notify_all();
                return Ok(());
            }
            sh.impostor(&mut st, id);
            if sh.conn_to(&st, &remote.key).is_ok() {
                // The positive control bound it.
                sh.changed.notify_all();
                return Ok(());
            }
        }
        drop(st);
        let (id, s) = sh.dial(&d)?;
        let w = sh.clone();
        sh.spawn(&self.threads, "mori-verbs-life", move || w.watch(id, s));
        Ok(())
    }

    fn disconnect(&self, remote: &EngineKey) -> Result<(), TransportError> {
        let mut st = self.shared.st();
        st.peers.remove(remote);
        if let Some(c) = st.bound.get(remote).copied() {
            self.shared.start_drain(&mut st, c, false);
        }
        Ok(())
    }

    fn register_memory(&self, id: MemoryId, region: &MemoryRegion) -> Result<u64, TransportError> {
        // Device memory only as a core region: the NIC registers it through
        // its dma-buf (a software NIC through its copies); GPU memory known
        // only by address is out of reach.
        if region.location() != MemoryLocation::Cpu && region.core_region().is_none() {
            return Err(TransportError::Unsupported(
                "this transport registers host memory, or device memory as a core region".to_owned(),
            ));
        }
        let (mem, len) = SimMem::of(region)?;
        let access = match self.shared.cfg.access {
            Access::WindowPerTenancy => MrAccess::WindowsOnly,
            Access::RegionKey => MrAccess::RemoteWriteRead,
        };
        let info = self.shared.nic.register(mem.clone(), access).map_err(verbs_err)?;
        if info.addr != region.addr() {
            self.shared.nic.deregister(info.id);
            return Err(TransportError::State(format!("registered at {:#x}, not {:#x}", info.addr, region.addr())));
        }
        let mut st = self.shared.st();
        if st.regions.contains_key(&id) {
            self.shared.nic.deregister(info.id);
            return Err(TransportError::State(format!("memory {id} already registered")));
        }
        let slot_size = region.slot_size().unwrap_or(len as u64).max(1);
        let rkey = u64::from(info.rkey);
        st.regions.insert(id, Registered { mr: info.id, rkey, len: len as u64, slot_size, busy: 0, _mem: mem });
        Ok(rkey)
    }

    fn deregister_memory(&self, id: MemoryId) -> Result<(), TransportError> {
        let mut st = self.shared.st();
        let Some(r) = st.regions.get(&id) else {
            return Err(TransportError::UnknownMemory { engine: self.shared.local()?.clone(), id });
        };
        if r.busy > 0 || st.windows.keys().any(|(m, _, _)| *m == id) {
            return Err(TransportError::Busy(id));
        }
        let mr = r.mr;
        st.regions.remove(&id);
        self.shared.nic.deregister(mr);
        Ok(())
    }

    fn post(&self, wr: WorkRequest) -> Result<(), TransportError> {
        let sh = &self.shared;
        let mut st = sh.st();
        let (mr, len) = match st.regions.get(&wr.local.id) {
            Some(r) if r.rkey == wr.local.rkey => (r.mr, r.len),
            _ => return Err(TransportError::UnknownMemory { engine: wr.local.engine_key.clone(), id: wr.local.id }),
        };
        let size = u32::try_from(wr.len).map_err(|_| TransportError::OutOfBounds)?;
        if wr.local_offset.checked_add(wr.len).map_or(true, |e| e > len)
            || wr.remote_offset.checked_add(wr.len).map_or(true, |e| e > wr.remote.size)
        {
            return Err(TransportError::OutOfBounds);
        }
        let conn = sh.conn_to(&st, &wr.remote.engine_key)?;
        let nqp = st.conns.get(&conn).map_or(1, |c| c.qps.len());
        // A window's key names its queue pair; the region's key works on any.
        let windowed = wr.remote.rkey & WINDOW_KEY != 0;
        let (qp_index, rkey) = if windowed {
            (((wr.remote.rkey >> 32) & 0xff) as usize, wr.remote.rkey as u32)
        } else {
            let rkey = u32::try_from(wr.remote.rkey).map_err(|_| TransportError::OutOfBounds)?;
            ((wr.tag.slot as u32 as usize) % nqp, rkey)
        };
        let qp = st.conns.get(&conn).and_then(|c| c.qps.get(qp_index).copied()).ok_or(TransportError::OutOfBounds)?;
        let remote_addr = wr.remote.addr.checked_add(wr.remote_offset).ok_or(TransportError::OutOfBounds)?;
        let (offset, engine_wr, mem) = (wr.local_offset, wr.wr_id, wr.local.id);
        let verb = match wr.op {
            OpKind::Write => Wr::Write { local: mr, offset, len: size, remote_addr, rkey },
            OpKind::Read => Wr::Read { local: mr, offset, len: size, remote_addr, rkey },
        };
        // A carried notification needs its send buffer before the WRITE
        // goes: it must not be posted without the SEND behind it.
        let carried = match (&wr.notification, wr.op) {
            (Some(n), OpKind::Write) if st.send_free.is_empty() => {
                let _ = n;
                return Err(TransportError::Remote("all send buffers in flight".to_owned()));
            }
            (Some(n), OpKind::Write) => Some(notification_bytes(n)),
            _ => None,
        };
        sh.post_on(&mut st, conn, qp, verb, Pending::Data { conn, engine_wr, mem, windowed })?;
        if let Some(r) = st.regions.get_mut(&mem) {
            r.busy += 1;
        }
        if let Some(bytes) = carried {
            if let Err(e) = sh.send_on(&mut st, conn, qp_index, &bytes) {
                // The WRITE is posted; its notification is lost, so the
                // target settles it another way (the adapter's ladder).
                tracing::warn!(error = %e, "carried notification not posted");
            }
        }
        Ok(())
    }

    fn notify(&self, to: &EngineKey, notification: Notification) -> Result<(), TransportError> {
        let sh = &self.shared;
        let mut st = sh.st();
        let conn = sh.conn_to(&st, to)?;
        sh.send_on(&mut st, conn, 0, &notification_bytes(&notification))
    }

    fn carries_notifications(&self) -> bool {
        true
    }

    fn poll(&self, max: usize, timeout: Duration) -> Vec<TransportEvent> {
        let sh = &self.shared;
        let mut q = lock(&sh.events);
        if q.is_empty() {
            q = sh.event_ready.wait_timeout(q, timeout).unwrap_or_else(|p| p.into_inner()).0;
        }
        let n = q.len().min(max);
        q.drain(..n).collect()
    }

    fn fence(&self, remote: &EngineKey) -> Result<(), TransportError> {
        let sh = &self.shared;
        let mut st = sh.st();
        let Some(conn) = st.bound.get(remote).copied() else {
            // Nothing bound: nothing can move between the two.
            return Ok(());
        };
        sh.start_drain(&mut st, conn, false);
        let (mut st, drained) = sh.wait(st, |st| !st.conns.contains_key(&conn));
        if !drained {
            return Err(TransportError::Remote(format!("fence of {remote}: requests still posted after the timeout")));
        }
        st.stats.fences += 1;
        Ok(())
    }

    fn send_message(&self, to: &EngineKey, bytes: Vec<u8>) -> Result<(), TransportError> {
        let sh = &self.shared;
        let mut msg = Vec::with_capacity(1 + bytes.len());
        msg.push(MSG_CONTROL);
        msg.extend_from_slice(&bytes);
        let mut st = sh.st();
        let conn = sh.conn_to(&st, to)?;
        sh.send_on(&mut st, conn, 0, &msg)
    }

    fn grant(
        &self,
        id: MemoryId,
        remote: &EngineKey,
        slot: u32,
        generation: u64,
    ) -> Result<Option<u64>, TransportError> {
        let sh = &self.shared;
        let mut st = sh.st();
        let (mr, offset, len) = match st.regions.get(&id) {
            Some(r) => {
                let off = u64::from(slot).checked_mul(r.slot_size).filter(|o| o + r.slot_size <= r.len);
                (r.mr, off.ok_or(TransportError::OutOfBounds)?, r.slot_size)
            }
            None => return Err(TransportError::UnknownMemory { engine: sh.local()?.clone(), id }),
        };
        if sh.cfg.access == Access::RegionKey {
            return Ok(None);
        }
        let len = u32::try_from(len).map_err(|_| TransportError::OutOfBounds)?;
        let conn = sh.conn_to(&st, remote)?;
        let tenancy = (id, slot, generation);
        if st.windows.contains_key(&tenancy) {
            return Err(TransportError::State(format!("slot {slot} generation {generation} is granted already")));
        }
        let Some(c) = st.conns.get(&conn) else { return Err(TransportError::UnknownPeer(remote.clone())) };
        let qp_index = slot as usize % c.qps.len();
        let qp = c.qps[qp_index];
        let mw = match st.spare_windows.pop() {
            Some(mw) => mw,
            None => sh.nic.alloc_window().map_err(verbs_err)?,
        };
        let bind = Wr::Bind { window: mw, mr, offset, len };
        let rkey = match sh.post_on(&mut st, conn, qp, bind, Pending::Bind { conn, tenancy }) {
            Ok(Some(k)) => k,
            Ok(None) | Err(_) => {
                sh.nic.free_window(mw);
                return Err(TransportError::Remote(format!("bind of slot {slot} not posted")));
            }
        };
        st.windows.insert(tenancy, Window { mw, conn, qp_index, state: WindowState::Binding });
        // Admission before exposure: the key goes out only once the NIC
        // honours it.
        let (mut st, _) = sh.wait(st, |st| st.windows.get(&tenancy).map_or(true, |w| w.state != WindowState::Binding));
        match st.windows.get(&tenancy).map(|w| w.state) {
            Some(WindowState::Bound) => Ok(Some(WINDOW_KEY | ((qp_index as u64) << 32) | u64::from(rkey))),
            state => {
                if state == Some(WindowState::Failed) {
                    if let Some(w) = st.windows.remove(&tenancy) {
                        sh.nic.free_window(w.mw);
                    }
                }
                Err(TransportError::Remote(format!("bind of slot {slot}: {state:?}")))
            }
        }
    }

    fn withdraw(&self, id: MemoryId, slot: u32, generation: u64) -> Result<(), TransportError> {
        let mut st = self.shared.st();
        self.invalidate(&mut st, (id, slot, generation)).map(|_| ())
    }

    fn revoke(&self, id: MemoryId, slot: u32, generation: u64) -> Result<bool, TransportError> {
        let sh = &self.shared;
        if sh.cfg.access == Access::RegionKey {
            return Err(TransportError::Unsupported("the region's key cannot be revoked per slot".to_owned()));
        }
        let tenancy = (id, slot, generation);
        let mut st = sh.st();
        if !self.invalidate(&mut st, tenancy)? {
            return Ok(false);
        }
        let (_st, done) = sh.wait(st, |st| !st.windows.contains_key(&tenancy));
        Ok(done)
    }
}

impl VerbsTransport {
    /// Posts `LOCAL_INV` of `tenancy`'s window (once); `false` if it has none.
    fn invalidate(&self, st: &mut State, tenancy: (MemoryId, u32, u64)) -> Result<bool, TransportError> {
        let sh = &self.shared;
        let Some(w) = st.windows.get(&tenancy) else { return Ok(false) };
        let (mw, conn, qp_index, state) = (w.mw, w.conn, w.qp_index, w.state);
        match state {
            WindowState::Invalidating => return Ok(true),
            WindowState::Binding | WindowState::Failed => return Ok(false),
            WindowState::Bound => {}
        }
        let qp = st.conns.get(&conn).and_then(|c| c.qps.get(qp_index).copied());
        let posted = match qp {
            Some(qp) => sh.post_on(st, conn, qp, Wr::Invalidate { window: mw }, Pending::Invalidate { conn, tenancy }),
            None => Err(TransportError::UnknownPeer(EngineKey::new("gone"))),
        };
        match posted {
            Ok(_) => {
                if let Some(w) = st.windows.get_mut(&tenancy) {
                    w.state = WindowState::Invalidating;
                }
                Ok(true)
            }
            Err(e) => {
                // The connection is gone (its queue pairs in ERR and
                // drained): a type-2 window works only through its queue
                // pair, so nothing can land under it any more.
                let down = qp.map_or(true, |q| sh.nic.qp_state(q).map_or(true, |s| s == backend_verbs::QpState::Error));
                if down {
                    if let Some(w) = st.windows.remove(&tenancy) {
                        sh.nic.free_window(w.mw);
                    }
                    sh.changed.notify_all();
                    Ok(true)
                } else {
                    Err(e)
                }
            }
        }
    }
}

/// A notification as a SEND: [`MSG_NOTIFY`], then the fields (its text cut
/// to fit one buffer).
fn notification_bytes(n: &Notification) -> Vec<u8> {
    let mut b = encode_notification(n);
    b.truncate(MAX_MESSAGE);
    b
}
