//! The two paths `kvt cost` counts, per backend: the same WRITE of one slot,
//! posted and awaited, `count` times after a warm-up.
//!
//! The adapter path is one loop for every backend, over its
//! `Arc<dyn Transfer>` (as `kvt bench` drives it). The raw paths are each
//! engine's own: what an engine's user writes without kv-transfer.

use super::{CostBackend, Path};
use anyhow::{anyhow, bail};
use kv_transfer_core::{
    block_on, poll_until, PoolConfig, RemoteSlots, Reserved, SlotLease, SlotPool, Transfer, TransferHandle,
    TransferOptions,
};
use std::sync::Arc;
use std::time::Duration;

/// Transfers before the counted ones (connections, caches and pools warm).
const WARMUP: u64 = 16;
/// Bound of one transfer's completion.
const WAIT: Duration = Duration::from_secs(30);

/// `Ok` when `b` can be counted in this build, else what it needs.
pub(super) fn available(b: CostBackend) -> anyhow::Result<()> {
    let missing = match b {
        CostBackend::TcpSim | CostBackend::Verbs => None,
        CostBackend::Mooncake => (!cfg!(feature = "mooncake")).then_some("mooncake"),
        CostBackend::Nixl => (!cfg!(feature = "nixl")).then_some("nixl"),
        CostBackend::Mori => (!cfg!(feature = "mori")).then_some("mori"),
    };
    if let Some(f) = missing {
        bail!("backend `{f}` is not compiled into this kvt: cargo run --release -p kvt --features {f} -- cost ...");
    }
    #[cfg(feature = "nixl")]
    if b == CostBackend::Nixl {
        // Here, not in 12 children under callgrind: the library is found or
        // the error says how to install it.
        backend_nixl::engine::NixlLibrary::load()?;
    }
    Ok(())
}

/// Runs `count` transfers of `size` bytes (after [`WARMUP`]) on `path` of `b`.
pub(super) fn run(b: CostBackend, path: Path, size: usize, count: u64) -> anyhow::Result<()> {
    let total = WARMUP + count;
    match (b, path) {
        (_, Path::Floor) => floor(size, total),
        (CostBackend::TcpSim, Path::Adapter) => adapter(
            crate::backends::loopback_rig(crate::Backend::TcpSim, 1, size, crate::backends::Placement::default())?,
            total,
        ),
        (CostBackend::TcpSim, Path::Raw) => raw_sim(size, total),
        #[cfg(feature = "mooncake")]
        (CostBackend::Mooncake, Path::Adapter) => adapter(
            crate::backends::loopback_rig(crate::Backend::Mooncake, 1, size, crate::backends::Placement::default())?,
            total,
        ),
        #[cfg(feature = "mooncake")]
        (CostBackend::Mooncake, Path::Raw) => raw_mooncake(size, total),
        #[cfg(feature = "nixl")]
        (CostBackend::Nixl, Path::Adapter) => adapter(
            crate::backends::loopback_rig(crate::Backend::Nixl, 1, size, crate::backends::Placement::default())?,
            total,
        ),
        #[cfg(feature = "nixl")]
        (CostBackend::Nixl, Path::Raw) => raw_nixl(size, total),
        (CostBackend::Verbs, Path::Adapter) => adapter(verbs_rig(size)?, total),
        (CostBackend::Verbs, Path::Raw) => raw_verbs(size, total),
        #[cfg(feature = "mori")]
        (CostBackend::Mori, Path::Adapter) => adapter(mori_rig(size)?, total),
        #[cfg(feature = "mori")]
        (CostBackend::Mori, Path::Raw) => raw_mori(size, total),
        #[allow(unreachable_patterns)]
        (b, _) => available(b),
    }
}

/// The adapter path: a lease of one slot written into the exposed slot,
/// awaited, and written again (as `kvt bench` with one thread and batch 1).
fn adapter(rig: crate::backends::Rig, total: u64) -> anyhow::Result<()> {
    let res = adapter_loop(&rig.transfer, &rig.pool, &rig.remote, total);
    (rig.teardown)();
    res
}

fn adapter_loop(t: &Arc<dyn Transfer>, pool: &SlotPool, remote: &RemoteSlots, total: u64) -> anyhow::Result<()> {
    let one = RemoteSlots { slots: remote.slots[..1].to_vec(), ..remote.clone() };
    let mut lease = pool.reserve(1).map_err(|e| anyhow!("the initiator's slot: {e}"))?;
    for i in 0..total {
        let mut h = block_on(t.write(lease, &one, TransferOptions::notify(false)))
            .map_err(|e| anyhow!("post {i} refused: {}", e.kind))?;
        lease = awaited(&mut h, i)?;
    }
    lease.release();
    Ok(())
}

/// Transfer `i`'s handle awaited (as the adapter path and the floor both
/// wait: the same wait on both sides of the comparison), its lease back.
fn awaited(h: &mut TransferHandle, i: u64) -> anyhow::Result<SlotLease<Reserved>> {
    let out = poll_until(std::pin::Pin::new(h), WAIT)
        .ok_or_else(|| anyhow!("transfer {i} did not complete within {WAIT:?}"))?
        .map_err(|e| anyhow!("transfer {i}: {e}"))?;
    out.result.map_err(|e| anyhow!("transfer {i}: {e}"))?;
    Ok(out.lease.into_reserved())
}

/// The core's own work per transfer, with no engine and no second thread:
/// the operation admitted by an abort tracker, the lease exposed, a
/// completion handle paired, the lease settled by its completion proof and
/// handed back through the handle (ready when polled: nothing parks), the
/// tracker told the operation ended. Every adapter does at least this per
/// transfer, so no backend's adapter / raw ratio can be below
/// 1 + floor / raw. The cheapest tracker key (`()`, as tcp-sim's) keeps it
/// a lower bound.
fn floor(size: usize, total: u64) -> anyhow::Result<()> {
    use kv_transfer_core::drain::{AbortTracker, ExposureToken, OpEnd};
    use kv_transfer_core::{Generation, HostRegion, PeerId, PoolId, RemoteSlot, SlotId};
    let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(size)?), PoolConfig::new(size))?;
    let remote = RemoteSlots {
        endpoint: "floor".into(),
        pool: PoolId(u64::MAX),
        key: 0,
        slot_size: size as u64,
        memory: Default::default(),
        token: ExposureToken::random(),
        slots: vec![RemoteSlot { slot: SlotId(0), generation: Generation(1), addr: 0, key: None }],
    };
    let mut tracker = AbortTracker::<()>::new(1024);
    let mut lease = pool.reserve(1).map_err(|e| anyhow!("the slot: {e}"))?;
    for op in 0..total {
        tracker.admit(op, &(), &remote, false).map_err(|e| anyhow!("admission {op}: {e}"))?;
        let (mut handle, completer) = TransferHandle::pair(authority.expose_local(lease, PeerId(1)));
        let proof = authority.completed_lease(completer.lease());
        completer.complete(proof, Ok(())).map_err(|e| anyhow!("settlement {op}: {e:?}"))?;
        if !tracker.finished(op, OpEnd::Proven).is_empty() {
            bail!("operation {op}: an ABORT_ACK came due with no ABORT sent");
        }
        lease = awaited(&mut handle, op)?;
    }
    lease.release();
    Ok(())
}

/// The simulator's raw NIC: a one-sided WRITE from the initiator's
/// registered memory (no copy, as a lease's) into the exposed slot,
/// completing to a queue by token (no callback allocated), awaited.
fn raw_sim(size: usize, total: u64) -> anyhow::Result<()> {
    use backend_tcp_sim::{NicConfig, RawAccess, RawCompletions, SimNic};
    use std::sync::{Condvar, Mutex};

    #[derive(Default)]
    struct Queue {
        done: Mutex<Vec<(u64, bool)>>,
        cv: Condvar,
    }
    impl RawCompletions for Queue {
        fn complete(&self, token: u64, result: Result<Option<bytes::Bytes>, kv_transfer_core::TransferError>) {
            let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
            d.push((token, result.is_ok()));
            self.cv.notify_one();
        }
    }

    let target = SimNic::start(NicConfig::new("cost-target"))?;
    let init = SimNic::start(NicConfig::new("cost-initiator"))?;
    let crate::backends::Pair { pool, exposed, remote, .. } =
        crate::backends::connect(&init, &target, 1, size, crate::backends::Placement::default())?;
    let key = init.key_of(&pool).ok_or_else(|| anyhow!("the initiator's pool has no key"))?;
    let access = RawAccess::of(&remote, 0).ok_or_else(|| anyhow!("no slot exposed"))?;
    let peer =
        init.wait_for_peer("cost-target", WAIT).ok_or_else(|| anyhow!("the initiator does not know the target"))?;
    let q = Arc::new(Queue::default());
    let cq: Arc<dyn RawCompletions> = q.clone();
    for token in 0..total {
        init.write_raw_registered(peer, access, (key, 0, size), &[], cq.clone(), token)?;
        let mut d = q.done.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = std::time::Instant::now() + WAIT;
        while d.is_empty() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                bail!("raw write {token} did not complete within {WAIT:?}");
            }
            d = q.cv.wait_timeout(d, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        if d.drain(..).any(|(t, ok)| t != token || !ok) {
            bail!("raw write {token} failed");
        }
    }
    target.revoke(&exposed);
    if let Ok(s) = exposed.try_settled() {
        s.release();
    }
    Ok(())
}

/// Mooncake's engine: a batch of one request, submitted, waited for, freed.
#[cfg(feature = "mooncake")]
fn raw_mooncake(size: usize, total: u64) -> anyhow::Result<()> {
    use backend_mooncake::{
        EngineConfig, MemoryRegion, MooncakeEngine, TcpTransportConfig, TransferEngine, TransferRequest, TransferStatus,
    };
    // The shapes of the adapter's rig (kvt's mooncake backend).
    let engine = |workers: usize| {
        MooncakeEngine::new(EngineConfig {
            local_host: "127.0.0.1".into(),
            tcp: TcpTransportConfig { workers, ..TcpTransportConfig::default() },
            ..EngineConfig::default()
        })
    };
    let (init, target) = (engine(8)?, engine(2)?);
    let mut tbuf = vec![0u8; size];
    let mut lbuf = vec![7u8; size];
    // SAFETY: both buffers outlive the engines, which are dropped first (below).
    target.register_memory(unsafe { MemoryRegion::new(tbuf.as_mut_ptr() as u64, size as u64) })?;
    // SAFETY: as above.
    init.register_memory(unsafe { MemoryRegion::new(lbuf.as_mut_ptr() as u64, size as u64) })?;
    let seg = init.open_segment(&target.local_segment_name())?;
    let rbase = init.segment_info(seg)?.desc.buffers.first().ok_or_else(|| anyhow!("the target has no buffer"))?.addr;
    let req = TransferRequest {
        opcode: backend_mooncake::TcpOpcode::Write,
        source: lbuf.as_ptr() as u64,
        target_id: seg,
        target_offset: rbase,
        length: size as u64,
    };
    for i in 0..total {
        let b = init.allocate_batch_id(1)?;
        for task in init.submit_transfer(b, std::slice::from_ref(&req))? {
            let s = init.wait_transfer(b, task, WAIT)?;
            if s.status != TransferStatus::Completed {
                bail!("raw transfer {i}: {s:?}");
            }
        }
        init.free_batch_id(b)?;
    }
    drop(init);
    drop(target);
    drop((tbuf, lbuf));
    Ok(())
}

/// NIXL's C API: one transfer request created once and re-posted (what the
/// adapter's request cache does), polled to done.
#[cfg(feature = "nixl")]
fn raw_nixl(size: usize, total: u64) -> anyhow::Result<()> {
    use backend_nixl::engine::{Agent, AgentConfig, HostBuffer, NixlLibrary, XferOp, XferState};
    let lib = NixlLibrary::load()?;
    let tag = std::process::id();
    let ini = Agent::new(
        &lib,
        &format!("cost-ini-{tag}"),
        &AgentConfig { progress_thread: false, ..AgentConfig::default() },
    )?;
    let tgt =
        Agent::new(&lib, &format!("cost-tgt-{tag}"), &AgentConfig { progress_thread: true, ..AgentConfig::default() })?;
    let ib = ini.create_backend("UCX", &[])?;
    let tb = tgt.create_backend("UCX", &[])?;
    let mut src = HostBuffer::new(size)?;
    let dst = HostBuffer::new(size)?;
    src.fill(0x11);
    // SAFETY: the buffers outlive the registrations (dropped after the
    // request is released, at the end of this function).
    let sreg = unsafe { ini.register_mem(&[src.region()], Some(&ib)) }?;
    // SAFETY: as above.
    let treg = unsafe { tgt.register_mem(&[dst.region()], Some(&tb)) }?;
    let remote = ini.load_remote_metadata(&tgt.local_metadata()?)?;
    let mut req = ini.create_xfer(XferOp::Write, &[src.region()], &[dst.region()], &remote, None, Some(&ib))?;
    let res = (|| -> anyhow::Result<()> {
        for i in 0..total {
            let mut st = req.post()?;
            let deadline = std::time::Instant::now() + WAIT;
            while st == XferState::InProgress && std::time::Instant::now() < deadline {
                st = req.status()?;
            }
            if st != XferState::Done {
                bail!("raw transfer {i} did not complete: {st:?}");
            }
        }
        Ok(())
    })();
    req.release().map_err(|(_, e)| e)?;
    ini.invalidate_remote_metadata(&remote)?;
    drop((sreg, treg));
    res
}

/// Two verbs adapters on one software fabric, connected: the verbs rig.
fn verbs_rig(size: usize) -> anyhow::Result<crate::backends::Rig> {
    use backend_verbs::{FakeFabric, VerbsConfig, VerbsTransfer};
    let fabric = FakeFabric::new(7);
    let side = |name: &str| VerbsTransfer::with_engine(VerbsConfig::new(name, "fake0", 0), fabric.nic());
    let init = side("cost-initiator")?;
    let target = side("cost-target")?;
    let crate::backends::Pair { pool, target_pool, exposed, remote } =
        crate::backends::connect(&init, &target, 1, size, crate::backends::Placement::default())?;
    let transfer: Arc<VerbsTransfer> = Arc::new(init);
    let keep = transfer.clone();
    let teardown = Box::new(move || {
        exposed.abort();
        crate::backends::await_settled(&target_pool, "verbs", "not revoked", Duration::from_secs(10));
        drop(target);
        drop(keep);
        drop(fabric);
    });
    Ok(crate::backends::Rig { backend: "verbs", transfer, pool, remote, teardown })
}

/// A raw loop on the software NIC's engine layer: two connected queue
/// pairs, the target's memory registered for remote access, a WRITE posted
/// and its completion polled.
fn raw_verbs(size: usize, total: u64) -> anyhow::Result<()> {
    use backend_verbs::{Engine, FakeFabric, MrAccess, QpId, WcStatus, WorkRequest};
    let fabric = FakeFabric::new(7);
    let (a, b): (Arc<dyn Engine>, Arc<dyn Engine>) = (fabric.nic(), fabric.nic());
    let region = |n| -> anyhow::Result<Arc<kv_transfer_core::HostRegion>> {
        Ok(Arc::new(kv_transfer_core::HostRegion::new(n).map_err(|e| anyhow!("{e}"))?))
    };
    let src = a.register(region(size)?, MrAccess::Local)?;
    let dst = b.register(region(size)?, MrAccess::RemoteWriteRead)?;
    let (qa, qb) = (a.create_qp(4096)?, b.create_qp(4096)?);
    a.connect(QpId(qa.qpn), &qb)?;
    b.connect(QpId(qb.qpn), &qa)?;
    for i in 0..total {
        let wr =
            WorkRequest::Write { local: src.id, offset: 0, len: size as u32, remote_addr: dst.addr, rkey: dst.rkey };
        a.post(QpId(qa.qpn), i, wr)?;
        let deadline = std::time::Instant::now() + WAIT;
        'wait: loop {
            for c in a.poll(16)? {
                if c.wr_id == i {
                    if c.status != WcStatus::Success {
                        bail!("raw write {i}: {:?}", c.status);
                    }
                    break 'wait;
                }
            }
            if std::time::Instant::now() > deadline {
                bail!("raw write {i} did not complete within {WAIT:?}");
            }
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Two MORI adapters on verbs transports over one software fabric.
#[cfg(feature = "mori")]
fn mori_rig(size: usize) -> anyhow::Result<crate::backends::Rig> {
    use backend_mori::harness::MoriSide;
    use backend_mori::verbs::VerbsTransportConfig;
    use backend_mori::EngineConfig;
    let fabric = backend_verbs::FakeFabric::new(7);
    let side = |key: &str| -> anyhow::Result<MoriSide<backend_mori::VerbsTransport>> {
        let region = Arc::new(kv_transfer_core::HostRegion::new(size).map_err(|e| anyhow!("{e}"))?);
        Ok(MoriSide::on_verbs(
            key,
            region,
            PoolConfig::new(size),
            VerbsTransportConfig::default(),
            fabric.nic(),
            EngineConfig::default(),
        )?)
    };
    let (target, init) = (side("cost-target")?, side("cost-initiator")?);
    let (peer, _) = target.connect(&init)?;
    let (exposed, remote) = target
        .transfer
        .expose(target.pool.reserve(1).map_err(|e| anyhow!("{e}"))?, peer)
        .map_err(|e| anyhow!("{}", e.kind))?;
    let transfer: Arc<dyn Transfer> = Arc::new(init.transfer.clone());
    let pool = init.pool.clone();
    let teardown = Box::new(move || {
        exposed.abort();
        crate::backends::await_settled(&target.pool, "mori", "not revoked", Duration::from_secs(10));
        drop((target, init, fabric));
    });
    Ok(crate::backends::Rig { backend: "mori", transfer, pool, remote, teardown })
}

/// MORI's engine on a verbs transport, as MORI keys memory (the region's
/// key grants the peer all of it): a write of one region into the other,
/// its status waited for.
#[cfg(feature = "mori")]
fn raw_mori(size: usize, total: u64) -> anyhow::Result<()> {
    use backend_mori::verbs::{Access, VerbsTransport, VerbsTransportConfig};
    use backend_mori::{EngineConfig, HostBuffer, IoEngine, MemoryRegion, MoriEngine, StatusCode, Tag};
    let fabric = backend_verbs::FakeFabric::new(7);
    let engine = |key: &str| -> anyhow::Result<MoriEngine> {
        let cfg = VerbsTransportConfig { access: Access::RegionKey, ..VerbsTransportConfig::default() };
        let t = VerbsTransport::new(cfg, fabric.nic())?;
        Ok(MoriEngine::new(key, EngineConfig::default(), t)?)
    };
    let (a, b) = (engine("cost-initiator")?, engine("cost-target")?);
    a.register_remote_engine(&b.engine_desc())?;
    b.register_remote_engine(&a.engine_desc())?;
    let local = a.register_memory(MemoryRegion::host(HostBuffer::zeroed(size)))?;
    let remote = b.register_memory(MemoryRegion::host(HostBuffer::zeroed(size)))?;
    for i in 0..total {
        let uid = a.allocate_transfer_unique_id();
        let st = a.write(&local, 0, &remote, 0, size as u64, uid, Tag::default());
        let code = st.wait_for(WAIT);
        if code != StatusCode::Success {
            bail!("raw MORI write {i}: {code:?}");
        }
    }
    drop((a, b, fabric));
    Ok(())
}
