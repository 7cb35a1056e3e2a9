//! The Mooncake adapter: our `MooncakeTransfer` as target and as initiator,
//! each over its own `MooncakeEngine`, on loopback TCP (protocol v2).
//!
//! The measured loop posts without completion notifications and reuses the
//! same remote slots, so the target's exposure is settled at teardown by
//! the drain path: the target aborts it and sends ABORT; the initiator's
//! adapter answers ABORT_ACK once every task it ran on those slots is
//! finished, which is the `Completed` proof.

use super::{connect, Pair, Rig};
use anyhow::bail;
use backend_mooncake::{
    AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer, ProtoVersion, TcpTransportConfig,
};
use std::sync::Arc;
use std::time::Duration;

/// Longest wait at teardown for the initiator's ABORT_ACK.
const SETTLE_WAIT: Duration = Duration::from_secs(10);

fn side(workers: usize, drivers: usize) -> anyhow::Result<MooncakeTransfer> {
    let cfg = EngineConfig {
        local_host: "127.0.0.1".into(),
        tcp: TcpTransportConfig { workers, ..TcpTransportConfig::default() },
        ..EngineConfig::default()
    };
    let engine = MooncakeEngine::new(cfg)?;
    Ok(MooncakeTransfer::new(Arc::new(engine), AdapterConfig { drivers, ..AdapterConfig::default() })?)
}

pub fn rig(slots: usize, block: usize, placement: super::Placement) -> anyhow::Result<Rig> {
    if slots == 0 || block == 0 {
        bail!("the mooncake rig needs at least one slot of at least one byte");
    }
    // The initiator's shape as the adapter's own bench runs it.
    let init = side(8, 4)?;
    let target = side(2, 1)?;
    let Pair { pool, target_pool: tpool, exposed, remote } = connect(&init, &target, slots, block, placement)?;
    if exposed.peer().and_then(|p| target.peer_proto(p)) != Some(ProtoVersion::V2) {
        bail!("the initiator does not speak Mooncake TCP protocol v2");
    }
    let transfer: Arc<MooncakeTransfer> = Arc::new(init);
    let keep = transfer.clone();
    let teardown = Box::new(move || {
        // ABORT / ABORT_ACK: the initiator acks once its tasks on these slots
        // are finished (they are: the loop waited for every handle).
        exposed.abort();
        super::await_settled(&tpool, "mooncake", "no ABORT_ACK", SETTLE_WAIT);
        drop(target);
        drop(keep);
    });
    Ok(Rig { backend: "mooncake", transfer, pool, remote, teardown })
}
