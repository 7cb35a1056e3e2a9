//! Throughput bench shaped like Mooncake's `transfer_engine_bench` initiator
//! (`--features testing`: it drives the crate's `bench` rig).
//!
//! ```text
//! mc_bench [--segment HOST:PORT] [--op write|read] [--duration SECS]
//!          [--threads N] [--batch N] [--block BYTES] [--workers N]
//!          [--rdma DEVICE] [--adapter [--no-hooks]]
//! ```
//! Without `--segment` it starts its own target engine in-process (our
//! initiator → our target); with it, it targets that segment (for example a
//! real `transfer_engine_bench --mode=target`), writing into its first buffer.
//! `mc_bench --serve SECS [--buffer BYTES]` only runs our target for SECS
//! seconds and prints `listening on HOST:PORT` (for a real initiator).
//! With `--adapter` it drives the kv-transfer adapter instead of the raw
//! engine ([`backend_mooncake::bench::run`]): leases, settlement, and (against
//! our own target) the full expose → write+notify → settle cycle per batch.
//! `--no-hooks` makes the adapter's waiter threads wait for every operation
//! instead of the engine's completion hooks settling it
//! (`AdapterConfig::engine_hooks`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mooncake::{
    EngineConfig, MemoryRegion, MooncakeEngine, TcpOpcode, TcpTransportConfig, TransferEngine, TransferRequest,
    TransferStatus,
};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| default.to_string())
}

/// Our engine: TCP, or with `--rdma DEVICE` Mooncake's RDMA transport on
/// that verbs device (feature `rdma-device`; the lab's guest has `rxe_lo`).
fn engine(cfg: EngineConfig, rdma: &str) -> Result<MooncakeEngine, Box<dyn std::error::Error>> {
    if rdma.is_empty() {
        return Ok(MooncakeEngine::new(cfg)?);
    }
    #[cfg(feature = "rdma-device")]
    {
        use backend_mooncake::rdma::{rdma_engine, Publish, RdmaNics};
        let lab = backend_verbs::LabEnv::from_env();
        let open = || backend_verbs::DeviceEngine::open(rdma, 1, lab.gid_index);
        let nics = RdmaNics { initiator: open()?, target: open()? };
        Ok(rdma_engine(cfg, nics, rdma, Publish::Registrations)?.0)
    }
    #[cfg(not(feature = "rdma-device"))]
    Err(format!("--rdma {rdma}: build with --features rdma-device (and run where a verbs device exists)").into())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let rdma = arg(&args, "--rdma", "");
    let segment = arg(&args, "--segment", "");
    let op = match arg(&args, "--op", "write").as_str() {
        "read" => TcpOpcode::Read,
        _ => TcpOpcode::Write,
    };
    let duration = Duration::from_secs_f64(arg(&args, "--duration", "5").parse()?);
    let threads: u64 = arg(&args, "--threads", "4").parse()?;
    let batch: u64 = arg(&args, "--batch", "32").parse()?;
    let block: u64 = arg(&args, "--block", "1048576").parse()?;
    let workers: usize = arg(&args, "--workers", "8").parse()?;
    let span = threads * batch * block;
    let serve: f64 = arg(&args, "--serve", "0").parse()?;
    if serve > 0.0 {
        let len: u64 = arg(&args, "--buffer", "1073741824").parse()?;
        let mut buf = vec![0u8; len as usize];
        let t = engine(EngineConfig::default(), &rdma)?;
        // SAFETY: `buf` outlives the engine (dropped first below).
        t.register_memory(unsafe { MemoryRegion::new(buf.as_mut_ptr() as u64, len) })?;
        println!("listening on {}", t.local_segment_name());
        std::thread::sleep(Duration::from_secs_f64(serve));
        drop(t);
        drop(buf);
        return Ok(());
    }

    if args.iter().any(|a| a == "--adapter") {
        if !rdma.is_empty() {
            return Err("--adapter runs over TCP only (the RDMA adapter's figures come from the raw engine)".into());
        }
        let cfg = backend_mooncake::bench::BenchConfig {
            target: (!segment.is_empty()).then(|| segment.clone()),
            op: if op == TcpOpcode::Read { kv_transfer_core::Op::Read } else { kv_transfer_core::Op::Write },
            duration,
            threads: threads as usize,
            batch: batch as usize,
            block: block as usize,
            workers,
            drivers: arg(&args, "--drivers", "4").parse()?,
            engine_hooks: !args.iter().any(|a| a == "--no-hooks"),
        };
        let r = backend_mooncake::bench::run(&cfg)?;
        println!("mc_bench adapter: op={op:?} threads={threads} batch={batch} block={block} workers={workers}: {r}");
        return Ok(());
    }

    let mut tbuf = vec![0u8; if segment.is_empty() { span as usize } else { 0 }];
    let target = if segment.is_empty() {
        let t = engine(EngineConfig::default(), &rdma)?;
        // SAFETY: `tbuf` outlives the engine (dropped explicitly below first).
        t.register_memory(unsafe { MemoryRegion::new(tbuf.as_mut_ptr() as u64, span) })?;
        Some(t)
    } else {
        None
    };
    let seg_name = target.as_ref().map(|t| t.local_segment_name()).unwrap_or(segment);
    let mut lbuf = vec![7u8; span as usize];
    let cfg = EngineConfig { tcp: TcpTransportConfig { workers, ..Default::default() }, ..Default::default() };
    let init = Arc::new(engine(cfg, &rdma)?);
    let lbase = lbuf.as_mut_ptr() as u64;
    // SAFETY: `lbuf` outlives the engine (dropped explicitly below first).
    init.register_memory(unsafe { MemoryRegion::new(lbase, span) })?;
    let seg = init.open_segment(&seg_name)?;
    let info = init.segment_info(seg)?;
    let rbase = info.desc.buffers.first().ok_or("target has no buffer")?.addr;
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut hs = Vec::new();
    for t in 0..threads {
        let (init, stop, bytes) = (init.clone(), stop.clone(), bytes.clone());
        hs.push(std::thread::spawn(move || -> Result<(), String> {
            while !stop.load(Ordering::Relaxed) {
                let b = init.allocate_batch_id(batch as usize).map_err(|e| e.to_string())?;
                let reqs: Vec<_> = (0..batch)
                    .map(|i| {
                        let off = (t * batch + i) * block;
                        TransferRequest {
                            opcode: op,
                            source: lbase + off,
                            target_id: seg,
                            target_offset: rbase + off,
                            length: block,
                        }
                    })
                    .collect();
                let r = init.submit_transfer(b, &reqs).map_err(|e| e.to_string())?;
                for task in r {
                    let s = init.wait_transfer(b, task, Duration::from_secs(30)).map_err(|e| e.to_string())?;
                    if s.status != TransferStatus::Completed {
                        return Err(format!("task {task}: {s:?}"));
                    }
                }
                init.free_batch_id(b).map_err(|e| e.to_string())?;
                bytes.fetch_add(batch * block, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().map_err(|_| "thread panicked")??;
    }
    let secs = start.elapsed().as_secs_f64();
    let b = bytes.load(Ordering::Relaxed) as f64;
    println!(
        "mc_bench: op={op:?} target={seg_name} proto={:?} threads={threads} batch={batch} block={block} workers={workers}: {:.3} GB/s ({:.0} MB in {secs:.2} s)",
        info.proto,
        b / secs / 1e9,
        b / 1e6
    );
    drop(init);
    drop(target);
    drop(lbuf);
    drop(tbuf);
    Ok(())
}
