//! The NIXL backend: two agents of the real library (UCX on host memory) in
//! this process, each behind our adapter ([`NixlTransfer`]).
//!
//! The initiator keeps completed requests for re-posting (the adapter's request
//! cache, one entry per slot): the measured loop posts the same local lease to
//! the same remote slot over and over without notifications, so after the first
//! round every post re-posts a terminal request instead of creating one. The
//! transport is whatever UCX picks (`UCX_TLS` is left to the caller: on one host
//! the default completes writes inside the post, `UCX_TLS=tcp` makes them
//! asynchronous over loopback TCP).

use super::{connect, Pair, Rig};
use anyhow::Context;
use backend_nixl::{AdapterConfig, NixlTransfer};
use kv_transfer_core::Transfer;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long teardown waits for the exposure to settle and for each side to shut down.
const TEARDOWN: Duration = Duration::from_secs(5);

/// Builds an initiator and a target agent in this process, connected, with the
/// target's exposure of exactly `slots` slots of `block` bytes to the initiator.
///
/// A missing library is an error naming what to install.
pub fn rig(slots: usize, block: usize, placement: super::Placement) -> anyhow::Result<Rig> {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let tag = format!("{}-{n}", std::process::id());
    let target = NixlTransfer::new_real(&format!("kvt-target-{tag}"), AdapterConfig::default())
        .context("kvt bench --backend nixl: cannot start the target agent")?;
    let init_cfg = AdapterConfig { request_cache: slots.max(1), ..AdapterConfig::default() };
    let init = Arc::new(
        NixlTransfer::new_real(&format!("kvt-initiator-{tag}"), init_cfg)
            .context("kvt bench --backend nixl: cannot start the initiator agent")?,
    );
    let Pair { pool: ipool, target_pool: tpool, exposed, remote } =
        connect(init.as_ref(), &target, slots, block, placement)?;
    let transfer: Arc<dyn Transfer> = init.clone();
    let teardown = Box::new(move || {
        // The loop posts without notifications, so no WRITE settles the exposure:
        // abort it; the initiator acknowledges (ABORT_ACK) once every request of it
        // on these slots is terminal, which settles them (`Completed`).
        exposed.abort();
        super::await_settled(&tpool, "nixl", "no acknowledgement", TEARDOWN);
        // The initiator first: its kept requests are released before the target
        // deregisters the memory they name.
        let ri = init.shutdown(TEARDOWN);
        let rt = target.shutdown(TEARDOWN);
        if ri.leaked + rt.leaked > 0 {
            eprintln!("nixl teardown: leaked registrations (initiator {ri:?}, target {rt:?})");
        }
    });
    Ok(Rig { backend: "nixl", transfer, pool: ipool, remote, teardown })
}
