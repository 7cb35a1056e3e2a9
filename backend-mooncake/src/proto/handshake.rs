//! P2P handshake framing: `u64` little-endian length (= 1 + JSON length), one
//! type byte, the JSON. A first byte above [`HandshakeType::Probe`] marks the
//! old, untyped protocol (the whole body is JSON, treated as a Connection).

use std::io::{Read, Write};

use super::ProtoError;

/// Default and minimum limit Mooncake applies to a handshake frame (1 MiB).
pub const MAX_HANDSHAKE_LEN: u64 = 1 << 20;

/// The type byte of [`HandshakeType::SealedNotify`]: not one of Mooncake's,
/// and no JSON text starts with it.
const SEALED_NOTIFY_BYTE: u8 = 0x10;

/// Handshake message type (the byte after the length).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandshakeType {
    /// Connection exchange (RDMA QP setup; also the old untyped protocol).
    Connection,
    /// Segment descriptor exchange.
    Metadata,
    /// A notification.
    Notify,
    /// A liveness probe.
    Probe,
    /// kv-transfer's own: a sealed notification follows (core's peer
    /// handshake, then a Notify frame and its session tag; see
    /// [`crate::sealed`]). Sent only to an engine whose descriptor
    /// advertises it; a real Mooncake engine reads it as the old protocol
    /// and closes the connection.
    SealedNotify,
    /// Old protocol: no type byte, the body is JSON (treated as Connection).
    OldProtocol,
}

impl HandshakeType {
    /// The wire byte, `None` for [`HandshakeType::OldProtocol`] (no byte).
    pub fn wire_byte(self) -> Option<u8> {
        match self {
            HandshakeType::Connection => Some(0),
            HandshakeType::Metadata => Some(1),
            HandshakeType::Notify => Some(2),
            HandshakeType::Probe => Some(3),
            HandshakeType::SealedNotify => Some(SEALED_NOTIFY_BYTE),
            HandshakeType::OldProtocol => None,
        }
    }
}

/// One decoded handshake frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeFrame {
    /// The message type.
    pub kind: HandshakeType,
    /// The JSON body (bytes; may carry a trailing newline as jsoncpp writes it).
    pub json: Vec<u8>,
}

impl HandshakeFrame {
    /// Builds a frame.
    pub fn new(kind: HandshakeType, json: impl Into<Vec<u8>>) -> Self {
        Self { kind, json: json.into() }
    }

    /// Encodes the frame, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let tb = self.kind.wire_byte();
        let len = self.json.len() as u64 + u64::from(tb.is_some());
        let mut out = Vec::with_capacity(8 + len as usize);
        out.extend_from_slice(&len.to_le_bytes());
        if let Some(b) = tb {
            out.push(b);
        }
        out.extend_from_slice(&self.json);
        out
    }

    /// Decodes one complete frame from `buf`, returning it and the bytes used.
    pub fn decode(buf: &[u8], max_len: u64) -> Result<(Self, usize), ProtoError> {
        let hdr: [u8; 8] =
            buf.get(..8).and_then(|s| s.try_into().ok()).ok_or(ProtoError::Truncated { need: 8, have: buf.len() })?;
        let len = Self::check_len(u64::from_le_bytes(hdr), max_len)?;
        let end = len.checked_add(8).ok_or(ProtoError::Oversize { len: len as u64, max: max_len })?;
        let body = buf.get(8..end).ok_or(ProtoError::Truncated { need: end, have: buf.len() })?;
        Ok((Self::from_body(body), end))
    }

    fn check_len(len: u64, max_len: u64) -> Result<usize, ProtoError> {
        if len == 0 {
            return Err(ProtoError::ZeroLength);
        }
        if len > max_len {
            return Err(ProtoError::Oversize { len, max: max_len });
        }
        usize::try_from(len).map_err(|_| ProtoError::Oversize { len, max: max_len })
    }

    fn from_body(body: &[u8]) -> Self {
        match body.first() {
            Some(&b) if b <= 3 => {
                let kind = match b {
                    0 => HandshakeType::Connection,
                    1 => HandshakeType::Metadata,
                    2 => HandshakeType::Notify,
                    _ => HandshakeType::Probe,
                };
                Self { kind, json: body[1..].to_vec() }
            }
            Some(&SEALED_NOTIFY_BYTE) => Self { kind: HandshakeType::SealedNotify, json: body[1..].to_vec() },
            _ => Self { kind: HandshakeType::OldProtocol, json: body.to_vec() },
        }
    }

    /// Reads one frame from a stream (blocking), enforcing `max_len`.
    pub fn read_from<R: Read>(r: &mut R, max_len: u64) -> Result<Self, ProtoError> {
        let mut hdr = [0u8; 8];
        read_exact(r, &mut hdr)?;
        let len = Self::check_len(u64::from_le_bytes(hdr), max_len)?;
        // Grown as bytes arrive, not allocated from the declared length: a
        // peer that declares 1 MiB and sends nothing costs nothing.
        let mut body = Vec::with_capacity(len.min(64 << 10));
        let mut take = r.take(len as u64);
        loop {
            match take.read_to_end(&mut body) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ProtoError::Io(e.to_string())),
            }
        }
        if body.len() < len {
            return Err(ProtoError::Truncated { need: len, have: body.len() });
        }
        Ok(Self::from_body(&body))
    }

    /// Writes the frame to a stream in one call.
    pub fn write_to<W: Write>(&self, w: &mut W) -> Result<(), ProtoError> {
        w.write_all(&self.encode()).map_err(|e| ProtoError::Io(e.to_string()))?;
        w.flush().map_err(|e| ProtoError::Io(e.to_string()))
    }
}

fn read_exact<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<(), ProtoError> {
    let mut have = 0;
    while have < buf.len() {
        match r.read(&mut buf[have..]) {
            Ok(0) => return Err(ProtoError::Truncated { need: buf.len(), have }),
            Ok(n) => have += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ProtoError::Io(e.to_string())),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_all_types() {
        for k in [
            HandshakeType::Connection,
            HandshakeType::Metadata,
            HandshakeType::Notify,
            HandshakeType::Probe,
            HandshakeType::SealedNotify,
        ] {
            let f = HandshakeFrame::new(k, b"{\"a\":1}".to_vec());
            let enc = f.encode();
            assert_eq!(u64::from_le_bytes(enc[..8].try_into().unwrap()), 8);
            let (d, used) = HandshakeFrame::decode(&enc, MAX_HANDSHAKE_LEN).unwrap();
            assert_eq!(used, enc.len());
            assert_eq!(d, f);
            let d2 = HandshakeFrame::read_from(&mut &enc[..], MAX_HANDSHAKE_LEN).unwrap();
            assert_eq!(d2, f);
        }
    }

    #[test]
    fn old_protocol_and_errors() {
        let mut enc = 2u64.to_le_bytes().to_vec();
        enc.extend_from_slice(b"{}");
        let (d, _) = HandshakeFrame::decode(&enc, MAX_HANDSHAKE_LEN).unwrap();
        assert_eq!(d.kind, HandshakeType::OldProtocol);
        assert_eq!(d.json, b"{}");
        assert_eq!(HandshakeFrame::decode(&0u64.to_le_bytes(), 10), Err(ProtoError::ZeroLength));
        assert!(matches!(HandshakeFrame::decode(&11u64.to_le_bytes(), 10), Err(ProtoError::Oversize { .. })));
        assert!(matches!(
            HandshakeFrame::decode(&u64::MAX.to_le_bytes(), u64::MAX),
            Err(ProtoError::Truncated { .. }) | Err(ProtoError::Oversize { .. })
        ));
        assert!(matches!(HandshakeFrame::decode(&[1, 2, 3], 10), Err(ProtoError::Truncated { .. })));
        let mut short = 5u64.to_le_bytes().to_vec();
        short.push(1);
        assert!(matches!(HandshakeFrame::read_from(&mut &short[..], 10), Err(ProtoError::Truncated { .. })));
    }
}
