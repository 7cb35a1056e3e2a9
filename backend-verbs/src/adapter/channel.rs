//! The TCP side channel: how two adapters exchange what their queue pairs
//! need (QP number, PSN, GID, MTU) and who they are. One connection per
//! peer pair, opened by whichever side adds the other first.
//!
//! Wire form of a hello, each way: magic `KVTV`, version 2, the name's
//! length (u16 LE, 1..=256), the name (UTF-8), the 32-byte
//! [`Endpoint`](crate::Endpoint), then a 16-byte ticket; the dialer's hello
//! is followed by its connection's 16-byte [`Nonce`]. A dialer may instead
//! open with a [`Confirm`] (magic `KVTQ`), answered with one byte. Anything
//! else is a typed error and the connection is dropped; no QP is connected
//! to it.
//!
//! The ticket is why a stranger cannot make itself a peer: each adapter
//! draws one at random and puts it in its descriptor
//! (`name@host:port#<32 hex digits>`), which travels out of band (the
//! serving engine's bootstrap); the dialer's hello must carry the dialed
//! side's ticket, or the acceptor refuses it before it records a peer. A
//! hello refused costs nothing that outlives its connection.
//!
//! The ticket proves only that the dialer holds the dialed side's
//! descriptor, which every peer that side served holds: it says nothing of
//! who the dialer is. The nonce does: the acceptor asks the owner of the
//! descriptor *it* was given, at that descriptor's address, whether it sent
//! that nonce to it ([`Confirm`]; see the adapter's `handshake` module).
//!
//! Before any of this, every side-channel connection (a hello's and a
//! [`Confirm`]'s) starts with core's mutual handshake under the cluster key
//! ([`kv_transfer_core::auth`], context [`AUTH_CONTEXT`]): the dialer names
//! the exact `host:port` it dialed (its descriptor's address) and its own
//! descriptor's address; the acceptor refuses a handshake that dialed
//! anything but its own descriptor's address (a relay), or that proves
//! another key. A [`Confirm`] is answered yes only for a nonce sent on a
//! connection dialed to the asker's own (proved) address.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::error::VerbsError;
use crate::work::{Endpoint, ENDPOINT_LEN};

/// The context of the side channel's handshake (core's
/// [`DialerConfig::context`](kv_transfer_core::auth::DialerConfig)).
pub const AUTH_CONTEXT: &str = "kvt-verbs-side-channel";

const MAGIC: [u8; 4] = *b"KVTV";
const VERSION: u8 = 2;
/// Longest adapter name.
pub const MAX_NAME: usize = 256;
/// Bytes of a side-channel ticket.
pub const TICKET_LEN: usize = 16;

/// The secret a dialer proves it got from the dialed side's descriptor.
pub type Ticket = [u8; TICKET_LEN];

fn io(e: std::io::Error) -> VerbsError {
    VerbsError::Endpoint(format!("side channel: {e}"))
}

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

/// Writes `b` whole, by `deadline`.
pub fn write_all(stream: &mut TcpStream, b: &[u8], deadline: std::time::Instant) -> Result<(), VerbsError> {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    if left.is_zero() {
        return Err(VerbsError::Endpoint("side channel: the handshake's deadline passed".into()));
    }
    stream.set_write_timeout(Some(left)).map_err(io)?;
    stream.write_all(b).map_err(io)?;
    stream.flush().map_err(io)
}

/// Magic of a confirmation request (see [`Confirm`]).
const CONFIRM_MAGIC: [u8; 4] = *b"KVTQ";
/// Most candidate nonces one [`Confirm`] carries.
pub const MAX_CANDIDATES: usize = 64;
/// The answer to a [`Confirm`] none of whose nonces the asked side sent.
pub const NONE_CONFIRMED: u8 = 0xff;

/// A connection's nonce: drawn by the dialer, sent once, after its hello,
/// on the connection it dialed; the acceptor later asks the dialer's own
/// listener (at the address of the descriptor it was given) whether that
/// nonce is one of its own. 16 random bytes, like a ticket.
pub type Nonce = [u8; TICKET_LEN];

/// "Did you dial me, on one of these connections?": what an acceptor
/// asks the side a descriptor names, on a connection it dials itself to the
/// descriptor's address. Wire form: magic `KVTQ`, version 1, the asked
/// side's ticket (proves the asker holds its descriptor), the asker's own
/// ticket (the connection must have been dialed to the descriptor carrying
/// it), a count (u8, 1..=[`MAX_CANDIDATES`]) and that many [`Nonce`]s. The
/// answer is one byte: the index of the nonce the asked side sent to the
/// asker, or [`NONE_CONFIRMED`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Confirm {
    /// The asked side's ticket.
    pub ticket: Ticket,
    /// The asker's own ticket.
    pub asker: Ticket,
    /// The nonces of the connections that claim the asked side's name.
    pub candidates: Vec<Nonce>,
}

impl Confirm {
    /// Its wire form.
    pub fn encode(&self) -> Result<Vec<u8>, VerbsError> {
        let n = self.candidates.len();
        if n == 0 || n > MAX_CANDIDATES {
            return Err(VerbsError::Endpoint(format!("{n} candidates (1..={MAX_CANDIDATES})")));
        }
        let mut b = Vec::with_capacity(6 + 2 * TICKET_LEN + n * TICKET_LEN);
        b.extend_from_slice(&CONFIRM_MAGIC);
        b.push(1);
        b.extend_from_slice(&self.ticket);
        b.extend_from_slice(&self.asker);
        b.push(n as u8);
        for c in &self.candidates {
            b.extend_from_slice(c);
        }
        Ok(b)
    }

    /// Reads the rest of a confirmation request whose magic was read.
    fn read_rest(r: &mut impl Read) -> Result<Self, VerbsError> {
        let mut head = [0u8; 1 + 2 * TICKET_LEN + 1];
        r.read_exact(&mut head).map_err(io)?;
        if head[0] != 1 {
            return Err(VerbsError::Endpoint(format!("confirmation version {}", head[0])));
        }
        let mut ticket = [0u8; TICKET_LEN];
        ticket.copy_from_slice(&head[1..1 + TICKET_LEN]);
        let mut asker = [0u8; TICKET_LEN];
        asker.copy_from_slice(&head[1 + TICKET_LEN..1 + 2 * TICKET_LEN]);
        let n = usize::from(head[1 + 2 * TICKET_LEN]);
        if n == 0 || n > MAX_CANDIDATES {
            return Err(VerbsError::Endpoint(format!("{n} candidates (1..={MAX_CANDIDATES})")));
        }
        let mut candidates = vec![[0u8; TICKET_LEN]; n];
        for c in &mut candidates {
            r.read_exact(c).map_err(io)?;
        }
        Ok(Self { ticket, asker, candidates })
    }
}

/// The first thing a dialer sends the acceptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opening {
    /// A connection: its hello and its nonce.
    Hello(Hello, Nonce),
    /// A question about connections this side dialed.
    Confirm(Confirm),
}

/// Reads what a dialer opens with (bounded by the reader: see [`Deadline`]).
pub fn read_opening(r: &mut impl Read) -> Result<Opening, VerbsError> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).map_err(io)?;
    if magic == CONFIRM_MAGIC {
        return Confirm::read_rest(r).map(Opening::Confirm);
    }
    let hello = Hello::read_from(&mut (&magic[..]).chain(&mut *r))?;
    let mut nonce = [0u8; TICKET_LEN];
    r.read_exact(&mut nonce).map_err(io)?;
    Ok(Opening::Hello(hello, nonce))
}

/// A reader with a whole-exchange deadline and an idle bound: each read
/// waits at most `idle` and never past `deadline`, so a peer that trickles
/// a byte at a time cannot hold a handshake longer than the deadline (a
/// per-read timeout alone would be restarted by every byte).
pub struct Deadline<'a> {
    stream: &'a TcpStream,
    deadline: std::time::Instant,
    idle: Duration,
}

impl<'a> Deadline<'a> {
    /// Reads from `stream` until `deadline`, each read at most `idle`.
    pub fn new(stream: &'a TcpStream, deadline: std::time::Instant, idle: Duration) -> Self {
        Self { stream, deadline, idle }
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake's deadline passed"));
        }
        // A zero timeout means "none" to set_read_timeout: at least 1 ms.
        self.stream.set_read_timeout(Some(left.min(self.idle).max(Duration::from_millis(1))))?;
        (&*self.stream).read(buf)
    }
}

/// Writes wait at most until the deadline (as the side channel's writes do), so
/// core's handshake runs inside the same whole-handshake deadline.
impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake's deadline passed"));
        }
        self.stream.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        (&*self.stream).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        (&*self.stream).flush()
    }
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
    let (name, addr, hex) = split_descriptor(s)?;
    let mut ticket = [0u8; TICKET_LEN];
    for (t, pair) in ticket.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
        *t = (hex_digit(pair[0]) << 4) | hex_digit(pair[1]);
    }
    Ok(Descriptor { name: name.to_owned(), addr: addr.to_owned(), ticket })
}

/// The name a descriptor gives, checked as [`parse_descriptor`] checks the
/// whole (what a post needs: no copy, no ticket decoded).
pub(crate) fn descriptor_name(s: &str) -> Result<&str, VerbsError> {
    split_descriptor(s).map(|(name, _, _)| name)
}

/// `(name, host:port, ticket hex)` of a well-formed descriptor.
fn split_descriptor(s: &str) -> Result<(&str, &str, &str), VerbsError> {
    let bad = || VerbsError::Endpoint(format!("descriptor {s:?} is not name@host:port#ticket"));
    let (rest, hex) = s.rsplit_once('#').ok_or_else(bad)?;
    if hex.len() != 2 * TICKET_LEN || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad());
    }
    match rest.rsplit_once('@') {
        Some((name, addr)) if !name.is_empty() && name.len() <= MAX_NAME && !addr.is_empty() => Ok((name, addr, hex)),
        _ => Err(bad()),
    }
}

/// The value of one ASCII hex digit (`split_descriptor` checked that it
/// is one: anything else reads as 0).
fn hex_digit(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => 0,
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

    /// A post names its peer by the descriptor without parsing all of it:
    /// the name it takes is the full parse's, and it refuses what the full
    /// parse refuses.
    #[test]
    fn a_posts_peer_name_is_the_full_parses_and_bad_descriptors_are_refused_alike() {
        let t = "00112233445566778899aAbBcCdDeEfF";
        let with = |d: &str| format!("{d}#{t}");
        let long = "n".repeat(MAX_NAME + 1);
        let cases = [
            with("a@b@127.0.0.1:9"),
            with("decode-0@10.0.0.2:4791"),
            with("no-at-sign"),
            with("@127.0.0.1:1"),
            with("name@"),
            with(&format!("{long}@h:1")),
            "a@127.0.0.1:9".into(),
            "a@127.0.0.1:9#00".into(),
            format!("a@h:1#{}g", &t[..31]),
        ];
        for d in &cases {
            let full = parse_descriptor(d.as_bytes());
            match (descriptor_name(d), &full) {
                (Ok(name), Ok(full)) => assert_eq!(name, full.name, "{d:?}"),
                (Err(_), Err(_)) => {}
                (name, full) => panic!("{d:?}: the post's name {name:?}, the full parse {full:?}"),
            }
        }
        let d = parse_descriptor(with("x@h:1").as_bytes()).unwrap();
        assert_eq!(
            d.ticket,
            [0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff]
        );
    }
}
