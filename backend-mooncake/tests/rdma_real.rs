//! Mooncake over RDMA against the REAL engine (0.3.13.post1's
//! `mooncake.engine`, `--protocol=rdma`) on a real verbs device: Soft-RoCE's
//! `rxe_lo` in the verbs guest (`scripts/rdma-lab test`).
//!
//! Both ways, READ and WRITE, byte-checked: our initiator into a real
//! target, and a real initiator into our target. On a host without a verbs
//! device (or built without `rdma-device`) every case is listed as ignored,
//! with what it needs; in the guest (`KVT_RDMA_LAB=1`) a missing device or
//! engine fails them.
//!
//! And the hazard with the real initiator: its large WRITE in flight into
//! our slot, the request aborted and the slot's next tenant written, both
//! driving `RdmaTarget`'s grants and core's retry shadows directly and
//! through our adapter (`MooncakeTransfer` with a key per tenancy), each
//! with its positive control (naive release).

use libtest_mimic::{Arguments, Failed, Trial};

#[cfg(feature = "rdma-device")]
#[path = "support/real_peer.rs"]
mod real_peer;

#[cfg(feature = "rdma-device")]
mod on_device {
    use std::sync::Arc;

    use backend_mooncake::rdma::{rdma_engine, Publish, RdmaNics, RdmaTarget};
    use backend_mooncake::{
        EngineConfig, MemoryRegion, MooncakeEngine, TaskStatus, TcpOpcode, TransferEngine, TransferRequest,
        TransferStatus,
    };
    use backend_verbs::{DeviceEngine, LabEnv};
    use libtest_mimic::Failed;

    use super::real_peer::{Engines, Peer, LINE_TIMEOUT};

    /// What the cases need: the device and the real engine.
    pub struct Lab {
        pub env: LabEnv,
        pub engines: Engines,
    }

    impl Lab {
        pub fn open() -> Result<Self, String> {
            let env = LabEnv::from_env();
            let devices = backend_verbs::devices().map_err(|e| e.to_string())?;
            if !devices.contains(&env.device) {
                return Err(format!("no verbs device {} (have {devices:?}): run scripts/rdma-lab test", env.device));
            }
            Ok(Self { engines: Engines::find()?, env })
        }

        /// Our engine over RDMA on the lab's device (two verbs engines: the
        /// transport polls its own).
        fn ours(&self) -> Result<MooncakeEngine, Failed> {
            Ok(self.ours_publishing(Publish::Registrations)?.0)
        }

        fn ours_publishing(&self, publish: Publish) -> Result<(MooncakeEngine, Arc<RdmaTarget>), Failed> {
            let open = || DeviceEngine::open(&self.env.device, 1, self.env.gid_index).map_err(|e| e.to_string());
            let nics = RdmaNics { initiator: open()? as Arc<dyn backend_verbs::Engine>, target: open()? };
            Ok(rdma_engine(EngineConfig::default(), nics, &self.env.device, publish).map_err(|e| e.to_string())?)
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed).wrapping_add((i >> 8) as u8)).collect()
    }

    fn register(e: &MooncakeEngine, buf: &mut [u8]) -> Result<u64, Failed> {
        let a = buf.as_mut_ptr() as u64;
        // SAFETY: every buffer outlives its engine in these cases and is read
        // only after the transfers touching it finished.
        e.register_memory(unsafe { MemoryRegion::new(a, buf.len() as u64) }).map_err(|e| e.to_string())?;
        Ok(a)
    }

    fn run(e: &MooncakeEngine, reqs: &[TransferRequest]) -> Result<Vec<TaskStatus>, Failed> {
        let b = e.allocate_batch_id(reqs.len()).map_err(|e| e.to_string())?;
        let r = e.submit_transfer(b, reqs).map_err(|e| e.to_string())?;
        let out = r.map(|t| e.wait_transfer(b, t, LINE_TIMEOUT)).collect::<Result<Vec<_>, _>>();
        e.free_batch_id(b).map_err(|e| e.to_string())?;
        Ok(out.map_err(|e| e.to_string())?)
    }

    fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
        if ok {
            Ok(())
        } else {
            Err(what().into())
        }
    }

    /// 5 slices and a short one at an odd offset.
    const LEN: usize = 5 * 64 * 1024 + 4321;

    pub fn our_initiator_writes_and_reads_a_real_target(lab: &Lab) -> Result<(), Failed> {
        let mut peer = Peer::start_rdma(&lab.engines, 4 << 20, &lab.env.device);
        let remote = pattern(LEN, 3);
        peer.put(1 << 20, &remote);
        let mut local = pattern(2 * LEN, 77);
        let init = lab.ours()?;
        let la = register(&init, &mut local)?;
        let seg = init.open_segment(&peer.segment()).map_err(|e| e.to_string())?;
        let desc = init.segment_info(seg).map_err(|e| e.to_string())?.desc;
        ensure(desc.protocol == "rdma" && !desc.devices.is_empty(), || format!("{desc:?}"))?;
        let w = TransferRequest {
            opcode: TcpOpcode::Write,
            source: la,
            target_id: seg,
            target_offset: peer.addr + 7,
            length: LEN as u64,
        };
        let r = TransferRequest {
            opcode: TcpOpcode::Read,
            source: la + LEN as u64,
            target_id: seg,
            target_offset: peer.addr + (1 << 20),
            length: LEN as u64,
        };
        for s in run(&init, &[w, r])? {
            ensure(s.status == TransferStatus::Completed, || format!("{s:?}"))?;
        }
        let landed = peer.get(7, LEN as u64);
        drop(init);
        ensure(landed == local[..LEN], || "our WRITE did not land byte for byte in the real target".into())?;
        ensure(local[LEN..] == remote[..], || "our READ of the real target did not bring its bytes".into())?;
        eprintln!("our initiator -> real target over RDMA: WRITE and READ of {LEN} bytes, byte-exact");
        Ok(())
    }

    pub fn a_real_initiator_writes_and_reads_our_target(lab: &Lab) -> Result<(), Failed> {
        let mut peer = Peer::start_rdma(&lab.engines, 4 << 20, &lab.env.device);
        let theirs = pattern(LEN, 41);
        peer.put(0, &theirs);
        let mut ours = pattern(2 * LEN, 9);
        let expect_read = ours[LEN..].to_vec();
        let target = lab.ours()?;
        let ta = register(&target, &mut ours)?;
        let seg = target.local_segment_name();
        let rc = peer.cmd(&format!("write {seg} 0 {ta} {LEN}"));
        ensure(rc == "RC 0", || format!("the real initiator's WRITE into our target: {rc}"))?;
        let rc = peer.cmd(&format!("read {seg} {} {} {LEN}", 2 << 20, ta + LEN as u64));
        ensure(rc == "RC 0", || format!("the real initiator's READ of our target: {rc}"))?;
        let got = peer.get(2 << 20, LEN as u64);
        drop(peer);
        drop(target);
        ensure(ours[..LEN] == theirs[..], || "the real WRITE did not land byte for byte in our target".into())?;
        ensure(got == expect_read, || "the real READ of our target did not bring our bytes".into())?;
        eprintln!("real initiator -> our target over RDMA: WRITE and READ of {LEN} bytes, byte-exact");
        Ok(())
    }

    /// How the target answers the abort of the request whose WRITE is in
    /// flight, before the slot's next tenant writes it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Abort {
        /// The positive control: Mooncake's own key for the whole buffer,
        /// the slot handed on at once.
        Naive,
        /// The tenancy's key revoked, and the slot granted at once to the
        /// same initiator under a new key: what its retry finds.
        RevokeThenRegrantToTheSameInitiator,
        /// Revoked, and kept away from that initiator (core's retry shadow);
        /// the next tenant is another peer's.
        RevokeAndShadow,
    }

    const BIG: usize = 64 << 20;
    const OLD: u8 = 0xa5;
    const NEW: u8 = 0x5e;

    /// A real initiator's 64 MiB WRITE into our slot; once its first bytes
    /// landed, the request is aborted as `abort` says and the slot's next
    /// tenant writes its own bytes; then, once the initiator's transfer
    /// ended, the old request's bytes in the new tenant's slot are counted.
    fn hazard(lab: &Lab, abort: Abort) -> Result<(usize, String), Failed> {
        use kv_transfer_core::drain::{ExposureToken, RetryShadows};
        use kv_transfer_core::{Generation, PeerId, PoolId, SlotId, Tenancy};
        use std::io::Write;

        let mut peer = Peer::start_rdma(&lab.engines, BIG as u64, &lab.env.device);
        assert_eq!(peer.cmd(&format!("fill 0 {BIG} {OLD}")), "OK");
        let mut slot = vec![0u8; BIG];
        let publish = if abort == Abort::Naive { Publish::Registrations } else { Publish::Grants };
        let (target, rdma) = lab.ours_publishing(publish)?;
        let sa = register(&target, &mut slot)?;
        let initiator = peer.segment();
        let grant = match abort {
            Abort::Naive => None,
            _ => Some(rdma.grant(&initiator, sa, BIG as u64).map_err(|e| e.to_string())?.0),
        };
        writeln!(peer.stdin, "write {} 0 {sa} {BIG}", target.local_segment_name()).map_err(|e| e.to_string())?;
        peer.stdin.flush().map_err(|e| e.to_string())?;
        // In flight: its first bytes are in the slot.
        let p = slot.as_mut_ptr();
        let until = std::time::Instant::now() + LINE_TIMEOUT;
        // SAFETY: in bounds; a volatile read of memory the NIC writes.
        while unsafe { std::ptr::read_volatile(p) } != OLD {
            ensure(std::time::Instant::now() < until, || "the real initiator's WRITE never landed".into())?;
            std::thread::yield_now();
        }
        let mut shadows = RetryShadows::default();
        let (pool, slot_id, peer_id) = (PoolId(1), SlotId(0), PeerId(1));
        match (abort, grant) {
            (Abort::RevokeThenRegrantToTheSameInitiator, Some(g)) => {
                ensure(rdma.revoke(g), || "no grant to revoke".into())?;
                rdma.grant(&initiator, sa, BIG as u64).map_err(|e| e.to_string())?;
            }
            (Abort::RevokeAndShadow, Some(g)) => {
                ensure(rdma.revoke(g), || "no grant to revoke".into())?;
                shadows.revoked(pool, peer_id, &[(Tenancy::new(slot_id, Generation(1)), ExposureToken::random())]);
                ensure(shadows.admit(pool, &[slot_id], peer_id).is_err(), || "the shadow did not hold".into())?;
                // The next tenant's prefill is another peer's.
                rdma.grant("127.0.0.1:1", sa, BIG as u64).map_err(|e| e.to_string())?;
            }
            _ => {}
        }
        // SAFETY: in bounds; the new tenant's bytes (the NIC may write too).
        unsafe { std::ptr::write_bytes(p, NEW, BIG) };
        let rc = peer.line();
        drop(peer);
        drop(target);
        Ok((slot.iter().filter(|b| **b == OLD).count(), rc))
    }

    pub fn hazard_naive_release_lets_the_real_initiators_write_into_the_next_tenant(lab: &Lab) -> Result<(), Failed> {
        let (foreign, rc) = hazard(lab, Abort::Naive)?;
        eprintln!(
            "hazard, naive (Mooncake's own key, slot handed on): {foreign} old bytes in the new tenant's slot ({rc})"
        );
        ensure(foreign > 0, || format!("the positive control showed no corruption ({rc})"))
    }

    pub fn hazard_a_revoked_key_regranted_to_the_same_initiator_takes_its_retry(lab: &Lab) -> Result<(), Failed> {
        let (foreign, rc) = hazard(lab, Abort::RevokeThenRegrantToTheSameInitiator)?;
        eprintln!(
            "hazard, revoked then regranted to the same initiator: {foreign} old bytes in the new tenant's slot ({rc})"
        );
        ensure(foreign > 0, || format!("the retry hazard did not show: revoking alone looked enough ({rc})"))
    }

    pub fn hazard_revoke_and_retry_shadow_leave_0_old_bytes_in_the_next_tenant(lab: &Lab) -> Result<(), Failed> {
        let (foreign, rc) = hazard(lab, Abort::RevokeAndShadow)?;
        eprintln!(
            "hazard, revoked and shadowed for that initiator: {foreign} old bytes in the new tenant's slot ({rc})"
        );
        ensure(foreign == 0, || format!("{foreign} old bytes landed after the revocation ({rc})"))?;
        ensure(rc != "RC 0", || "the aborted transfer reported success".into())
    }

    /// Where the slot's next tenant is exposed, in the hazard through the adapter.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum NextTenant {
        /// To another peer.
        AnotherPeer,
        /// First to the same real initiator (whose retry would take a new
        /// key), then, refused, to another peer.
        SameInitiatorFirst,
    }

    /// The hazard through our adapter (`MooncakeTransfer` with a key per
    /// tenancy from `RdmaTarget`, the ladder drain then revoke): a real
    /// initiator's 64 MiB WRITE into an exposed slot; once its first bytes
    /// landed the exposure is aborted; the slot comes back as the ladder
    /// settles it, the next tenant writes its bytes and is exposed as `next`
    /// says; once the initiator's transfer ended, the old request's bytes in
    /// the next tenant's slot are counted. Returns them, the initiator's
    /// result line, and whether the same initiator was refused the slot.
    fn hazard_through_the_adapter(
        lab: &Lab,
        policy: backend_mooncake::ReleasePolicy,
        next: NextTenant,
    ) -> Result<(usize, String, bool), Failed> {
        use backend_mooncake::adapter::TenancyKeys;
        use backend_mooncake::{AdapterConfig, MooncakeTransfer};
        use kv_transfer_core::{EscalationLadder, ExposeErrorKind, HostRegion, PoolConfig, Region};
        use std::io::Write;
        use std::time::{Duration, Instant};

        let mut peer = Peer::start_rdma(&lab.engines, BIG as u64, &lab.env.device);
        assert_eq!(peer.cmd(&format!("fill 0 {BIG} {OLD}")), "OK");
        let (engine, rdma) = lab.ours_publishing(Publish::Grants)?;
        let keys: Arc<dyn TenancyKeys> = rdma;
        let cfg = AdapterConfig { keys: Some(keys), release_policy: policy, ..AdapterConfig::default() };
        let decode = MooncakeTransfer::new(Arc::new(engine), cfg).map_err(|e| e.to_string())?;
        let region = Arc::new(HostRegion::new(BIG).map_err(|e| e.to_string())?);
        // Drain first (the real engine never acks), revoke at once after.
        let ladder = EscalationLadder {
            drain: Duration::from_millis(20),
            revoke: Duration::from_millis(20),
            fence: Duration::from_secs(600),
        };
        let pool = decode
            .register_pool(region.clone(), PoolConfig::new(BIG).with_ladder(ladder))
            .map_err(|e| e.to_string())?;
        let initiator = decode.add_peer(&peer.segment()).map_err(|e| e.to_string())?;
        let other_engine = lab.ours()?;
        let other = decode.add_peer(&other_engine.local_segment_name()).map_err(|e| e.to_string())?;

        // Made before the WRITE starts: writing the next tenant is then one copy.
        let new_bytes = vec![NEW; BIG];
        let (exposed, remote) =
            decode.expose(pool.reserve(1).map_err(|e| e.to_string())?, initiator).map_err(|e| e.kind.to_string())?;
        let addr = remote.slots[0].addr;
        writeln!(peer.stdin, "write {} 0 {addr} {BIG}", decode.segment_name()).map_err(|e| e.to_string())?;
        peer.stdin.flush().map_err(|e| e.to_string())?;
        // In flight: its first bytes are in the slot.
        let until = Instant::now() + LINE_TIMEOUT;
        let mut first = [0u8; 1];
        while first[0] != OLD {
            ensure(Instant::now() < until, || "the real initiator's WRITE never landed".into())?;
            region.read(0, &mut first).map_err(|e| e.to_string())?;
            std::thread::yield_now();
        }
        let t_landed = Instant::now();
        exposed.abort();
        // The slot back on the free list: the naive release at once; the
        // safe one once the ladder revoked the tenancy's key.
        let until = Instant::now() + LINE_TIMEOUT;
        while pool.metrics().free != 1 {
            ensure(Instant::now() < until, || format!("the aborted slot never came back: {:?}", pool.metrics()))?;
            std::thread::sleep(Duration::from_millis(1));
        }
        let t_free = t_landed.elapsed();
        let mut lease = pool.reserve(1).map_err(|e| e.to_string())?;
        lease.write_at(0, 0, &new_bytes).map_err(|e| e.to_string())?;
        eprintln!("first bytes landed -> slot free {t_free:?}, -> next tenant written {:?}", t_landed.elapsed());
        let mut refused = false;
        if next == NextTenant::SameInitiatorFirst {
            lease = match decode.expose(lease, initiator) {
                Err(e) if matches!(e.kind, ExposeErrorKind::RetryShadow(_)) => {
                    refused = true;
                    e.lease
                }
                Err(e) => return Err(format!("expose to the same initiator: {}", e.kind).into()),
                Ok((exposed, _)) => {
                    // The naive release keeps no shadow: the slot is the
                    // initiator's again, under a new key its retry takes.
                    let rc = peer.line();
                    let foreign = count_old(&region)?;
                    exposed.abort();
                    return Ok((foreign, rc, false));
                }
            };
        }
        let (next_exposed, _) = decode.expose(lease, other).map_err(|e| e.kind.to_string())?;
        let rc = peer.line();
        let foreign = count_old(&region)?;
        next_exposed.abort();
        drop(peer);
        Ok((foreign, rc, refused))
    }

    fn count_old(region: &kv_transfer_core::HostRegion) -> Result<usize, Failed> {
        use kv_transfer_core::Region;
        let mut got = vec![0u8; BIG];
        region.read(0, &mut got).map_err(|e| e.to_string())?;
        Ok(got.iter().filter(|b| **b == OLD).count())
    }

    pub fn adapter_naive_release_lets_the_real_initiators_write_into_the_next_tenant(lab: &Lab) -> Result<(), Failed> {
        let (foreign, rc, _) =
            hazard_through_the_adapter(lab, backend_mooncake::ReleasePolicy::Naive, NextTenant::AnotherPeer)?;
        eprintln!("hazard through the adapter, naive release: {foreign} old bytes in the next tenant's slot ({rc})");
        ensure(foreign > 0, || format!("the positive control showed no corruption ({rc})"))
    }

    pub fn adapter_safe_0_old_bytes_in_the_next_tenant_of_another_peer(lab: &Lab) -> Result<(), Failed> {
        let (foreign, rc, _) =
            hazard_through_the_adapter(lab, backend_mooncake::ReleasePolicy::Safe, NextTenant::AnotherPeer)?;
        eprintln!("hazard through the adapter, safe, next tenant another peer's: {foreign} old bytes ({rc})");
        ensure(foreign == 0, || format!("{foreign} old bytes landed in the next tenant ({rc})"))?;
        ensure(rc != "RC 0", || "the aborted transfer reported success".into())
    }

    /// Its positive control is
    /// [`hazard_a_revoked_key_regranted_to_the_same_initiator_takes_its_retry`]:
    /// without the shadow, the same initiator's retry takes the new key.
    pub fn adapter_safe_the_same_initiator_is_refused_the_slot_and_its_retry_lands_nothing(
        lab: &Lab,
    ) -> Result<(), Failed> {
        let (foreign, rc, refused) =
            hazard_through_the_adapter(lab, backend_mooncake::ReleasePolicy::Safe, NextTenant::SameInitiatorFirst)?;
        eprintln!(
            "hazard through the adapter, safe, next tenant offered to the same initiator first: refused {refused}, \
             {foreign} old bytes ({rc})"
        );
        ensure(refused, || "the revoked slot was exposed again to the initiator that may retry it".into())?;
        ensure(foreign == 0, || format!("{foreign} old bytes landed in the next tenant ({rc})"))?;
        ensure(rc != "RC 0", || "the aborted transfer reported success".into())
    }

    pub type Check = fn(&Lab) -> Result<(), Failed>;
    pub const CHECKS: &[(&str, Check)] = &[
        ("rdma_real_our_initiator_writes_and_reads_a_real_target", our_initiator_writes_and_reads_a_real_target),
        ("rdma_real_a_real_initiator_writes_and_reads_our_target", a_real_initiator_writes_and_reads_our_target),
        (
            "rdma_real_hazard_naive_release_lets_the_real_initiators_write_into_the_next_tenant",
            hazard_naive_release_lets_the_real_initiators_write_into_the_next_tenant,
        ),
        (
            "rdma_real_hazard_a_revoked_key_regranted_to_the_same_initiator_takes_its_retry",
            hazard_a_revoked_key_regranted_to_the_same_initiator_takes_its_retry,
        ),
        (
            "rdma_real_hazard_revoke_and_retry_shadow_leave_0_old_bytes_in_the_next_tenant",
            hazard_revoke_and_retry_shadow_leave_0_old_bytes_in_the_next_tenant,
        ),
        (
            "rdma_real_adapter_naive_release_lets_the_real_initiators_write_into_the_next_tenant",
            adapter_naive_release_lets_the_real_initiators_write_into_the_next_tenant,
        ),
        (
            "rdma_real_adapter_safe_0_old_bytes_in_the_next_tenant_of_another_peer",
            adapter_safe_0_old_bytes_in_the_next_tenant_of_another_peer,
        ),
        (
            "rdma_real_adapter_safe_the_same_initiator_is_refused_the_slot_and_its_retry_lands_nothing",
            adapter_safe_the_same_initiator_is_refused_the_slot_and_its_retry_lands_nothing,
        ),
    ];
}

fn main() {
    let args = Arguments::from_args();
    let in_lab = std::env::var("KVT_RDMA_LAB").is_ok_and(|v| v == "1");
    #[cfg(feature = "rdma-device")]
    let trials = {
        use std::sync::Arc;
        let lab = on_device::Lab::open().map(Arc::new);
        let missing = lab.as_ref().err().cloned();
        if let (Some(why), false, false) = (&missing, in_lab, args.list) {
            eprintln!("ignored: Mooncake over RDMA against the real engine: {why}");
        }
        on_device::CHECKS
            .iter()
            .map(|&(name, check)| {
                let lab = lab.as_ref().ok().cloned();
                let why = missing.clone().unwrap_or_default();
                Trial::test(name, move || match &lab {
                    Some(lab) => check(lab),
                    None => Err(Failed::from(format!("needs a verbs device and the real engine: {why}"))),
                })
                .with_ignored_flag(missing.is_some() && !in_lab)
            })
            .collect::<Vec<_>>()
    };
    #[cfg(not(feature = "rdma-device"))]
    let trials = {
        if !args.list {
            eprintln!("ignored: Mooncake over RDMA against the real engine needs the feature `rdma-device` and a verbs device (scripts/rdma-lab test)");
        }
        let _ = in_lab;
        vec![Trial::test("rdma_real_needs_the_feature_rdma_device", || Ok::<(), Failed>(())).with_ignored_flag(true)]
    };
    libtest_mimic::run(&args, trials).exit();
}
