//! The public value types of the NIC's API: its configuration and release
//! policy, the errors of its management calls and of `expose`, the inbound
//! events and the message hook, and what `peers` and `fault_log` return.
//! Plain data, kept apart from the handle so that `mod.rs` reads as the API.

#[cfg(doc)]
use super::SimNic;
use crate::fault::FaultPlan;
use bytes::Bytes;
#[cfg(doc)]
use kv_transfer_core::RejectReason;
use kv_transfer_core::{PeerId, PoolError, Tenancy};
use serde::{Deserialize, Serialize};
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// How the NIC releases quarantined slots: core's one policy type. With
/// [`ReleasePolicy::Safe`] the NIC checks generations and slots leave
/// quarantine only with a real proof; the positive control
/// (`ReleasePolicy::Naive`, feature `naive-positive-control`) also skips
/// the NIC's generation check (one rkey per region), as SGLang did before
/// its fix.
pub use kv_transfer_core::drain::ReleasePolicy;

/// Bounds of a NIC's listener (Rule 9: a peer's connections buy only that
/// peer's handshakes). Refusals are closed at once and counted
/// ([`NicStats::handshakes_refused_busy`](crate::NicStats),
/// `handshakes_refused_per_address`, `connections_refused_per_address`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Handshakes served at once (each on a thread of its own).
    pub handshakes: usize,
    /// Handshakes served at once per source address.
    pub per_address: usize,
    /// Established connections kept per source address.
    pub connections_per_address: usize,
    /// Longest wait for any one read of a handshake.
    pub idle: Duration,
    /// At `handshakes` in flight, the oldest handshake gives way to a new
    /// connection (closed, counted `handshakes_evicted`) instead of the new
    /// one being refused: many source addresses, each under its own cap,
    /// cannot then hold the total against an honest peer for longer than
    /// it takes them to open `handshakes` new connections. `false`: refuse
    /// at the total (the many-addresses test's positive control).
    pub evict_oldest: bool,
    /// The positive control only: handshakes one at a time on the
    /// accepting thread, no caps (the behaviour before issue 29).
    pub serial: bool,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            handshakes: 32,
            per_address: 8,
            connections_per_address: 1024,
            idle: Duration::from_secs(2),
            evict_oldest: true,
            serial: false,
        }
    }
}

impl ListenerLimits {
    /// The positive control: serial handshakes, no caps.
    pub fn serial() -> Self {
        Self {
            handshakes: usize::MAX,
            per_address: usize::MAX,
            connections_per_address: usize::MAX,
            idle: Duration::MAX,
            evict_oldest: false,
            serial: true,
        }
    }
}

/// Configuration of a [`SimNic`].
#[derive(Clone, Debug)]
pub struct NicConfig {
    /// Name announced to peers in the handshake.
    pub name: String,
    /// Address to listen on (loopback; port 0 picks one).
    pub listen: String,
    /// Release policy (keep [`ReleasePolicy::Safe`] unless writing a positive control).
    pub policy: ReleasePolicy,
    /// Faults injected by this NIC.
    pub faults: FaultPlan,
    /// Longest WRITE/READ this NIC accepts as a target; longer ones are
    /// rejected with [`RejectReason::Oversize`].
    pub max_wr_bytes: u32,
    /// How long a revocation waits for in-flight applies to drain before it
    /// gives up (and the ladder moves on to the fence).
    pub revoke_wait: Duration,
    /// Bound on the handshake of a new connection (for an accepted one: the
    /// whole handshake, from accept to the last byte of its HELLO).
    pub handshake_timeout: Duration,
    /// Caps of the listener (handshakes at once, per address, connections
    /// per address, idle bound).
    pub listener: ListenerLimits,
    /// `SO_SNDBUF` / `SO_RCVBUF` of each connection (`None`: the kernel's
    /// autotuning). 4 MiB by default: it lifts loopback throughput markedly.
    pub socket_buffer: Option<usize>,
    /// Most per-WR delay records kept for [`SimNic::fault_log`] (1,000,000
    /// by default, about 24 MB; 0 for long runs that never read it).
    pub fault_log_limit: usize,
    /// The cluster's key, which every connection's handshake proves both
    /// ends hold (`kv_transfer_core::auth`). `None`: the deployment's
    /// (`ClusterKey::from_env`: `KV_TRANSFER_CLUSTER_KEY` or its file; else
    /// single-host mode, with a warning), read when the NIC starts.
    pub cluster_key: Option<kv_transfer_core::auth::ClusterKey>,
    /// Addresses besides its endpoint that a dialer may have dialed to
    /// reach this NIC (a DNS name, a forwarded port). A handshake that
    /// dialed any other address is a relayed one and is refused; listing a
    /// relay's address here is what the hostile tests' positive control does.
    pub answers_to: Vec<String>,
}

impl NicConfig {
    /// A safe NIC named `name` on `127.0.0.1:0` with no faults.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            listen: "127.0.0.1:0".into(),
            policy: ReleasePolicy::Safe,
            faults: FaultPlan::default(),
            max_wr_bytes: 16 << 20,
            revoke_wait: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(5),
            listener: ListenerLimits::default(),
            socket_buffer: Some(4 << 20),
            fault_log_limit: 1_000_000,
            cluster_key: None,
            answers_to: Vec::new(),
        }
    }
    /// Sets the cluster key (instead of the deployment's, read at start).
    pub fn with_cluster_key(mut self, key: kv_transfer_core::auth::ClusterKey) -> Self {
        self.cluster_key = Some(key);
        self
    }
    /// Replaces the release policy.
    pub fn with_policy(mut self, policy: ReleasePolicy) -> Self {
        self.policy = policy;
        self
    }
    /// Replaces the fault plan.
    pub fn with_faults(mut self, faults: FaultPlan) -> Self {
        self.faults = faults;
        self
    }
    /// Replaces the largest accepted access.
    pub fn with_max_wr_bytes(mut self, max: u32) -> Self {
        self.max_wr_bytes = max;
        self
    }
}

/// Errors of NIC management calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NicError {
    /// A socket call failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer did not complete the handshake.
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The peer handshake was refused: another cluster key, a replayed or
    /// relayed handshake (typed, and counted in [`SimNic::auth_stats`](crate::SimNic::auth_stats)).
    #[error("peer handshake: {0}")]
    Auth(#[from] kv_transfer_core::auth::AuthError),
    /// The deployment's cluster key could not be read.
    #[error(transparent)]
    Key(#[from] kv_transfer_core::auth::KeyError),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// No live connection to this peer.
    #[error("unknown or disconnected peer {0:?}")]
    UnknownPeer(PeerId),
    /// Larger than a frame can carry.
    #[error("{0} bytes is more than a frame can carry")]
    TooLarge(usize),
    /// The NIC is shut down (or crashed).
    #[error("NIC is shut down")]
    ShuttingDown,
    /// No region of this NIC has this key (or the range lies outside it).
    #[error("no registered range {len} bytes at {offset} in region {key:#x}")]
    LocalRange {
        /// The key asked for.
        key: u64,
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
    },
}

/// Why [`SimNic::expose`] refused (core's one type; the lease comes back unexposed).
pub use kv_transfer_core::{ExposeError, ExposeErrorKind};

/// Something that happened at this NIC that the application may care about.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InboundEvent {
    /// A connection came up (opened or accepted).
    PeerConnected {
        /// The peer as this NIC numbers it.
        peer: PeerId,
        /// The peer's name.
        name: String,
        /// The peer's listening endpoint.
        endpoint: String,
    },
    /// A peer notified that an operation on these tenancies completed (the
    /// data is in place); the exposures were settled with `Completed`.
    Notified {
        /// The peer.
        peer: PeerId,
        /// Key of the region.
        key: u64,
        /// Tenancies settled (stale ones left out).
        tenancies: Vec<Tenancy>,
    },
    /// The connection to the peer was torn down and fenced.
    PeerLost {
        /// The peer.
        peer: PeerId,
    },
    /// An application message from the peer ([`SimNic::send_message`]),
    /// reported here when no [`MessageHook`] is set.
    Message {
        /// The peer.
        peer: PeerId,
        /// The bytes, uninterpreted.
        bytes: Bytes,
    },
}

/// Receives the application messages of every connection
/// ([`SimNic::set_message_hook`]): the peer, its name, and the bytes (valid
/// for the call only: the receiver reuses its buffer).
///
/// It runs on the connection's receiving thread, in the order the frames
/// arrived, so it must return quickly and must not wait on this NIC (no
/// `fence`, `revoke` or `shutdown` from inside it). Sending is fine: it only
/// queues.
pub type MessageHook = Arc<dyn Fn(PeerId, &str, &[u8]) + Send + Sync>;

/// A live connection, as [`SimNic::peers`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer as this NIC numbers it (never reused).
    pub peer: PeerId,
    /// The peer's name.
    pub name: String,
    /// The peer's listening endpoint.
    pub endpoint: String,
    /// Index of the connection at this NIC (what [`DropSpec`](crate::DropSpec) names).
    pub index: u32,
}

/// One decision of the fault plan, as the NIC applied it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRecord {
    /// Connection index.
    pub conn: u32,
    /// WR sequence number on that connection.
    pub seq: u64,
    /// Delay applied before sending, µs.
    pub delay_us: u64,
}
