//! The TCP simulator: two NICs on loopback.

use super::{connect, Pair, Rig};
use backend_tcp_sim::{NicConfig, SimNic};
use std::sync::Arc;

pub fn rig(slots: usize, block: usize, placement: super::Placement) -> anyhow::Result<Rig> {
    let target = SimNic::start(NicConfig::new("kvt-target"))?;
    let init = SimNic::start(NicConfig::new("kvt-initiator"))?;
    let Pair { pool, exposed, remote, .. } = connect(&init, &target, slots, block, placement)?;
    let teardown = Box::new(move || {
        // The loop posts without notifications; revoking settles the exposure.
        target.revoke(&exposed);
        if let Ok(s) = exposed.try_settled() {
            s.release();
        }
    });
    Ok(Rig { backend: "tcp-sim", transfer: Arc::new(init), pool, remote, teardown })
}
