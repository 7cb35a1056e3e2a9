//! The adapter over the real library: two agents in one process, UCX on host
//! memory (`UCX_TLS=tcp` unless set), byte-checked WRITE and READ settled by the
//! adapter's notifications, an abort while a write is in flight, and teardown.
//! Runs once with NIXL's progress thread, and once with the adapter's driver as the
//! only progress and the request cache on.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_nixl::adapter::{AdapterConfig, NixlTransfer, Progress};
use futures::executor::block_on;
use kv_transfer_core::drain::ControlKind;
use kv_transfer_core::{Exposed, HostRegion, PoolConfig, Region, Settled, SlotLease, Transfer, TransferOptions};

const SLOT: usize = 256 << 10;

fn settle(mut e: SlotLease<Exposed>, limit: Duration) -> SlotLease<Settled> {
    let start = Instant::now();
    loop {
        match e.try_settled() {
            Ok(s) => return s,
            Err(back) => {
                assert!(start.elapsed() < limit, "exposure not settled within {limit:?}");
                e = back;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn scenario(progress: Progress, request_cache: usize) {
    // Once, before any agent of this process exists (the tests run in parallel).
    static TLS: std::sync::Once = std::sync::Once::new();
    TLS.call_once(|| {
        if std::env::var_os("UCX_TLS").is_none() {
            std::env::set_var("UCX_TLS", "tcp");
        }
    });
    let cfg = AdapterConfig { progress, request_cache, ..AdapterConfig::default() };
    let ini = NixlTransfer::new_real(&common::unique("ad-ini"), cfg.clone()).expect("initiator");
    let tgt = NixlTransfer::new_real(&common::unique("ad-tgt"), cfg).expect("target");
    let src = ini.register_pool(Arc::new(HostRegion::new(8 * SLOT).unwrap()), PoolConfig::new(SLOT)).expect("src pool");
    let dst_region = Arc::new(HostRegion::new(8 * SLOT).unwrap());
    let dst = tgt.register_pool(dst_region.clone(), PoolConfig::new(SLOT)).expect("dst pool");
    let to_tgt = ini.add_peer(&tgt.local_metadata().unwrap()).expect("add target");
    let to_ini = tgt.add_peer(&ini.local_metadata().unwrap()).expect("add initiator");

    // WRITE 4 slots, settled on the target by the W notification.
    let (exposed, remote) = tgt.expose(dst.reserve(4).unwrap(), to_ini).expect("expose");
    let mut lease = src.reserve(4).unwrap();
    for i in 0..4 {
        lease.write_at(i, 0, &common::pattern(SLOT, 10 + i as u8)).unwrap();
    }
    // Layer-wise: three writes without notification (re-posted from the request
    // cache when it is on), then the notifying one.
    for _ in 0..3 {
        let h = block_on(ini.write(lease, &remote, TransferOptions::notify(false))).expect("post write");
        let out = block_on(h).expect("not abandoned");
        assert_eq!(out.result, Ok(()));
        lease = out.lease.into_reserved();
    }
    assert_eq!(ini.metrics().reposted, if request_cache > 0 { 2 } else { 0 });
    let h = block_on(ini.write(lease, &remote, TransferOptions::default())).expect("post write");
    let out = block_on(h).expect("not abandoned");
    assert_eq!(out.result, Ok(()));
    let written = settle(exposed, Duration::from_secs(20));
    for i in 0..4 {
        let mut got = vec![0u8; SLOT];
        written.read_at(i, 0, &mut got).unwrap();
        assert!(got == common::pattern(SLOT, 10 + i as u8), "WRITE slot {i} differs");
    }
    written.release();

    // READ 4 slots the target filled, settled on the target by the R notification.
    let mut r = dst.reserve(4).unwrap();
    for i in 0..4 {
        r.write_at(i, 0, &common::pattern(SLOT, 50 + i as u8)).unwrap();
    }
    let (exposed, remote) = tgt.expose(r, to_ini).expect("expose");
    let h = block_on(ini.read(out.lease.into_reserved(), &remote, TransferOptions::default())).expect("post read");
    let out = block_on(h).expect("not abandoned");
    assert_eq!(out.result, Ok(()));
    for i in 0..4 {
        let mut got = vec![0u8; SLOT];
        out.lease.read_at(i, 0, &mut got).unwrap();
        assert!(got == common::pattern(SLOT, 50 + i as u8), "READ slot {i} differs");
    }
    settle(exposed, Duration::from_secs(20)).release();
    let kinds: Vec<ControlKind> = tgt.take_events().iter().map(|e| e.kind).collect();
    assert_eq!(kinds, vec![ControlKind::Done, ControlKind::Done]);

    // Abort while a write is in flight: the slots come back only once nothing can
    // land any more, so every byte of the write is there when they do.
    let (exposed, remote) = tgt.expose(dst.reserve(8).unwrap(), to_ini).expect("expose");
    let mut lease = out.lease.into_reserved();
    for i in 0..4 {
        lease.write_at(i, 0, &[0xC3; SLOT]).unwrap();
    }
    let mut lease2 = src.reserve(4).unwrap();
    for i in 0..4 {
        lease2.write_at(i, 0, &[0xC3; SLOT]).unwrap();
    }
    // Two requests, 4 remote slots each; the first handle is cancelled and dropped,
    // then the target aborts the whole exposure while both may be in flight.
    let mut r1 = remote.clone();
    r1.slots.truncate(4);
    let mut r2 = remote.clone();
    r2.slots.drain(..4);
    let h1 = block_on(ini.write(lease, &r1, TransferOptions::notify(false))).expect("post");
    let h2 = block_on(ini.write(lease2, &r2, TransferOptions::notify(false))).expect("post");
    h1.cancel();
    drop(h1);
    exposed.abort();
    let start = Instant::now();
    while dst.metrics().free < 8 {
        assert!(start.elapsed() < Duration::from_secs(20), "aborted slots never came back");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut all = vec![0u8; 8 * SLOT];
    dst_region.read(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0xC3), "slots returned before every byte of the aborted writes landed");
    let out2 = block_on(h2).expect("not abandoned");
    assert_eq!(out2.result, Ok(()));
    out2.lease.release();
    let tm = tgt.metrics();
    let im = ini.metrics();
    assert!(tm.aborts_sent >= 1 && im.aborts_received >= 1 && im.acks_sent >= 1, "{tm:?} {im:?}");
    assert_eq!(dst.metrics().quarantined, 0);

    // Teardown in order: nothing outstanding, so both succeed and deregister.
    let start = Instant::now();
    while src.metrics().free < 8 {
        assert!(start.elapsed() < Duration::from_secs(10), "source leases never came back");
        std::thread::sleep(Duration::from_millis(1));
    }
    ini.remove_peer(to_tgt, Duration::from_secs(5)).expect("remove target");
    tgt.remove_peer(to_ini, Duration::from_secs(5)).expect("remove initiator");
    let ri = ini.shutdown(Duration::from_secs(5));
    let rt = tgt.shutdown(Duration::from_secs(5));
    assert_eq!((ri.deregistered, ri.leaked), (1, 0), "{ri:?}");
    assert_eq!((rt.deregistered, rt.leaked), (1, 0), "{rt:?}");
}

#[test]
fn two_agents_one_process_agent_progress_thread() {
    if common::library_or_skip("two_agents_one_process_agent_progress_thread").is_none() {
        return;
    }
    scenario(Progress::AgentThread, 0);
}

#[test]
fn two_agents_one_process_driver_progress_request_cache() {
    if common::library_or_skip("two_agents_one_process_driver_progress_request_cache").is_none() {
        return;
    }
    // With the request cache on: teardown must release the kept requests first,
    // or the engine refuses to invalidate and deregister.
    scenario(Progress::Driver, 8);
}
