//! Unit tests of the adapter's pure pieces: the mapping of a target's
//! refusal to core's typed rejection, and the tag and endpoint encodings.

use kv_transfer_core::{Generation, RejectReason, SlotId, Tenancy, TransferError};

use super::post::to_transfer_error;
use super::wire::{decode_endpoint, encode_endpoint, pack_tag, unpack_tag};
use crate::status::StatusCode;
use crate::types::{EngineKey, MemoryDesc, MemoryLocation};

#[test]
fn rejections_keep_their_reason() {
    let m = "remote operation failed: rejected by the target: stale generation";
    assert_eq!(to_transfer_error(StatusCode::RdmaOp, m.into()), TransferError::Rejected(RejectReason::StaleGeneration));
    let e = to_transfer_error(StatusCode::RdmaOp, "remote operation failed: connection fenced".into());
    assert!(matches!(e, TransferError::Engine { code: 13, .. }));
    let e = to_transfer_error(StatusCode::BadState, "rejected by the target: oversize".into());
    assert!(matches!(e, TransferError::Engine { code: 14, .. }));
}

#[test]
fn tag_round_trip() {
    let t = Tenancy::new(SlotId(u32::MAX), Generation(u64::MAX));
    for settle in [true, false] {
        let tag = pack_tag(7, t, settle);
        assert_eq!(unpack_tag(tag), (settle, 7, t));
    }
}

#[test]
fn endpoint_round_trip() {
    let d = MemoryDesc {
        engine_key: EngineKey::new("de/co:de"),
        id: 3,
        device_id: -1,
        addr: 0x1000,
        size: 4096,
        loc: MemoryLocation::Cpu,
        rkey: 99,
    };
    assert_eq!(decode_endpoint(&encode_endpoint(&d), 99), Some(d));
    assert_eq!(decode_endpoint("tcp://x", 1), None);
    assert_eq!(decode_endpoint("mori:/1/2/3/4/cpu", 1), None);
}
