// An application cannot expose a lease by itself: only the backend's
// settlement authority (or its `Target::expose`) can.
use kv_transfer_core::*;
use std::sync::Arc;

fn main() {
    let (pool, _authority) = SlotPool::new(Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(1024)).unwrap();
    let _ = pool.reserve(1).unwrap().expose(PeerId(1), 1, "peer", Default::default());
}
