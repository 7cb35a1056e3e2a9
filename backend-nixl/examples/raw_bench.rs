//! Raw NIXL throughput: two agents in one process, UCX on host memory, a plain
//! loop of post WRITE / poll to done over the C API wrappers, for 64 KiB and
//! 16 MiB blocks. Reports GB/s (10^9 bytes per second).
//!
//! ```sh
//! CARGO_TARGET_DIR=/work/main/tgt/nixl cargo run --release -p backend-nixl --example raw_bench
//! UCX_TLS=tcp CARGO_TARGET_DIR=/work/main/tgt/nixl cargo run --release -p backend-nixl --example raw_bench
//! ```
//! `KVT_BENCH_SECS` (default 2) bounds each size's run; `KVT_BENCH_REPOST=0`
//! creates a fresh request per iteration instead of re-posting one.

use std::time::{Duration, Instant};

use backend_nixl::engine::{Agent, AgentConfig, HostBuffer, NixlLibrary, XferOp, XferState};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lib = match NixlLibrary::load() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let secs: f64 = std::env::var("KVT_BENCH_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(2.0);
    let repost = std::env::var("KVT_BENCH_REPOST").as_deref() != Ok("0");
    // The initiator polls (no progress thread); the target runs NIXL's.
    let ini_cfg = AgentConfig { progress_thread: false, ..AgentConfig::default() };
    let tgt_cfg = AgentConfig { progress_thread: true, ..AgentConfig::default() };
    let pid = std::process::id();
    let ini = Agent::new(&lib, &format!("bench-ini-{pid}"), &ini_cfg)?;
    let tgt = Agent::new(&lib, &format!("bench-tgt-{pid}"), &tgt_cfg)?;
    let ib = ini.create_backend("UCX", &[])?;
    let tb = tgt.create_backend("UCX", &[])?;
    println!(
        "library: {}  UCX_TLS={}  repost={repost}",
        lib.path().display(),
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(default)".into())
    );

    for block in [64usize << 10, 16 << 20] {
        let mut src = HostBuffer::new(block)?;
        let dst = HostBuffer::new(block)?;
        src.fill(0x11);
        // SAFETY: the buffers outlive the registrations (dropped at the end of
        // this iteration, after every request has completed and been released).
        let sreg = unsafe { ini.register_dram(&[src.region()], Some(&ib)) }?;
        // SAFETY: as above.
        let treg = unsafe { tgt.register_dram(&[dst.region()], Some(&tb)) }?;
        let remote = ini.load_remote_metadata(&tgt.local_metadata()?)?;

        let budget = Duration::from_secs_f64(secs);
        let max_iters: u64 = 10_000_000;
        let mut req = None;
        let mut iters = 0u64;
        let mut polls = 0u64;
        let start = Instant::now();
        while iters < max_iters && start.elapsed() < budget {
            if req.is_none() || !repost {
                if let Some(r) = req.take() {
                    backend_nixl::engine::XferRequest::release(r).map_err(|(_, e)| e)?;
                }
                req =
                    Some(ini.create_xfer(XferOp::Write, &[src.region()], &[dst.region()], &remote, None, Some(&ib))?);
            }
            let Some(r) = req.as_mut() else { break };
            let mut st = r.post()?;
            // Poll to done, bounded by the same budget (plus slack).
            while st == XferState::InProgress && start.elapsed() < budget * 4 {
                st = r.status()?;
                polls += 1;
            }
            if st != XferState::Done {
                return Err("a transfer did not complete in time".into());
            }
            iters += 1;
        }
        let el = start.elapsed().as_secs_f64();
        if let Some(r) = req.take() {
            r.release().map_err(|(_, e)| e)?;
        }
        let bytes = iters as f64 * block as f64;
        println!(
            "block {:>9} B: {:>7} transfers in {:.2} s = {:.3} GB/s ({:.1} us/transfer, {:.1} polls/transfer)",
            block,
            iters,
            el,
            bytes / el / 1e9,
            el * 1e6 / iters.max(1) as f64,
            polls as f64 / iters.max(1) as f64
        );
        assert_eq!(dst.to_vec()[block - 1], 0x11, "data did not arrive");
        ini.invalidate_remote_metadata(&remote)?;
        drop(sreg);
        drop(treg);
    }
    Ok(())
}
