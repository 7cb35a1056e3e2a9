//! The adapter's notification format.
//!
//! One line of ASCII: `kvt1 <kind> <pool> <slot>:<gen>,<slot>:<gen>,...`, where
//! `<pool>` is the *target's* pool id (the one named by the `RemoteSlots`) and every
//! tenancy is the target's `(SlotId, Generation)`. Kinds:
//!
//! | kind | sender | meaning |
//! | --- | --- | --- |
//! | `W` | initiator | a WRITE into these tenancies succeeded; no operation of the sender touches them any more |
//! | `R` | initiator | the same for a READ out of them |
//! | `A` | target | ABORT: the target gave up these tenancies; drain and acknowledge |
//! | `K` | initiator | ABORT_ACK: every operation of the sender on them reached a terminal status; it will post none again |
//!
//! Anything else is malformed (counted and dropped; never a panic).

use kv_transfer_core::{Generation, PoolId, SlotId, Tenancy};

/// Prefix of every adapter message.
pub const MAGIC: &str = "kvt1";

/// What a message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgKind {
    /// `W`: a WRITE completed.
    Written,
    /// `R`: a READ completed.
    Read,
    /// `A`: the target asks the initiator to drain and acknowledge.
    Abort,
    /// `K`: the initiator acknowledges: nothing of it touches the tenancies any more.
    AbortAck,
}

impl MsgKind {
    fn letter(self) -> char {
        match self {
            Self::Written => 'W',
            Self::Read => 'R',
            Self::Abort => 'A',
            Self::AbortAck => 'K',
        }
    }
}

/// A parsed adapter message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// What it says.
    pub kind: MsgKind,
    /// The target's pool.
    pub pool: PoolId,
    /// The target's tenancies (non-empty).
    pub tenancies: Vec<Tenancy>,
}

/// Why a message was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not an adapter message (no `kvt1 ` prefix): someone else's notification.
    #[error("not a kvt1 message")]
    Foreign,
    /// Starts like one but does not parse.
    #[error("malformed kvt1 message: {0}")]
    Malformed(&'static str),
}

/// Encodes a message.
pub fn encode(kind: MsgKind, pool: PoolId, tenancies: &[Tenancy]) -> Vec<u8> {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(16 + tenancies.len() * 8);
    let _ = write!(s, "{MAGIC} {} {} ", kind.letter(), pool.0);
    for (i, t) in tenancies.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{}:{}", t.slot.0, t.generation.0);
    }
    s.into_bytes()
}

/// Parses a message. Never panics, whatever the bytes.
pub fn decode(msg: &[u8]) -> Result<Message, ParseError> {
    if !msg.starts_with(MAGIC.as_bytes()) || msg.get(MAGIC.len()) != Some(&b' ') {
        return Err(ParseError::Foreign);
    }
    let s = std::str::from_utf8(msg).map_err(|_| ParseError::Malformed("not UTF-8"))?;
    let mut parts = s.split(' ');
    let _magic = parts.next();
    let kind = match parts.next() {
        Some("W") => MsgKind::Written,
        Some("R") => MsgKind::Read,
        Some("A") => MsgKind::Abort,
        Some("K") => MsgKind::AbortAck,
        _ => return Err(ParseError::Malformed("unknown kind")),
    };
    let pool = parts.next().and_then(|p| p.parse::<u64>().ok()).ok_or(ParseError::Malformed("bad pool id"))?;
    let list = parts.next().ok_or(ParseError::Malformed("no tenancies"))?;
    if parts.next().is_some() {
        return Err(ParseError::Malformed("trailing fields"));
    }
    let mut tenancies = Vec::new();
    for item in list.split(',') {
        let (slot, gen) = item.split_once(':').ok_or(ParseError::Malformed("tenancy without ':'"))?;
        let slot = slot.parse::<u32>().map_err(|_| ParseError::Malformed("bad slot"))?;
        let gen = gen.parse::<u64>().map_err(|_| ParseError::Malformed("bad generation"))?;
        tenancies.push(Tenancy::new(SlotId(slot), Generation(gen)));
    }
    if tenancies.is_empty() {
        return Err(ParseError::Malformed("no tenancies"));
    }
    Ok(Message { kind, pool: PoolId(pool), tenancies })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_hostile_input() {
        let ts = [Tenancy::new(SlotId(3), Generation(17)), Tenancy::new(SlotId(0), Generation(u64::MAX))];
        for kind in [MsgKind::Written, MsgKind::Read, MsgKind::Abort, MsgKind::AbortAck] {
            let m = encode(kind, PoolId(9), &ts);
            assert_eq!(decode(&m), Ok(Message { kind, pool: PoolId(9), tenancies: ts.to_vec() }));
        }
        assert_eq!(encode(MsgKind::Written, PoolId(2), &ts[..1]), b"kvt1 W 2 3:17".to_vec());
        assert_eq!(decode(b"hello"), Err(ParseError::Foreign));
        assert_eq!(decode(b"kvt1"), Err(ParseError::Foreign));
        assert_eq!(decode(b""), Err(ParseError::Foreign));
        for bad in [
            &b"kvt1 "[..],
            b"kvt1 X 1 1:1",
            b"kvt1 W x 1:1",
            b"kvt1 W 1",
            b"kvt1 W 1 ",
            b"kvt1 W 1 1",
            b"kvt1 W 1 1:",
            b"kvt1 W 1 :1",
            b"kvt1 W 1 1:1,",
            b"kvt1 W 1 1:1 extra",
            b"kvt1 W 1 99999999999:1",
            b"kvt1 W 1 1:-1",
            b"kvt1 W 1 \xff:1",
        ] {
            assert!(matches!(decode(bad), Err(ParseError::Malformed(_))), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
