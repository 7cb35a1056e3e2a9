//! Who a peer is: a mutual handshake under the cluster's key.
//!
//! A peer is what a handshake proves, never what a message says. Every
//! connection that carries kv-transfer's own protocol starts with one: both
//! ends prove they hold the deployment's [`ClusterKey`] (HMAC-SHA256
//! challenge–response over a transcript that covers both fresh nonces, both
//! names and endpoints, the protocol, and the address the dialer dialed),
//! and agree on a [`Session`] whose keys tag every later control message.
//! Per-peer state is keyed by the [`PeerIdentity`] it yields.
//!
//! - **Wrong key**: a proof does not verify ([`AuthError::WrongKey`]).
//! - **Replayed**: a recorded HELLO is refused by nonce
//!   ([`AuthError::Replayed`]); past the cache, the acceptor's own fresh
//!   nonce makes a recorded FINISH fail as a wrong key.
//! - **Relayed**: a third party that makes an honest peer dial it and
//!   forwards that peer's messages to us is refused, because the peer's
//!   HELLO names the address it dialed ([`AuthError::AddressMismatch`]);
//!   altering that field breaks the peer's proof.
//!
//! The construction is the usual PSK mutual authentication (as in TLS 1.3's
//! PSK mode without the certificates); the primitives are RustCrypto's
//! `hmac`, `sha2` and `hkdf`, nothing written here. `docs/THREAT-MODEL.md`
//! says why and what it does not protect (every key holder is trusted; a
//! key holder can claim any name).
//!
//! The state machines ([`Dialer`], [`Acceptor`]) do no I/O; [`dial`] and
//! [`accept`] drive them over any `Read + Write` (a backend passes a socket
//! wrapped in its own deadlines).
//!
//! ```
//! use kv_transfer_core::auth::*;
//! let key = ClusterKey::from_secret(b"a deployment's shared secret").unwrap();
//! let decode = AcceptorConfig::new(key.clone(), "demo", Identity::new("decode", "10.0.0.2:7000"));
//! let (dialer, hello) = Dialer::start(DialerConfig {
//!     key: key.clone(),
//!     context: "demo".into(),
//!     me: Identity::new("prefill", "10.0.0.1:7000"),
//!     dialed: "10.0.0.2:7000".into(),
//!     expect_name: Some("decode".into()),
//! }).unwrap();
//! let (acceptor, challenge) = Acceptor::on_hello(&decode, hello, None).unwrap();
//! let (mut at_prefill, finish) = dialer.on_challenge(challenge).unwrap();
//! let mut at_decode = acceptor.on_finish(finish).unwrap();
//! assert_eq!(at_decode.peer.identity.name, "prefill");
//! let tag = at_prefill.session.seal(b"DONE");
//! assert!(at_decode.session.open(b"DONE", &tag).is_ok());
//! assert!(at_decode.session.open(b"DONE", &tag).is_err()); // once, in order
//! ```

mod handshake;
mod key;

pub use handshake::{
    Acceptor, AcceptorConfig, Dialer, DialerConfig, Established, Frame, FrameKind, Identity, PeerIdentity, RefusalCode,
    ReplayCache, Session, HEADER_LEN, MAC_LEN, MAX_BODY, MAX_FIELD, NONCE_LEN,
};
pub use key::{ClusterKey, KeyError, KeySource, CLUSTER_KEY_ENV, CLUSTER_KEY_FILE_ENV, MAX_SECRET_LEN, MIN_SECRET_LEN};

use std::io::{Read, Write};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a handshake (or a session's message) was refused. Each is counted
/// ([`AuthCounters`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The connection failed or a deadline passed.
    #[error("handshake I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Not a handshake message of this shape.
    #[error("malformed handshake: {0}")]
    Malformed(&'static str),
    /// Another version of the handshake.
    #[error("handshake version {0} (this is 1)")]
    Version(u8),
    /// The other end's proof did not verify: it holds another key, or a
    /// relay altered what it sent.
    #[error("the peer's proof did not verify: another cluster key, or an altered transcript")]
    WrongKey,
    /// The HELLO's nonce was seen before: a recorded handshake.
    #[error("a replayed handshake (its nonce was seen before)")]
    Replayed,
    /// The dialer dialed an address that is not this side's: a relay.
    #[error("the peer dialed {dialed:?}, which is not this side's address (a relayed handshake)")]
    AddressMismatch {
        /// What the dialer says it dialed.
        dialed: String,
    },
    /// A handshake for another protocol.
    #[error("a handshake for {got:?}, this side speaks {expected:?}")]
    ContextMismatch {
        /// This side's protocol.
        expected: String,
        /// The other's.
        got: String,
    },
    /// The acceptor proved a name other than the one this side dialed for.
    #[error("dialed {expected:?}, the peer proved {got:?}")]
    NameMismatch {
        /// The name dialed for.
        expected: String,
        /// The name proved.
        got: String,
    },
    /// The other end refused the handshake.
    #[error("the peer refused the handshake: {0:?}")]
    Refused(RefusalCode),
    /// A session message whose tag is not the next one of this session.
    #[error("a message not sealed by this session's peer (or out of order)")]
    BadTag,
}

/// What kind of refusal an [`AuthError`] is: one classification for the
/// counters, the Python package's exceptions and the backends' own errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthErrorKind {
    /// A proof did not verify: another cluster key (or an altered transcript).
    WrongKey,
    /// A recorded handshake (its nonce was seen before).
    Replayed,
    /// The dialer dialed an address that is not the acceptor's: a relay.
    AddressMismatch,
    /// A handshake for another protocol.
    ContextMismatch,
    /// The acceptor proved another name than the one dialed for.
    NameMismatch,
    /// The other end refused ours, saying why.
    RefusedByPeer(RefusalCode),
    /// Malformed, another version, a bad session tag.
    Malformed,
    /// The connection failed or a deadline passed.
    Io,
}

impl AuthErrorKind {
    /// Its name (the counter's, without `auth_`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::WrongKey => "wrong_key",
            Self::Replayed => "replayed",
            Self::AddressMismatch => "address_mismatch",
            Self::ContextMismatch => "context_mismatch",
            Self::NameMismatch => "name_mismatch",
            Self::RefusedByPeer(_) => "refused_by_peer",
            Self::Malformed => "malformed",
            Self::Io => "io",
        }
    }
}

impl AuthError {
    /// Its kind.
    pub fn kind(&self) -> AuthErrorKind {
        match self {
            Self::WrongKey => AuthErrorKind::WrongKey,
            Self::Replayed => AuthErrorKind::Replayed,
            Self::AddressMismatch { .. } => AuthErrorKind::AddressMismatch,
            Self::ContextMismatch { .. } => AuthErrorKind::ContextMismatch,
            Self::NameMismatch { .. } => AuthErrorKind::NameMismatch,
            Self::Refused(code) => AuthErrorKind::RefusedByPeer(*code),
            Self::Io(_) => AuthErrorKind::Io,
            Self::Malformed(_) | Self::Version(_) | Self::BadTag => AuthErrorKind::Malformed,
        }
    }
}

/// Counters of one listener's or dialer's handshakes.
#[derive(Debug, Default)]
pub struct AuthCounters {
    established: AtomicU64,
    wrong_key: AtomicU64,
    replayed: AtomicU64,
    address_mismatch: AtomicU64,
    context_mismatch: AtomicU64,
    name_mismatch: AtomicU64,
    refused_by_peer: AtomicU64,
    malformed: AtomicU64,
    io: AtomicU64,
}

/// A snapshot of [`AuthCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AuthStats {
    /// Handshakes that ended in a session.
    pub established: u64,
    /// Refused: a proof did not verify.
    pub wrong_key: u64,
    /// Refused: a HELLO's nonce was seen before.
    pub replayed: u64,
    /// Refused: the dialer dialed another address (a relay).
    pub address_mismatch: u64,
    /// Refused: another protocol.
    pub context_mismatch: u64,
    /// Refused: the acceptor proved another name than the one dialed for.
    pub name_mismatch: u64,
    /// The other end refused ours.
    pub refused_by_peer: u64,
    /// Refused: malformed, another version, or a bad session tag.
    pub malformed: u64,
    /// The connection failed or its deadline passed.
    pub io: u64,
}

impl AuthStats {
    /// Every count, by name (each prefixed `auth_`, as backends report them).
    pub fn fields(&self) -> [(&'static str, u64); 9] {
        [
            ("auth_established", self.established),
            ("auth_wrong_key", self.wrong_key),
            ("auth_replayed", self.replayed),
            ("auth_address_mismatch", self.address_mismatch),
            ("auth_context_mismatch", self.context_mismatch),
            ("auth_name_mismatch", self.name_mismatch),
            ("auth_refused_by_peer", self.refused_by_peer),
            ("auth_malformed", self.malformed),
            ("auth_io", self.io),
        ]
    }
}

impl AuthCounters {
    /// Counts a handshake's end.
    pub fn count(&self, r: &Result<Established, AuthError>) {
        match r {
            Ok(_) => self.count_established(),
            Err(e) => self.count_refusal(e),
        }
    }

    /// Counts a handshake that ended in a session.
    pub fn count_established(&self) {
        self.established.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a refused handshake, by kind.
    pub fn count_refusal(&self, e: &AuthError) {
        let c = match e.kind() {
            AuthErrorKind::WrongKey => &self.wrong_key,
            AuthErrorKind::Replayed => &self.replayed,
            AuthErrorKind::AddressMismatch => &self.address_mismatch,
            AuthErrorKind::ContextMismatch => &self.context_mismatch,
            AuthErrorKind::NameMismatch => &self.name_mismatch,
            AuthErrorKind::RefusedByPeer(_) => &self.refused_by_peer,
            AuthErrorKind::Io => &self.io,
            AuthErrorKind::Malformed => &self.malformed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn snapshot(&self) -> AuthStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        AuthStats {
            established: g(&self.established),
            wrong_key: g(&self.wrong_key),
            replayed: g(&self.replayed),
            address_mismatch: g(&self.address_mismatch),
            context_mismatch: g(&self.context_mismatch),
            name_mismatch: g(&self.name_mismatch),
            refused_by_peer: g(&self.refused_by_peer),
            malformed: g(&self.malformed),
            io: g(&self.io),
        }
    }
}

/// Reads one handshake message; the size is checked before the body is read.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, AuthError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let (kind, len) = Frame::check_header(&h)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Frame { kind, body })
}

fn write_frame(w: &mut impl Write, f: &Frame) -> Result<(), AuthError> {
    w.write_all(&f.encode())?;
    w.flush()?;
    Ok(())
}

/// Tells the other end why, best effort (it may be gone), and returns `e`.
fn refuse(s: &mut impl Write, e: AuthError) -> AuthError {
    if !matches!(e, AuthError::Io(_) | AuthError::Refused(_)) {
        let _ = write_frame(s, &Frame::refused(RefusalCode::of(&e)));
    }
    e
}

/// The dialer's side of a handshake over `s` (bounded by `s`'s own
/// timeouts), counted in `counters`.
pub fn dial<S: Read + Write>(s: &mut S, cfg: DialerConfig, counters: &AuthCounters) -> Result<Established, AuthError> {
    let r = (|| {
        let (dialer, hello) = Dialer::start(cfg)?;
        write_frame(s, &hello)?;
        let challenge = read_frame(s)?;
        match dialer.on_challenge(challenge) {
            Ok((est, finish)) => {
                write_frame(s, &finish)?;
                Ok(est)
            }
            Err(e) => Err(refuse(s, e)),
        }
    })();
    counters.count(&r);
    if let Err(e) = &r {
        tracing::debug!(error = %e, "outbound handshake refused");
    }
    r
}

/// The acceptor's side of a handshake over `s`, from `source` (bounded by
/// `s`'s own timeouts), counted in `counters`.
pub fn accept<S: Read + Write>(
    s: &mut S,
    cfg: &AcceptorConfig,
    source: Option<IpAddr>,
    counters: &AuthCounters,
) -> Result<Established, AuthError> {
    let r = (|| {
        let hello = read_frame(s)?;
        let (acceptor, challenge) = match Acceptor::on_hello(cfg, hello, source) {
            Ok(x) => x,
            Err(e) => return Err(refuse(s, e)),
        };
        write_frame(s, &challenge)?;
        let finish = read_frame(s)?;
        acceptor.on_finish(finish).map_err(|e| refuse(s, e))
    })();
    counters.count(&r);
    if let Err(e) = &r {
        tracing::debug!(?source, error = %e, "inbound handshake refused");
    }
    r
}

#[cfg(test)]
mod tests;
