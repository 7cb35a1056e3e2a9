//! The adapter's control messages, carried as Mooncake notifications.
//!
//! One line of ASCII: `kvt1 <kind> <pool> <slot>:<gen>,<slot>:<gen>,...`
//!
//! - `W` (initiator → target): every task of an operation on these tenancies
//!   finished COMPLETED under protocol v2, observed by the initiator. Sent
//!   only after that observation, never on failure.
//! - `A` (target → initiator): ABORT. The target abandoned these tenancies and
//!   asks the initiator to drain: finish every task touching them, then ack,
//!   and never post to them again.
//! - `K` (initiator → target): ABORT_ACK. Every task this initiator posted on
//!   these tenancies is finished (COMPLETED or FAILED), it will post no more
//!   to them, and every task ran under protocol v2.
//!
//! The pool id scopes the tenancies (a target may run several pools).

use kv_transfer_core::{Generation, PoolId, SlotId, Tenancy};

/// Magic prefix of every adapter message.
pub const MAGIC: &str = "kvt1";
/// Most tenancies one message may carry (a parse limit, not a protocol one).
pub const MAX_TENANCIES: usize = 1 << 16;

/// Kind of an adapter message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Operation completed (initiator → target).
    Done,
    /// ABORT (target → initiator).
    Abort,
    /// ABORT_ACK (initiator → target).
    AbortAck,
}

impl Kind {
    fn letter(self) -> char {
        match self {
            Kind::Done => 'W',
            Kind::Abort => 'A',
            Kind::AbortAck => 'K',
        }
    }
}

/// A decoded adapter message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// What it says.
    pub kind: Kind,
    /// The pool the tenancies belong to (the target's pool).
    pub pool: PoolId,
    /// The tenancies.
    pub tenancies: Vec<Tenancy>,
}

/// Why a notification is not a well-formed adapter message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    /// No `kvt1 ` prefix: not ours (an application's notification).
    NotOurs,
    /// Prefix present, rest malformed.
    Malformed,
}

impl Message {
    /// Encodes to the wire line.
    pub fn encode(&self) -> String {
        let mut s = String::with_capacity(16 + self.tenancies.len() * 12);
        s.push_str(MAGIC);
        s.push(' ');
        s.push(self.kind.letter());
        s.push(' ');
        s.push_str(&self.pool.0.to_string());
        s.push(' ');
        for (i, t) in self.tenancies.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&t.slot.0.to_string());
            s.push(':');
            s.push_str(&t.generation.0.to_string());
        }
        s
    }

    /// Decodes a wire line. Never panics.
    pub fn parse(msg: &str) -> Result<Message, ParseError> {
        let mut it = msg.split_ascii_whitespace();
        if it.next() != Some(MAGIC) {
            return Err(ParseError::NotOurs);
        }
        let kind = match it.next() {
            Some("W") => Kind::Done,
            Some("A") => Kind::Abort,
            Some("K") => Kind::AbortAck,
            _ => return Err(ParseError::Malformed),
        };
        let pool = it.next().and_then(|p| p.parse::<u64>().ok()).ok_or(ParseError::Malformed)?;
        let list = it.next().ok_or(ParseError::Malformed)?;
        if it.next().is_some() {
            return Err(ParseError::Malformed);
        }
        let mut tenancies = Vec::new();
        for item in list.split(',') {
            if tenancies.len() >= MAX_TENANCIES {
                return Err(ParseError::Malformed);
            }
            let (s, g) = item.split_once(':').ok_or(ParseError::Malformed)?;
            let slot = s.parse::<u32>().map_err(|_| ParseError::Malformed)?;
            let generation = g.parse::<u64>().map_err(|_| ParseError::Malformed)?;
            tenancies.push(Tenancy::new(SlotId(slot), Generation(generation)));
        }
        Ok(Message { kind, pool: PoolId(pool), tenancies })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let m = Message {
            kind: Kind::AbortAck,
            pool: PoolId(7),
            tenancies: vec![Tenancy::new(SlotId(3), Generation(9)), Tenancy::new(SlotId(0), Generation(u64::MAX))],
        };
        let s = m.encode();
        assert_eq!(s, format!("kvt1 K 7 3:9,0:{}", u64::MAX));
        assert_eq!(Message::parse(&s), Ok(m));
        assert_eq!(Message::parse("kv ready"), Err(ParseError::NotOurs));
        assert_eq!(Message::parse(""), Err(ParseError::NotOurs));
        for bad in [
            "kvt1",
            "kvt1 X 1 1:1",
            "kvt1 W",
            "kvt1 W x 1:1",
            "kvt1 W 1",
            "kvt1 W 1 1",
            "kvt1 W 1 1:",
            "kvt1 W 1 :1",
            "kvt1 W 1 1:1,",
            "kvt1 W 1 1:1 extra",
            "kvt1 W 1 4294967296:1",
            "kvt1 W -1 1:1",
        ] {
            assert_eq!(Message::parse(bad), Err(ParseError::Malformed), "{bad}");
        }
    }
}
