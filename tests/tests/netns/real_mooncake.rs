//! Ours against the REAL Mooncake engine (0.3.13.post1, the `mooncake.engine`
//! Python module from `.engines`) across the veth: the real engine runs in
//! host b's namespace (`ip netns exec`), ours in host a's. Our adapter as
//! initiator WRITEs and READs the real target; the real engine as initiator
//! WRITEs into our adapter's exposed slot and its notification (Mooncake
//! sends it only after it saw the transfer COMPLETED) settles it. Bytes are
//! checked on both sides.

use super::*;
use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer};
use kv_transfer_core::drain::{ControlKind, ControlMessage};
use kv_transfer_core::{Generation, PoolId, RemoteSlot, RemoteSlots, SlotId};

#[path = "../../../backend-mooncake/tests/support/real_peer.rs"]
mod real_peer;
use real_peer::{Engines, Peer, LINE_TIMEOUT};

const MC_SLOT: usize = 64 << 10;

/// The real engine, or why it cannot be used (for the harness to ignore
/// the scenario, or fail it under `CI=true`).
pub(super) fn engines() -> Result<Engines, String> {
    Engines::find()
}

fn ours(host: &netns_lab::Host) -> Result<Arc<MooncakeTransfer>, Failed> {
    let cfg = EngineConfig { local_host: host.addr.to_string(), ..EngineConfig::default() };
    let t = host
        .run(move || -> Result<MooncakeTransfer, String> {
            let e = MooncakeEngine::new(cfg).map_err(|e| e.to_string())?;
            MooncakeTransfer::new(Arc::new(e), AdapterConfig::default()).map_err(|e| e.to_string())
        })
        .map_err(err("host"))?
        .map_err(err("our side"))?;
    Ok(Arc::new(t))
}

fn pat(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed).wrapping_add((i >> 8) as u8)).collect()
}

pub(super) fn across_the_veth() -> Result<(), Failed> {
    let eng = engines().map_err(|w| Failed::from(format!("needs {w}")))?;
    let lab = Lab::new("mcreal").map_err(err("lab"))?;
    // The real engine on host b (its methods panic on a broken peer: the
    // harness reports that as this test's failure).
    let mut peer = Peer::start_in(&eng, 1 << 20, false, Some(&lab.b.ns), &lab.b.addr.to_string());
    let theirs = pat(MC_SLOT, 42);
    peer.put(2 * MC_SLOT as u64, &theirs);

    // 1. Our adapter on host a as the initiator, the real engine the target.
    let a = ours(&lab.a)?;
    let pool = a
        .register_pool(Arc::new(HostRegion::new(4 * MC_SLOT).map_err(err("region"))?), PoolConfig::new(MC_SLOT))
        .map_err(err("pool"))?;
    let (t, seg) = (a.clone(), peer.segment());
    lab.a.run(move || t.add_peer(&seg)).map_err(err("host a"))?.map_err(err("add the real target"))?;
    let (pseg, paddr) = (peer.segment(), peer.addr);
    let remote = |slots: &[u64]| RemoteSlots {
        endpoint: pseg.clone(),
        pool: PoolId(0),
        key: 0,
        slot_size: MC_SLOT as u64,
        memory: Default::default(),
        token: Default::default(),
        slots: slots
            .iter()
            .map(|&i| RemoteSlot {
                slot: SlotId(i as u32),
                generation: Generation(0),
                addr: paddr + i * MC_SLOT as u64,
                key: None,
            })
            .collect(),
    };
    let mut src = pool.reserve(2).map_err(err("reserve"))?;
    src.write_at(0, 0, &pat(MC_SLOT, 1)).map_err(err("fill"))?;
    src.write_at(1, 0, &pat(MC_SLOT, 2)).map_err(err("fill"))?;
    let (w, r) = (remote(&[0, 1]), remote(&[2]));
    let h = block_on(a.write(src, &w, TransferOptions::notify(false))).map_err(|e| Failed::from(e.kind.to_string()))?;
    let out = poll_until(Box::pin(h).as_mut(), LINE_TIMEOUT).ok_or("our WRITE to the real target never ended")?;
    let out = out.map_err(err("write"))?;
    out.result.map_err(err("write"))?;
    out.lease.release();
    let h = block_on(a.read(pool.reserve(1).map_err(err("reserve"))?, &r, TransferOptions::notify(false)))
        .map_err(|e| Failed::from(e.kind.to_string()))?;
    let out = poll_until(Box::pin(h).as_mut(), LINE_TIMEOUT).ok_or("our READ of the real target never ended")?;
    let out = out.map_err(err("read"))?;
    out.result.map_err(err("read"))?;
    ensure(out.lease.bytes().map_err(err("bytes"))? == theirs, "we did not read the real target's bytes")?;
    out.lease.release();
    ensure(
        peer.get(0, 2 * MC_SLOT as u64) == [pat(MC_SLOT, 1), pat(MC_SLOT, 2)].concat(),
        "the real target does not hold our bytes",
    )?;

    // 2. The real engine as the initiator into our decode adapter's exposed
    // slot; its notification, sent after COMPLETED, settles it.
    let d = ours(&lab.a)?;
    let dregion = Arc::new(HostRegion::new(2 * MC_SLOT).map_err(err("region"))?);
    let dpool = d.register_pool(dregion.clone(), PoolConfig::new(MC_SLOT)).map_err(err("pool"))?;
    let (t, seg) = (d.clone(), peer.segment());
    let pid = lab.a.run(move || t.add_peer(&seg)).map_err(err("host a"))?.map_err(err("add the real initiator"))?;
    let (exposed, remote) =
        d.expose(dpool.reserve(1).map_err(err("reserve"))?, pid).map_err(|e| Failed::from(e.kind.to_string()))?;
    let dseg = d.segment_name().to_string();
    let rc = peer.cmd(&format!("write {dseg} {} {} {MC_SLOT}", 2 * MC_SLOT, remote.slots[0].addr));
    ensure(rc == "RC 0", format!("the real WRITE into our slot: {rc}"))?;
    let done = ControlMessage::new(ControlKind::Done, remote.pool, remote.token, remote.tenancies())
        .encode_text()
        .map_err(err("encode"))?;
    let rc = peer.cmd(&format!("notify {dseg} {} {done}", remote.slots[0].addr));
    ensure(rc == "RC 0", format!("the real notification: {rc}"))?;
    let settled = poll_until(Box::pin(exposed.settled()).as_mut(), Duration::from_secs(10))
        .ok_or("the real engine's DONE did not settle our exposure")?;
    ensure(settled.bytes().map_err(err("bytes"))? == theirs, "the real engine's bytes did not land in our slot")?;
    settled.release();
    eprintln!(
        "netns real mooncake: ours ({}) -> real ({}) WRITE 2 x 64 KiB + READ 64 KiB, real -> ours WRITE 64 KiB + \
         DONE: bytes checked",
        lab.a.addr,
        peer.segment()
    );
    Ok(())
}
