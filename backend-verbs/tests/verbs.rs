//! The engine layer on a real verbs device: what the NIC itself enforces for
//! each of the contract's proofs, each with its positive control where one
//! exists. A custom harness (`libtest-mimic`): where no verbs device exists
//! (this project's hosts) every test is marked *ignored* with the command
//! that runs them (`scripts/rdma-lab test`); in the lab's guest
//! (`KVT_RDMA_LAB=1`) a missing device fails them instead.

#[cfg(feature = "verbs")]
mod on_device {
    use backend_verbs::*;
    use kv_transfer_core::drain::ReleasePolicy;
    use kv_transfer_core::{
        block_on, EscalationLadder, HostRegion, PeerId, PoolConfig, Region, SlotPool, Transfer, TransferOptions,
    };
    use std::sync::Arc;
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(10);
    const MTU: u32 = 1024;
    const SLOT: usize = 64 << 10;

    pub type Check = fn(&Lab) -> Result<(), String>;

    /// An open device and a protection domain.
    pub struct Lab {
        pub pd: Arc<ProtectionDomain>,
        pub gid_index: u8,
        pub device: String,
    }

    impl Lab {
        pub fn open(env: &LabEnv) -> Result<Self, VerbsError> {
            let ctx = Context::open(&env.device)?;
            let pd = ProtectionDomain::new(&ctx)?;
            Ok(Self { pd, gid_index: env.gid_index, device: env.device.clone() })
        }

        /// A prefill and a decode adapter, connected; each with a pool.
        fn adapters(&self, policy: ReleasePolicy, slots: usize, slot: usize) -> Result<Adapters, String> {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let mk = |name: &str| {
                let mut cfg = VerbsConfig::new(format!("{name}-{}", std::process::id()), &self.device, self.gid_index);
                cfg.release_policy = policy;
                VerbsTransfer::new(cfg).map_err(|x| e(&x))
            };
            let (prefill, decode) = (mk("prefill")?, mk("decode")?);
            let fast = EscalationLadder {
                drain: Duration::from_millis(1),
                revoke: Duration::from_millis(1),
                fence: Duration::from_secs(30),
            };
            let region = |n: usize| -> Result<Arc<dyn Region>, String> {
                Ok(Arc::new(HostRegion::new(n * slot).map_err(|x| e(&x))?))
            };
            let dpool =
                decode.register_pool(region(slots)?, PoolConfig::new(slot).with_ladder(fast)).map_err(|x| e(&x))?;
            let ppool = prefill.register_pool(region(slots)?, PoolConfig::new(slot)).map_err(|x| e(&x))?;
            prefill.add_peer(decode.descriptor()).map_err(|x| e(&x))?;
            let peer = decode.add_peer(prefill.descriptor()).map_err(|x| e(&x))?;
            Ok(Adapters { prefill, decode, ppool, dpool, peer })
        }

        fn region(&self, len: usize, access: MrAccess, byte: u8) -> Result<Arc<MemoryRegion>, String> {
            let r: Arc<dyn Region> = Arc::new(HostRegion::new(len).map_err(|e| e.to_string())?);
            r.write(0, &vec![byte; len]).map_err(|e| e.to_string())?;
            MemoryRegion::register(&self.pd, r, access).map_err(|e| e.to_string())
        }

        /// Two connected RC queue pairs (initiator, target), each with its CQ.
        fn pair(&self) -> Result<(QueuePair, QueuePair), String> {
            let e = |e: VerbsError| e.to_string();
            let a = QueuePair::new(&self.pd, &CompletionQueue::new(&self.pd, 1024).map_err(e)?, 1, self.gid_index)
                .map_err(e)?;
            let b = QueuePair::new(&self.pd, &CompletionQueue::new(&self.pd, 1024).map_err(e)?, 1, self.gid_index)
                .map_err(e)?;
            // Through the side channel's wire form, as two hosts would.
            let ea = Endpoint::decode(&a.endpoint(MTU).map_err(e)?.encode()).map_err(e)?;
            let eb = Endpoint::decode(&b.endpoint(MTU).map_err(e)?.encode()).map_err(e)?;
            a.connect(&eb).map_err(e)?;
            b.connect(&ea).map_err(e)?;
            Ok((a, b))
        }
    }

    fn wait(qp: &QueuePair, wr_id: u64) -> Result<Completion, String> {
        qp.cq()
            .wait_for(qp.qp_num(), wr_id, WAIT)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no completion of wr {wr_id} within {WAIT:?}"))
    }

    fn invalidate(target: &QueuePair, w: &mut MemoryWindow, wr: u64) -> Result<(), String> {
        target.post_invalidate(wr, w).map_err(|e| e.to_string())?;
        let c = wait(target, wr)?;
        w.invalidate_completed(c.status.is_success());
        if !c.status.is_success() || !matches!(w.state(), WindowState::Unbound) {
            return Err(format!("LOCAL_INV: {c:?}"));
        }
        Ok(())
    }

    fn bytes(mr: &MemoryRegion, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        mr.region().read(0, &mut v).expect("read");
        v
    }

    fn bind(target: &QueuePair, w: &mut MemoryWindow, mr: &Arc<MemoryRegion>, wr: u64) -> Result<u32, String> {
        let key = target.post_bind(wr, w, mr, 0, SLOT as u32).map_err(|e| e.to_string())?;
        let c = wait(target, wr)?;
        w.bind_completed(c.status.is_success(), mr.addr(), SLOT as u32);
        if !c.status.is_success() || c.kind != WcKind::Bind {
            return Err(format!("bind: {c:?}"));
        }
        Ok(key)
    }

    fn write(init: &QueuePair, src: &Arc<MemoryRegion>, wr: u64, addr: u64, rkey: u32) -> Result<WcStatus, String> {
        init.post_write(wr, src, 0, SLOT as u32, addr, rkey).map_err(|e| e.to_string())?;
        Ok(wait(init, wr)?.status)
    }

    /// Revoked: a WRITE through the tenancy's window lands; after its
    /// `LOCAL_INV` completed, a WRITE with the old key is refused by the NIC
    /// (`REM_ACCESS_ERR`) and the slot is byte for byte unchanged.
    pub fn revoked_local_inv_refuses_the_stale_write_and_memory_is_unchanged(lab: &Lab) -> Result<(), String> {
        let (init, target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::WindowsOnly, 0)?;
        let mut w = MemoryWindow::new(&lab.pd).map_err(|e| e.to_string())?;
        let key = bind(&target, &mut w, &slot, 1)?;
        let first = lab.region(SLOT, MrAccess::Local, b'A')?;
        let st = write(&init, &first, 10, slot.addr(), key)?;
        if st != WcStatus::Success || bytes(&slot, SLOT) != vec![b'A'; SLOT] {
            return Err(format!("the write through the window did not land: {st:?}"));
        }
        invalidate(&target, &mut w, 2)?;
        let stale = lab.region(SLOT, MrAccess::Local, b'Z')?;
        let st = write(&init, &stale, 11, slot.addr(), key)?;
        if st != WcStatus::RemoteAccess {
            return Err(format!("a WRITE with the invalidated key ended {st:?}, expected RemoteAccess"));
        }
        if bytes(&slot, SLOT) != vec![b'A'; SLOT] {
            return Err("the stale WRITE changed the slot".into());
        }
        Ok(())
    }

    /// The positive control: with the `naive` registration (the region's
    /// own key grants remote WRITE) there is no per-tenancy key to retire,
    /// so the old tenancy's late WRITE lands in the slot.
    pub fn naive_positive_control_the_regions_own_key_lets_the_stale_write_land(lab: &Lab) -> Result<(), String> {
        let (init, _target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::RemoteWriteRead, 0)?;
        let first = lab.region(SLOT, MrAccess::Local, b'A')?;
        if write(&init, &first, 1, slot.addr(), slot.rkey())? != WcStatus::Success {
            return Err("the first write failed".into());
        }
        // "Aborted and reassigned": nothing at the NIC changes.
        let stale = lab.region(SLOT, MrAccess::Local, b'Z')?;
        let st = write(&init, &stale, 2, slot.addr(), slot.rkey())?;
        if st != WcStatus::Success || bytes(&slot, SLOT) != vec![b'Z'; SLOT] {
            return Err(format!("positive control: expected the stale write to land, got {st:?}"));
        }
        Ok(())
    }

    /// The next tenancy on the same window (invalidated, then bound under a
    /// new key) is reachable with the new key only; a bound window cannot
    /// be bound again without its invalidation.
    pub fn rebinding_the_window_under_a_new_key_retires_the_old_key(lab: &Lab) -> Result<(), String> {
        let (init, target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::WindowsOnly, 0)?;
        let mut w = MemoryWindow::new(&lab.pd).map_err(|e| e.to_string())?;
        let old = bind(&target, &mut w, &slot, 1)?;
        if !matches!(target.post_bind(9, &mut w, &slot, 0, SLOT as u32), Err(VerbsError::Invalid { .. })) {
            return Err("a bound window was bound again without its invalidation".into());
        }
        invalidate(&target, &mut w, 2)?;
        let new = bind(&target, &mut w, &slot, 3)?;
        if old == new {
            return Err(format!("the rebind kept key {old:#x}"));
        }
        let src = lab.region(SLOT, MrAccess::Local, b'N')?;
        let st = write(&init, &src, 10, slot.addr(), new)?;
        if st != WcStatus::Success {
            return Err(format!("a WRITE with the new key ended {st:?}"));
        }
        let stale = lab.region(SLOT, MrAccess::Local, b'Z')?;
        let st = write(&init, &stale, 11, slot.addr(), old)?;
        if st != WcStatus::RemoteAccess || bytes(&slot, SLOT) != vec![b'N'; SLOT] {
            return Err(format!("a WRITE with the retired key ended {st:?} (or changed the slot)"));
        }
        Ok(())
    }

    /// With `WindowsOnly` the region's own key grants nothing: only a window does.
    pub fn the_regions_own_key_grants_nothing_remote(lab: &Lab) -> Result<(), String> {
        let (init, _target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::WindowsOnly, 7)?;
        let src = lab.region(SLOT, MrAccess::Local, b'Z')?;
        let st = write(&init, &src, 1, slot.addr(), slot.rkey())?;
        if st != WcStatus::RemoteAccess || bytes(&slot, SLOT) != vec![7; SLOT] {
            return Err(format!("a WRITE with the region's own key ended {st:?} (or changed memory)"));
        }
        Ok(())
    }

    /// A rejected access takes the initiator's QP to ERR (RC): its next
    /// request completes flushed and proves nothing about the remote side.
    pub fn a_rejected_access_errors_the_queue_pair_and_flushes_what_follows(lab: &Lab) -> Result<(), String> {
        let (init, _target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::WindowsOnly, 0)?;
        let src = lab.region(SLOT, MrAccess::Local, b'Z')?;
        if write(&init, &src, 1, slot.addr(), 0x1234_5600)? != WcStatus::RemoteAccess {
            return Err("a WRITE with a made-up key was not refused".into());
        }
        let st = write(&init, &src, 2, slot.addr(), 0x1234_5600)?;
        if st != WcStatus::Flushed {
            return Err(format!("the next request on the errored QP ended {st:?}, expected Flushed"));
        }
        Ok(())
    }

    /// Fenced: moving a QP with requests posted to ERR completes every one of
    /// them flushed; a SEND posted afterwards never leaves (flushed at once;
    /// rxe gives a RECV posted after ERR no completion at all).
    pub fn fenced_a_queue_pair_in_error_flushes_every_posted_request(lab: &Lab) -> Result<(), String> {
        let (_init, target) = lab.pair()?;
        let buf = lab.region(SLOT, MrAccess::Local, 0)?;
        for wr in 0..8u64 {
            target.post_recv(wr, &buf, wr * 1024, 1024).map_err(|e| e.to_string())?;
        }
        target.to_error().map_err(|e| e.to_string())?;
        for wr in 0..8u64 {
            let c = wait(&target, wr)?;
            if c.status != WcStatus::Flushed {
                return Err(format!("RECV {wr} ended {c:?}, expected Flushed"));
            }
        }
        // A SEND posted after ERR never leaves: refused, or flushed at once.
        if target.post_send(100, &buf, 0, 64).is_ok() {
            let c = wait(&target, 100)?;
            if c.status != WcStatus::Flushed {
                return Err(format!("a SEND after ERR ended {c:?}"));
            }
        }
        if target.state() != QpState::Error {
            return Err(format!("the QP is {:?}", target.state()));
        }
        if target.cq().in_flight() != 0 {
            return Err(format!("{} requests still hold memory after their flush", target.cq().in_flight()));
        }
        Ok(())
    }

    /// On RC a SEND posted after WRITEs on the same QP is delivered after
    /// those WRITEs are placed: a notification can ride the data path.
    pub fn a_send_after_writes_arrives_after_they_are_placed(lab: &Lab) -> Result<(), String> {
        let (init, target) = lab.pair()?;
        let slot = lab.region(4 * SLOT, MrAccess::WindowsOnly, 0)?;
        let mut w = MemoryWindow::new(&lab.pd).map_err(|e| e.to_string())?;
        let key = target.post_bind(1, &mut w, &slot, 0, 4 * SLOT as u32).map_err(|e| e.to_string())?;
        let c = wait(&target, 1)?;
        w.bind_completed(c.status.is_success(), slot.addr(), 4 * SLOT as u32);
        let inbox = lab.region(64, MrAccess::Local, 0)?;
        target.post_recv(2, &inbox, 0, 64).map_err(|e| e.to_string())?;
        let src = lab.region(4 * SLOT, MrAccess::Local, b'W')?;
        let note = lab.region(64, MrAccess::Local, b'N')?;
        init.post_write(10, &src, 0, 4 * SLOT as u32, slot.addr(), key).map_err(|e| e.to_string())?;
        init.post_send(11, &note, 0, 64).map_err(|e| e.to_string())?;
        let c = wait(&target, 2)?;
        if c.status != WcStatus::Success || c.kind != WcKind::Recv || c.byte_len != 64 {
            return Err(format!("the SEND arrived as {c:?}"));
        }
        if bytes(&slot, 4 * SLOT) != vec![b'W'; 4 * SLOT] {
            return Err("the SEND arrived before the WRITE posted ahead of it was placed".into());
        }
        for wr in [10, 11] {
            let c = wait(&init, wr)?;
            if !c.status.is_success() {
                return Err(format!("initiator wr {wr}: {c:?}"));
            }
        }
        Ok(())
    }

    /// A type-2B key is bound to one QP: the same key through another QP
    /// pair is refused.
    pub fn a_window_key_works_only_through_its_queue_pair(lab: &Lab) -> Result<(), String> {
        let (_init, target) = lab.pair()?;
        let (other_init, _other_target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::WindowsOnly, 3)?;
        let mut w = MemoryWindow::new(&lab.pd).map_err(|e| e.to_string())?;
        let key = bind(&target, &mut w, &slot, 1)?;
        let src = lab.region(SLOT, MrAccess::Local, b'Z')?;
        let st = write(&other_init, &src, 2, slot.addr(), key)?;
        if st != WcStatus::RemoteAccess || bytes(&slot, SLOT) != vec![3; SLOT] {
            return Err(format!("a WRITE with another QP's window key ended {st:?} (or changed memory)"));
        }
        Ok(())
    }

    /// A posted request holds its memory until its completion is polled:
    /// dropping every handle of a region mid-request does not free it.
    pub fn a_posted_request_holds_its_memory_until_its_completion(lab: &Lab) -> Result<(), String> {
        let (init, target) = lab.pair()?;
        let slot = lab.region(SLOT, MrAccess::WindowsOnly, 0)?;
        let mut w = MemoryWindow::new(&lab.pd).map_err(|e| e.to_string())?;
        let key = bind(&target, &mut w, &slot, 1)?;
        let src = lab.region(SLOT, MrAccess::Local, b'H')?;
        let weak = Arc::downgrade(src.region());
        init.post_write(5, &src, 0, SLOT as u32, slot.addr(), key).map_err(|e| e.to_string())?;
        drop(src);
        if weak.upgrade().is_none() {
            return Err("the source region was freed while its WRITE was posted".into());
        }
        let c = wait(&init, 5)?;
        if !c.status.is_success() || weak.upgrade().is_some() {
            return Err(format!("after its completion ({c:?}) the region should be freed"));
        }
        Ok(())
    }

    /// Device memory with no dma-buf (core's fake device: its address faults
    /// on the CPU) is refused with a typed error before the NIC sees its
    /// address: GPUDirect RDMA registers device memory through a dma-buf,
    /// never through a host pointer it does not have.
    pub fn device_memory_without_a_dmabuf_is_refused_by_name(lab: &Lab) -> Result<(), String> {
        let region = Arc::new(kv_transfer_core::FakeDeviceRegion::new(1 << 16).map_err(|e| e.to_string())?);
        match MemoryRegion::register(&lab.pd, region, MrAccess::WindowsOnly) {
            Err(VerbsError::DeviceMemory { .. }) => Ok(()),
            Err(e) => Err(format!("expected VerbsError::DeviceMemory, got {e}")),
            Ok(_) => Err("a real NIC registered memory it cannot reach".into()),
        }
    }

    /// Out-of-bounds requests are refused before they reach the NIC, with
    /// nothing posted.
    pub fn out_of_bounds_requests_are_refused_before_posting(lab: &Lab) -> Result<(), String> {
        let (init, _target) = lab.pair()?;
        let src = lab.region(4096, MrAccess::Local, 0)?;
        for (off, len) in [(4096u64, 1u32), (1, 4096), (u64::MAX, 2)] {
            match init.post_write(1, &src, off, len, 0, 0) {
                Err(VerbsError::Invalid { .. }) => {}
                other => return Err(format!("post_write({off}, {len}) gave {other:?}")),
            }
        }
        if init.cq().in_flight() != 0 {
            return Err("a refused request holds memory".into());
        }
        Ok(())
    }

    struct Adapters {
        prefill: VerbsTransfer,
        decode: VerbsTransfer,
        ppool: SlotPool,
        dpool: SlotPool,
        peer: PeerId,
    }

    fn wait_metric(pool: &SlotPool, f: impl Fn(&kv_transfer_core::MetricsSnapshot) -> bool) -> bool {
        let deadline = std::time::Instant::now() + WAIT;
        while std::time::Instant::now() < deadline {
            if f(&pool.metrics()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    /// The adapter's happy path: a window per slot, WRITEs then the DONE as
    /// a SEND on the same QP; the exposure settles `Completed` with the
    /// bytes in place, and only after its windows are invalidated: the same
    /// descriptor used again (a late or hostile WRITE) is refused by the NIC
    /// and the slots are unchanged.
    pub fn adapter_write_then_done_settles_and_a_replayed_write_is_refused(lab: &Lab) -> Result<(), String> {
        let a = lab.adapters(ReleasePolicy::Safe, 4, SLOT)?;
        let (exposed, remote) =
            a.decode.expose(a.dpool.reserve(2).map_err(|e| e.to_string())?, a.peer).map_err(|e| e.to_string())?;
        if remote.slots.iter().any(|s| s.key.is_none()) || remote.key != 0 {
            return Err(format!("expected a window key per slot and no pool key: {remote:?}"));
        }
        let mut src = a.ppool.reserve(2).map_err(|e| e.to_string())?;
        src.write_at(0, 0, &vec![b'1'; SLOT]).map_err(|e| e.to_string())?;
        src.write_at(1, 0, &vec![b'2'; SLOT]).map_err(|e| e.to_string())?;
        let out = block_on(async {
            a.prefill
                .write(src, &remote, TransferOptions::default())
                .await
                .map_err(|e| e.kind.to_string())?
                .await
                .map_err(|e| e.to_string())
        })?;
        out.result.map_err(|e| format!("write: {e}"))?;
        out.lease.release();
        let mut settled = Box::pin(exposed.settled());
        let settled =
            kv_transfer_core::poll_until(settled.as_mut(), WAIT).ok_or("the DONE did not settle the exposure")?;
        let bytes = settled.bytes().map_err(|e| e.to_string())?;
        if bytes[..SLOT] != vec![b'1'; SLOT][..] || bytes[SLOT..] != vec![b'2'; SLOT][..] {
            return Err("the settled slots do not hold the written bytes".into());
        }
        if a.dpool.metrics().settled_completed != 2 || a.decode.counter("invalidations") < 2 {
            return Err(format!(
                "expected 2 Completed after 2 invalidations: {:?} {:?}",
                a.dpool.metrics(),
                a.decode.counters()
            ));
        }
        let mut late = a.ppool.reserve(2).map_err(|e| e.to_string())?;
        late.write_at(0, 0, &vec![b'X'; SLOT]).map_err(|e| e.to_string())?;
        let out = block_on(async {
            a.prefill
                .write(late, &remote, TransferOptions::notify(false))
                .await
                .map_err(|e| e.kind.to_string())?
                .await
                .map_err(|e| e.to_string())
        });
        match out {
            Ok(o) if o.result.is_err() => o.lease.release(),
            Ok(_) => return Err("a WRITE through invalidated windows succeeded".into()),
            Err(_) => {} // abandoned: flushed behind the refused one
        }
        let again = settled.bytes().map_err(|e| e.to_string())?;
        if again != bytes {
            return Err("the refused WRITE changed the settled slots".into());
        }
        settled.release();
        Ok(())
    }

    /// The reported hazard, on real RDMA: a large WRITE posted, its request
    /// aborted, the slot handed to a new tenant. Safe: the window is
    /// invalidated before the slot is freed, the rest of the WRITE is
    /// refused (`REM_ACCESS_ERR`), 0 stale bytes in the new tenant's slot.
    fn hazard(lab: &Lab, policy: ReleasePolicy) -> Result<(usize, bool), String> {
        const BIG: usize = 32 << 20;
        let a = lab.adapters(policy, 1, BIG)?;
        let (exposed, remote) =
            a.decode.expose(a.dpool.reserve(1).map_err(|e| e.to_string())?, a.peer).map_err(|e| e.to_string())?;
        let mut src = a.ppool.reserve(1).map_err(|e| e.to_string())?;
        src.write_at(0, 0, &vec![b'O'; BIG]).map_err(|e| e.to_string())?;
        let mut h =
            block_on(a.prefill.write(src, &remote, TransferOptions::notify(false))).map_err(|e| e.kind.to_string())?;
        exposed.abort();
        if !wait_metric(&a.dpool, |m| m.free == 1) {
            return Err(format!("the aborted slot never came back: {:?} {:?}", a.dpool.metrics(), a.decode.counters()));
        }
        // The new tenant's bytes.
        let mut next = a.dpool.reserve(1).map_err(|e| e.to_string())?;
        next.write_at(0, 0, &vec![b'N'; BIG]).map_err(|e| e.to_string())?;
        let out = kv_transfer_core::poll_until(std::pin::Pin::new(&mut h), Duration::from_secs(120));
        let refused = match out {
            Some(Ok(o)) => {
                let r = o.result.is_err();
                o.lease.release();
                r
            }
            Some(Err(_)) => true,
            None => {
                let mut bytes = vec![0u8; BIG];
                a.dpool.region().read(0, &mut bytes).map_err(|e| e.to_string())?;
                let stale = bytes.iter().filter(|&&b| b == b'O').count();
                return Err(format!(
                    "the old WRITE never finished ({stale} stale bytes); prefill {:?}; decode {:?}; {:?}",
                    a.prefill.counters(),
                    a.decode.counters(),
                    a.dpool.metrics()
                ));
            }
        };
        let mut bytes = vec![0u8; BIG];
        a.dpool.region().read(0, &mut bytes).map_err(|e| e.to_string())?;
        let stale = bytes.iter().filter(|&&b| b == b'O').count();
        drop(next);
        Ok((stale, refused))
    }

    pub fn hazard_large_write_aborted_and_reassigned_safe_lands_nothing(lab: &Lab) -> Result<(), String> {
        // 0 stale bytes on every try; the race must be exercised (the old
        // WRITE refused by the NIC) on one of up to 3.
        for _ in 0..3 {
            let (stale, refused) = hazard(lab, ReleasePolicy::Safe)?;
            if stale != 0 {
                return Err(format!("{stale} stale bytes landed in the new tenant's slot"));
            }
            if refused {
                return Ok(());
            }
        }
        Err("the old WRITE finished before the revoke in 3 tries: the race was not exercised".into())
    }

    /// Its positive control: the naive registration, the slot freed on
    /// abort: the old WRITE's bytes land in the new tenant's slot.
    /// (The race depends on the old WRITE still running when the slot is
    /// reused: tried up to 3 times, one reproduction required, the rate
    /// reported.)
    pub fn hazard_large_write_aborted_and_reassigned_naive_positive_control(lab: &Lab) -> Result<(), String> {
        const TRIES: usize = 3;
        for attempt in 1..=TRIES {
            let (stale, _) = hazard(lab, ReleasePolicy::Naive)?;
            if stale > 0 {
                eprintln!("naive: {stale} stale bytes landed in the new tenant's slot (reproduced on try {attempt} of {TRIES})");
                return Ok(());
            }
        }
        Err(format!("positive control: no stale byte landed in {TRIES} tries (the old WRITE ended before the reuse)"))
    }

    /// Bad input on the RECV buffers, from a peer that speaks the side
    /// channel and then SENDs garbage: truncated and foreign messages are
    /// dropped and counted (`malformed`), a DONE for another peer's exposure
    /// (with its token) is forged, one naming a future generation is stale,
    /// an oversize SEND errors only that peer's QP; nothing settles, memory
    /// is unchanged, and the real peer's DONE still settles.
    pub fn bad_input_on_recv_buffers_is_dropped_and_counted(lab: &Lab) -> Result<(), String> {
        use backend_verbs::adapter::{parse_descriptor, Hello};
        use kv_transfer_core::drain::{ControlKind, ControlMessage};
        use std::io::Write;
        let e = |e: &dyn std::fmt::Display| e.to_string();
        let a = lab.adapters(ReleasePolicy::Safe, 2, SLOT)?;
        let (exposed, remote) = a.decode.expose(a.dpool.reserve(1).map_err(|x| e(&x))?, a.peer).map_err(|x| e(&x))?;
        let slot = remote.slots[0].slot.0 as usize;
        let before = {
            let mut v = vec![0u8; SLOT];
            a.dpool.region().read(slot * SLOT, &mut v).map_err(|x| e(&x))?;
            v
        };
        // The garbler: its own QP, connected through the side channel.
        let cq = CompletionQueue::new(&lab.pd, 64).map_err(|x| e(&x))?;
        let qp = QueuePair::new(&lab.pd, &cq, 1, lab.gid_index).map_err(|x| e(&x))?;
        // It read the decode's descriptor: it has the side channel's ticket.
        let d = parse_descriptor(a.decode.descriptor().as_bytes()).map_err(|x| e(&x))?;
        let mut s = std::net::TcpStream::connect(&d.addr).map_err(|x| e(&x))?;
        // Every side-channel connection starts with core's handshake under
        // the cluster key (the lab's adapters take it from the environment).
        let auth = kv_transfer_core::auth::DialerConfig {
            key: kv_transfer_core::auth::ClusterKey::from_env().map_err(|x| e(&x))?,
            context: backend_verbs::adapter::AUTH_CONTEXT.into(),
            me: kv_transfer_core::auth::Identity::new(format!("garbler-{}", std::process::id()), ""),
            dialed: d.addr.clone(),
            expect_name: Some(d.name.clone()),
        };
        kv_transfer_core::auth::dial(&mut s, auth, &Default::default()).map_err(|x| e(&x))?;
        let ours = Hello {
            name: format!("garbler-{}", std::process::id()),
            endpoint: qp.endpoint(MTU).map_err(|x| e(&x))?,
            ticket: d.ticket,
        };
        // A dialer's hello is followed by its connection's nonce (the claim
        // the named peer would have to confirm; the garbler's never is).
        let mut hello = ours.encode().map_err(|x| e(&x))?;
        hello.extend_from_slice(&[0x6b; 16]);
        s.write_all(&hello).map_err(|x| e(&x))?;
        let theirs = Hello::read_from(&mut s).map_err(|x| e(&x))?;
        qp.connect(&theirs.endpoint).map_err(|x| e(&x))?;
        let send = |wr: u64, bytes: &[u8]| -> Result<WcStatus, String> {
            let mr = lab.region(bytes.len(), MrAccess::Local, 0)?;
            mr.region().write(0, bytes).map_err(|x| e(&x))?;
            qp.post_send(wr, &mr, 0, bytes.len() as u32).map_err(|x| e(&x))?;
            Ok(wait(&qp, wr)?.status)
        };
        let done = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies());
        let encoded = done.encode().map_err(|x| e(&x))?;
        let mut future = remote.tenancies();
        future[0].generation = kv_transfer_core::Generation(future[0].generation.0 + 1);
        let stale =
            ControlMessage::new(ControlKind::Done, remote.pool, remote.token, future).encode().map_err(|x| e(&x))?;
        let m0 = a.dpool.metrics();
        for (wr, bytes) in
            [(1u64, &encoded[..10]), (2, &b"not a control message at all"[..]), (3, &encoded[..]), (4, &stale[..])]
        {
            if send(wr, bytes)? != WcStatus::Success {
                return Err(format!("SEND {wr} was not delivered"));
            }
        }
        let deadline = std::time::Instant::now() + WAIT;
        let counted = || {
            let m = a.dpool.metrics();
            a.decode.counter("malformed") >= 2
                && m.forged_rejected + m.stale_rejected >= m0.forged_rejected + m0.stale_rejected + 2
        };
        while !counted() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        if !counted() {
            return Err(format!("bad input not counted: {:?} {:?}", a.decode.counters(), a.dpool.metrics()));
        }
        // Oversize: larger than a RECV buffer; errors the garbler's QP only.
        let big = vec![0u8; kv_transfer_core::drain::MAX_LEN + 1];
        let _ = send(5, &big)?;
        let exposed = match exposed.try_settled() {
            Ok(_) => return Err("bad input settled the exposure".into()),
            Err(l) => l,
        };
        let mut now = vec![0u8; SLOT];
        a.dpool.region().read(slot * SLOT, &mut now).map_err(|x| e(&x))?;
        if now != before {
            return Err("bad input changed the exposed slot".into());
        }
        // The real peer still writes, and its DONE settles.
        let mut src = a.ppool.reserve(1).map_err(|x| e(&x))?;
        src.write_at(0, 0, &vec![b'R'; SLOT]).map_err(|x| e(&x))?;
        let out = block_on(async {
            a.prefill
                .write(src, &remote, TransferOptions::default())
                .await
                .map_err(|x| x.kind.to_string())?
                .await
                .map_err(|x| x.to_string())
        })?;
        out.result.map_err(|x| format!("the real peer's write: {x}"))?;
        out.lease.release();
        let mut f = Box::pin(exposed.settled());
        let settled = kv_transfer_core::poll_until(f.as_mut(), WAIT).ok_or("the real peer's DONE did not settle")?;
        settled.release();
        Ok(())
    }

    const CRASH_SLOT: usize = 32 << 20;

    /// The child's side of the crash test: a prefill adapter that posts one
    /// large WRITE into the exposure its parent sends, then waits to be
    /// killed.
    pub fn crash_child(decode: &str) -> ! {
        use std::io::{BufRead, Write};
        let env = LabEnv::from_env();
        let t = VerbsTransfer::new(VerbsConfig::new(
            format!("crash-prefill-{}", std::process::id()),
            env.device,
            env.gid_index,
        ))
        .expect("child adapter");
        let pool = t
            .register_pool(Arc::new(HostRegion::new(CRASH_SLOT).expect("region")), PoolConfig::new(CRASH_SLOT))
            .expect("pool");
        t.add_peer(decode).expect("child adds decode");
        let mut out = std::io::stdout();
        writeln!(out, "{}", t.descriptor()).expect("stdout");
        out.flush().expect("stdout");
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).expect("stdin");
        let remote: kv_transfer_core::RemoteSlots = serde_json::from_str(&line).expect("remote");
        let mut src = pool.reserve(1).expect("reserve");
        src.write_at(0, 0, &vec![b'D'; CRASH_SLOT]).expect("fill");
        let _h = block_on(t.write(src, &remote, TransferOptions::notify(false))).expect("post");
        writeln!(out, "posted").expect("stdout");
        out.flush().expect("stdout");
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(0)
    }

    /// Peer crash: the prefill process is killed with SIGKILL in the middle
    /// of a 32 MiB WRITE. The decode side's heartbeat fails, its QP goes to
    /// ERR, everything on it flushes, and the exposure settles `Fenced`;
    /// nothing of the dead peer lands in the next tenant's slot.
    pub fn peer_crash_killed_process_is_fenced_by_the_heartbeat(lab: &Lab) -> Result<(), String> {
        use std::io::{BufRead, Write};
        use std::process::{Command, Stdio};
        let e = |e: &dyn std::fmt::Display| e.to_string();
        let mut cfg = VerbsConfig::new(format!("crash-decode-{}", std::process::id()), &lab.device, lab.gid_index);
        cfg.heartbeat = Duration::from_millis(100);
        let decode = VerbsTransfer::new(cfg).map_err(|x| e(&x))?;
        // No ladder step within the test: only the fence can settle.
        let never = EscalationLadder {
            drain: Duration::from_secs(600),
            revoke: Duration::from_secs(600),
            fence: Duration::from_secs(600),
        };
        let region: Arc<dyn Region> = Arc::new(HostRegion::new(CRASH_SLOT).map_err(|x| e(&x))?);
        let pool = decode.register_pool(region, PoolConfig::new(CRASH_SLOT).with_ladder(never)).map_err(|x| e(&x))?;
        let exe = std::env::current_exe().map_err(|x| e(&x))?;
        let mut child = Command::new(exe)
            .env("KVT_VERBS_CRASH_CHILD", decode.descriptor())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|x| e(&x))?;
        let mut stdout = std::io::BufReader::new(child.stdout.take().ok_or("no child stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line).map_err(|x| e(&x))?;
        let desc = line.trim().to_owned();
        let peer = decode.add_peer(&desc).map_err(|x| e(&x))?;
        let (exposed, remote) = decode.expose(pool.reserve(1).map_err(|x| e(&x))?, peer).map_err(|x| e(&x))?;
        let mut stdin = child.stdin.take().ok_or("no child stdin")?;
        writeln!(stdin, "{}", serde_json::to_string(&remote).map_err(|x| e(&x))?).map_err(|x| e(&x))?;
        line.clear();
        stdout.read_line(&mut line).map_err(|x| e(&x))?;
        if line.trim() != "posted" {
            let _ = child.kill();
            return Err(format!("the child said {line:?}"));
        }
        std::thread::sleep(Duration::from_millis(30));
        child.kill().map_err(|x| e(&x))?; // SIGKILL
        let _ = child.wait();
        let mut f = Box::pin(exposed.settled());
        let settled = kv_transfer_core::poll_until(f.as_mut(), Duration::from_secs(60))
            .ok_or_else(|| format!("the dead peer was never fenced: {:?} {:?}", decode.counters(), pool.metrics()))?;
        let m = pool.metrics();
        if m.settled_fenced != 1 {
            return Err(format!("expected Fenced, saw {m:?}"));
        }
        settled.release();
        let mut next = pool.reserve(1).map_err(|x| e(&x))?;
        next.write_at(0, 0, &vec![b'N'; CRASH_SLOT]).map_err(|x| e(&x))?;
        std::thread::sleep(Duration::from_millis(200));
        let mut bytes = vec![0u8; CRASH_SLOT];
        pool.region().read(0, &mut bytes).map_err(|x| e(&x))?;
        let stale = bytes.iter().filter(|&&b| b != b'N').count();
        drop(next);
        if stale != 0 {
            return Err(format!("{stale} bytes of the dead peer landed after the fence"));
        }
        Ok(())
    }

    pub const CHECKS: &[(&str, Check)] = &[
        ("peer_crash_killed_process_is_fenced_by_the_heartbeat", peer_crash_killed_process_is_fenced_by_the_heartbeat),
        ("bad_input_on_recv_buffers_is_dropped_and_counted", bad_input_on_recv_buffers_is_dropped_and_counted),
        (
            "adapter_write_then_done_settles_and_a_replayed_write_is_refused",
            adapter_write_then_done_settles_and_a_replayed_write_is_refused,
        ),
        (
            "hazard_large_write_aborted_and_reassigned_safe_lands_nothing",
            hazard_large_write_aborted_and_reassigned_safe_lands_nothing,
        ),
        (
            "hazard_large_write_aborted_and_reassigned_naive_positive_control",
            hazard_large_write_aborted_and_reassigned_naive_positive_control,
        ),
        (
            "revoked_local_inv_refuses_the_stale_write_and_memory_is_unchanged",
            revoked_local_inv_refuses_the_stale_write_and_memory_is_unchanged,
        ),
        (
            "naive_positive_control_the_regions_own_key_lets_the_stale_write_land",
            naive_positive_control_the_regions_own_key_lets_the_stale_write_land,
        ),
        (
            "rebinding_the_window_under_a_new_key_retires_the_old_key",
            rebinding_the_window_under_a_new_key_retires_the_old_key,
        ),
        ("the_regions_own_key_grants_nothing_remote", the_regions_own_key_grants_nothing_remote),
        (
            "a_rejected_access_errors_the_queue_pair_and_flushes_what_follows",
            a_rejected_access_errors_the_queue_pair_and_flushes_what_follows,
        ),
        (
            "fenced_a_queue_pair_in_error_flushes_every_posted_request",
            fenced_a_queue_pair_in_error_flushes_every_posted_request,
        ),
        ("a_send_after_writes_arrives_after_they_are_placed", a_send_after_writes_arrives_after_they_are_placed),
        ("a_window_key_works_only_through_its_queue_pair", a_window_key_works_only_through_its_queue_pair),
        (
            "a_posted_request_holds_its_memory_until_its_completion",
            a_posted_request_holds_its_memory_until_its_completion,
        ),
        ("out_of_bounds_requests_are_refused_before_posting", out_of_bounds_requests_are_refused_before_posting),
        ("device_memory_without_a_dmabuf_is_refused_by_name", device_memory_without_a_dmabuf_is_refused_by_name),
    ];
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    #[cfg(feature = "verbs")]
    if let Ok(decode) = std::env::var("KVT_VERBS_CRASH_CHILD") {
        on_device::crash_child(&decode);
    }
    let args = Arguments::from_args();
    let env = backend_verbs::LabEnv::from_env();
    #[cfg(feature = "verbs")]
    let trials = {
        use std::sync::Arc;
        let lab = on_device::Lab::open(&env).map(Arc::new);
        let missing = lab.as_ref().err().map(|e| e.to_string());
        if let (Some(why), false) = (&missing, env.in_lab) {
            if !args.list {
                eprintln!("ignored: the verbs tests: {why}");
            }
        }
        on_device::CHECKS
            .iter()
            .map(|&(name, check)| {
                let ignored = missing.is_some() && !env.in_lab;
                let lab = lab.as_ref().ok().cloned();
                let why = missing.clone().unwrap_or_default();
                Trial::test(name, move || match &lab {
                    Some(lab) => check(lab).map_err(Into::into),
                    None => Err(format!("no verbs device in the lab: {why}").into()),
                })
                .with_ignored_flag(ignored)
            })
            .collect::<Vec<_>>()
    };
    #[cfg(not(feature = "verbs"))]
    let trials = {
        let _ = &env;
        if !args.list {
            eprintln!("ignored: the verbs tests need the feature `verbs` (and a device: scripts/rdma-lab test)");
        }
        vec![Trial::test("verbs_tests_need_the_feature_verbs", || Ok(())).with_ignored_flag(true)]
    };
    libtest_mimic::run(&args, trials).exit();
}
