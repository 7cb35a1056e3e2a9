//! What a backend provides for the scenarios.

use kv_transfer_core::drain::ReleasePolicy;
use kv_transfer_core::{
    block_on, EscalationLadder, Exposed, PeerId, Region, RemoteSlots, Reserved, SlotLease, SlotMemory, SlotPool,
    Target, Tenancy, Transfer, TransferError, TransferHandle, TransferOptions,
};
use kv_transfer_testkit::payload::{pattern, Tag};
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A scenario's failure: what was expected and what was seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure(pub String);

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Failure {}

impl Failure {
    /// A failure from anything printable.
    pub fn from_err(what: &str, e: impl fmt::Display) -> Self {
        Self(format!("{what}: {e}"))
    }
}

/// `map_err` helper: `.map_err(|e| fail("what")(&e))` names the step that failed.
pub fn fail(what: &str) -> impl Fn(&dyn fmt::Display) -> Failure + '_ {
    move |e| Failure::from_err(what, e)
}

/// Returns a [`Failure`] unless `cond` holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Failure(format!($($fmt)+)));
        }
    };
}

/// Shape of a rig.
#[derive(Clone, Debug)]
pub struct RigConfig {
    /// Bytes per slot (both sides).
    pub slot_size: usize,
    /// Slots of the decode pool.
    pub decode_slots: usize,
    /// Slots of the prefill pool.
    pub prefill_slots: usize,
    /// The decode pool's escalation ladder.
    pub ladder: EscalationLadder,
    /// Run the prefill side in a separate process (for the crash scenario).
    pub prefill_process: bool,
    /// Give the decode side the means to hold incoming writes (a backend may
    /// buffer held writes whole, which changes what "in flight" means; the
    /// stalled-peer case turns this off).
    pub can_hold: bool,
    /// The decode side's release policy. `Naive` is the positive control:
    /// it frees aborted slots without a proof and drops the checks of who
    /// may settle an exposure (token, authenticated sender), so the
    /// hostile-peer scenarios can show their attacks succeed without them.
    pub policy: ReleasePolicy,
    /// The memory both sides' slots live in. [`SlotMemory::FakeDevice`]
    /// faults on any CPU access through a slot's address, so a cell run on it
    /// (`<scenario>::<backend>_device`, [`OnDevice`]) proves that no path of
    /// the backend dereferences a device slot on the CPU.
    pub memory: SlotMemory,
}

impl RigConfig {
    /// A region of `slots` slots in the configured memory.
    pub fn region(&self, slots: usize) -> Result<Arc<dyn Region>, Failure> {
        self.memory.allocate(slots.max(1) * self.slot_size).map_err(|e| fail("region")(&e))
    }
}

impl Default for RigConfig {
    fn default() -> Self {
        Self {
            slot_size: 1024,
            decode_slots: 8,
            prefill_slots: 16,
            ladder: EscalationLadder::default(),
            prefill_process: false,
            can_hold: true,
            policy: ReleasePolicy::Safe,
            memory: SlotMemory::Host,
        }
    }
}

/// A raw one-sided access, outside any lease: what a buggy or hostile peer
/// can put on the wire. Field values are taken as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawSpec {
    /// Access key.
    pub key: u64,
    /// Target address.
    pub addr: u64,
    /// Slot named.
    pub slot: u32,
    /// Generation named.
    pub generation: u64,
}

/// An exposure to a stalled peer, with the guard that keeps the peer alive.
pub type StalledExposure = (SlotLease<Exposed>, Box<dyn Any>);

/// How the decode side knows who sent a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SenderIdentity {
    /// The transport authenticates the sender (the simulator's connection,
    /// bound when the exposure was made): even a leaked token settles
    /// nothing from anyone else.
    Connection,
    /// The sender is the name it declares (NIXL's agent name, Mooncake's
    /// notify `name`): only the exposure's token tells the peer from a
    /// third party using its name.
    DeclaredName,
}

/// Where backends differ in what a scenario may expect ([`Rig::behaviour`]):
/// data, declared once per backend, not behaviour spread over methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Behaviour {
    /// The decode side can settle an aborted exposure by revoking its
    /// access (`Revoked`) while a write is still held. A backend that cannot
    /// (Mooncake TCP has no per-tenancy key) says `false`; the scenarios then
    /// check that the slots stay quarantined instead.
    pub can_revoke: bool,
    /// A slot whose tenancy was revoked is refused to the same peer until
    /// that peer's ack (core's retry shadows: Mooncake over RDMA, whose
    /// initiator retries a refused slice under whatever key the metadata
    /// holds next). [`Rig::expose`] then waits for the ack (bounded), and a
    /// scenario that needs the slot again at once exposes it to another peer.
    pub shadows_revoked_slots: bool,
    /// A stale write refused by the decode NIC also ends the connection it
    /// came on (RC verbs: `REM_ACCESS_ERR` puts both ends of the queue pair
    /// in ERR, so what was posted behind it is flushed and every exposure on
    /// it settles by the fence). The refusal is then seen by the initiator,
    /// not counted at the target.
    pub stale_write_breaks_connection: bool,
    /// The decode side can settle every exposure to a dead or stalled peer
    /// by fencing it (`Fenced`). A backend that cannot says `false`; the
    /// scenarios then check that the slots stay quarantined.
    pub can_fence: bool,
    /// How the decode side knows who sent a message.
    pub sender_identity: SenderIdentity,
    /// A [`RawPeer::notify`] carries the exposure's token (MORI's statuses
    /// do not: they are bound to the connection instead).
    pub proofs_carry_token: bool,
}

impl Default for Behaviour {
    /// Revokes and fences, names senders by what they declare, proofs carry
    /// the token, no shadows, a refused write ends nothing.
    fn default() -> Self {
        Self {
            can_revoke: true,
            shadows_revoked_slots: false,
            stale_write_breaks_connection: false,
            can_fence: true,
            sender_identity: SenderIdentity::DeclaredName,
            proofs_carry_token: true,
        }
    }
}

/// A peer under the test's direct control that can send notifications the
/// real engines would not (replays, old and future generations).
pub trait RawPeer {
    /// Sends a DONE for `tenancies` of the exposure `remote` describes (its
    /// pool, key and token: this peer is the one it was exposed to).
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure>;
}

/// A backend under test.
pub trait Backend {
    /// Its name.
    fn name(&self) -> &'static str;
    /// `Ok` when it can run here; otherwise what to install.
    fn available(&self) -> Result<(), String>;
    /// A decode side and a prefill side, connected.
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure>;
    /// What its rigs provide beyond the basics. The conformance matrix
    /// lists a cell whose scenario needs something missing as ignored (not
    /// applicable, with why), never as passed; a cell that runs checks that
    /// its rig provides what the backend declared.
    fn provides(&self) -> Provides {
        Provides::default()
    }
    /// Whether CI runs this backend's tests somewhere else when it is not
    /// available here (the verbs backend: in `scripts/rdma-lab`'s guest).
    /// Its tests are then marked ignored even with `CI=true`, never passed.
    fn runs_elsewhere_in_ci(&self) -> bool {
        false
    }
    /// Scenario 2 (the reassignment race) on this backend: its rig in
    /// `kv_transfer_examples::race`, or why it has none (the cells are then
    /// ignored with that reason).
    fn race(&self) -> Result<RaceRunner, &'static str> {
        Err("a race rig of its own (kv_transfer_examples::race has the simulator's, Mooncake's and verbs')")
    }
    /// Requests per policy its race runs when `KVT_RACE_ITERS` does not say
    /// (`None`: the suite's default, 10,000).
    fn race_requests(&self) -> Option<u64> {
        None
    }
    /// The memory its rigs put slots in ([`OnDevice`] says device memory).
    fn memory(&self) -> SlotMemory {
        SlotMemory::Host
    }
}

/// A backend whose rigs put every slot in device memory: device-like memory
/// that faults on the CPU ([`SlotMemory::FakeDevice`], cells named
/// `<scenario>::<backend>_device`), or a CUDA device's (cells named
/// `<scenario>::<backend>_cuda`, run where a GPU is). A backend that cannot
/// take that memory ([`Provides::fake_device`], [`Provides::cuda`]) has them
/// listed as ignored, with why.
pub struct OnDevice {
    inner: Box<dyn Backend>,
    name: &'static str,
    memory: SlotMemory,
}

impl OnDevice {
    /// `inner`, with its slots in `memory` (a device's).
    pub fn new(inner: Box<dyn Backend>, memory: SlotMemory) -> Self {
        // Interned: the matrix builds its backends once per test.
        static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
        let suffix = if let SlotMemory::Cuda { .. } = memory { "cuda" } else { "device" };
        let want = format!("{}_{suffix}", inner.name());
        let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
        let name = match names.iter().find(|n| **n == want) {
            Some(n) => *n,
            None => {
                let n: &'static str = Box::leak(want.into_boxed_str());
                names.push(n);
                n
            }
        };
        Self { inner, name, memory }
    }
}

impl Backend for OnDevice {
    fn name(&self) -> &'static str {
        self.name
    }
    fn available(&self) -> Result<(), String> {
        self.inner.available()
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        self.inner.rig(&RigConfig { memory: self.memory, ..cfg.clone() })
    }
    fn provides(&self) -> Provides {
        self.inner.provides()
    }
    fn runs_elsewhere_in_ci(&self) -> bool {
        self.inner.runs_elsewhere_in_ci()
    }
    fn memory(&self) -> SlotMemory {
        self.memory
    }
    fn race(&self) -> Result<RaceRunner, &'static str> {
        self.inner.race()
    }
    fn race_requests(&self) -> Option<u64> {
        self.inner.race_requests()
    }
}

/// What a backend's rigs provide beyond the basics ([`Backend::provides`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Provides {
    /// A prefill side in a process of its own, which a scenario kills
    /// (`RigConfig::prefill_process`).
    pub prefill_process: bool,
    /// Incoming writes held at the decode side ([`Faults::hold_writes`]).
    pub held_writes: bool,
    /// Settlement by revocation ([`Behaviour::can_revoke`](crate::harness::Behaviour::can_revoke)).
    pub revoke: bool,
    /// Settlement by a fence ([`Behaviour::can_fence`](crate::harness::Behaviour::can_fence)).
    pub fence: bool,
    /// Raw one-sided accesses ([`Faults::raw_write`]).
    pub raw_access: bool,
    /// Malformed frames sent to the decode side ([`Faults::send_malformed`]).
    pub malformed_frames: bool,
    /// A peer under the test's control ([`Faults::raw_peer`]).
    pub raw_peer: bool,
    /// A peer that stalls mid-payload ([`Faults::expose_to_stalled_peer`]).
    pub stalled_peer: bool,
    /// Slots in core's fake device memory ([`RigConfig::memory`]): `Ok`
    /// when the rigs take it, or what the backend lacks for it.
    pub fake_device: Result<(), &'static str>,
    /// Slots in a CUDA device's memory: `Ok` when the rigs take it (the
    /// `_cuda` columns then run where a GPU is), or what the backend lacks.
    pub cuda: Result<(), &'static str>,
}

impl Default for Provides {
    /// Everything but an out-of-process prefill side and device memory.
    fn default() -> Self {
        Self {
            prefill_process: false,
            held_writes: true,
            revoke: true,
            fence: true,
            raw_access: true,
            malformed_frames: true,
            raw_peer: true,
            stalled_peer: true,
            fake_device: Err("device memory in this backend's rigs"),
            cuda: Err("device memory in this backend's rigs"),
        }
    }
}

/// Runs the reassignment race (scenario 2) on one backend.
pub type RaceRunner = fn(
    &kv_transfer_examples::race::RaceConfig,
    &mut dyn FnMut(u64, u64),
) -> Result<kv_transfer_examples::race::RaceReport, kv_transfer_examples::race::RaceError>;

/// A decode lease exposed to a peer, and what describes it to that peer.
pub type Exposure = (SlotLease<Exposed>, RemoteSlots);

/// Exposes `lease` to `peer` through `decode`: a failure names the refusal.
pub fn expose_to(decode: &dyn Target, lease: SlotLease<Reserved>, peer: PeerId) -> Result<Exposure, Failure> {
    decode.expose(lease, peer).map_err(|e| Failure(format!("expose: {}", e.kind)))
}

/// Fills a reserved lease with request `request`'s tagged payload for `remote`'s slots.
pub fn fill_tagged(lease: &mut SlotLease<Reserved>, remote: &RemoteSlots, request: u64) -> Result<(), Failure> {
    for (i, s) in remote.slots.iter().enumerate() {
        let bytes = pattern(remote.slot_size as usize, Tag::new(request, s.slot.0, s.generation.0));
        lease.write_at(i, 0, &bytes).map_err(|e| Failure(format!("local write: {e}")))?;
    }
    Ok(())
}

/// A decode side and a prefill side of one backend, connected: the parts
/// every backend has, as data, and what only some can stage ([`Faults`]).
///
/// The decode side reserves and exposes slots; the prefill side writes into
/// them.
pub struct Rig {
    /// What only this backend can stage. First, so that it is dropped first:
    /// its teardown (held writes let through, a worker reaped, adapters
    /// drained) runs while the parts below are still alive.
    pub faults: Box<dyn Faults>,
    /// The backend's name.
    pub backend: &'static str,
    /// How the backend behaves where backends differ (declared once, as data).
    pub behaviour: Behaviour,
    /// The decode side, which exposes leases of [`decode_pool`](Self::decode_pool).
    /// (Before the pool: the rigs always dropped an adapter before its pool.)
    pub decode: Arc<dyn Target>,
    /// The decode side's pool.
    pub decode_pool: SlotPool,
    /// The prefill side, as [`decode`](Self::decode) numbers it.
    pub prefill_peer: PeerId,
    /// The prefill side, when it runs in this process and is alive (`None`
    /// when it runs in another process, or once crashed).
    pub prefill: Option<PrefillSide>,
}

/// A prefill side in the test's process.
pub struct PrefillSide {
    /// Its `Transfer` (before the pool, as on the decode side).
    pub transfer: Arc<dyn Transfer>,
    /// Its pool.
    pub pool: SlotPool,
}

impl Rig {
    /// Exposes a decode lease to the prefill side ([`Faults::expose`]).
    pub fn expose(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        self.faults.expose(self.decode.as_ref(), self.prefill_peer, lease)
    }

    /// Has the prefill side WRITE request `request`'s tagged payload into
    /// `remote` (with notification). The handle, when the prefill side is in
    /// this process; otherwise [`Faults::write_tagged`] has it written.
    pub fn write_tagged(&self, remote: &RemoteSlots, request: u64) -> Result<Option<TransferHandle>, Failure> {
        let Some(p) = &self.prefill else { return self.faults.write_tagged(remote, request) };
        let mut src = p.pool.reserve(remote.slots.len()).map_err(|e| fail("prefill reserve")(&e))?;
        fill_tagged(&mut src, remote, request)?;
        let h = block_on(p.transfer.write(src, remote, TransferOptions::default()))
            .map_err(|e| Failure(format!("post: {}", e.kind)))?;
        Ok(Some(h))
    }

    /// Kills the prefill side without goodbyes ([`Faults::crash_prefill`]),
    /// then lets go of this rig's handles on it.
    pub fn crash_prefill(&mut self) -> Result<(), Failure> {
        let crashed = self.faults.crash_prefill();
        self.prefill = None;
        crashed
    }

    /// Messages the decode side dropped as forged or stale so far: the
    /// pool's counters, plus what the backend drops before the pool sees it.
    pub fn dropped_messages(&self) -> u64 {
        let m = self.decode_pool.metrics();
        m.forged_rejected + m.stale_rejected + self.faults.dropped_before_the_pool()
    }
}

/// What a backend's rig stages beyond its parts: held writes, a crash, raw
/// accesses, malformed frames, raw, hostile and stalled peers, and the
/// counters to print when a scenario fails. A capability the backend lacks
/// keeps its default (`None` / `false`), and [`Backend::provides`] says so.
pub trait Faults {
    /// Backend counters worth printing when a scenario fails.
    fn diagnostics(&self) -> String;
    /// Exposes a decode lease to the prefill side (`prefill`, as `decode`
    /// numbers it). A backend that must wait, reconnect or look its peer up
    /// again first (see [`Behaviour::shadows_revoked_slots`]) overrides this.
    fn expose(&self, decode: &dyn Target, prefill: PeerId, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        expose_to(decode, lease, prefill)
    }
    /// [`Rig::write_tagged`] where the rig has no prefill side of its own:
    /// one in another process is told to write (no handle); a crashed one
    /// cannot.
    fn write_tagged(&self, _remote: &RemoteSlots, _request: u64) -> Result<Option<TransferHandle>, Failure> {
        Err(Failure("the prefill side is dead".into()))
    }
    /// Starts holding incoming writes at the decode side (false: cannot).
    fn hold_writes(&self) -> bool {
        false
    }
    /// Lets held writes through.
    fn release_writes(&self) {}
    /// Waits (bounded) until at least one write is held.
    fn wait_held(&self, _timeout: Duration) -> bool {
        false
    }
    /// Kills the prefill side without goodbyes (process kill or NIC crash);
    /// [`Rig::crash_prefill`] then drops the rig's own handles on it.
    fn crash_prefill(&mut self) -> Result<(), Failure>;
    /// A raw WRITE of `data` from the prefill side; its terminal status
    /// (`None`: the backend has no raw access).
    fn raw_write(&self, _spec: RawSpec, _data: Vec<u8>) -> Option<Result<(), TransferError>> {
        None
    }
    /// Sends bytes that are not a valid frame to the decode side and waits
    /// until it tore that connection down (`None`: not applicable).
    fn send_malformed(&self) -> Option<Result<(), Failure>> {
        None
    }
    /// Connects a [`RawPeer`] to the decode side; `expose_to_raw` exposes to it
    /// (`None`: the backend has no such peer).
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        None
    }
    /// Exposes a decode lease to the last raw peer connected.
    fn expose_to_raw(&self, _lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        Err(Failure("no raw peer connected".into()))
    }
    /// A hostile third party that claims to be the last raw peer connected
    /// (its name), through a connection, agent or engine of its own: what
    /// anyone can do with the public wire formats (`None`: not possible).
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        None
    }
    /// Messages the decode side dropped as forged or stale before its pool
    /// saw them (the pool counts its own: [`Rig::dropped_messages`]).
    fn dropped_before_the_pool(&self) -> u64 {
        0
    }
    /// Exposes a decode lease to a peer that starts a WRITE, sends half its
    /// payload and then stalls forever without acking (so revocation cannot
    /// drain and only a fence can settle). The guard keeps that peer alive
    /// (`None`: the backend cannot stage one; the lease goes back to the pool).
    fn expose_to_stalled_peer(&self, _lease: SlotLease<Reserved>) -> Option<Result<StalledExposure, Failure>> {
        None
    }
}
