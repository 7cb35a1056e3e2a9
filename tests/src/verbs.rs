//! The verbs backend's harness: a decode and a prefill [`VerbsTransfer`]
//! connected over a loopback side channel, on one of two NICs:
//!
//! - `verbs`: a verbs device (Soft-RoCE in `scripts/rdma-lab`'s guest;
//!   feature `verbs`);
//! - `verbs-fake`: `backend-verbs`' software NIC ([`FakeFabric`]: keys,
//!   windows, RC errors and flushes as the device has them), on any host.
//!
//! Writes cannot be held (the NIC places them), raw accesses are not
//! offered; a raw peer is a third adapter under the test's control, and its
//! impostor a fourth under the same name.

use crate::harness::{
    expose_to, fail, Backend, Behaviour, Exposure, Failure, Faults, PrefillSide, Provides, RawPeer, Rig, RigConfig,
    SenderIdentity,
};
use backend_verbs::{FakeFabric, LabEnv, VerbsConfig, VerbsTransfer};
use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotPool, Target, Tenancy};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Why the verbs columns cannot take device memory here.
pub const DMABUF: &str = "a memory region over GPU memory (GPUDirect RDMA through a dma-buf: a GPU and a NIC that \
                          can, see scripts/device-check.sh)";

/// The verbs backends: the device (feature `verbs`) and the software NIC.
pub fn backends() -> Vec<Box<dyn Backend>> {
    #[allow(unused_mut)]
    let mut v: Vec<Box<dyn Backend>> = vec![Box::new(VerbsBackend { nic: Nic::Fake })];
    #[cfg(feature = "verbs")]
    v.push(Box::new(VerbsBackend { nic: Nic::Device }));
    v
}

static RIGS: AtomicU64 = AtomicU64::new(0);

/// Which NIC a verbs rig runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nic {
    /// A verbs device (`LabEnv`: `KVT_VERBS_DEVICE`).
    #[cfg(feature = "verbs")]
    Device,
    /// A [`FakeFabric`] of the rig's own.
    Fake,
}

impl Nic {
    /// `Ok` where this NIC can run here; otherwise what it needs.
    pub fn available(self) -> Result<(), String> {
        match self {
            #[cfg(feature = "verbs")]
            Nic::Device => {
                let env = LabEnv::from_env();
                backend_verbs::Context::open(&env.device).map(|_| ()).map_err(|e| e.to_string())
            }
            Nic::Fake => Ok(()),
        }
    }

    /// Whether CI runs this NIC's columns elsewhere when it is missing
    /// here: the device's run in the lab's guest, where a missing device fails.
    pub fn runs_elsewhere_in_ci(self) -> bool {
        match self {
            #[cfg(feature = "verbs")]
            Nic::Device => !LabEnv::from_env().in_lab,
            Nic::Fake => false,
        }
    }

    /// Whether writes can be held: the software NIC holds queue pairs; a
    /// device places the WRITEs.
    pub fn holds_writes(self) -> bool {
        matches!(self, Nic::Fake)
    }
}

/// The verbs backend on one kind of NIC.
#[derive(Clone, Copy, Debug)]
pub struct VerbsBackend {
    /// The NIC.
    pub nic: Nic,
}

/// Where a rig's adapters get their NIC.
#[derive(Clone)]
enum Engines {
    #[cfg(feature = "verbs")]
    Device,
    Fake(FakeFabric),
}

impl Engines {
    fn adapter(&self, c: VerbsConfig) -> Result<VerbsTransfer, Failure> {
        self.adapter_on(c).map(|(t, _)| t)
    }

    /// The adapter, and its NIC's index on the fake fabric.
    fn adapter_on(&self, c: VerbsConfig) -> Result<(VerbsTransfer, Option<usize>), Failure> {
        let t = match self {
            #[cfg(feature = "verbs")]
            Engines::Device => VerbsTransfer::new(c).map(|t| (t, None)),
            Engines::Fake(f) => {
                let nic = f.fake_nic();
                let id = nic.id();
                VerbsTransfer::with_engine(c, Arc::new(nic)).map(|t| (t, Some(id)))
            }
        };
        t.map_err(|e| fail("verbs adapter")(&e))
    }

    /// The fake fabric's queue pairs of NIC `nic`.
    fn queue_pairs_of(&self, nic: Option<usize>) -> Vec<u32> {
        match (self, nic) {
            (Engines::Fake(f), Some(n)) => f.queue_pairs().into_iter().filter(|q| q.1 == n).map(|q| q.0).collect(),
            _ => Vec::new(),
        }
    }
}

fn adapter(engines: &Engines, name: &str, cfg: &RigConfig) -> Result<(VerbsTransfer, Option<usize>), Failure> {
    let env = LabEnv::from_env();
    let mut c = VerbsConfig::new(
        format!("{name}-{}-{}", std::process::id(), RIGS.fetch_add(1, Ordering::Relaxed)),
        env.device,
        env.gid_index,
    );
    c.release_policy = cfg.policy;
    engines.adapter_on(c)
}

impl Backend for VerbsBackend {
    fn name(&self) -> &'static str {
        match self.nic {
            #[cfg(feature = "verbs")]
            Nic::Device => "verbs",
            Nic::Fake => "verbs-fake",
        }
    }
    fn available(&self) -> Result<(), String> {
        self.nic.available()
    }
    fn provides(&self) -> Provides {
        Provides {
            held_writes: self.nic.holds_writes(),
            // Verbs gives no raw access from user space, and a WRITE is the
            // NIC's whole message: it cannot be stalled half sent.
            raw_access: false,
            stalled_peer: false,
            // The side channel refuses a bad hello before any frame.
            malformed_frames: false,
            // The software NIC moves bytes through the region's copies, as
            // a GPUDirect NIC's DMA reaches device memory; a real NIC needs
            // the device memory registered through a dma-buf.
            fake_device: match self.nic {
                #[cfg(feature = "verbs")]
                Nic::Device => Err(DMABUF),
                Nic::Fake => Ok(()),
            },
            cuda: match self.nic {
                #[cfg(feature = "verbs")]
                Nic::Device => Err(DMABUF),
                Nic::Fake => Ok(()),
            },
            ..Provides::default()
        }
    }
    fn runs_elsewhere_in_ci(&self) -> bool {
        self.nic.runs_elsewhere_in_ci()
    }
    fn race(&self) -> Result<crate::harness::RaceRunner, &'static str> {
        match self.nic {
            #[cfg(feature = "verbs")]
            Nic::Device => Ok(kv_transfer_examples::race::verbs::run_verbs_race),
            Nic::Fake => Err("a NIC that delays a WRITE queued behind a large one (the race's hold); the software \
                 NIC places a WRITE when it is posted"),
        }
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        if cfg.prefill_process {
            return Err(Failure("the verbs rig has no out-of-process prefill side".into()));
        }
        let engines = match self.nic {
            #[cfg(feature = "verbs")]
            Nic::Device => Engines::Device,
            Nic::Fake => Engines::Fake(FakeFabric::new(0x5eed ^ RIGS.load(Ordering::Relaxed))),
        };
        let (decode, _) = adapter(&engines, "decode", cfg)?;
        let decode = Arc::new(decode);
        let region = |n: usize| cfg.region(n);
        let dpool = decode
            .register_pool(region(cfg.decode_slots)?, PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder))
            .map_err(|e| fail("decode pool")(&e))?;
        let (prefill, prefill_nic) =
            adapter(&engines, "prefill", &RigConfig { policy: Default::default(), ..cfg.clone() })?;
        let prefill = Arc::new(prefill);
        let ppool = prefill
            .register_pool(region(cfg.prefill_slots)?, PoolConfig::new(cfg.slot_size))
            .map_err(|e| fail("prefill pool")(&e))?;
        prefill.add_peer(decode.descriptor()).map_err(|e| fail("prefill adds decode")(&e))?;
        let prefill_peer = decode.add_peer(prefill.descriptor()).map_err(|e| fail("decode adds prefill")(&e))?;
        let prefill_name = prefill.descriptor().rsplit_once('@').map(|(n, _)| n.to_owned()).unwrap_or_default();
        Ok(Rig {
            faults: Box::new(VerbsFaults {
                engines,
                decode: decode.clone(),
                dpool: dpool.clone(),
                prefill: Arc::downgrade(&prefill),
                prefill_name,
                prefill_nic,
                raw: Mutex::new(None),
            }),
            backend: self.name(),
            behaviour: Behaviour {
                stale_write_breaks_connection: true,
                sender_identity: SenderIdentity::Connection,
                ..Behaviour::default()
            },
            decode,
            decode_pool: dpool,
            prefill_peer,
            prefill: Some(PrefillSide { transfer: prefill, pool: ppool }),
        })
    }
}

/// What a verbs rig stages: the prefill side's send queues held (on the
/// software NIC), third and fourth adapters as raw and impostor peers.
struct VerbsFaults {
    engines: Engines,
    decode: Arc<VerbsTransfer>,
    dpool: SlotPool,
    /// For its counters: weak, so that a crash (the rig letting go of it)
    /// drops the adapter.
    prefill: Weak<VerbsTransfer>,
    /// The prefill adapter's name: the decode side's peer for it is looked
    /// up each time (a rejected access costs a reconnect, under a new id).
    prefill_name: String,
    /// The prefill adapter's NIC on the fake fabric (its send queues are
    /// what `hold_writes` holds).
    prefill_nic: Option<usize>,
    /// The last raw peer: its name and the decode side's id for it.
    raw: Mutex<Option<(String, PeerId)>>,
}

/// A third adapter under the test's control: it sends control messages the
/// real initiator would not.
struct VerbsRawPeer {
    adapter: VerbsTransfer,
    /// The decode side, as this adapter numbers it.
    decode: PeerId,
}

impl RawPeer for VerbsRawPeer {
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        let m = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, tenancies.to_vec());
        self.adapter.send_control(self.decode, &m).map_err(|e| fail("raw DONE")(&e))
    }
}

impl VerbsFaults {
    /// An adapter named `name` (exactly), connected to the decode side.
    fn raw_adapter(&self, name: &str) -> Result<VerbsRawPeer, Failure> {
        let env = LabEnv::from_env();
        let adapter = self.engines.adapter(VerbsConfig::new(name, env.device, env.gid_index))?;
        let decode = adapter.add_peer(self.decode.descriptor()).map_err(|e| fail("raw adds decode")(&e))?;
        Ok(VerbsRawPeer { adapter, decode })
    }
}

impl Faults for VerbsFaults {
    fn diagnostics(&self) -> String {
        format!(
            "decode {:?} {:?}; prefill {:?}",
            self.decode.counters(),
            self.dpool.metrics(),
            self.prefill.upgrade().map(|t| t.counters())
        )
    }
    /// Exposes to the prefill side as the decode side names it now (not
    /// `prefill`: a reconnect after a fence gives it a new id).
    fn expose(&self, decode: &dyn Target, _prefill: PeerId, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        // Bounded: a reconnect after a fence takes a few milliseconds. An
        // exposure refused because the connection just died is tried again
        // on the new one, as a serving engine would.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut lease = lease;
        loop {
            let Some(peer) = self.decode.peer_named(&self.prefill_name) else {
                if std::time::Instant::now() >= deadline {
                    return Err(Failure(format!("the prefill side is not connected: {}", self.diagnostics())));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            match decode.expose(lease, peer) {
                Ok(x) => return Ok(x),
                Err(e) if std::time::Instant::now() < deadline => {
                    lease = e.lease;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(Failure(format!("expose: {}; {}", e.kind, self.diagnostics()))),
            }
        }
    }
    #[allow(irrefutable_let_patterns)]
    fn hold_writes(&self) -> bool {
        // The fake fabric holds the prefill side's send queues (its WRITEs
        // and the DONEs behind them stay posted); a device places them.
        let Engines::Fake(f) = &self.engines else { return false };
        for q in self.engines.queue_pairs_of(self.prefill_nic) {
            f.hold(q);
        }
        self.prefill_nic.is_some()
    }
    #[allow(irrefutable_let_patterns)]
    fn release_writes(&self) {
        if let Engines::Fake(f) = &self.engines {
            for q in self.engines.queue_pairs_of(self.prefill_nic) {
                f.release(q);
            }
        }
    }
    #[allow(irrefutable_let_patterns)]
    fn wait_held(&self, timeout: Duration) -> bool {
        let Engines::Fake(f) = &self.engines else { return false };
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.engines.queue_pairs_of(self.prefill_nic).iter().any(|q| f.posted(*q) > 0) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    fn crash_prefill(&mut self) -> Result<(), Failure> {
        // Nothing to strike: as the rig drops the prefill adapter (the only
        // strong handle), its QPs go to ERR without a goodbye; the decode
        // side learns it at its next request on that QP, or its ladder
        // fences it.
        Ok(())
    }
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = format!("raw-{}-{}", std::process::id(), RIGS.fetch_add(1, Ordering::Relaxed));
            let raw = self.raw_adapter(&name)?;
            // The decode side adds its descriptor (a connection is the raw
            // peer's only once its owner confirms it), then finds it by name:
            // bounded wait.
            self.decode.add_peer(raw.adapter.descriptor()).map_err(|e| fail("decode adds raw")(&e))?;
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let id = loop {
                match self.decode.peer_named(&name) {
                    Some(id) => break id,
                    None if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
                    None => return Err(Failure("the raw peer never connected".into())),
                }
            };
            *self.raw.lock().unwrap_or_else(|p| p.into_inner()) = Some((name, id));
            Ok(Box::new(raw) as Box<dyn RawPeer>)
        })())
    }
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = self.raw.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(n, _)| n.clone());
            let name = name.ok_or_else(|| Failure("no raw peer to impersonate".into()))?;
            // Its own QP, under the raw peer's name.
            Ok(Box::new(self.raw_adapter(&name)?) as Box<dyn RawPeer>)
        })())
    }
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        let Some(id) = self.raw.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(_, id)| *id) else {
            return Err(Failure("no raw peer connected".into()));
        };
        expose_to(self.decode.as_ref(), lease, id)
    }
    // No stalled peer: a stalled WRITE cannot be staged from user space
    // (the NIC sends the whole message).
}
