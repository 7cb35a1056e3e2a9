//! The MORI backend's harness: MORI-IO semantics (engine and adapter) on
//! the TCP simulator's fabric through `backend_mori::SimTransport`, so the
//! simulator's key, bounds and generation checks apply. It has no
//! out-of-process prefill side, so the killed-process crash scenario is
//! skipped; the in-process crash runs.

use crate::ensure;
use crate::harness::{
    expose_to, fail, Backend, Behaviour, Exposure, Failure, Faults, PrefillSide, RawPeer, RawSpec, Rig, RigConfig,
    SenderIdentity, StalledExposure,
};
use crate::sim::{send_garbage, start_stalled_write};
use backend_mori::harness::{raw_sim_peer_desc, settle_tag, MoriSide, RawMoriPeer};
use backend_mori::{EngineConfig, IoEngine, SimTransportConfig, StatusCode};
use backend_tcp_sim::Gate;
use kv_transfer_core::{PeerId, PoolConfig, RemoteSlots, Reserved, SlotLease, Tenancy, TransferError};
use std::any::Any;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The MORI backend (engine + adapter) on the TCP simulator's fabric. Always available.
#[derive(Clone, Copy, Debug, Default)]
pub struct MoriBackend;

/// The MORI harness for the suite.
pub fn backend() -> Option<Box<dyn Backend>> {
    Some(Box::new(MoriBackend))
}

static RIGS: AtomicU64 = AtomicU64::new(0);

impl Backend for MoriBackend {
    fn name(&self) -> &'static str {
        "mori"
    }
    fn available(&self) -> Result<(), String> {
        Ok(())
    }
    fn provides(&self) -> crate::harness::Provides {
        crate::harness::Provides {
            // The simulated NIC copies device memory through the region.
            fake_device: Ok(()),
            cuda: Ok(()),
            ..Default::default()
        }
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        if cfg.prefill_process {
            return Err(Failure("the MORI rig has no out-of-process prefill side".into()));
        }
        let n = RIGS.fetch_add(1, Ordering::Relaxed);
        let gate = cfg.can_hold.then(Gate::new);
        let mut dt = SimTransportConfig::default();
        dt.nic.faults.gate = gate.clone();
        dt.nic.max_wr_bytes = (cfg.slot_size * 4).min(u32::MAX as usize) as u32;
        dt.nic.revoke_wait = Duration::from_millis(200);
        dt.nic.policy = cfg.policy;
        let region = |slots: usize| cfg.region(slots);
        // Keys: the decode side sorts first, so it opens the simulator connection.
        let decode = MoriSide::on_sim(
            &format!("a-decode-{n}"),
            region(cfg.decode_slots)?,
            PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder),
            dt,
            EngineConfig::default(),
        )
        .map_err(|e| fail("decode side")(&e))?;
        let prefill = MoriSide::on_sim(
            &format!("b-prefill-{n}"),
            region(cfg.prefill_slots)?,
            PoolConfig::new(cfg.slot_size),
            SimTransportConfig::default(),
            EngineConfig::default(),
        )
        .map_err(|e| fail("prefill side")(&e))?;
        let (prefill_at_decode, _) = decode.connect(&prefill).map_err(|e| fail("connect")(&e))?;
        Ok(Rig {
            backend: "mori",
            behaviour: Behaviour {
                sender_identity: SenderIdentity::Connection,
                proofs_carry_token: false,
                ..Behaviour::default()
            },
            decode: Arc::new(decode.transfer.clone()),
            decode_pool: decode.pool.clone(),
            prefill_peer: prefill_at_decode,
            prefill: Some(PrefillSide { transfer: Arc::new(prefill.transfer.clone()), pool: prefill.pool.clone() }),
            faults: Box::new(MoriFaults {
                decode,
                prefill: Some(prefill),
                gate,
                slot_size: cfg.slot_size,
                raw: Mutex::new(None),
                raw_name: Mutex::new(None),
            }),
        })
    }
}

/// What a MORI rig stages (two engines with adapters on the simulator's
/// fabric): a gate at the decode NIC that can hold incoming writes, the
/// prefill side's transport crashed, raw wire-level and MORI peers.
struct MoriFaults {
    decode: MoriSide,
    /// `None` once crashed.
    prefill: Option<MoriSide>,
    gate: Option<Gate>,
    slot_size: usize,
    raw: Mutex<Option<PeerId>>,
    /// The last raw peer's engine key (what an impostor's HELLO claims).
    raw_name: Mutex<Option<String>>,
}

impl MoriFaults {
    fn raw_hello(&self, name: &str) -> Result<TcpStream, Failure> {
        let nic = self.decode.transport.nic().ok_or_else(|| Failure("decode NIC not attached".into()))?;
        crate::sim::raw_hello(nic.endpoint(), name)
    }
}

impl MoriFaults {
    /// A raw MORI peer sending statuses that name the decode pool's memory.
    fn raw_mori_peer(&self, peer: RawMoriPeer) -> Result<Box<dyn RawPeer>, Failure> {
        let desc = self.decode.transfer.memory_desc(&self.decode.pool).ok_or_else(|| Failure("no memory".into()))?;
        Ok(Box::new(MoriRawPeer { peer, mem: desc.id, key: desc.rkey }))
    }
}

impl Drop for MoriFaults {
    fn drop(&mut self) {
        self.release_writes();
    }
}

struct MoriRawPeer {
    peer: RawMoriPeer,
    mem: u32,
    key: u64,
}

impl RawPeer for MoriRawPeer {
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        // A key that is not the decode pool's names no memory of it: keep the
        // memory id out of range so the notification is stale.
        let mem = if remote.key == self.key { self.mem } else { u32::MAX >> 1 };
        for t in tenancies {
            self.peer.notify(StatusCode::Success, settle_tag(mem, *t)).map_err(|e| fail("raw notify")(&e))?;
        }
        Ok(())
    }
}

impl Faults for MoriFaults {
    fn diagnostics(&self) -> String {
        let nic = |s: &MoriSide| s.transport.nic().map(|n| format!("{:?}", n.stats())).unwrap_or_default();
        let p =
            self.prefill.as_ref().map(|p| format!("{:?} {:?} NIC {}", p.transfer.stats(), p.engine.stats(), nic(p)));
        format!(
            "decode adapter {:?}; engine {:?}; NIC {}; prefill {}",
            self.decode.transfer.stats(),
            self.decode.engine.stats(),
            nic(&self.decode),
            p.unwrap_or_else(|| "dead".into())
        )
    }
    fn hold_writes(&self) -> bool {
        self.gate.as_ref().map(Gate::hold).is_some()
    }
    fn release_writes(&self) {
        if let Some(g) = &self.gate {
            g.open();
        }
    }
    fn wait_held(&self, timeout: Duration) -> bool {
        self.gate.as_ref().is_some_and(|g| g.wait_for_waiting(1, timeout))
    }
    fn crash_prefill(&mut self) -> Result<(), Failure> {
        if let Some(p) = self.prefill.take() {
            p.transport.crash();
        }
        Ok(())
    }
    fn raw_write(&self, spec: RawSpec, data: Vec<u8>) -> Option<Result<(), TransferError>> {
        let p = self.prefill.as_ref()?;
        let nic = p.transport.nic()?;
        Some(match p.transport.sim_peer(&self.decode.engine.key()) {
            Ok(peer) => crate::sim::raw_write(nic, peer, spec, data),
            Err(e) => Err(TransferError::Transport(e.to_string())),
        })
    }
    fn send_malformed(&self) -> Option<Result<(), Failure>> {
        Some(send_garbage(self.decode.transport.nic()?))
    }
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = format!("raw-{}", RIGS.fetch_add(1, Ordering::Relaxed));
            let peer =
                RawMoriPeer::connect(&name, &self.decode.engine.engine_desc()).map_err(|e| fail("raw peer")(&e))?;
            let nic = self.decode.transport.nic().ok_or_else(|| Failure("decode NIC not attached".into()))?;
            ensure!(nic.wait_for_peer(&name, Duration::from_secs(5)).is_some(), "the raw peer never connected");
            let id = self.decode.transfer.add_peer(peer.desc()).map_err(|e| fail("add raw peer")(&e))?;
            *self.raw.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
            *self.raw_name.lock().unwrap_or_else(|p| p.into_inner()) = Some(name);
            self.raw_mori_peer(peer)
        })())
    }
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = self.raw_name.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let name = name.ok_or_else(|| Failure("no raw peer to impersonate".into()))?;
            // Its own simulator NIC and connection, whose HELLO claims the
            // raw peer's key; never added as a peer.
            let peer =
                RawMoriPeer::connect(&name, &self.decode.engine.engine_desc()).map_err(|e| fail("impostor")(&e))?;
            self.raw_mori_peer(peer)
        })())
    }
    fn dropped_before_the_pool(&self) -> u64 {
        self.decode.transport.impostor_messages()
    }
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        let Some(id) = *self.raw.lock().unwrap_or_else(|p| p.into_inner()) else {
            return Err(Failure("no raw peer connected".into()));
        };
        expose_to(&self.decode.transfer, lease, id)
    }
    fn expose_to_stalled_peer(&self, lease: SlotLease<Reserved>) -> Option<Result<StalledExposure, Failure>> {
        let nic = self.decode.transport.nic()?.clone();
        Some((|| {
            let name = format!("staller-{}", RIGS.fetch_add(1, Ordering::Relaxed));
            let mut s = self.raw_hello(&name)?;
            ensure!(nic.wait_for_peer(&name, Duration::from_secs(5)).is_some(), "the stalled peer never showed up");
            let peer = self
                .decode
                .transfer
                .add_peer(&raw_sim_peer_desc(&name, "127.0.0.1:9"))
                .map_err(|e| fail("add stalled peer")(&e))?;
            let (exposed, remote) = expose_to(&self.decode.transfer, lease, peer)?;
            start_stalled_write(&mut s, &remote, self.slot_size)?;
            Ok((exposed, Box::new(s) as Box<dyn Any>))
        })())
    }
}
