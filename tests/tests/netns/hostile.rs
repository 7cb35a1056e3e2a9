//! Scenario 5: a hostile peer on every listening port the project opens.
//! The service runs on host a with registered memory holding a known
//! pattern; from host b a seeded generator ([`frames`]) sends random,
//! truncated, oversize, replayed (and, where every byte is checked,
//! mutated) frames, `KVT_HOSTILE_FRAMES` per port (100,000 by default).
//! Then: every byte of registered memory is unchanged, the service did not
//! stop (no panicked thread, still accepting), and an honest peer is served
//! through the same port.
//!
//! NIXL opens no listening port of ours (its metadata travels through the
//! caller; UCX's own listener is NIXL's), so it has no case here.

use super::*;
use kv_transfer_tests::frames::{blast, BlastPlan, BlastReport, FrameGen, LenField, Preamble};
use std::net::{SocketAddr, TcpStream};

/// Frames per port (`KVT_HOSTILE_FRAMES`, default 100,000).
fn frames_per_port() -> u64 {
    std::env::var("KVT_HOSTILE_FRAMES").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000)
}

/// Sends the frames from host b and checks the count.
fn blast_from_b(
    lab: &Lab,
    port: &str,
    addr: SocketAddr,
    per_connection: usize,
    preamble: Option<fn(&mut TcpStream) -> std::io::Result<()>>,
    gen: impl Fn(usize) -> FrameGen + Send + Sync + 'static,
) -> Result<BlastReport, Failed> {
    let n = frames_per_port();
    // 100,000 connections in a minute or two from one address to one port:
    // the service closes first, so each leaves a TIME_WAIT on host a, and
    // host b's ephemeral ports come round again onto tuples still waiting
    // there (a SYN that is then answered late, or not: connects time out
    // under load). Both hosts are the test's own: it keeps no TIME_WAIT on
    // host a and gives host b the whole port range.
    lab.a
        .run(|| std::fs::write("/proc/sys/net/ipv4/tcp_max_tw_buckets", "0"))
        .map_err(err("host a"))?
        .map_err(err("tcp_max_tw_buckets"))?;
    lab.b
        .run(|| std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "1024 65535"))
        .map_err(err("host b"))?
        .map_err(err("ip_local_port_range"))?;
    let r = lab
        .b
        .run(move || {
            let pre = preamble.map(|p| move |s: &mut TcpStream| p(s));
            let plan = BlastPlan {
                addr,
                frames: n,
                per_connection,
                preamble: pre.as_ref().map(|p| p as &Preamble),
                threads: 4,
                deadline: Duration::from_secs(600),
            };
            blast(&plan, &gen)
        })
        .map_err(err("host b"))?;
    eprintln!(
        "netns hostile {port}: {} frames (random {} / truncated {} / oversize {} / replayed {} / mutated {}) on {} \
         connections in {:.1?}: {} reset by the service, {} connects refused, {} reply bytes",
        r.frames,
        r.kinds[0],
        r.kinds[1],
        r.kinds[2],
        r.kinds[3],
        r.kinds[4],
        r.connections,
        r.elapsed,
        r.reset,
        r.connect_failures,
        r.reply_bytes
    );
    ensure(r.frames >= n, format!("{port}: only {} of {n} frames sent (the service stopped accepting?)", r.frames))?;
    Ok(r)
}

fn region_bytes(r: &HostRegion) -> Result<Vec<u8>, Failed> {
    let mut v = vec![0u8; r.len()];
    r.read(0, &mut v).map_err(err("read the region"))?;
    Ok(v)
}

fn filled_region(slots: usize, seed: u8) -> Result<Arc<HostRegion>, Failed> {
    let r = HostRegion::new(slots * SLOT).map_err(err("region"))?;
    let bytes: Vec<u8> = (0..slots * SLOT).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    r.write(0, &bytes).map_err(err("fill"))?;
    Ok(Arc::new(r))
}

/// tcp-sim's data port: the hello (as a peer named `hostile`), then frames
/// built like a real peer's: WRITEs into an exposed slot (exposed to
/// another connection), WRITE_IMM, READs, a second hello, a DONE.
pub(super) fn tcp_sim() -> Result<(), Failed> {
    use backend_tcp_sim::wire::{self, Body};
    use backend_tcp_sim::RawAccess;
    let lab = Lab::new("hsim").map_err(err("lab"))?;
    let p = pair(&lab, 4, ladder(200, 200, 1_000), None)?;
    let (exposed, remote) = p
        .decode
        .expose(p.dpool.reserve(2).map_err(err("reserve"))?, p.peer)
        .map_err(|e| Failed::from(e.kind.to_string()))?;
    // The memory the blast must not change: a pattern everywhere.
    let pattern: Vec<u8> = (0..4 * SLOT).map(|i| (i as u8).wrapping_mul(7)).collect();
    p.dregion.write(0, &pattern).map_err(err("fill"))?;
    let mut honest = Vec::new();
    for i in 0..2 {
        let acc = RawAccess::of(&remote, i).ok_or("no access")?;
        let mut w = wire::encode_head(&Body::Write(acc.header(7 + i as u64, 64)), 64).map_err(err("encode"))?;
        w.extend_from_slice(&[0xEE; 64]);
        honest.push(w);
        honest.push(wire::encode_head(&Body::Read(acc.header(9, 64)), 0).map_err(err("encode"))?);
    }
    honest.push(
        wire::encode_head(&Body::Hello { name: "netns-prefill".into(), endpoint: "10.0.0.1:1".into() }, 0)
            .map_err(err("encode"))?,
    );
    let addr: SocketAddr = p.decode.endpoint().parse().map_err(err("endpoint"))?;
    fn hello(s: &mut TcpStream) -> std::io::Result<()> {
        use std::io::{Read, Write};
        let key = kv_transfer_core::auth::ClusterKey::from_env().map_err(std::io::Error::other)?;
        let dialed = s.peer_addr()?.to_string();
        wire::authenticate_dialed(s, &key, "hostile", "10.0.0.9:1", &dialed).map_err(std::io::Error::other)?;
        let h = wire::encode_head(&Body::Hello { name: "hostile".into(), endpoint: "10.0.0.9:1".into() }, 0)
            .map_err(std::io::Error::other)?;
        s.write_all(&h)?;
        let mut pre = [0u8; wire::PREFIX_LEN];
        s.read_exact(&mut pre)?;
        let pf = wire::decode_prefix(&pre).map_err(std::io::Error::other)?;
        let mut f = vec![0u8; pf.fields_len()];
        s.read_exact(&mut f)
    }
    let len = Some(LenField { offset: 4, width: 4 });
    blast_from_b(&lab, "tcp-sim data port", addr, 8, Some(hello), move |t| {
        FrameGen::new(0x5eed + t as u64, honest.clone(), len, true)
    })?;
    let st = p.decode.stats();
    ensure(region_bytes(&p.dregion)? == pattern, "the hostile frames changed registered memory")?;
    ensure(st.writes_applied == 0, format!("{} hostile writes applied", st.writes_applied))?;
    ensure(st.hook_panics == 0, "a NIC thread panicked")?;
    ensure(st.malformed_frames > 0, "no frame was refused as malformed: the generator reached nothing")?;
    eprintln!(
        "netns hostile tcp-sim: {} malformed, {} wrong peer, {} unknown key, {} out of bounds, {} stale, {} oversize",
        st.malformed_frames,
        st.rejected_wrong_peer,
        st.rejected_unknown_key,
        st.rejected_out_of_bounds,
        st.rejected_stale_generation,
        st.rejected_oversize
    );
    // The honest peer, on its connection from before, is still served.
    let mut src = p.ppool.reserve(2).map_err(err("reserve"))?;
    for i in 0..2 {
        src.write_at(i, 0, &vec![0xA5; SLOT]).map_err(err("fill"))?;
    }
    let h = block_on(p.prefill.write(src, &remote, TransferOptions::notify(true)))
        .map_err(|e| Failed::from(e.kind.to_string()))?;
    let out = poll_until(Box::pin(h).as_mut(), Duration::from_secs(10)).ok_or("the honest write never ended")?;
    out.map_err(err("honest write"))?.result.map_err(err("honest write"))?;
    let settled = poll_until(Box::pin(exposed.settled()).as_mut(), Duration::from_secs(10))
        .ok_or("the honest write's DONE never settled the exposure")?;
    let got = settled.bytes().map_err(err("read"))?;
    ensure(got.iter().all(|&b| b == 0xA5), "the honest peer's bytes did not land")?;
    settled.release();
    Ok(())
}

/// The verbs adapter's side channel (on the fake fabric's NIC: the same
/// listener and handshake as on a device): hellos of the right shape from
/// a stranger (no ticket: it never saw the descriptor), cut, oversize (the
/// name's length), replayed and mutated. Each is refused and counted,
/// and leaves no queue pair behind (each used to keep one, and a
/// well-formed one became a peer: a device has only so many); an honest
/// adapter still connects and writes.
pub(super) fn verbs_side_channel() -> Result<(), Failed> {
    use backend_verbs::{Endpoint, FakeFabric, Gid, VerbsConfig, VerbsTransfer};
    let lab = Lab::new("hvrb").map_err(err("lab"))?;
    let fabric = FakeFabric::new(0x1234);
    let start = |host: &netns_lab::Host, name: &str| -> Result<VerbsTransfer, Failed> {
        let mut c = VerbsConfig::new(name.to_string(), "fake", 0);
        c.listen = format!("{}:0", host.addr);
        c.timeout = Duration::from_secs(2);
        let nic = fabric.fake_nic();
        host.run(move || VerbsTransfer::with_engine(c, Arc::new(nic)).map_err(|e| e.to_string()))
            .map_err(err("host"))?
            .map_err(err("verbs adapter"))
    };
    let decode = Arc::new(start(&lab.a, "netns-verbs-decode")?);
    let dregion = filled_region(4, 3)?;
    let dpool = decode.register_pool(dregion.clone(), PoolConfig::new(SLOT)).map_err(err("pool"))?;
    let before = region_bytes(&dregion)?;
    let qps_before = fabric.queue_pairs().len();
    let desc = decode.descriptor().to_string();
    let addr: SocketAddr = backend_verbs::adapter::parse_descriptor(desc.as_bytes())
        .map_err(err("descriptor"))?
        .addr
        .parse()
        .map_err(err("address"))?;
    // Hellos of the right shape, but without the decode's ticket: a
    // stranger never saw its descriptor (the ticket's only carrier).
    let hello = |name: &str, qpn: u32, ticket: [u8; 16]| {
        let mut b = b"KVTV\x02".to_vec();
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&Endpoint { qpn, psn: 1, gid: Gid([0; 16]), mtu: 1024 }.encode());
        b.extend_from_slice(&ticket);
        b
    };
    let honest = vec![
        hello("hostile", 7, [0; 16]),
        hello("netns-verbs-prefill", 9, [0x5a; 16]),
        hello(&"x".repeat(256), 11, [0xff; 16]),
    ];
    let len = Some(LenField { offset: 5, width: 2 });
    let r = blast_from_b(&lab, "verbs side channel", addr, 1, None, move |t| {
        FrameGen::new(0x7e4b + t as u64, honest.clone(), len, true)
    })?;
    ensure(region_bytes(&dregion)? == before, "the hostile hellos changed registered memory")?;
    // Every hello is refused (none carries the ticket) and leaves no queue
    // pair behind. Handshakes run on threads of their own, up to a cap (rule
    // 9): a connection past the cap is refused at the gate, and the last
    // handshakes may still be ending when the blast returns (bounded wait).
    let counter = |name: &str| decode.counters().into_iter().find(|c| c.0 == name).map_or(0, |c| c.1);
    let refusals =
        || counter("side_channel_refused") + counter("side_channel_busy") + counter("side_channel_per_address");
    let t0 = Instant::now();
    while refusals() < r.connections && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (peers, refused) = (counter("peers"), refusals());
    let leftover = fabric.queue_pairs().len().saturating_sub(qps_before);
    eprintln!("netns hostile verbs: {refused} hellos refused, {peers} peers made, {leftover} queue pairs left over");
    ensure(peers == 0, format!("{peers} hostile hellos became peers"))?;
    ensure(leftover == 0, format!("{leftover} queue pairs of refused connections outlived them"))?;
    ensure(refused == r.connections, format!("{refused} refusals counted for {} connections", r.connections))?;
    // An honest adapter on host b connects through the same listener and writes.
    let prefill = Arc::new(start(&lab.b, "netns-verbs-prefill")?);
    let ppool = prefill.register_pool(filled_region(4, 9)?, PoolConfig::new(SLOT)).map_err(err("pool"))?;
    let (p, d) = (prefill.clone(), decode.clone());
    let (pdesc, ddesc) = (prefill.descriptor().to_string(), desc.clone());
    lab.b.run(move || p.add_peer(&ddesc)).map_err(err("host b"))?.map_err(err("prefill adds decode"))?;
    let peer = lab.a.run(move || d.add_peer(&pdesc)).map_err(err("host a"))?.map_err(err("decode adds prefill"))?;
    let (exposed, remote) =
        decode.expose(dpool.reserve(1).map_err(err("reserve"))?, peer).map_err(|e| Failed::from(e.kind.to_string()))?;
    let mut src = ppool.reserve(1).map_err(err("reserve"))?;
    src.write_at(0, 0, &vec![0xA5; SLOT]).map_err(err("fill"))?;
    let h = block_on(prefill.write(src, &remote, TransferOptions::notify(true)))
        .map_err(|e| Failed::from(e.kind.to_string()))?;
    let out = poll_until(Box::pin(h).as_mut(), Duration::from_secs(10)).ok_or("the honest write never ended")?;
    out.map_err(err("honest write"))?.result.map_err(err("honest write"))?;
    let settled = poll_until(Box::pin(exposed.settled()).as_mut(), Duration::from_secs(10))
        .ok_or("the honest DONE never settled the exposure")?;
    ensure(settled.bytes().map_err(err("read"))?.iter().all(|&b| b == 0xA5), "the honest bytes did not land")?;
    settled.release();
    Ok(())
}

/// Mooncake's handshake and data ports (our engine, wire-compatible with
/// the real one). The data port has no access key by the protocol's design
/// (an address is the key: anyone who reaches the port and knows a
/// registered address may write it), so its replays carry the bytes the
/// memory already holds, and nothing is mutated; random frames aim at
/// unregistered addresses, oversize ones past every registered range.
#[cfg(feature = "mooncake")]
pub(super) mod mooncake {
    use super::*;
    use backend_mooncake::proto::handshake::{HandshakeFrame, HandshakeType};
    use backend_mooncake::proto::tcp::{RequestHeader, HEADER_LEN};
    use backend_mooncake::{
        AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer, TcpOpcode, TcpTransportConfig,
    };
    use kv_transfer_core::Target;

    struct Side {
        engine: Arc<MooncakeEngine>,
        transfer: Arc<MooncakeTransfer>,
    }

    fn side(host: &netns_lab::Host) -> Result<Side, Failed> {
        let cfg = EngineConfig {
            local_host: host.addr.to_string(),
            tcp: TcpTransportConfig { io_timeout: Duration::from_secs(1), ..TcpTransportConfig::default() },
            ..EngineConfig::default()
        };
        host.run(move || -> Result<Side, String> {
            let engine = Arc::new(MooncakeEngine::new(cfg).map_err(|e| e.to_string())?);
            let t = MooncakeTransfer::new(engine.clone(), AdapterConfig::default()).map_err(|e| e.to_string())?;
            Ok(Side { engine, transfer: Arc::new(t) })
        })
        .map_err(err("host"))?
        .map_err(err("mooncake side"))
    }

    /// Both sides, their pools, the registered memory's pattern.
    struct Rig {
        decode: Side,
        prefill: Side,
        dregion: Arc<HostRegion>,
        dpool: SlotPool,
        ppool: SlotPool,
        before: Vec<u8>,
        peer: kv_transfer_core::PeerId,
    }

    fn rig(lab: &Lab) -> Result<Rig, Failed> {
        let (decode, prefill) = (side(&lab.a)?, side(&lab.b)?);
        let dregion = filled_region(4, 5)?;
        let dpool = decode.transfer.register_pool(dregion.clone(), PoolConfig::new(SLOT)).map_err(err("pool"))?;
        let ppool = prefill.transfer.register_pool(filled_region(4, 6)?, PoolConfig::new(SLOT)).map_err(err("pool"))?;
        let before = region_bytes(&dregion)?;
        let (ddesc, pdesc) = (
            decode.transfer.local_descriptor().map_err(err("descriptor"))?,
            prefill.transfer.local_descriptor().map_err(err("descriptor"))?,
        );
        let (d, p) = (decode.transfer.clone(), prefill.transfer.clone());
        lab.b.run(move || Target::add_peer(&*p, &ddesc)).map_err(err("host b"))?.map_err(err("prefill adds decode"))?;
        let peer =
            lab.a.run(move || Target::add_peer(&*d, &pdesc)).map_err(err("host a"))?.map_err(err("decode adds"))?;
        Ok(Rig { decode, prefill, dregion, dpool, ppool, before, peer })
    }

    /// After the blast: memory unchanged, and an honest transfer (a
    /// descriptor fetch and a notification on the handshake port, the
    /// bytes on the data port) lands and settles.
    fn honest_after(r: &Rig, port: &str) -> Result<(), Failed> {
        ensure(region_bytes(&r.dregion)? == r.before, format!("{port}: the hostile frames changed registered memory"))?;
        let (exposed, remote) = r
            .decode
            .transfer
            .expose(r.dpool.reserve(2).map_err(err("reserve"))?, r.peer)
            .map_err(|e| Failed::from(e.kind.to_string()))?;
        let mut src = r.ppool.reserve(2).map_err(err("reserve"))?;
        for i in 0..2 {
            src.write_at(i, 0, &vec![0xA5; SLOT]).map_err(err("fill"))?;
        }
        let h = block_on(r.prefill.transfer.write(src, &remote, TransferOptions::notify(true)))
            .map_err(|e| Failed::from(e.kind.to_string()))?;
        let out = poll_until(Box::pin(h).as_mut(), Duration::from_secs(10)).ok_or("the honest write never ended")?;
        out.map_err(err("honest write"))?.result.map_err(err("honest write"))?;
        let settled = poll_until(Box::pin(exposed.settled()).as_mut(), Duration::from_secs(10))
            .ok_or(format!("{port}: the honest notification never settled the exposure"))?;
        ensure(settled.bytes().map_err(err("read"))?.iter().all(|&b| b == 0xA5), "the honest bytes did not land")?;
        settled.release();
        Ok(())
    }

    pub(in super::super) fn handshake_port() -> Result<(), Failed> {
        let lab = Lab::new("hmch").map_err(err("lab"))?;
        let r = rig(&lab)?;
        let addr = r.decode.engine.handshake_addr().ok_or("no handshake port")?;
        let desc = r.prefill.engine.local_descriptor().to_json();
        let notify = br#"{"name":"10.0.0.9:1","notify_msg":"W1 0 0 0 0"}"#.to_vec();
        let honest = vec![
            HandshakeFrame::new(HandshakeType::Metadata, desc).encode(),
            HandshakeFrame::new(HandshakeType::Notify, notify).encode(),
            HandshakeFrame::new(HandshakeType::Probe, b"{}\n".to_vec()).encode(),
            HandshakeFrame::new(HandshakeType::Connection, b"{}\n".to_vec()).encode(),
        ];
        let len = Some(LenField { offset: 0, width: 8 });
        blast_from_b(&lab, "mooncake handshake port", addr, 1, None, move |t| {
            FrameGen::new(0x6d63 + t as u64, honest.clone(), len, true)
        })?;
        honest_after(&r, "handshake port")
    }

    pub(in super::super) fn data_port() -> Result<(), Failed> {
        let lab = Lab::new("hmcd").map_err(err("lab"))?;
        let r = rig(&lab)?;
        let addr = r.decode.engine.data_addr().ok_or("no data port")?;
        let base = r
            .decode
            .engine
            .local_descriptor()
            .buffers
            .first()
            .map(|b| b.addr)
            .ok_or("the decode registered no buffer")?;
        let mut honest = Vec::new();
        for (off, size) in [(0usize, 64usize), (SLOT, 256), (3 * SLOT + 100, 32)] {
            let head = |opcode| RequestHeader { size: size as u64, addr: base + off as u64, opcode, v2: true }.encode();
            let mut w = head(TcpOpcode::Write).to_vec();
            w.extend_from_slice(&r.before[off..off + size]); // a replay: the bytes already there
            honest.push(w);
            honest.push(head(TcpOpcode::Read).to_vec());
        }
        debug_assert!(honest.iter().all(|f| f.len() >= HEADER_LEN));
        let len = Some(LenField { offset: 0, width: 8 });
        blast_from_b(&lab, "mooncake data port", addr, 1, None, move |t| {
            FrameGen::new(0x6d64 + t as u64, honest.clone(), len, false)
        })?;
        honest_after(&r, "data port")
    }
}
