//! MORI-IO's semantics on RDMA verbs ([`VerbsTransport`]): the engine and
//! the adapter, unchanged, over queue pairs, SENDs and memory windows, on
//! two NICs:
//!
//! - `fake`: `backend-verbs`' software NIC ([`FakeFabric`]), on any host;
//! - `device`: a verbs device (feature `verbs-device`; Soft-RoCE in
//!   `scripts/rdma-lab`'s guest, where a missing device fails). Elsewhere
//!   these cases show as ignored, with what they need.
//!
//! Every case checks bytes, and every wait is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mori::harness::MoriSide;
use backend_mori::verbs::{Access, VerbsTransport, VerbsTransportConfig};
use backend_mori::{EngineConfig, IoEngine, MemoryDesc, StatusCode, Tag};
use backend_tcp_sim::block_on;
use backend_verbs::{Engine, FakeFabric};
use kv_transfer_core::{
    EscalationLadder, Exposed, HostRegion, PeerId, PoolConfig, RemoteSlots, Settled, SlotLease, Transfer,
    TransferOptions,
};

const SLOT: usize = 64 * 1024;
const LONG: Duration = Duration::from_secs(10);

type Side = MoriSide<VerbsTransport>;
type Check = fn(&Nics) -> Result<(), String>;

/// Where a case's two engines get their NICs.
enum Nics {
    Fake(FakeFabric),
    #[cfg(feature = "verbs-device")]
    Device(backend_verbs::LabEnv),
}

impl Nics {
    fn nic(&self) -> Result<Arc<dyn Engine>, String> {
        match self {
            Nics::Fake(f) => Ok(Arc::new(f.fake_nic())),
            #[cfg(feature = "verbs-device")]
            Nics::Device(env) => backend_verbs::DeviceEngine::open(&env.device, 1, env.gid_index)
                .map(|e| e as Arc<dyn Engine>)
                .map_err(|e| e.to_string()),
        }
    }
}

struct Pair {
    decode: Side,
    prefill: Side,
    /// Prefill as decode numbers it.
    prefill_at_decode: PeerId,
}

fn pair(nics: &Nics, slots: usize, access: Access) -> Result<Pair, String> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let side = |name: &str, pool: PoolConfig| -> Result<Side, String> {
        let region = Arc::new(HostRegion::new(slots * SLOT).map_err(|e| e.to_string())?);
        let cfg = VerbsTransportConfig { access, ..VerbsTransportConfig::default() };
        MoriSide::on_verbs(&format!("{name}-{n}"), region, pool, cfg, nics.nic()?, EngineConfig::default())
            .map_err(|e| format!("{name}: {e}"))
    };
    let ladder = EscalationLadder::default();
    let decode = side("a-decode", PoolConfig::new(SLOT).with_ladder(ladder))?;
    let prefill = side("b-prefill", PoolConfig::new(SLOT))?;
    let (prefill_at_decode, _) = decode.connect(&prefill).map_err(|e| format!("connect: {e}"))?;
    Ok(Pair { decode, prefill, prefill_at_decode })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn wait_settled(mut l: SlotLease<Exposed>) -> Result<SlotLease<Settled>, String> {
    let deadline = Instant::now() + LONG;
    loop {
        match l.try_settled() {
            Ok(s) => return Ok(s),
            Err(back) => l = back,
        }
        if Instant::now() >= deadline {
            return Err("the exposure did not settle within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Decode exposes `slots` slots; prefill writes `seed`'s bytes into them
/// through the adapter; returns decode's settled lease and the descriptor.
fn write_and_settle(p: &Pair, slots: usize, seed: u8) -> Result<(SlotLease<Settled>, RemoteSlots), String> {
    let lease = p.decode.pool.reserve(slots).map_err(|e| e.to_string())?;
    let (exposed, remote) =
        p.decode.transfer.expose(lease, p.prefill_at_decode).map_err(|e| format!("expose: {}", e.kind))?;
    let mut src = p.prefill.pool.reserve(slots).map_err(|e| e.to_string())?;
    for i in 0..slots {
        src.write_at(i, 0, &pattern(SLOT, seed.wrapping_add(i as u8))).map_err(|e| e.to_string())?;
    }
    let out = block_on(async {
        let h =
            p.prefill.transfer.write(src, &remote, TransferOptions::default()).await.map_err(|e| e.kind.to_string())?;
        Ok::<_, String>(h.await)
    })?
    .map_err(|e| format!("abandoned: {e:?}"))?;
    out.result.map_err(|e| format!("write failed: {e}"))?;
    let settled = wait_settled(exposed)?;
    let bytes = settled.bytes().map_err(|e| e.to_string())?;
    for i in 0..slots {
        if bytes[i * SLOT..(i + 1) * SLOT] != pattern(SLOT, seed.wrapping_add(i as u8))[..] {
            return Err(format!("slot {i}: not the bytes written"));
        }
    }
    Ok((settled, remote))
}

/// A one-slot exposure settles from the notification carried behind the
/// WRITE on its queue pair, a two-slot one from the batch's notifications
/// on queue pair 0; both byte-checked.
fn writes_land_and_settle_by_their_notifications(nics: &Nics) -> Result<(), String> {
    let p = pair(nics, 4, Access::WindowPerTenancy)?;
    let (one, remote) = write_and_settle(&p, 1, 7)?;
    if remote.slots[0].key.is_none() {
        return Err("the exposure carries no per-tenancy key".into());
    }
    let (two, _) = write_and_settle(&p, 2, 40)?;
    drop((one, two));
    let s = p.decode.transport.stats();
    if s.windows_bound < 3 || s.windows_invalidated < 3 {
        return Err(format!(
            "windows bound {} / invalidated {}, expected 3 each",
            s.windows_bound, s.windows_invalidated
        ));
    }
    Ok(())
}

/// A WRITE under a settled tenancy's key into the slot's next tenant:
/// with a window per tenancy the NIC refuses it and the new tenant's bytes
/// stay; with MORI's region key (the positive control) it lands.
fn stale_write(nics: &Nics, access: Access) -> Result<usize, String> {
    let p = pair(nics, 1, access)?;
    let (first, old) = write_and_settle(&p, 1, 1)?;
    first.release();
    let (second, _) = write_and_settle(&p, 1, 2)?;
    // The old tenancy's write, as a late or retried one would be: straight
    // to the engine, under the old descriptor's key.
    let local = p.prefill.transfer.memory_desc(&p.prefill.pool).ok_or("no prefill memory")?;
    let rdesc = p.decode.transfer.memory_desc(&p.decode.pool).ok_or("no decode memory")?;
    let remote = MemoryDesc { rkey: old.key_of(0), ..rdesc.clone() };
    let mut src = p.prefill.pool.reserve(1).map_err(|e| e.to_string())?;
    src.write_at(0, 0, &pattern(SLOT, 99)).map_err(|e| e.to_string())?;
    let off = u64::from(src.tenancies()[0].slot.0) * SLOT as u64;
    let uid = p.prefill.engine.allocate_transfer_unique_id();
    let st =
        p.prefill.engine.write(&local, off, &remote, old.slots[0].addr - rdesc.addr, SLOT as u64, uid, Tag::new(0, 0));
    let code = st.wait_for(LONG);
    let bytes = second.bytes().map_err(|e| e.to_string())?;
    let landed = bytes.iter().zip(pattern(SLOT, 99)).filter(|(a, b)| **a == *b).count();
    let kept = bytes == pattern(SLOT, 2);
    match (access, code, kept) {
        (Access::WindowPerTenancy, c, true) if c.is_terminal() && !c.is_success() => Ok(0),
        (Access::WindowPerTenancy, c, _) => Err(format!("stale write: {c}, new tenant's bytes kept: {kept}")),
        (Access::RegionKey, StatusCode::Success, false) => Ok(landed),
        (Access::RegionKey, c, _) => Err(format!("positive control: stale write {c}, bytes changed: {}", !kept)),
    }
}

fn a_stale_write_under_a_settled_tenancys_window_is_refused_by_the_nic(nics: &Nics) -> Result<(), String> {
    stale_write(nics, Access::WindowPerTenancy).map(|_| ())
}

fn positive_control_a_stale_write_under_the_region_key_lands(nics: &Nics) -> Result<(), String> {
    match stale_write(nics, Access::RegionKey)? {
        0 => Err("the positive control shows no corruption".into()),
        n => {
            eprintln!("positive control: {n} of {SLOT} bytes of the stale write landed in the next tenant's slot");
            Ok(())
        }
    }
}

/// The peer's lifeline closes (its process gone): the decode side drains
/// the connection and the adapter holds a `Fenced` proof for what was
/// exposed to it, so the slot is freed without a timer.
fn a_crashed_peer_fences_its_exposures(nics: &Nics) -> Result<(), String> {
    let p = pair(nics, 2, Access::WindowPerTenancy)?;
    let lease = p.decode.pool.reserve(1).map_err(|e| e.to_string())?;
    let (exposed, _remote) =
        p.decode.transfer.expose(lease, p.prefill_at_decode).map_err(|e| format!("expose: {}", e.kind))?;
    p.prefill.transport.crash();
    let deadline = Instant::now() + LONG;
    while p.decode.transport.stats().connections_lost == 0 {
        if Instant::now() >= deadline {
            return Err(format!("the lost connection was never reported: {:?}", p.decode.transport.stats()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    exposed.abort();
    let m = p.decode.pool.metrics();
    let deadline = Instant::now() + LONG;
    let mut m = m;
    while m.free < 2 {
        if Instant::now() >= deadline {
            return Err(format!("the slot was not freed by the fence: {m:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
        m = p.decode.pool.metrics();
    }
    Ok(())
}

const CHECKS: &[(&str, Check)] = &[
    ("writes_land_and_settle_by_their_notifications", writes_land_and_settle_by_their_notifications),
    (
        "a_stale_write_under_a_settled_tenancys_window_is_refused_by_the_nic",
        a_stale_write_under_a_settled_tenancys_window_is_refused_by_the_nic,
    ),
    (
        "positive_control_a_stale_write_under_the_region_key_lands",
        positive_control_a_stale_write_under_the_region_key_lands,
    ),
    ("a_crashed_peer_fences_its_exposures", a_crashed_peer_fences_its_exposures),
];

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let mut trials: Vec<Trial> = CHECKS
        .iter()
        .map(|&(name, check)| {
            Trial::test(format!("{name}::fake"), move || {
                check(&Nics::Fake(FakeFabric::new(0x6d6f7269))).map_err(Into::into)
            })
        })
        .collect();
    let env = backend_verbs::LabEnv::from_env();
    #[cfg(feature = "verbs-device")]
    let missing = backend_verbs::Context::open(&env.device).err().map(|e| e.to_string());
    #[cfg(not(feature = "verbs-device"))]
    let missing = Some("the feature `verbs-device` (and a device: scripts/rdma-lab test)".to_owned());
    // On a host without a device these show as ignored (CI runs them in the
    // lab's guest); in the guest, a missing device fails.
    let ignored = missing.is_some() && !env.in_lab;
    if let (Some(why), true, false) = (&missing, ignored, args.list) {
        eprintln!("ignored: MORI on a verbs device: needs {why}");
    }
    for &(name, check) in CHECKS {
        let why = missing.clone();
        #[cfg(feature = "verbs-device")]
        let env = env.clone();
        trials.push(
            Trial::test(format!("{name}::device"), move || match why {
                Some(why) => Err(format!("no verbs device: {why}").into()),
                #[cfg(feature = "verbs-device")]
                None => check(&Nics::Device(env)).map_err(Into::into),
                #[cfg(not(feature = "verbs-device"))]
                None => {
                    let _ = check;
                    Ok(())
                }
            })
            .with_ignored_flag(ignored),
        );
    }
    libtest_mimic::run(&args, trials).exit();
}
