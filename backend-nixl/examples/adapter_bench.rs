//! Throughput of the adapter against a plain loop over NIXL's raw C API, same
//! sizes, same run: two agents in one process, UCX on host memory, one WRITE at a
//! time (post, wait for done), 64 KiB and 16 MiB blocks. GB/s is 10^9 bytes/s.
//!
//! ```sh
//! CARGO_TARGET_DIR=/work/main/tgt/nixl cargo run --release -p backend-nixl --example adapter_bench
//! UCX_TLS=tcp CARGO_TARGET_DIR=/work/main/tgt/nixl cargo run --release -p backend-nixl --example adapter_bench
//! KVT_BENCH_DEVICE=cuda:0 cargo run --release -p backend-nixl --features cuda --example adapter_bench
//! ```
//!
//! `KVT_BENCH_DEVICE` puts every buffer of both rigs in that memory (`cuda:N`:
//! VRAM, device to device); `KVT_BENCH_SOURCE_DEVICE` the source's alone
//! (`host` with `KVT_BENCH_DEVICE=cuda:0`: host to device).
//!
//! - raw/repost: one request created once and re-posted (the cheapest raw loop);
//! - raw/fresh: a request created, posted, polled, released per transfer (what an
//!   adapter must do, since each lease names different memory and tenancies);
//! - adapter qd1: `Transfer::write` + `block_on(handle)` (core's, the executor the crate offers callers without a runtime) per transfer, default
//!   `AdapterConfig` except that the driver polls (`Progress::Driver`: no agent
//!   progress thread on the initiator, as in the raw loops), notify off (the raw
//!   loops send none); the default `request_cache` re-posts completed requests;
//! - adapter qd1 no cache: the same with `AdapterConfig::request_cache` 0 (a
//!   request created and released per transfer);
//! - adapter qd4: four writes in flight at once (informational).
//!
//! The target runs NIXL's progress thread in every case, with the adapter's
//! default delay (`AdapterConfig::agent_progress_delay`) in both rigs. Both rigs (raw agents and
//! adapters) are built once per size and measured in `KVT_BENCH_ROUNDS` (default
//! 6) rounds of `KVT_BENCH_SECS` (default 0.5) per case, the cases in the order
//! above in even rounds and in reverse in odd ones (so that what ran just before
//! a case favours neither side); medians are reported, and each ratio
//! is the median over rounds of an adapter case divided by the better raw loop
//! of the same round.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_nixl::adapter::{AdapterConfig, NixlTransfer, Progress};
use backend_nixl::engine::{Agent, AgentConfig, MemRegion, NixlLibrary, XferOp, XferState};

use kv_transfer_core::{
    block_on, Exposed, PoolConfig, Region, RemoteSlots, Reserved, SlotLease, SlotMemory, Transfer, TransferHandle,
    TransferOptions,
};

/// Where the source's and the destination's buffers live.
#[derive(Clone, Copy)]
struct Memory {
    src: SlotMemory,
    dst: SlotMemory,
}

impl Memory {
    fn from_env() -> Res<Self> {
        let get = |k: &str| std::env::var(k).ok().map(|v| v.parse::<SlotMemory>()).transpose();
        let dst = get("KVT_BENCH_DEVICE")?.unwrap_or_default();
        Ok(Self { src: get("KVT_BENCH_SOURCE_DEVICE")?.unwrap_or(dst), dst })
    }
}

fn descriptor(r: &dyn Region) -> Res<MemRegion> {
    MemRegion::of(r).ok_or_else(|| format!("NIXL cannot register {}", r.kind()).into())
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct RawRig {
    ini: Arc<Agent>,
    ib: backend_nixl::engine::Backend,
    src: Arc<dyn Region>,
    dst: Arc<dyn Region>,
    remote: String,
    _regs: Vec<backend_nixl::engine::Registration>,
    _keep: (Arc<Agent>, backend_nixl::engine::Backend),
}

impl RawRig {
    fn new(lib: &NixlLibrary, block: usize, mem: Memory) -> Res<Self> {
        let pid = std::process::id();
        let no_thread = AgentConfig { progress_thread: false, ..Default::default() };
        let ini = Agent::new(lib, &format!("rb-ini-{pid}-{block}"), &no_thread)?;
        // The same target progress-thread delay as the adapter's target (an idle
        // rig must not spin while the other one is measured).
        let delay = AdapterConfig::default().agent_progress_delay.as_micros() as u64;
        let tgt_cfg = AgentConfig { progress_delay_us: delay, ..Default::default() };
        let tgt = Agent::new(lib, &format!("rb-tgt-{pid}-{block}"), &tgt_cfg)?;
        let ib = ini.create_backend("UCX", &[])?;
        let tb = tgt.create_backend("UCX", &[])?;
        let src = mem.src.allocate(block)?;
        let dst = mem.dst.allocate(block)?;
        src.write(0, &vec![0x11; block])?;
        // SAFETY: the buffers are fields of the rig, dropped after the
        // registrations (field order) and after every request was released.
        let sreg = unsafe { ini.register_mem(&[descriptor(src.as_ref())?], Some(&ib)) }?;
        // SAFETY: as above.
        let treg = unsafe { tgt.register_mem(&[descriptor(dst.as_ref())?], Some(&tb)) }?;
        let remote = ini.load_remote_metadata(&tgt.local_metadata()?)?;
        Ok(Self { ini, ib, src, dst, remote, _regs: vec![sreg, treg], _keep: (tgt, tb) })
    }

    /// One WRITE at a time for `budget`: a request re-posted, or created per transfer.
    fn run(&mut self, budget: Duration, repost: bool) -> Res<f64> {
        let block = self.src.len();
        let (s, d) = (descriptor(self.src.as_ref())?, descriptor(self.dst.as_ref())?);
        let mut req = None;
        let mut n = 0u64;
        let start = Instant::now();
        while start.elapsed() < budget {
            if req.is_none() || !repost {
                if let Some(r) = req.take() {
                    backend_nixl::engine::XferRequest::release(r).map_err(|(_, e)| e)?;
                }
                req = Some(self.ini.create_xfer(XferOp::Write, &[s], &[d], &self.remote, None, Some(&self.ib))?);
            }
            let Some(r) = req.as_mut() else { break };
            let mut st = r.post()?;
            while st == XferState::InProgress && start.elapsed() < budget * 20 {
                st = r.status()?;
            }
            if st != XferState::Done {
                return Err("raw transfer did not complete".into());
            }
            n += 1;
        }
        let secs = start.elapsed().as_secs_f64();
        if let Some(r) = req.take() {
            r.release().map_err(|(_, e)| e)?;
        }
        let mut last = [0u8; 1];
        self.dst.read(block - 1, &mut last)?;
        if last[0] != 0x11 {
            return Err("raw: data did not arrive".into());
        }
        Ok(n as f64 * block as f64 / secs / 1e9)
    }
}

struct AdapterRig {
    ini: NixlTransfer,
    remotes: Vec<RemoteSlots>,
    leases: Vec<Option<SlotLease<Reserved>>>,
    block: usize,
    _tgt: (NixlTransfer, Vec<SlotLease<Exposed>>),
}

impl AdapterRig {
    fn new(block: usize, qd: usize, request_cache: usize, mem: Memory) -> Res<Self> {
        let pid = std::process::id();
        let ini = NixlTransfer::new_real(
            &format!("ab-ini-{pid}-{block}-{request_cache}"),
            AdapterConfig { progress: Progress::Driver, request_cache, ..AdapterConfig::default() },
        )?;
        let tgt = NixlTransfer::new_real(&format!("ab-tgt-{pid}-{block}-{request_cache}"), AdapterConfig::default())?;
        let src = ini.register_pool(mem.src.allocate(qd * block)?, PoolConfig::new(block))?;
        let dst = tgt.register_pool(mem.dst.allocate(qd * block)?, PoolConfig::new(block))?;
        ini.add_peer(&tgt.local_metadata()?)?;
        let peer = tgt.add_peer(&ini.local_metadata()?)?;
        let (mut remotes, mut exposures, mut leases) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..qd {
            let (e, r) = tgt.expose(dst.reserve(1)?, peer).map_err(|e| e.kind.to_string())?;
            exposures.push(e);
            remotes.push(r);
            let mut l = src.reserve(1)?;
            l.write_at(0, 0, &vec![0x22; block])?;
            leases.push(Some(l));
        }
        Ok(Self { ini, remotes, leases, block, _tgt: (tgt, exposures) })
    }

    /// `qd` writes in flight at a time for `budget`, notify off.
    fn run(&mut self, budget: Duration, qd: usize) -> Res<f64> {
        let no_notify = TransferOptions::notify(false);
        let mut n = 0u64;
        let mut handles: Vec<Option<TransferHandle>> = (0..qd).map(|_| None).collect();
        let start = Instant::now();
        while start.elapsed() < budget {
            for (i, h) in handles.iter_mut().enumerate() {
                if let Some(l) = self.leases[i].take() {
                    let post = block_on(self.ini.write(l, &self.remotes[i], no_notify.clone()));
                    *h = Some(post.map_err(|e| e.kind.to_string())?);
                }
            }
            for (i, h) in handles.iter_mut().enumerate() {
                if let Some(h) = h.take() {
                    let out = block_on(h).map_err(|e| e.to_string())?;
                    out.result?;
                    self.leases[i] = Some(out.lease.into_reserved());
                    n += 1;
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        if self.ini.metrics().completed_err > 0 {
            return Err("adapter: transfers failed".into());
        }
        Ok(n as f64 * self.block as f64 / secs / 1e9)
    }

    fn finish(self) {
        let (tgt, exposures) = self._tgt;
        drop(self.leases);
        // Never settled (no notification): abort; the idle initiator acknowledges.
        for e in exposures {
            e.abort();
        }
        let r = tgt.shutdown(Duration::from_secs(5));
        let i = self.ini.shutdown(Duration::from_secs(5));
        if r.leaked + i.leaked > 0 {
            eprintln!("teardown leaked: target {r:?} initiator {i:?}");
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Res<()> {
    let lib = match NixlLibrary::load() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let secs: f64 = std::env::var("KVT_BENCH_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(0.5);
    let rounds: usize = std::env::var("KVT_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(6);
    let budget = Duration::from_secs_f64(secs);
    let mem = Memory::from_env()?;
    println!(
        "library: {}  UCX_TLS={}  memory {} -> {}  {rounds} alternating rounds of {secs} s per case; medians",
        lib.path().display(),
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(default)".into()),
        mem.src,
        mem.dst
    );
    for block in [64usize << 10, 16 << 20] {
        let mut raw = RawRig::new(&lib, block, mem)?;
        let mut ad = AdapterRig::new(block, 4, AdapterConfig::default().request_cache, mem)?;
        let mut adc = AdapterRig::new(block, 1, 0, mem)?;
        let (mut rr, mut rf, mut a1, mut ac, mut a4, mut ratio, mut ratio_c) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        for round in 0..rounds {
            // The five cases, in reverse order every other round.
            let (mut r1, mut x, mut r2, mut c) = (0.0, 0.0, 0.0, 0.0);
            for i in 0..5 {
                match if round % 2 == 0 { i } else { 4 - i } {
                    0 => r1 = raw.run(budget, true)?,
                    1 => x = ad.run(budget, 1)?,
                    2 => r2 = raw.run(budget, false)?,
                    3 => c = adc.run(budget, 1)?,
                    _ => a4.push(ad.run(budget, 4)?),
                }
            }
            // Against the better raw loop of the same round.
            ratio.push(x / r1.max(r2));
            ratio_c.push(c / r1.max(r2));
            rr.push(r1);
            rf.push(r2);
            a1.push(x);
            ac.push(c);
        }
        let reposted = ad.ini.metrics().reposted;
        ad.finish();
        adc.finish();
        let (rr, rf, a1, ac, a4) = (median(rr), median(rf), median(a1), median(ac), median(a4));
        println!(
            "block {block:>8} B: raw/repost {rr:.3} GB/s  raw/fresh {rf:.3} GB/s  adapter qd1 {a1:.3} GB/s \
             ({reposted} re-posts)  adapter qd1 no cache {ac:.3} GB/s  adapter qd4 {a4:.3} GB/s"
        );
        println!(
            "block {block:>8} B: adapter qd1 / best raw = {:.1}%   adapter qd1 no cache / best raw = {:.1}%   \
             (per-round medians)",
            100.0 * median(ratio),
            100.0 * median(ratio_c)
        );
    }
    Ok(())
}
