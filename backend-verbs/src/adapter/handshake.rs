//! Side-channel handshakes, and who a peer is.
//!
//! **A peer's identity is the descriptor this side was given for it**
//! (`add_peer`), never the name a hello declares. A connection this side
//! dialed to the descriptor's address, whose hello carried the
//! descriptor's ticket and was answered under the descriptor's name, is
//! that peer's. A connection this side *accepted* is only a claim to the
//! name its hello declares (anyone holding this side's descriptor can open
//! one: every peer it served has it): it is confirmed only by asking the
//! descriptor's owner, on a connection this side dials to the descriptor's
//! address, whether it sent that connection's nonce to this side
//! ([`Confirm`]). Until then the claim is its own peer, named by nothing:
//! `add_peer` and `peer_named` never return it, and it is capped per
//! address and in all ([`SideChannelLimits`]). A claim under a name whose
//! descriptor is known already (a reconnect after a fence) is asked about
//! at once, on the handshake's own thread.
//!
//! **The acceptor never waits on one peer for another.** Each accepted
//! connection gets a thread of its own, up to [`SideChannelLimits::handshakes`]
//! at once and [`SideChannelLimits::per_address`] per source address, each
//! bounded by a whole-handshake deadline and an idle bound; connections past
//! a cap are closed at once and counted. The positive control
//! ([`SideChannelLimits::serial`]) runs handshakes one at a time on the
//! accepting thread, as this adapter did before.
//!
//! **Every connection starts with core's handshake** under the cluster key
//! ([`kv_transfer_core::auth`]), inside the same whole-handshake deadline:
//! the dialer names the `host:port` it dialed (the descriptor's) and its
//! own descriptor's address, and the acceptor refuses a handshake that
//! dialed anything but its own descriptor's address. A relay that makes a
//! peer dial it (a descriptor with the relay's address and our ticket) and
//! forwards the peer's bytes to us is refused there (issue 46). And a
//! [`Confirm`] is answered yes only for a nonce sent on a connection this
//! side dialed to the asker's own address, as the asker proved it in the
//! confirmation's handshake: a nonce a relay collected is never confirmed
//! to anyone (binding by address, not only by ticket). The ticket and the
//! confirmation stay, as defence in depth.

use kv_transfer_core::{AtFull, GateRefusal};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_transfer_core::auth::{AuthError, DialerConfig, Established};
use kv_transfer_core::{HostRegion, PeerId, Region};

use super::channel::{
    self, read_opening, Confirm, Deadline, Nonce, Opening, AUTH_CONTEXT, MAX_CANDIDATES, NONE_CONFIRMED,
};
use super::{
    fresh_ticket, inc, lock, tickets_match, AdapterError, Descriptor, Hello, Inner, Peer, PeerState, Pending, RECVS,
    SENDS, TICKET_LEN,
};
use crate::error::VerbsError;
use crate::work::{MrAccess, MrId, QpId, QpState, WorkRequest};

/// Whose word makes an accepted connection a peer's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerIdentity {
    /// An accepted connection is a descriptor owner's only once the owner,
    /// asked at its descriptor's address, confirms it dialed it (the
    /// default).
    #[default]
    Confirmed,
    /// The positive control only: the name a hello declares is taken as
    /// the peer's identity, so whoever holds this side's descriptor and
    /// dials first under another peer's name is given that peer's
    /// exposures (the behaviour before issue 29).
    DeclaredName,
}

/// Bounds of the side channel's acceptor (Rule 9: a peer's connections buy
/// only that peer's handshakes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SideChannelLimits {
    /// Handshakes served at once (each on a thread of its own).
    pub handshakes: usize,
    /// Handshakes served at once per source address.
    pub per_address: usize,
    /// Whole-handshake deadline of an accepted connection: from accept to
    /// its last byte.
    pub deadline: Duration,
    /// Longest wait for any one read of a handshake.
    pub idle: Duration,
    /// At `handshakes` in flight, the oldest handshake gives way to a new
    /// connection (closed, counted) instead of the new one being refused:
    /// many source addresses, each under `per_address`, then cannot hold
    /// the total against an honest peer. `false`: refuse at the total (the
    /// many-addresses tests' positive control).
    pub evict_oldest: bool,
    /// Unconfirmed claims (accepted connections no descriptor confirmed
    /// yet, each with a queue pair) kept per source address.
    pub claims_per_address: usize,
    /// Unconfirmed claims kept in all.
    pub claims: usize,
    /// The positive control only: handshakes one at a time on the
    /// accepting thread, no caps (the behaviour before issue 29: one idle
    /// connection holds every other for up to the deadline).
    pub serial: bool,
}

impl Default for SideChannelLimits {
    fn default() -> Self {
        Self {
            handshakes: 32,
            per_address: 8,
            deadline: Duration::from_secs(5),
            idle: Duration::from_secs(2),
            evict_oldest: true,
            claims_per_address: 8,
            claims: 64,
            serial: false,
        }
    }
}

impl SideChannelLimits {
    /// The positive control: serial handshakes, no caps, `deadline` each.
    pub fn serial(deadline: Duration) -> Self {
        Self {
            handshakes: usize::MAX,
            per_address: usize::MAX,
            deadline,
            idle: deadline,
            evict_oldest: false,
            claims_per_address: usize::MAX,
            claims: usize::MAX,
            serial: true,
        }
    }
}

/// A handshake's place at the gate (core's [`PeerGate`]), given back when
/// dropped; held with a clone of its connection, which an eviction closes.
type Admitted = kv_transfer_core::GatePermit<IpAddr, TcpStream>;

impl Inner {
    /// Accepts side-channel connections until stopped: each handshake on a
    /// thread of its own, within the limits (or, as the positive control,
    /// one at a time here).
    pub(super) fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        while !self.stop.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((s, from)) => {
                    let _ = s.set_nonblocking(false);
                    if self.cfg.side_channel.serial {
                        self.serve(s, from.ip());
                        continue;
                    }
                    let Some(ticket) = self.admit(from.ip(), &s) else { continue };
                    let me = Arc::clone(&self);
                    let spawned = std::thread::Builder::new().name("verbs-handshake".into()).spawn(move || {
                        let _ticket = ticket;
                        me.serve(s, from.ip());
                    });
                    if let Err(e) = spawned {
                        inc(&self.counters.side_channel_busy);
                        tracing::warn!(%from, error = %e, "no thread for a side-channel handshake: refused");
                    }
                }
                Err(_) if self.stop.load(Ordering::Acquire) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "side-channel accept failed");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// A place for a handshake from `addr` on `s`, or a counted refusal
    /// (the connection is then closed when the caller drops it).
    fn admit(self: &Arc<Self>, addr: IpAddr, s: &TcpStream) -> Option<Admitted> {
        let at_full = AtFull::evict_if(self.cfg.side_channel.evict_oldest);
        let Ok(handle) = s.try_clone() else { return None };
        match self.gate.enter_or_evict(addr, handle, at_full) {
            Ok((place, evicted)) => {
                if let Some(old) = evicted {
                    // Its handshake's next read fails and its thread ends.
                    let _ = old.shutdown(std::net::Shutdown::Both);
                    inc(&self.counters.side_channel_evicted);
                    tracing::debug!(%addr, "the oldest side-channel handshake closed to make room");
                }
                Some(place)
            }
            Err(GateRefusal::PerPeer) => {
                inc(&self.counters.side_channel_per_address);
                tracing::debug!(%addr, "side-channel handshake refused: per-address cap");
                None
            }
            Err(_) => {
                inc(&self.counters.side_channel_busy);
                tracing::debug!(%addr, "side-channel handshake refused: handshakes at their cap");
                None
            }
        }
    }

    /// One accepted connection: core's handshake first, then a hello (a
    /// connection) or a confirmation request, all within the
    /// whole-handshake deadline.
    fn serve(&self, mut s: TcpStream, from: IpAddr) {
        let deadline = Instant::now() + self.cfg.side_channel.deadline;
        let mut serve = || -> Result<(), AdapterError> {
            let (proved, opening) = {
                let mut io = Deadline::new(&s, deadline, self.cfg.side_channel.idle);
                let est = kv_transfer_core::auth::accept(&mut io, &self.auth, Some(from), &self.auth_counters)?;
                (est.peer.identity, read_opening(&mut io)?)
            };
            match opening {
                Opening::Confirm(q) => self.answer_confirm(&mut s, &q, &proved.endpoint, deadline),
                Opening::Hello(theirs, nonce) => {
                    self.accept_hello(&mut s, theirs, &proved.name, nonce, from, deadline).map(|_| ())
                }
            }
        };
        let r = serve();
        if let Err(e) = r {
            inc(&self.counters.side_channel_refused);
            tracing::warn!(%from, error = %e, "side-channel handshake refused");
        }
    }

    /// Answers "did you dial me on one of these connections?": the index
    /// of the nonce this side sent to the asker (a connection it dialed to
    /// a descriptor carrying the asker's ticket *and* the asker's own
    /// address, `asker_addr`, as the asker proved it in this connection's
    /// handshake), or none. Refused without this side's ticket.
    fn answer_confirm(
        &self,
        s: &mut TcpStream,
        q: &Confirm,
        asker_addr: &str,
        deadline: Instant,
    ) -> Result<(), AdapterError> {
        if !tickets_match(&q.ticket, &self.ticket) {
            return Err(VerbsError::Endpoint("a confirmation request without this side's ticket".into()).into());
        }
        // The positive control's addresses are taken for anyone's.
        let to_asker = |addr: &str| addr == asker_addr || self.cfg.positive_control_addresses.iter().any(|a| a == addr);
        let st = lock(&self.state);
        let ours = |c: &Nonce| {
            st.dialing.get(c).is_some_and(|(t, addr)| tickets_match(t, &q.asker) && to_asker(addr))
                || st.peers.values().any(|p| {
                    p.state == PeerState::Live
                        && p.nonce == *c
                        && p.dialed.as_ref().is_some_and(|d| tickets_match(&d.ticket, &q.asker) && to_asker(&d.addr))
                })
        };
        let answer = q.candidates.iter().position(ours).map_or(NONE_CONFIRMED, |i| i as u8);
        drop(st);
        inc(&self.counters.confirms_answered);
        channel::write_all(s, &[answer], deadline)?;
        Ok(())
    }

    /// Asks the owner of `d`, at `d`'s address, which of `candidates` (the
    /// nonces of connections that claim its name here) it sent to this
    /// side.
    fn confirm_with(&self, d: &Descriptor, candidates: &[Nonce]) -> Result<Option<usize>, AdapterError> {
        let addr = d.addr.parse().map_err(|_| VerbsError::Endpoint(format!("{} is not host:port", d.addr)))?;
        let deadline = Instant::now() + self.cfg.timeout.min(self.cfg.side_channel.deadline);
        let mut s = TcpStream::connect_timeout(&addr, deadline.saturating_duration_since(Instant::now()))?;
        self.auth_dial(&s, d, deadline, self.cfg.side_channel.idle)?;
        let q = Confirm { ticket: d.ticket, asker: self.ticket, candidates: candidates.to_vec() };
        channel::write_all(&mut s, &q.encode()?, deadline)?;
        let mut answer = [0u8; 1];
        std::io::Read::read_exact(&mut Deadline::new(&s, deadline, self.cfg.side_channel.idle), &mut answer)?;
        Ok(Some(usize::from(answer[0])).filter(|i| *i < candidates.len()))
    }

    /// `add_peer`: the confirmed connection to `d`'s owner if one is up;
    /// else a claim to its name that its owner confirms; else a connection
    /// this side dials.
    pub(super) fn add_peer(&self, d: Descriptor) -> Result<PeerId, AdapterError> {
        lock(&self.state).known.insert(d.name.clone(), d.clone());
        if let Some(p) = self.live_peer(&d.name) {
            return Ok(p);
        }
        if self.cfg.identity == PeerIdentity::Confirmed {
            let claims: Vec<(PeerId, Nonce)> = {
                let st = lock(&self.state);
                let mut c: Vec<(PeerId, Nonce)> = st
                    .peers
                    .iter()
                    .filter(|(_, p)| !p.confirmed && p.state == PeerState::Live && p.name == d.name)
                    .map(|(id, p)| (*id, p.nonce))
                    .collect();
                // Newest first: a reconnect supersedes what it replaced.
                c.sort_by_key(|c| std::cmp::Reverse(c.0 .0));
                c.truncate(MAX_CANDIDATES);
                c
            };
            if !claims.is_empty() {
                let nonces: Vec<Nonce> = claims.iter().map(|c| c.1).collect();
                match self.confirm_with(&d, &nonces) {
                    Ok(Some(i)) => {
                        if let Some(id) = self.promote(claims[i].0) {
                            return Ok(id);
                        }
                    }
                    Ok(None) => {
                        self.counters.identity_unconfirmed.fetch_add(claims.len() as u64, Ordering::Relaxed);
                        tracing::warn!(
                            name = %d.name,
                            claims = claims.len(),
                            "connections claim a peer's name that its owner did not dial: not its connections"
                        );
                    }
                    Err(e) => tracing::warn!(name = %d.name, error = %e, "asking a peer about its connections failed"),
                }
            }
        }
        let addr = d.addr.parse().map_err(|_| VerbsError::Endpoint(format!("{} is not host:port", d.addr)))?;
        let mut s = TcpStream::connect_timeout(&addr, self.cfg.timeout)?;
        self.dial_handshake(&mut s, &d)
    }

    /// A claim its owner confirmed: it is the peer now, under its name.
    fn promote(&self, id: PeerId) -> Option<PeerId> {
        let mut st = lock(&self.state);
        let p = st.peers.get_mut(&id).filter(|p| p.state == PeerState::Live)?;
        p.confirmed = true;
        let name = p.name.clone();
        if let Some(old) = st.name_peer(name, id).filter(|o| *o != id) {
            self.drop_record(&mut st, old);
        }
        Some(id)
    }

    /// The dialer's half: our hello (with the dialed side's ticket) and a
    /// fresh nonce, their hello under the name we dialed; the peer is
    /// recorded as `d`'s (we chose the address).
    pub(super) fn dial_handshake(&self, s: &mut TcpStream, d: &Descriptor) -> Result<PeerId, AdapterError> {
        let deadline = Instant::now() + self.cfg.timeout;
        // Core's handshake first: nothing of ours (no QP) for a side that
        // does not prove the key and the descriptor's name.
        self.auth_dial(s, d, deadline, self.cfg.timeout)?;
        let endpoint = self.engine.create_qp(self.cfg.mtu)?;
        let qp = QpId(endpoint.qpn);
        let nonce = fresh_ticket();
        // Known before the hello leaves: the dialed side may ask about it
        // before it answers.
        lock(&self.state).dialing.insert(nonce, (d.ticket, d.addr.clone()));
        let r = (|| {
            let ours = Hello { name: self.cfg.name.clone(), endpoint, ticket: d.ticket };
            let mut b = ours.encode().map_err(|e| (e.into(), false))?;
            b.extend_from_slice(&nonce);
            channel::write_all(s, &b, deadline).map_err(|e| (e.into(), false))?;
            let theirs = Hello::read_from(&mut Deadline::new(&*s, deadline, self.cfg.timeout))
                .map_err(|e| (AdapterError::from(e), false))?;
            if theirs.name != d.name {
                let e = VerbsError::Endpoint(format!("dialed {}, {} answered", d.name, theirs.name));
                return Err((e.into(), false));
            }
            self.record(qp, &theirs, Some(d), nonce, true, None)
        })();
        lock(&self.state).dialing.remove(&nonce);
        r.map_err(|(e, recorded)| self.unrecorded(qp, e, recorded))
    }

    /// Core's handshake as the dialer, on `s` (dialed to `d`'s address),
    /// within `deadline`: this side's name and descriptor address, the
    /// address dialed, and `d`'s name, which the other end must prove.
    fn auth_dial(
        &self,
        s: &TcpStream,
        d: &Descriptor,
        deadline: Instant,
        idle: Duration,
    ) -> Result<Established, AuthError> {
        let cfg = DialerConfig {
            key: self.auth.key.clone(),
            context: AUTH_CONTEXT.into(),
            me: self.auth.me.clone(),
            dialed: d.addr.clone(),
            expect_name: Some(d.name.clone()),
        };
        kv_transfer_core::auth::dial(&mut Deadline::new(s, deadline, idle), cfg, &self.auth_counters)
    }

    /// The acceptor's half, once the dialer's hello is read: refused
    /// without this side's ticket, or under another name than the one its
    /// handshake proved (`proved`); otherwise a connection, confirmed (its
    /// descriptor's owner says it dialed it, or the positive control takes
    /// the declared name) or a capped claim. Recorded before we answer, so
    /// that when the dialer's `add_peer` returns, ours finds it.
    fn accept_hello(
        &self,
        s: &mut TcpStream,
        theirs: Hello,
        proved: &str,
        nonce: Nonce,
        from: IpAddr,
        deadline: Instant,
    ) -> Result<PeerId, AdapterError> {
        if !tickets_match(&theirs.ticket, &self.ticket) {
            return Err(
                VerbsError::Endpoint(format!("a hello from {:?} without this side's ticket", theirs.name)).into()
            );
        }
        if theirs.name != proved {
            return Err(VerbsError::Endpoint(format!(
                "a hello under {:?} on a handshake that proved {proved:?}",
                theirs.name
            ))
            .into());
        }
        let confirmed = match self.cfg.identity {
            PeerIdentity::DeclaredName => true,
            PeerIdentity::Confirmed => {
                let known = lock(&self.state).known.get(&theirs.name).cloned();
                match known.map(|d| self.confirm_with(&d, &[nonce])) {
                    Some(Ok(Some(0))) => true,
                    Some(r) => {
                        inc(&self.counters.identity_unconfirmed);
                        tracing::warn!(
                            name = %theirs.name, %from, answer = ?r.map_err(|e| e.to_string()),
                            "a connection under a known peer's name that its owner did not dial: kept as a claim"
                        );
                        false
                    }
                    None => false,
                }
            }
        };
        if !confirmed {
            let limits = &self.cfg.side_channel;
            let st = lock(&self.state);
            let claims = st.peers.values().filter(|p| !p.confirmed && p.state == PeerState::Live);
            let (mut here, mut all) = (0usize, 0usize);
            for p in claims {
                all += 1;
                here += usize::from(p.from == Some(from));
            }
            if here >= limits.claims_per_address || all >= limits.claims {
                drop(st);
                inc(&self.counters.claims_refused);
                return Err(VerbsError::Endpoint(format!(
                    "an unconfirmed claim to {:?} from {from}: claims at their cap ({here} here, {all} in all)",
                    theirs.name
                ))
                .into());
            }
        }
        let endpoint = self.engine.create_qp(self.cfg.mtu)?;
        let qp = QpId(endpoint.qpn);
        let ours = Hello { name: self.cfg.name.clone(), endpoint, ticket: [0; TICKET_LEN] };
        let r = (|| {
            let id = self.record(qp, &theirs, None, nonce, confirmed, Some(from))?;
            if let Err(e) = channel::write_all(s, &ours.encode().map_err(|e| (e.into(), true))?, deadline) {
                // The dialer gave up: this QP has no partner.
                self.start_fence(&mut lock(&self.state), id);
                return Err((e.into(), true));
            }
            Ok(id)
        })();
        r.map_err(|(e, recorded)| self.unrecorded(qp, e, recorded))
    }

    /// A QP no peer record names is this side's to destroy (a hostile or
    /// broken hello would otherwise cost one per connection).
    fn unrecorded(&self, qp: QpId, e: AdapterError, recorded: bool) -> AdapterError {
        if !recorded {
            self.engine.destroy_qp(qp);
        }
        e
    }

    /// Connects `qp` to theirs, posts its RECV ring and records the peer;
    /// an error says whether the peer (and with it the QP) was recorded.
    fn record(
        &self,
        qp: QpId,
        theirs: &Hello,
        dialed: Option<&Descriptor>,
        nonce: Nonce,
        confirmed: bool,
        from: Option<IpAddr>,
    ) -> Result<PeerId, (AdapterError, bool)> {
        let early = |e: AdapterError| (e, false);
        self.engine.connect(qp, &theirs.endpoint).map_err(|e| early(e.into()))?;
        let ring = |n: u64| -> Result<(MrId, Arc<dyn Region>), AdapterError> {
            let bytes = kv_transfer_core::drain::MAX_LEN as u64 * n;
            let region: Arc<dyn Region> = Arc::new(
                HostRegion::new(bytes as usize).map_err(|e| VerbsError::invalid("control ring", e.to_string()))?,
            );
            Ok((self.engine.register(Arc::clone(&region), MrAccess::Local)?.id, region))
        };
        let (recv, send) = (ring(RECVS).map_err(early)?, ring(u64::from(SENDS)).map_err(early)?);
        let mut st = lock(&self.state);
        st.next_peer += 1;
        let id = PeerId(st.next_peer);
        for index in 0..RECVS {
            let wr = self.wr_id();
            st.wrs.insert(wr, Pending::Recv { peer: id, index });
            let len = kv_transfer_core::drain::MAX_LEN as u32;
            let buffer = WorkRequest::Recv { local: recv.0, offset: index * u64::from(len), len };
            if let Err(e) = self.engine.post(qp, wr, buffer) {
                st.wrs.remove(&wr);
                // RECVs are posted: the QP is not ours to destroy under
                // them; to ERR, so that they flush.
                let _ = self.engine.to_error(qp);
                return Err((e.into(), true));
            }
        }
        // A name is not an identity (the QP is: a window's key works only
        // through the QP it was bound on, a DONE counts only from the peer
        // its exposure went to). Only a confirmed connection is given a
        // name. A second confirmed connection under a name that is live
        // already gets its own peer, and the name keeps naming the first;
        // a reconnect after a fence (or after the NIC put the old QP in
        // ERR, which this side may not have polled yet) takes it over.
        if confirmed {
            let old = st.peer_named(&theirs.name);
            let old_live = old.and_then(|o| st.peers.get(&o)).filter(|p| p.state == PeerState::Live);
            let old_dead = old_live.is_some_and(|p| self.engine.qp_state(p.qp).map_or(true, |s| s == QpState::Error));
            let taken = old_live.is_some() && !old_dead;
            if old_dead {
                if let Some(o) = old {
                    self.start_fence(&mut st, o);
                }
            }
            if taken {
                tracing::warn!(name = %theirs.name, "a second connection under a live peer's name: not given the name");
            } else if let Some(old) = st.name_peer(theirs.name.clone(), id) {
                // The record the name leaves, if fenced already, has no one
                // to name it any more.
                self.drop_record(&mut st, old);
            }
        }
        st.peers.insert(
            id,
            Peer {
                name: theirs.name.clone(),
                dialed: dialed.cloned(),
                qp,
                state: PeerState::Live,
                probed: Instant::now(),
                probing: false,
                recv,
                send,
                send_free: (0..SENDS).rev().collect(),
                nonce,
                confirmed,
                from,
            },
        );
        Ok(id)
    }
}
