//! One side of a prefill/decode pair over NIXL, for the two-process tests.
//!
//! ```text
//! nixl_peer <decode|prefill> <dir> <raw|adapter|cut|roundtrip> <MiB> [host|cuda[:N]]
//! ```
//!
//! The last argument says where both sides' memory lives (default host):
//! `cuda:N` puts the slots and the source in GPU N's memory (NIXL's VRAM),
//! read and filled only through the region's copies (the build needs the
//! feature `cuda`; `scripts/device-check.sh` runs it).
//!
//! The two processes meet through files in `<dir>` (written to a temporary name,
//! then renamed): `decode.md` and `prefill.md` (NIXL metadata), `remote.txt` (the
//! slots the decode side exposes), `released` (the prefill side let go of its
//! request), `exit` (the decode side is done watching). Every wait is bounded
//! (`KVT_PEER_TIMEOUT_S`, default 60 s). The decode side prints one line starting
//! with `RESULT`, the prefill side one starting with `PREFILL`.
//!
//! - `raw`: the hazard's positive control over NIXL's raw API: the prefill side
//!   posts a WRITE of the whole buffer, releases it at once (NIXL says success
//!   while it is `IN_PROG`); the decode side then hands the slot to a new tenant,
//!   fills it, and counts the old bytes that land afterwards.
//! - `adapter`: the same through `NixlTransfer`: the prefill side cancels and drops
//!   its handle at once; the decode side aborts its exposure and hands the slot to
//!   a new tenant as soon as the pool gives it out again.
//! - `cut`: `adapter` with the link cut by the test mid-transfer (the
//!   netns test, which owns the link): the prefill side puts `posted` once its
//!   WRITE is posted and lets go of it only after `cut`; the decode side aborts,
//!   puts `stuck` once the pool reports the slot stuck (a 300 ms drain
//!   deadline), and takes the slot back only when the pool gives it out,
//!   which must not happen before the test puts `restored`.
//! - `roundtrip`: a byte-checked WRITE into 4 exposed slots and a READ out of 4
//!   others, settled by the adapter's notifications.
//!
//! Run with `UCX_TLS=tcp` for the hazard (with shared memory transports the write
//! completes inside the post).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_nixl::adapter::{AdapterConfig, NixlTransfer};
use backend_nixl::engine::{Agent, AgentConfig, MemRegion, NixlLibrary, XferOp, XferState};
use kv_transfer_core::{
    HostRegion, MemoryKind, PoolConfig, Region, RemoteSlots, SlotMemory, Transfer, TransferOptions,
};

const OLD: u8 = 0xA5;
const NEW: u8 = 0x5A;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn timeout() -> Duration {
    Duration::from_secs(std::env::var("KVT_PEER_TIMEOUT_S").ok().and_then(|v| v.parse().ok()).unwrap_or(60))
}

fn put(dir: &Path, name: &str, data: &[u8]) -> Res<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, data)?;
    std::fs::rename(tmp, dir.join(name))?;
    Ok(())
}

fn get(dir: &Path, name: &str) -> Res<Vec<u8>> {
    let path: PathBuf = dir.join(name);
    let start = Instant::now();
    loop {
        if let Ok(d) = std::fs::read(&path) {
            return Ok(d);
        }
        if start.elapsed() > timeout() {
            return Err(format!("timed out waiting for {}", path.display()).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The descriptor as it travels between the two processes: JSON, the
/// exposure's token included (a DONE without it settles nothing).
fn encode_remote(r: &RemoteSlots) -> String {
    serde_json::to_string(r).unwrap_or_default()
}

fn decode_remote(s: &[u8]) -> Res<RemoteSlots> {
    Ok(serde_json::from_slice(s)?)
}

/// Counts `byte` at 65,536 evenly spread offsets (cheap, for watching).
fn sample(read: &dyn Fn(usize, &mut [u8]), len: usize, byte: u8) -> usize {
    let step = (len / 65_536).max(1);
    let mut one = [0u8; 1];
    let mut n = 0;
    let mut off = 0;
    while off < len {
        read(off, &mut one);
        n += usize::from(one[0] == byte);
        off += step;
    }
    n
}

/// Counts `byte` in the whole range, 1 MiB at a time (uniform chunks are
/// compared with `memcmp`, which is fast even unoptimised).
fn count(read: &dyn Fn(usize, &mut [u8]), len: usize, byte: u8) -> usize {
    let mut buf = vec![0u8; 1 << 20];
    let all = vec![byte; 1 << 20];
    let mut n = 0;
    let mut off = 0;
    while off < len {
        let k = buf.len().min(len - off);
        read(off, &mut buf[..k]);
        n += if buf[..k] == all[..k] {
            k
        } else if !buf[..k].contains(&byte) {
            0
        } else {
            buf[..k].iter().filter(|&&b| b == byte).count()
        };
        off += k;
    }
    n
}

/// Watches until the sampled count of `OLD` stops changing for 500 ms (bounded):
/// returns (last change after `t0`, still changing at the end).
fn watch(read: &dyn Fn(usize, &mut [u8]), len: usize, t0: Instant) -> (Duration, bool) {
    let mut last = usize::MAX;
    let mut stable_since = Instant::now();
    let mut last_change = Duration::ZERO;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
        let n = sample(read, len, OLD);
        if n != last {
            last = n;
            last_change = t0.elapsed();
            stable_since = Instant::now();
        } else if stable_since.elapsed() > Duration::from_millis(500) {
            return (last_change, false);
        }
    }
    (last_change, true)
}

/// The raw API's descriptor of a whole region: DRAM, or VRAM of its device.
fn mem_region(r: &dyn Region) -> Res<MemRegion> {
    MemRegion::of(r).ok_or_else(|| format!("NIXL cannot register {}", r.kind()).into())
}

/// Fills a region with `byte` through its copies, 1 MiB at a time.
fn fill(r: &dyn Region, byte: u8) -> Res<()> {
    let chunk = vec![byte; 1 << 20];
    let mut off = 0;
    while off < r.len() {
        let k = chunk.len().min(r.len() - off);
        r.write(off, &chunk[..k])?;
        off += k;
    }
    Ok(())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 12) as u8)).collect()
}

fn adapter(role: &str) -> Res<NixlTransfer> {
    let name = format!("{role}-{}", std::process::id());
    Ok(NixlTransfer::new_real(&name, AdapterConfig::default())?)
}

fn decode_raw(dir: &Path, len: usize, memory: SlotMemory) -> Res<()> {
    let lib = NixlLibrary::load()?;
    let tgt = Agent::new(&lib, &format!("decode-{}", std::process::id()), &AgentConfig::default())?;
    let tb = tgt.create_backend("UCX", &[])?;
    let slot = memory.allocate(len)?;
    let desc = mem_region(slot.as_ref())?;
    // SAFETY: `slot` is leaked below together with the registration (never freed
    // while the peer may write it).
    let reg = unsafe { tgt.register_mem(&[desc], Some(&tb)) }?;
    put(dir, "decode.md", &tgt.local_metadata()?)?;
    let ini = tgt.load_remote_metadata(&get(dir, "prefill.md")?)?;
    let device = match slot.kind() {
        MemoryKind::Device { ordinal } => ordinal.to_string(),
        _ => "host".into(),
    };
    put(dir, "remote.txt", format!("{} {} {device}", slot.addr(), slot.len()).as_bytes())?;
    let how = get(dir, "released")?;
    let t0 = Instant::now();
    // The slot goes back to the pool at once; a new tenant fills it.
    fill(slot.as_ref(), NEW)?;
    let read = |off: usize, out: &mut [u8]| {
        let _ = slot.read(off, out);
    };
    let (last_change, changing) = watch(&read, len, t0);
    let late = count(&read, len, OLD);
    let notif = tgt.get_notifs()?.iter().any(|n| n.agent == ini);
    println!(
        "RESULT mode=raw prefill={} late_old_bytes={late} len={len} last_change_ms={} still_changing={changing} \
         notif={notif}",
        String::from_utf8_lossy(&how),
        last_change.as_millis()
    );
    put(dir, "exit", b"")?;
    reg.leak();
    std::mem::forget(slot);
    std::mem::forget(Arc::clone(&tgt));
    Ok(())
}

fn prefill_raw(dir: &Path, len: usize, memory: SlotMemory) -> Res<()> {
    let lib = NixlLibrary::load()?;
    let ini = Agent::new(&lib, &format!("prefill-{}", std::process::id()), &AgentConfig::default())?;
    let ib = ini.create_backend("UCX", &[])?;
    let src = memory.allocate(len)?;
    fill(src.as_ref(), OLD)?;
    // SAFETY: leaked below with the buffer.
    let reg = unsafe { ini.register_mem(&[mem_region(src.as_ref())?], Some(&ib)) }?;
    let name = ini.load_remote_metadata(&get(dir, "decode.md")?)?;
    put(dir, "prefill.md", &ini.local_metadata()?)?;
    let remote = String::from_utf8(get(dir, "remote.txt")?)?;
    let mut it = remote.split(' ');
    let (Some(Ok(addr)), Some(Ok(rlen)), Some(device)) =
        (it.next().map(str::parse::<usize>), it.next().map(str::parse::<usize>), it.next())
    else {
        return Err("bad remote".into());
    };
    let target = match device.parse::<u32>() {
        Ok(ordinal) => MemRegion::vram(addr, rlen.min(len), ordinal),
        Err(_) => MemRegion::new(addr, rlen.min(len)),
    };
    let mut req = ini.create_xfer(
        XferOp::Write,
        &[mem_region(src.as_ref())?],
        &[target],
        &name,
        Some(b"old tenant done"),
        Some(&ib),
    )?;
    let posted = req.post()?;
    let st = req.status()?;
    let how = if st == XferState::Done {
        "done-before-release"
    } else {
        // The raw release: success while IN_PROG.
        req.release().map_err(|(_, e)| e)?;
        "released-in-prog"
    };
    put(dir, "released", how.as_bytes())?;
    println!("PREFILL mode=raw posted={posted:?} status={st:?} {how}");
    let _ = get(dir, "exit");
    reg.leak();
    std::mem::forget(src);
    Ok(())
}

fn decode_adapter(dir: &Path, len: usize, cut: bool, memory: SlotMemory) -> Res<()> {
    let t = adapter("decode")?;
    let region = memory.allocate(len)?;
    let mut cfg = PoolConfig::new(len);
    if cut {
        let d = Duration::from_millis(300);
        cfg = cfg.with_ladder(kv_transfer_core::EscalationLadder { drain: d, revoke: d, fence: d });
    }
    let pool = t.register_pool(region.clone(), cfg)?;
    put(dir, "decode.md", &t.local_metadata()?)?;
    let peer = t.add_peer(&get(dir, "prefill.md")?)?;
    let (exposed, remote) = t.expose(pool.reserve(1)?, peer).map_err(|e| e.kind.to_string())?;
    put(dir, "remote.txt", encode_remote(&remote).as_bytes())?;
    let how = get(dir, "released")?;
    let t0 = Instant::now();
    // The request is aborted: the exposure goes to quarantine, not to the free list.
    exposed.abort();
    let quarantined = pool.metrics().quarantined;
    let mut stuck_reported = false;
    // A new tenant gets the slot as soon as the pool gives it out again.
    let (mut lease, freed_while_cut) = loop {
        if cut && !stuck_reported && pool.metrics().quarantine_stuck > 0 {
            stuck_reported = true;
            put(dir, "stuck", b"")?;
        }
        match pool.reserve(1) {
            Ok(l) => break (l, cut && !dir.join("restored").exists()),
            Err(_) if t0.elapsed() < timeout() => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => {
                let m = pool.metrics();
                println!(
                    "RESULT mode=cut slot_back=false stuck_reported={stuck_reported} quarantined={} stuck={} \
                     aborts_sent={}",
                    m.quarantined,
                    m.quarantine_stuck,
                    t.metrics().aborts_sent
                );
                return Err(format!("slot never came back: {e}").into());
            }
        }
    };
    let waited = t0.elapsed();
    let chunk = vec![NEW; 1 << 20];
    let mut off = 0;
    while off < len {
        let k = chunk.len().min(len - off);
        lease.write_at(0, off, &chunk[..k])?;
        off += k;
    }
    let filled = t0.elapsed();
    let read = |off: usize, out: &mut [u8]| {
        let _ = region.read(off, out);
    };
    let (_, changing) = watch(&read, len, t0);
    let late = count(&read, len, OLD);
    let m = t.metrics();
    let pm = pool.metrics();
    println!(
        "RESULT mode={} prefill={} late_old_bytes={late} len={len} quarantined_at_abort={quarantined} \
         slot_back_after_ms={} filled_ms={} still_changing={changing} aborts_sent={} settled_by_message={} \
         stale={} slot_back=true stuck_reported={stuck_reported} freed_while_cut={freed_while_cut} \
         settled_completed={}",
        if cut { "cut" } else { "adapter" },
        String::from_utf8_lossy(&how),
        waited.as_millis(),
        filled.as_millis(),
        m.aborts_sent,
        m.settled_by_message,
        m.stale,
        pm.settled_completed
    );
    lease.release();
    put(dir, "exit", b"")?;
    let r = t.shutdown(Duration::from_secs(10));
    eprintln!("decode shutdown: {r:?}");
    Ok(())
}

fn prefill_adapter(dir: &Path, len: usize, cut: bool, memory: SlotMemory) -> Res<()> {
    let t = adapter("prefill")?;
    let pool = t.register_pool(memory.allocate(len)?, PoolConfig::new(len))?;
    let mut lease = pool.reserve(1)?;
    let chunk = vec![OLD; 1 << 20];
    let mut off = 0;
    while off < len {
        let k = chunk.len().min(len - off);
        lease.write_at(0, off, &chunk[..k])?;
        off += k;
    }
    t.add_peer(&get(dir, "decode.md")?)?;
    put(dir, "prefill.md", &t.local_metadata()?)?;
    let remote = decode_remote(&get(dir, "remote.txt")?)?;
    let h =
        futures_lite_block_on(t.write(lease, &remote, TransferOptions::default())).map_err(|e| e.kind.to_string())?;
    if cut {
        // The test cuts the link with the WRITE in flight.
        put(dir, "posted", b"")?;
        get(dir, "cut")?;
    }
    // Let go at once: cancel and drop the handle (NIXL itself has no cancel).
    h.cancel();
    drop(h);
    put(dir, "released", b"handle-dropped")?;
    let _ = get(dir, "exit");
    let r = t.shutdown(Duration::from_secs(20));
    let m = t.metrics();
    println!(
        "PREFILL mode=adapter shutdown={r:?} acks_sent={} aborts_received={} completed_ok={} completed_err={} free={}",
        m.acks_sent,
        m.aborts_received,
        m.completed_ok,
        m.completed_err,
        pool.metrics().free
    );
    Ok(())
}

const RT_SLOT: usize = 1 << 20;

fn decode_roundtrip(dir: &Path) -> Res<()> {
    let t = adapter("decode")?;
    let pool = t.register_pool(Arc::new(HostRegion::new(8 * RT_SLOT)?), PoolConfig::new(RT_SLOT))?;
    put(dir, "decode.md", &t.local_metadata()?)?;
    let peer = t.add_peer(&get(dir, "prefill.md")?)?;
    // WRITE target: 4 slots. READ source: 4 slots filled here.
    let (w_exposed, w_remote) = t.expose(pool.reserve(4)?, peer).map_err(|e| e.kind.to_string())?;
    let mut r_lease = pool.reserve(4)?;
    for i in 0..4 {
        r_lease.write_at(i, 0, &pattern(RT_SLOT, 100 + i as u8))?;
    }
    let (r_exposed, r_remote) = t.expose(r_lease, peer).map_err(|e| e.kind.to_string())?;
    put(dir, "remote.txt", format!("{}\n{}", encode_remote(&w_remote), encode_remote(&r_remote)).as_bytes())?;
    let settle = |mut e: kv_transfer_core::SlotLease<kv_transfer_core::Exposed>| -> Res<_> {
        let start = Instant::now();
        loop {
            match e.try_settled() {
                Ok(s) => return Ok(s),
                Err(back) if start.elapsed() < timeout() => {
                    e = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return Err("exposure never settled".into()),
            }
        }
    };
    let written = settle(w_exposed)?;
    let mut ok = true;
    for i in 0..4 {
        let mut got = vec![0u8; RT_SLOT];
        written.read_at(i, 0, &mut got)?;
        ok &= got == pattern(RT_SLOT, 1 + i as u8);
    }
    let read = settle(r_exposed)?;
    let events = t.take_events();
    println!(
        "RESULT mode=roundtrip write_bytes_ok={ok} events={:?} settled_by_message={} stale={}",
        events.iter().map(|e| e.kind).collect::<Vec<_>>(),
        t.metrics().settled_by_message,
        t.metrics().stale
    );
    written.release();
    read.release();
    put(dir, "exit", b"")?;
    let r = t.shutdown(Duration::from_secs(10));
    eprintln!("decode shutdown: {r:?}");
    Ok(())
}

fn prefill_roundtrip(dir: &Path) -> Res<()> {
    let t = adapter("prefill")?;
    let pool = t.register_pool(Arc::new(HostRegion::new(8 * RT_SLOT)?), PoolConfig::new(RT_SLOT))?;
    let peer = t.add_peer(&get(dir, "decode.md")?)?;
    put(dir, "prefill.md", &t.local_metadata()?)?;
    let remote = String::from_utf8(get(dir, "remote.txt")?)?;
    let mut lines = remote.lines();
    let (Some(w), Some(r)) = (lines.next(), lines.next()) else {
        return Err("bad remote file".into());
    };
    let (w, r) = (decode_remote(w.as_bytes())?, decode_remote(r.as_bytes())?);
    let mut lease = pool.reserve(4)?;
    for i in 0..4 {
        lease.write_at(i, 0, &pattern(RT_SLOT, 1 + i as u8))?;
    }
    let h = futures_lite_block_on(t.write(lease, &w, TransferOptions::default())).map_err(|e| e.kind.to_string())?;
    let out = futures_lite_block_on(h).map_err(|e| e.to_string())?;
    let write_ok = out.result.is_ok();
    let h = futures_lite_block_on(t.read(out.lease.into_reserved(), &r, TransferOptions::default()))
        .map_err(|e| e.kind.to_string())?;
    let out = futures_lite_block_on(h).map_err(|e| e.to_string())?;
    let mut read_ok = out.result.is_ok();
    for i in 0..4 {
        let mut got = vec![0u8; RT_SLOT];
        out.lease.read_at(i, 0, &mut got)?;
        read_ok &= got == pattern(RT_SLOT, 100 + i as u8);
    }
    out.lease.release();
    let _ = get(dir, "exit");
    t.remove_peer(peer, Duration::from_secs(5))?;
    let rep = t.shutdown(Duration::from_secs(5));
    println!("PREFILL mode=roundtrip write_ok={write_ok} read_bytes_ok={read_ok} shutdown={rep:?}");
    Ok(())
}

/// A minimal `block_on` (the bin has no async runtime dependency).
fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Th(std::thread::Thread);
    impl Wake for Th {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Th(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: nixl_peer <decode|prefill> <dir> <raw|adapter|cut|roundtrip> <MiB> [host|cuda[:N]]";
    let (Some(role), Some(dir), Some(mode)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let mib: usize = args.get(4).and_then(|m| m.parse().ok()).unwrap_or(256);
    let memory = match args.get(5).map(|m| m.parse::<SlotMemory>()).transpose() {
        Ok(m) => m.unwrap_or_default(),
        Err(e) => {
            eprintln!("{e}\n{usage}");
            std::process::exit(2);
        }
    };
    let dir = Path::new(dir);
    let len = mib << 20;
    let r = match (role.as_str(), mode.as_str()) {
        ("decode", "raw") => decode_raw(dir, len, memory),
        ("prefill", "raw") => prefill_raw(dir, len, memory),
        ("decode", "adapter") => decode_adapter(dir, len, false, memory),
        ("prefill", "adapter") => prefill_adapter(dir, len, false, memory),
        ("decode", "cut") => decode_adapter(dir, len, true, memory),
        ("prefill", "cut") => prefill_adapter(dir, len, true, memory),
        ("decode", "roundtrip") => decode_roundtrip(dir),
        ("prefill", "roundtrip") => prefill_roundtrip(dir),
        _ => Err(usage.into()),
    };
    let code = match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("nixl_peer {role} {mode}: error: {e}");
            1
        }
    };
    // NIXL and UCX leave threads behind; leave without running their exit handlers
    // on state that may still be in use (raw mode leaks live requests on purpose).
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}
