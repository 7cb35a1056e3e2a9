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
//! ```
//!
//! The handshake binds both segment names and the address the dialer dialed
//! (a relay is refused), and is fresh (both nonces); the tag is the session's
//! first message, so nothing recorded opens again. The receiver also checks
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
use std::time::Duration;

use kv_transfer_core::auth::{
    self, AcceptorConfig, AuthCounters, AuthError, AuthStats, ClusterKey, DialerConfig, Identity, MAC_LEN,
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
}

impl NotifyAuth {
    /// `segment` is this engine's segment name (`ip:port` of its handshake
    /// port): its name and its endpoint, and what dialers dial.
    pub fn new(key: ClusterKey, segment: &str) -> Self {
        let acceptor = AcceptorConfig::new(key, AUTH_CONTEXT, Identity::new(segment, segment));
        Self { acceptor, counters: AuthCounters::default() }
    }

    /// What its handshakes proved and refused so far.
    pub fn stats(&self) -> AuthStats {
        self.counters.snapshot()
    }

    /// Sends `msg` to the engine whose segment is `target` (dialed at
    /// `addr`), sealed; `Ok` only if it proved to be `target` and queued it.
    pub fn send(&self, addr: SocketAddr, target: &str, msg: &str, timeout: Duration) -> Result<(), EngineError> {
        let mut s = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| EngineError::io(format!("connect handshake {addr}"), e))?;
        s.set_read_timeout(Some(timeout)).map_err(|e| EngineError::io("set timeout", e))?;
        s.set_write_timeout(Some(timeout)).map_err(|e| EngineError::io("set timeout", e))?;
        // Four small writes before the answer: with Nagle each would wait
        // for the previous one's (delayed) ACK, tens of ms per notification.
        s.set_nodelay(true).map_err(|e| EngineError::io("set nodelay", e))?;
        HandshakeFrame::new(HandshakeType::SealedNotify, b"{}\n".to_vec()).write_to(&mut s)?;
        let me = &self.acceptor.me;
        let cfg = DialerConfig {
            key: self.acceptor.key.clone(),
            context: AUTH_CONTEXT.into(),
            me: me.clone(),
            dialed: target.to_string(),
            expect_name: Some(target.to_string()),
        };
        let mut est = auth::dial(&mut s, cfg, &self.counters).map_err(EngineError::PeerAuth)?;
        let frame = HandshakeFrame::new(HandshakeType::Notify, NotifyDesc::new(&me.name, msg).to_json()).encode();
        let tag = est.session.seal(&frame);
        let mut out = frame;
        out.extend_from_slice(&tag);
        s.write_all(&out).map_err(|e| EngineError::io(format!("sealed notify to {target}"), e))?;
        let reply = HandshakeFrame::read_from(&mut s, MAX_HANDSHAKE_LEN)?;
        if reply.kind != HandshakeType::Notify {
            return Err(EngineError::UnexpectedReply { expected: HandshakeType::Notify, got: reply.kind });
        }
        let r: NotifyReply = serde_json::from_slice(&reply.json).map_err(crate::proto::ProtoError::from)?;
        if r.is_success() {
            Ok(())
        } else {
            Err(EngineError::NotifyRejected(r.notify_msg))
        }
    }

    /// The acceptor's side, after the opening frame: the handshake, then the
    /// sealed notification, returned with its sender set to the name the
    /// handshake proved. `None` (counted) for anything refused.
    pub(crate) fn accept<S: Read + Write>(&self, s: &mut S, source: IpAddr) -> Option<NotifyDesc> {
        let mut est = auth::accept(s, &self.acceptor, Some(source), &self.counters).ok()?;
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
        let frame = HandshakeFrame::read_from(s, MAX_HANDSHAKE_LEN).ok()?;
        let mut tag = [0u8; MAC_LEN];
        s.read_exact(&mut tag).ok()?;
        if frame.kind != HandshakeType::Notify {
            return None;
        }
        if let Err(e) = est.session.open(&frame.encode(), &tag) {
            tracing::debug!(peer = %name, error = %e, "sealed notification with a bad tag");
            self.counters.count_refusal(&e);
            return None;
        }
        let mut n = NotifyDesc::from_json(&frame.json).ok()?;
        if n.name != name {
            let e = AuthError::NameMismatch { expected: name, got: n.name };
            tracing::debug!(error = %e, "sealed notification under another name");
            self.counters.count_refusal(&e);
            return None;
        }
        n.proven = true;
        Some(n)
    }
}

/// What [`crate::MooncakeEngine`] needs to seal: its key (`None`: the
/// deployment's, [`ClusterKey::from_env`]).
pub(crate) fn key_or_env(key: &Option<ClusterKey>) -> Result<ClusterKey, EngineError> {
    match key {
        Some(k) => Ok(k.clone()),
        None => ClusterKey::from_env().map_err(EngineError::Key),
    }
}
