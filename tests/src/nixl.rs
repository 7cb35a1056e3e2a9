//! The NIXL backend's harness: the adapter ([`NixlTransfer`]) over the real
//! library, two agents in this process (UCX on host memory), metadata
//! exchanged in memory.
//!
//! - **Decode side**: one agent without NIXL's progress thread; the adapter's
//!   driver is its only progress ([`Progress::Driver`]), through an engine
//!   wrapper ([`GatedEngine`]) that can stop polling. With UCX over TCP a
//!   target that makes no progress lets no incoming WRITE complete: the bytes
//!   wait in the socket and the initiator's request stays `IN_PROG`. That is
//!   how the rig holds incoming writes at the decode side
//!   ([`Faults::hold_writes`]), and only when every UCX transport in use is `tcp`
//!   (or `self`): shared memory and CMA write without the target's help.
//! - **Prefill side**: another agent, gated the same way, so that
//!   [`Faults::crash_prefill`] can freeze it: from then on it never progresses,
//!   never observes a completion, never sends a notification or an ack (what
//!   it already put on the wire still lands). As the decode side sees it,
//!   that is a crash without goodbyes; the agent itself is leaked, never
//!   destroyed under a possible write.
//! - **Raw peer**: a third agent that sends the adapter's notifications with
//!   whatever tenancies the test names (replays, old and future generations).
//! - **Stalled peer**: a third agent that completes one WRITE, then freezes
//!   and posts another, without notification, into the exposed slot.
//!
//! `UCX_TLS` is set to `tcp` once, before this process creates any agent,
//! unless the caller set it (as `backend-nixl`'s own tests do): UCX reads its
//! environment when an agent is created, and it is process-wide.
//!
//! What NIXL cannot do, reported absent: revoke one tenancy's access, or
//! fence a peer with a confirmation ([`Behaviour::can_revoke`](crate::harness::Behaviour::can_revoke) and
//! [`Behaviour::can_fence`](crate::harness::Behaviour::can_fence) are false: the adapter's `Revoke`/`Fence` escalations
//! produce no proof, and aborted slots stay quarantined until the peer
//! acknowledges, or for good, reported stuck); a raw one-sided access checked
//! at the target ([`Faults::raw_write`] is `None`: NIXL checks no key, slot bound
//! or generation at write time, so only our initiator-side checks stand
//! between a buggy peer and the memory); a malformed frame that tears a
//! connection down ([`Faults::send_malformed`] is `None`: a notification that
//! does not parse is dropped and counted, the connection stays). The prefill
//! side always runs in this process (no killed-process variant).

use crate::harness::{
    expose_to, fail, Backend, Behaviour, Exposure, Failure, Faults, PrefillSide, Provides, RawPeer, Rig, RigConfig,
    StalledExposure,
};
use backend_nixl::engine::{AgentConfig, NixlLibrary, INSTALL_HINT};
use backend_nixl::{
    AdapterConfig, EngineConfig, EngineError, MemRegion, NixlEngine, NixlTransfer, Notification, Progress,
    RealNixlEngine, RegId, ReqId, XferSpec, XferState,
};
use backend_tcp_sim::block_on;
use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{
    HostRegion, PeerId, PoolConfig, PoolId, RemoteSlots, Reserved, SlotLease, SlotPool, Tenancy, Transfer,
    TransferOptions,
};
use kv_transfer_testkit::wait::{poll_until, wait_until};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

/// The NIXL harness, wired into the suite.
pub fn backend() -> Option<Box<dyn Backend>> {
    Some(Box::new(NixlBackend::default()))
}

/// The real NIXL library behind our adapter. Available where
/// `libnixl_capi.so` loads (see `backend-nixl`'s search order).
#[derive(Clone, Debug, Default)]
pub struct NixlBackend {
    _private: (),
}

/// How long the rig waits for one step of its own.
const WAIT: Duration = Duration::from_secs(10);

/// How long a rig's teardown waits for each side to drain before leaking.
const TEARDOWN: Duration = Duration::from_secs(2);

static AGENTS: AtomicU64 = AtomicU64::new(0);

fn unique(what: &str) -> String {
    format!("kvt-suite-{what}-{}-{}", std::process::id(), AGENTS.fetch_add(1, Ordering::Relaxed))
}

/// Sets `UCX_TLS=tcp` unless set, once, before any agent of this harness exists.
fn prepare_env() {
    static ENV: Once = Once::new();
    ENV.call_once(|| {
        if std::env::var_os("UCX_TLS").is_none() {
            std::env::set_var("UCX_TLS", "tcp");
        }
    });
}

/// Whether every UCX transport allowed is one through which a target that
/// makes no progress receives nothing (loopback TCP, or UCX's `self`).
fn transports_need_target_progress() -> bool {
    std::env::var("UCX_TLS").is_ok_and(|v| {
        let mut any = false;
        let all = v.split(',').map(str::trim).all(|t| {
            any |= t == "tcp";
            t == "tcp" || t == "self"
        });
        any && all
    })
}

impl Backend for NixlBackend {
    fn name(&self) -> &'static str {
        "nixl"
    }
    fn provides(&self) -> Provides {
        prepare_env();
        Provides {
            // Held by not progressing the target: only where UCX cannot
            // place a write without the target's progress.
            held_writes: transports_need_target_progress(),
            // Drain and ack only (its CAPABILITIES).
            revoke: false,
            fence: false,
            // The wire is UCX's.
            raw_access: false,
            malformed_frames: false,
            fake_device: Err("VRAM registration of real GPU memory (the `_cuda` column: scripts/device-check.sh)"),
            cuda: Ok(()),
            ..Provides::default()
        }
    }
    fn available(&self) -> Result<(), String> {
        prepare_env();
        match NixlLibrary::load() {
            Ok(_) => Ok(()),
            Err(e) => {
                let msg = e.to_string();
                if msg.contains(INSTALL_HINT) {
                    Err(msg)
                } else {
                    Err(format!("{msg}; install with `{INSTALL_HINT}`"))
                }
            }
        }
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        prepare_env();
        rig(cfg)
    }
}

/// A [`RealNixlEngine`] for an agent without NIXL's progress thread, whose
/// only progress is our adapter's polling, and which the test can stop:
///
/// - **held**: `get_notifs` neither progresses the agent nor returns
///   anything, so incoming data and notifications wait (over UCX's TCP
///   transport, in the socket);
/// - **frozen** (a crash, as the peers see it): besides, `xfer_status`
///   reports `IN_PROG` without progressing (the initiator never learns that a
///   request ended, so it never sends its notification or an ack) and
///   `gen_notif` fails. Posting still goes through: a frozen agent's last
///   post puts its bytes on the wire and then the agent is silent for good.
///
/// Everything else is passed through.
pub struct GatedEngine {
    inner: RealNixlEngine,
    held: AtomicBool,
    frozen: AtomicBool,
    /// Taken around each real `get_notifs`, so that once [`hold`](Self::hold)
    /// returned no poll that may progress the agent is running.
    polling: Mutex<()>,
}

impl GatedEngine {
    /// Wraps `inner`, not held.
    pub fn new(inner: RealNixlEngine) -> Self {
        Self { inner, held: AtomicBool::new(false), frozen: AtomicBool::new(false), polling: Mutex::new(()) }
    }
    /// An agent named `name` without NIXL's progress thread, gated.
    pub fn start(name: String) -> Result<Self, EngineError> {
        let mut ec = EngineConfig::ucx(name);
        ec.agent = AgentConfig { progress_thread: false, ..AgentConfig::default() };
        Ok(Self::new(RealNixlEngine::new(ec)?))
    }
    /// Freezes the agent for good (see the type's docs); returns once no poll is running.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
        self.hold();
    }
    /// Whether the agent is frozen.
    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::SeqCst)
    }
    /// Stops polling; returns once no poll is running.
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
        drop(self.polling.lock().unwrap_or_else(|p| p.into_inner()));
    }
    /// Lets polling go on (not for a frozen agent).
    pub fn open(&self) {
        self.held.store(false, Ordering::SeqCst);
    }
    /// Whether polling is stopped.
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::SeqCst) || self.is_frozen()
    }
}

impl NixlEngine for GatedEngine {
    fn agent_name(&self) -> String {
        self.inner.agent_name()
    }
    unsafe fn register_mem(&self, regions: &[MemRegion]) -> Result<RegId, EngineError> {
        // SAFETY: the caller keeps the contract of `NixlEngine::register_mem`,
        // which is passed on unchanged.
        unsafe { self.inner.register_mem(regions) }
    }
    fn deregister(&self, id: RegId) -> Result<(), EngineError> {
        self.inner.deregister(id)
    }
    fn local_metadata(&self) -> Result<Vec<u8>, EngineError> {
        self.inner.local_metadata()
    }
    fn load_remote_metadata(&self, metadata: &[u8]) -> Result<String, EngineError> {
        self.inner.load_remote_metadata(metadata)
    }
    fn invalidate_remote_metadata(&self, remote_agent: &str) -> Result<(), EngineError> {
        self.inner.invalidate_remote_metadata(remote_agent)
    }
    fn create_xfer(&self, spec: &XferSpec) -> Result<ReqId, EngineError> {
        self.inner.create_xfer(spec)
    }
    fn post_xfer(&self, id: ReqId) -> Result<XferState, EngineError> {
        self.inner.post_xfer(id)
    }
    fn xfer_status(&self, id: ReqId) -> Result<XferState, EngineError> {
        let _g = self.polling.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_frozen() {
            return Ok(XferState::InProgress);
        }
        self.inner.xfer_status(id)
    }
    fn release_xfer(&self, id: ReqId) -> Result<(), EngineError> {
        self.inner.release_xfer(id)
    }
    fn get_notifs(&self) -> Result<Vec<Notification>, EngineError> {
        let _g = self.polling.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_held() {
            return Ok(Vec::new());
        }
        self.inner.get_notifs()
    }
    fn gen_notif(&self, remote_agent: &str, msg: &[u8]) -> Result<(), EngineError> {
        if self.is_frozen() {
            return Err(EngineError::InvalidArgument(format!("{} is frozen (crashed)", self.agent_name())));
        }
        self.inner.gen_notif(remote_agent, msg)
    }
}

/// What a NIXL rig stages: its agents' gates (held writes, a frozen prefill
/// agent), and third agents as raw, impostor and stalled peers.
struct NixlFaults {
    decode: Arc<NixlTransfer>,
    gate: Arc<GatedEngine>,
    dpool: SlotPool,
    /// Kept past a crash: a frozen agent is shut down with the rig, never
    /// dropped under a possible write.
    prefill: Arc<NixlTransfer>,
    pgate: Arc<GatedEngine>,
    /// Something will never settle (a crashed or stalled peer): teardown waits less.
    doomed: AtomicBool,
    can_hold: bool,
    /// The last raw peer, as the decode side numbers it.
    raw: Mutex<Option<PeerId>>,
    /// Its agent name (what an impostor agent is created under).
    raw_name: Mutex<Option<String>>,
    /// The keys of exposures to raw peers.
    keys: Keys,
}

/// Registration keys (`RemoteSlots::key`) and the pools they belong to.
type Keys = Arc<Mutex<HashMap<u64, PoolId>>>;

fn register(t: &NixlTransfer, slots: usize, slot_size: usize, cfg: PoolConfig) -> Result<SlotPool, Failure> {
    let bytes = slots.checked_mul(slot_size).ok_or_else(|| Failure("pool size overflows".into()))?;
    let region = HostRegion::new(bytes).map_err(|e| fail("region")(&e))?;
    t.register_pool(Arc::new(region), cfg).map_err(|e| fail("register pool")(&e))
}

/// Decode and prefill agents in this process, each behind the adapter.
fn rig(cfg: &RigConfig) -> Result<Rig, Failure> {
    let gate = Arc::new(GatedEngine::start(unique("decode")).map_err(|e| fail("decode agent")(&e))?);
    let dcfg = AdapterConfig { release_policy: cfg.policy, ..driven(TEARDOWN) };
    let decode = Arc::new(NixlTransfer::new(gate.clone(), dcfg).map_err(|e| fail("decode adapter")(&e))?);
    let dpool =
        register(&decode, cfg.decode_slots, cfg.slot_size, PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder))?;
    let pgate = Arc::new(GatedEngine::start(unique("prefill")).map_err(|e| fail("prefill agent")(&e))?);
    let prefill =
        Arc::new(NixlTransfer::new(pgate.clone(), driven(TEARDOWN)).map_err(|e| fail("prefill adapter")(&e))?);
    let ppool = register(&prefill, cfg.prefill_slots, cfg.slot_size, PoolConfig::new(cfg.slot_size))?;
    // Metadata after registration: each side learns the other's memory.
    let dmd = decode.local_metadata().map_err(|e| fail("decode metadata")(&e))?;
    prefill.add_peer(&dmd).map_err(|e| fail("prefill loads decode metadata")(&e))?;
    let pmd = prefill.local_metadata().map_err(|e| fail("prefill metadata")(&e))?;
    let peer = decode.add_peer(&pmd).map_err(|e| fail("decode loads prefill metadata")(&e))?;
    Ok(Rig {
        faults: Box::new(NixlFaults {
            decode: decode.clone(),
            gate,
            dpool: dpool.clone(),
            prefill: prefill.clone(),
            pgate,
            doomed: AtomicBool::new(false),
            can_hold: cfg.can_hold && transports_need_target_progress(),
            raw: Mutex::new(None),
            raw_name: Mutex::new(None),
            keys: Keys::default(),
        }),
        backend: "nixl",
        behaviour: Behaviour { can_revoke: false, can_fence: false, ..Behaviour::default() },
        decode,
        decode_pool: dpool,
        prefill_peer: peer,
        prefill: Some(PrefillSide { transfer: prefill, pool: ppool }),
    })
}

/// Adapter settings for an agent whose only progress is the adapter's driver.
fn driven(teardown_timeout: Duration) -> AdapterConfig {
    AdapterConfig { progress: Progress::Driver, teardown_timeout, ..AdapterConfig::default() }
}

impl Drop for NixlFaults {
    fn drop(&mut self) {
        self.gate.open();
        // The prefill side first: it drains its requests and sends its last
        // messages, which may settle the decode side's exposures. What cannot
        // drain is leaked by the adapter (never freed under a NIC).
        let doomed = self.doomed.load(Ordering::SeqCst) || self.pgate.is_frozen();
        let wait = if doomed { Duration::from_millis(200) } else { TEARDOWN };
        let rp = self.prefill.shutdown(if self.pgate.is_frozen() { Duration::ZERO } else { wait });
        let rd = self.decode.shutdown(wait);
        if rp.leaked + rd.leaked > 0 {
            eprintln!("[nixl] rig teardown left work outstanding (leaked safely): prefill {rp:?}, decode {rd:?}");
        }
    }
}

impl NixlFaults {
    /// A third agent that completes one WRITE (so its connection is up), then
    /// freezes and posts a WRITE into `lease`'s slots without a notification:
    /// its bytes go out, and it never observes completion, never notifies,
    /// never answers an ABORT.
    fn stalled(&self, lease: SlotLease<Reserved>) -> Result<StalledExposure, Failure> {
        self.doomed.store(true, Ordering::SeqCst);
        let slot = self.dpool.slot_size();
        let gate = Arc::new(GatedEngine::start(unique("staller")).map_err(|e| fail("staller agent")(&e))?);
        let t = NixlTransfer::new(gate.clone(), driven(Duration::from_millis(100)))
            .map_err(|e| fail("staller adapter")(&e))?;
        let spool = register(&t, 1, slot, PoolConfig::new(slot))?;
        let dmd = self.decode.local_metadata().map_err(|e| fail("decode metadata")(&e))?;
        t.add_peer(&dmd).map_err(|e| fail("staller loads decode metadata")(&e))?;
        let smd = t.local_metadata().map_err(|e| fail("staller metadata")(&e))?;
        let peer = self.decode.add_peer(&smd).map_err(|e| fail("decode loads staller metadata")(&e))?;
        // A complete, notified WRITE first.
        let warm = self.dpool.reserve(1).map_err(|e| fail("reserve")(&e))?;
        let (wexp, wremote) = expose_to(self.decode.as_ref(), warm, peer)?;
        let src = spool.reserve(1).map_err(|e| fail("staller reserve")(&e))?;
        let mut h = block_on(t.write(src, &wremote, TransferOptions::default()))
            .map_err(|e| Failure(format!("staller post: {}", e.kind)))?;
        let out = poll_until(std::pin::Pin::new(&mut h), WAIT)
            .ok_or_else(|| Failure("the staller's first WRITE never completed".into()))?
            .map_err(|e| fail("the staller's first WRITE")(&e))?;
        out.result.map_err(|e| fail("the staller's first WRITE")(&e))?;
        let mut f = Box::pin(wexp.settled());
        poll_until(f.as_mut(), WAIT)
            .ok_or_else(|| Failure("the staller's first WRITE never settled".into()))?
            .release();
        // Then the WRITE it never finishes.
        let (exposed, remote) = expose_to(self.decode.as_ref(), lease, peer)?;
        gate.freeze();
        // Without an attached notification: NIXL may complete a request inside
        // the post and send its notification from there, which would be an ack.
        let h = block_on(t.write(out.lease.into_reserved(), &remote, TransferOptions::notify(false)))
            .map_err(|e| Failure(format!("staller post: {}", e.kind)))?;
        Ok((exposed, Box::new((h, t, gate, spool)) as Box<dyn Any>))
    }
}

/// A NIXL agent under the test's control, sending adapter notifications.
struct NixlRawPeer {
    engine: RealNixlEngine,
    /// The decode agent's name.
    decode: String,
    /// Registration keys the decode side handed out, and their pools.
    keys: Keys,
}

impl RawPeer for NixlRawPeer {
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        // The adapter's messages name the pool, not the key: a key that is not the
        // decode pool's names a pool that does not exist.
        let known = self.keys.lock().unwrap_or_else(|p| p.into_inner()).get(&remote.key).copied();
        let pool = known.unwrap_or(PoolId(u64::MAX));
        let msg = ControlMessage::new(ControlKind::Done, pool, remote.token, tenancies.to_vec());
        let text = msg.encode_text().map_err(|e| fail("encode")(&e))?;
        self.engine.gen_notif(&self.decode, text.as_bytes()).map_err(|e| fail("raw notify")(&e))
    }
}

impl NixlFaults {
    /// A real agent named `name` that loaded the decode side's metadata
    /// (so it can notify it), and the decode agent's name.
    fn agent_towards_decode(&self, name: &str) -> Result<(RealNixlEngine, String), Failure> {
        let engine = RealNixlEngine::new(EngineConfig::ucx(name)).map_err(|e| fail("raw agent")(&e))?;
        let dmd = self.decode.local_metadata().map_err(|e| fail("decode metadata")(&e))?;
        let decode = engine.load_remote_metadata(&dmd).map_err(|e| fail("raw loads decode metadata")(&e))?;
        Ok((engine, decode))
    }
}

impl Faults for NixlFaults {
    fn diagnostics(&self) -> String {
        format!(
            "decode adapter {:?}; prefill adapter {:?}; held {}",
            self.decode.metrics(),
            self.prefill.metrics(),
            self.gate.is_held()
        )
    }
    fn hold_writes(&self) -> bool {
        if self.can_hold {
            self.gate.hold();
        }
        self.can_hold
    }
    fn release_writes(&self) {
        self.gate.open();
    }
    fn wait_held(&self, timeout: Duration) -> bool {
        // Held: the decode agent makes no progress, so a posted WRITE stays in
        // flight (`IN_PROG` at the prefill side) until the writes are let through.
        self.gate.is_held() && wait_until(timeout, || self.prefill.metrics().in_flight > 0)
    }
    fn crash_prefill(&mut self) -> Result<(), Failure> {
        // As the decode side sees it, a crash: no progress, no completion, no
        // notification or ack ever again; what is already on the wire lands.
        self.pgate.freeze();
        Ok(())
    }
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = unique("raw");
            let (engine, decode) = self.agent_towards_decode(&name)?;
            let rmd = engine.local_metadata().map_err(|e| fail("raw metadata")(&e))?;
            let peer = self.decode.add_peer(&rmd).map_err(|e| fail("decode loads raw metadata")(&e))?;
            *self.raw.lock().unwrap_or_else(|p| p.into_inner()) = Some(peer);
            *self.raw_name.lock().unwrap_or_else(|p| p.into_inner()) = Some(name);
            Ok(Box::new(NixlRawPeer { engine, decode, keys: Arc::clone(&self.keys) }) as Box<dyn RawPeer>)
        })())
    }
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = self.raw_name.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let name = name.ok_or_else(|| Failure("no raw peer to impersonate".into()))?;
            // A second, real agent under the raw peer's name; the decode side
            // never loads its metadata.
            let (engine, decode) = self.agent_towards_decode(&name)?;
            Ok(Box::new(NixlRawPeer { engine, decode, keys: Arc::clone(&self.keys) }) as Box<dyn RawPeer>)
        })())
    }
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        let Some(peer) = *self.raw.lock().unwrap_or_else(|p| p.into_inner()) else {
            return Err(Failure("no raw peer connected".into()));
        };
        let (exposed, remote) = expose_to(self.decode.as_ref(), lease, peer)?;
        self.keys.lock().unwrap_or_else(|p| p.into_inner()).insert(remote.key, remote.pool);
        Ok((exposed, remote))
    }
    fn expose_to_stalled_peer(&self, lease: SlotLease<Reserved>) -> Option<Result<StalledExposure, Failure>> {
        Some(self.stalled(lease))
    }
}
