//! The MORI backend on RDMA verbs: MORI-IO's engine and adapter, unchanged,
//! on `backend_mori::verbs::VerbsTransport` (a connection of RC queue pairs
//! per pair of engines, notifications as SENDs behind the WRITEs, a memory
//! window per tenancy), on one of two NICs:
//!
//! - `mori-verbs`: a verbs device (Soft-RoCE in `scripts/rdma-lab`'s guest;
//!   features `mori` and `verbs`);
//! - `mori-verbs-fake`: `backend-verbs`' software NIC ([`FakeFabric`]), on
//!   any host (feature `mori`).
//!
//! Writes can be held on the software NIC (the prefill side's queue pairs
//! to the decode side stop sending), not on a device. Raw accesses and a
//! stalled half-written WRITE cannot be staged from user space (the NIC
//! sends a whole message). A raw peer is a third engine under the test's
//! control that sends MORI notifications of its choosing; its impostor a
//! fourth under the same engine key, with a ticket of its own.

use crate::ensure;
use crate::harness::{
    expose_to, fail, Backend, Behaviour, Exposure, Failure, Faults, PrefillSide, Provides, RawPeer, Rig, RigConfig,
    SenderIdentity,
};
use crate::verbs::Nic;
use backend_mori::harness::{settle_tag, MoriSide};
use backend_mori::verbs::{VerbsTransport, VerbsTransportConfig};
use backend_mori::{EngineConfig, EngineKey, IoEngine, MoriTransport, Notification, StatusCode};
use backend_verbs::{Engine, FakeFabric};
use kv_transfer_core::drain::ReleasePolicy;
use kv_transfer_core::{PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotMemory, Target, Tenancy};
use kv_transfer_testkit::wait::wait_until;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Side = MoriSide<VerbsTransport>;

const WAIT: Duration = Duration::from_secs(10);

static RIGS: AtomicU64 = AtomicU64::new(0);

/// The MORI-on-verbs backends: the software NIC, and the device (feature `verbs`).
pub fn backends() -> Vec<Box<dyn Backend>> {
    #[allow(unused_mut)]
    let mut v: Vec<Box<dyn Backend>> = vec![Box::new(MoriVerbsBackend { nic: Nic::Fake })];
    #[cfg(feature = "verbs")]
    v.push(Box::new(MoriVerbsBackend { nic: Nic::Device }));
    v
}

/// MORI on verbs, on one kind of NIC.
#[derive(Clone, Copy, Debug)]
pub struct MoriVerbsBackend {
    /// The NIC.
    pub nic: Nic,
}

/// Where a rig's engines get their NICs.
#[derive(Clone)]
enum Nics {
    #[cfg(feature = "verbs")]
    Device(backend_verbs::LabEnv),
    Fake(FakeFabric),
}

impl Nics {
    fn nic(&self) -> Result<Arc<dyn Engine>, Failure> {
        match self {
            #[cfg(feature = "verbs")]
            Nics::Device(env) => backend_verbs::DeviceEngine::open(&env.device, 1, env.gid_index)
                .map(|e| e as Arc<dyn Engine>)
                .map_err(|e| fail("verbs device")(&e)),
            Nics::Fake(f) => Ok(Arc::new(f.fake_nic())),
        }
    }

    /// An engine named `key` with an adapter and a pool of `slots` slots.
    fn side(
        &self,
        key: &str,
        slots: usize,
        pool: PoolConfig,
        policy: ReleasePolicy,
        memory: SlotMemory,
    ) -> Result<Side, Failure> {
        let region = RigConfig { slot_size: pool.slot_size, memory, ..RigConfig::default() }.region(slots)?;
        let cfg = VerbsTransportConfig { policy, ..VerbsTransportConfig::default() };
        MoriSide::on_verbs(key, region, pool, cfg, self.nic()?, EngineConfig::default()).map_err(|e| fail(key)(&e))
    }
}

impl Backend for MoriVerbsBackend {
    fn name(&self) -> &'static str {
        match self.nic {
            #[cfg(feature = "verbs")]
            Nic::Device => "mori-verbs",
            Nic::Fake => "mori-verbs-fake",
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
            // MORI registers device memory through the region's copies: the
            // software NIC reaches it; a real NIC needs a dma-buf.
            fake_device: match self.nic {
                #[cfg(feature = "verbs")]
                Nic::Device => Err(crate::verbs::DMABUF),
                Nic::Fake => Ok(()),
            },
            cuda: match self.nic {
                #[cfg(feature = "verbs")]
                Nic::Device => Err(crate::verbs::DMABUF),
                Nic::Fake => Ok(()),
            },
            ..Provides::default()
        }
    }
    fn runs_elsewhere_in_ci(&self) -> bool {
        self.nic.runs_elsewhere_in_ci()
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        if cfg.prefill_process {
            return Err(Failure("the MORI-on-verbs rig has no out-of-process prefill side".into()));
        }
        let n = RIGS.fetch_add(1, Ordering::Relaxed);
        let nics = match self.nic {
            #[cfg(feature = "verbs")]
            Nic::Device => Nics::Device(backend_verbs::LabEnv::from_env()),
            Nic::Fake => Nics::Fake(FakeFabric::new(0x3031 ^ n)),
        };
        let tag = format!("{}-{n}", std::process::id());
        let decode = nics.side(
            &format!("a-decode-{tag}"),
            cfg.decode_slots,
            PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder),
            cfg.policy,
            cfg.memory,
        )?;
        let prefill = nics.side(
            &format!("b-prefill-{tag}"),
            cfg.prefill_slots,
            PoolConfig::new(cfg.slot_size),
            Default::default(),
            cfg.memory,
        )?;
        // The decode side dials (its add_peer goes first).
        let (peer, _) = decode.connect(&prefill).map_err(|e| fail("connect")(&e))?;
        Ok(Rig {
            backend: self.name(),
            behaviour: Behaviour {
                stale_write_breaks_connection: true,
                sender_identity: SenderIdentity::Connection,
                proofs_carry_token: false,
                ..Behaviour::default()
            },
            decode: Arc::new(decode.transfer.clone()),
            decode_pool: decode.pool.clone(),
            prefill_peer: peer,
            prefill: Some(PrefillSide { transfer: Arc::new(prefill.transfer.clone()), pool: prefill.pool.clone() }),
            faults: Box::new(MoriVerbsFaults {
                nics,
                decode,
                prefill: Some(prefill),
                raw: Mutex::new(None),
                memory: cfg.memory,
            }),
        })
    }
}

/// What a MORI-on-verbs rig stages: the prefill side's queue pairs held
/// (on the software NIC), its transport crashed, third and fourth engines
/// as raw and impostor peers.
struct MoriVerbsFaults {
    nics: Nics,
    decode: Side,
    /// `None` once crashed.
    prefill: Option<Side>,
    /// The last raw peer's engine key and the decode side's id for it.
    raw: Mutex<Option<(String, PeerId)>>,
    /// Where every side's slots live.
    memory: SlotMemory,
}

/// A third (or, as an impostor, fourth) engine under the test's control:
/// it sends MORI notifications the real initiator would not.
struct MoriVerbsRawPeer {
    side: Side,
    /// The decode engine's key.
    decode: EngineKey,
    /// The decode pool's memory id and key: a notification for another
    /// key names memory the decode engine does not have.
    mem: u32,
    key: u64,
    seq: u32,
}

impl RawPeer for MoriVerbsRawPeer {
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        let mem = if remote.key == self.key { self.mem } else { u32::MAX >> 1 };
        for t in tenancies {
            let n = Notification {
                seq: self.seq,
                uid: u64::from(self.seq),
                code: StatusCode::Success.raw(),
                message: String::new(),
                tag: settle_tag(mem, *t),
            };
            self.seq = self.seq.wrapping_add(1);
            self.side.transport.notify(&self.decode, n).map_err(|e| fail("raw notify")(&e))?;
        }
        Ok(())
    }
}

impl MoriVerbsFaults {
    /// The prefill side's queue pairs to the decode side (what holding
    /// writes holds on the software NIC).
    fn prefill_qps(&self) -> Vec<u32> {
        self.prefill.as_ref().map(|p| p.transport.queue_pairs(&self.decode.engine.key())).unwrap_or_default()
    }

    /// A raw engine named `key`, connected to the decode side.
    fn raw_side(&self, key: &str) -> Result<MoriVerbsRawPeer, Failure> {
        let side =
            self.nics.side(key, 1, PoolConfig::new(self.decode.pool.slot_size()), Default::default(), self.memory)?;
        let desc = self.decode.transfer.memory_desc(&self.decode.pool).ok_or_else(|| Failure("no memory".into()))?;
        Ok(MoriVerbsRawPeer { side, decode: self.decode.engine.key(), mem: desc.id, key: desc.rkey, seq: 0 })
    }
}

impl Faults for MoriVerbsFaults {
    fn diagnostics(&self) -> String {
        let p = self.prefill.as_ref().map(|p| format!("{:?} {:?}", p.transfer.stats(), p.transport.stats()));
        format!(
            "decode adapter {:?}; engine {:?}; transport {:?}; pool {:?}; prefill {}",
            self.decode.transfer.stats(),
            self.decode.engine.stats(),
            self.decode.transport.stats(),
            self.decode.pool.metrics(),
            p.unwrap_or_else(|| "dead".into())
        )
    }
    fn expose(&self, decode: &dyn Target, prefill: PeerId, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        // A refused stale WRITE ends the connection (RC), and each engine
        // then holds the other fenced until it is registered again: a
        // serving engine re-adds its peer and exposes again. Bounded.
        let deadline = Instant::now() + WAIT;
        let mut lease = lease;
        loop {
            match decode.expose(lease, prefill) {
                Ok(x) => return Ok(x),
                Err(e) if Instant::now() < deadline => {
                    lease = e.lease;
                    if let Some(p) = &self.prefill {
                        let _ = self.decode.connect(p);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(Failure(format!("expose: {}; {}", e.kind, self.diagnostics()))),
            }
        }
    }
    #[allow(irrefutable_let_patterns)]
    fn hold_writes(&self) -> bool {
        let Nics::Fake(f) = &self.nics else { return false };
        let qps = self.prefill_qps();
        qps.iter().for_each(|q| f.hold(*q));
        !qps.is_empty()
    }
    #[allow(irrefutable_let_patterns)]
    fn release_writes(&self) {
        if let Nics::Fake(f) = &self.nics {
            self.prefill_qps().iter().for_each(|q| f.release(*q));
        }
    }
    #[allow(irrefutable_let_patterns)]
    fn wait_held(&self, timeout: Duration) -> bool {
        let Nics::Fake(f) = &self.nics else { return false };
        wait_until(timeout, || self.prefill_qps().iter().any(|q| f.posted(*q) > 0))
    }
    fn crash_prefill(&mut self) -> Result<(), Failure> {
        // Queue pairs to ERR and side channels closed, no goodbye: the
        // decode side learns it from the lifeline (or its next request).
        if let Some(p) = self.prefill.take() {
            p.transport.crash();
        }
        Ok(())
    }
    fn send_malformed(&self) -> Option<Result<(), Failure>> {
        let addr = self.decode.transport.side_channel()?;
        Some((|| {
            let before = self.decode.transport.stats().refused_hellos;
            let mut s = TcpStream::connect(&addr).map_err(|e| fail("side channel")(&e))?;
            s.write_all(&[0xde, 0xad, 0xbe, 0xef, 0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4])
                .map_err(|e| fail("garbage")(&e))?;
            ensure!(
                wait_until(WAIT, || self.decode.transport.stats().refused_hellos > before),
                "the decode side did not refuse a side-channel hello of garbage; {}",
                self.diagnostics()
            );
            // Closed: the read ends (EOF or reset), within the bound.
            s.set_read_timeout(Some(WAIT)).map_err(|e| fail("side channel")(&e))?;
            let mut b = [0u8; 64];
            match s.read(&mut b) {
                Ok(0) => Ok(()),
                Err(e) if !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(()),
                Ok(n) => Err(Failure(format!("the decode side answered garbage with {n} bytes"))),
                Err(e) => Err(Failure(format!("the decode side kept the connection that sent garbage open: {e}"))),
            }
        })())
    }
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = format!("raw-{}-{}", std::process::id(), RIGS.fetch_add(1, Ordering::Relaxed));
            let raw = self.raw_side(&name)?;
            let (id, _) = self.decode.connect(&raw.side).map_err(|e| fail("connect raw peer")(&e))?;
            *self.raw.lock().unwrap_or_else(|p| p.into_inner()) = Some((name, id));
            Ok(Box::new(raw) as Box<dyn RawPeer>)
        })())
    }
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = self.raw.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(n, _)| n.clone());
            let name = name.ok_or_else(|| Failure("no raw peer to impersonate".into()))?;
            // Its own engine, NIC and ticket under the raw peer's key; it
            // dials the decode side with the decode side's descriptor.
            let t = &self.decode.transport;
            let (hellos, qps) = (t.stats().impostor_hellos, t.queue_pairs(&EngineKey::new(&name)));
            let imp = self.raw_side(&name)?;
            imp.side.transfer.add_peer(&self.decode.engine.engine_desc()).map_err(|e| fail("impostor dials")(&e))?;
            // Until the decode side has judged its hello (an impostor's, or,
            // in the positive control, bound in the raw peer's place).
            ensure!(
                wait_until(WAIT, || t.stats().impostor_hellos > hellos || t.queue_pairs(&EngineKey::new(&name)) != qps),
                "the decode side never judged the impostor's hello; {}",
                self.diagnostics()
            );
            Ok(Box::new(imp) as Box<dyn RawPeer>)
        })())
    }
    fn dropped_before_the_pool(&self) -> u64 {
        let s = self.decode.transport.stats();
        s.impostor_messages + s.unbound_messages
    }
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        let Some(id) = self.raw.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(_, id)| *id) else {
            return Err(Failure("no raw peer connected".into()));
        };
        expose_to(&self.decode.transfer, lease, id)
    }
    // No stalled peer: a half-written WRITE cannot be staged from user space.
}

impl Drop for MoriVerbsFaults {
    fn drop(&mut self) {
        self.release_writes();
    }
}
