// A lease moved into a transfer is gone until the completion gives it back.
use kv_transfer_core::*;

async fn post(t: &dyn Transfer, lease: SlotLease<Reserved>, remote: RemoteSlots) {
    let _handle = t.write(lease, &remote, TransferOptions::default()).await;
    lease.release();
}

fn main() {
    let _ = post;
}
