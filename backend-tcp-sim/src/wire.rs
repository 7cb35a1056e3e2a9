//! The simulator's frame codec: pure, I/O-free, never panics (the layering of
//! `quinn-proto` under `quinn`). The NIC reads a fixed [`PREFIX_LEN`]-byte
//! prefix, then the frame's fields, then (for data frames) streams the payload
//! straight into registered memory; [`decode`] does the same on a buffer and is
//! what the fuzz target drives.
//!
//! Layout (little endian):
//!
//! ```text
//! prefix   magic:u16 = 0x4B56 | kind:u8 | flags:u8 | len:u32   (len = bytes after the prefix)
//!          flags: 0, except WRITE_IMM's, which is the immediate's length (at most MAX_IMM)
//! HELLO      name_len:u16 name endpoint_len:u16 endpoint
//! WRITE      wr_id:u64 key:u64 addr:u64 slot:u32 generation:u64 | payload (len - 36 bytes)
//! WRITE_IMM  as WRITE, then imm (flags bytes) | payload (len - 36 - flags bytes)
//! READ       wr_id:u64 key:u64 addr:u64 slot:u32 generation:u64 read_len:u32
//! READ_RESP  wr_id:u64 status:u8 reason:u8 | payload (len - 10 bytes)
//! COMPLETION wr_id:u64 status:u8 reason:u8
//! CONTROL    one DONE / ABORT / ABORT_ACK in core's drain codec (kv_transfer_core::drain)
//! ```
//!
//!
//! Before the HELLO, each connection runs core's peer handshake
//! (`kv_transfer_core::auth`) under the context [`AUTH_CONTEXT`]: both ends
//! prove the cluster key, and the HELLO must name what the handshake
//! proved. [`authenticate_dialed`] and [`authenticate_accepted`] run it on
//! a socket, for a peer that speaks the wire format by hand.
//!
//! ```
//! use backend_tcp_sim::wire::{self, AccessHeader, Body, WireStatus};
//! use kv_transfer_core::{Generation, SlotId};
//!
//! let h = AccessHeader { wr_id: 7, key: 1, addr: 4096, slot: SlotId(1), generation: Generation(3), len: 4 };
//! let mut buf = wire::encode_head(&Body::Write(h), 4).unwrap();
//! buf.extend_from_slice(b"abcd");
//! let d = wire::decode(&buf).unwrap();
//! assert_eq!(d.body, Body::Write(h));
//! assert_eq!(d.payload, b"abcd");
//! assert_eq!(d.consumed, buf.len());
//! // Truncated input is a typed error, never a panic.
//! assert!(matches!(wire::decode(&buf[..10]), Err(wire::DecodeError::Truncated { .. })));
//! # let _ = WireStatus::Ok;
//! ```

use kv_transfer_core::drain::{self, ControlMessage};
use kv_transfer_core::{Generation, RejectReason, SlotId};

/// First two bytes of every frame.
pub const MAGIC: u16 = 0x4B56;
/// Bytes of the fixed prefix.
pub const PREFIX_LEN: usize = 8;
/// Largest payload a data frame may carry (WRITE, READ_RESP). A larger length
/// cannot be decoded: the stream is torn down.
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Largest body of a control frame.
pub const MAX_CONTROL: u32 = 64 << 10;
/// Longest immediate a WRITE_IMM carries.
pub const MAX_IMM: usize = 64;
/// Most tenancies one CONTROL frame may carry (core's codec limit).
pub const MAX_TENANCIES: usize = drain::MAX_TENANCIES;
/// Longest name or endpoint in a HELLO.
pub const MAX_NAME: usize = 1024;

/// Bytes of fields in front of a WRITE's payload.
pub const WRITE_FIELDS: usize = 36;
/// Bytes of a READ's fields.
pub const READ_FIELDS: usize = 40;
/// Bytes of fields of a READ_RESP (in front of its payload) and of a COMPLETION.
pub const STATUS_FIELDS: usize = 10;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Handshake: the NIC's name and listening endpoint.
    Hello = 1,
    /// One-sided write of one slot's range.
    Write = 2,
    /// One-sided read of one slot's range.
    Read = 3,
    /// The data (or failure) of a READ.
    ReadResp = 4,
    /// Terminal status of a WRITE, sent by the target after it applied (or rejected) it.
    Completion = 5,
    /// One control message of the drain protocol (DONE after the data,
    /// ABORT, ABORT_ACK), in core's codec. (Kinds 7 and 8 are retired.)
    Control = 6,
    /// Application messages: the payload (at most [`MAX_CONTROL`] bytes) is
    /// one or more records, each a `u32` length and that many bytes (see
    /// [`split_messages`]), delivered in order with the connection's other
    /// frames. A sender appends to a frame still queued, so a burst of small
    /// messages crosses as one frame.
    Message = 9,
    /// A WRITE with immediate data (at most [`MAX_IMM`] bytes): the target
    /// hands the immediate to the application as a message once the payload
    /// is applied, and only then (a rejected write delivers nothing), like
    /// RDMA's WRITE_WITH_IMM.
    WriteImm = 10,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Hello,
            2 => Self::Write,
            3 => Self::Read,
            4 => Self::ReadResp,
            5 => Self::Completion,
            6 => Self::Control,
            9 => Self::Message,
            10 => Self::WriteImm,
            _ => return None,
        })
    }
}

/// Why bytes are not a frame. Every malformed input maps to one of these.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// More bytes are needed.
    #[error("truncated: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes needed for the next step.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first two bytes are not [`MAGIC`].
    #[error("bad magic {0:#06x}")]
    BadMagic(u16),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Non-zero flags (reserved).
    #[error("reserved flags set: {0:#04x}")]
    BadFlags(u8),
    /// A length beyond the codec's limits.
    #[error("frame of kind {kind:?} declares {len} bytes; at most {max} allowed")]
    Oversize {
        /// Frame kind.
        kind: Kind,
        /// Declared length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A length that does not fit the kind's fixed fields.
    #[error("frame of kind {kind:?} cannot be {len} bytes long")]
    BadLength {
        /// Frame kind.
        kind: Kind,
        /// Declared length.
        len: u32,
    },
    /// Unknown completion status or reject reason.
    #[error("unknown status {status}/{reason}")]
    BadStatus {
        /// Status byte.
        status: u8,
        /// Reason byte.
        reason: u8,
    },
    /// A name or endpoint that is not UTF-8 or too long.
    #[error("bad name in HELLO")]
    BadName,
    /// A CONTROL frame whose message core's codec refuses.
    #[error("control message: {0}")]
    Control(#[from] drain::DecodeError),
}

/// Why a frame cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// Payload longer than [`MAX_PAYLOAD`], or a payload on a frame kind without one.
    #[error("payload of {0} bytes not allowed here")]
    Payload(usize),
    /// A control message core's codec refuses to encode.
    #[error("control message: {0}")]
    Control(#[from] drain::EncodeError),
    /// Name or endpoint longer than [`MAX_NAME`].
    #[error("name too long")]
    NameTooLong,
}

/// The fixed prefix of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    /// Frame kind.
    pub kind: Kind,
    /// Bytes after the prefix (fields and payload).
    pub len: u32,
    /// Length of a WRITE_IMM's immediate (0 for every other kind).
    pub imm_len: u8,
}

impl Prefix {
    /// Bytes of fields that follow the prefix (everything but the payload).
    pub fn fields_len(&self) -> usize {
        match self.kind {
            Kind::Write => WRITE_FIELDS,
            Kind::WriteImm => WRITE_FIELDS + self.imm_len as usize,
            Kind::ReadResp => STATUS_FIELDS,
            Kind::Message => 0,
            _ => self.len as usize,
        }
    }
    /// Bytes of payload after the fields.
    pub fn payload_len(&self) -> usize {
        self.len as usize - self.fields_len()
    }
}

/// Where a one-sided access goes: one slot's range at the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AccessHeader {
    /// Initiator's work-request id, echoed by the completion.
    pub wr_id: u64,
    /// The target region's key.
    pub key: u64,
    /// Target address (inside the slot's range).
    pub addr: u64,
    /// The slot the access is for.
    pub slot: SlotId,
    /// The tenancy's generation: the target checks it against the bound one.
    pub generation: Generation,
    /// Bytes written (WRITE: the payload's length) or asked for (READ).
    pub len: u32,
}

/// The immediate data of a WRITE_IMM: at most [`MAX_IMM`] bytes, kept in place.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Immediate {
    len: u8,
    bytes: [u8; MAX_IMM],
}

impl Immediate {
    /// `bytes` as an immediate; `None` if longer than [`MAX_IMM`].
    pub fn new(bytes: &[u8]) -> Option<Self> {
        let len = u8::try_from(bytes.len()).ok().filter(|l| usize::from(*l) <= MAX_IMM)?;
        let mut b = [0u8; MAX_IMM];
        b[..bytes.len()].copy_from_slice(bytes);
        Some(Self { len, bytes: b })
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::fmt::Debug for Immediate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Immediate").field(&self.as_bytes()).finish()
    }
}

/// Terminal status of one work request on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireStatus {
    /// Applied (WRITE) or read (READ).
    Ok,
    /// Refused by the target's NIC; nothing was written.
    Rejected(RejectReason),
    /// The target failed to access its memory.
    TargetError,
}

impl WireStatus {
    fn to_bytes(self) -> [u8; 2] {
        match self {
            Self::Ok => [0, 0],
            Self::Rejected(r) => [
                1,
                match r {
                    RejectReason::OutOfBounds => 1,
                    RejectReason::UnknownKey => 2,
                    RejectReason::StaleGeneration => 3,
                    RejectReason::ZeroLength => 4,
                    RejectReason::Oversize => 5,
                    // RejectReason is non_exhaustive; a future reason travels as "unknown".
                    _ => 255,
                },
            ],
            Self::TargetError => [2, 0],
        }
    }
    fn from_bytes(status: u8, reason: u8) -> Result<Self, DecodeError> {
        let bad = DecodeError::BadStatus { status, reason };
        match (status, reason) {
            (0, 0) => Ok(Self::Ok),
            (1, r) => Ok(Self::Rejected(match r {
                1 => RejectReason::OutOfBounds,
                2 => RejectReason::UnknownKey,
                3 => RejectReason::StaleGeneration,
                4 => RejectReason::ZeroLength,
                5 => RejectReason::Oversize,
                _ => return Err(bad),
            })),
            (2, 0) => Ok(Self::TargetError),
            _ => Err(bad),
        }
    }
}

/// A decoded frame without its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    /// Handshake.
    Hello {
        /// The NIC's name.
        name: String,
        /// Where it listens.
        endpoint: String,
    },
    /// One-sided write; `len` is the payload's length.
    Write(AccessHeader),
    /// One-sided write with immediate data for the target's application.
    WriteImm(AccessHeader, Immediate),
    /// One-sided read.
    Read(AccessHeader),
    /// The answer to a READ; its payload follows.
    ReadResp {
        /// The READ's id.
        wr_id: u64,
        /// Its status.
        status: WireStatus,
    },
    /// Terminal status of a WRITE.
    Completion {
        /// The WRITE's id.
        wr_id: u64,
        /// Its status.
        status: WireStatus,
    },
    /// A drain-protocol message (DONE, ABORT, ABORT_ACK).
    Control(ControlMessage),
    /// An application message; its payload follows.
    Message,
}

impl Body {
    /// The frame kind.
    pub fn kind(&self) -> Kind {
        match self {
            Self::Hello { .. } => Kind::Hello,
            Self::Write(_) => Kind::Write,
            Self::WriteImm(..) => Kind::WriteImm,
            Self::Read(_) => Kind::Read,
            Self::ReadResp { .. } => Kind::ReadResp,
            Self::Completion { .. } => Kind::Completion,
            Self::Control(_) => Kind::Control,
            Self::Message => Kind::Message,
        }
    }
}

/// A frame decoded from a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded<'a> {
    /// The frame's fields.
    pub body: Body,
    /// Its payload (empty for frames without one).
    pub payload: &'a [u8],
    /// Bytes of the buffer the frame used.
    pub consumed: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.b.len() < n {
            return Err(DecodeError::Truncated { needed: n, have: self.b.len() });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.arr::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn name(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_NAME {
            return Err(DecodeError::BadName);
        }
        let s = self.take(n)?;
        std::str::from_utf8(s).map(str::to_owned).map_err(|_| DecodeError::BadName)
    }
}

/// Decodes and validates a frame's prefix (the first [`PREFIX_LEN`] bytes of
/// `b`). Checks magic, kind, flags, and the length against the kind's limits.
pub fn decode_prefix(b: &[u8]) -> Result<Prefix, DecodeError> {
    let mut c = Cursor { b };
    let p = c.arr::<PREFIX_LEN>()?;
    let magic = u16::from_le_bytes([p[0], p[1]]);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let kind = Kind::from_u8(p[2]).ok_or(DecodeError::UnknownKind(p[2]))?;
    let imm_len = match (kind, p[3]) {
        (_, 0) => 0,
        (Kind::WriteImm, n) if usize::from(n) <= MAX_IMM => n,
        (_, f) => return Err(DecodeError::BadFlags(f)),
    };
    let len = u32::from_le_bytes([p[4], p[5], p[6], p[7]]);
    let bad_len = DecodeError::BadLength { kind, len };
    match kind {
        Kind::Write | Kind::WriteImm | Kind::ReadResp => {
            let fixed = match kind {
                Kind::Write => WRITE_FIELDS,
                Kind::WriteImm => WRITE_FIELDS + usize::from(imm_len),
                _ => STATUS_FIELDS,
            } as u32;
            if len < fixed {
                return Err(bad_len);
            }
            if len - fixed > MAX_PAYLOAD {
                return Err(DecodeError::Oversize { kind, len, max: MAX_PAYLOAD + fixed });
            }
        }
        Kind::Read if len as usize != READ_FIELDS => return Err(bad_len),
        Kind::Completion if len as usize != STATUS_FIELDS => return Err(bad_len),
        Kind::Hello if len > MAX_CONTROL => {
            return Err(DecodeError::Oversize { kind, len, max: MAX_CONTROL });
        }
        Kind::Control if len as usize > drain::MAX_LEN => {
            return Err(DecodeError::Oversize { kind, len, max: drain::MAX_LEN as u32 });
        }
        Kind::Control if (len as usize) < drain::HEADER_LEN => return Err(bad_len),
        Kind::Message if len > MAX_CONTROL => {
            return Err(DecodeError::Oversize { kind, len, max: MAX_CONTROL });
        }
        Kind::Read | Kind::Completion | Kind::Message | Kind::Hello | Kind::Control => {}
    }
    Ok(Prefix { kind, len, imm_len })
}

/// Decodes a frame's fields (`fields` must be exactly
/// [`Prefix::fields_len`] bytes).
pub fn decode_fields(prefix: &Prefix, fields: &[u8]) -> Result<Body, DecodeError> {
    if fields.len() != prefix.fields_len() {
        return Err(DecodeError::BadLength { kind: prefix.kind, len: prefix.len });
    }
    let mut c = Cursor { b: fields };
    let body = match prefix.kind {
        Kind::Hello => {
            let name = c.name()?;
            let endpoint = c.name()?;
            Body::Hello { name, endpoint }
        }
        Kind::Write | Kind::WriteImm | Kind::Read => {
            let wr_id = c.u64()?;
            let key = c.u64()?;
            let addr = c.u64()?;
            let slot = SlotId(c.u32()?);
            let generation = Generation(c.u64()?);
            let len = if prefix.kind == Kind::Read { c.u32()? } else { prefix.payload_len() as u32 };
            let h = AccessHeader { wr_id, key, addr, slot, generation, len };
            match prefix.kind {
                Kind::Write => Body::Write(h),
                Kind::Read => Body::Read(h),
                _ => {
                    let imm = Immediate::new(c.take(usize::from(prefix.imm_len))?)
                        .ok_or(DecodeError::BadFlags(prefix.imm_len))?;
                    Body::WriteImm(h, imm)
                }
            }
        }
        Kind::ReadResp | Kind::Completion => {
            let wr_id = c.u64()?;
            let status = c.u8()?;
            let reason = c.u8()?;
            let status = WireStatus::from_bytes(status, reason)?;
            if prefix.kind == Kind::ReadResp {
                if status != WireStatus::Ok && prefix.payload_len() != 0 {
                    return Err(DecodeError::BadLength { kind: prefix.kind, len: prefix.len });
                }
                Body::ReadResp { wr_id, status }
            } else {
                Body::Completion { wr_id, status }
            }
        }
        Kind::Control => {
            let m = ControlMessage::decode(c.b)?;
            c.b = &[];
            Body::Control(m)
        }
        Kind::Message => Body::Message,
    };
    if !c.b.is_empty() {
        return Err(DecodeError::BadLength { kind: prefix.kind, len: prefix.len });
    }
    Ok(body)
}

/// Bytes of a message record's length prefix.
pub const RECORD_PREFIX: usize = 4;

/// Appends one message record (length, then bytes) to a Message payload.
pub fn push_message(payload: &mut Vec<u8>, msg: &[u8]) -> Result<(), EncodeError> {
    let len = u32::try_from(msg.len()).map_err(|_| EncodeError::Payload(msg.len()))?;
    if payload.len() + RECORD_PREFIX + msg.len() > MAX_CONTROL as usize {
        return Err(EncodeError::Payload(payload.len() + RECORD_PREFIX + msg.len()));
    }
    payload.extend_from_slice(&len.to_le_bytes());
    payload.extend_from_slice(msg);
    Ok(())
}

/// The records of a Message payload, all checked before any is returned (a
/// malformed payload yields none). The records are borrowed from `payload`,
/// in order; nothing is allocated.
pub fn split_messages(payload: &[u8]) -> Result<Messages<'_>, DecodeError> {
    let bad = DecodeError::BadLength { kind: Kind::Message, len: payload.len() as u32 };
    let mut count = 0;
    let mut rest = payload;
    // Bounded: every turn consumes at least RECORD_PREFIX bytes.
    while !rest.is_empty() {
        let (len, tail) = rest.split_first_chunk::<RECORD_PREFIX>().ok_or_else(|| bad.clone())?;
        let len = u32::from_le_bytes(*len) as usize;
        if tail.len() < len {
            return Err(bad);
        }
        rest = &tail[len..];
        count += 1;
    }
    if count == 0 {
        return Err(bad);
    }
    Ok(Messages { rest: payload, left: count })
}

/// The records of a checked Message payload ([`split_messages`]).
#[derive(Clone, Debug)]
pub struct Messages<'a> {
    rest: &'a [u8],
    left: usize,
}

impl<'a> Iterator for Messages<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        // Checked by `split_messages`: every record is whole.
        let (len, tail) = self.rest.split_first_chunk::<RECORD_PREFIX>()?;
        let (msg, tail) = tail.split_at_checked(u32::from_le_bytes(*len) as usize)?;
        self.rest = tail;
        self.left = self.left.saturating_sub(1);
        Some(msg)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Messages<'_> {}

/// Decodes one whole frame from the front of `buf`.
pub fn decode(buf: &[u8]) -> Result<Decoded<'_>, DecodeError> {
    let prefix = decode_prefix(buf)?;
    let rest = &buf[PREFIX_LEN..];
    let total = prefix.len as usize;
    if rest.len() < total {
        return Err(DecodeError::Truncated { needed: PREFIX_LEN + total, have: buf.len() });
    }
    let fl = prefix.fields_len();
    let body = decode_fields(&prefix, &rest[..fl])?;
    Ok(Decoded { body, payload: &rest[fl..total], consumed: PREFIX_LEN + total })
}

fn put_name(out: &mut Vec<u8>, s: &str) -> Result<(), EncodeError> {
    if s.len() > MAX_NAME {
        return Err(EncodeError::NameTooLong);
    }
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Encodes a frame's prefix and fields; a data frame's `payload_len` bytes of
/// payload must follow (WRITE: `payload_len` must equal the header's `len`).
pub fn encode_head(body: &Body, payload_len: usize) -> Result<Vec<u8>, EncodeError> {
    let has_payload = matches!(body, Body::Write(_) | Body::WriteImm(..) | Body::ReadResp { .. } | Body::Message);
    let max = if matches!(body, Body::Message) { MAX_CONTROL } else { MAX_PAYLOAD };
    if (!has_payload && payload_len != 0) || payload_len > max as usize {
        return Err(EncodeError::Payload(payload_len));
    }
    if let Body::Write(h) | Body::WriteImm(h, _) = body {
        if h.len as usize != payload_len {
            return Err(EncodeError::Payload(payload_len));
        }
    }
    let imm = match body {
        Body::WriteImm(_, imm) => imm.as_bytes(),
        _ => &[],
    };
    let mut out = Vec::with_capacity(PREFIX_LEN + READ_FIELDS + imm.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(body.kind() as u8);
    // The flags byte: the immediate's length (`Immediate` holds at most MAX_IMM).
    out.push(imm.len() as u8);
    out.extend_from_slice(&[0; 4]);
    match body {
        Body::Hello { name, endpoint } => {
            put_name(&mut out, name)?;
            put_name(&mut out, endpoint)?;
        }
        Body::Write(h) | Body::WriteImm(h, _) | Body::Read(h) => {
            out.extend_from_slice(&h.wr_id.to_le_bytes());
            out.extend_from_slice(&h.key.to_le_bytes());
            out.extend_from_slice(&h.addr.to_le_bytes());
            out.extend_from_slice(&h.slot.0.to_le_bytes());
            out.extend_from_slice(&h.generation.0.to_le_bytes());
            if matches!(body, Body::Read(_)) {
                out.extend_from_slice(&h.len.to_le_bytes());
            }
            out.extend_from_slice(imm);
        }
        Body::ReadResp { wr_id, status } | Body::Completion { wr_id, status } => {
            if matches!(body, Body::ReadResp { .. }) && *status != WireStatus::Ok && payload_len != 0 {
                return Err(EncodeError::Payload(payload_len));
            }
            out.extend_from_slice(&wr_id.to_le_bytes());
            out.extend_from_slice(&status.to_bytes());
        }
        Body::Control(m) => m.encode_into(&mut out)?,
        Body::Message => {}
    }
    let len = (out.len() - PREFIX_LEN + payload_len) as u32;
    out[4..8].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// The peer handshake's context for the simulator's connections: a
/// handshake for another protocol is refused.
pub const AUTH_CONTEXT: &str = "kvt-tcp-sim";

/// The dialer's side of the peer handshake on `s`, as `name` at `endpoint`,
/// having dialed `dialed` (exactly as connected to), under `key`; the HELLO
/// exchange follows it. Bounded by `s`'s timeouts.
pub fn authenticate_dialed(
    s: &mut std::net::TcpStream,
    key: &kv_transfer_core::auth::ClusterKey,
    name: &str,
    endpoint: &str,
    dialed: &str,
) -> Result<kv_transfer_core::auth::Established, kv_transfer_core::auth::AuthError> {
    use kv_transfer_core::auth::{dial, AuthCounters, DialerConfig, Identity};
    let cfg = DialerConfig {
        key: key.clone(),
        context: AUTH_CONTEXT.into(),
        me: Identity::new(name, endpoint),
        dialed: dialed.into(),
        expect_name: None,
    };
    dial(s, cfg, &AuthCounters::default())
}

/// The acceptor's side of the peer handshake on an accepted `s`, as `name`
/// at `endpoint`, under `key`. Bounded by `s`'s timeouts.
pub fn authenticate_accepted(
    s: &mut std::net::TcpStream,
    key: &kv_transfer_core::auth::ClusterKey,
    name: &str,
    endpoint: &str,
) -> Result<kv_transfer_core::auth::Established, kv_transfer_core::auth::AuthError> {
    use kv_transfer_core::auth::{accept, AcceptorConfig, AuthCounters, Identity};
    let mut cfg = AcceptorConfig::new(key.clone(), AUTH_CONTEXT, Identity::new(name, endpoint));
    if let Ok(local) = s.local_addr() {
        cfg.addresses.push(local.to_string());
    }
    let source = s.peer_addr().ok().map(|a| a.ip());
    accept(s, &cfg, source, &AuthCounters::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control(kind: drain::ControlKind) -> ControlMessage {
        use kv_transfer_core::{PoolId, Tenancy};
        let ts = vec![Tenancy::new(SlotId(1), Generation(2)), Tenancy::new(SlotId(3), Generation(4))];
        ControlMessage::new(kind, PoolId(9), drain::ExposureToken::from_bytes([5; 16]), ts)
    }

    #[test]
    fn round_trips() {
        let h = AccessHeader { wr_id: 1, key: 2, addr: 3, slot: SlotId(4), generation: Generation(5), len: 6 };
        let bodies = [
            (Body::Hello { name: "a".into(), endpoint: "127.0.0.1:1".into() }, 0),
            (Body::Write(h), 6),
            (Body::WriteImm(h, Immediate::new(b"notify").unwrap()), 6),
            (Body::WriteImm(h, Immediate::new(&[9; MAX_IMM]).unwrap()), 6),
            (Body::Read(h), 0),
            (Body::ReadResp { wr_id: 1, status: WireStatus::Ok }, 3),
            (Body::ReadResp { wr_id: 1, status: WireStatus::Rejected(RejectReason::StaleGeneration) }, 0),
            (Body::Completion { wr_id: 1, status: WireStatus::TargetError }, 0),
            (Body::Control(control(drain::ControlKind::Done)), 0),
            (Body::Control(control(drain::ControlKind::Abort)), 0),
            (Body::Control(control(drain::ControlKind::AbortAck)), 0),
            (Body::Message, 0),
            (Body::Message, 33),
        ];
        for (b, pl) in bodies {
            let mut buf = encode_head(&b, pl).unwrap();
            buf.extend_from_slice(&vec![0xAB; pl]);
            let d = decode(&buf).unwrap();
            assert_eq!(d.body, b);
            assert_eq!(d.payload.len(), pl);
            assert_eq!(d.consumed, buf.len());
            for cut in 0..buf.len() {
                assert!(decode(&buf[..cut]).is_err());
            }
        }
    }

    #[test]
    fn message_records() {
        let mut p = Vec::new();
        push_message(&mut p, b"one").unwrap();
        push_message(&mut p, b"").unwrap();
        push_message(&mut p, &[7; 100]).unwrap();
        let got = split_messages(&p).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got.collect::<Vec<_>>(), vec![&b"one"[..], &b""[..], &[7u8; 100][..]]);
        // Truncated, trailing garbage, empty: typed errors, nothing returned.
        assert!(split_messages(&p[..p.len() - 1]).is_err());
        assert!(split_messages(&p[..2]).is_err());
        assert!(split_messages(&[]).is_err());
        // The frame limit holds for the sum.
        let mut big = Vec::new();
        assert!(push_message(&mut big, &vec![0; MAX_CONTROL as usize]).is_err());
        assert!(big.is_empty());
    }

    #[test]
    fn typed_errors() {
        assert_eq!(decode(&[0x00, 0x00, 1, 0, 0, 0, 0, 0]), Err(DecodeError::BadMagic(0)));
        assert_eq!(decode(&[0x56, 0x4B, 99, 0, 0, 0, 0, 0]), Err(DecodeError::UnknownKind(99)));
        assert_eq!(decode(&[0x56, 0x4B, 2, 1, 0, 0, 0, 0]), Err(DecodeError::BadFlags(1)));
        // Flags are a WRITE_IMM's immediate length only, and at most MAX_IMM.
        assert_eq!(decode(&[0x56, 0x4B, 10, MAX_IMM as u8 + 1, 0, 0, 0, 0]), Err(DecodeError::BadFlags(65)));
        assert!(matches!(decode(&[0x56, 0x4B, 10, 4, 39, 0, 0, 0]), Err(DecodeError::BadLength { .. })));
        assert!(Immediate::new(&[0; MAX_IMM + 1]).is_none());
        assert!(matches!(decode(&[0x56, 0x4B, 2, 0, 0xff, 0xff, 0xff, 0xff]), Err(DecodeError::Oversize { .. })));
        assert!(matches!(decode(&[0x56, 0x4B, 5, 0, 3, 0, 0, 0]), Err(DecodeError::BadLength { .. })));
        let mut c = encode_head(&Body::Completion { wr_id: 1, status: WireStatus::Ok }, 0).unwrap();
        c[16] = 7;
        assert!(matches!(decode(&c), Err(DecodeError::BadStatus { .. })));
        let big = (MAX_CONTROL + 1).to_le_bytes();
        let m = [0x56, 0x4B, 9, 0, big[0], big[1], big[2], big[3]];
        assert!(matches!(decode(&m), Err(DecodeError::Oversize { kind: Kind::Message, .. })));
        assert_eq!(
            encode_head(&Body::Message, MAX_CONTROL as usize + 1),
            Err(EncodeError::Payload(MAX_CONTROL as usize + 1))
        );
    }
}
