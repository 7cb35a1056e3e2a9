//! The TCP side channel: how two adapters exchange what their queue pairs
//! need (QP number, PSN, GID, MTU) and who they are. One connection per
//! peer pair, opened by whichever side adds the other first.
//!
//! Wire form of a hello, each way: magic `KVTV`, version 2, the name's
//! length (u16 LE, 1..=256), the name (UTF-8), the 32-byte
//! [`Endpoint`](crate::Endpoint), then a 16-byte ticket. Anything else is
//! a typed error and the connection is dropped; no QP is connected to it.
//!
//! The ticket is why a stranger cannot make itself a peer: each adapter
//! draws one at random and puts it in its descriptor
//! (`name@host:port#<32 hex digits>`), which travels out of band (the
//! serving engine's bootstrap); the dialer's hello must carry the dialed
//! side's ticket, or the acceptor refuses it before it records a peer. A
//! hello refused costs nothing that outlives its connection.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::error::VerbsError;
use crate::work::{Endpoint, ENDPOINT_LEN};

const MAGIC: [u8; 4] = *b"KVTV";
const VERSION: u8 = 2;
/// Longest adapter name.
pub const MAX_NAME: usize = 256;
/// Bytes of a side-channel ticket.
pub const TICKET_LEN: usize = 16;

/// The secret a dialer proves it got from the dialed side's descriptor.
pub type Ticket = [u8; TICKET_LEN];

/// What one side says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The adapter's name.
    pub name: String,
    /// Its queue pair for this connection.
    pub endpoint: Endpoint,
    /// From a dialer: the dialed side's ticket. From the acceptor: zeros.
    pub ticket: Ticket,
}

impl Hello {
    /// Its wire form.
    pub fn encode(&self) -> Result<Vec<u8>, VerbsError> {
        let name = self.name.as_bytes();
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(VerbsError::Endpoint(format!("a name of {} bytes (1..={MAX_NAME})", name.len())));
        }
        let mut b = Vec::with_capacity(7 + name.len() + ENDPOINT_LEN + TICKET_LEN);
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&self.endpoint.encode());
        b.extend_from_slice(&self.ticket);
        Ok(b)
    }

    /// Reads one hello from `r`, bounded by the connection's read timeout.
    pub fn read_from(r: &mut impl Read) -> Result<Self, VerbsError> {
        let io = |e: std::io::Error| VerbsError::Endpoint(format!("side channel: {e}"));
        let mut head = [0u8; 7];
        r.read_exact(&mut head).map_err(io)?;
        if head[0..4] != MAGIC {
            return Err(VerbsError::Endpoint("not a kv-transfer verbs side channel".into()));
        }
        if head[4] != VERSION {
            return Err(VerbsError::Endpoint(format!("side-channel version {} (this is {VERSION})", head[4])));
        }
        let n = usize::from(u16::from_le_bytes([head[5], head[6]]));
        if n == 0 || n > MAX_NAME {
            return Err(VerbsError::Endpoint(format!("a name of {n} bytes (1..={MAX_NAME})")));
        }
        let mut name = vec![0u8; n];
        r.read_exact(&mut name).map_err(io)?;
        let name = String::from_utf8(name).map_err(|_| VerbsError::Endpoint("a name that is not UTF-8".into()))?;
        let mut ep = [0u8; ENDPOINT_LEN];
        r.read_exact(&mut ep).map_err(io)?;
        let endpoint = Endpoint::decode(&ep)?;
        let mut ticket = [0u8; TICKET_LEN];
        r.read_exact(&mut ticket).map_err(io)?;
        Ok(Self { name, endpoint, ticket })
    }
}

fn io(e: std::io::Error) -> VerbsError {
    VerbsError::Endpoint(format!("side channel: {e}"))
}

/// Sends our hello (bounded by `timeout`).
pub fn send(stream: &mut TcpStream, ours: &Hello, timeout: Duration) -> Result<(), VerbsError> {
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    stream.write_all(&ours.encode()?).map_err(io)
}

/// Reads their hello (bounded by `timeout`).
pub fn receive(stream: &mut TcpStream, timeout: Duration) -> Result<Hello, VerbsError> {
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    Hello::read_from(stream)
}

/// A peer's descriptor, parsed: who it is, where its side channel
/// listens, and the ticket a hello to it must carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// The adapter's name.
    pub name: String,
    /// Its side channel, `host:port`.
    pub addr: String,
    /// Its ticket.
    pub ticket: Ticket,
}

impl Descriptor {
    /// The descriptor's text form, `name@host:port#<32 hex digits>`.
    pub fn encode(&self) -> String {
        let hex: String = self.ticket.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}@{}#{hex}", self.name, self.addr)
    }
}

/// Parses a peer's descriptor (`name@host:port#<32 hex digits>`).
pub fn parse_descriptor(d: &[u8]) -> Result<Descriptor, VerbsError> {
    let s = std::str::from_utf8(d).map_err(|_| VerbsError::Endpoint("a descriptor that is not UTF-8".into()))?;
    let bad = || VerbsError::Endpoint(format!("descriptor {s:?} is not name@host:port#ticket"));
    let (rest, hex) = s.rsplit_once('#').ok_or_else(bad)?;
    if hex.len() != 2 * TICKET_LEN || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let mut ticket = [0u8; TICKET_LEN];
    for (i, t) in ticket.iter_mut().enumerate() {
        *t = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    match rest.rsplit_once('@') {
        Some((name, addr)) if !name.is_empty() && name.len() <= MAX_NAME && !addr.is_empty() => {
            Ok(Descriptor { name: name.to_owned(), addr: addr.to_owned(), ticket })
        }
        _ => Err(bad()),
    }
}

/// A fresh random ticket (the kernel's generator; should it be
/// unreadable, std's per-process random hash keys, mixed with the time).
pub fn fresh_ticket() -> Ticket {
    use std::io::Read as _;
    let mut t = [0u8; TICKET_LEN];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut t)).is_ok() {
        return t;
    }
    use std::hash::{BuildHasher, Hasher};
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    for (i, chunk) in t.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(now);
        h.write_usize(i);
        h.write_u32(std::process::id());
        chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::work::Gid;

    fn hello() -> Hello {
        Hello {
            name: "decode-0".into(),
            endpoint: Endpoint { qpn: 17, psn: 5, gid: Gid([1; 16]), mtu: 1024 },
            ticket: [7; TICKET_LEN],
        }
    }

    #[test]
    fn a_hello_round_trips() {
        let b = hello().encode().unwrap();
        assert_eq!(Hello::read_from(&mut &b[..]).unwrap(), hello());
    }

    /// Bad input on the side channel (truncated, foreign, oversize name,
    /// unknown version, bad QPN) is a typed error.
    #[test]
    fn bad_side_channel_input_is_a_typed_error() {
        let good = hello().encode().unwrap();
        let mut cases = vec![good[..good.len() - 1].to_vec(), good[..3].to_vec()];
        let mut foreign = good.clone();
        foreign[0] = b'H';
        cases.push(foreign);
        let mut version = good.clone();
        version[4] = 9;
        cases.push(version);
        let mut long = good.clone();
        long[5..7].copy_from_slice(&(MAX_NAME as u16 + 1).to_le_bytes());
        cases.push(long);
        let mut qpn = good.clone();
        let at = 7 + "decode-0".len() + 4;
        qpn[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        cases.push(qpn);
        for c in cases {
            assert!(matches!(Hello::read_from(&mut &c[..]), Err(VerbsError::Endpoint(_))), "{c:?}");
        }
        let t = "00112233445566778899aabbccddeeff";
        let with = |d: &str| format!("{d}#{t}");
        for d in
            [with("no-at-sign"), with("@127.0.0.1:1"), with("name@"), "a@127.0.0.1:9".into(), "a@127.0.0.1:9#00".into()]
        {
            assert!(parse_descriptor(d.as_bytes()).is_err(), "{d:?}");
        }
        assert!(parse_descriptor(&[0xff, b'@', b'x', b'#']).is_err());
        let d = parse_descriptor(with("a@b@127.0.0.1:9").as_bytes()).unwrap();
        assert_eq!((d.name.as_str(), d.addr.as_str()), ("a@b", "127.0.0.1:9"));
        assert_eq!(d.ticket[15], 0xff);
        assert_eq!(d.encode(), with("a@b@127.0.0.1:9"));
        assert_ne!(fresh_ticket(), fresh_ticket());
    }
}
