//! Prefill and decode as two processes (the `nixl_peer` binary), exchanging NIXL
//! metadata through files, loopback only, `UCX_TLS=tcp`:
//!
//! - a byte-checked WRITE and READ through the adapter;
//! - the hazard: raw NIXL (release while `IN_PROG`, new tenant fills the slot, the
//!   old bytes land afterwards) as the positive control, then the same scenario
//!   through the adapter, where no old byte may land.
//!
//! Run with `--nocapture` to see the figures. `KVT_HAZARD_MIB` sets the size
//! (default 256).

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(Vec<Child>);

impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if !matches!(c.try_wait(), Ok(Some(_))) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Runs decode and prefill for `mode`; returns both stdouts (and stderrs).
fn run_pair(mode: &str, mib: usize) -> (String, String) {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvt-nixl-peer-{}-{mode}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let tls = std::env::var("UCX_TLS").unwrap_or_else(|_| "tcp".into());
    let spawn = |role: &str| {
        Command::new(env!("CARGO_BIN_EXE_nixl_peer"))
            .args([role, dir.to_str().expect("utf-8 temp dir"), mode, &mib.to_string()])
            .env("UCX_TLS", &tls)
            .env("KVT_PEER_TIMEOUT_S", "60")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nixl_peer")
    };
    let mut kids = Kill(vec![spawn("decode"), spawn("prefill")]);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(120) {
        if kids.0.iter_mut().all(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut outs = Vec::new();
    for c in &mut kids.0 {
        let running = !matches!(c.try_wait(), Ok(Some(_)));
        if running {
            let _ = c.kill();
        }
        let status = c.wait().ok();
        let (mut o, mut e) = (String::new(), String::new());
        if let Some(s) = c.stdout.as_mut() {
            let _ = s.read_to_string(&mut o);
        }
        if let Some(s) = c.stderr.as_mut() {
            let _ = s.read_to_string(&mut e);
        }
        eprintln!("--- nixl_peer ({mode}) status {status:?}{}\n{o}{e}", if running { " (killed)" } else { "" });
        outs.push(o);
    }
    let _ = std::fs::remove_dir_all(&dir);
    (outs.remove(0), outs.remove(0))
}

/// The `key=value` fields of the line starting with `tag`.
fn fields(out: &str, tag: &str) -> HashMap<String, String> {
    let line = out.lines().find(|l| l.starts_with(tag)).unwrap_or_else(|| panic!("no {tag} line in {out:?}"));
    line.split(' ').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn two_processes_write_and_read_byte_checked() {
    if common::library_or_skip("two_processes_write_and_read_byte_checked").is_none() {
        return;
    }
    let (dec, pre) = run_pair("roundtrip", 0);
    let d = fields(&dec, "RESULT");
    let p = fields(&pre, "PREFILL");
    assert_eq!(d["write_bytes_ok"], "true", "{dec}");
    assert_eq!(p["write_ok"], "true", "{pre}");
    assert_eq!(p["read_bytes_ok"], "true", "{pre}");
    assert_eq!(d["settled_by_message"], "8", "{dec}");
}

#[test]
fn hazard_two_processes_raw_lands_late_bytes_adapter_lands_none() {
    if common::library_or_skip("hazard_two_processes").is_none() {
        return;
    }
    let mib: usize = std::env::var("KVT_HAZARD_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);

    // Positive control: raw NIXL, released while IN_PROG. Whether the release
    // catches the write in flight and the late bytes land after the slot
    // changed hands is a race between two processes: repeat it (bounded)
    // until it reproduces, require one reproduction, and report the rate.
    const ATTEMPTS: usize = 4;
    let mut tries = 0;
    let mut reproduced = 0;
    let (mut raw, mut raw_late, mut dec_raw) = (HashMap::new(), 0u64, String::new());
    while tries < ATTEMPTS && reproduced == 0 {
        tries += 1;
        let (dec, _) = run_pair("raw", mib);
        raw = fields(&dec, "RESULT");
        raw_late = raw["late_old_bytes"].parse().expect("number");
        if raw["prefill"] == "released-in-prog" && raw_late > 0 {
            reproduced += 1;
        }
        dec_raw = dec;
    }
    eprintln!("positive control: reproduced on attempt {tries} of at most {ATTEMPTS} ({reproduced}/{tries})");
    assert!(reproduced > 0, "positive control failed: no late bytes with raw NIXL in {tries} attempts\n{dec_raw}");
    // Through the adapter.
    let (dec, pre) = run_pair("adapter", mib);
    let ad = fields(&dec, "RESULT");
    let ad_late: u64 = ad["late_old_bytes"].parse().expect("number");
    eprintln!(
        "HAZARD {mib} MiB, two processes, UCX_TLS={}: raw release-while-IN_PROG: {raw_late} stale bytes landed in the \
         new tenant's slot (prefill {}); through the adapter: {ad_late} (slot back after {} ms)",
        std::env::var("UCX_TLS").unwrap_or_else(|_| "tcp".into()),
        raw["prefill"],
        ad["slot_back_after_ms"],
    );
    assert_eq!(ad_late, 0, "stale bytes landed through the adapter\n{dec}");
    assert_eq!(ad["quarantined_at_abort"], "1", "{dec}");
    assert_eq!(ad["still_changing"], "false", "{dec}");
    assert!(pre.contains("in_flight_left: 0"), "prefill did not drain its request\n{pre}");
}
