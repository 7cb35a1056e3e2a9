//! `kvt`: the kv-transfer command-line tool.
//!
//! - `kvt bench`: throughput and per-batch latency of one-sided READ/WRITE,
//!   in one process (`--mode loopback`) or across two (`--mode target` and
//!   `--mode initiator`), with a sweep over block sizes and an SVG plot.
//! - `kvt race`: the randomized abort/reassignment race of the conformance
//!   suite's scenario 2, with a progress bar and a report, on the TCP
//!   simulator (`--backend tcp-sim`) or real RDMA verbs (`--backend verbs`,
//!   feature `verbs`, where a verbs device exists).
//! - `kvt soak`: the disaggregated workload across two network namespaces
//!   with link flaps, loss bursts and prefill kills at random, a line per
//!   interval and a final report (needs root).
//! - `kvt cost`: instructions per transfer through each backend's adapter
//!   against its raw engine path, counted with callgrind (needs valgrind).

mod adversary;
mod backends;
mod bench;
mod cost;
mod measure;
mod plot;
mod soak;
mod units;

use anyhow::{anyhow, bail};
use backend_tcp_sim::ReleasePolicy;
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kv_transfer_core::{Op, SlotMemory};
use kv_transfer_examples::race::{run_race, table, RaceConfig};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "kvt", version, about = "kv-transfer tool: transfer benchmarks and the slot-reuse race", long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Measure one-sided READ/WRITE throughput and per-batch latency.
    Bench(BenchArgs),
    /// Run the randomized abort/reassignment race and report foreign bytes consumed.
    Race(RaceArgs),
    /// Run the workload across two network namespaces with faults at random (needs root).
    Soak(SoakArgs),
    /// Count instructions per transfer, adapter against raw engine, per backend (needs valgrind).
    Cost(cost::CostArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    /// The RDMA-like fabric over loopback TCP (always built in).
    TcpSim,
    /// NIXL (feature `nixl`).
    Nixl,
    /// Mooncake Transfer Engine (feature `mooncake`).
    Mooncake,
    /// Mooncake over its RDMA transport on backend-verbs' software NIC, a
    /// key per exposure (feature `mooncake`; `kvt race` only).
    MooncakeRdma,
    /// MORI-IO (feature `mori`).
    Mori,
    /// Real RDMA verbs (feature `verbs`; needs a verbs device).
    Verbs,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::TcpSim => "tcp-sim",
            Self::Nixl => "nixl",
            Self::Mooncake => "mooncake",
            Self::MooncakeRdma => "mooncake-rdma",
            Self::Mori => "mori",
            Self::Verbs => "verbs",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Initiator and target in this process, over loopback.
    Loopback,
    /// Serve initiators on --listen.
    Target,
    /// Drive a target at --target.
    Initiator,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OpArg {
    Read,
    Write,
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Transfer backend; a comma-separated list measures each in turn, same
    /// sizes, same run (`--backend tcp-sim,mori`), one plot line each.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "tcp-sim")]
    backend: Vec<Backend>,
    /// Where the two ends run.
    #[arg(long, value_enum, default_value = "loopback")]
    mode: Mode,
    /// Target mode: control address to listen on.
    #[arg(long, default_value = "127.0.0.1:7650")]
    listen: String,
    /// Target mode: initiators to serve before exiting.
    #[arg(long, default_value_t = 100)]
    sessions: u32,
    /// Target mode: exit after this long without a new initiator.
    #[arg(long, default_value = "10m", value_parser = units::parse_duration)]
    idle_timeout: Duration,
    /// Initiator mode: the target's control address.
    #[arg(long)]
    target: Option<String>,
    /// READ or WRITE.
    #[arg(long, value_enum, default_value = "write")]
    op: OpArg,
    /// Bytes per operation (4096, 64KiB, 1MiB, ...).
    #[arg(long, default_value = "1MiB", value_parser = units::parse_size)]
    block_size: usize,
    /// Operations posted before waiting for all of them.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Posting threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Measured time per configuration (2s, 500ms, ...).
    #[arg(long, default_value = "2s", value_parser = units::parse_duration)]
    duration: Duration,
    /// Unmeasured warm-up before it.
    #[arg(long, default_value = "200ms", value_parser = units::parse_duration)]
    warmup: Duration,
    /// Run once per block size in this list (4KiB,64KiB,1MiB,16MiB) instead of --block-size.
    #[arg(long, value_delimiter = ',', value_parser = units::parse_size)]
    sweep: Option<Vec<usize>>,
    /// With --sweep: write an SVG chart of GB/s against block size here.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Repeat every measurement this many times, alternating the backends'
    /// order each round, and report medians and each backend's per-round
    /// ratio to the first one listed (the way to compare on a noisy machine).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Print machine-readable JSON instead of the table (no progress bar).
    #[arg(long)]
    json: bool,
    /// Where the slots live: `host`, `fake-device` (device-like memory that
    /// faults on any CPU access) or `cuda[:N]` (a GPU; kvt built with the
    /// feature `cuda`). tcp-sim and mooncake stage device memory, NIXL
    /// registers a GPU's as VRAM, verbs through a dma-buf.
    #[arg(long, default_value = "host")]
    device: SlotMemory,
    /// The initiator's (the WRITE's source) memory, if not --device's:
    /// `--source-device host --device cuda` measures host to device.
    #[arg(long)]
    source_device: Option<SlotMemory>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PolicyArg {
    /// Free aborted slots at once, without a proof (the bug; positive control).
    Naive,
    /// Free only with a settlement proof (the contract).
    Safe,
    /// Both, side by side.
    Both,
}

#[derive(clap::Args, Debug)]
struct RaceArgs {
    /// Where the race runs: `tcp-sim` (held writes at a simulated NIC's
    /// gate), `mooncake` (ours on both sides over Mooncake's TCP protocol;
    /// held writes at the initiator's transport; no revoke, no fence: the
    /// ack is the only proof) or `verbs` (real RDMA WRITEs; a held round
    /// queues a large WRITE ahead of its doomed writes).
    #[arg(long, value_enum, default_value = "tcp-sim")]
    backend: Backend,
    /// Verbs: bytes of the WRITE queued ahead of a held round's doomed writes.
    #[arg(long, default_value = "4MiB", value_parser = units::parse_size)]
    blocker: usize,
    /// Requests to serve (per policy).
    #[arg(long, default_value_t = 10_000)]
    requests: u64,
    /// Seed of the schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Release policy of the decode NIC.
    #[arg(long, value_enum, default_value = "safe")]
    policy: PolicyArg,
    /// Share of requests aborted while their writes are in flight.
    #[arg(long, default_value_t = 0.3)]
    abort_rate: f64,
    /// Share of rounds whose writes are held past their aborts.
    #[arg(long, default_value_t = 0.5)]
    hold_rate: f64,
    /// Slots per request.
    #[arg(long, default_value_t = 2)]
    slots_per_request: usize,
    /// Bytes per slot.
    #[arg(long, default_value = "256", value_parser = units::parse_size)]
    slot_size: usize,
    /// Where every pool's slots live: `host`, `fake-device` (faults on any
    /// CPU access through a slot's address) or `cuda[:N]` (feature `cuda`).
    /// Device memory: tcp-sim and mooncake (staged).
    #[arg(long, default_value = "host")]
    device: SlotMemory,
    /// Print the reports as JSON (no progress bar).
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FaultArg {
    /// Link cuts, each restored.
    Flaps,
    /// netem loss and delay bursts (link cuts where the kernel has no netem).
    Bursts,
    /// Prefill crashes and restarts.
    Kills,
    /// No faults.
    None,
}

#[derive(clap::Args, Debug)]
struct SoakArgs {
    /// How long to run (60s, 30m, ...).
    #[arg(long, default_value = "60s", value_parser = units::parse_duration)]
    duration: Duration,
    /// A line every this long.
    #[arg(long, default_value = "10s", value_parser = units::parse_duration)]
    interval: Duration,
    /// Seed of the schedule (aborts, delays, faults).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Release policy of the decode NIC (`naive`: the positive control, which must show foreign bytes).
    #[arg(long, value_enum, default_value = "safe")]
    policy: PolicyArg,
    /// Mean time between faults.
    #[arg(long, default_value = "3s", value_parser = units::parse_duration)]
    fault_every: Duration,
    /// Share of requests aborted with their writes in flight.
    #[arg(long, default_value_t = 0.3)]
    abort_rate: f64,
    /// Faults to inject (any of flaps, bursts, kills; `none` for none).
    #[arg(long, value_delimiter = ',', default_value = "flaps,bursts,kills")]
    faults: Vec<FaultArg>,
    /// Bytes per slot.
    #[arg(long, default_value = "16KiB", value_parser = units::parse_size)]
    slot_size: usize,
    /// Print a final JSON object on stdout (the interval lines go to stderr).
    #[arg(long)]
    json: bool,
    /// Attack while the workload runs: the first third of --duration is a
    /// no-attack baseline, the rest runs under a seeded adversary (by
    /// --seed) hitting every honest NIC's listening port with every hostile
    /// test's attack (wrong cluster key, forged FINISH under an honest
    /// name, replayed HELLO, relay, made-up names, garbage, oversized
    /// frames, half-open, slowloris, floods of 10x the per-address and the
    /// listener's handshake caps, from 19 addresses of its own per host).
    /// Fails (exit 1) unless: every kind attempted and refused (typed in
    /// the NICs' auth or listener stats), no session without the key, the
    /// same attack with the real key establishes one (positive control),
    /// 0 foreign bytes and the pool whole, honest p99 under attack <=
    /// max(3 x baseline p99, baseline p99 + 40 ms), and at the end (the
    /// adversary stopped, handshake deadlines passed) vs the baseline's
    /// end: threads <= +8, open fds <= +32, RSS <= +24 MiB, heap in use
    /// <= +8 MiB, heap slope over the attack's second half <= 16 MiB/min.
    #[arg(long)]
    adversary: bool,
}

/// A progress bar on stderr, hidden when stderr is not a terminal or `hidden`.
fn bar(len: u64, hidden: bool, template: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if hidden || !std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Refuses a backend that is not usable in this build, naming what to install.
fn check_backend(b: Backend) -> anyhow::Result<()> {
    let (feature, compiled, engine) = match b {
        Backend::TcpSim => return Ok(()),
        Backend::Nixl => (
            "nixl",
            cfg!(feature = "nixl"),
            "the NIXL engine: python3 -m venv .engines && .engines/bin/pip install --no-deps nixl-cu12==1.5.1",
        ),
        Backend::Mooncake => (
            "mooncake",
            cfg!(feature = "mooncake"),
            "nothing more for the loopback bench (it runs our wire-compatible engine); measuring against the real \
             Mooncake Transfer Engine (backend-mooncake/scripts/measure.sh) needs apt-get install libibverbs1 && \
             python3 -m venv .engines && .engines/bin/pip install --no-deps \
             mooncake-transfer-engine-non-cuda==0.3.13.post1",
        ),
        Backend::MooncakeRdma => (
            "mooncake",
            cfg!(feature = "mooncake"),
            "nothing more: the race runs on backend-verbs' software NIC (Mooncake over RDMA against the real engine \
             runs in the lab's guest: scripts/rdma-lab test)",
        ),
        Backend::Verbs => (
            "verbs",
            cfg!(feature = "verbs"),
            "a verbs device (none on this project's hosts: run it in the lab's guest, scripts/rdma-lab run -- \
             target/release/kvt bench --backend verbs ...; building needs cmake libclang-dev libibverbs-dev)",
        ),
        Backend::Mori => (
            "mori",
            cfg!(feature = "mori"),
            "nothing more: MORI-IO semantics run on the TCP simulator's fabric (real MORI-IO needs RDMA NICs or AMD \
             GPUs and an RDMA transport, not built yet)",
        ),
    };
    if !compiled {
        bail!(
            "backend `{feature}` is not compiled into this kvt.\n  rebuild with its feature: cargo run --release -p kvt \
             --features {feature} -- bench --backend {feature} ...\n  it also needs {engine}"
        );
    }
    Ok(())
}

fn bench_cmd(a: BenchArgs) -> anyhow::Result<()> {
    for (i, &b) in a.backend.iter().enumerate() {
        check_backend(b)?;
        if a.backend[..i].contains(&b) {
            bail!("--backend lists {} twice", b.name());
        }
    }
    let op = match a.op {
        OpArg::Read => Op::Read,
        OpArg::Write => Op::Write,
    };
    if a.mode != Mode::Loopback && a.backend != [Backend::TcpSim] {
        bail!("--mode target / initiator run the TCP simulator across processes; other backends run --mode loopback");
    }
    if a.mode == Mode::Target {
        let quiet = a.json;
        return bench::serve(&a.listen, a.sessions, a.idle_timeout, a.device, &|m| {
            if !quiet {
                eprintln!("{m}");
            }
        });
    }
    if a.plot.is_some() && a.sweep.is_none() {
        bail!("--plot draws a sweep: add --sweep 4KiB,64KiB,1MiB,16MiB");
    }
    let target = match (a.mode, &a.target) {
        (Mode::Initiator, None) => bail!("--mode initiator needs --target HOST:PORT (a `kvt bench --mode target`)"),
        (Mode::Initiator, Some(t)) => Some(t.clone()),
        _ => None,
    };
    let sizes = a.sweep.clone().unwrap_or_else(|| vec![a.block_size]);
    let rounds = a.rounds as usize;
    // Round by round, size by size, every backend back to back; odd rounds
    // take the backends in reverse, so that none is always measured first.
    let mut runs: Vec<(usize, Backend, usize)> = Vec::new();
    for round in 0..rounds {
        for &bs in &sizes {
            let mut order = a.backend.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            runs.extend(order.into_iter().map(|b| (round, b, bs)));
        }
    }
    let mut results = Vec::new();
    for (i, &(round, backend, bs)) in runs.iter().enumerate() {
        let p = bench::Params {
            op,
            block_size: bs,
            batch: a.batch,
            threads: a.threads,
            duration: a.duration,
            warmup: a.warmup,
            placement: backends::Placement { initiator: a.source_device.unwrap_or(a.device), target: a.device },
        };
        let total = (a.duration + a.warmup).as_millis() as u64;
        let pb = bar(total.max(1), a.json, "{msg} [{bar:40}] {elapsed_precise}");
        let round_note = if rounds > 1 { format!(" (round {}/{rounds})", round + 1) } else { String::new() };
        pb.set_message(format!(
            "[{}/{}] {} {} {}{round_note}",
            i + 1,
            runs.len(),
            backend.name(),
            bench::op_name(op),
            units::fmt_size(bs)
        ));
        let (target, p2) = (target.clone(), p.clone());
        let job = std::thread::spawn(move || match target {
            Some(t) => bench::initiator(&t, &p2),
            None => backends::loopback_rig(backend, p2.slots()?, p2.block_size, p2.placement)
                .and_then(|r| bench::loopback(r, &p2)),
        });
        let t0 = std::time::Instant::now();
        while !job.is_finished() {
            pb.set_position((t0.elapsed().as_millis() as u64).min(total));
            std::thread::sleep(Duration::from_millis(50));
        }
        pb.finish_and_clear();
        let mut r = job.join().map_err(|_| anyhow!("the bench thread panicked"))??;
        if r.batches == 0 {
            // Every batch that started after the warm-up outlived the run: a
            // figure of 0 GB/s would be a lie, not a measurement.
            bail!(
                "{} {}: no batch of {} x {} x {} finished inside --duration {:?} (a batch takes longer than the run \
                 on this device); raise --duration, or lower --batch / --threads",
                backend.name(),
                units::fmt_size(bs),
                a.threads,
                a.batch,
                units::fmt_size(bs),
                a.duration
            );
        }
        r.round = round;
        results.push(r);
    }
    let names: Vec<&str> = a.backend.iter().map(|b| b.name()).collect();
    let summary = bench::summarize(&results, &names, &sizes);
    if a.json && rounds > 1 {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "results": results, "summary": summary }))?);
    } else if a.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else if rounds > 1 {
        println!(
            "{:<9} {:>8} {:>6} {:>9} {:>17} {:>17}",
            "backend",
            "block",
            "rounds",
            "GB/s",
            "(min..max)",
            format!("vs {}", names.first().copied().unwrap_or_default())
        );
        for s in &summary {
            let ratio = match (s.ratio, s.ratio_min, s.ratio_max) {
                (Some(r), Some(lo), Some(hi)) => format!("{r:.3} ({lo:.2}..{hi:.2})"),
                _ => "-".into(),
            };
            println!(
                "{:<9} {:>8} {:>6} {:>9.3} {:>17} {:>17}",
                s.backend,
                units::fmt_size(s.block_size),
                s.rounds,
                s.gb_per_s,
                format!("({:.3}..{:.3})", s.gb_per_s_min, s.gb_per_s_max),
                ratio
            );
        }
    } else {
        if let Some(r) = results.iter().find(|r| r.memory != "host") {
            println!("slots in {} memory", r.memory);
        }
        println!(
            "{:<9} {:<9} {:<5} {:>8} {:>5} {:>7} {:>9} {:>12} {:>12} {:>8}",
            "backend", "mode", "op", "block", "batch", "threads", "GB/s", "p50 µs/batch", "p99 µs/batch", "batches"
        );
        for r in &results {
            println!(
                "{:<9} {:<9} {:<5} {:>8} {:>5} {:>7} {:>9.3} {:>12} {:>12} {:>8}",
                r.backend,
                r.mode,
                r.op,
                units::fmt_size(r.block_size),
                r.batch,
                r.threads,
                r.gb_per_s,
                r.p50_us,
                r.p99_us,
                r.batches
            );
        }
    }
    if let Some(path) = &a.plot {
        let series: Vec<plot::Series> = a
            .backend
            .iter()
            .map(|b| plot::Series {
                label: format!("{} {}", b.name(), bench::op_name(op)),
                // Medians over the rounds (the single run's figure for one round).
                points: summary.iter().filter(|s| s.backend == b.name()).map(|s| (s.block_size, s.gb_per_s)).collect(),
            })
            .collect();
        let title = format!("kvt bench: {} ×{} batch, {} threads", bench::op_name(op), a.batch, a.threads);
        std::fs::write(path, plot::svg(&title, &series))
            .map_err(|e| anyhow!("cannot write {}: {e}", path.display()))?;
        if !a.json {
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn race_cmd(a: RaceArgs) -> anyhow::Result<bool> {
    check_backend(a.backend)?;
    if !matches!(a.backend, Backend::TcpSim | Backend::Verbs | Backend::Mooncake | Backend::MooncakeRdma) {
        bail!(
            "kvt race runs on tcp-sim, mooncake, mooncake-rdma or verbs (the conformance suite covers {} without \
             scenario 2)",
            a.backend.name()
        );
    }
    let policies = match a.policy {
        PolicyArg::Naive => vec![ReleasePolicy::Naive],
        PolicyArg::Safe => vec![ReleasePolicy::Safe],
        PolicyArg::Both => vec![ReleasePolicy::Naive, ReleasePolicy::Safe],
    };
    let mut reports = Vec::new();
    for policy in policies {
        let cfg = RaceConfig {
            requests: a.requests,
            seed: a.seed,
            policy,
            abort_rate: a.abort_rate,
            hold_rate: a.hold_rate,
            slots_per_request: a.slots_per_request,
            slot_size: a.slot_size,
            blocker_bytes: a.blocker,
            memory: a.device,
            ..RaceConfig::default()
        };
        let pb = bar(a.requests.max(1), a.json, "{msg} [{bar:40}] {pos}/{len} requests {per_sec} eta {eta}");
        pb.set_message(format!("race {} {}", a.backend.name(), kv_transfer_examples::race::policy_name(policy)));
        let mut progress = |done, _| pb.set_position(done);
        let r = match a.backend {
            #[cfg(feature = "verbs")]
            Backend::Verbs => kv_transfer_examples::race::verbs::run_verbs_race(&cfg, &mut progress),
            #[cfg(feature = "mooncake")]
            Backend::Mooncake => kv_transfer_examples::race::mooncake::run_mooncake_race(&cfg, &mut progress),
            #[cfg(feature = "mooncake")]
            Backend::MooncakeRdma => kv_transfer_examples::race::mooncake::run_mooncake_rdma_race(&cfg, &mut progress),
            _ => run_race(&cfg, &mut progress),
        };
        pb.finish_and_clear();
        reports.push(r?);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", table(&reports));
    }
    let mut ok = true;
    for r in &reports {
        let Some(c) = &r.config else { continue };
        match c.policy {
            ReleasePolicy::Safe if r.corrupted() || !r.pool_whole() => {
                eprintln!("kvt race: the safe policy consumed foreign bytes or leaked slots: contract violated");
                ok = false;
            }
            ReleasePolicy::Naive if !r.corrupted() && !a.json => {
                eprintln!("kvt race: naive showed no corruption this run; raise --requests or --abort-rate");
            }
            _ => {}
        }
    }
    Ok(ok)
}

fn soak_cmd(a: SoakArgs) -> anyhow::Result<bool> {
    let policy = match a.policy {
        PolicyArg::Naive => ReleasePolicy::Naive,
        PolicyArg::Safe => ReleasePolicy::Safe,
        PolicyArg::Both => bail!("kvt soak runs one policy: --policy safe or --policy naive"),
    };
    if !(0.0..=1.0).contains(&a.abort_rate) {
        bail!("--abort-rate must be in [0, 1]");
    }
    if a.interval.is_zero() || a.slot_size == 0 {
        bail!("--interval and --slot-size must be positive");
    }
    let cfg = soak::SoakConfig {
        duration: a.duration,
        interval: a.interval,
        seed: a.seed,
        policy,
        slot_size: a.slot_size,
        abort_rate: a.abort_rate,
        fault_every: a.fault_every,
        faults: soak::FaultKinds {
            flaps: a.faults.contains(&FaultArg::Flaps),
            bursts: a.faults.contains(&FaultArg::Bursts),
            kills: a.faults.contains(&FaultArg::Kills),
        },
        adversary: a.adversary,
        ..soak::SoakConfig::default()
    };
    let json = a.json;
    let mut print = |l: &soak::IntervalLine| {
        let mut line = format!(
            "[{:>7.1}s] requests {:>9} aborted {:>8} foreign_bytes {:>9} quarantined {:>3} stuck {:>3} rss {:>6.1} MiB \
             heap {:>6.1} MiB",
            l.t_s,
            l.requests,
            l.aborted,
            l.foreign_bytes,
            l.quarantined,
            l.stuck,
            l.rss_bytes as f64 / (1u64 << 20) as f64,
            l.heap_bytes as f64 / (1u64 << 20) as f64
        );
        if let Some(a) = &l.adversary {
            use std::fmt::Write;
            let _ = write!(line, " | {} p99 {:.2} ms threads {} fds {}", a.phase, a.p99_ms, a.threads, a.fds);
            if !a.kinds.is_empty() {
                let _ = write!(line, " attacks (refused/attempted):");
                for (k, c) in &a.kinds {
                    let _ = write!(line, " {k} {}/{}", c.refused, c.attempted);
                }
            }
        }
        if json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let r = soak::run_soak(&cfg, &mut print)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "soak {} seed {}: {} requests, {} aborted, {} foreign bytes ({} requests), {} failed (settled without a DONE), {} torn, \
             faults: {} link flaps, {} loss bursts{}, {} prefill kills; end: {}/{} free, {} quarantined, {} stuck; \
             RSS {:.1} MiB, slope {:+.1} KiB/min after warm-up; heap in use {:.1} MiB, slope {:+.1} KiB/min",
            r.policy,
            r.seed,
            r.requests,
            r.aborted,
            r.foreign_bytes,
            r.foreign_requests,
            r.failed,
            r.garbage_requests,
            r.faults.link_flaps,
            r.faults.loss_bursts,
            r.faults.loss_bursts_unavailable.as_deref().map(|w| format!(" ({w})")).unwrap_or_default(),
            r.faults.peer_kills,
            r.final_free,
            r.capacity,
            r.quarantined,
            r.stuck,
            r.rss_bytes as f64 / (1u64 << 20) as f64,
            r.rss_slope_bytes_per_min / 1024.0,
            r.heap_bytes as f64 / (1u64 << 20) as f64,
            r.heap_slope_bytes_per_min / 1024.0
        );
        if let Some(a) = &r.adversary {
            println!(
                "adversary: {} ports, {} attacks ({} refused, {} lost to faults, {} unrefused, {} sessions without the key), \
                 {} connections; honest p99 {:.2} ms baseline -> {:.2} ms under attack (bound {:.2}; {} + {} requests, {} \
                 left out for faults); threads {} -> {} (peak {}), fds {} -> {} (peak {}), RSS {:.1} -> {:.1} MiB, heap \
                 {:.1} -> {:.1} MiB (slope {:+.1} KiB/min); positive control: {}/{} sessions with the real key",
                a.targets,
                a.total.attempted,
                a.total.refused,
                a.total.lost,
                a.total.unrefused,
                a.total.established,
                a.total.connections,
                a.baseline_p99_ms,
                a.attack_p99_ms,
                a.p99_bound_ms,
                a.baseline_samples,
                a.attack_samples,
                a.latency_excluded,
                a.threads_baseline,
                a.threads_end,
                a.threads_peak,
                a.fds_baseline,
                a.fds_end,
                a.fds_peak,
                a.rss_baseline_bytes as f64 / (1u64 << 20) as f64,
                a.rss_end_bytes as f64 / (1u64 << 20) as f64,
                a.heap_baseline_bytes as f64 / (1u64 << 20) as f64,
                a.heap_end_bytes as f64 / (1u64 << 20) as f64,
                a.attack_heap_slope_bytes_per_min / 1024.0,
                a.control.established,
                a.control.attempted
            );
            for (k, c) in &a.kinds {
                println!(
                    "  {k:<22} attempted {:>6} refused {:>6} lost {:>4} unrefused {} established {} connections {:>7}; \
                     targets' {} +{}",
                    c.counts.attempted,
                    c.counts.refused,
                    c.counts.lost,
                    c.counts.unrefused,
                    c.counts.established,
                    c.counts.connections,
                    c.refused_as,
                    c.refused_as_delta
                );
            }
        }
    }
    if let Some(a) = r.adversary.as_ref().filter(|a| !a.failures.is_empty()) {
        for f in &a.failures {
            eprintln!("kvt soak --adversary: {f}");
        }
        return Ok(false);
    }
    Ok(match policy {
        ReleasePolicy::Safe if !r.clean() => {
            eprintln!("kvt soak: foreign bytes consumed or slots not accounted for under the safe policy");
            false
        }
        ReleasePolicy::Naive if r.foreign_bytes == 0 => {
            eprintln!("kvt soak: the positive control (naive) showed no foreign bytes: raise --duration");
            false
        }
        _ => true,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Bench(a) => bench_cmd(a).map(|()| true),
        Cmd::Race(a) => race_cmd(a),
        Cmd::Soak(a) => soak_cmd(a),
        Cmd::Cost(a) => cost::cmd(a).map(|()| true),
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("kvt: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
