//! Property tests of the frame codec: random bytes never panic the decoder,
//! and every encodable frame round-trips. (The `fuzz/` crate drives the same
//! decoder with libFuzzer.)

use backend_tcp_sim::wire::{self, AccessHeader, Body, WireStatus};
use kv_transfer_core::drain::{ControlKind, ControlMessage, ExposureToken};
use kv_transfer_core::{Generation, PoolId, RejectReason, SlotId, Tenancy};
use proptest::prelude::*;

fn status() -> impl Strategy<Value = WireStatus> {
    prop_oneof![
        Just(WireStatus::Ok),
        Just(WireStatus::TargetError),
        prop_oneof![
            Just(RejectReason::OutOfBounds),
            Just(RejectReason::UnknownKey),
            Just(RejectReason::StaleGeneration),
            Just(RejectReason::ZeroLength),
            Just(RejectReason::Oversize),
        ]
        .prop_map(WireStatus::Rejected),
    ]
}

fn control() -> impl Strategy<Value = ControlMessage> {
    let kind = prop_oneof![Just(ControlKind::Done), Just(ControlKind::Abort), Just(ControlKind::AbortAck)];
    (kind, any::<u64>(), any::<[u8; 16]>(), prop::collection::vec((any::<u32>(), any::<u64>()), 1..40)).prop_map(
        |(kind, pool, token, ts)| {
            let ts = ts.into_iter().map(|(s, g)| Tenancy::new(SlotId(s), Generation(g))).collect();
            ControlMessage::new(kind, PoolId(pool), ExposureToken::from_bytes(token), ts)
        },
    )
}

fn body() -> impl Strategy<Value = (Body, usize)> {
    let hdr = (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u64>(), 0u32..5000).prop_map(
        |(wr_id, key, addr, slot, g, len)| AccessHeader {
            wr_id,
            key,
            addr,
            slot: SlotId(slot),
            generation: Generation(g),
            len,
        },
    );
    prop_oneof![
        ("[a-z0-9:.]{0,40}", "[a-z0-9:.]{0,40}").prop_map(|(name, endpoint)| (Body::Hello { name, endpoint }, 0)),
        hdr.clone().prop_map(|h| (Body::Write(h), h.len as usize)),
        hdr.prop_map(|h| (Body::Read(h), 0)),
        (any::<u64>(), status(), 0usize..3000).prop_map(|(wr_id, status, n)| {
            let n = if status == WireStatus::Ok { n } else { 0 };
            (Body::ReadResp { wr_id, status }, n)
        }),
        (any::<u64>(), status()).prop_map(|(wr_id, status)| (Body::Completion { wr_id, status }, 0)),
        control().prop_map(|m| (Body::Control(m), 0)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(d) = wire::decode(&bytes) {
            prop_assert!(d.consumed <= bytes.len());
            prop_assert!(d.consumed >= wire::PREFIX_LEN);
        }
    }

    #[test]
    fn valid_prefix_random_rest_never_panics(kind in 0u8..10, len in 0u32..200, rest in prop::collection::vec(any::<u8>(), 0..250)) {
        let mut b = vec![0x56, 0x4B, kind, 0];
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&rest);
        if let Ok(d) = wire::decode(&b) {
            prop_assert_eq!(d.consumed, 8 + len as usize);
        }
    }

    #[test]
    fn frames_round_trip((body, pl) in body(), fill in any::<u8>()) {
        let mut buf = wire::encode_head(&body, pl).unwrap();
        buf.extend_from_slice(&vec![fill; pl]);
        buf.extend_from_slice(b"trailing");
        let d = wire::decode(&buf).unwrap();
        prop_assert_eq!(&d.body, &body);
        prop_assert_eq!(d.payload.len(), pl);
        prop_assert_eq!(d.consumed, buf.len() - 8);
        // Every strict prefix is an error, never a panic.
        for cut in [0, 1, 7, 8, 9, d.consumed / 2, d.consumed - 1] {
            prop_assert!(wire::decode(&buf[..cut.min(d.consumed - 1)]).is_err());
        }
    }
}
