//! The real engine: one NIXL agent with one UCX backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::{EngineError, RegId, ReqId, XferState};
use super::raw::{Agent, AgentConfig, Backend, NixlLibrary, Registration, XferRequest};
use super::types::{IdMap, MemRegion, Notification, XferSpec};
use super::NixlEngine;

/// How to build a [`RealNixlEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// The agent's name; must be unique among the peers.
    pub name: String,
    /// Agent options (progress thread etc.).
    pub agent: AgentConfig,
    /// The backend plugin; `"UCX"`.
    pub plugin: String,
    /// Parameters applied on top of the plugin's defaults.
    pub backend_params: Vec<(String, String)>,
    /// On drop, how long to keep polling requests that are still in progress
    /// before leaking them (and the agent) instead of releasing them.
    pub drain_on_drop: Duration,
}

impl EngineConfig {
    /// UCX with default parameters, [`AgentConfig::default`] (progress thread on),
    /// 2 s drain on drop.
    pub fn ucx(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            agent: AgentConfig::default(),
            plugin: "UCX".into(),
            backend_params: Vec::new(),
            drain_on_drop: Duration::from_secs(2),
        }
    }
}

struct Entry {
    req: XferRequest,
    /// Last state seen by `post` or `status`; `None` before the first post.
    last: Option<Result<XferState, ()>>,
}

#[derive(Default)]
struct Tables {
    next: u64,
    reqs: IdMap<ReqId, Entry>,
    regs: HashMap<RegId, Registration>,
}

/// [`NixlEngine`] over the real library: one agent, one backend.
///
/// Guards on top of raw NIXL: `release_xfer` refuses a posted request that is not
/// terminal; `deregister` refuses while any request is unreleased;
/// `invalidate_remote_metadata` refuses while requests to that peer are
/// unreleased. On drop, live requests are polled up to `drain_on_drop`; any still
/// in progress are leaked together with the agent and all registrations.
pub struct RealNixlEngine {
    // Field order is drop order: tables (requests, registrations), then the
    // backend, then the agent, whose `Arc` children already keep it alive.
    tables: Mutex<Tables>,
    backend: Backend,
    agent: Arc<Agent>,
    drain_on_drop: Duration,
}

impl std::fmt::Debug for RealNixlEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNixlEngine")
            .field("agent", &self.agent.name())
            .field("backend", &self.backend.plugin())
            .finish_non_exhaustive()
    }
}

impl RealNixlEngine {
    /// Loads the library and builds the agent and its backend.
    pub fn new(cfg: EngineConfig) -> Result<Self, EngineError> {
        let lib = NixlLibrary::load()?;
        Self::with_library(&lib, cfg)
    }

    /// Builds on an already loaded library.
    pub fn with_library(lib: &NixlLibrary, cfg: EngineConfig) -> Result<Self, EngineError> {
        let agent = Agent::new(lib, &cfg.name, &cfg.agent)?;
        let backend = agent.create_backend(&cfg.plugin, &cfg.backend_params)?;
        Ok(Self { tables: Mutex::new(Tables::default()), backend, agent, drain_on_drop: cfg.drain_on_drop })
    }

    /// The agent, for raw calls (benchmarks, hazard tests).
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Number of requests created and not yet released.
    pub fn live_requests(&self) -> usize {
        self.tables().reqs.len()
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        // Table updates are single inserts/removes; a poisoned lock holds a
        // consistent map.
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Posts a request (or re-posts a completed one), recording what the post said.
    fn post_entry(id: ReqId, e: &mut Entry) -> Result<XferState, EngineError> {
        // A request may be re-posted once it completed (NIXL allows it); never
        // while it may be in progress, nor after an error.
        if e.req.is_posted() && e.last != Some(Ok(XferState::Done)) {
            return Err(EngineError::InvalidArgument(format!("{id} already posted and not completed")));
        }
        match e.req.post() {
            Ok(st) => {
                e.last = Some(Ok(st));
                Ok(st)
            }
            Err(source) => {
                e.last = Some(Err(()));
                Err(EngineError::PostFailed { id, source })
            }
        }
    }

    fn poll_entry(id: ReqId, e: &mut Entry) -> Result<XferState, EngineError> {
        match e.req.status() {
            Ok(st) => {
                e.last = Some(Ok(st));
                Ok(st)
            }
            Err(err) => {
                e.last = Some(Err(()));
                tracing::debug!(%id, error = %err, "transfer failed");
                Err(err.into())
            }
        }
    }
}

impl NixlEngine for RealNixlEngine {
    fn agent_name(&self) -> String {
        self.agent.name().to_owned()
    }

    unsafe fn register_mem(&self, regions: &[MemRegion]) -> Result<RegId, EngineError> {
        // SAFETY: forwarded: the caller upholds the same contract.
        let reg = unsafe { self.agent.register_mem(regions, Some(&self.backend)) }?;
        let mut t = self.tables();
        t.next += 1;
        let id = RegId(t.next);
        t.regs.insert(id, reg);
        Ok(id)
    }

    fn deregister(&self, id: RegId) -> Result<(), EngineError> {
        let mut t = self.tables();
        if !t.regs.contains_key(&id) {
            return Err(EngineError::UnknownRegistration(id));
        }
        if !t.reqs.is_empty() {
            return Err(EngineError::Busy { what: format!("deregister {id}"), live: t.reqs.len() });
        }
        match t.regs.remove(&id) {
            Some(reg) => reg.deregister(),
            None => Err(EngineError::UnknownRegistration(id)),
        }
    }

    fn local_metadata(&self) -> Result<Vec<u8>, EngineError> {
        self.agent.local_metadata()
    }

    fn load_remote_metadata(&self, metadata: &[u8]) -> Result<String, EngineError> {
        self.agent.load_remote_metadata(metadata)
    }

    fn invalidate_remote_metadata(&self, remote_agent: &str) -> Result<(), EngineError> {
        let t = self.tables();
        let live = t.reqs.values().filter(|e| e.req.remote_agent() == remote_agent).count();
        if live > 0 {
            return Err(EngineError::Busy { what: format!("invalidate metadata of {remote_agent:?}"), live });
        }
        self.agent.invalidate_remote_metadata(remote_agent)
    }

    fn create_xfer(&self, spec: &XferSpec) -> Result<ReqId, EngineError> {
        let req = self.agent.create_xfer(
            spec.op,
            &spec.local,
            &spec.remote,
            &spec.remote_agent,
            spec.notif.as_deref(),
            Some(&self.backend),
        )?;
        let mut t = self.tables();
        t.next += 1;
        let id = ReqId(t.next);
        t.reqs.insert(id, Entry { req, last: None });
        Ok(id)
    }

    fn post_xfer(&self, id: ReqId) -> Result<XferState, EngineError> {
        let mut t = self.tables();
        let e = t.reqs.get_mut(&id).ok_or(EngineError::UnknownRequest(id))?;
        Self::post_entry(id, e)
    }

    fn post_xfer_polled(
        &self,
        id: ReqId,
        poll: bool,
    ) -> (Result<XferState, EngineError>, Option<Result<XferState, EngineError>>) {
        let mut t = self.tables();
        let Some(e) = t.reqs.get_mut(&id) else { return (Err(EngineError::UnknownRequest(id)), None) };
        let posted = Self::post_entry(id, e);
        let polled = (poll && matches!(posted, Ok(XferState::InProgress))).then(|| Self::poll_entry(id, e));
        (posted, polled)
    }

    fn xfer_status(&self, id: ReqId) -> Result<XferState, EngineError> {
        let mut t = self.tables();
        let e = t.reqs.get_mut(&id).ok_or(EngineError::UnknownRequest(id))?;
        if !e.req.is_posted() {
            return Err(EngineError::InvalidArgument(format!("{id} not posted")));
        }
        Self::poll_entry(id, e)
    }

    fn release_xfer(&self, id: ReqId) -> Result<(), EngineError> {
        let mut t = self.tables();
        let e = t.reqs.get_mut(&id).ok_or(EngineError::UnknownRequest(id))?;
        if e.req.is_posted() && e.last != Some(Ok(XferState::Done)) {
            // Re-poll: a request that failed is terminal, one in progress is not.
            if let Ok(XferState::InProgress) = Self::poll_entry(id, e) {
                return Err(EngineError::StillInProgress(id));
            }
        }
        let Some(e) = t.reqs.remove(&id) else {
            return Err(EngineError::UnknownRequest(id));
        };
        match e.req.release() {
            Ok(()) => Ok(()),
            Err((req, err)) => {
                t.reqs.insert(id, Entry { req, last: e.last });
                Err(err.into())
            }
        }
    }

    fn get_notifs(&self) -> Result<Vec<Notification>, EngineError> {
        self.agent.get_notifs()
    }

    fn gen_notif(&self, remote_agent: &str, msg: &[u8]) -> Result<(), EngineError> {
        self.agent.gen_notif(remote_agent, msg)
    }
}

impl Drop for RealNixlEngine {
    fn drop(&mut self) {
        let t = self.tables.get_mut().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + self.drain_on_drop;
        let mut leaked = false;
        let ids: Vec<ReqId> = t.reqs.keys().copied().collect();
        for id in ids {
            let Some(e) = t.reqs.remove(&id) else {
                continue;
            };
            let mut st = if e.req.is_posted() { e.req.status() } else { Ok(XferState::Done) };
            // Bounded drain: by time, and by count as a second bound.
            let mut polls = 0u32;
            while matches!(st, Ok(XferState::InProgress)) && Instant::now() < deadline && polls < 10_000_000 {
                std::thread::yield_now();
                st = e.req.status();
                polls += 1;
            }
            if matches!(st, Ok(XferState::InProgress)) {
                leaked = true;
            }
            // XferRequest's own drop releases a terminal request and leaks one
            // still in progress (with an extra reference to the agent).
            drop(e);
        }
        if leaked {
            tracing::warn!(
                agent = %self.agent.name(),
                "requests still in progress at drop: leaking registrations and agent"
            );
            for (_, reg) in t.regs.drain() {
                reg.leak();
            }
        }
    }
}
