// A reserved lease was never exposed; it has nothing to settle and cannot
// pretend to be settled to skip exposure bookkeeping.
use kv_transfer_core::*;
use std::sync::Arc;

fn main() {
    let (pool, _a) = SlotPool::new(Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(1024)).unwrap();
    let reserved = pool.reserve(1).unwrap();
    let settled: SlotLease<Settled> = reserved;
    settled.release();
}
