//! `kvt cost`: what the guarantee costs, in instructions per transfer.
//!
//! For each backend and size, the same transfers (one WRITE of one slot,
//! posted and awaited, one at a time, no notification) run twice: through
//! kv-transfer's adapter (a lease, admission, the drain protocol's
//! bookkeeping) and through the raw engine path under it (the simulator's
//! raw NIC, Mooncake's engine, NIXL's C API, a raw verbs loop on the
//! software NIC, MORI's engine on verbs). Each path runs in a child process
//! under `valgrind --tool=callgrind` (all threads counted), once with `N`
//! transfers and once with `2N`: the difference of the two totals over `N`
//! is the cost of one transfer, with set-up, warm-up and teardown cancelled
//! out. Instruction counts do not move with a noisy machine, as wall-clock
//! ratios do; a path that polls may still vary a little with scheduling,
//! so each figure is the median of `--repeat` runs.
//!
//! A third path, counted once, is the floor: the core's own work per
//! transfer with no engine and no second thread (the operation admitted by
//! an abort tracker, the lease exposed, a completion handle, the lease
//! settled by its proof and handed back). Every adapter does at least that,
//! so a backend's adapter / raw can be no lower than `1 + floor / raw`: the
//! table's `lowest` column. What an adapter costs above `lowest` is its
//! backend's own (hand-offs, lookups); what `lowest` costs is the core's.
//!
//! ```text
//! kvt cost --backend tcp-sim,mooncake,nixl,verbs,mori --sizes 4KiB,64KiB,1MiB
//! ```

mod paths;

use crate::units;
use anyhow::{anyhow, bail, Context as _};
use clap::ValueEnum;
use serde::Serialize;
use std::process::Command;

/// A backend `kvt cost` can count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum CostBackend {
    /// The TCP simulator: its adapter against its raw NIC.
    TcpSim,
    /// Mooncake (feature `mooncake`): the adapter against its engine.
    Mooncake,
    /// NIXL (feature `nixl`; the real library): the adapter against its C API.
    Nixl,
    /// Verbs on backend-verbs' software NIC: the adapter against a raw loop.
    Verbs,
    /// MORI on verbs on the software NIC (feature `mori`): the adapter
    /// against MORI's engine, and against bare verbs.
    Mori,
}

impl CostBackend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::TcpSim => "tcp-sim",
            Self::Mooncake => "mooncake",
            Self::Nixl => "nixl",
            Self::Verbs => "verbs",
            Self::Mori => "mori",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        <Self as ValueEnum>::from_str(s, true).ok()
    }
}

/// The two ways to the same transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Through kv-transfer's adapter.
    Adapter,
    /// Through the engine alone.
    Raw,
    /// The core's own per-transfer work alone, no engine (the same for
    /// every backend: counted once).
    Floor,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Self::Adapter => "adapter",
            Self::Raw => "raw",
            Self::Floor => "floor",
        }
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct CostArgs {
    /// Backends to count (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "tcp-sim,mooncake,nixl,verbs,mori")]
    backend: Vec<CostBackend>,
    /// Bytes per transfer (comma-separated: 4KiB,64KiB,1MiB).
    #[arg(long, value_delimiter = ',', default_value = "4KiB,64KiB,1MiB", value_parser = units::parse_size)]
    sizes: Vec<usize>,
    /// N: transfers in the shorter of the two runs (the longer runs 2N).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    transfers: u64,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=15))]
    repeat: u32,
    /// Print machine-readable JSON instead of the table (no progress bar).
    #[arg(long)]
    json: bool,
    /// Internal: run one path (`BACKEND:PATH:BYTES:COUNT`) in this process,
    /// for the parent's callgrind.
    #[arg(long, hide = true)]
    run: Option<String>,
}

/// Largest transfer counted (each side allocates it).
const MAX_SIZE: usize = 64 << 20;

/// One row of the report.
#[derive(Clone, Debug, Serialize)]
struct Row {
    backend: CostBackend,
    size: usize,
    adapter: f64,
    raw: f64,
    ratio: f64,
    /// The lowest `ratio` the core's own work allows: 1 + floor / raw.
    lowest: f64,
    /// MORI only: the adapter against the bare verbs raw loop.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_bare_verbs: Option<f64>,
}

pub(crate) fn cmd(a: CostArgs) -> anyhow::Result<()> {
    if let Some(spec) = &a.run {
        return run_spec(spec);
    }
    for (i, b) in a.backend.iter().enumerate() {
        paths::available(*b)?;
        if a.backend[..i].contains(b) {
            bail!("--backend lists {} twice", b.name());
        }
    }
    if a.sizes.iter().any(|&s| s == 0 || s > MAX_SIZE) {
        bail!("--sizes: each between 1 B and 64 MiB");
    }
    valgrind_present()?;
    let exe = std::env::current_exe().context("the path of this kvt")?;
    let per_figure = 2 * u64::from(a.repeat);
    let figures: u64 =
        a.backend.iter().map(|b| if *b == CostBackend::Mori { 3 } else { 2 }).sum::<u64>() * a.sizes.len() as u64 + 1;
    let pb =
        crate::bar(figures * per_figure, a.json, "{elapsed_precise} [{bar:30}] {pos}/{len} runs under callgrind {msg}");
    let count = |backend: CostBackend, path: Path, size: usize| -> anyhow::Result<f64> {
        pb.set_message(format!("{} {} {}", backend.name(), path.name(), units::fmt_size(size)));
        let mut each = Vec::new();
        for _ in 0..a.repeat {
            let short = instructions(&exe, backend, path, size, a.transfers)?;
            pb.inc(1);
            let long = instructions(&exe, backend, path, size, 2 * a.transfers)?;
            pb.inc(1);
            // Signed: a path whose polling threads ran longer in
            // the shorter run can come out negative (noise, shown).
            each.push((long as f64 - short as f64) / a.transfers as f64);
        }
        Ok(crate::measure::median(&each))
    };
    // The floor moves no bytes: one figure serves every size.
    let floor = count(a.backend[0], Path::Floor, 4096)?;
    let mut rows = Vec::new();
    for &b in &a.backend {
        for &size in &a.sizes {
            let count = |backend, path| count(backend, path, size);
            let adapter = count(b, Path::Adapter)?;
            let raw = count(b, Path::Raw)?;
            let vs_bare_verbs = if b == CostBackend::Mori {
                let bare = count(CostBackend::Verbs, Path::Raw)?;
                Some(adapter / bare)
            } else {
                None
            };
            rows.push(Row {
                backend: b,
                size,
                adapter,
                raw,
                ratio: adapter / raw,
                lowest: 1.0 + floor / raw,
                vs_bare_verbs,
            });
        }
    }
    pb.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "floor": floor, "rows": rows }))?);
    } else {
        print!("{}", table(&rows, floor, a.transfers, a.repeat));
    }
    Ok(())
}

fn table(rows: &[Row], floor: f64, n: u64, repeat: u32) -> String {
    let mut s = format!(
        "instructions per transfer (callgrind, all threads; one WRITE of one slot, posted and awaited; \
         (I(2N) - I(N)) / N with N = {n}, median of {repeat})\n\
         the core's own work per transfer, no engine (admission, exposure, handle, settlement): {floor:.0}; \
         no adapter / raw can be below `lowest` = 1 + {floor:.0} / raw\n"
    );
    s += &format!(
        "{:<9} {:>8} {:>12} {:>12} {:>14} {:>8}\n",
        "backend", "size", "adapter", "raw", "adapter / raw", "lowest"
    );
    for r in rows {
        s += &format!(
            "{:<9} {:>8} {:>12.0} {:>12.0} {:>14.3} {:>8.3}",
            r.backend.name(),
            units::fmt_size(r.size),
            r.adapter,
            r.raw,
            r.ratio,
            r.lowest
        );
        if let Some(v) = r.vs_bare_verbs {
            s += &format!("   (adapter / bare verbs raw: {v:.3})");
        }
        s += "\n";
    }
    s
}

/// `valgrind` is on the path, or an error saying how to get it.
fn valgrind_present() -> anyhow::Result<()> {
    match Command::new("valgrind").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => bail!(
            "kvt cost counts instructions with valgrind's callgrind, which is not installed: apt-get install valgrind"
        ),
    }
}

/// Total instructions of all threads of one child run of `path`.
fn instructions(exe: &std::path::Path, b: CostBackend, path: Path, size: usize, count: u64) -> anyhow::Result<u64> {
    let spec = format!("{}:{}:{size}:{count}", b.name(), path.name());
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(exe)
        .args(["cost", "--run", &spec])
        .output()
        .with_context(|| format!("running {spec} under callgrind"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
        bail!("{spec} failed under callgrind:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    collected(&stderr).ok_or_else(|| anyhow!("{spec}: no instruction total in callgrind's output"))
}

/// The `Collected : N` total of callgrind's summary.
fn collected(stderr: &str) -> Option<u64> {
    stderr.lines().find_map(|l| {
        let (_, rest) = l.split_once("Collected :")?;
        rest.trim().parse().ok()
    })
}

/// The child's side: `BACKEND:PATH:BYTES:COUNT`.
fn run_spec(spec: &str) -> anyhow::Result<()> {
    let bad = || anyhow!("--run takes BACKEND:PATH:BYTES:COUNT, not {spec:?}");
    let mut it = spec.split(':');
    let backend = it.next().and_then(CostBackend::parse).ok_or_else(bad)?;
    let path = match it.next() {
        Some("adapter") => Path::Adapter,
        Some("raw") => Path::Raw,
        Some("floor") => Path::Floor,
        _ => return Err(bad()),
    };
    let size: usize = it.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
    let count: u64 = it.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
    if it.next().is_some() || size == 0 || size > MAX_SIZE {
        return Err(bad());
    }
    paths::run(backend, path, size, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_is_read_from_callgrinds_summary() {
        let err = "==12== Events    : Ir\n==12== Collected : 20468798\n==12==\n==12== I   refs:      20,468,798\n";
        assert_eq!(collected(err), Some(20_468_798));
        assert_eq!(collected("nothing here"), None);
    }

    #[test]
    fn a_malformed_run_spec_is_refused() {
        for spec in [
            "",
            "tcp-sim",
            "tcp-sim:adapter",
            "nope:adapter:4096:1",
            "tcp-sim:both:4096:1",
            "tcp-sim:raw:0:1",
            "tcp-sim:floor:4096",
            "tcp-sim:raw:1099511627776:1",
        ] {
            assert!(run_spec(spec).is_err(), "{spec:?} accepted");
        }
    }
}
