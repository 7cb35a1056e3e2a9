//! `kvt bench`: throughput and per-batch latency of one-sided operations.
//!
//! Every backend runs the same measured loop, [`run_loop`], over its
//! `Arc<dyn Transfer>`: loopback rigs come from [`crate::backends`], and the
//! target / initiator modes across processes use the TCP simulator. One loop
//! for all makes backends comparable in one run (`--backend tcp-sim,mori`).
//!
//! Target / initiator control protocol (one JSON object per line, on the
//! target's `--listen` address; the data moves over the simulated NIC):
//!
//! ```text
//! initiator -> {"name": "...", "block_size": N, "slots": M}
//! target    -> {"nic": "127.0.0.1:PORT"}        (a NIC started for this session)
//! initiator    connects its NIC there
//! target    -> {"remote": RemoteSlots}          (M slots exposed to that peer)
//! initiator    runs the loop, then -> {"done": true}
//! target       revokes, releases, drops the session's NIC
//! ```

use crate::measure::{measure, median, per_thread, BenchConfig};
use anyhow::{anyhow, bail, Context as _};
use backend_tcp_sim::{NicConfig, SimNic};
use kv_transfer_core::{Op, PoolConfig, RemoteSlots, SlotMemory, SlotPool, Transfer};
use serde::Serialize;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest registered memory one run may ask for.
pub const MAX_BYTES: usize = 4 << 30;

/// What to measure.
#[derive(Clone, Debug)]
pub struct Params {
    /// READ or WRITE.
    pub op: Op,
    /// Bytes per operation (one slot).
    pub block_size: usize,
    /// Operations posted before waiting for them all.
    pub batch: usize,
    /// Posting threads.
    pub threads: usize,
    /// Measured time.
    pub duration: Duration,
    /// Unmeasured time before it.
    pub warmup: Duration,
    /// Where each side's slots live (`--device`, `--source-device`).
    pub placement: crate::backends::Placement,
}

impl Params {
    /// Slots each side registers: `threads × batch`, checked against [`MAX_BYTES`].
    pub fn slots(&self) -> anyhow::Result<usize> {
        let slots = self.threads.checked_mul(self.batch).ok_or_else(|| anyhow!("threads × batch overflows"))?;
        let bytes = slots.checked_mul(self.block_size).ok_or_else(|| anyhow!("registered memory overflows"))?;
        if slots == 0 {
            bail!("--batch and --threads must be at least 1");
        }
        if bytes > MAX_BYTES {
            bail!("threads × batch × block size = {bytes} B exceeds the {MAX_BYTES} B this tool registers");
        }
        Ok(slots)
    }
}

/// One measured configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// Backend name.
    pub backend: String,
    /// `loopback` or `initiator`.
    pub mode: String,
    /// Where the slots lived: `host`, `cuda:0`, `host->cuda:0` (initiator->target).
    pub memory: String,
    /// `read` or `write`.
    pub op: String,
    /// Bytes per operation.
    pub block_size: usize,
    /// Operations per batch.
    pub batch: usize,
    /// Threads.
    pub threads: usize,
    /// Bytes moved in the measured time.
    pub bytes: u64,
    /// Measured time, s.
    pub elapsed_s: f64,
    /// Throughput, GB/s (10^9 B/s).
    pub gb_per_s: f64,
    /// Batches measured.
    pub batches: usize,
    /// Median batch latency (post of the first op to the last completion), µs.
    pub p50_us: u64,
    /// 99th percentile batch latency, µs.
    pub p99_us: u64,
    /// Which round of a `--rounds` run (0 for a single run).
    pub round: usize,
}

/// One backend at one block size over the rounds of a `--rounds` run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    /// Backend name.
    pub backend: String,
    /// Bytes per operation.
    pub block_size: usize,
    /// Rounds measured.
    pub rounds: usize,
    /// Median GB/s over the rounds.
    pub gb_per_s: f64,
    /// Lowest GB/s of a round.
    pub gb_per_s_min: f64,
    /// Highest GB/s of a round.
    pub gb_per_s_max: f64,
    /// Against the first backend listed, same block size: the median of the
    /// per-round ratios (each round compares two runs seconds apart, so drift
    /// on a shared machine cancels out). Absent for the first backend.
    pub ratio: Option<f64>,
    /// Lowest per-round ratio.
    pub ratio_min: Option<f64>,
    /// Highest per-round ratio.
    pub ratio_max: Option<f64>,
}

/// Medians over rounds, and each backend's per-round ratio to the first of
/// `backends` (rounds are paired by [`Outcome::round`]). One entry per
/// backend and size that has results, in the order given.
pub fn summarize(results: &[Outcome], backends: &[&str], sizes: &[usize]) -> Vec<Summary> {
    let by_round = |backend: &str, size: usize| -> Vec<(usize, f64)> {
        results.iter().filter(|r| r.backend == backend && r.block_size == size).map(|r| (r.round, r.gb_per_s)).collect()
    };
    let mut out = Vec::new();
    for &size in sizes {
        let base = backends.first().map(|b| by_round(b, size)).unwrap_or_default();
        for (i, &backend) in backends.iter().enumerate() {
            let runs = by_round(backend, size);
            if runs.is_empty() {
                continue;
            }
            let gb: Vec<f64> = runs.iter().map(|r| r.1).collect();
            let ratios: Vec<f64> = if i == 0 {
                Vec::new()
            } else {
                runs.iter()
                    .filter_map(|&(round, g)| base.iter().find(|b| b.0 == round && b.1 > 0.0).map(|b| g / b.1))
                    .collect()
            };
            let some = |f: f64| (!ratios.is_empty()).then_some(f);
            out.push(Summary {
                backend: backend.to_string(),
                block_size: size,
                rounds: runs.len(),
                gb_per_s: median(&gb),
                gb_per_s_min: gb.iter().copied().fold(f64::INFINITY, f64::min),
                gb_per_s_max: gb.iter().copied().fold(0.0, f64::max),
                ratio: some(median(&ratios)),
                ratio_min: some(ratios.iter().copied().fold(f64::INFINITY, f64::min)),
                ratio_max: some(ratios.iter().copied().fold(0.0, f64::max)),
            });
        }
    }
    out
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn outcome(backend: &str, mode: &str, p: &Params, bytes: u64, elapsed: Duration, mut lat: Vec<u64>) -> Outcome {
    // Numbered by the caller (`bench_cmd`), which knows the round.
    lat.sort_unstable();
    let secs = elapsed.as_secs_f64();
    Outcome {
        backend: backend.into(),
        mode: mode.into(),
        memory: p.placement.to_string(),
        op: op_name(p.op).into(),
        block_size: p.block_size,
        batch: p.batch,
        threads: p.threads,
        bytes,
        elapsed_s: secs,
        gb_per_s: if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 },
        batches: lat.len(),
        p50_us: quantile(&lat, 0.5),
        p99_us: quantile(&lat, 0.99),
        round: 0,
    }
}

/// `read` / `write`.
pub fn op_name(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
    }
}

/// Registers `slots` slots of `block` bytes in `memory` with a simulator NIC.
pub fn register(nic: &SimNic, slots: usize, block: usize, memory: SlotMemory) -> anyhow::Result<SlotPool> {
    let region = crate::backends::allocate(memory, slots, block)?;
    Ok(nic.register_pool(region, PoolConfig::new(block))?)
}

/// Both ends in this process, on loopback, through `rig`'s backend.
pub fn loopback(rig: crate::backends::Rig, p: &Params) -> anyhow::Result<Outcome> {
    let res = run_loop(&rig.transfer, &rig.pool, &rig.remote, p);
    let backend = rig.backend;
    (rig.teardown)();
    let (bytes, elapsed, lat) = res?;
    Ok(outcome(backend, "loopback", p, bytes, elapsed, lat))
}

/// The measured loop (the one every backend's bench shares,
/// [`crate::measure::measure`]): `threads` threads, each posting
/// `batch` single-slot operations against its share of `remote`, waiting
/// for all of them, and repeating until `warmup + duration` is spent.
pub fn run_loop(
    init: &Arc<dyn Transfer>,
    ipool: &SlotPool,
    remote: &RemoteSlots,
    p: &Params,
) -> anyhow::Result<(u64, Duration, Vec<u64>)> {
    if remote.slots.len() < p.threads * p.batch || remote.slot_size != p.block_size as u64 {
        bail!(
            "the target exposed {} slots of {} B; {} of {} B are needed",
            remote.slots.len(),
            remote.slot_size,
            p.threads * p.batch,
            p.block_size
        );
    }
    let cfg = BenchConfig {
        block_size: p.block_size,
        batch: p.batch,
        threads: p.threads,
        duration: p.duration,
        warmup: p.warmup,
    };
    let r = measure(init, ipool, p.op, per_thread(remote, p.threads, p.batch), &cfg)?;
    Ok((r.bytes, r.elapsed, r.batch_latency_us))
}

fn send(s: &mut TcpStream, v: &Value) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(v)?;
    line.push(b'\n');
    s.write_all(&line).context("control connection")?;
    Ok(())
}

fn recv(r: &mut BufReader<TcpStream>) -> anyhow::Result<Value> {
    let mut line = String::new();
    if r.read_line(&mut line).context("control connection")? == 0 {
        bail!("the control connection closed");
    }
    let v: Value = serde_json::from_str(&line).context("malformed control message")?;
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        bail!("the target refused: {e}");
    }
    Ok(v)
}

/// Target mode: serves `sessions` initiators one after the other on
/// `listen`, and gives up after `idle` without a new initiator.
/// Its slots live in `memory`.
pub fn serve(
    listen: &str,
    sessions: u32,
    idle: Duration,
    memory: SlotMemory,
    log: &dyn Fn(String),
) -> anyhow::Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    log(format!("kvt bench target: control on {}, serving {sessions} session(s)", l.local_addr()?));
    l.set_nonblocking(true)?;
    for n in 0..sessions {
        let deadline = Instant::now() + idle;
        let (s, from) = loop {
            match l.accept() {
                Ok(x) => break x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        log(format!("no initiator for {idle:?}: exiting"));
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e.into()),
            }
        };
        s.set_nonblocking(false)?;
        match session(s, memory) {
            Ok(()) => log(format!("session {} from {from}: done", n + 1)),
            Err(e) => log(format!("session {} from {from}: {e:#}", n + 1)),
        }
    }
    Ok(())
}

fn session(mut s: TcpStream, memory: SlotMemory) -> anyhow::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(3600)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let hello = recv(&mut r)?;
    let name = hello.get("name").and_then(Value::as_str).unwrap_or_default().to_string();
    let block = hello.get("block_size").and_then(Value::as_u64).unwrap_or(0) as usize;
    let slots = hello.get("slots").and_then(Value::as_u64).unwrap_or(0) as usize;
    if name.is_empty() || block == 0 || slots == 0 || slots.saturating_mul(block) > MAX_BYTES {
        let msg = format!("bad request: name {name:?}, {slots} slots of {block} B (at most {MAX_BYTES} B in all)");
        send(&mut s, &json!({ "error": msg }))?;
        bail!(msg);
    }
    let nic = SimNic::start(NicConfig::new("kvt-target"))?;
    let pool = register(&nic, slots, block, memory)?;
    send(&mut s, &json!({ "nic": nic.endpoint() }))?;
    let peer = nic.wait_for_peer(&name, Duration::from_secs(10)).ok_or_else(|| anyhow!("{name} did not connect"))?;
    let (exposed, remote) = nic.expose(pool.reserve(slots)?, peer).map_err(|e| anyhow!("{}", e.kind))?;
    send(&mut s, &json!({ "remote": remote }))?;
    let done = recv(&mut r);
    nic.revoke(&exposed);
    if let Ok(settled) = exposed.try_settled() {
        settled.release();
    }
    done.map(|_| ())
}

/// Initiator mode: runs the loop against a `kvt bench --mode target`.
pub fn initiator(target: &str, p: &Params) -> anyhow::Result<Outcome> {
    let slots = p.slots()?;
    let mut s =
        TcpStream::connect(target).with_context(|| format!("cannot reach the target's control port {target}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let name = format!("kvt-initiator-{}", std::process::id());
    send(&mut s, &json!({ "name": name, "block_size": p.block_size, "slots": slots }))?;
    let nic_ep = recv(&mut r)?
        .get("nic")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| anyhow!("target sent no NIC endpoint"))?;
    let init = SimNic::start(NicConfig::new(name))?;
    let ipool = register(&init, slots, p.block_size, p.placement.initiator)?;
    init.connect(&nic_ep)?;
    let remote: RemoteSlots = serde_json::from_value(
        recv(&mut r)?.get("remote").cloned().ok_or_else(|| anyhow!("target sent no descriptor"))?,
    )?;
    let transfer: Arc<dyn Transfer> = Arc::new(init);
    let res = run_loop(&transfer, &ipool, &remote, p);
    let _ = send(&mut s, &json!({ "done": true }));
    let (bytes, elapsed, lat) = res?;
    Ok(outcome("tcp-sim", "initiator", p, bytes, elapsed, lat))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(backend: &str, block_size: usize, round: usize, gb_per_s: f64) -> Outcome {
        Outcome {
            backend: backend.into(),
            mode: "loopback".into(),
            memory: "host".into(),
            op: "write".into(),
            block_size,
            batch: 1,
            threads: 1,
            bytes: 1,
            elapsed_s: 1.0,
            gb_per_s,
            batches: 1,
            p50_us: 1,
            p99_us: 1,
            round,
        }
    }

    #[test]
    fn ratios_pair_runs_of_the_same_round() {
        // Round 1 is slow for both backends (a noisy neighbour): the
        // per-round ratio sees through it, the ratio of medians would not.
        let results = vec![
            run("tcp-sim", 64, 0, 4.0),
            run("mori", 64, 0, 3.6),
            run("mori", 64, 1, 1.8),
            run("tcp-sim", 64, 1, 2.0),
            run("tcp-sim", 64, 2, 4.2),
            run("mori", 64, 2, 4.2),
        ];
        let s = summarize(&results, &["tcp-sim", "mori"], &[64]);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].backend.as_str(), s[0].rounds, s[0].ratio), ("tcp-sim", 3, None));
        assert_eq!((s[0].gb_per_s, s[0].gb_per_s_min, s[0].gb_per_s_max), (4.0, 2.0, 4.2));
        let m = &s[1];
        assert_eq!((m.backend.as_str(), m.gb_per_s), ("mori", 3.6));
        assert!((m.ratio.unwrap_or(0.0) - 0.9).abs() < 1e-9, "{m:?}");
        assert!((m.ratio_min.unwrap_or(0.0) - 0.9).abs() < 1e-9 && (m.ratio_max.unwrap_or(0.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn sizes_are_kept_apart_and_even_counts_average_the_middle() {
        let results = vec![run("a", 1, 0, 1.0), run("a", 1, 1, 3.0), run("a", 2, 0, 10.0), run("b", 2, 0, 5.0)];
        let s = summarize(&results, &["a", "b"], &[1, 2]);
        assert_eq!(
            s.iter().map(|x| (x.backend.as_str(), x.block_size)).collect::<Vec<_>>(),
            [("a", 1), ("a", 2), ("b", 2)]
        );
        assert_eq!(s[0].gb_per_s, 2.0);
        assert_eq!(s[2].ratio, Some(0.5));
    }
}
