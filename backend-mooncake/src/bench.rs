//! A reusable throughput bench that drives the adapter ([`MooncakeTransfer`])
//! the way Mooncake's `transfer_engine_bench` initiator drives its engine:
//! `threads` threads, each posting one operation of `batch` blocks of `block`
//! bytes at a time and waiting for it, for `duration`.
//!
//! - Without [`BenchConfig::target`]: our initiator adapter to our target
//!   adapter, in-process over loopback TCP. Every iteration is the full safe
//!   cycle: the target reserves and exposes `batch` slots, the initiator
//!   posts with a completion notification, waits for the terminal status,
//!   and the target's exposure settles from that notification.
//! - With a target segment name (`ip:port`, for example a real
//!   `transfer_engine_bench --mode=target`): our initiator adapter writes
//!   into the target's first buffer (no notification: a plain Mooncake
//!   target cannot read it).
//!
//! Latencies are per batch: from `post` to the local terminal status (and,
//! with our own target, to the target's settlement).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_transfer_core::{
    Generation, HostRegion, Op, PeerId, PoolConfig, PoolId, Region, RemoteSlot, RemoteSlots, SlotId, SlotPool,
    Transfer, TransferOptions,
};

use crate::adapter::{block_on, AdapterConfig, MooncakeTransfer};
use crate::engine::{EngineConfig, MooncakeEngine};
use crate::proto::ProtoVersion;
use crate::transport::TcpTransportConfig;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// A target segment (`ip:port`); `None` runs our own target in-process.
    pub target: Option<String>,
    /// READ or WRITE.
    pub op: Op,
    /// How long to run.
    pub duration: Duration,
    /// Posting threads.
    pub threads: usize,
    /// Blocks (slots) per operation.
    pub batch: usize,
    /// Bytes per block (slot size).
    pub block: usize,
    /// TCP transport workers of the initiator engine.
    pub workers: usize,
    /// Adapter driver threads of the initiator.
    pub drivers: usize,
    /// The initiator adapter's [`AdapterConfig::engine_hooks`].
    pub engine_hooks: bool,
}

impl Default for BenchConfig {
    /// `transfer_engine_bench`'s shape as measure.sh runs it: WRITE, 4
    /// threads, batch 32, 1 MiB blocks, 5 s.
    fn default() -> Self {
        Self {
            target: None,
            op: Op::Write,
            duration: Duration::from_secs(5),
            threads: 4,
            batch: 32,
            block: 1 << 20,
            workers: 8,
            drivers: 4,
            engine_hooks: true,
        }
    }
}

/// Per-batch latency summary, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchLatency {
    /// Batches measured.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest.
    pub max_us: u64,
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchResult {
    /// The target segment.
    pub target: String,
    /// Framing the target speaks.
    pub proto: ProtoVersion,
    /// Bytes moved by successful operations.
    pub bytes: u64,
    /// Wall time of the run.
    pub secs: f64,
    /// `bytes / secs / 1e9`.
    pub gbps: f64,
    /// Per-batch latencies.
    pub latency: BatchLatency,
}

impl std::fmt::Display for BenchResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} GB/s ({:.0} MB in {:.2} s, target {} {:?}); batch latency p50 {} us, p99 {} us, max {} us, mean {:.0} us, {} batches",
            self.gbps,
            self.bytes as f64 / 1e6,
            self.secs,
            self.target,
            self.proto,
            self.latency.p50_us,
            self.latency.p99_us,
            self.latency.max_us,
            self.latency.mean_us,
            self.latency.count
        )
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
#[error("bench: {0}")]
pub struct BenchError(pub String);

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError(e.to_string())
}

struct Side {
    adapter: MooncakeTransfer,
    pool: SlotPool,
}

fn side(cfg: EngineConfig, adapter: AdapterConfig, slots: usize, block: usize) -> Result<Side, BenchError> {
    let engine = MooncakeEngine::new(cfg).map_err(err)?;
    let adapter = MooncakeTransfer::new(Arc::new(engine), adapter).map_err(err)?;
    let region = Arc::new(HostRegion::new(slots * block).map_err(err)?);
    // Touch every page with non-zero bytes first: untouched zeroed pages all
    // map the kernel's shared zero page, which would make the source side of
    // a WRITE read one cache-hot page and flatter the figures.
    let chunk = vec![0xA5u8; block.min(1 << 20)];
    let mut off = 0;
    while off < region.len() {
        let n = chunk.len().min(region.len() - off);
        region.write(off, &chunk[..n]).map_err(err)?;
        off += n;
    }
    let pool = adapter.register_pool(region, PoolConfig::new(block)).map_err(err)?;
    Ok(Side { adapter, pool })
}

fn summarize(mut lat: Vec<Duration>) -> BatchLatency {
    if lat.is_empty() {
        return BatchLatency::default();
    }
    lat.sort_unstable();
    let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let q = |p: f64| us(lat[((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1]);
    let total: f64 = lat.iter().map(|d| d.as_secs_f64() * 1e6).sum();
    BatchLatency {
        count: lat.len() as u64,
        mean_us: total / lat.len() as f64,
        p50_us: q(0.50),
        p99_us: q(0.99),
        max_us: lat.last().map(|d| us(*d)).unwrap_or(0),
    }
}

/// Runs the bench and reports throughput and per-batch latencies.
pub fn run(cfg: &BenchConfig) -> Result<BenchResult, BenchError> {
    if cfg.threads == 0 || cfg.batch == 0 || cfg.block == 0 {
        return Err(BenchError("threads, batch and block must be > 0".into()));
    }
    let slots = cfg.threads * cfg.batch;
    let ecfg =
        EngineConfig { tcp: TcpTransportConfig { workers: cfg.workers, ..Default::default() }, ..Default::default() };
    let acfg = AdapterConfig { drivers: cfg.drivers, engine_hooks: cfg.engine_hooks, ..Default::default() };
    let init = Arc::new(side(ecfg, acfg, slots, cfg.block)?);
    let own_target = match &cfg.target {
        None => {
            let acfg = AdapterConfig { drivers: 1, ..Default::default() };
            Some(Arc::new(side(EngineConfig::default(), acfg, slots, cfg.block)?))
        }
        Some(_) => None,
    };
    let target_name = match (&own_target, &cfg.target) {
        (Some(t), _) => t.adapter.segment_name().to_string(),
        (None, Some(n)) => n.clone(),
        (None, None) => return Err(BenchError("no target".into())),
    };
    let init_peer = init.adapter.add_peer(&target_name).map_err(err)?;
    let proto = init.adapter.peer_proto(init_peer).unwrap_or(ProtoVersion::V1);
    // For a foreign target: its first buffer, carved per thread.
    let foreign_base = if own_target.is_none() {
        let seg = init.adapter.engine().open_segment(&target_name).map_err(err)?;
        let info = init.adapter.engine().segment_info(seg).map_err(err)?;
        let b = info.desc.buffers.first().ok_or_else(|| BenchError("target advertises no buffer".into()))?;
        if b.length < (slots * cfg.block) as u64 {
            return Err(BenchError(format!("target buffer of {} bytes < {} needed", b.length, slots * cfg.block)));
        }
        b.addr
    } else {
        0
    };
    let target_peer: Option<PeerId> = match &own_target {
        Some(t) => Some(t.adapter.add_peer(init.adapter.segment_name()).map_err(err)?),
        None => None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let lats = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let mut hs = Vec::new();
    for t in 0..cfg.threads {
        let (init, own_target, stop, bytes, lats) =
            (init.clone(), own_target.clone(), stop.clone(), bytes.clone(), lats.clone());
        let (op, batch, block, target_name) = (cfg.op, cfg.batch, cfg.block, target_name.clone());
        hs.push(std::thread::spawn(move || -> Result<(), BenchError> {
            let mut mine = Vec::new();
            let foreign = RemoteSlots {
                endpoint: target_name,
                pool: PoolId(0),
                key: 0,
                slot_size: block as u64,
                memory: Default::default(),
                token: Default::default(),
                slots: (0..batch)
                    .map(|i| RemoteSlot {
                        slot: SlotId(i as u32),
                        generation: Generation(0),
                        addr: foreign_base + ((t * batch + i) * block) as u64,
                        key: None,
                    })
                    .collect(),
            };
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let local = init.pool.reserve(batch).map_err(err)?;
                let (exposure, remote, notify) = match (&own_target, target_peer) {
                    (Some(tg), Some(peer)) => {
                        let lease = tg.pool.reserve(batch).map_err(err)?;
                        let (e, r) = tg.adapter.expose(lease, peer).map_err(|e| err(e.kind))?;
                        (Some(e), r, true)
                    }
                    _ => (None, foreign.clone(), false),
                };
                let h = block_on(init.adapter.post(op, local, &remote, TransferOptions::notify(notify)))
                    .map_err(|e| err(e.kind))?;
                let out = block_on(h).map_err(err)?;
                out.result.map_err(err)?;
                out.lease.release();
                if let Some(e) = exposure {
                    block_on(e.settled()).release();
                }
                mine.push(t0.elapsed());
                bytes.fetch_add((batch * block) as u64, Ordering::Relaxed);
            }
            if let Ok(mut l) = lats.lock() {
                l.extend(mine);
            }
            Ok(())
        }));
    }
    std::thread::sleep(cfg.duration);
    stop.store(true, Ordering::Relaxed);
    let mut first_err = None;
    for h in hs {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(_) => first_err = first_err.or(Some(BenchError("bench thread panicked".into()))),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(e) = first_err {
        return Err(e);
    }
    let b = bytes.load(Ordering::Relaxed);
    let lat = lats.lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default();
    Ok(BenchResult { target: target_name, proto, bytes: b, secs, gbps: b as f64 / secs / 1e9, latency: summarize(lat) })
}
