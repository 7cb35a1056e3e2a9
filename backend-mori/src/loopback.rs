//! An in-process [`MoriTransport`]: several engines in one process, bytes
//! copied between registered [`HostBuffer`]s on a worker thread per transport.
//!
//! It is the reference implementation of the transport contract and the test
//! bed of the engine (and of the adapter's unit tests). Faults can be injected
//! at run time through [`LoopbackTransport`]'s methods: a delay per operation,
//! failing the next operations, refusing the next posts, losing notifications
//! (MORI never tells a target of a failure), and a hold gate that stops the
//! worker so operations stay in flight as long as a test wants. It implements
//! [`MoriTransport::fence`]: after a fence, queued operations between the two
//! engines complete with a flush error and move no bytes.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use backend_mori::{loopback::LoopbackFabric, EngineConfig, HostBuffer, IoEngine, MemoryRegion, MoriEngine, StatusCode, Tag};
//!
//! let fabric = LoopbackFabric::new();
//! let a = MoriEngine::new("prefill", EngineConfig::default(), fabric.transport()).unwrap();
//! let b = MoriEngine::new("decode", EngineConfig::default(), fabric.transport()).unwrap();
//! a.register_remote_engine(&b.engine_desc()).unwrap();
//! b.register_remote_engine(&a.engine_desc()).unwrap();
//! let src = HostBuffer::from_vec(vec![7u8; 64]);
//! let dst = HostBuffer::zeroed(64);
//! let src_desc = a.register_memory(MemoryRegion::host(src)).unwrap();
//! let dst_desc = b.register_memory(MemoryRegion::host(dst.clone())).unwrap();
//! let uid = a.allocate_transfer_unique_id();
//! let status = a.write(&src_desc, 0, &dst_desc, 0, 64, uid, Tag::new(3, 1));
//! assert_eq!(status.wait_for(Duration::from_secs(5)), StatusCode::Success);
//! assert_eq!(dst.to_vec(), vec![7u8; 64]);
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::Duration;

use crate::error::TransportError;
use crate::transport::{Completion, MoriTransport, Notification, OpKind, TransportEvent, WorkRequest};
use crate::types::{EngineDesc, EngineKey, HostBuffer, MemoryId, MemoryLocation, MemoryRegion};
use crate::util::lock;

/// Name the loopback publishes in [`EngineDesc::transport`].
pub const LOOPBACK: &str = "loopback";

/// How long the worker sleeps between checks of a closed hold gate.
const GATE_TICK: Duration = Duration::from_millis(20);

/// The shared "wire" of loopback transports. Cloning shares it.
#[derive(Clone, Default)]
pub struct LoopbackFabric {
    hub: Arc<Hub>,
}

impl fmt::Debug for LoopbackFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackFabric").field("endpoints", &lock(&self.hub.endpoints).len()).finish()
    }
}

#[derive(Default)]
struct Hub {
    endpoints: Mutex<HashMap<EngineKey, Arc<Endpoint>>>,
    next_rkey: AtomicU64,
    /// Fenced engine pairs. Workers hold this lock while they copy, so a fence
    /// that inserts a pair waits for a copy in progress and no copy between the
    /// pair starts after it.
    fences: Mutex<HashSet<(EngineKey, EngineKey)>>,
}

fn pair(a: &EngineKey, b: &EngineKey) -> (EngineKey, EngineKey) {
    if a <= b {
        (a.clone(), b.clone())
    } else {
        (b.clone(), a.clone())
    }
}

impl Hub {
    fn endpoint(&self, key: &EngineKey) -> Option<Arc<Endpoint>> {
        lock(&self.endpoints).get(key).cloned()
    }
}

struct Region {
    buffer: HostBuffer,
    rkey: u64,
    busy: usize,
}

#[derive(Default)]
struct Endpoint {
    regions: Mutex<HashMap<MemoryId, Region>>,
    events: Mutex<VecDeque<TransportEvent>>,
    events_cv: Condvar,
}

impl Endpoint {
    fn push_event(&self, event: TransportEvent) {
        lock(&self.events).push_back(event);
        self.events_cv.notify_all();
    }

    /// The buffer of region `id` if `rkey` is its current key; marks it busy.
    fn acquire(&self, id: MemoryId, rkey: u64) -> Option<HostBuffer> {
        let mut regions = lock(&self.regions);
        let region = regions.get_mut(&id).filter(|r| r.rkey == rkey)?;
        region.busy += 1;
        Some(region.buffer.clone())
    }

    fn release(&self, id: MemoryId) {
        if let Some(region) = lock(&self.regions).get_mut(&id) {
            region.busy = region.busy.saturating_sub(1);
        }
    }
}

#[derive(Default)]
struct FaultState {
    delay: Duration,
    fail_next: usize,
    refuse_posts: usize,
    held: bool,
    closed: bool,
    drop_notifications: bool,
    ops_completed: u64,
    notifications_dropped: u64,
}

#[derive(Default)]
struct Faults {
    state: Mutex<FaultState>,
    cv: Condvar,
}

enum Job {
    Op { wr: WorkRequest, local: Arc<Endpoint>, local_buf: HostBuffer, remote: Option<(Arc<Endpoint>, HostBuffer)> },
    Notify { from: EngineKey, to: EngineKey, notification: Notification },
    Message { from: EngineKey, to: EngineKey, bytes: Vec<u8> },
}

impl LoopbackFabric {
    /// A new, empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new transport on this fabric, to give to [`crate::MoriEngine::new`];
    /// keep a clone to inject faults.
    pub fn transport(&self) -> Arc<LoopbackTransport> {
        Arc::new(LoopbackTransport {
            hub: Arc::clone(&self.hub),
            endpoint: Arc::new(Endpoint::default()),
            key: OnceLock::new(),
            tx: Mutex::new(None),
            faults: Arc::new(Faults::default()),
            connected: Mutex::new(HashSet::new()),
        })
    }
}

/// One engine's port on a [`LoopbackFabric`].
pub struct LoopbackTransport {
    hub: Arc<Hub>,
    endpoint: Arc<Endpoint>,
    key: OnceLock<EngineKey>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    faults: Arc<Faults>,
    connected: Mutex<HashSet<EngineKey>>,
}

impl fmt::Debug for LoopbackTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackTransport").field("key", &self.key.get()).finish()
    }
}

impl LoopbackTransport {
    /// Every operation waits `delay` before it runs.
    pub fn set_delay(&self, delay: Duration) {
        lock(&self.faults.state).delay = delay;
    }

    /// The next `n` operations complete with an error, without moving bytes.
    pub fn fail_next_ops(&self, n: usize) {
        lock(&self.faults.state).fail_next = n;
    }

    /// The next `n` calls to `post` are refused at once.
    pub fn refuse_next_posts(&self, n: usize) {
        lock(&self.faults.state).refuse_posts = n;
    }

    /// While `true`, notifications sent through this transport are lost.
    pub fn set_drop_notifications(&self, drop: bool) {
        lock(&self.faults.state).drop_notifications = drop;
    }

    /// Closes the hold gate: the worker stops before its next job, so posted
    /// operations stay in flight (and notifications queue) until [`Self::release`].
    pub fn hold(&self) {
        lock(&self.faults.state).held = true;
    }

    /// Opens the hold gate.
    pub fn release(&self) {
        lock(&self.faults.state).held = false;
        self.faults.cv.notify_all();
    }

    /// Operations completed so far (with or without error).
    pub fn ops_completed(&self) -> u64 {
        lock(&self.faults.state).ops_completed
    }

    /// Notifications lost so far (dropped on purpose or to an unknown engine).
    pub fn notifications_dropped(&self) -> u64 {
        lock(&self.faults.state).notifications_dropped
    }

    fn local_key(&self) -> Result<&EngineKey, TransportError> {
        self.key.get().ok_or_else(|| TransportError::State("transport not attached".to_owned()))
    }

    fn send(&self, job: Job) -> Result<(), TransportError> {
        match lock(&self.tx).as_ref() {
            Some(tx) => tx.send(job).map_err(|_| TransportError::Closed),
            None => Err(TransportError::Closed),
        }
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        if let Some(key) = self.key.get() {
            let mut endpoints = lock(&self.hub.endpoints);
            if endpoints.get(key).is_some_and(|ep| Arc::ptr_eq(ep, &self.endpoint)) {
                endpoints.remove(key);
            }
        }
        lock(&self.tx).take();
        lock(&self.faults.state).closed = true;
        self.faults.cv.notify_all();
    }
}

impl MoriTransport for LoopbackTransport {
    fn name(&self) -> String {
        LOOPBACK.to_owned()
    }

    fn attach(&self, local: &EngineKey) -> Result<Vec<u8>, TransportError> {
        let mut endpoints = lock(&self.hub.endpoints);
        if self.key.get().is_some() {
            return Err(TransportError::State("transport already attached".to_owned()));
        }
        if endpoints.contains_key(local) {
            return Err(TransportError::State(format!("engine {local} already on this fabric")));
        }
        let (tx, rx) = mpsc::channel();
        let worker = Worker { hub: Arc::clone(&self.hub), faults: Arc::clone(&self.faults) };
        thread::Builder::new()
            .name(format!("mori-loopback-{local}"))
            .spawn(move || worker.run(rx))
            .map_err(|e| TransportError::State(format!("cannot start worker: {e}")))?;
        self.key.set(local.clone()).map_err(|_| TransportError::State("transport already attached".to_owned()))?;
        *lock(&self.tx) = Some(tx);
        endpoints.insert(local.clone(), Arc::clone(&self.endpoint));
        Ok(local.as_str().as_bytes().to_vec())
    }

    fn connect(&self, remote: &EngineDesc) -> Result<(), TransportError> {
        if remote.transport != LOOPBACK {
            return Err(TransportError::Unsupported(format!("peer uses transport {}", remote.transport)));
        }
        if self.hub.endpoint(&remote.key).is_none() {
            return Err(TransportError::UnknownPeer(remote.key.clone()));
        }
        let local = self.local_key()?;
        lock(&self.hub.fences).remove(&pair(local, &remote.key));
        lock(&self.connected).insert(remote.key.clone());
        Ok(())
    }

    fn fence(&self, remote: &EngineKey) -> Result<(), TransportError> {
        let local = self.local_key()?;
        lock(&self.connected).remove(remote);
        // Waits for a copy in progress (workers hold this lock while copying).
        lock(&self.hub.fences).insert(pair(local, remote));
        Ok(())
    }

    fn disconnect(&self, remote: &EngineKey) -> Result<(), TransportError> {
        lock(&self.connected).remove(remote);
        Ok(())
    }

    fn register_memory(&self, id: MemoryId, region: &MemoryRegion) -> Result<u64, TransportError> {
        self.local_key()?;
        let Some(buffer) = region.host_buffer() else {
            return Err(match region.location() {
                MemoryLocation::Gpu => TransportError::Unsupported("loopback cannot reach GPU memory".to_owned()),
                MemoryLocation::Cpu => TransportError::Unsupported("loopback needs a HostBuffer".to_owned()),
            });
        };
        let mut regions = lock(&self.endpoint.regions);
        if regions.contains_key(&id) {
            return Err(TransportError::State(format!("memory {id} already registered")));
        }
        let rkey = self.hub.next_rkey.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        regions.insert(id, Region { buffer: buffer.clone(), rkey, busy: 0 });
        Ok(rkey)
    }

    fn deregister_memory(&self, id: MemoryId) -> Result<(), TransportError> {
        let mut regions = lock(&self.endpoint.regions);
        match regions.get(&id) {
            None => Err(TransportError::UnknownMemory { engine: self.local_key()?.clone(), id }),
            Some(region) if region.busy > 0 => Err(TransportError::Busy(id)),
            Some(_) => {
                regions.remove(&id);
                Ok(())
            }
        }
    }

    fn post(&self, wr: WorkRequest) -> Result<(), TransportError> {
        let key = self.local_key()?.clone();
        {
            let mut faults = lock(&self.faults.state);
            if faults.refuse_posts > 0 {
                faults.refuse_posts -= 1;
                return Err(TransportError::Remote("injected post refusal".to_owned()));
            }
        }
        if wr.local.engine_key != key {
            return Err(TransportError::UnknownMemory { engine: wr.local.engine_key.clone(), id: wr.local.id });
        }
        if !lock(&self.connected).contains(&wr.remote.engine_key) {
            return Err(TransportError::UnknownPeer(wr.remote.engine_key.clone()));
        }
        let Some(local_buf) = self.endpoint.acquire(wr.local.id, wr.local.rkey) else {
            return Err(TransportError::UnknownMemory { engine: key, id: wr.local.id });
        };
        // A missing remote region is found at execution, as a NIC would (remote access error).
        let remote = self
            .hub
            .endpoint(&wr.remote.engine_key)
            .and_then(|ep| ep.acquire(wr.remote.id, wr.remote.rkey).map(|buf| (ep, buf)));
        let local = Arc::clone(&self.endpoint);
        let local_id = wr.local.id;
        let job = Job::Op { wr, local, local_buf, remote };
        if let Err(e) = self.send(job) {
            self.endpoint.release(local_id);
            return Err(e);
        }
        Ok(())
    }

    fn notify(&self, to: &EngineKey, notification: Notification) -> Result<(), TransportError> {
        let from = self.local_key()?.clone();
        if !lock(&self.connected).contains(to) {
            return Err(TransportError::UnknownPeer(to.clone()));
        }
        self.send(Job::Notify { from, to: to.clone(), notification })
    }

    fn send_message(&self, to: &EngineKey, bytes: Vec<u8>) -> Result<(), TransportError> {
        let from = self.local_key()?.clone();
        if !lock(&self.connected).contains(to) {
            return Err(TransportError::UnknownPeer(to.clone()));
        }
        self.send(Job::Message { from, to: to.clone(), bytes })
    }

    fn poll(&self, max: usize, timeout: Duration) -> Vec<TransportEvent> {
        let mut events = lock(&self.endpoint.events);
        if events.is_empty() {
            events = self
                .endpoint
                .events_cv
                .wait_timeout_while(events, timeout, |e| e.is_empty())
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let n = events.len().min(max.max(1));
        events.drain(..n).collect()
    }
}

struct Worker {
    hub: Arc<Hub>,
    faults: Arc<Faults>,
}

impl Worker {
    fn run(self, rx: mpsc::Receiver<Job>) {
        // Ends when the transport is dropped (sender gone) and the queue is drained.
        while let Ok(job) = rx.recv() {
            let (delay, drop_notifications) = self.gate();
            if !delay.is_zero() {
                thread::sleep(delay);
            }
            match job {
                Job::Op { wr, local, local_buf, remote } => {
                    let fail = {
                        let mut faults = lock(&self.faults.state);
                        let fail = faults.fail_next > 0;
                        faults.fail_next = faults.fail_next.saturating_sub(1);
                        fail
                    };
                    let result = if fail {
                        Err(TransportError::Remote("injected operation failure".to_owned()))
                    } else {
                        let fences = lock(&self.hub.fences);
                        if fences.contains(&pair(&wr.local.engine_key, &wr.remote.engine_key)) {
                            Err(TransportError::Remote("flushed: connection fenced".to_owned()))
                        } else {
                            copy(&wr, &local_buf, remote.as_ref().map(|(_, buf)| buf))
                        }
                    };
                    local.release(wr.local.id);
                    if let Some((ep, _)) = &remote {
                        ep.release(wr.remote.id);
                    }
                    lock(&self.faults.state).ops_completed += 1;
                    local.push_event(TransportEvent::Completion(Completion { wr_id: wr.wr_id, result }));
                }
                Job::Notify { from, to, notification } => match self.hub.endpoint(&to) {
                    Some(ep) if !drop_notifications && !lock(&self.hub.fences).contains(&pair(&from, &to)) => {
                        ep.push_event(TransportEvent::Notification { from, notification });
                    }
                    _ => lock(&self.faults.state).notifications_dropped += 1,
                },
                Job::Message { from, to, bytes } => match self.hub.endpoint(&to) {
                    Some(ep) if !drop_notifications && !lock(&self.hub.fences).contains(&pair(&from, &to)) => {
                        ep.push_event(TransportEvent::Message { from, bytes });
                    }
                    _ => lock(&self.faults.state).notifications_dropped += 1,
                },
            }
        }
    }

    /// Waits while the hold gate is closed; returns the delay and whether
    /// notifications are dropped.
    fn gate(&self) -> (Duration, bool) {
        let mut faults = lock(&self.faults.state);
        while faults.held && !faults.closed {
            faults = self.faults.cv.wait_timeout(faults, GATE_TICK).unwrap_or_else(|e| e.into_inner()).0;
        }
        (faults.delay, faults.drop_notifications)
    }
}

fn copy(wr: &WorkRequest, local: &HostBuffer, remote: Option<&HostBuffer>) -> Result<(), TransportError> {
    let Some(remote) = remote else {
        return Err(TransportError::UnknownMemory { engine: wr.remote.engine_key.clone(), id: wr.remote.id });
    };
    let len = usize::try_from(wr.len).map_err(|_| TransportError::OutOfBounds)?;
    let mut bytes = vec![0u8; len];
    match wr.op {
        OpKind::Write => {
            local.read_at(wr.local_offset, &mut bytes)?;
            remote.write_at(wr.remote_offset, &bytes)
        }
        OpKind::Read => {
            remote.read_at(wr.remote_offset, &mut bytes)?;
            local.write_at(wr.local_offset, &bytes)
        }
    }
}
