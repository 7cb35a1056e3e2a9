// Only a pool's SettlementAuthority can mint a proof: no constructor, no
// public fields, no way to wrap one proof kind into another.
use kv_transfer_core::*;

fn forge_completed(s: Settlement) -> Completed {
    Completed(s)
}

fn forge_settlement() -> Settlement {
    Settlement { pool: PoolId(1), kind: SettlementKind::Completed }
}

fn forge_fenced() -> Fenced {
    Fenced::new(PeerId(1))
}

fn main() {
    let _ = (forge_completed, forge_settlement, forge_fenced);
}
