// An exposed lease cannot be released: a NIC may still write into it.
use kv_transfer_core::*;
use std::sync::Arc;

fn main() {
    let (pool, _a) = SlotPool::new(Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(1024)).unwrap();
    let (exposed, _remote) = _a.expose(pool.reserve(1).unwrap(), PeerId(1), 1, "peer", Default::default());
    exposed.release();
}
