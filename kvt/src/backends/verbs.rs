//! The verbs adapter on a real verbs device (Soft-RoCE in the lab's guest):
//! an initiator and a target `VerbsTransfer` on one device, connected over
//! the loopback side channel. The measured loop posts without DONE and
//! reuses the same exposed slots; at teardown the target aborts the
//! exposure and its ladder revokes it (`LOCAL_INV` of each slot's window).

use super::{connect, Pair, Rig};
use anyhow::Context;
use backend_verbs::{LabEnv, VerbsConfig, VerbsTransfer};
use std::sync::Arc;
use std::time::Duration;

pub fn rig(slots: usize, block: usize, placement: super::Placement) -> anyhow::Result<Rig> {
    let env = LabEnv::from_env();
    let side = |name: &str| {
        VerbsTransfer::new(VerbsConfig::new(format!("kvt-{name}-{}", std::process::id()), &env.device, env.gid_index))
            .with_context(|| format!("the verbs backend on device {} (GID index {})", env.device, env.gid_index))
    };
    let init = side("initiator")?;
    let target = side("target")?;
    let Pair { pool, target_pool: tpool, exposed, remote } = connect(&init, &target, slots, block, placement)?;
    let transfer: Arc<VerbsTransfer> = Arc::new(init);
    let keep = transfer.clone();
    let teardown = Box::new(move || {
        exposed.abort();
        // The revoke is a local invalidation per slot.
        super::await_settled(&tpool, "verbs", "not revoked", Duration::from_secs(10));
        drop(target);
        drop(keep);
    });
    Ok(Rig { backend: "verbs", transfer, pool, remote, teardown })
}
