//! The adapter's shared state: peers, windows, pending work requests
//! and operations, under one lock, and what every thread reaches through
//! `Arc<Inner>`.

use super::*;

/// The adapter's counters.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) posts: AtomicU64,
    pub(super) ops_ok: AtomicU64,
    pub(super) ops_failed: AtomicU64,
    pub(super) remote_access_errors: AtomicU64,
    pub(super) flushed: AtomicU64,
    pub(super) binds: AtomicU64,
    pub(super) invalidations: AtomicU64,
    pub(super) control_sent: AtomicU64,
    pub(super) messages_received: AtomicU64,
    pub(super) malformed: AtomicU64,
    pub(super) heartbeats: AtomicU64,
    pub(super) side_channel_refused: AtomicU64,
    pub(super) side_channel_busy: AtomicU64,
    pub(super) side_channel_evicted: AtomicU64,
    pub(super) side_channel_per_address: AtomicU64,
    pub(super) identity_unconfirmed: AtomicU64,
    pub(super) claims_refused: AtomicU64,
    pub(super) confirms_answered: AtomicU64,
    pub(super) records_dropped: AtomicU64,
}

pub(super) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A peer's lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PeerState {
    Live,
    /// Its QP is in ERR; the fence is minted once every request flushed.
    Fencing,
    Fenced,
}

pub(super) struct Peer {
    pub(super) name: String,
    /// Its descriptor, where we dialed it (we redial after a fence).
    pub(super) dialed: Option<Descriptor>,
    pub(super) qp: QpId,
    pub(super) state: PeerState,
    /// When it was last probed, and whether a probe is out.
    pub(super) probed: Instant,
    pub(super) probing: bool,
    /// Its RECV ring: `RECVS` buffers of `MAX_LEN` bytes.
    pub(super) recv: (MrId, Arc<dyn Region>),
    /// Its SEND ring: `SENDS` buffers of `MAX_LEN` bytes, and those not in
    /// flight (a buffer is reused only once its SEND completed).
    pub(super) send: (MrId, Arc<dyn Region>),
    pub(super) send_free: Vec<u32>,
    /// The connection's nonce: ours if we dialed it, theirs if we accepted it.
    pub(super) nonce: Nonce,
    /// Its descriptor's owner's: we dialed it, or the owner confirmed it
    /// dialed us. Only a confirmed peer has a name in `by_name`.
    pub(super) confirmed: bool,
    /// Where an accepted connection came from (claims are capped per address).
    pub(super) from: Option<std::net::IpAddr>,
}

/// A slot's memory window, as this side moved it (the engine enforces the
/// same order: a type-2 window binds only when unbound).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum WindowState {
    Unbound,
    /// A bind was posted; its key grants nothing yet.
    Binding,
    /// The key grants the slot, through the peer's QP only.
    Bound,
    /// A `LOCAL_INV` was posted; the key grants access until it completes.
    /// What its completion proves, one entry per path that asked for it
    /// (the ladder's revoke and the peer's ABORT_ACK can race: the second
    /// joins the invalidation in flight).
    Invalidating(Vec<(AfterInvalidate, kv_transfer_core::Tenancy)>),
}

#[derive(Clone, Debug)]
pub(super) struct Window {
    pub(super) id: MwId,
    pub(super) state: WindowState,
}

pub(super) struct PoolEntry {
    pub(super) authority: SettlementAuthority,
    pub(super) mr: MrInfo,
    /// One window per slot (allocated on first use).
    pub(super) windows: Vec<Option<Window>>,
    /// The peer each slot's window is bound to (on that peer's QP).
    pub(super) window_peer: Vec<Option<PeerId>>,
}

/// What a settled invalidation proves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AfterInvalidate {
    /// The ladder's revoke: `Revoked`.
    Revoke,
    /// The peer's DONE, now that its window is gone: `Completed`.
    Complete,
    /// An exposure that failed half-way: nothing to prove.
    Nothing,
}

pub(super) type BindWaiter = Arc<(Mutex<Option<bool>>, Condvar)>;

/// A posted work request, by `wr_id`.
pub(super) enum Pending {
    /// One WR of operation `op`.
    OpWr {
        op: u64,
        peer: PeerId,
    },
    Bind {
        peer: PeerId,
        done: BindWaiter,
        pool: PoolId,
        slot: u32,
    },
    /// A `LOCAL_INV` of `slot`'s window (what it proves is in the
    /// window's state).
    Invalidate {
        peer: PeerId,
        pool: PoolId,
        slot: u32,
    },
    /// A control message; `slot`: its buffer in the peer's SEND ring.
    Send {
        peer: PeerId,
        slot: Option<u32>,
    },
    Heartbeat {
        peer: PeerId,
    },
    Recv {
        peer: PeerId,
        index: u64,
    },
}

impl Pending {
    pub(super) fn peer(&self) -> PeerId {
        match self {
            Self::OpWr { peer, .. }
            | Self::Bind { peer, .. }
            | Self::Invalidate { peer, .. }
            | Self::Send { peer, .. }
            | Self::Heartbeat { peer }
            | Self::Recv { peer, .. } => *peer,
        }
    }
}

/// Why an operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum OpFailure {
    /// A later WR of it could not be posted.
    Post(String),
    /// A WR of it completed with this status.
    Status(crate::work::WcStatus),
}

impl std::fmt::Display for OpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Post(e) => write!(f, "post failed: {e}"),
            Self::Status(s) => write!(f, "completed with {s:?}"),
        }
    }
}

pub(super) struct OpEntry {
    pub(super) id: u64,
    pub(super) completer: Completer,
    pub(super) authority: SettlementAuthority,
    pub(super) remaining: u32,
    pub(super) error: Option<OpFailure>,
}

pub(super) struct State {
    pub(super) pools: HashMap<PoolId, PoolEntry>,
    pub(super) peers: HashMap<PeerId, Peer>,
    /// Who each name is (private: every change goes through
    /// [`State::name_peer`], which forgets the post's cache).
    by_name: HashMap<String, PeerId>,
    /// The last endpoint a post named and the peer its name named then: a
    /// post to the same target neither checks its descriptor again nor
    /// hashes the name. Only a well-formed endpoint is kept, and any change
    /// to `by_name` forgets it.
    last_endpoint: Option<(Box<str>, PeerId)>,
    pub(super) next_peer: u32,
    pub(super) wrs: HashMap<u64, Pending>,
    pub(super) ops: HashMap<u64, OpEntry>,
    pub(super) next_op: u64,
    /// Initiator side: which operations touch which remote tenancies, and
    /// when an ABORT may be answered.
    pub(super) aborts: kv_transfer_core::drain::AbortTracker<PeerId>,
    /// Nonces of handshakes this side is dialing, with the dialed ticket
    /// and address (a confirmation request may come before the peer is
    /// recorded).
    pub(super) dialing: HashMap<Nonce, (Ticket, String)>,
    /// The descriptors `add_peer` was given, by name: who a name is.
    pub(super) known: HashMap<String, Descriptor>,
}

impl State {
    /// The peer `name` names.
    pub(super) fn peer_named(&self, name: &str) -> Option<PeerId> {
        self.by_name.get(name).copied()
    }

    /// `name` names `id` from now on; the peer it named before, if any.
    pub(super) fn name_peer(&mut self, name: String, id: PeerId) -> Option<PeerId> {
        self.last_endpoint = None;
        self.by_name.insert(name, id)
    }

    /// The peer a post's `endpoint` (a target's descriptor) names: the
    /// cached answer for the last endpoint, else its name checked and
    /// looked up. `Err`: what is wrong with it.
    pub(super) fn peer_at(&mut self, endpoint: &str) -> Result<PeerId, String> {
        if let Some((e, p)) = &self.last_endpoint {
            if **e == *endpoint {
                return Ok(*p);
            }
        }
        let name = descriptor_name(endpoint).map_err(|_| format!("bad endpoint {endpoint:?}"))?;
        let peer = self.by_name.get(name).copied().ok_or_else(|| format!("{name} is not a peer"))?;
        self.last_endpoint = Some((endpoint.into(), peer));
        Ok(peer)
    }
}

impl Default for State {
    fn default() -> Self {
        Self {
            pools: HashMap::default(),
            peers: HashMap::default(),
            by_name: HashMap::default(),
            last_endpoint: None,
            next_peer: 0,
            wrs: HashMap::default(),
            ops: HashMap::default(),
            next_op: 0,
            aborts: kv_transfer_core::drain::AbortTracker::new(TOMBSTONES),
            dialing: HashMap::default(),
            known: HashMap::default(),
        }
    }
}

pub(super) struct Inner {
    pub(super) cfg: VerbsConfig,
    pub(super) engine: Arc<dyn Engine>,
    pub(super) descriptor: String,
    pub(super) state: Mutex<State>,
    /// Core's drain: the exposure table, the pools' authorities, the ladder.
    pub(super) drain: Mutex<Driver>,
    pub(super) drain_counters: Arc<DrainCounters>,
    pub(super) stop: AtomicBool,
    /// The listening socket, for the drop to shut down (waking `accept`).
    pub(super) acceptor: TcpListener,
    /// What a dialer's hello must carry (from this side's descriptor).
    pub(super) ticket: Ticket,
    pub(super) next_wr: AtomicU64,
    pub(super) counters: Counters,
    /// Side-channel handshakes in flight (the acceptor's caps).
    pub(super) gate: kv_transfer_core::PeerGate<std::net::IpAddr, std::net::TcpStream>,
    /// The side channel's acceptor: the cluster key, this side's identity,
    /// the addresses it answers to, and the listener's one replay cache.
    pub(super) auth: kv_transfer_core::auth::AcceptorConfig,
    /// Side-channel handshakes, both ways.
    pub(super) auth_counters: kv_transfer_core::auth::AuthCounters,
}

impl Inner {
    pub(super) fn wr_id(&self) -> u64 {
        self.next_wr.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn live_peer(&self, name: &str) -> Option<PeerId> {
        let st = lock(&self.state);
        st.peer_named(name).filter(|p| st.peers.get(p).is_some_and(|p| p.state == PeerState::Live))
    }

    /// Sends each message (ABORT_ACKs now due) to its peer, if live.
    pub(super) fn send_all(&self, st: &mut State, out: Vec<kv_transfer_core::drain::Outgoing<PeerId>>) {
        for o in out {
            let Some(qp) = st.peers.get(&o.to).filter(|p| p.state == PeerState::Live).map(|p| p.qp) else {
                continue;
            };
            if let Err(e) = self.send_control(st, o.to, qp, &o.msg) {
                tracing::warn!(peer = o.to.0, error = %e, "control message not sent");
            }
        }
    }

    /// Posts `msg` as a SEND on `qp`, from a free buffer of the peer's
    /// SEND ring (held until the SEND completes), or, with all of them in
    /// flight, from one registered for it alone.
    pub(super) fn send_control(
        &self,
        st: &mut State,
        peer: PeerId,
        qp: QpId,
        msg: &ControlMessage,
    ) -> Result<(), VerbsError> {
        let bytes = msg.encode().map_err(|e| VerbsError::invalid("encode", e.to_string()))?;
        let len = bytes.len() as u32;
        let ring = st.peers.get_mut(&peer).and_then(|p| p.send_free.pop().map(|i| (i, p.send.clone())));
        let (slot, mr, offset) = match ring {
            Some((i, (mr, region))) => {
                let at = i as usize * kv_transfer_core::drain::MAX_LEN;
                region.write(at, &bytes).map_err(|e| VerbsError::invalid("send buffer", e.to_string()))?;
                (Some(i), mr, at as u64)
            }
            None => {
                let region =
                    HostRegion::new(bytes.len()).map_err(|e| VerbsError::invalid("send buffer", e.to_string()))?;
                region.write(0, &bytes).map_err(|e| VerbsError::invalid("send buffer", e.to_string()))?;
                (None, self.engine.register(Arc::new(region), MrAccess::Local)?.id, 0)
            }
        };
        let wr = self.wr_id();
        let posted = self.engine.post(qp, wr, WorkRequest::Send { local: mr, offset, len });
        if slot.is_none() {
            // The engine keeps it registered until the SEND completes.
            self.engine.deregister(mr);
        }
        if let Err(e) = posted {
            self.send_done(st, peer, slot);
            return Err(e);
        }
        st.wrs.insert(wr, Pending::Send { peer, slot });
        inc(&self.counters.control_sent);
        Ok(())
    }

    /// A SEND's buffer is free again (its SEND completed, or never went).
    pub(super) fn send_done(&self, st: &mut State, peer: PeerId, slot: Option<u32>) {
        if let (Some(i), Some(p)) = (slot, st.peers.get_mut(&peer)) {
            p.send_free.push(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(name: &str, ticket: u8) -> String {
        Descriptor { name: name.into(), addr: "10.0.0.2:4791".into(), ticket: [ticket; TICKET_LEN] }.encode()
    }

    /// The post's cache of its last endpoint answers as the name table
    /// does, and forgets itself whenever a name changes hands.
    #[test]
    fn a_cached_endpoint_names_the_peer_its_name_names_now() {
        let mut st = State::default();
        let (a, b) = (endpoint("decode-0", 1), endpoint("decode-1", 2));
        assert!(st.peer_at(&a).is_err(), "no peer has the name yet");
        assert_eq!(st.name_peer("decode-0".into(), PeerId(1)), None);
        st.name_peer("decode-1".into(), PeerId(2));
        assert_eq!(st.peer_at(&a), Ok(PeerId(1)));
        assert_eq!(st.peer_at(&a), Ok(PeerId(1)), "cached");
        assert_eq!(st.peer_at(&b), Ok(PeerId(2)));
        // The name is taken over (a reconnect): the cached answer goes.
        assert_eq!(st.name_peer("decode-0".into(), PeerId(3)), Some(PeerId(1)));
        assert_eq!(st.peer_at(&a), Ok(PeerId(3)));
        // Another ticket under the same name: the name decides.
        assert_eq!(st.peer_at(&endpoint("decode-0", 9)), Ok(PeerId(3)));
        // A malformed endpoint is refused, and never cached.
        let bad = a.replace('#', "!");
        assert!(st.peer_at(&bad).is_err());
        assert!(st.peer_at(&bad).is_err());
        assert_eq!(st.peer_at(&a), Ok(PeerId(3)));
    }
}
