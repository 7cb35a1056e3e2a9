//! The side channel of [`super::VerbsTransport`]: how two engines connect
//! their queue pairs, and who they are.
//!
//! MORI-IO exchanges its queue pairs over TCP, its control plane; so does
//! this transport, with `backend-verbs`' hello for each queue pair:
//!
//! 0. before anything else, core's handshake ([`kv_transfer_core::auth`],
//!    context [`super::AUTH_CONTEXT`]): both ends prove the cluster key,
//!    the dialer names the address it dialed (the acceptor refuses any but
//!    its own: a relay) and the acceptor must prove the descriptor's name;
//!    the offer that follows must name the engine the handshake proved;
//! 1. the dialer sends one byte (the number of queue pairs, 1..=8), one
//!    [`Hello`] per queue pair (its engine key, the QP's endpoint, and the
//!    *dialed* side's ticket, from the descriptor it was given), then its own
//!    ticket (16 bytes);
//! 2. the acceptor checks the dialed ticket, connects as many queue pairs,
//!    posts their receives and answers the same way (its key, its
//!    endpoints, a zero ticket);
//! 3. the dialer connects its queue pairs, posts its receives and sends
//!    [`READY`]; only then does the acceptor send on them.
//!
//! The TCP connection then stays open as the connection's lifeline: when
//! either side closes it (a fence, a crash, a drop), the other moves its
//! queue pairs to ERR.
//!
//! A hello's key is a claim, not an identity. The acceptor binds the
//! connection to the engine it names only once that engine's descriptor is
//! registered ([`crate::MoriTransport::connect`]) and the dialer's own ticket
//! equals the descriptor's: a stranger who knows only this side's descriptor
//! can open a connection, but nothing it sends is taken as that engine's.
//! A hello that names a registered engine with another ticket marks its
//! connection an impostor's: never bound, kept open until its lifeline
//! closes, every SEND on it dropped and counted
//! ([`super::VerbsTransportStats::impostor_messages`]), so an operator sees
//! the attack message by message.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use backend_verbs::adapter::{Hello, Ticket, TICKET_LEN};
use backend_verbs::Endpoint;

use crate::error::TransportError;

/// The dialer's last word: its receives are posted.
pub(super) const READY: u8 = 0x52;
/// Most queue pairs per connection.
pub(super) const MAX_QPS: usize = 8;

fn io(what: &'static str) -> impl Fn(std::io::Error) -> TransportError {
    move |e| TransportError::Remote(format!("side channel ({what}): {e}"))
}

fn proto(why: impl Into<String>) -> TransportError {
    TransportError::Remote(format!("side channel: {}", why.into()))
}

/// What one side says: its key, its queue pairs' endpoints, and a ticket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Offer {
    pub key: String,
    pub endpoints: Vec<Endpoint>,
    /// In each hello: the dialed side's ticket (from the dialer), zeros
    /// (from the acceptor).
    pub ticket: Ticket,
}

impl Offer {
    pub fn encode(&self) -> Result<Vec<u8>, TransportError> {
        if self.endpoints.is_empty() || self.endpoints.len() > MAX_QPS {
            return Err(proto(format!("{} queue pairs (1..={MAX_QPS})", self.endpoints.len())));
        }
        let mut b = vec![self.endpoints.len() as u8];
        for ep in &self.endpoints {
            let h = Hello { name: self.key.clone(), endpoint: *ep, ticket: self.ticket };
            b.extend_from_slice(&h.encode().map_err(|e| proto(e.to_string()))?);
        }
        Ok(b)
    }

    /// Reads an offer, bounded by the stream's read timeout: typed errors
    /// for anything else (a count out of range, a bad hello, hellos that
    /// disagree on who or which ticket).
    pub fn read_from(r: &mut impl Read) -> Result<Self, TransportError> {
        let mut n = [0u8; 1];
        r.read_exact(&mut n).map_err(io("count"))?;
        let n = usize::from(n[0]);
        if n == 0 || n > MAX_QPS {
            return Err(proto(format!("{n} queue pairs (1..={MAX_QPS})")));
        }
        let mut offer: Option<Offer> = None;
        for _ in 0..n {
            let h = Hello::read_from(r).map_err(|e| proto(e.to_string()))?;
            match &mut offer {
                None => offer = Some(Offer { key: h.name, endpoints: vec![h.endpoint], ticket: h.ticket }),
                Some(o) if o.key == h.name && o.ticket == h.ticket => o.endpoints.push(h.endpoint),
                Some(_) => return Err(proto("hellos of one offer disagree")),
            }
        }
        offer.ok_or_else(|| proto("empty offer"))
    }
}

/// Reads the dialer's own ticket.
pub(super) fn read_ticket(r: &mut impl Read) -> Result<Ticket, TransportError> {
    let mut t = [0u8; TICKET_LEN];
    r.read_exact(&mut t).map_err(io("ticket"))?;
    Ok(t)
}

pub(super) fn write_all(s: &mut TcpStream, b: &[u8], timeout: Duration) -> Result<(), TransportError> {
    s.set_write_timeout(Some(timeout)).map_err(io("timeout"))?;
    s.write_all(b).map_err(io("write"))?;
    s.flush().map_err(io("flush"))
}

pub(super) fn read_ready(s: &mut impl Read) -> Result<(), TransportError> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b).map_err(io("ready"))?;
    if b[0] != READY {
        return Err(proto(format!("ready byte {:#x}", b[0])));
    }
    Ok(())
}

/// Compares tickets in time independent of where they differ.
pub(super) fn tickets_match(a: &Ticket, b: &Ticket) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use backend_verbs::Gid;

    fn offer(n: usize) -> Offer {
        let ep = |i: u32| Endpoint { qpn: 0x10 + i, psn: i, gid: Gid([3; 16]), mtu: 1024 };
        Offer { key: "decode-0".into(), endpoints: (0..n as u32).map(ep).collect(), ticket: [9; TICKET_LEN] }
    }

    #[test]
    fn an_offer_round_trips() {
        for n in [1, 2, MAX_QPS] {
            let b = offer(n).encode().unwrap();
            assert_eq!(Offer::read_from(&mut &b[..]).unwrap(), offer(n));
        }
    }

    /// Bad input on the side channel is a typed error, never a connection:
    /// no queue pairs, too many, truncated, hellos that disagree.
    #[test]
    fn a_bad_offer_is_a_typed_error() {
        assert!(offer(0).encode().is_err() && offer(MAX_QPS + 1).encode().is_err());
        let good = offer(2).encode().unwrap();
        let mut cases = vec![vec![0u8], vec![MAX_QPS as u8 + 1], good[..good.len() - 1].to_vec(), Vec::new()];
        let mut other = offer(1);
        other.key = "impostor".into();
        let mut mixed = vec![2u8];
        mixed.extend_from_slice(&offer(1).encode().unwrap()[1..]);
        mixed.extend_from_slice(&other.encode().unwrap()[1..]);
        cases.push(mixed);
        for c in cases {
            assert!(matches!(Offer::read_from(&mut &c[..]), Err(TransportError::Remote(_))), "{c:?}");
        }
        assert!(tickets_match(&[1; 16], &[1; 16]) && !tickets_match(&[1; 16], &[2; 16]));
    }
}
