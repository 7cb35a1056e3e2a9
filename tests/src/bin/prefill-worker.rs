//! A prefill worker in its own process, for the peer-crash scenarios: it
//! connects to the decode side and, for every command read from stdin (one
//! JSON object per line:
//! `{"remote": RemoteSlots, "request": N, "repeat": R, "notify": bool}`), WRITEs request N's
//! tagged payload into the remote slots R times back to back. The test
//! freezes and kills it mid-transfer.
//!
//! usage: prefill-worker DECODE_ENDPOINT NAME SLOT_SIZE
//!        prefill-worker --mooncake DECODE_SEGMENT LOCAL_HOST SLOT_SIZE
//!
//! The first runs a simulated NIC; the second our Mooncake engine (TCP) on
//! LOCAL_HOST, which prints its own segment name as the first line of stdout
//! (`segment NAME`) for the decode side to add.

use backend_tcp_sim::{block_on, NicConfig, SimNic};
use kv_transfer_core::{HostRegion, PoolConfig, RemoteSlots, SlotPool, Transfer, TransferOptions};
use kv_transfer_testkit::wait::poll_until;
use kv_transfer_tests::harness::fill_tagged;
use std::io::BufRead;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, segment, host, slot_size] if flag == "--mooncake" => mooncake(segment, host, slot_size),
        [endpoint, name, slot_size] => {
            let slot_size: usize = slot_size.parse().map_err(|e| format!("SLOT_SIZE: {e}"))?;
            let nic = SimNic::start(NicConfig::new(name.clone())).map_err(|e| e.to_string())?;
            let region = HostRegion::new(64 * slot_size).map_err(|e| e.to_string())?;
            let pool = nic.register_pool(Arc::new(region), PoolConfig::new(slot_size)).map_err(|e| e.to_string())?;
            nic.connect(endpoint).map_err(|e| e.to_string())?;
            serve(&nic, &pool)
        }
        _ => Err("usage: prefill-worker DECODE_ENDPOINT NAME SLOT_SIZE | \
                  prefill-worker --mooncake DECODE_SEGMENT LOCAL_HOST SLOT_SIZE"
            .into()),
    }
}

#[cfg(feature = "mooncake")]
fn mooncake(segment: &str, host: &str, slot_size: &str) -> Result<(), String> {
    use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer, TcpTransportConfig};
    let slot_size: usize = slot_size.parse().map_err(|e| format!("SLOT_SIZE: {e}"))?;
    let cfg = EngineConfig {
        local_host: host.to_string(),
        tcp: TcpTransportConfig { io_timeout: Duration::from_secs(1), ..TcpTransportConfig::default() },
        ..EngineConfig::default()
    };
    let engine = MooncakeEngine::new(cfg).map_err(|e| e.to_string())?;
    let t = MooncakeTransfer::new(Arc::new(engine), AdapterConfig::default()).map_err(|e| e.to_string())?;
    let region = HostRegion::new(64 * slot_size).map_err(|e| e.to_string())?;
    let pool = t.register_pool(Arc::new(region), PoolConfig::new(slot_size)).map_err(|e| e.to_string())?;
    t.add_peer(segment).map_err(|e| e.to_string())?;
    println!("segment {}", t.segment_name());
    serve(&t, &pool)
}

#[cfg(not(feature = "mooncake"))]
fn mooncake(_: &str, _: &str, _: &str) -> Result<(), String> {
    Err("built without the feature `mooncake`".into())
}

/// Runs the commands on stdin through `t`, sources from `pool`.
fn serve(t: &impl Transfer, pool: &SlotPool) -> Result<(), String> {
    for line in std::io::stdin().lock().lines().take(10_000) {
        let line = line.map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        let remote: RemoteSlots =
            serde_json::from_value(v.get("remote").cloned().unwrap_or_default()).map_err(|e| e.to_string())?;
        let request = v.get("request").and_then(serde_json::Value::as_u64).unwrap_or(0);
        let repeat = v.get("repeat").and_then(serde_json::Value::as_u64).unwrap_or(1).clamp(1, 16);
        // `"notify": false`: no DONE, so only a drain, revocation or fence settles the target.
        let opts = match v.get("notify").and_then(serde_json::Value::as_bool) {
            Some(n) => TransferOptions::notify(n),
            None => TransferOptions::default(),
        };
        let mut handles = Vec::new();
        for _ in 0..repeat {
            let mut src = pool.reserve(remote.slots.len()).map_err(|e| e.to_string())?;
            fill_tagged(&mut src, &remote, request).map_err(|e| e.0)?;
            handles.push(block_on(t.write(src, &remote, opts.clone())).map_err(|e| e.to_string())?);
        }
        for mut h in handles {
            if let Some(Ok(out)) = poll_until(std::pin::Pin::new(&mut h), Duration::from_secs(30)) {
                out.lease.release();
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefill-worker: {e}");
            ExitCode::FAILURE
        }
    }
}
