//! The `kvt` binary, end to end.

use std::process::Command;

fn kvt(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvt")).args(args).output().expect("kvt runs")
}

#[test]
fn help_lists_subcommands() {
    let o = kvt(&["--help"]);
    assert!(o.status.success());
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("bench") && s.contains("race"), "{s}");
    let o = kvt(&["bench", "--help"]);
    let s = String::from_utf8_lossy(&o.stdout);
    for flag in [
        "--mode",
        "--backend",
        "--op",
        "--block-size",
        "--batch",
        "--threads",
        "--duration",
        "--sweep",
        "--plot",
        "--rounds",
        "--json",
    ] {
        assert!(s.contains(flag), "bench --help lacks {flag}: {s}");
    }
}

#[test]
fn tiny_bench_json() {
    for op in ["write", "read"] {
        let o = kvt(&[
            "bench",
            "--op",
            op,
            "--block-size",
            "64KiB",
            "--batch",
            "4",
            "--threads",
            "1",
            "--duration",
            "100ms",
            "--warmup",
            "0s",
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        let r = &v[0];
        assert_eq!(r["backend"], "tcp-sim");
        assert_eq!(r["op"], op);
        assert_eq!(r["block_size"], 65536);
        assert!(r["bytes"].as_u64().unwrap_or(0) > 0, "{v}");
        assert!(r["gb_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
        assert!(r["p99_us"].as_u64().unwrap_or(0) >= r["p50_us"].as_u64().unwrap_or(0));
    }
}

/// `--rounds`: every backend once per round, rounds paired into ratios.
#[cfg(feature = "mori")]
#[test]
fn rounds_report_medians_and_per_round_ratios() {
    let args = |json: bool| {
        let mut v = vec![
            "bench",
            "--backend",
            "tcp-sim,mori",
            "--rounds",
            "2",
            "--block-size",
            "64KiB",
            "--batch",
            "2",
            "--threads",
            "1",
            "--duration",
            "50ms",
            "--warmup",
            "0s",
        ];
        if json {
            v.push("--json");
        }
        kvt(&v)
    };
    let o = args(true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 4, "{v}");
    // Round 0 runs tcp-sim first, round 1 mori first.
    let order: Vec<(u64, &str)> =
        results.iter().map(|r| (r["round"].as_u64().unwrap_or(9), r["backend"].as_str().unwrap_or(""))).collect();
    assert_eq!(order, [(0, "tcp-sim"), (0, "mori"), (1, "mori"), (1, "tcp-sim")]);
    let summary = v["summary"].as_array().expect("summary");
    assert_eq!(summary.len(), 2, "{v}");
    assert_eq!((summary[0]["backend"].as_str(), summary[0]["rounds"].as_u64()), (Some("tcp-sim"), Some(2)));
    assert!(summary[0]["ratio"].is_null(), "{v}");
    assert!(summary[1]["ratio"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
    let o = args(false);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("vs tcp-sim") && table.lines().any(|l| l.starts_with("mori")), "{table}");
}

#[test]
fn a_backend_listed_twice_is_refused() {
    let o = kvt(&["bench", "--backend", "tcp-sim,tcp-sim", "--duration", "10ms"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("twice"));
}

#[test]
fn sweep_writes_a_plot() {
    let dir = std::env::temp_dir().join(format!("kvt-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let svg = dir.join("out.svg");
    let o = kvt(&[
        "bench",
        "--sweep",
        "4KiB,64KiB",
        "--batch",
        "2",
        "--threads",
        "1",
        "--duration",
        "50ms",
        "--warmup",
        "0s",
        "--json",
        "--plot",
        svg.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(2));
    let s = std::fs::read_to_string(&svg).expect("svg written");
    assert!(s.starts_with("<svg") && s.contains("polyline") && s.contains("tcp-sim write"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn target_and_initiator_across_processes() {
    use std::io::BufRead;
    let mut target = Command::new(env!("CARGO_BIN_EXE_kvt"))
        .args(["bench", "--mode", "target", "--listen", "127.0.0.1:0", "--sessions", "1"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("target starts");
    let mut first = String::new();
    let stderr = target.stderr.take().expect("stderr");
    let mut lines = std::io::BufReader::new(stderr);
    lines.read_line(&mut first).expect("target prints its address");
    let addr = first.split("control on ").nth(1).and_then(|r| r.split(',').next()).expect("address").to_string();
    let o = kvt(&[
        "bench",
        "--mode",
        "initiator",
        "--target",
        &addr,
        "--block-size",
        "4KiB",
        "--batch",
        "2",
        "--threads",
        "1",
        "--duration",
        "100ms",
        "--warmup",
        "0s",
        "--json",
    ]);
    let _ = target.wait();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v[0]["mode"], "initiator");
    assert!(v[0]["bytes"].as_u64().unwrap_or(0) > 0);
}

#[test]
fn tiny_race_json() {
    let o = kvt(&["race", "--requests", "300", "--policy", "both", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let naive = &v[0];
    let safe = &v[1];
    assert_eq!(naive["config"]["policy"], "Naive");
    assert!(naive["foreign_requests"].as_u64().unwrap_or(0) > 0, "naive showed no corruption: {naive}");
    assert_eq!(safe["foreign_requests"], 0);
    assert_eq!(safe["final_free"], safe["capacity"]);
}

#[test]
fn missing_backend_names_what_to_install() {
    let compiled = [
        ("nixl", "nixl-cu12", cfg!(feature = "nixl")),
        ("mooncake", "mooncake-transfer-engine", cfg!(feature = "mooncake")),
        ("mori", "MORI-IO semantics", cfg!(feature = "mori")),
    ];
    for (b, what, built_in) in compiled {
        if built_in {
            // Compiled in: the backend's own tests and rig cover it.
            continue;
        }
        let o = kvt(&["bench", "--backend", b, "--duration", "10ms"]);
        assert_eq!(o.status.code(), Some(2));
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(&format!("--features {b}")), "{e}");
        assert!(e.contains(what), "{e}");
    }
    let o = kvt(&["bench", "--block-size", "12XB"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown size unit"));
}
