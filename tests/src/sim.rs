//! The TCP simulator's harness: the reference [`Backend`] implementation.

use crate::ensure;
use crate::harness::{
    expose_to, fail, Backend, Behaviour, Exposure, Failure, Faults, PrefillSide, Provides, RawPeer, RawSpec, Rig,
    RigConfig, SenderIdentity, StalledExposure,
};
use backend_tcp_sim::wire::{self, Body};
use backend_tcp_sim::{FaultPlan, Gate, NicConfig, RawAccess, SimNic};
use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{
    Generation, PeerId, PoolConfig, RemoteSlots, Reserved, SlotId, SlotLease, Tenancy, TransferError, TransferHandle,
};
use kv_transfer_testkit::wait::wait_until;
use std::any::Any;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The TCP simulator. Always available.
#[derive(Clone, Debug, Default)]
pub struct SimBackend {
    /// Path of the `prefill-worker` binary, for rigs whose prefill side runs
    /// in a separate process (`RigConfig::prefill_process`).
    pub prefill_worker: Option<PathBuf>,
}

static RIGS: AtomicU64 = AtomicU64::new(0);

/// Opens a raw wire-level connection to the simulator NIC at `endpoint`
/// and completes the HELLO exchange as peer `name`: a peer that speaks the
/// wire format by hand, for the stale, malformed and stalled-peer scenarios.
pub(crate) fn raw_hello(endpoint: &str, name: &str) -> Result<TcpStream, Failure> {
    let mut s = TcpStream::connect(endpoint).map_err(|e| fail("raw connect")(&e))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| fail("timeout")(&e))?;
    let key = kv_transfer_core::auth::ClusterKey::from_env().map_err(|e| fail("cluster key")(&e))?;
    wire::authenticate_dialed(&mut s, &key, name, "127.0.0.1:9", endpoint).map_err(|e| fail("peer handshake")(&e))?;
    let hello = wire::encode_head(&Body::Hello { name: name.into(), endpoint: "127.0.0.1:9".into() }, 0)
        .map_err(|e| fail("encode")(&e))?;
    s.write_all(&hello).map_err(|e| fail("raw hello")(&e))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| fail("timeout")(&e))?;
    let mut pre = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut pre).map_err(|e| fail("raw hello reply")(&e))?;
    let p = wire::decode_prefix(&pre).map_err(|e| fail("hello reply")(&e))?;
    let mut f = vec![0u8; p.fields_len()];
    s.read_exact(&mut f).map_err(|e| fail("raw hello reply")(&e))?;
    Ok(s)
}

/// A raw WRITE from `nic` to `peer` (as `nic` numbers it): its terminal status.
pub(crate) fn raw_write(nic: &SimNic, peer: PeerId, spec: RawSpec, data: Vec<u8>) -> Result<(), TransferError> {
    let a =
        RawAccess { key: spec.key, addr: spec.addr, slot: SlotId(spec.slot), generation: Generation(spec.generation) };
    let h = nic.write_raw(peer, a, bytes::Bytes::from(data)).map_err(|e| TransferError::Transport(e.to_string()))?;
    match h.wait(Duration::from_secs(10)) {
        Some(r) => r.map(|_| ()),
        None => Err(TransferError::Transport("no terminal status within 10 s".into())),
    }
}

/// Sends bytes that are no frame to the decode NIC `nic` over a raw
/// connection of its own, and waits until the NIC counted them and tore that
/// connection down.
pub(crate) fn send_garbage(nic: &SimNic) -> Result<(), Failure> {
    let before = nic.stats().malformed_frames;
    let name = format!("garbler-{}", RIGS.fetch_add(1, Ordering::Relaxed));
    let mut s = raw_hello(nic.endpoint(), &name)?;
    ensure!(wait_until(Duration::from_secs(5), || nic.peer_by_name(&name).is_some()), "the raw peer never showed up");
    s.write_all(&[0xde, 0xad, 0xbe, 0xef, 0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4]).map_err(|e| fail("garbage")(&e))?;
    ensure!(
        wait_until(Duration::from_secs(5), || nic.stats().malformed_frames > before
            && nic.peer_by_name(&name).is_none()),
        "the decode NIC did not tear down the connection that sent garbage"
    );
    Ok(())
}

/// Starts a WRITE of one slot (`slot_size` bytes) into `remote`'s first slot
/// over a raw wire client and sends only half its payload: the target's NIC
/// holds the access in flight, and the client never finishes it.
pub(crate) fn start_stalled_write(s: &mut TcpStream, remote: &RemoteSlots, slot_size: usize) -> Result<(), Failure> {
    let h = RawAccess::of(remote, 0).ok_or_else(|| Failure("no slot to stall on".into()))?.header(1, slot_size as u32);
    let head = wire::encode_head(&Body::Write(h), slot_size).map_err(|e| fail("encode")(&e))?;
    s.write_all(&head).map_err(|e| fail("stalled write")(&e))?;
    s.write_all(&vec![0x5a; slot_size / 2]).map_err(|e| fail("stalled write")(&e))
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "tcp-sim"
    }
    fn available(&self) -> Result<(), String> {
        Ok(())
    }
    fn race(&self) -> Result<crate::harness::RaceRunner, &'static str> {
        Ok(kv_transfer_examples::race::run_race)
    }
    fn provides(&self) -> Provides {
        // Device slots are staged through host buffers by the NIC.
        Provides {
            prefill_process: self.prefill_worker.is_some(),
            fake_device: Ok(()),
            cuda: Ok(()),
            ..Provides::default()
        }
    }
    fn rig(&self, cfg: &RigConfig) -> Result<Rig, Failure> {
        let n = RIGS.fetch_add(1, Ordering::Relaxed);
        let gate = cfg.can_hold.then(Gate::new);
        let mut dcfg = NicConfig::new(format!("decode-{n}"))
            .with_policy(cfg.policy)
            .with_faults(FaultPlan { gate: gate.clone(), ..FaultPlan::default() })
            .with_max_wr_bytes((cfg.slot_size * 4).min(u32::MAX as usize) as u32);
        dcfg.revoke_wait = Duration::from_millis(200);
        let decode = SimNic::start(dcfg).map_err(|e| fail("decode NIC")(&e))?;
        let region = cfg.region(cfg.decode_slots)?;
        let decode_pool = decode
            .register_pool(region, PoolConfig::new(cfg.slot_size).with_ladder(cfg.ladder))
            .map_err(|e| fail("decode pool")(&e))?;
        let pname = format!("prefill-{n}-{}", std::process::id());
        let (prefill_peer, prefill, in_process) = if cfg.prefill_process {
            let Some(worker) = &self.prefill_worker else {
                return Err(Failure("the out-of-process rig needs the prefill-worker binary".into()));
            };
            let mut child = Command::new(worker)
                .args([decode.endpoint(), &pname, &cfg.slot_size.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| fail("spawning prefill-worker")(&e))?;
            let stdin = child.stdin.take();
            let peer = decode.wait_for_peer(&pname, Duration::from_secs(20));
            let (Some(stdin), Some(peer)) = (stdin, peer) else {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Failure("prefill-worker did not connect".into()));
            };
            (peer, Prefill::Process { child, stdin }, None)
        } else {
            let nic = SimNic::start(NicConfig::new(pname.clone())).map_err(|e| fail("prefill NIC")(&e))?;
            let region = cfg.region(cfg.prefill_slots)?;
            let pool =
                nic.register_pool(region, PoolConfig::new(cfg.slot_size)).map_err(|e| fail("prefill pool")(&e))?;
            let decode_at_prefill = nic.connect(decode.endpoint()).map_err(|e| fail("connect")(&e))?;
            let peer = decode
                .wait_for_peer(&pname, Duration::from_secs(5))
                .ok_or_else(|| Failure("prefill did not connect".into()))?;
            let side = PrefillSide { transfer: Arc::new(nic.clone()), pool };
            (peer, Prefill::InProcess { nic, decode_at_prefill }, Some(side))
        };
        Ok(Rig {
            faults: Box::new(SimFaults {
                decode: decode.clone(),
                gate,
                prefill,
                slot_size: cfg.slot_size,
                raw: std::sync::Mutex::new(None),
            }),
            backend: "tcp-sim",
            behaviour: Behaviour { sender_identity: SenderIdentity::Connection, ..Behaviour::default() },
            decode: Arc::new(decode),
            decode_pool,
            prefill_peer,
            prefill: in_process,
        })
    }
}

/// The prefill side, as the faults reach it (its pool and `Transfer`, when
/// in this process, are the rig's).
enum Prefill {
    InProcess { nic: SimNic, decode_at_prefill: PeerId },
    Process { child: Child, stdin: ChildStdin },
    Dead,
}

/// What a TCP-simulator rig stages: a gate at the decode NIC that can hold
/// incoming writes, a prefill NIC in this process or a `prefill-worker`
/// child to crash, and raw wire-level peers.
struct SimFaults {
    decode: SimNic,
    gate: Option<Gate>,
    prefill: Prefill,
    slot_size: usize,
    /// The last raw peer, as the decode NIC numbers it, and its name.
    raw: std::sync::Mutex<Option<(PeerId, String)>>,
}

struct SimRawPeer(TcpStream);

impl RawPeer for SimRawPeer {
    fn notify(&mut self, remote: &RemoteSlots, tenancies: &[Tenancy]) -> Result<(), Failure> {
        let m = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, tenancies.to_vec());
        let f = wire::encode_head(&Body::Control(m), 0).map_err(|e| fail("encode")(&e))?;
        self.0.write_all(&f).map_err(|e| fail("raw notify")(&e))
    }
}

impl SimFaults {
    fn raw_hello(&self, name: &str) -> Result<TcpStream, Failure> {
        raw_hello(self.decode.endpoint(), name)
    }
}

impl Drop for SimFaults {
    fn drop(&mut self) {
        self.release_writes();
        if let Prefill::Process { child, .. } = &mut self.prefill {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Faults for SimFaults {
    fn diagnostics(&self) -> String {
        let p = match &self.prefill {
            Prefill::InProcess { nic, .. } => format!("{:?}", nic.stats()),
            _ => "out of process".into(),
        };
        format!("decode NIC {:?}; prefill NIC {p}", self.decode.stats())
    }
    fn write_tagged(&self, remote: &RemoteSlots, request: u64) -> Result<Option<TransferHandle>, Failure> {
        let Prefill::Process { stdin, .. } = &self.prefill else {
            return Err(Failure("the prefill side is dead".into()));
        };
        let line = serde_json::json!({ "remote": remote, "request": request, "repeat": 4 }).to_string();
        let mut w: &ChildStdin = stdin;
        writeln!(w, "{line}").and_then(|()| w.flush()).map_err(|e| fail("worker stdin")(&e))?;
        Ok(None)
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
        match std::mem::replace(&mut self.prefill, Prefill::Dead) {
            Prefill::InProcess { nic, .. } => nic.crash(),
            Prefill::Process { mut child, .. } => {
                child.kill().map_err(|e| fail("kill prefill-worker")(&e))?;
                child.wait().map_err(|e| fail("reap prefill-worker")(&e))?;
            }
            Prefill::Dead => {}
        }
        Ok(())
    }
    fn raw_write(&self, spec: RawSpec, data: Vec<u8>) -> Option<Result<(), TransferError>> {
        let Prefill::InProcess { nic, decode_at_prefill } = &self.prefill else { return None };
        Some(raw_write(nic, *decode_at_prefill, spec, data))
    }
    fn send_malformed(&self) -> Option<Result<(), Failure>> {
        Some(send_garbage(&self.decode))
    }
    fn raw_peer(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        Some((|| {
            let name = format!("raw-{}", RIGS.fetch_add(1, Ordering::Relaxed));
            let s = self.raw_hello(&name)?;
            let peer = self
                .decode
                .wait_for_peer(&name, Duration::from_secs(5))
                .ok_or_else(|| Failure("the raw peer never showed up".into()))?;
            *self.raw.lock().unwrap_or_else(|p| p.into_inner()) = Some((peer, name));
            Ok(Box::new(SimRawPeer(s)) as Box<dyn RawPeer>)
        })())
    }
    fn impostor(&self) -> Option<Result<Box<dyn RawPeer>, Failure>> {
        let name = self.raw.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(_, n)| n.clone());
        Some(match name {
            // Same HELLO, its own connection.
            Some(name) => self.raw_hello(&name).map(|s| Box::new(SimRawPeer(s)) as Box<dyn RawPeer>),
            None => Err(Failure("no raw peer to impersonate".into())),
        })
    }
    fn expose_to_raw(&self, lease: SlotLease<Reserved>) -> Result<Exposure, Failure> {
        let Some(peer) = self.raw.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(p, _)| *p) else {
            return Err(Failure("no raw peer connected".into()));
        };
        expose_to(&self.decode, lease, peer)
    }
    fn expose_to_stalled_peer(&self, lease: SlotLease<Reserved>) -> Option<Result<StalledExposure, Failure>> {
        Some((|| {
            let name = format!("staller-{}", RIGS.fetch_add(1, Ordering::Relaxed));
            let mut s = self.raw_hello(&name)?;
            let peer = self
                .decode
                .wait_for_peer(&name, Duration::from_secs(5))
                .ok_or_else(|| Failure("the stalled peer never showed up".into()))?;
            let (exposed, remote) = expose_to(&self.decode, lease, peer)?;
            start_stalled_write(&mut s, &remote, self.slot_size)?;
            Ok((exposed, Box::new(s) as Box<dyn Any>))
        })())
    }
}
