//! A prefill peer as a separate process, for tests that kill it with
//! SIGKILL mid-transfer.
//!
//! Usage: `sim-peer <target-endpoint> <name>`. It connects, prints
//! `connected`, then reads one descriptor per stdin line (a `RemoteSlots`
//! as JSON, token included), fills that many slots
//! with 0xAB, posts a WRITE (with NOTIFY), prints `posted`, and prints `done
//! <result>` when it completes. It exits when stdin closes.

use backend_tcp_sim::{block_on, NicConfig, SimNic};
use kv_transfer_core::{HostRegion, PoolConfig, RemoteSlots, Transfer, TransferOptions};
use std::io::{BufRead, Write};
use std::sync::Arc;

fn parse(line: &str) -> Option<RemoteSlots> {
    serde_json::from_str(line).ok()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(endpoint), Some(name)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: sim-peer <target-endpoint> <name>");
        std::process::exit(2);
    };
    let nic = match SimNic::start(NicConfig::new(name.clone())) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("start: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = nic.connect(endpoint) {
        eprintln!("connect: {e}");
        std::process::exit(1);
    }
    let mut out = std::io::stdout();
    let _ = writeln!(out, "connected");
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Some(remote) = parse(&line) else {
            eprintln!("bad descriptor: {line}");
            continue;
        };
        let n = remote.slots.len();
        let size = remote.slot_size as usize;
        let pool = match HostRegion::new(n * size)
            .map_err(|e| e.to_string())
            .and_then(|r| nic.register_pool(Arc::new(r), PoolConfig::new(size)).map_err(|e| e.to_string()))
        {
            Ok(p) => p,
            Err(e) => {
                eprintln!("pool: {e}");
                continue;
            }
        };
        let Ok(mut lease) = pool.reserve(n) else { continue };
        for i in 0..n {
            let _ = lease.write_at(i, 0, &vec![0xAB; size]);
        }
        match block_on(nic.write(lease, &remote, TransferOptions::default())) {
            Ok(h) => {
                let _ = writeln!(out, "posted");
                let _ = out.flush();
                let res = block_on(h).map(|o| o.result);
                let _ = writeln!(out, "done {res:?}");
                let _ = out.flush();
            }
            Err(e) => {
                let _ = writeln!(out, "post failed: {}", e.kind);
                let _ = out.flush();
            }
        }
    }
}
