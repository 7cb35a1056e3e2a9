//! Sealed notifications: a notification between two kv-transfer engines
//! whose receiver knows who sent it.
//!
//! A Mooncake notification names its sender in a JSON field that anyone who
//! reaches the handshake port can fill, so on its own it proves nothing: a
//! third party can send ABORTs under a decode's name and spend that decode's
//! share of the initiator's abort state (round three's attack 2). Between
//! two kv-transfer engines (a descriptor that advertises
//! [`SegmentDesc::kvt_notify_auth`](crate::proto::SegmentDesc::kvt_notify_auth)),
//! a notification travels instead on a handshake connection that starts with
//! core's peer handshake ([`kv_transfer_core::auth`], context
//! [`AUTH_CONTEXT`]), under the cluster key both engines were given:
//!
//! ```text
//! dialer                                   acceptor (the handshake port)
//!   [len][0x10]{}                     ->   a sealed notification follows
//!   HELLO                             ->
//!                                     <-   CHALLENGE
//!   FINISH, [len][2]{notify}, tag     ->   queued under the proven name
//!                                     <-   [len][2]{"notify_msg":"success"}
//!   [len][2]{notify}, tag             ->   the next one, on the same session
//!                                     <-   [len][2]{"notify_msg":"success"}
//! ```
//!
//! The dialer keeps the connection for its next notification to the same
//! engine (one round trip each, as a plain notification costs), for up to
//! 2 s idle; the acceptor closes it after its idle deadline.
//!
//! The handshake binds both segment names and the address the dialer dialed
//! (a relay is refused), and is fresh (both nonces); the tag is the session's
//! sequence number, so nothing recorded opens again. The receiver also checks
//! that the name the dialer proved is at the address its connection came
//! from (a segment name is `ip:port`). The notification is then queued under
//! that name, marked [`NotifyDesc::proven`]; a plain one, whatever name it
//! declares, is not.
//!
//! To a real Mooncake engine (no such field in its descriptor) notifications
//! stay plain: the wire must stay the engine's, and what such a peer says is
//! only ever trusted with an exposure's token.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_transfer_core::hash::HashMap;

use kv_transfer_core::auth::{
    self, AcceptorConfig, AuthCounters, AuthError, AuthStats, ClusterKey, DialerConfig, Identity, Session, MAC_LEN,
};

use crate::error::EngineError;
use crate::proto::{HandshakeFrame, HandshakeType, NotifyDesc, NotifyReply, MAX_HANDSHAKE_LEN};

/// The handshake's context for sealed notifications: a handshake for another
/// protocol (tcp-sim's NIC, the verbs side channel) is refused here.
pub const AUTH_CONTEXT: &str = "kvt-mooncake-notify";

/// The version of sealed notifications this engine speaks (advertised in its
/// descriptor).
pub const SEALED_NOTIFY_VERSION: u32 = 1;

/// One engine's side of sealed notifications: its key, its segment name,
/// and what its handshakes proved or refused. An engine holds one; a test
/// that plays another engine (or a hostile peer with another key) makes its
/// own.
#[derive(Debug)]
pub struct NotifyAuth {
    acceptor: AcceptorConfig,
    counters: AuthCounters,
    /// Established connections per target, kept between notifications (a
    /// notification on one costs one round trip, as a plain one does). More
    /// than one, because a request's DONEs (its KV pages, its aux row) end
    /// at once on different threads: with one kept, the second dialed a new
    /// handshake for every request.
    idle: Mutex<HashMap<String, Vec<Open>>>,
}

/// A dialed connection whose handshake is done, and when it was last used.
#[derive(Debug)]
struct Open {
    stream: TcpStream,
    session: Session,
    used: Instant,
}

/// A kept connection idle longer than this is dropped rather than reused:
/// below the acceptor's idle deadline ([`crate::ConnLimits::HANDSHAKE`],
/// 5 s), so a reused connection is rarely one the other end just closed.
const REUSE_WITHIN: Duration = Duration::from_secs(2);

/// Targets with kept connections at most.
const MAX_KEPT: usize = 256;

/// Connections kept per target at most (each holds a thread at the target's
/// handshake port until its idle deadline).
const MAX_KEPT_PER_TARGET: usize = 4;

impl NotifyAuth {
    /// `segment` is this engine's segment name (`ip:port` of its handshake
    /// port): its name and its endpoint, and what dialers dial.
    pub fn new(key: ClusterKey, segment: &str) -> Self {
        let acceptor = AcceptorConfig::new(key, AUTH_CONTEXT, Identity::new(segment, segment));
        Self { acceptor, counters: AuthCounters::default(), idle: Mutex::default() }
    }

    /// What its handshakes proved and refused so far.
    pub fn stats(&self) -> AuthStats {
        self.counters.snapshot()
    }

    /// Sends `msg` to the engine whose segment is `target` (dialed at
    /// `addr`), sealed; `Ok` only if it proved to be `target` and queued it.
    /// On the connection kept from the last notification to `target` if
    /// there is one (a message whose connection turns out closed goes again
    /// on a new one: a message is queued at most once per connection, and a
    /// repeated DONE or ABORT is harmless), else on a new one.
    pub fn send(&self, addr: SocketAddr, target: &str, msg: &str, timeout: Duration) -> Result<(), EngineError> {
        let frame = HandshakeFrame::new(HandshakeType::Notify, NotifyDesc::new(&self.acceptor.me.name, msg).to_json());
        let frame = frame.encode();
        if let Some(mut open) = self.take_kept(target) {
            if let Ok(r) = exchange(&mut open, &frame, target) {
                self.keep(target, open);
                return r;
            }
        }
        let mut open = self.dial(addr, target, timeout)?;
        let r = exchange(&mut open, &frame, target)?;
        self.keep(target, open);
        r
    }

    /// The most recently used kept connection to `target` still within
    /// [`REUSE_WITHIN`] (older ones are dropped).
    fn take_kept(&self, target: &str) -> Option<Open> {
        let mut idle = lock(&self.idle);
        let kept = idle.get_mut(target)?;
        kept.retain(|o| o.used.elapsed() < REUSE_WITHIN);
        let open = kept.pop();
        if kept.is_empty() {
            idle.remove(target);
        }
        open
    }

    fn keep(&self, target: &str, mut open: Open) {
        open.used = Instant::now();
        let mut idle = lock(&self.idle);
        if idle.len() >= MAX_KEPT && !idle.contains_key(target) {
            idle.retain(|_, kept| {
                kept.retain(|o| o.used.elapsed() < REUSE_WITHIN);
                !kept.is_empty()
            });
            if idle.len() >= MAX_KEPT {
                return;
            }
        }
        let kept = idle.entry(target.to_string()).or_default();
        if kept.len() < MAX_KEPT_PER_TARGET {
            kept.push(open);
        }
    }

    /// A new connection to `target` at `addr`, its handshake done.
    fn dial(&self, addr: SocketAddr, target: &str, timeout: Duration) -> Result<Open, EngineError> {
        let mut s = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| EngineError::io(format!("connect handshake {addr}"), e))?;
        s.set_read_timeout(Some(timeout)).map_err(|e| EngineError::io("set timeout", e))?;
        s.set_write_timeout(Some(timeout)).map_err(|e| EngineError::io("set timeout", e))?;
        // Small writes each waiting for an answer: with Nagle each would
        // wait for the previous one's (delayed) ACK, tens of ms a message.
        s.set_nodelay(true).map_err(|e| EngineError::io("set nodelay", e))?;
        HandshakeFrame::new(HandshakeType::SealedNotify, b"{}\n".to_vec()).write_to(&mut s)?;
        let cfg = DialerConfig {
            key: self.acceptor.key.clone(),
            context: AUTH_CONTEXT.into(),
            me: self.acceptor.me.clone(),
            dialed: target.to_string(),
            expect_name: Some(target.to_string()),
        };
        let est = auth::dial(&mut s, cfg, &self.counters).map_err(EngineError::PeerAuth)?;
        Ok(Open { stream: s, session: est.session, used: Instant::now() })
    }

    /// The acceptor's side, after the opening frame: the handshake, and
    /// the name it proved. `None` (counted) if refused.
    pub(crate) fn accept<S: Read + Write>(&self, s: &mut S, source: IpAddr) -> Option<Inbound> {
        let est = auth::accept(s, &self.acceptor, Some(source), &self.counters).ok()?;
        let name = est.peer.identity.name.clone();
        // A segment name is where its engine listens: a key holder at one
        // address is not another address's engine.
        if let Ok(at) = name.parse::<SocketAddr>() {
            if !at.ip().is_unspecified() && at.ip() != source {
                let e = AuthError::NameMismatch { expected: format!("a segment at {source}"), got: name };
                tracing::debug!(error = %e, "sealed notification refused");
                self.counters.count_refusal(&e);
                return None;
            }
        }
        Some(Inbound { name, session: est.session })
    }

    /// The next sealed notification on an accepted connection, its sender
    /// set to the name the handshake proved. `None` at the end of the
    /// connection or (counted) for anything refused, which ends it.
    pub(crate) fn next<S: Read>(&self, s: &mut S, inbound: &mut Inbound) -> Option<NotifyDesc> {
        let frame = HandshakeFrame::read_from(s, MAX_HANDSHAKE_LEN).ok()?;
        let mut tag = [0u8; MAC_LEN];
        s.read_exact(&mut tag).ok()?;
        if frame.kind != HandshakeType::Notify {
            return None;
        }
        let name = &inbound.name;
        if let Err(e) = inbound.session.open(&frame.encode(), &tag) {
            tracing::debug!(peer = %name, error = %e, "sealed notification with a bad tag");
            self.counters.count_refusal(&e);
            return None;
        }
        let mut n = NotifyDesc::from_json(&frame.json).ok()?;
        if n.name != *name {
            let e = AuthError::NameMismatch { expected: name.clone(), got: n.name };
            tracing::debug!(error = %e, "sealed notification under another name");
            self.counters.count_refusal(&e);
            return None;
        }
        n.proven = true;
        Some(n)
    }
}

/// An accepted connection whose handshake is done: who it proved to be,
/// and the session its notifications are sealed in.
#[derive(Debug)]
pub(crate) struct Inbound {
    name: String,
    session: Session,
}

/// One sealed notification on an open connection, and its answer: `Err`
/// if the connection failed (the caller may try a new one), `Ok` with the
/// target's verdict otherwise.
fn exchange(open: &mut Open, frame: &[u8], target: &str) -> Result<Result<(), EngineError>, EngineError> {
    let tag = open.session.seal(frame);
    let mut out = Vec::with_capacity(frame.len() + MAC_LEN);
    out.extend_from_slice(frame);
    out.extend_from_slice(&tag);
    open.stream.write_all(&out).map_err(|e| EngineError::io(format!("sealed notify to {target}"), e))?;
    let reply = HandshakeFrame::read_from(&mut open.stream, MAX_HANDSHAKE_LEN)?;
    if reply.kind != HandshakeType::Notify {
        return Err(EngineError::UnexpectedReply { expected: HandshakeType::Notify, got: reply.kind });
    }
    let r: NotifyReply = serde_json::from_slice(&reply.json).map_err(crate::proto::ProtoError::from)?;
    Ok(if r.is_success() { Ok(()) } else { Err(EngineError::NotifyRejected(r.notify_msg)) })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`crate::MooncakeEngine`] needs to seal: its key (`None`: the
/// deployment's, [`ClusterKey::from_env`]).
pub(crate) fn key_or_env(key: &Option<ClusterKey>) -> Result<ClusterKey, EngineError> {
    match key {
        Some(k) => Ok(k.clone()),
        None => ClusterKey::from_env().map_err(EngineError::Key),
    }
}
