//! Property tests of the drain protocol's control-message codec
//! ([`ControlMessage`]): every message round-trips in both forms, no input
//! makes a decoder panic, whatever decodes re-encodes to the very same bytes,
//! and no strict prefix of a valid encoding decodes.
#![cfg(not(loom))]

use kv_transfer_core::drain::{
    ControlKind, ControlMessage, DecodeError, Digest, ExposureToken, DIGEST_LEN, HEADER_LEN, MAGIC, MAX_LEN,
    MAX_TENANCIES, TEXT_PREFIX, VERSION,
};
use kv_transfer_core::{Generation, PoolId, SlotId, Tenancy};
use proptest::collection::vec;
use proptest::prelude::*;

fn kind() -> impl Strategy<Value = ControlKind> {
    prop_oneof![Just(ControlKind::Done), Just(ControlKind::Abort), Just(ControlKind::AbortAck)]
}

/// Mostly a few tenancies, sometimes a medium count, sometimes exactly the maximum.
fn count() -> impl Strategy<Value = usize> {
    prop_oneof![12 => 1..=8usize, 3 => 9..=64usize, 1 => Just(MAX_TENANCIES)]
}

/// Any valid message: every kind, 1..=MAX_TENANCIES tenancies, digests
/// (one per tenancy) only on DONE, and only when `with_digests`.
fn message_with(counts: BoxedStrategy<usize>) -> impl Strategy<Value = ControlMessage> {
    (kind(), any::<u64>(), any::<[u8; 16]>(), counts, any::<bool>()).prop_flat_map(
        |(kind, pool, token, n, with_digests)| {
            let digests = if with_digests && kind == ControlKind::Done { n } else { 0 };
            (vec((any::<u32>(), any::<u64>()), n), vec(any::<[u8; 16]>(), digests)).prop_map(move |(ts, digests)| {
                ControlMessage {
                    kind,
                    pool: PoolId(pool),
                    token: ExposureToken::from_bytes(token),
                    tenancies: ts.into_iter().map(|(s, g)| Tenancy::new(SlotId(s), Generation(g))).collect(),
                    digests: digests.into_iter().map(Digest).collect(),
                }
            })
        },
    )
}

fn message() -> impl Strategy<Value = ControlMessage> {
    message_with(count().boxed())
}

/// Small messages only (the prefix test decodes every prefix).
fn small_message() -> impl Strategy<Value = ControlMessage> {
    message_with((1..=6usize).boxed())
}

/// Bytes that look like a header often enough to reach the deep checks.
fn near_miss_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..256),
        vec(any::<u8>(), 0..256).prop_map(|tail| [&MAGIC[..], &tail].concat()),
        (0..4u8, 0..3u8, 0..4u16, vec(any::<u8>(), 0..128)).prop_map(|(kind, flags, n, tail)| {
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&[VERSION, kind, flags, 0]);
            b.extend_from_slice(&[0u8; 24]);
            b.extend_from_slice(&n.to_le_bytes());
            b.extend_from_slice(&tail);
            b
        }),
    ]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A decoded message re-encodes to exactly the bytes it came from.
fn assert_canonical_binary(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(m) = ControlMessage::decode(bytes) {
        prop_assert_eq!(m.encode().expect("a decoded message encodes"), bytes.to_vec());
    }
    Ok(())
}

fn assert_canonical_text(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(m) = ControlMessage::decode_text(bytes) {
        prop_assert_eq!(m.encode_text().expect("a decoded message encodes").into_bytes(), bytes.to_vec());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn codec_round_trips_every_message(m in message()) {
        let bin = m.encode().expect("a valid message encodes");
        prop_assert_eq!(bin.len(), m.encoded_len());
        prop_assert!(bin.len() <= MAX_LEN);
        prop_assert_eq!(ControlMessage::decode(&bin), Ok(m.clone()));
        let text = m.encode_text().expect("a valid message encodes as text");
        prop_assert!(text.starts_with(TEXT_PREFIX));
        prop_assert_eq!(text.len(), TEXT_PREFIX.len() + 2 * bin.len());
        prop_assert_eq!(ControlMessage::decode_text(text.as_bytes()), Ok(m));
    }

    #[test]
    fn codec_never_panics_on_arbitrary_bytes(bytes in near_miss_bytes()) {
        assert_canonical_binary(&bytes)?;
        assert_canonical_text(&bytes)?;
        // The same bytes behind the text prefix, raw and armored.
        let raw = [TEXT_PREFIX.as_bytes(), &bytes].concat();
        assert_canonical_text(&raw)?;
        let armored = format!("{TEXT_PREFIX}{}", hex(&bytes));
        assert_canonical_text(armored.as_bytes())?;
        prop_assert_eq!(
            ControlMessage::decode_text(armored.as_bytes()).ok(),
            ControlMessage::decode(&bytes).ok(),
            "the armor changes nothing about what decodes"
        );
    }

    #[test]
    fn codec_never_panics_on_arbitrary_text(s in "kvt2 [0-9a-fA-F]{0,160}|[ -~]{0,64}") {
        assert_canonical_text(s.as_bytes())?;
    }

    #[test]
    fn codec_mutated_encodings_decode_canonically_or_fail(
        m in small_message(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        extra in vec(any::<u8>(), 0..20),
    ) {
        let mut bin = m.encode().unwrap();
        for (at, byte) in edits {
            let i = at.index(bin.len());
            bin[i] = byte;
        }
        assert_canonical_binary(&bin)?;
        assert_canonical_text(format!("{TEXT_PREFIX}{}", hex(&bin)).as_bytes())?;
        let cut = cut.index(bin.len() + 1);
        let mut other = bin[..cut].to_vec();
        other.extend_from_slice(&extra);
        assert_canonical_binary(&other)?;
    }

    #[test]
    fn codec_rejects_every_strict_prefix_of_a_valid_encoding(m in small_message()) {
        let bin = m.encode().unwrap();
        for len in 0..bin.len() {
            match ControlMessage::decode(&bin[..len]) {
                Err(DecodeError::Foreign) => prop_assert!(len < MAGIC.len(), "prefix of {} bytes called foreign", len),
                Err(DecodeError::Truncated { needed, got }) => {
                    prop_assert!(len >= MAGIC.len());
                    prop_assert_eq!(got, len);
                    prop_assert!(needed > len);
                    prop_assert!(needed == HEADER_LEN || needed == bin.len());
                }
                other => prop_assert!(false, "prefix of {} bytes decoded as {:?}", len, other),
            }
        }
        let text = m.encode_text().unwrap();
        for len in 0..text.len() {
            prop_assert!(
                ControlMessage::decode_text(&text.as_bytes()[..len]).is_err(),
                "text prefix of {} bytes decoded",
                len
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// The largest message, every kind, with and without digests.
    #[test]
    fn codec_round_trips_at_max_tenancies(m in message_with(Just(MAX_TENANCIES).boxed())) {
        let bin = m.encode().unwrap();
        prop_assert_eq!(bin.len(), HEADER_LEN + MAX_TENANCIES * if m.digests.is_empty() { 12 } else { 12 + DIGEST_LEN });
        prop_assert_eq!(ControlMessage::decode(&bin), Ok(m.clone()));
        prop_assert_eq!(ControlMessage::decode_text(m.encode_text().unwrap().as_bytes()), Ok(m));
    }
}
