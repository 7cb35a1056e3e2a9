//! What the adapter and an [`Engine`](crate::Engine) say to each other,
//! independent of any device: queue-pair endpoints and states, work
//! requests, completions, and the handles an engine hands out.

use crate::error::VerbsError;

/// A global identifier of a port (RoCE: an IPv6 or IPv4-mapped address).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gid(pub [u8; 16]);

/// What a memory region lets the NIC do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MrAccess {
    /// Local reads and writes only (a source buffer, a RECV buffer).
    Local,
    /// Local access, and memory windows may be bound over it: the safe
    /// policy's pool memory. The region's rkey grants nothing remote.
    WindowsOnly,
    /// The region's own rkey grants remote WRITE and READ for as long as it
    /// is registered: what the `naive` positive control uses (no key per
    /// tenancy, so nothing at the NIC tells tenancies apart).
    RemoteWriteRead,
}

/// How a work request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// The remote side refused the access (a stale or wrong key, out of the
    /// window's bounds): `IBV_WC_REM_ACCESS_ERR`. The QP is in ERR now.
    RemoteAccess,
    /// Flushed: the QP went to ERR with this request posted; it never ran
    /// (or its outcome at the remote side is unknown): `IBV_WC_WR_FLUSH_ERR`.
    Flushed,
    /// A memory-management operation failed (a bind or invalidation):
    /// `IBV_WC_MW_BIND_ERR` and kin.
    MemoryManagement(u32),
    /// Any other status (its `ibv_wc_status` value).
    Other(u32),
}

impl WcStatus {
    /// Whether it is [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == Self::Success
    }
}

/// What a completion completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcKind {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND.
    Send,
    /// A RECV (an incoming SEND landed in its buffer).
    Recv,
    /// A window bind.
    Bind,
    /// A local invalidation.
    LocalInv,
    /// A flushed or failed request (the opcode is not reported then).
    Unknown,
}

/// One completion, matched to its work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` it was posted with.
    pub wr_id: u64,
    /// The queue pair it was posted on.
    pub qp_num: u32,
    /// How it ended.
    pub status: WcStatus,
    /// What it was (for a successful one).
    pub kind: WcKind,
    /// Bytes received (a RECV) or read (a READ).
    pub byte_len: u32,
}

/// An RC queue pair's state, as this side moved it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created.
    Reset,
    /// Has a port and access flags.
    Init,
    /// Ready to receive (knows its remote).
    ReadyToReceive,
    /// Ready to send.
    ReadyToSend,
    /// In error: every posted request flushed, nothing more leaves it.
    Error,
}

/// What the peer needs to connect to a queue pair (exchanged over the TCP
/// side channel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// The port's GID.
    pub gid: Gid,
    /// Path MTU in bytes (256, 512, 1024, 2048 or 4096).
    pub mtu: u32,
}

const ENDPOINT_MAGIC: [u8; 4] = *b"KVQP";
/// Bytes of an encoded [`Endpoint`].
pub const ENDPOINT_LEN: usize = 32;

impl Endpoint {
    /// Its wire form: magic, QPN, PSN, MTU (little-endian), GID.
    pub fn encode(&self) -> [u8; ENDPOINT_LEN] {
        let mut b = [0u8; ENDPOINT_LEN];
        b[0..4].copy_from_slice(&ENDPOINT_MAGIC);
        b[4..8].copy_from_slice(&self.qpn.to_le_bytes());
        b[8..12].copy_from_slice(&self.psn.to_le_bytes());
        b[12..16].copy_from_slice(&self.mtu.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid.0);
        b
    }

    /// Decodes what a peer sent: typed errors for a truncated, oversize or
    /// foreign message, or values no QP can have.
    pub fn decode(b: &[u8]) -> Result<Self, VerbsError> {
        if b.len() != ENDPOINT_LEN {
            return Err(VerbsError::Endpoint(format!("{} bytes, expected {ENDPOINT_LEN}", b.len())));
        }
        if b[0..4] != ENDPOINT_MAGIC {
            return Err(VerbsError::Endpoint("not a kv-transfer QP descriptor".into()));
        }
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (qpn, psn, mtu) = (word(4), word(8), word(12));
        if qpn == 0 || qpn > 0x00ff_ffff {
            return Err(VerbsError::Endpoint(format!("QPN {qpn} is not a 24-bit QP number")));
        }
        if psn > 0x00ff_ffff {
            return Err(VerbsError::Endpoint(format!("PSN {psn} is not 24 bits")));
        }
        if !matches!(mtu, 256 | 512 | 1024 | 2048 | 4096) {
            return Err(VerbsError::Endpoint(format!("MTU {mtu} is not 256..4096")));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Ok(Self { qpn, psn, gid: Gid(gid), mtu })
    }
}

/// A queue pair, as an engine numbers it (its QP number).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId(pub u32);

/// Registered memory, as an engine numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MrId(pub u32);

/// A memory window, as an engine numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MwId(pub u32);

/// What registering memory gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrInfo {
    /// Its handle.
    pub id: MrId,
    /// The address of its first byte (what remote addresses name).
    pub addr: u64,
    /// Its own remote key (grants nothing unless registered with remote access).
    pub rkey: u32,
}

/// One work request, as the adapter posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkRequest {
    /// RDMA WRITE of `local[offset..offset+len]` to `remote_addr` under `rkey`.
    Write {
        /// Source memory.
        local: MrId,
        /// Offset in it.
        offset: u64,
        /// Bytes.
        len: u32,
        /// Destination address at the peer.
        remote_addr: u64,
        /// The key that grants it.
        rkey: u32,
    },
    /// RDMA READ of `len` bytes at `remote_addr` into `local[offset..]`.
    Read {
        /// Destination memory.
        local: MrId,
        /// Offset in it.
        offset: u64,
        /// Bytes.
        len: u32,
        /// Source address at the peer.
        remote_addr: u64,
        /// The key that grants it.
        rkey: u32,
    },
    /// SEND of `local[offset..offset+len]` (lands in one of the peer's RECVs).
    Send {
        /// Source memory.
        local: MrId,
        /// Offset in it.
        offset: u64,
        /// Bytes.
        len: u32,
    },
    /// A RECV buffer `local[offset..offset+len]` for one incoming SEND.
    Recv {
        /// Buffer memory.
        local: MrId,
        /// Offset in it.
        offset: u64,
        /// Bytes.
        len: u32,
    },
    /// A zero-length WRITE: fails (after the transport's retries) if the
    /// peer is gone.
    Heartbeat,
    /// Binds the unbound `window` over `mr[offset..offset+len]` (remote
    /// WRITE and READ, through this QP only) under a fresh key; `post`
    /// returns the key, usable once the bind completed.
    Bind {
        /// The window.
        window: MwId,
        /// The memory it grants.
        mr: MrId,
        /// Offset in it.
        offset: u64,
        /// Bytes.
        len: u32,
    },
    /// `LOCAL_INV` of `window`'s key: once completed, the NIC refuses it.
    Invalidate {
        /// The window.
        window: MwId,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep() -> Endpoint {
        Endpoint { qpn: 0x11, psn: 0x22, gid: Gid([7; 16]), mtu: 1024 }
    }

    #[test]
    fn an_endpoint_round_trips_through_its_wire_form() {
        assert_eq!(Endpoint::decode(&ep().encode()).unwrap(), ep());
    }

    /// Bad input on the side channel: truncated, oversize, foreign, and
    /// values no QP can have are typed errors, never a connect attempt.
    #[test]
    fn a_bad_endpoint_descriptor_is_a_typed_error() {
        let good = ep().encode();
        let mut cases: Vec<Vec<u8>> = vec![good[..31].to_vec(), [&good[..], &[0]].concat(), Vec::new()];
        let mut foreign = good;
        foreign[0] = b'X';
        cases.push(foreign.to_vec());
        for (at, v) in [(4, 0u32), (4, 0x0100_0000), (8, 0x0100_0000), (12, 1000)] {
            let mut b = good;
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
            cases.push(b.to_vec());
        }
        for c in cases {
            assert!(matches!(Endpoint::decode(&c), Err(VerbsError::Endpoint(_))), "{c:?}");
        }
    }
}
