//! The one control-message codec: DONE, ABORT and ABORT_ACK, as every
//! backend exchanges them.
//!
//! Binary, little-endian, versioned and bounded; the same bytes travel in a
//! simulator frame, a MORI message, and (armored as text by
//! [`ControlMessage::encode_text`]) in a NIXL or Mooncake notification.
//!
//! ```text
//! offset size field
//!      0    4 magic "KVTC"
//!      4    1 version (2)
//!      5    1 kind: 1 DONE, 2 ABORT, 3 ABORT_ACK
//!      6    1 flags: bit 0 = a 16-byte MAC follows each tenancy; other bits 0
//!      7    1 reserved, 0
//!      8    8 pool id (the exposing side's pool)
//!     16   16 exposure token (see [`ExposureToken`])
//!     32    2 count of tenancies, 1..=MAX_TENANCIES
//!     34      count × { slot u32, generation u64 [, mac [u8; 16]] }
//! ```
//!
//! Decoding never panics and rejects every malformed input with a typed
//! [`DecodeError`]: a short or long buffer, an unknown version, kind or flag,
//! a non-zero reserved byte, zero or too many tenancies.

use crate::ids::{Generation, PoolId, SlotId, Tenancy};
use std::fmt;

/// First four bytes of every control message.
pub const MAGIC: [u8; 4] = *b"KVTC";
/// The codec version this build writes and reads.
pub const VERSION: u8 = 2;
/// Most tenancies one message carries (a larger exposure is sent in chunks).
pub const MAX_TENANCIES: usize = 1024;
/// Bytes before the first tenancy.
pub const HEADER_LEN: usize = 34;
/// Prefix of the text armor ([`ControlMessage::encode_text`]).
pub const TEXT_PREFIX: &str = "kvt2 ";
/// Longest encoded message, in bytes (binary form).
pub const MAX_LEN: usize = HEADER_LEN + MAX_TENANCIES * ENTRY_WITH_DIGEST;

const ENTRY: usize = 12;
const ENTRY_WITH_DIGEST: usize = ENTRY + DIGEST_LEN;

const FLAG_DIGESTS: u8 = 1;

/// What a control message says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ControlKind {
    /// Initiator → target: every operation of the sender on these tenancies
    /// reached a successful terminal status; the bytes are in place.
    Done,
    /// Target → initiator: the target gave these tenancies up; drain every
    /// operation on them, then acknowledge, and never post to them again.
    Abort,
    /// Initiator → target: every operation of the sender on these tenancies
    /// is terminal and it will post none again (sent only when each of them
    /// ended in a way that proves it stopped).
    AbortAck,
}

impl ControlKind {
    fn to_byte(self) -> u8 {
        match self {
            Self::Done => 1,
            Self::Abort => 2,
            Self::AbortAck => 3,
        }
    }
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Done),
            2 => Some(Self::Abort),
            3 => Some(Self::AbortAck),
            _ => None,
        }
    }
}

/// The unguessable capability of one exposure: 128 bits from the operating
/// system's random source, handed only to the peer the slots were exposed to
/// (inside its [`RemoteSlots`](crate::RemoteSlots)). A DONE or ABORT_ACK
/// settles a tenancy only when it carries that exposure's token; a name, a
/// guessed generation or a replayed message from another exposure does not.
///
/// `Debug` and `Display` show only a short fingerprint, so logs never leak it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct ExposureToken(pub(crate) [u8; 16]);

impl ExposureToken {
    /// The all-zero token (what `Default` gives): no exposure carries it.
    pub const ZERO: Self = Self([0; 16]);
    /// A fresh token from the OS's random source. Falls back to a
    /// process-unique (guessable) value, with an error event, only if the
    /// OS refuses randomness.
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        if let Err(e) = getrandom::fill(&mut b) {
            tracing::error!(error = %e, "OS random source failed: exposure token is guessable");
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
            b[..8].copy_from_slice(&N.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_le_bytes());
        }
        Self(b)
    }
    /// The token's bytes (what a message carries).
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
    /// A token from bytes (as decoded from a message).
    pub fn from_bytes(b: [u8; 16]) -> Self {
        Self(b)
    }
    /// Compares in time independent of where the tokens differ.
    pub fn ct_eq(&self, other: &Self) -> bool {
        self.0.iter().zip(other.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl fmt::Debug for ExposureToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExposureToken({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

/// One decoded control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlMessage {
    /// What it says.
    pub kind: ControlKind,
    /// The exposing side's pool the tenancies belong to.
    pub pool: PoolId,
    /// The exposure's token.
    pub token: ExposureToken,
    /// The tenancies (1..=[`MAX_TENANCIES`]).
    pub tenancies: Vec<Tenancy>,
    /// With a DONE of a WRITE: the crc32c of each tenancy's bytes as the
    /// initiator sent them, in tenancy order (empty: no digests).
    pub digests: Vec<Digest>,
}

/// Why bytes are not a control message. Every malformed input has one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// No magic (or no text prefix): someone else's message, not ours.
    #[error("not a kv-transfer control message")]
    Foreign,
    /// Shorter than the header or than its count says.
    #[error("truncated: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes the header says the message has.
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// Bytes after the last tenancy.
    #[error("{0} trailing bytes")]
    Trailing(usize),
    /// A version this build does not speak.
    #[error("unsupported codec version {0}")]
    Version(u8),
    /// A kind byte that names no message.
    #[error("unknown message kind {0}")]
    Kind(u8),
    /// Flag bits this version does not define, or a non-zero reserved byte.
    #[error("unknown flags {0:#04x}")]
    Flags(u8),
    /// No tenancy, or more than [`MAX_TENANCIES`].
    #[error("{0} tenancies (1..={MAX_TENANCIES} allowed)")]
    Count(usize),
    /// Digests on a message other than DONE.
    #[error("digests are only carried by DONE")]
    DigestsOnNonDone,
    /// Text armor present but not hex of even length.
    #[error("text armor is not hex")]
    Armor,
}

/// Why a message cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// No tenancy, or more than [`MAX_TENANCIES`]: split it ([`ControlMessage::chunks`]).
    #[error("{0} tenancies (1..={MAX_TENANCIES} allowed)")]
    Count(usize),
    /// Digests whose number is not the number of tenancies, or on a kind other than DONE.
    #[error("digests must be one per tenancy, on DONE only")]
    Digests,
}

impl ControlMessage {
    /// A message without digests.
    pub fn new(kind: ControlKind, pool: PoolId, token: ExposureToken, tenancies: Vec<Tenancy>) -> Self {
        Self { kind, pool, token, tenancies, digests: Vec::new() }
    }

    /// Splits a message into messages of at most [`MAX_TENANCIES`] each
    /// (digests follow their tenancies).
    pub fn chunks(self) -> Vec<ControlMessage> {
        if self.tenancies.len() <= MAX_TENANCIES {
            return vec![self];
        }
        let Self { kind, pool, token, tenancies, digests } = self;
        tenancies
            .chunks(MAX_TENANCIES)
            .enumerate()
            .map(|(i, ts)| {
                let d = if digests.is_empty() {
                    Vec::new()
                } else {
                    digests
                        .get(i * MAX_TENANCIES..i * MAX_TENANCIES + ts.len())
                        .map(<[Digest]>::to_vec)
                        .unwrap_or_default()
                };
                Self { kind, pool, token, tenancies: ts.to_vec(), digests: d }
            })
            .collect()
    }

    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.tenancies.len() * if self.digests.is_empty() { ENTRY } else { ENTRY_WITH_DIGEST }
    }

    /// Appends the binary form to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let n = self.tenancies.len();
        if n == 0 || n > MAX_TENANCIES {
            return Err(EncodeError::Count(n));
        }
        let digests = !self.digests.is_empty();
        if digests && (self.digests.len() != n || self.kind != ControlKind::Done) {
            return Err(EncodeError::Digests);
        }
        out.reserve(self.encoded_len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind.to_byte());
        out.push(if digests { FLAG_DIGESTS } else { 0 });
        out.push(0);
        out.extend_from_slice(&self.pool.0.to_le_bytes());
        out.extend_from_slice(&self.token.0);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for (i, t) in self.tenancies.iter().enumerate() {
            out.extend_from_slice(&t.slot.0.to_le_bytes());
            out.extend_from_slice(&t.generation.0.to_le_bytes());
            if digests {
                out.extend_from_slice(&self.digests[i].0);
            }
        }
        Ok(())
    }

    /// The binary form.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut v = Vec::new();
        self.encode_into(&mut v)?;
        Ok(v)
    }

    /// The text form, for transports whose notifications are strings
    /// (NIXL, Mooncake): [`TEXT_PREFIX`] then the binary form in lowercase hex.
    pub fn encode_text(&self) -> Result<String, EncodeError> {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bin = self.encode()?;
        let mut s = String::with_capacity(TEXT_PREFIX.len() + bin.len() * 2);
        s.push_str(TEXT_PREFIX);
        for b in bin {
            s.push(HEX[(b >> 4) as usize] as char);
            s.push(HEX[(b & 15) as usize] as char);
        }
        Ok(s)
    }

    /// Decodes the binary form. Never panics.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < MAGIC.len() || b[..4] != MAGIC {
            return Err(DecodeError::Foreign);
        }
        if b.len() < HEADER_LEN {
            return Err(DecodeError::Truncated { needed: HEADER_LEN, got: b.len() });
        }
        if b[4] != VERSION {
            return Err(DecodeError::Version(b[4]));
        }
        let kind = ControlKind::from_byte(b[5]).ok_or(DecodeError::Kind(b[5]))?;
        let flags = b[6];
        if flags & !FLAG_DIGESTS != 0 || b[7] != 0 {
            return Err(DecodeError::Flags(flags | b[7]));
        }
        let digests = flags & FLAG_DIGESTS != 0;
        if digests && kind != ControlKind::Done {
            return Err(DecodeError::DigestsOnNonDone);
        }
        let pool = PoolId(u64::from_le_bytes(array(&b[8..16])));
        let token = ExposureToken(array(&b[16..32]));
        let n = u16::from_le_bytes(array(&b[32..34])) as usize;
        if n == 0 || n > MAX_TENANCIES {
            return Err(DecodeError::Count(n));
        }
        let entry = if digests { ENTRY_WITH_DIGEST } else { ENTRY };
        let needed = HEADER_LEN + n * entry;
        if b.len() < needed {
            return Err(DecodeError::Truncated { needed, got: b.len() });
        }
        if b.len() > needed {
            return Err(DecodeError::Trailing(b.len() - needed));
        }
        let mut tenancies = Vec::with_capacity(n);
        let mut ds = Vec::with_capacity(if digests { n } else { 0 });
        for e in b[HEADER_LEN..].chunks_exact(entry) {
            let slot = SlotId(u32::from_le_bytes(array(&e[0..4])));
            let generation = Generation(u64::from_le_bytes(array(&e[4..12])));
            tenancies.push(Tenancy::new(slot, generation));
            if digests {
                ds.push(Digest(array(&e[ENTRY..ENTRY_WITH_DIGEST])));
            }
        }
        Ok(Self { kind, pool, token, tenancies, digests: ds })
    }

    /// Decodes the text form ([`encode_text`](Self::encode_text)). Never panics.
    pub fn decode_text(s: &[u8]) -> Result<Self, DecodeError> {
        let hex = s.strip_prefix(TEXT_PREFIX.as_bytes()).ok_or(DecodeError::Foreign)?;
        if hex.len() % 2 != 0 || hex.len() > 2 * MAX_LEN {
            return Err(DecodeError::Armor);
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut bin = Vec::with_capacity(hex.len() / 2);
        for pair in hex.chunks_exact(2) {
            match (nibble(pair[0]), nibble(pair[1])) {
                (Some(h), Some(l)) => bin.push(h << 4 | l),
                _ => return Err(DecodeError::Armor),
            }
        }
        // Our prefix, but not our bytes inside: malformed, not someone else's.
        Self::decode(&bin).map_err(|e| if e == DecodeError::Foreign { DecodeError::Armor } else { e })
    }
}

fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(b);
    a
}

/// Bytes of a [`Digest`] on the wire.
pub const DIGEST_LEN: usize = 16;

/// A slot's integrity tag, as a DONE carries it: a MAC of the slot's bytes
/// (BLAKE3 in keyed mode, truncated to 128 bits) under a key derived from
/// the exposure's token. A writer that does not hold the token (a third
/// party that reached the slot by address, a squatter) cannot make its
/// bytes pass; a plain checksum (the crc32c this replaced) it could fix up
/// with four bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Digest(pub [u8; DIGEST_LEN]);

impl Digest {
    /// Compares in time independent of where the tags differ.
    pub fn ct_eq(&self, other: &Self) -> bool {
        self.0.iter().zip(other.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest(")?;
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The MAC key of an exposure: derived from its token, so only the two ends
/// the token was handed to can tag or check its bytes.
fn digest_key(token: &ExposureToken) -> [u8; 32] {
    blake3::derive_key("kv-transfer 2026-12 slot digest v2", &token.0)
}

/// The digest of `bytes` under `token`'s key: what a DONE carries per
/// tenancy, and what a settled lease's read checks.
///
/// ```
/// use kv_transfer_core::drain::{digest, ExposureToken};
/// let (a, b) = (ExposureToken::random(), ExposureToken::random());
/// assert_eq!(digest(&a, b"kv"), digest(&a, b"kv"));
/// assert_ne!(digest(&a, b"kv"), digest(&b, b"kv"), "another exposure, another key");
/// ```
pub fn digest(token: &ExposureToken, bytes: &[u8]) -> Digest {
    let tag = blake3::keyed_hash(&digest_key(token), bytes);
    Digest(array(&tag.as_bytes()[..DIGEST_LEN]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: ControlKind, n: usize, digests: bool) -> ControlMessage {
        let ts: Vec<Tenancy> =
            (0..n).map(|i| Tenancy::new(SlotId(i as u32 * 7), Generation(u64::MAX - i as u64))).collect();
        let d =
            if digests { (0..n as u32).map(|i| Digest([(i % 251) as u8; DIGEST_LEN])).collect() } else { Vec::new() };
        ControlMessage { kind, pool: PoolId(42), token: ExposureToken([7; 16]), tenancies: ts, digests: d }
    }

    #[test]
    fn every_kind_round_trips_in_both_forms() {
        for (kind, digests) in [
            (ControlKind::Done, false),
            (ControlKind::Done, true),
            (ControlKind::Abort, false),
            (ControlKind::AbortAck, false),
        ] {
            for n in [1, 2, MAX_TENANCIES] {
                let m = msg(kind, n, digests);
                let b = m.encode().unwrap();
                assert_eq!(b.len(), m.encoded_len());
                assert_eq!(ControlMessage::decode(&b), Ok(m.clone()));
                let t = m.encode_text().unwrap();
                assert_eq!(ControlMessage::decode_text(t.as_bytes()), Ok(m));
            }
        }
    }

    #[test]
    fn every_malformed_input_has_a_typed_error() {
        let good = msg(ControlKind::Done, 2, true).encode().unwrap();
        assert_eq!(ControlMessage::decode(b""), Err(DecodeError::Foreign));
        assert_eq!(ControlMessage::decode(b"kvt1 W 1 1:1"), Err(DecodeError::Foreign));
        assert!(matches!(ControlMessage::decode(&good[..20]), Err(DecodeError::Truncated { .. })));
        assert!(matches!(ControlMessage::decode(&good[..good.len() - 1]), Err(DecodeError::Truncated { .. })));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(ControlMessage::decode(&long), Err(DecodeError::Trailing(1)));
        let mut v = good.clone();
        v[4] = 9;
        assert_eq!(ControlMessage::decode(&v), Err(DecodeError::Version(9)));
        let mut v = good.clone();
        v[5] = 0;
        assert_eq!(ControlMessage::decode(&v), Err(DecodeError::Kind(0)));
        let mut v = good.clone();
        v[6] = 0x81;
        assert_eq!(ControlMessage::decode(&v), Err(DecodeError::Flags(0x81)));
        let mut v = good.clone();
        v[7] = 1;
        assert!(matches!(ControlMessage::decode(&v), Err(DecodeError::Flags(_))));
        let mut v = good.clone();
        v[5] = 2; // ABORT with digests
        assert_eq!(ControlMessage::decode(&v), Err(DecodeError::DigestsOnNonDone));
        let mut v = good.clone();
        v[32..34].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(ControlMessage::decode(&v), Err(DecodeError::Count(0)));
        let mut v = good;
        v[32..34].copy_from_slice(&(MAX_TENANCIES as u16 + 1).to_le_bytes());
        assert_eq!(ControlMessage::decode(&v), Err(DecodeError::Count(MAX_TENANCIES + 1)));
        assert_eq!(ControlMessage::decode_text(b"kvt2 0"), Err(DecodeError::Armor));
        assert_eq!(ControlMessage::decode_text(b"kvt2 zz"), Err(DecodeError::Armor));
        assert_eq!(ControlMessage::decode_text(b"hello"), Err(DecodeError::Foreign));
        assert_eq!(ControlMessage::decode_text(b"kvt2 00"), Err(DecodeError::Armor));
    }

    #[test]
    fn encoding_refuses_what_decoding_would_refuse() {
        assert_eq!(msg(ControlKind::Done, 0, false).encode(), Err(EncodeError::Count(0)));
        assert_eq!(
            msg(ControlKind::Done, MAX_TENANCIES + 1, false).encode(),
            Err(EncodeError::Count(MAX_TENANCIES + 1))
        );
        let mut m = msg(ControlKind::Abort, 1, false);
        m.digests = vec![Digest::default()];
        assert_eq!(m.encode(), Err(EncodeError::Digests));
        let big = msg(ControlKind::Done, MAX_TENANCIES * 2 + 3, true);
        let parts = big.clone().chunks();
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| p.encode().is_ok()));
        let back: Vec<Tenancy> = parts.iter().flat_map(|p| p.tenancies.clone()).collect();
        let digests: Vec<Digest> = parts.iter().flat_map(|p| p.digests.clone()).collect();
        assert_eq!((back, digests), (big.tenancies, big.digests));
    }

    #[test]
    fn token_debug_shows_a_fingerprint_only() {
        let t = ExposureToken([0xab; 16]);
        assert_eq!(format!("{t:?}"), "ExposureToken(abab…)");
        assert!(t.ct_eq(&ExposureToken([0xab; 16])));
        assert!(!t.ct_eq(&ExposureToken::random()));
    }
}
