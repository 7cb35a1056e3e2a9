//! MORI-IO semantics on the TCP simulator's fabric: an initiator and a
//! target `MoriTransfer` over `SimTransport`, so `--backend tcp-sim,mori`
//! shows the adapter's cost over the bare fabric, same loop, same run.

use super::Rig;
use backend_mori::harness::LoopbackRig;
use std::sync::Arc;

pub fn rig(slots: usize, block: usize) -> anyhow::Result<Rig> {
    let r = LoopbackRig::new(slots, block)?;
    Ok(Rig {
        backend: "mori",
        transfer: Arc::new(r.transfer()),
        pool: r.initiator_pool(),
        remote: r.remote().clone(),
        teardown: Box::new(move || r.teardown()),
    })
}
