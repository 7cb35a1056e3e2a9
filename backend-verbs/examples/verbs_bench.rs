//! Speed of the verbs adapter against a raw verbs loop, in one run on one
//! device (software RDMA in the lab: compare the ratios, not the GB/s).
//!
//! 1. WRITE, one at a time, at each size: the raw loop (the engine layer's
//!    post and completion, no leases) against the adapter (reserve, post,
//!    await the handle, release; the same WRs into an exposed slot).
//! 2. One tenancy's access: bind a window + `LOCAL_INV` (what the adapter
//!    does per exposure) against registering and deregistering a region per
//!    tenancy (the alternative).
//!
//! Rounds alternate the order of what is compared; the figures are medians
//! over rounds. Usage (in the lab):
//! `scripts/rdma-lab run -- target/release/examples/verbs_bench [ITERS] [ROUNDS]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_verbs::*;
use kv_transfer_core::{block_on, HostRegion, PoolConfig, Region, Transfer, TransferOptions};

const WAIT: Duration = Duration::from_secs(30);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn region(len: usize) -> Arc<dyn Region> {
    Arc::new(HostRegion::new(len).expect("region"))
}

/// µs per WRITE of `size`, one at a time, through the engine layer.
fn raw_loop(pd: &Arc<ProtectionDomain>, gid: u8, size: usize, iters: usize) -> f64 {
    let cq_a = CompletionQueue::new(pd, 1024).expect("cq");
    let cq_b = CompletionQueue::new(pd, 1024).expect("cq");
    let a = QueuePair::new(pd, &cq_a, 1, gid).expect("qp");
    let b = QueuePair::new(pd, &cq_b, 1, gid).expect("qp");
    // The MTU the adapter runs at: the port's, at most 4096.
    let mtu = pd.context().active_mtu(1).expect("port").min(VerbsConfig::new("x", "y", 1).mtu);
    a.connect(&b.endpoint(mtu).expect("ep")).expect("connect");
    b.connect(&a.endpoint(mtu).expect("ep")).expect("connect");
    let src = MemoryRegion::register(pd, region(size), MrAccess::Local).expect("src");
    let dst = MemoryRegion::register(pd, region(size), MrAccess::WindowsOnly).expect("dst");
    let mut w = MemoryWindow::new(pd).expect("mw");
    let key = b.post_bind(1, &mut w, &dst, 0, size as u32).expect("bind");
    let c = cq_b.wait_for(b.qp_num(), 1, WAIT).expect("poll").expect("bind completion");
    w.bind_completed(c.status.is_success(), dst.addr(), size as u32);
    let t0 = Instant::now();
    for i in 0..iters as u64 {
        a.post_write(10 + i, &src, 0, size as u32, dst.addr(), key).expect("post");
        let c = cq_a.wait_for(a.qp_num(), 10 + i, WAIT).expect("poll").expect("completion");
        assert!(c.status.is_success(), "{c:?}");
    }
    t0.elapsed().as_secs_f64() * 1e6 / iters as f64
}

/// µs per WRITE of `size` through the adapter (reserve, post, await, release).
fn adapter_loop(env: &LabEnv, size: usize, iters: usize, busy_poll: bool) -> f64 {
    let mk = |n: &str| {
        let mut c = VerbsConfig::new(n, &env.device, env.gid_index);
        c.busy_poll = busy_poll;
        VerbsTransfer::new(c).expect("adapter")
    };
    let (prefill, decode) = (mk("bench-prefill"), mk("bench-decode"));
    let dpool = decode.register_pool(region(size), PoolConfig::new(size)).expect("pool");
    let ppool = prefill.register_pool(region(size), PoolConfig::new(size)).expect("pool");
    prefill.add_peer(decode.descriptor()).expect("peer");
    let peer = decode.add_peer(prefill.descriptor()).expect("peer");
    let (exposed, remote) = decode.expose(dpool.reserve(1).expect("reserve"), peer).expect("expose");
    let t0 = Instant::now();
    for _ in 0..iters {
        let src = ppool.reserve(1).expect("reserve");
        let h = block_on(prefill.write(src, &remote, TransferOptions::notify(false))).expect("post");
        let mut h = h;
        let out = kv_transfer_core::poll_until(std::pin::Pin::new(&mut h), WAIT)
            .expect("completes in 30 s")
            .expect("outcome");
        out.result.expect("write");
        out.lease.release();
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    exposed.abort();
    us
}

/// µs per tenancy: window bind + LOCAL_INV, or reg_mr + dereg_mr.
fn tenancy_cycles(pd: &Arc<ProtectionDomain>, gid: u8, size: usize, iters: usize) -> (f64, f64) {
    let cq = CompletionQueue::new(pd, 1024).expect("cq");
    let cq_b = CompletionQueue::new(pd, 1024).expect("cq");
    let qp = QueuePair::new(pd, &cq, 1, gid).expect("qp");
    let other = QueuePair::new(pd, &cq_b, 1, gid).expect("qp");
    qp.connect(&other.endpoint(1024).expect("ep")).expect("connect");
    other.connect(&qp.endpoint(1024).expect("ep")).expect("connect");
    let mem = region(size);
    let mr = MemoryRegion::register(pd, Arc::clone(&mem), MrAccess::WindowsOnly).expect("mr");
    let mut w = MemoryWindow::new(pd).expect("mw");
    let t0 = Instant::now();
    for i in 0..iters as u64 {
        qp.post_bind(2 * i + 1, &mut w, &mr, 0, size as u32).expect("bind");
        let c = cq.wait_for(qp.qp_num(), 2 * i + 1, WAIT).expect("poll").expect("bind");
        w.bind_completed(c.status.is_success(), mr.addr(), size as u32);
        qp.post_invalidate(2 * i + 2, &mut w).expect("inv");
        let c = cq.wait_for(qp.qp_num(), 2 * i + 2, WAIT).expect("poll").expect("inv");
        w.invalidate_completed(c.status.is_success());
    }
    let window = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    let t0 = Instant::now();
    for _ in 0..iters {
        drop(MemoryRegion::register(pd, Arc::clone(&mem), MrAccess::RemoteWriteRead).expect("reg"));
    }
    let register = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    (window, register)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let iters: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let rounds: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    let env = LabEnv::from_env();
    let ctx = match Context::open(&env.device) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("verbs_bench: {e}");
            std::process::exit(2);
        }
    };
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    println!("verbs_bench on {} (GID index {}), {iters} iterations x {rounds} rounds", env.device, env.gid_index);
    for size in [64 << 10, 1 << 20] {
        // Interleaved, order alternating by round: drift on a shared
        // machine hits all three alike.
        let (mut raw, mut busy, mut backoff) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rounds {
            if r % 2 == 0 {
                raw.push(raw_loop(&pd, env.gid_index, size, iters));
                busy.push(adapter_loop(&env, size, iters, true));
                backoff.push(adapter_loop(&env, size, iters, false));
            } else {
                backoff.push(adapter_loop(&env, size, iters, false));
                busy.push(adapter_loop(&env, size, iters, true));
                raw.push(raw_loop(&pd, env.gid_index, size, iters));
            }
        }
        let ratio = |a: &[f64]| -> Vec<f64> { raw.iter().zip(a).map(|(r, a)| r / a).collect() };
        let (rb, ro) = (ratio(&busy), ratio(&backoff));
        println!(
            "WRITE {:>5} KiB: raw {:8.1} us, adapter {:8.1} us (busy poll) / {:8.1} us (backoff) per op; \
             adapter/raw throughput {:.2} busy (rounds {:.2?}), {:.2} backoff (rounds {:.2?})",
            size >> 10,
            median(raw.clone()),
            median(busy.clone()),
            median(backoff.clone()),
            median(rb.clone()),
            rb,
            median(ro.clone()),
            ro
        );
    }
    let (mut win, mut reg) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (w, r) = tenancy_cycles(&pd, env.gid_index, 1 << 20, iters);
        win.push(w);
        reg.push(r);
    }
    println!(
        "per tenancy (1 MiB slot): window bind + LOCAL_INV {:.1} us, reg_mr + dereg_mr {:.1} us; register/window {:.2}",
        median(win.clone()),
        median(reg.clone()),
        median(reg) / median(win)
    );
}
