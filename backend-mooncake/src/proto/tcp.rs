//! TCP transport framing: the 24-byte request header and the v2 status word.

use super::ProtoError;

/// Size of a request header on the wire (C struct `{u64 size; u64 addr; u8
/// opcode;}` without packing: 7 padding bytes).
pub const HEADER_LEN: usize = 24;
/// Size of a status word.
pub const STATUS_LEN: usize = 8;
/// Magic in the high 32 bits of a status word (`"MCTV"`).
pub const STATUS_MAGIC: u32 = 0x4D43_5456;
/// Opcode flag marking a v2 request.
pub const V2_FLAG: u8 = 0x80;

/// Transfer opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TcpOpcode {
    /// Read from the remote (0).
    Read,
    /// Write to the remote (1).
    Write,
}

impl TcpOpcode {
    /// Wire value without the v2 flag.
    pub fn wire(self) -> u8 {
        match self {
            TcpOpcode::Read => 0,
            TcpOpcode::Write => 1,
        }
    }
}

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Payload size in bytes.
    pub size: u64,
    /// Target virtual address.
    pub addr: u64,
    /// Operation.
    pub opcode: TcpOpcode,
    /// Whether the v2 flag (0x80) is set: the peer expects status words.
    pub v2: bool,
}

impl RequestHeader {
    /// Encodes to the 24-byte wire form (padding zeroed).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = self.opcode.wire() | if self.v2 { V2_FLAG } else { 0 };
        b
    }

    /// Decodes from at least 24 bytes. Padding bytes are ignored.
    ///
    /// Mooncake's v1 server treats any opcode other than WRITE as READ; we are
    /// strict and reject unknown opcodes with [`ProtoError::UnknownOpcode`].
    pub fn decode(buf: &[u8]) -> Result<Self, ProtoError> {
        if buf.len() < HEADER_LEN {
            return Err(ProtoError::Truncated { need: HEADER_LEN, have: buf.len() });
        }
        let mut s = [0u8; 8];
        s.copy_from_slice(&buf[..8]);
        let size = u64::from_le_bytes(s);
        s.copy_from_slice(&buf[8..16]);
        let addr = u64::from_le_bytes(s);
        let raw = buf[16];
        let v2 = raw & V2_FLAG != 0;
        let opcode = match raw & !V2_FLAG {
            0 => TcpOpcode::Read,
            1 => TcpOpcode::Write,
            _ => return Err(ProtoError::UnknownOpcode(raw)),
        };
        Ok(Self { size, addr, opcode, v2 })
    }
}

/// The v2 status word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusWord {
    /// Request accepted (WRITE applied / READ data follows).
    Ok,
    /// Address range not inside one registered buffer (or size 0); the server
    /// closes the connection after sending it.
    AddrRejected,
}

impl StatusWord {
    /// Encodes to 8 little-endian bytes.
    pub fn encode(self) -> [u8; STATUS_LEN] {
        let low: u64 = match self {
            StatusWord::Ok => 0,
            StatusWord::AddrRejected => 1,
        };
        ((u64::from(STATUS_MAGIC) << 32) | low).to_le_bytes()
    }

    /// Decodes 8 bytes; a missing magic or unknown code is an error.
    pub fn decode(buf: &[u8]) -> Result<Self, ProtoError> {
        let b: [u8; 8] = buf
            .get(..STATUS_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(ProtoError::Truncated { need: STATUS_LEN, have: buf.len() })?;
        let w = u64::from_le_bytes(b);
        if (w >> 32) as u32 != STATUS_MAGIC {
            return Err(ProtoError::BadStatusMagic(w));
        }
        match w as u32 {
            0 => Ok(StatusWord::Ok),
            1 => Ok(StatusWord::AddrRejected),
            c => Err(ProtoError::UnknownStatus(c)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout() {
        let h = RequestHeader { size: 0x0102, addr: 0xAABB, opcode: TcpOpcode::Write, v2: true };
        let b = h.encode();
        assert_eq!(&b[..8], &0x0102u64.to_le_bytes());
        assert_eq!(&b[8..16], &0xAABBu64.to_le_bytes());
        assert_eq!(b[16], 0x81);
        assert_eq!(&b[17..], &[0u8; 7]);
        assert_eq!(RequestHeader::decode(&b).unwrap(), h);
        let mut r = b;
        r[16] = 0x00;
        assert_eq!(RequestHeader::decode(&r).unwrap().opcode, TcpOpcode::Read);
        assert!(!RequestHeader::decode(&r).unwrap().v2);
        r[16] = 0x02;
        assert_eq!(RequestHeader::decode(&r), Err(ProtoError::UnknownOpcode(2)));
        assert!(matches!(RequestHeader::decode(&b[..23]), Err(ProtoError::Truncated { .. })));
    }

    #[test]
    fn status_word() {
        assert_eq!(StatusWord::Ok.encode(), 0x4D43_5456_0000_0000u64.to_le_bytes());
        assert_eq!(StatusWord::AddrRejected.encode(), 0x4D43_5456_0000_0001u64.to_le_bytes());
        for s in [StatusWord::Ok, StatusWord::AddrRejected] {
            assert_eq!(StatusWord::decode(&s.encode()).unwrap(), s);
        }
        assert!(matches!(StatusWord::decode(&[0; 8]), Err(ProtoError::BadStatusMagic(0))));
        assert_eq!(StatusWord::decode(&0x4D43_5456_0000_0007u64.to_le_bytes()), Err(ProtoError::UnknownStatus(7)));
        assert!(matches!(StatusWord::decode(&[0; 3]), Err(ProtoError::Truncated { .. })));
    }
}
