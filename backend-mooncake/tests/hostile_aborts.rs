//! Hostile peers against the initiator side's abort state (rule 9), with
//! only Mooncake's public wire format: a notification names its sender, so a
//! third party can send ABORTs under the decode's segment name.
//!
//! Attack 1 of the second round: the decode aborts an exposure before the
//! prefill posted, the prefill acks and tombstones it, the slot goes to the
//! next tenant; a flood of ABORTs for made-up tenancies (10x the cap) then
//! used to push the real tombstone out of one shared FIFO, and the prefill's
//! late WRITE of the old descriptor landed in the next tenant's slot.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mooncake::adapter::block_on;
use backend_mooncake::proto::NotifyDesc;
use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer, ReleasePolicy};
use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken};
use kv_transfer_core::{
    Generation, HostRegion, PoolConfig, Region, SlotId, SlotPool, Tenancy, Transfer, TransferOptions,
};

const SLOT: usize = 4096;
const CAP: usize = 64;

struct Side {
    a: MooncakeTransfer,
    pool: SlotPool,
    region: Arc<HostRegion>,
}

fn side(cfg: AdapterConfig) -> Side {
    let e = MooncakeEngine::new(EngineConfig::default()).unwrap();
    let a = MooncakeTransfer::new(Arc::new(e), cfg).unwrap();
    let region = Arc::new(HostRegion::new(SLOT).unwrap());
    let pool = a.register_pool(region.clone(), PoolConfig::new(SLOT)).unwrap();
    Side { a, pool, region }
}

use kv_transfer_testkit::wait::wait_for as wait_until;

fn made_up(i: u64) -> ExposureToken {
    let mut b = [0x3c; 16];
    b[..8].copy_from_slice(&i.to_le_bytes());
    ExposureToken::from_bytes(b)
}

struct Outcome {
    /// Bytes of the aborted request found in the next tenant's slot.
    foreign: usize,
    /// The late post was admitted.
    admitted: bool,
    /// The honest WRITE into the next tenancy settled, and how long it took.
    honest: Duration,
    prefill: Side,
}

fn attack(policy: ReleasePolicy) -> Outcome {
    let prefill = side(AdapterConfig { max_aborted: CAP, release_policy: policy, ..AdapterConfig::default() });
    let decode = side(AdapterConfig::default());
    let peer = decode.a.add_peer(prefill.a.segment_name()).unwrap();
    // The aborted request: exposed, aborted before the prefill posted.
    let (exposed, old) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    exposed.abort();
    wait_until("the prefill's ABORT_ACK frees the slot", Duration::from_secs(10), || decode.pool.metrics().free == 1);
    // The next tenant's exposure of the same slot, live.
    let (next, new) = decode.a.expose(decode.pool.reserve(1).unwrap(), peer).unwrap();
    decode.region.write(0, &[0u8; SLOT]).unwrap();
    // The flood, under the decode's name, from a third party.
    let to: SocketAddr = prefill.a.segment_name().parse().unwrap();
    let before = prefill.a.metrics().aborts_received;
    for i in 0..(10 * CAP) as u64 {
        let t = Tenancy::new(SlotId(1000 + i as u32), Generation(1));
        let abort = ControlMessage::new(ControlKind::Abort, old.pool, made_up(i), vec![t]);
        let n = NotifyDesc { name: decode.a.segment_name().to_string(), notify_msg: abort.encode_text().unwrap() };
        let _ = backend_mooncake::client::send_notify(to, &n, Duration::from_secs(2));
    }
    wait_until("the flood is handled", Duration::from_secs(20), || {
        prefill.a.metrics().aborts_received >= before + (10 * CAP) as u64
    });
    // The prefill's late WRITE of the aborted request's descriptor.
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &[0xAB; SLOT]).unwrap();
    let admitted = match block_on(prefill.a.write(src, &old, TransferOptions::notify(false))) {
        Ok(h) => {
            let out = block_on(h).expect("not abandoned");
            eprintln!("late write: {:?}", out.result);
            out.lease.release();
            true
        }
        Err(e) => {
            e.lease.release();
            false
        }
    };
    let mut slot = vec![0u8; SLOT];
    decode.region.read(0, &mut slot).unwrap();
    let foreign = slot.iter().filter(|b| **b == 0xAB).count();
    // The honest WRITE of the next tenant settles it.
    let t0 = Instant::now();
    let mut src = prefill.pool.reserve(1).unwrap();
    src.write_at(0, 0, &[0x11; SLOT]).unwrap();
    let h = block_on(prefill.a.write(src, &new, TransferOptions::default())).expect("honest post");
    block_on(h).expect("not abandoned").lease.release();
    let settled = block_on(next.settled());
    let honest = t0.elapsed();
    if foreign == 0 {
        assert_eq!(settled.bytes().unwrap(), vec![0x11; SLOT]);
    }
    settled.release();
    Outcome { foreign, admitted, honest, prefill }
}

#[test]
fn hostile_abort_flood_under_the_decodes_name_never_evicts_a_real_tombstone() {
    let o = attack(ReleasePolicy::Safe);
    assert!(!o.admitted, "the late post of an aborted tenancy was admitted after the flood");
    assert_eq!(o.foreign, 0, "foreign bytes in the next tenant's slot");
    assert!(o.honest < Duration::from_secs(5), "the honest write took {:?}", o.honest);
    let m = o.prefill.a.metrics();
    assert!(m.aborts_received >= (10 * CAP) as u64, "{m:?}");
}

#[test]
fn hostile_abort_flood_positive_control_the_shared_fifo_lets_the_late_write_land() {
    let o = attack(ReleasePolicy::Naive);
    assert!(o.admitted, "positive control: the flood should evict the tombstone");
    assert_eq!(o.foreign, SLOT, "positive control: the aborted request's bytes in the next tenant's slot");
}
