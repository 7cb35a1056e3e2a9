//! `kvt cost` end to end: the simulator's adapter and raw NIC counted under
//! callgrind. Without valgrind the test is listed as ignored with what it
//! needs (`scripts/test` installs it); with `CI=true` it fails instead.

use libtest_mimic::{Arguments, Failed, Trial};
use std::process::Command;

fn valgrind() -> bool {
    Command::new("valgrind").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// The cost of a transfer through the adapter and through the raw NIC are
/// both counted, positive, and of the same order (the adapter adds a lease
/// and its bookkeeping to a path whose cost is the NIC's own); the core's
/// floor is counted too, and is a part of the adapter's cost.
fn cost_counts_the_adapter_and_the_raw_path() -> Result<(), Failed> {
    let o = Command::new(env!("CARGO_BIN_EXE_kvt"))
        .args(["cost", "--backend", "tcp-sim", "--sizes", "4KiB", "--transfers", "40", "--json"])
        .output()
        .map_err(|e| format!("kvt runs: {e}"))?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned().into());
    }
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| format!("json: {e}"))?;
    let r = &v["rows"][0];
    let (adapter, raw) = (r["adapter"].as_f64().unwrap_or(0.0), r["raw"].as_f64().unwrap_or(0.0));
    if r["backend"] != "tcp-sim" || r["size"] != 4096 {
        return Err(format!("not the row asked for: {v}").into());
    }
    if !(raw > 1000.0 && adapter > raw * 0.5 && adapter < raw * 5.0) {
        return Err(format!("adapter {adapter}, raw {raw} instructions per transfer: {v}").into());
    }
    // The floor is a part of the adapter's work (the core's, with no engine):
    // counted, below the adapter's whole cost, and the bound it sets is
    // 1 + floor / raw.
    let (floor, lowest) = (v["floor"].as_f64().unwrap_or(0.0), r["lowest"].as_f64().unwrap_or(0.0));
    if !(floor > 100.0 && floor < adapter) {
        return Err(format!("floor {floor} against adapter {adapter} instructions per transfer: {v}").into());
    }
    if (lowest - (1.0 + floor / raw)).abs() > 1e-9 {
        return Err(format!("lowest {lowest} is not 1 + {floor} / {raw}: {v}").into());
    }
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let present = valgrind();
    if !present {
        eprintln!("kvt cost's test needs valgrind (apt-get install valgrind; scripts/test installs it): ignored here");
    }
    let trial = Trial::test("cost_counts_the_adapter_and_the_raw_path", move || {
        if !present {
            return Err("valgrind is not installed (CI=true: not skipped)".into());
        }
        cost_counts_the_adapter_and_the_raw_path()
    })
    .with_ignored_flag(!present && !ci);
    libtest_mimic::run(&args, vec![trial]).exit();
}
