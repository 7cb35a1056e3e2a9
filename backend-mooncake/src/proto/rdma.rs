//! The RDMA parts of Mooncake's P2P handshake: the Connection message that
//! pairs queue pairs, NIC paths, and GIDs as Mooncake writes them.
//!
//! As captured between two real engines (0.3.13.post1 on Soft-RoCE, see
//! `docs/ENGINES.md`, "Mooncake over RDMA"): the initiator sends a Connection
//! (type 0) with its NIC path, the target's NIC path, its GID and one QP
//! number per queue pair; the target answers with the paths swapped and
//! its own QP numbers; then, on a second TCP connection, the initiator sends
//! the same message with `ready_ack: true`, answered by an empty record. A
//! non-empty `reply_msg` is a refusal. QP *i* pairs with the peer's QP *i*,
//! and both sides start their packet sequence numbers at 0.

use serde::{Deserialize, Serialize};

use super::ProtoError;

/// Queue pairs per endpoint (`MC_NUM_QP_PER_EP`).
pub const QPS_PER_ENDPOINT: usize = 2;
/// Bytes per work request (`MC_SLICE_SIZE`): one signaled WRITE or READ
/// with one SGE per slice.
pub const SLICE_SIZE: u64 = 64 * 1024;
/// The most QP numbers a Connection message may carry (bounds a hostile
/// peer's message; Mooncake sends [`QPS_PER_ENDPOINT`]).
pub const MAX_QPS_PER_ENDPOINT: usize = 64;

/// A Connection message (the keys in the order jsoncpp sorts them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionDesc {
    /// The sender's GID (16 colon-separated hex bytes).
    #[serde(default)]
    pub local_gid: String,
    /// The sender's LID (0 on RoCE).
    #[serde(default)]
    pub local_lid: u16,
    /// The sender's NIC path (`host:port@device`).
    #[serde(default)]
    pub local_nic_path: String,
    /// Unused by the RDMA transport (empty).
    #[serde(default)]
    pub payload: String,
    /// The receiver's NIC path, as the sender names it.
    #[serde(default)]
    pub peer_nic_path: String,
    /// The sender's QP numbers, QP *i* for the peer's QP *i*.
    #[serde(default)]
    pub qp_num: Vec<u32>,
    /// The ready round: `true` on the initiator's second message. Absent in
    /// a reply means the peer skips the ready round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ack: Option<bool>,
    /// Non-empty: the peer refused, and says why.
    #[serde(default)]
    pub reply_msg: String,
}

impl ConnectionDesc {
    /// Decodes and checks a Connection message: QP numbers are 24-bit and
    /// non-zero, at most [`MAX_QPS_PER_ENDPOINT`] of them, the GID parses
    /// (unless the message is a refusal, which carries no endpoint).
    pub fn from_json(json: &[u8]) -> Result<Self, ProtoError> {
        let v: serde_json::Value = serde_json::from_slice(json)?;
        if !v.is_object() {
            return Err(ProtoError::Json("a Connection message is a JSON object".into()));
        }
        let c: Self = serde_json::from_value(v)?;
        if !c.reply_msg.is_empty() {
            return Ok(c);
        }
        if c.qp_num.len() > MAX_QPS_PER_ENDPOINT {
            return Err(ProtoError::InvalidDescriptor(format!("{} QP numbers", c.qp_num.len())));
        }
        if let Some(q) = c.qp_num.iter().find(|q| **q == 0 || **q > 0x00ff_ffff) {
            return Err(ProtoError::InvalidDescriptor(format!("QP number {q} is not a 24-bit QP number")));
        }
        if !c.qp_num.is_empty() {
            parse_gid(&c.local_gid)?;
        }
        Ok(c)
    }

    /// Encodes as JSON with a trailing newline (as jsoncpp writes it).
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// A NIC path: `host:port@device`, the segment name and a device of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPath {
    /// The segment name (`host:port`, the handshake address in P2P mode).
    pub segment: String,
    /// The device name.
    pub device: String,
}

impl NicPath {
    /// `segment@device`.
    pub fn new(segment: impl Into<String>, device: impl Into<String>) -> Self {
        Self { segment: segment.into(), device: device.into() }
    }

    /// Parses `segment@device` (the last `@` splits; both parts non-empty).
    pub fn parse(s: &str) -> Result<Self, ProtoError> {
        match s.rsplit_once('@') {
            Some((seg, dev)) if !seg.is_empty() && !dev.is_empty() => Ok(Self::new(seg, dev)),
            _ => Err(ProtoError::InvalidDescriptor(format!("NIC path {s:?} is not segment@device"))),
        }
    }
}

impl std::fmt::Display for NicPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.segment, self.device)
    }
}

/// A GID as Mooncake writes it: 16 two-digit hex bytes joined by `:`.
pub fn format_gid(gid: &[u8; 16]) -> String {
    let mut s = String::with_capacity(47);
    for (i, b) in gid.iter().enumerate() {
        if i > 0 {
            s.push(':');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Parses [`format_gid`]'s form.
pub fn parse_gid(s: &str) -> Result<[u8; 16], ProtoError> {
    let bad = || ProtoError::InvalidDescriptor(format!("GID {s:?} is not 16 colon-separated hex bytes"));
    let mut gid = [0u8; 16];
    let mut parts = s.split(':');
    for b in &mut gid {
        let p = parts.next().ok_or_else(bad)?;
        if p.is_empty() || p.len() > 2 {
            return Err(bad());
        }
        *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The initiator's first message as captured between two real engines.
    const CAPTURED: &str = r#"{"local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:7f:00:00:01","local_lid":0,"local_nic_path":"127.0.0.1:15889@rxe_lo","payload":"","peer_nic_path":"127.0.0.1:16912@rxe_lo","qp_num":[17,18],"ready_ack":false,"reply_msg":""}
"#;

    #[test]
    fn a_captured_connection_message_round_trips_byte_for_byte() {
        let c = ConnectionDesc::from_json(CAPTURED.as_bytes()).unwrap();
        assert_eq!(c.qp_num, vec![17, 18]);
        assert_eq!(NicPath::parse(&c.peer_nic_path).unwrap(), NicPath::new("127.0.0.1:16912", "rxe_lo"));
        assert_eq!(parse_gid(&c.local_gid).unwrap()[12..], [127, 0, 0, 1]);
        assert_eq!(String::from_utf8(c.to_json()).unwrap(), CAPTURED);
    }

    #[test]
    fn a_gid_round_trips_through_mooncakes_form() {
        let g: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(parse_gid(&format_gid(&g)).unwrap(), g);
    }

    /// A hostile or broken peer's Connection message is a typed error,
    /// never a connect attempt with a QP number no QP can have.
    #[test]
    fn a_bad_connection_message_is_a_typed_error() {
        let good = ConnectionDesc::from_json(CAPTURED.as_bytes()).unwrap();
        let mut cases = Vec::new();
        for q in [vec![0], vec![0x0100_0000], vec![1; MAX_QPS_PER_ENDPOINT + 1]] {
            cases.push(ConnectionDesc { qp_num: q, ..good.clone() }.to_json());
        }
        for gid in ["", "00:11", "zz:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00", &format!("{}:00", good.local_gid)] {
            cases.push(ConnectionDesc { local_gid: gid.into(), ..good.clone() }.to_json());
        }
        cases.push(b"[]".to_vec());
        cases.push(b"{\"qp_num\": \"x\"}".to_vec());
        for c in cases {
            assert!(ConnectionDesc::from_json(&c).is_err(), "{}", String::from_utf8_lossy(&c));
        }
        let refusal = ConnectionDesc { reply_msg: "no such device".into(), qp_num: vec![0], ..good };
        assert_eq!(ConnectionDesc::from_json(&refusal.to_json()).unwrap().reply_msg, "no such device");
    }

    #[test]
    fn a_nic_path_needs_a_segment_and_a_device() {
        for bad in ["", "@", "a@", "@b", "nodevice"] {
            assert!(NicPath::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(NicPath::new("h:1", "d").to_string(), "h:1@d");
    }
}
