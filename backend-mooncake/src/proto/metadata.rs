//! JSON bodies of the handshake: the segment descriptor (Metadata), the
//! notification (Notify) and their replies.

use serde::{Deserialize, Serialize};

use super::ProtoError;

/// One registered buffer in a segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// Buffer name (must be non-empty; Mooncake uses the segment name).
    pub name: String,
    /// Virtual address of the buffer in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// RDMA only: the remote key of this buffer on each device of the
    /// segment, in device order (empty for TCP).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rkey: Vec<u32>,
    /// RDMA only: the local key on each device (Mooncake sends it; nothing
    /// remote uses it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lkey: Vec<u32>,
}

impl BufferDesc {
    /// Whether `[addr, addr+len)` lies inside this buffer and `len > 0`.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr >= self.addr
            && addr.checked_add(len).zip(self.addr.checked_add(self.length)).is_some_and(|(end, bend)| end <= bend)
    }
}

/// Which TCP transport framing a peer speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProtoVersion {
    /// No status word: a WRITE completion only means the bytes left the
    /// sender's socket; a rejected request looks like success. A completion
    /// against a v1 peer proves nothing about the remote memory.
    V1,
    /// Status word after each WRITE is applied and before each READ's data:
    /// a completion means the bytes were applied at the destination.
    V2,
}

/// A segment descriptor as exchanged by a Metadata handshake (TCP protocol).
///
/// Unknown fields are ignored on decode; absent optional fields are omitted on
/// encode except the ones 0.3.13.post1 always sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// Segment name (`ip:handshake_port` in P2P mode).
    pub name: String,
    /// Transport protocol, `"tcp"` here.
    pub protocol: String,
    /// TCP data port.
    #[serde(default)]
    pub tcp_data_port: u16,
    /// TCP framing version; absent means 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_proto_version: Option<u32>,
    /// Host of the data port, if advertised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_data_host: Option<String>,
    /// RDMA server name (empty for TCP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_server_name: Option<String>,
    /// Timestamp string (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Registered buffers.
    #[serde(default)]
    pub buffers: Vec<BufferDesc>,
    /// RDMA only: the segment's devices; a buffer's `rkey[i]` is its key on
    /// `devices[i]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceDesc>,
    /// RDMA only: which devices serve which memory location, as Mooncake
    /// writes it (`{"cpu:0": [[preferred...], [available...]]}`); kept as
    /// the peer sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_matrix: Option<serde_json::Value>,
    /// kv-transfer's own: the version of sealed notifications this engine
    /// accepts ([`crate::sealed`]); absent from a real Mooncake engine's
    /// descriptor, whose notifications stay plain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvt_notify_auth: Option<u32>,
}

/// One RDMA device of a segment (`{"gid": "00:...", "lid": 0, "name": "rxe_lo"}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    /// The port's GID as 16 colon-separated hex bytes.
    pub gid: String,
    /// The port's LID (0 on RoCE).
    #[serde(default)]
    pub lid: u16,
    /// Device name (`rxe_lo`, `mlx5_0`).
    pub name: String,
}

impl SegmentDesc {
    /// Decodes and validates a descriptor from JSON bytes.
    pub fn from_json(json: &[u8]) -> Result<Self, ProtoError> {
        let d: SegmentDesc = serde_json::from_slice(json)?;
        d.validate()?;
        Ok(d)
    }

    /// Encodes as JSON (with a trailing newline, as jsoncpp's FastWriter does).
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }

    /// Checks that the descriptor is usable for its protocol: a TCP segment
    /// needs a data port, an RDMA segment devices with a name and a GID and,
    /// on every buffer, one remote key per device.
    pub fn validate(&self) -> Result<(), ProtoError> {
        match self.protocol.as_str() {
            "tcp" if self.tcp_data_port == 0 => {
                return Err(ProtoError::InvalidDescriptor("tcp_data_port is 0".into()));
            }
            "tcp" => {}
            "rdma" => self.validate_rdma()?,
            other => return Err(ProtoError::InvalidDescriptor(format!("protocol {other:?} is not tcp or rdma"))),
        }
        if let Some(v) = self.tcp_proto_version {
            if v == 0 {
                return Err(ProtoError::InvalidDescriptor("tcp_proto_version 0".into()));
            }
        }
        for b in &self.buffers {
            if b.name.is_empty() || b.addr == 0 || b.length == 0 {
                return Err(ProtoError::InvalidDescriptor(format!(
                    "buffer {b:?} needs a name and non-zero addr and length"
                )));
            }
            if b.addr.checked_add(b.length).is_none() {
                return Err(ProtoError::InvalidDescriptor(format!("buffer {b:?} wraps")));
            }
        }
        Ok(())
    }

    fn validate_rdma(&self) -> Result<(), ProtoError> {
        if self.devices.is_empty() {
            return Err(ProtoError::InvalidDescriptor("an rdma segment with no devices".into()));
        }
        for d in &self.devices {
            if d.name.is_empty() {
                return Err(ProtoError::InvalidDescriptor("a device with no name".into()));
            }
            super::rdma::parse_gid(&d.gid)?;
        }
        for b in &self.buffers {
            if b.rkey.len() != self.devices.len() {
                return Err(ProtoError::InvalidDescriptor(format!(
                    "buffer at {:#x} has {} rkeys for {} devices",
                    b.addr,
                    b.rkey.len(),
                    self.devices.len()
                )));
            }
        }
        Ok(())
    }

    /// What this peer's completions prove: the TCP framing version it
    /// speaks; over RDMA (RC), what v2 proves, since a WRITE completes only
    /// once the target's NIC acknowledged it placed (Mooncake's RDMA
    /// metadata says `tcp_proto_version` 1, meaning nothing for RDMA).
    pub fn proto_version(&self) -> ProtoVersion {
        if self.protocol == "rdma" {
            return ProtoVersion::V2;
        }
        match self.tcp_proto_version {
            Some(v) if v >= 2 => ProtoVersion::V2,
            _ => ProtoVersion::V1,
        }
    }

    /// The buffer containing `[addr, addr+len)`, if any.
    pub fn buffer_containing(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        self.buffers.iter().find(|b| b.contains(addr, len))
    }
}

/// A notification (`{"name": ..., "notify_msg": ...}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyDesc {
    /// Sender's segment name.
    #[serde(default)]
    pub name: String,
    /// The message.
    #[serde(default)]
    pub notify_msg: String,
    /// Not on the wire: whether `name` is what a peer handshake proved (a
    /// sealed notification, [`crate::sealed`]) rather than what the JSON
    /// declares, which anyone can write.
    #[serde(skip)]
    pub proven: bool,
}

impl NotifyDesc {
    /// A plain notification from `name`.
    pub fn new(name: &str, msg: &str) -> Self {
        Self { name: name.to_string(), notify_msg: msg.to_string(), proven: false }
    }

    /// Decodes from JSON bytes.
    pub fn from_json(json: &[u8]) -> Result<Self, ProtoError> {
        Ok(serde_json::from_slice(json)?)
    }
    /// Encodes as JSON with a trailing newline.
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// Reply to a Notify: `{"notify_msg":"success"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyReply {
    /// `"success"` when the receiver queued the message.
    #[serde(default)]
    pub notify_msg: String,
}

impl NotifyReply {
    /// The reply a receiver sends after queueing.
    pub fn success() -> Self {
        Self { notify_msg: "success".into() }
    }
    /// Whether the reply reports success.
    pub fn is_success(&self) -> bool {
        self.notify_msg == "success"
    }
}

/// Reply to a Probe: `{"status":"success"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReply {
    /// `"success"`.
    #[serde(default)]
    pub status: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: &str = r#"{"buffers":[{"addr":140287034785792,"length":100663296,"name":"127.0.0.1:15101"}],"name":"127.0.0.1:15101","protocol":"tcp","rdma_server_name":"","tcp_data_host":"127.0.0.1","tcp_data_port":15414,"tcp_proto_version":2,"timestamp":"2026-11-29 23:01:20.309374"}
"#;

    #[test]
    fn parses_real_descriptor() {
        let d = SegmentDesc::from_json(REAL.as_bytes()).unwrap();
        assert_eq!(d.tcp_data_port, 15414);
        assert_eq!(d.proto_version(), ProtoVersion::V2);
        assert_eq!(d.buffers.len(), 1);
        assert!(d.buffer_containing(140287034785792, 1).is_some());
        assert!(d.buffer_containing(140287034785792 + 100663296, 1).is_none());
        assert!(d.buffer_containing(140287034785792, 0).is_none());
        let again = SegmentDesc::from_json(&d.to_json()).unwrap();
        assert_eq!(again, d);
    }

    #[test]
    fn v1_and_invalid() {
        let v1 = r#"{"name":"a:1","protocol":"tcp","tcp_data_port":5,"buffers":[]}"#;
        assert_eq!(SegmentDesc::from_json(v1.as_bytes()).unwrap().proto_version(), ProtoVersion::V1);
        for bad in [
            r#"{"name":"a","protocol":"rdma","tcp_data_port":5}"#,
            r#"{"name":"a","protocol":"udp","tcp_data_port":5}"#,
            r#"{"name":"a","protocol":"tcp","tcp_data_port":0}"#,
            r#"{"name":"a","protocol":"tcp","tcp_data_port":5,"buffers":[{"name":"","addr":1,"length":1}]}"#,
            r#"{"name":"a","protocol":"tcp","tcp_data_port":5,"buffers":[{"name":"b","addr":18446744073709551615,"length":2}]}"#,
            r#"{"name":"a","protocol":"tcp","tcp_data_port":70000}"#,
            r#"not json"#,
            r#"[]"#,
        ] {
            assert!(SegmentDesc::from_json(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn notify() {
        let n = NotifyDesc::new("x", "hello");
        assert_eq!(NotifyDesc::from_json(&n.to_json()).unwrap(), n);
        let r: NotifyReply = serde_json::from_str("{\"notify_msg\":\"success\"}\n").unwrap();
        assert!(r.is_success());
    }

    /// Only a sealed connection's handshake proves a sender: a plain
    /// notification that says it is proven is not, and the field never
    /// goes out on the wire.
    #[test]
    fn a_notification_cannot_declare_itself_proven() {
        let n = NotifyDesc::from_json(br#"{"name":"127.0.0.1:1","notify_msg":"kvt2 00","proven":true}"#).unwrap();
        assert!(!n.proven);
        let sealed = NotifyDesc { proven: true, ..NotifyDesc::new("x", "m") };
        assert!(!String::from_utf8(sealed.to_json()).unwrap().contains("proven"));
    }
}
