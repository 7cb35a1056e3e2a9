//! Initiator side of the P2P handshake: fetch a segment descriptor, send a
//! notification, probe, pair RDMA queue pairs.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::error::EngineError;
use crate::proto::{
    ConnectionDesc, HandshakeFrame, HandshakeType, NotifyDesc, NotifyReply, SegmentDesc, MAX_HANDSHAKE_LEN,
};

/// Resolves a segment name `host:port` to a socket address.
pub fn resolve_segment(name: &str) -> Result<SocketAddr, EngineError> {
    name.to_socket_addrs().ok().and_then(|mut a| a.next()).ok_or_else(|| EngineError::BadSegmentName(name.to_string()))
}

/// One request/response exchange on a fresh handshake connection.
pub fn exchange(
    addr: SocketAddr,
    kind: HandshakeType,
    json: Vec<u8>,
    timeout: Duration,
) -> Result<HandshakeFrame, EngineError> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| EngineError::io(format!("connect handshake {addr}"), e))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| EngineError::io("set timeout", e))?;
    s.set_write_timeout(Some(timeout)).map_err(|e| EngineError::io("set timeout", e))?;
    HandshakeFrame::new(kind, json).write_to(&mut s)?;
    let reply = HandshakeFrame::read_from(&mut s, MAX_HANDSHAKE_LEN)?;
    if reply.kind != kind {
        return Err(EngineError::UnexpectedReply { expected: kind, got: reply.kind });
    }
    Ok(reply)
}

/// Fetches the peer's segment descriptor, sending ours (as Mooncake does).
pub fn fetch_metadata(addr: SocketAddr, local: &SegmentDesc, timeout: Duration) -> Result<SegmentDesc, EngineError> {
    let reply = exchange(addr, HandshakeType::Metadata, local.to_json(), timeout)?;
    Ok(SegmentDesc::from_json(&reply.json)?)
}

/// Sends a notification; `Ok` only if the peer replied `success`.
pub fn send_notify(addr: SocketAddr, msg: &NotifyDesc, timeout: Duration) -> Result<(), EngineError> {
    let reply = exchange(addr, HandshakeType::Notify, msg.to_json(), timeout)?;
    let r: NotifyReply = serde_json::from_slice(&reply.json).map_err(crate::proto::ProtoError::from)?;
    if r.is_success() {
        Ok(())
    } else {
        Err(EngineError::NotifyRejected(r.notify_msg))
    }
}

/// Probes a peer's handshake port.
pub fn probe(addr: SocketAddr, timeout: Duration) -> Result<(), EngineError> {
    exchange(addr, HandshakeType::Probe, b"{}\n".to_vec(), timeout).map(|_| ())
}

/// One Connection round (RDMA queue-pair exchange): `Err` if the peer
/// refused (a non-empty `reply_msg`) or its reply does not decode.
pub fn exchange_connection(
    addr: SocketAddr,
    msg: &ConnectionDesc,
    timeout: Duration,
) -> Result<ConnectionDesc, EngineError> {
    let reply = exchange(addr, HandshakeType::Connection, msg.to_json(), timeout)?;
    let c = ConnectionDesc::from_json(&reply.json)?;
    if !c.reply_msg.is_empty() {
        return Err(EngineError::ConnectionRejected(c.reply_msg));
    }
    Ok(c)
}
