//! The disaggregated prefill/decode demo: the same seeded workload of
//! aborts, reassignments and writes held past their abort, run under the
//! `naive` release policy (free on abort, like SGLang before its fix) and the
//! `safe` one (free only with a proof), side by side.
//!
//! ```sh
//! cargo run --release -p kv-transfer-examples --bin demo
//! cargo run --release -p kv-transfer-examples --bin demo -- --requests 20000 --abort-rate 0.5 --seed 7
//! cargo run --release -p kv-transfer-examples --bin demo -- --policy safe --json
//! cargo run --release -p kv-transfer-examples --bin demo -- --device fake-device
//! ```

use backend_tcp_sim::ReleasePolicy;
use kv_transfer_examples::race::{policy_name as name, run_race, table, RaceConfig};
use std::process::ExitCode;

const USAGE: &str = "\
demo: prefill and decode workers on loopback over the TCP simulator (separate NICs), the same seeded
workload under the naive and the safe release policy, side by side.

usage: demo [--requests N] [--abort-rate F] [--hold-rate F] [--seed S] [--policy naive|safe|both]
            [--device host|fake-device|cuda[:N]] [--json]

  --requests N      requests served per policy (default 10000)
  --abort-rate F    share of requests aborted while their writes are in flight (default 0.3)
  --hold-rate F     share of rounds whose writes are held at the decode NIC past their aborts (default 0.5)
  --seed S          seed of the schedule (default 1)
  --policy P        naive, safe or both (default both)
  --device D        where the slots live: host (default), fake-device (device-like memory that faults on
                    any CPU access) or cuda[:N] (a GPU; built with the feature cuda)
  --json            print the reports as JSON instead of the table";

struct Args {
    cfg: RaceConfig,
    policies: Vec<ReleasePolicy>,
    json: bool,
}

fn parse() -> Result<Option<Args>, String> {
    let mut cfg = RaceConfig { requests: 10_000, ..RaceConfig::default() };
    let mut policies = vec![ReleasePolicy::Naive, ReleasePolicy::Safe];
    let mut json = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--json" => json = true,
            "--requests" => cfg.requests = val(&a)?.parse().map_err(|e| format!("--requests: {e}"))?,
            "--abort-rate" => cfg.abort_rate = val(&a)?.parse().map_err(|e| format!("--abort-rate: {e}"))?,
            "--hold-rate" => cfg.hold_rate = val(&a)?.parse().map_err(|e| format!("--hold-rate: {e}"))?,
            "--seed" => cfg.seed = val(&a)?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--device" => cfg.memory = val(&a)?.parse().map_err(|e| format!("--device: {e}"))?,
            "--policy" => {
                policies = match val(&a)?.as_str() {
                    "naive" => vec![ReleasePolicy::Naive],
                    "safe" => vec![ReleasePolicy::Safe],
                    "both" => vec![ReleasePolicy::Naive, ReleasePolicy::Safe],
                    other => return Err(format!("--policy: expected naive, safe or both, got {other:?}")),
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(Args { cfg, policies, json }))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("demo: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let c = &args.cfg;
    if !args.json {
        println!(
            "kv-transfer demo: {} requests per policy, abort rate {}, hold rate {}, seed {}, {} slots of {} B per \
             request in {} memory",
            c.requests, c.abort_rate, c.hold_rate, c.seed, c.slots_per_request, c.slot_size, c.memory
        );
        println!("prefill workers 0 and 1 -> decode worker, separate NICs over loopback TCP (tcp-sim)\n");
    }
    let mut reports = Vec::new();
    for p in &args.policies {
        let cfg = RaceConfig { policy: *p, ..args.cfg.clone() };
        match run_race(&cfg, &mut |_, _| {}) {
            Ok(r) => reports.push((*p, r)),
            Err(e) => {
                eprintln!("demo: {} run failed: {e}", name(*p));
                return ExitCode::FAILURE;
            }
        }
    }
    if args.json {
        let v: Vec<_> = reports.iter().map(|(_, r)| r).collect();
        match serde_json::to_string_pretty(&v) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("demo: {e}");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }
    let rs: Vec<_> = reports.iter().map(|(_, r)| r.clone()).collect();
    print!("{}", table(&rs));
    for (p, r) in &reports {
        match p {
            ReleasePolicy::Naive if r.corrupted() => println!(
                "\nnaive: freed slots on abort without proof; {} requests read another request's KV bytes.",
                r.foreign_requests
            ),
            ReleasePolicy::Naive => println!("\nnaive: no corruption observed this run (raise --requests or --abort-rate)."),
            ReleasePolicy::Safe if !r.corrupted() && r.pool_whole() => println!(
                "safe: zero foreign bytes; late writes were rejected at the NIC or drained before reclaim, every slot came back."
            ),
            _ => println!("safe: CONTRACT VIOLATED: see the table."),
        }
    }
    ExitCode::SUCCESS
}
