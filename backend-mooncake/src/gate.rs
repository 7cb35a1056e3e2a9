//! Fault injection: a [`DataTransport`] that can hold what is submitted to
//! it, for tests and races that need a WRITE in flight past its abort.
//!
//! A Mooncake target's data server has no hook to hold an incoming request,
//! so the hold sits at the initiator: while holding, submitted tasks wait
//! here, posted and not terminal, no byte on the wire. That is all "in
//! flight" means to a target that cannot revoke: the bytes may still come.

use crate::transport::{DataTransport, TcpTransport, TcpTransportConfig, TransportWork};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
struct GateState {
    holding: bool,
    /// Crashed: tasks are dropped (FAILED, nothing sent).
    dead: bool,
    held: Vec<TransportWork>,
}

/// A transport (Mooncake's TCP one, or any other) behind a gate: while [`hold`](Self::hold)ing,
/// submitted tasks wait; [`open`](Self::open) hands them to the transport in
/// order; [`crash`](Self::crash) drops them all (each reports FAILED: it
/// never left) and every later one.
///
/// ```no_run
/// use backend_mooncake::{gate::GatedTransport, DataTransport, EngineConfig, MooncakeEngine};
/// use std::sync::Arc;
/// let cfg = EngineConfig::default();
/// let gate = Arc::new(GatedTransport::new(cfg.tcp.clone()).unwrap());
/// let engine = MooncakeEngine::with_transport(cfg, gate.clone() as Arc<dyn DataTransport>).unwrap();
/// gate.hold(); // what the engine submits now waits
/// gate.open(); // and goes out
/// # drop(engine);
/// ```
pub struct GatedTransport {
    inner: Arc<dyn DataTransport>,
    state: Mutex<GateState>,
    cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for GatedTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("GatedTransport").field("holding", &s.holding).field("held", &s.held.len()).finish()
    }
}

impl GatedTransport {
    /// A gated TCP transport, open.
    pub fn new(cfg: TcpTransportConfig) -> std::io::Result<Self> {
        Ok(Self::over(Arc::new(TcpTransport::new(cfg)?)))
    }

    /// `inner` behind a gate, open (the RDMA transport: a held task has not
    /// reached the NIC).
    pub fn over(inner: Arc<dyn DataTransport>) -> Self {
        Self { inner, state: Mutex::default(), cv: Condvar::new() }
    }

    /// Holds what is submitted from now on; false once crashed.
    pub fn hold(&self) -> bool {
        let mut s = lock(&self.state);
        s.holding = !s.dead;
        s.holding
    }

    /// Hands every held task to the transport, in order, and stops holding.
    pub fn open(&self) {
        let held = {
            let mut s = lock(&self.state);
            s.holding = false;
            std::mem::take(&mut s.held)
        };
        for w in held {
            self.inner.submit(w);
        }
    }

    /// Drops every held task (each reports FAILED: it never left) and every
    /// later one.
    pub fn crash(&self) {
        let held = {
            let mut s = lock(&self.state);
            s.dead = true;
            s.holding = false;
            std::mem::take(&mut s.held)
        };
        drop(held);
    }

    /// Tasks held now.
    pub fn held(&self) -> usize {
        lock(&self.state).held.len()
    }

    /// Waits (bounded) until at least one task is held; whether one is.
    pub fn wait_held(&self, timeout: Duration) -> bool {
        let s = lock(&self.state);
        match self.cv.wait_timeout_while(s, timeout, |s| s.held.is_empty()) {
            Ok((s, _)) => !s.held.is_empty(),
            Err(e) => !e.into_inner().0.held.is_empty(),
        }
    }
}

impl DataTransport for GatedTransport {
    fn protocol(&self) -> &'static str {
        self.inner.protocol()
    }
    fn submit(&self, work: TransportWork) {
        let mut s = lock(&self.state);
        if s.dead {
            drop(s);
            drop(work);
        } else if s.holding {
            s.held.push(work);
            drop(s);
            self.cv.notify_all();
        } else {
            drop(s);
            self.inner.submit(work);
        }
    }
    fn forget_segment(&self, segment: u64) {
        self.inner.forget_segment(segment);
    }
}
