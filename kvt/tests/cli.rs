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
