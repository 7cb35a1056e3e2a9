//! The TCP simulator: two NICs on loopback.

use super::Rig;
use crate::bench::register;
use anyhow::anyhow;
use backend_tcp_sim::{NicConfig, SimNic};
use std::sync::Arc;
use std::time::Duration;

pub fn rig(slots: usize, block: usize) -> anyhow::Result<Rig> {
    let target = SimNic::start(NicConfig::new("kvt-target"))?;
    let tpool = register(&target, slots, block)?;
    let init = SimNic::start(NicConfig::new("kvt-initiator"))?;
    let pool = register(&init, slots, block)?;
    init.connect(target.endpoint())?;
    let peer = target
        .wait_for_peer("kvt-initiator", Duration::from_secs(5))
        .ok_or_else(|| anyhow!("the initiator did not connect"))?;
    let (exposed, remote) = target.expose(tpool.reserve(slots)?, peer).map_err(|e| anyhow!("{}", e.kind))?;
    let teardown = Box::new(move || {
        // The loop posts without notifications; revoking settles the exposure.
        target.revoke(&exposed);
        if let Ok(s) = exposed.try_settled() {
            s.release();
        }
    });
    Ok(Rig { backend: "tcp-sim", transfer: Arc::new(init), pool, remote, teardown })
}
