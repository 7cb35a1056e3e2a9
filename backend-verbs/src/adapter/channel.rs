//! The TCP side channel: how two adapters exchange what their queue pairs
//! need (QP number, PSN, GID, MTU) and who they are. One connection per
//! peer pair, opened by whichever side adds the other first.
//!
//! Wire form of a hello, each way: magic `KVTV`, version 1, the name's
//! length (u16 LE, 1..=256), the name (UTF-8), then the 32-byte
//! [`Endpoint`](crate::Endpoint). Anything else is a typed error and the
//! connection is dropped; no QP is connected to it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::error::VerbsError;
use crate::work::{Endpoint, ENDPOINT_LEN};

const MAGIC: [u8; 4] = *b"KVTV";
const VERSION: u8 = 1;
/// Longest adapter name.
pub const MAX_NAME: usize = 256;

/// What one side says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The adapter's name.
    pub name: String,
    /// Its queue pair for this connection.
    pub endpoint: Endpoint,
}

impl Hello {
    /// Its wire form.
    pub fn encode(&self) -> Result<Vec<u8>, VerbsError> {
        let name = self.name.as_bytes();
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(VerbsError::Endpoint(format!("a name of {} bytes (1..={MAX_NAME})", name.len())));
        }
        let mut b = Vec::with_capacity(7 + name.len() + ENDPOINT_LEN);
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&self.endpoint.encode());
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
        Ok(Self { name, endpoint: Endpoint::decode(&ep)? })
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

/// A peer's descriptor: `name@host:port` (its side channel).
pub fn parse_descriptor(d: &[u8]) -> Result<(String, String), VerbsError> {
    let s = std::str::from_utf8(d).map_err(|_| VerbsError::Endpoint("a descriptor that is not UTF-8".into()))?;
    match s.rsplit_once('@') {
        Some((name, addr)) if !name.is_empty() && name.len() <= MAX_NAME && !addr.is_empty() => {
            Ok((name.to_owned(), addr.to_owned()))
        }
        _ => Err(VerbsError::Endpoint(format!("descriptor {s:?} is not name@host:port"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::work::Gid;

    fn hello() -> Hello {
        Hello { name: "decode-0".into(), endpoint: Endpoint { qpn: 17, psn: 5, gid: Gid([1; 16]), mtu: 1024 } }
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
        for d in [&b"no-at-sign"[..], b"@127.0.0.1:1", b"name@", &[0xff, b'@', b'x']] {
            assert!(parse_descriptor(d).is_err(), "{d:?}");
        }
        assert_eq!(parse_descriptor(b"a@b@127.0.0.1:9").unwrap(), ("a@b".into(), "127.0.0.1:9".into()));
    }
}
