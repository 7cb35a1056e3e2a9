//! Pure protocol codecs (no I/O beyond `Read`/`Write` helpers): the P2P
//! handshake framing, the segment descriptor and notify JSON, and the TCP
//! transport request header and status word.
//!
//! Every decoder returns a typed [`ProtoError`] on malformed, truncated or
//! oversize input and never panics.

pub mod handshake;
pub mod metadata;
pub mod rdma;
pub mod tcp;

pub use handshake::{HandshakeFrame, HandshakeType, MAX_HANDSHAKE_LEN};
pub use metadata::{BufferDesc, DeviceDesc, NotifyDesc, NotifyReply, ProbeReply, ProtoVersion, SegmentDesc};
pub use rdma::{ConnectionDesc, NicPath};
pub use tcp::{RequestHeader, StatusWord, TcpOpcode, HEADER_LEN, STATUS_LEN, STATUS_MAGIC};

/// A protocol decoding or validation error.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    /// Input ended before a complete message was read.
    #[error("truncated message: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A handshake frame announced a zero length.
    #[error("handshake frame with zero length")]
    ZeroLength,
    /// A handshake frame is larger than the configured limit.
    #[error("handshake frame of {len} bytes exceeds the limit of {max}")]
    Oversize {
        /// Announced length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The JSON body could not be parsed or does not have the expected shape.
    #[error("malformed JSON: {0}")]
    Json(String),
    /// The segment descriptor parsed but is not usable.
    #[error("invalid segment descriptor: {0}")]
    InvalidDescriptor(String),
    /// A TCP request header carried an unknown opcode.
    #[error("unknown TCP opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// A status word did not carry the `MCTV` magic.
    #[error("status word {0:#018x} has no MCTV magic")]
    BadStatusMagic(u64),
    /// A status word carried the magic but an unknown code.
    #[error("unknown status code {0}")]
    UnknownStatus(u32),
    /// An I/O error while reading or writing a frame.
    #[error("i/o error: {0}")]
    Io(String),
}

impl From<serde_json::Error> for ProtoError {
    fn from(e: serde_json::Error) -> Self {
        ProtoError::Json(e.to_string())
    }
}

#[cfg(test)]
mod fuzz_tests {
    use super::*;

    /// Deterministic xorshift so the test needs no extra dependency.
    fn next(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[test]
    fn decoders_never_panic_on_random_input() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..20_000 {
            let len = (next(&mut seed) % 64) as usize;
            let mut buf: Vec<u8> = (0..len).map(|_| next(&mut seed) as u8).collect();
            if round % 3 == 0 && buf.len() >= 8 {
                // Plausible lengths, to reach the body paths.
                let l = next(&mut seed) % 70;
                buf[..8].copy_from_slice(&l.to_le_bytes());
            }
            let _ = HandshakeFrame::decode(&buf, MAX_HANDSHAKE_LEN);
            let _ = HandshakeFrame::read_from(&mut &buf[..], 48);
            let _ = RequestHeader::decode(&buf);
            let _ = StatusWord::decode(&buf);
            let _ = SegmentDesc::from_json(&buf);
            let _ = NotifyDesc::from_json(&buf);
        }
        // Mutated real descriptors.
        let real = br#"{"buffers":[{"addr":140287034785792,"length":100663296,"name":"127.0.0.1:15101"}],"name":"127.0.0.1:15101","protocol":"tcp","rdma_server_name":"","tcp_data_host":"127.0.0.1","tcp_data_port":15414,"tcp_proto_version":2,"timestamp":"x"}"#;
        for _ in 0..5_000 {
            let mut m = real.to_vec();
            for _ in 0..3 {
                let i = (next(&mut seed) as usize) % m.len();
                m[i] = next(&mut seed) as u8;
            }
            if let Ok(d) = SegmentDesc::from_json(&m) {
                let _ = d.buffer_containing(next(&mut seed), next(&mut seed));
            }
        }
    }
}
