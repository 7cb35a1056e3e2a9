//! Positive control for the hazard, with NIXL's raw API: release a WRITE while it is
//! still `IN_PROG`, hand the target slot to a new tenant, and count the old
//! request's bytes that land on top of the new tenant's data afterwards.
//!
//! Size: `KVT_HAZARD_MIB` (default 256). Transport: `UCX_TLS` (default `tcp` here).
//! Run with `--nocapture` to see the figures.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_nixl::engine::{Agent, AgentConfig, HostBuffer, XferOp, XferState};

const OLD: u8 = 0xA5;
const NEW: u8 = 0x5A;

/// Counts `byte` in the buffer, a word at a time (tests run unoptimised).
fn count(buf: &HostBuffer, byte: u8) -> usize {
    let v = buf.to_vec();
    let word = u64::from_ne_bytes([byte; 8]);
    let mut n = 0;
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        let w = u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        if w == word {
            n += 8;
        } else {
            n += c.iter().filter(|&&b| b == byte).count();
        }
    }
    n + tail.iter().filter(|&&b| b == byte).count()
}

/// Counts `byte` in 64 Ki samples spread over the buffer (cheap, for watching).
fn sample(buf: &HostBuffer, byte: u8) -> usize {
    let step = (buf.len() / 65_536).max(1);
    let mut one = [0u8; 1];
    let mut n = 0;
    let mut off = 0;
    while off < buf.len() {
        if buf.read(off, &mut one).is_ok() && one[0] == byte {
            n += 1;
        }
        off += step;
    }
    n
}

#[test]
fn release_in_prog_lets_old_bytes_land_in_new_tenant() {
    let Some(lib) = common::library_or_skip("release_in_prog_lets_old_bytes_land_in_new_tenant") else {
        return;
    };
    // Over loopback TCP the write is asynchronous and slow enough to catch in
    // flight; UCX's default picks CMA in one process, which finishes inside post.
    if std::env::var_os("UCX_TLS").is_none() {
        std::env::set_var("UCX_TLS", "tcp");
    }
    let mib: usize = std::env::var("KVT_HAZARD_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let len = mib << 20;
    let mut src = HostBuffer::new(len).expect("src");
    let mut slot = HostBuffer::new(len).expect("slot");
    src.fill(OLD);

    // Both agents run NIXL's progress thread, as serving processes do: the
    // initiator's keeps pushing the released request, the target's applies it.
    let cfg = AgentConfig { progress_thread: true, ..AgentConfig::default() };
    let ini = Agent::new(&lib, &common::unique("hz-ini"), &cfg).expect("agent");
    let tgt = Agent::new(&lib, &common::unique("hz-tgt"), &cfg).expect("agent");
    let ib = ini.create_backend("UCX", &[]).expect("ucx");
    let tb = tgt.create_backend("UCX", &[]).expect("ucx");
    // SAFETY: the buffers outlive the registrations (leaked below if the NIC may
    // still write them, together with the buffers).
    let sreg = unsafe { ini.register_mem(&[src.region()], Some(&ib)) }.expect("reg");
    // SAFETY: as above.
    let treg = unsafe { tgt.register_mem(&[slot.region()], Some(&tb)) }.expect("reg");
    let tname = ini.load_remote_metadata(&tgt.local_metadata().unwrap()).unwrap();
    let iname = tgt.load_remote_metadata(&ini.local_metadata().unwrap()).unwrap();

    let mut req = ini
        .create_xfer(XferOp::Write, &[src.region()], &[slot.region()], &tname, Some(b"old tenant done"), Some(&ib))
        .expect("create");
    let t0 = Instant::now();
    let posted = req.post().expect("post");
    let before_release = req.status().expect("status");
    eprintln!("hazard: {mib} MiB WRITE posted: {posted:?}, status before release: {before_release:?}");
    if before_release == XferState::Done {
        eprintln!("hazard NOT reproduced: the write finished before it could be released");
        drop(req);
        return;
    }
    // The raw release: NIXL says success although the request is in progress.
    let released = req.release();
    let release_at = t0.elapsed();
    assert!(
        released.is_ok(),
        "release_xfer_req on an IN_PROG request failed: {:?}",
        released.as_ref().err().map(|(_, e)| *e)
    );
    let landed_at_release = sample(&slot, OLD);

    // The slot goes back to the pool at once and a new tenant fills it.
    slot.fill(NEW);
    let filled_at = t0.elapsed();

    // Watch, bounded in count and time, until the old bytes stop changing.
    let mut last = usize::MAX;
    let mut stable_since = Instant::now();
    let mut samples = 0u32;
    let mut last_change = Duration::ZERO;
    let mut late = 0usize;
    let watch = Instant::now();
    while samples < 2_000 && watch.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
        late = sample(&slot, OLD);
        samples += 1;
        if late != last {
            last = late;
            last_change = t0.elapsed();
            stable_since = Instant::now();
        } else if stable_since.elapsed() > Duration::from_millis(500) {
            break;
        }
    }
    let sampled = late;
    let watched = watch.elapsed();
    let late = count(&slot, OLD);
    let notifs = tgt.get_notifs().expect("notifs");
    let got_notif = notifs.iter().any(|n| n.agent == iname && n.msg == b"old tenant done");
    eprintln!(
        "hazard: released IN_PROG at {:?} ({} of 65536 samples had landed); new tenant filled at {:?}; \
         old bytes last seen arriving at {:?}; after {:?} ({} samples): {} OLD bytes overwrote the new tenant ({:.1}% of the slot); \
         notification received: {}",
        release_at,
        landed_at_release,
        filled_at,
        last_change,
        watched,
        sampled,
        late,
        100.0 * late as f64 / len as f64,
        got_notif
    );
    assert!(late > 0, "hazard not reproduced: no old bytes landed after release (see the figures above)");
    assert!(!got_notif, "the released request's notification arrived");

    // Teardown: the old request can no longer be observed (it was released), so if
    // bytes were still changing at the end, keep everything alive for the process.
    if stable_since.elapsed() <= Duration::from_millis(500) {
        eprintln!("hazard: writes still changing at the end: leaking agents and buffers");
        sreg.leak();
        treg.leak();
        std::mem::forget(src);
        std::mem::forget(slot);
        std::mem::forget(Arc::clone(&ini));
        std::mem::forget(Arc::clone(&tgt));
    }
}

/// The engine's drop never releases a request still in flight: with no drain time
/// it leaks the request and its agent (the agent's reference count stays above one)
/// and the write runs to its end. Its notification is not sent, since nobody polls
/// the leaked request any more.
#[test]
fn engine_drop_with_in_flight_request_leaks_instead_of_releasing() {
    use backend_nixl::engine::{create_and_post, EngineConfig, NixlEngine, RealNixlEngine, XferSpec};
    let Some(lib) = common::library_or_skip("engine_drop_with_in_flight_request") else {
        return;
    };
    if std::env::var_os("UCX_TLS").is_none() {
        std::env::set_var("UCX_TLS", "tcp");
    }
    let len = 128 << 20;
    let mut src = HostBuffer::new(len).expect("src");
    let dst = HostBuffer::new(len).expect("dst");
    src.fill(OLD);
    let mut icfg = EngineConfig::ucx(common::unique("drop-ini"));
    icfg.drain_on_drop = Duration::ZERO;
    let ini = RealNixlEngine::with_library(&lib, icfg).expect("ini");
    let tgt = RealNixlEngine::with_library(&lib, EngineConfig::ucx(common::unique("drop-tgt"))).expect("tgt");
    // SAFETY: both buffers are leaked below if the initiator was leaked, and
    // otherwise outlive both engines.
    unsafe { ini.register_mem(&[src.region()]) }.expect("reg");
    // SAFETY: as above.
    unsafe { tgt.register_mem(&[dst.region()]) }.expect("reg");
    let tname = ini.load_remote_metadata(&tgt.local_metadata().unwrap()).unwrap();
    let iname = tgt.load_remote_metadata(&ini.local_metadata().unwrap()).unwrap();
    let spec = XferSpec {
        op: XferOp::Write,
        local: vec![src.region()],
        remote: vec![dst.region()],
        remote_agent: tname,
        notif: Some(b"dropped initiator".to_vec()),
    };
    let (id, st) = create_and_post(&ini, &spec).expect("post");
    let agent = std::sync::Arc::clone(ini.agent());
    let live_at_drop = ini.xfer_status(id).expect("status") == XferState::InProgress;
    drop(ini); // never released early: leaked with its agent if still in flight
    let leaked = std::sync::Arc::strong_count(&agent) > 1;
    let full = common::bounded(2_000, Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(10));
        (sample(&dst, OLD) == 65_536).then_some(())
    });
    let got_notif = common::bounded(200, Duration::from_secs(5), || {
        tgt.get_notifs().ok()?.iter().any(|n| n.agent == iname && n.msg == b"dropped initiator").then_some(())
    })
    .is_some();
    let landed = count(&dst, OLD);
    eprintln!(
        "drop: state at post {st:?}; in flight at drop: {live_at_drop}; agent leaked: {leaked}; \
         {landed} of {len} bytes landed; notification received: {got_notif}"
    );
    if live_at_drop {
        assert!(leaked, "an in-flight request was released by the engine's drop");
    }
    assert!(full.is_some() && landed == len, "the write was cut short");
    // The initiator (if leaked) may still reference both buffers.
    std::mem::forget(src);
    std::mem::forget(dst);
    std::mem::forget(tgt);
}
