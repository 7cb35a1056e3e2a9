//! Hostile peers against Mooncake over RDMA on backend-verbs' software NIC
//! (issue 29, attack 6, the part that fits without a protection domain per
//! peer): a Connection exchange under another peer's NIC path.
#![cfg(feature = "rdma")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mooncake::proto::rdma::ConnectionDesc;
use backend_mooncake::rdma::{Publish, RdmaTarget, RdmaTargetConfig};
use backend_mooncake::TargetHook;
use backend_verbs::{Engine, FakeFabric, FakeNic, MrAccess, QpId, QpState, WcStatus, WorkRequest};
use kv_transfer_core::{HostRegion, Region};

const MTU: u32 = 4096;

/// Pairs two queue pairs of `nic` with the target under `nic_path` through
/// the public Connection message; returns ours and the target's reply.
fn pair(target: &RdmaTarget, nic: &FakeNic, nic_path: &str) -> (Vec<QpId>, ConnectionDesc) {
    pair_from(target, nic, nic_path, "127.0.0.1".parse().unwrap())
}

/// As [`pair`], the Connection arriving from `from`.
fn pair_from(
    target: &RdmaTarget,
    nic: &FakeNic,
    nic_path: &str,
    from: std::net::IpAddr,
) -> (Vec<QpId>, ConnectionDesc) {
    let eps: Vec<_> = (0..2).map(|_| nic.create_qp(MTU).unwrap()).collect();
    let req = ConnectionDesc {
        local_gid: backend_mooncake::proto::rdma::format_gid(&eps[0].gid.0),
        local_lid: 0,
        local_nic_path: nic_path.into(),
        payload: String::new(),
        peer_nic_path: "127.0.0.1:2@fake0".into(),
        qp_num: eps.iter().map(|e| e.qpn).collect(),
        ready_ack: Some(false),
        reply_msg: String::new(),
    };
    let reply = ConnectionDesc::from_json(&target.connection(&req.to_json(), from)).unwrap();
    if reply.reply_msg.is_empty() {
        let gid = backend_verbs::Gid(backend_mooncake::proto::rdma::parse_gid(&reply.local_gid).unwrap());
        for (ours, theirs) in eps.iter().zip(&reply.qp_num) {
            let remote = backend_verbs::Endpoint { qpn: *theirs, psn: 0, gid, mtu: MTU };
            nic.connect(QpId(ours.qpn), &remote).unwrap();
        }
    }
    (eps.iter().map(|e| QpId(e.qpn)).collect(), reply)
}

/// One RDMA WRITE of `data` through `qp`; the completion's status.
fn write_through(nic: &FakeNic, qp: QpId, data: &[u8], remote_addr: u64, rkey: u32) -> WcStatus {
    let src = Arc::new(HostRegion::new(data.len()).unwrap());
    src.write(0, data).unwrap();
    let mr = nic.register(src.clone(), MrAccess::Local).unwrap();
    nic.post(qp, 77, WorkRequest::Write { local: mr.id, offset: 0, len: data.len() as u32, remote_addr, rkey })
        .unwrap();
    let t0 = Instant::now();
    // Bounded: 5 s.
    while t0.elapsed() < Duration::from_secs(5) {
        if let Some(c) = nic.poll(16).unwrap().into_iter().find(|c| c.wr_id == 77) {
            nic.deregister(mr.id);
            return c.status;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("no completion");
}

/// Attack 6 (second half): a Connection exchange that declares honest
/// peer P's NIC path. Positive control (`replace_live_pairs`, the old
/// behaviour): P's queue pairs at the target are destroyed and P's next
/// WRITE fails. Checked: the first pairing wins while its queue pairs
/// live: the impostor is refused (a non-empty `reply_msg`, counted), the
/// target's queue pairs stay, and P's WRITE of 4,096 bytes lands at once.
#[test]
fn hostile_rdma_connection_under_another_peers_nic_path_does_not_replace_its_queue_pairs() {
    for checked in [false, true] {
        let fabric = FakeFabric::new(123);
        let tnic = fabric.fake_nic();
        let cfg = RdmaTargetConfig {
            device: "fake0".into(),
            publish: Publish::Registrations,
            replace_live_pairs: !checked,
            ..Default::default()
        };
        let target = RdmaTarget::new(Arc::new(tnic.clone()), cfg);
        let mem = Arc::new(HostRegion::new(8192).unwrap());
        target.registered(mem.addr(), mem.len() as u64).unwrap();
        // The key the target publishes for the buffer (Mooncake's own).
        let base = backend_mooncake::proto::SegmentDesc {
            name: "127.0.0.1:2".into(),
            protocol: "tcp".into(),
            tcp_data_port: 0,
            tcp_proto_version: None,
            tcp_data_host: None,
            rdma_server_name: None,
            timestamp: None,
            buffers: vec![backend_mooncake::proto::BufferDesc {
                name: "x".into(),
                addr: mem.addr(),
                length: mem.len() as u64,
                rkey: vec![],
                lkey: vec![],
            }],
            devices: vec![],
            priority_matrix: None,
            kvt_notify_auth: None,
        };
        let rkey = target.descriptor(base, None, None).buffers[0].rkey[0];

        let honest = fabric.fake_nic();
        let path = "127.0.0.1:5000@fake0";
        let (p_qps, reply) = pair(&target, &honest, path);
        assert!(reply.reply_msg.is_empty(), "{reply:?}");
        let theirs: Vec<QpId> = reply.qp_num.iter().map(|q| QpId(*q)).collect();
        assert_eq!(write_through(&honest, p_qps[0], &[1u8; 64], mem.addr(), rkey), WcStatus::Success);

        // The impostor declares P's NIC path.
        let impostor = fabric.fake_nic();
        let (_, bad) = pair(&target, &impostor, path);
        let alive = theirs.iter().filter(|q| matches!(tnic.qp_state(**q), Ok(s) if s != QpState::Error)).count();
        let t0 = Instant::now();
        let status = write_through(&honest, p_qps[1], &[0xABu8; 4096], mem.addr() + 4096, rkey);
        let took = t0.elapsed();
        let mut landed = vec![0u8; 4096];
        mem.read(4096, &mut landed).unwrap();
        let landed = landed.iter().filter(|b| **b == 0xAB).count();
        eprintln!(
            "checked={checked}: impostor reply_msg {:?}; target's queue pairs alive {alive} of 2; \
             P's WRITE {status:?}, {landed} of 4096 bytes landed in {took:?}; refused {}",
            bad.reply_msg,
            target.pairs_refused()
        );
        if checked {
            assert!(!bad.reply_msg.is_empty(), "the impostor is refused");
            assert_eq!(target.pairs_refused(), 1);
            assert_eq!(alive, 2, "P's queue pairs stay");
            assert_eq!((status, landed), (WcStatus::Success, 4096), "P still served");
            assert!(took < Duration::from_secs(1));
        } else {
            assert!(bad.reply_msg.is_empty(), "the old target pairs the impostor");
            assert_eq!(alive, 0, "and destroys P's queue pairs");
            assert_ne!(status, WcStatus::Success, "P's endpoint is gone");
            assert_eq!(landed, 0);
        }
        drop(target);
    }
}

/// A peer whose queue pairs at the target are all in ERR (a Mooncake
/// initiator after a refused key deletes its endpoint and reconnects) pairs
/// anew under its NIC path: first-wins does not lock it out.
#[test]
fn rdma_a_nic_path_whose_queue_pairs_are_in_error_pairs_anew() {
    let fabric = FakeFabric::new(124);
    let tnic = fabric.fake_nic();
    let cfg = RdmaTargetConfig { device: "fake0".into(), publish: Publish::Registrations, ..Default::default() };
    let target = RdmaTarget::new(Arc::new(tnic.clone()), cfg);
    let peer = fabric.fake_nic();
    let path = "127.0.0.1:5001@fake0";
    let (_, first) = pair(&target, &peer, path);
    assert!(first.reply_msg.is_empty());
    for q in &first.qp_num {
        tnic.to_error(QpId(*q)).unwrap();
    }
    let (_, again) = pair(&target, &peer, path);
    assert!(again.reply_msg.is_empty(), "{again:?}");
    assert_eq!(target.pairs_refused(), 0);
    assert_eq!(target.paired_queue_pairs(), 2);
}

#[path = "support/hostile_util.rs"]
mod util;

/// Attack 6 (first half), from another address: a metadata request that
/// declares honest peer P's segment name. Positive control
/// (`grants_by_declared_name`, the old behaviour): the reply holds P's
/// grant key, and the impostor, pairing queue pairs of its own, READs P's
/// slot with it (all 65,536 bytes). Checked: a request from an address that
/// is not the one in the name it declares gets no grants (counted); P's
/// own WRITE still lands and settles, within 2 s. What remains (docs/THREAT-MODEL.md):
/// an impostor on P's own host gets P's grants; a key usable only through
/// P's queue pairs needs a protection domain per peer (see the report).
#[test]
fn hostile_rdma_metadata_declaring_another_peers_name_gets_no_grants() {
    use backend_mooncake::adapter::{block_on, TenancyKeys};
    use backend_mooncake::proto::{HandshakeType, SegmentDesc};
    use backend_mooncake::rdma::{RdmaNics, RdmaParts};
    use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeTransfer};
    use kv_transfer_core::{EscalationLadder, PoolConfig, Transfer, TransferOptions};
    const SLOT: usize = 64 << 10;
    for checked in [false, true] {
        let fabric = FakeFabric::new(125);
        let adapter = |tcfg: RdmaTargetConfig| {
            let nics = RdmaNics { initiator: fabric.nic(), target: fabric.nic() };
            let parts = RdmaParts::with_target_config(nics, tcfg, Duration::from_secs(5)).unwrap();
            let engine = parts.engine(EngineConfig::default(), parts.transport.clone()).unwrap();
            let keys: Arc<dyn TenancyKeys> = parts.target.clone();
            let a = MooncakeTransfer::new(Arc::new(engine), AdapterConfig { keys: Some(keys), ..Default::default() })
                .unwrap();
            let region = Arc::new(HostRegion::new(2 * SLOT).unwrap());
            let pool = a
                .register_pool(region.clone(), PoolConfig::new(SLOT).with_ladder(EscalationLadder::default()))
                .unwrap();
            (a, pool, region, parts.target)
        };
        let grants = RdmaTargetConfig {
            device: "fake0".into(),
            publish: Publish::Grants,
            grants_by_declared_name: !checked,
            ..Default::default()
        };
        let (decode, dpool, dregion, dtarget) = adapter(grants.clone());
        let (prefill, ppool, _, _) = adapter(RdmaTargetConfig { device: "fake0".into(), ..grants });
        dregion.write(0, &util::pattern(SLOT, 3)).unwrap();
        let peer = decode.add_peer(prefill.segment_name()).unwrap();
        let (exposed, remote) = decode.expose(dpool.reserve(1).unwrap(), peer).unwrap();
        let key = remote.slots[0].key.unwrap() as u32;

        // The impostor, from 127.0.0.2, declares P's name.
        let hs: std::net::SocketAddr = decode.segment_name().parse().unwrap();
        let body = serde_json::json!({ "name": prefill.segment_name() }).to_string();
        let json = util::raw_handshake(util::ATTACKER, hs, HandshakeType::Metadata, body.as_bytes()).unwrap();
        let desc = SegmentDesc::from_json(&json).unwrap();
        let leaked = desc.buffers.iter().find(|b| b.rkey.first() == Some(&key)).map(|b| (b.addr, b.rkey[0]));
        let mut read = 0;
        if let Some((addr, rkey)) = leaked {
            // Its own queue pairs, its own NIC path; the key works through them.
            let nic = fabric.fake_nic();
            let (qps, reply) = pair_from(&dtarget, &nic, "127.0.0.2:9@fake0", util::ATTACKER.into());
            assert!(reply.reply_msg.is_empty());
            let dst = Arc::new(HostRegion::new(SLOT).unwrap());
            let mr = nic.register(dst.clone(), MrAccess::Local).unwrap();
            let wr = WorkRequest::Read { local: mr.id, offset: 0, len: SLOT as u32, remote_addr: addr, rkey };
            nic.post(qps[0], 5, wr).unwrap();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if let Some(c) = nic.poll(4).unwrap().into_iter().find(|c| c.wr_id == 5) {
                    assert_eq!(c.status, WcStatus::Success);
                    let mut got = vec![0u8; SLOT];
                    dst.read(0, &mut got).unwrap();
                    read = got.iter().zip(util::pattern(SLOT, 3)).filter(|(a, b)| **a == *b).count();
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // P itself is served.
        let t0 = Instant::now();
        let mut src = ppool.reserve(1).unwrap();
        src.write_at(0, 0, &vec![0x5Au8; SLOT]).unwrap();
        let out = block_on(block_on(prefill.write(src, &remote, TransferOptions::default())).unwrap()).unwrap();
        out.result.unwrap();
        out.lease.release();
        let settled = block_on(exposed.settled());
        let took = t0.elapsed();
        eprintln!(
            "checked={checked}: impostor got key: {}, read {read} of {SLOT} bytes of P's slot; \
             grants withheld {}; P's write settled in {took:?}",
            leaked.is_some(),
            dtarget.grants_withheld()
        );
        if checked {
            assert!(leaked.is_none() && desc.buffers.is_empty(), "{:?}", desc.buffers);
            assert_eq!(read, 0);
            assert_eq!(dtarget.grants_withheld(), 1);
            assert!(took < Duration::from_secs(2));
            assert_eq!(settled.bytes().unwrap(), &vec![0x5Au8; SLOT][..]);
        } else {
            assert!(leaked.is_some(), "the old target hands P's key to whoever claims P's name");
            assert_eq!(read, SLOT, "and the impostor reads P's whole slot with it");
        }
        settled.release();
    }
}

/// Rule 9 on the Connection exchange: one address pairs 1,100 NIC paths
/// (each costs queue pairs at the target; 17x the per-address cap of 64,
/// more than the 1,024 in all). Positive control (no per-address cap, the
/// old behaviour): the flood takes all 1,024 pairings and an honest peer
/// from another address is refused. Checked: 64 paired, the rest refused
/// and counted, and the honest peer pairs at once.
#[test]
fn hostile_rdma_pairing_flood_from_one_address_does_not_shut_out_another_peer() {
    for checked in [false, true] {
        let fabric = FakeFabric::new(126);
        let tnic = fabric.fake_nic();
        let cfg = RdmaTargetConfig {
            device: "fake0".into(),
            max_peers_per_addr: if checked { 64 } else { usize::MAX },
            ..Default::default()
        };
        let target = RdmaTarget::new(Arc::new(tnic.clone()), cfg);
        let attacker = fabric.fake_nic();
        let t0 = Instant::now();
        let mut paired = 0;
        for i in 0..1100 {
            let (qps, r) = pair_from(&target, &attacker, &format!("127.0.0.2:{i}@fake0"), util::ATTACKER.into());
            if r.reply_msg.is_empty() {
                paired += 1;
            } else {
                // Refused: its own queue pairs are no use to it.
                for q in qps {
                    attacker.destroy_qp(q);
                }
            }
        }
        let flood = t0.elapsed();
        let honest = fabric.fake_nic();
        let t0 = Instant::now();
        let (_, r) = pair(&target, &honest, "127.0.0.1:7000@fake0");
        let took = t0.elapsed();
        eprintln!(
            "checked={checked}: 1100 pairings from one address: {paired} paired (target queue pairs {}), \
             refused {} in {flood:?}; honest pairing {:?} in {took:?}",
            target.paired_queue_pairs(),
            target.pairs_refused(),
            if r.reply_msg.is_empty() { "ok" } else { r.reply_msg.as_str() },
        );
        if checked {
            assert_eq!(paired, 64);
            assert_eq!(target.pairs_refused(), 1100 - 64);
            assert!(r.reply_msg.is_empty(), "the honest peer pairs");
            assert!(took < Duration::from_secs(1));
        } else {
            assert_eq!(paired, 1024);
            assert!(!r.reply_msg.is_empty(), "the flood shuts the honest peer out");
        }
    }
}
