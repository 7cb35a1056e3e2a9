//! MORI on verbs against the bare verbs backend, in one run, on one device
//! (Soft-RoCE in the lab's guest: only the ratio means anything there).
//!
//! Each round exposes `BATCH` slots of `SLOT` bytes, writes them from the
//! prefill side in one post, waits until the decode side's exposure
//! settled, and releases it; one thread. Rounds alternate between the two
//! backends, and the median of the per-round ratios is printed.
//!
//! ```text
//! cargo build -p backend-mori --features verbs-device,sim --example mori_verbs_bench --release
//! scripts/rdma-lab run -- target/release/examples/mori_verbs_bench [SLOT_KIB] [ROUNDS]
//! ```
//!
//! `--fake mori|verbs N` instead runs one backend for `N` batches on the
//! software NIC (deterministic placement: for
//! `valgrind --tool=callgrind`, where instructions per transfer are the
//! difference of two runs' totals over the difference of their `N`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mori::harness::MoriSide;
use backend_mori::verbs::{VerbsTransport, VerbsTransportConfig};
use backend_mori::EngineConfig;
use backend_tcp_sim::block_on;
use backend_verbs::{Engine, FakeFabric, LabEnv, VerbsConfig, VerbsTransfer};
use kv_transfer_core::{HostRegion, PeerId, PoolConfig, SlotPool, Transfer, TransferOptions};

const BATCH: usize = 8;
const SLOTS: usize = 2 * BATCH;
const ROUND: Duration = Duration::from_millis(1500);

/// One backend's decode and prefill sides.
struct Bench {
    name: &'static str,
    decode_pool: SlotPool,
    prefill_pool: SlotPool,
    prefill: Box<dyn Transfer>,
    expose: Box<dyn Fn(kv_transfer_core::SlotLease<kv_transfer_core::Reserved>) -> Option<Exposure>>,
    _keep: Box<dyn std::any::Any>,
}

type Exposure = (kv_transfer_core::SlotLease<kv_transfer_core::Exposed>, kv_transfer_core::RemoteSlots);

fn region(slot: usize) -> Arc<HostRegion> {
    Arc::new(HostRegion::new(SLOTS * slot).expect("region"))
}

/// Where the sides get their NICs: the device, or one software fabric.
enum Nics {
    #[cfg_attr(not(feature = "verbs-device"), allow(dead_code))]
    Device(LabEnv),
    Fake(FakeFabric),
}

fn nic(nics: &Nics) -> Arc<dyn Engine> {
    match nics {
        #[cfg(feature = "verbs-device")]
        Nics::Device(env) => backend_verbs::DeviceEngine::open(&env.device, 1, env.gid_index)
            .expect("verbs device (run in scripts/rdma-lab's guest)"),
        #[cfg(not(feature = "verbs-device"))]
        Nics::Device(_) => panic!("the device needs the feature `verbs-device`"),
        Nics::Fake(f) => Arc::new(f.fake_nic()),
    }
}

fn mori(env: &Nics, slot: usize) -> Bench {
    let side = |name: &str| -> MoriSide<VerbsTransport> {
        MoriSide::on_verbs(
            name,
            region(slot),
            PoolConfig::new(slot),
            VerbsTransportConfig::default(),
            nic(env),
            EngineConfig::default(),
        )
        .expect("MORI side")
    };
    let (decode, prefill) = (side("a-decode"), side("b-prefill"));
    let (peer, _) = decode.connect(&prefill).expect("connect");
    let d = decode.clone();
    Bench {
        name: "mori-verbs",
        decode_pool: decode.pool.clone(),
        prefill_pool: prefill.pool.clone(),
        prefill: Box::new(prefill.transfer.clone()),
        expose: Box::new(move |l| d.transfer.expose(l, peer).ok()),
        _keep: Box::new((decode, prefill)),
    }
}

fn bare(nics: &Nics, slot: usize) -> Bench {
    let env = LabEnv::from_env();
    let side = |name: &str| {
        let t = VerbsTransfer::with_engine(VerbsConfig::new(name, env.device.clone(), env.gid_index), nic(nics))
            .expect("verbs adapter");
        let pool = t.register_pool(region(slot), PoolConfig::new(slot)).expect("pool");
        (t, pool)
    };
    let ((decode, dpool), (prefill, ppool)) = (side("decode"), side("prefill"));
    prefill.add_peer(decode.descriptor()).expect("prefill adds decode");
    decode.add_peer(prefill.descriptor()).expect("decode adds prefill");
    let deadline = Instant::now() + Duration::from_secs(10);
    let peer: PeerId = loop {
        if let Some(p) = decode.peer_named("prefill") {
            break p;
        }
        assert!(Instant::now() < deadline, "prefill never connected");
        std::thread::sleep(Duration::from_millis(2));
    };
    let d = Arc::new(decode);
    Bench {
        name: "verbs",
        decode_pool: dpool,
        prefill_pool: ppool,
        prefill: Box::new(prefill),
        _keep: Box::new(d.clone()),
        expose: Box::new(move |l| d.expose(l, peer).ok()),
    }
}

/// Bytes per second over one round.
fn round(b: &Bench, slot: usize) -> f64 {
    batches(b, slot, 1_000_000, ROUND)
}

/// Bytes per second over `count` batches or `limit`, whichever ends first.
fn batches(b: &Bench, slot: usize, count: usize, limit: Duration) -> f64 {
    let start = Instant::now();
    let mut bytes = 0u64;
    for _ in 0..count {
        if start.elapsed() >= limit {
            break;
        }
        let lease = b.decode_pool.reserve(BATCH).expect("decode slots");
        let (mut exposed, remote) = (b.expose)(lease).expect("expose");
        let src = b.prefill_pool.reserve(BATCH).expect("prefill slots");
        let h = block_on(b.prefill.write(src, &remote, TransferOptions::default())).expect("post");
        let out = block_on(h).expect("not abandoned");
        out.result.expect("write");
        let deadline = Instant::now() + Duration::from_secs(10);
        let settled = loop {
            match exposed.try_settled() {
                Ok(s) => break s,
                Err(back) => exposed = back,
            }
            assert!(Instant::now() < deadline, "{}: exposure not settled", b.name);
            std::thread::yield_now();
        };
        settled.release();
        bytes += (BATCH * slot) as u64;
    }
    bytes as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("--fake") {
        let n = argv.get(2).and_then(|a| a.parse::<usize>().ok()).unwrap_or(1000);
        let nics = Nics::Fake(FakeFabric::new(7));
        let slot = 4096;
        let b = match argv.get(1).map(String::as_str) {
            Some("mori") => mori(&nics, slot),
            _ => bare(&nics, slot),
        };
        let rate = batches(&b, slot, n, Duration::from_secs(3600));
        println!("{}: {n} batches of {BATCH} x 4 KiB on the software NIC, {:.3} GB/s", b.name, rate / 1e9);
        return;
    }
    let mut args = argv.into_iter();
    let slot = args.next().and_then(|a| a.parse::<usize>().ok()).unwrap_or(64) * 1024;
    let rounds = args.next().and_then(|a| a.parse::<usize>().ok()).unwrap_or(6);
    let nics = Nics::Device(LabEnv::from_env());
    let (m, v) = (mori(&nics, slot), bare(&nics, slot));
    let mut ratios = Vec::new();
    for r in 0..rounds {
        // Alternating which goes first, so neither always runs on a warmer machine.
        let (a, b) = if r % 2 == 0 {
            (round(&m, slot), round(&v, slot))
        } else {
            let b = round(&v, slot);
            (round(&m, slot), b)
        };
        println!("round {r}: mori-verbs {:.3} GB/s, verbs {:.3} GB/s, ratio {:.3}", a / 1e9, b / 1e9, a / b);
        ratios.push(a / b);
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    println!(
        "slot {} KiB, batch {BATCH}, 1 thread: MORI on verbs / bare verbs, median of {rounds} rounds: {:.3} (range {:.3}-{:.3})",
        slot / 1024,
        median,
        ratios[0],
        ratios[ratios.len() - 1]
    );
}
