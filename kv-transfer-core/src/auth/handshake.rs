//! The handshake, sans-IO: its three messages, the dialer's and the
//! acceptor's state machines, and the session they agree on.
//!
//! ```text
//!  dialer                                              acceptor
//!  HELLO  nonce_d, context, name_d, endpoint_d, dialed ─►  dialed one of mine? nonce_d new?
//!     ◄─ CHALLENGE  nonce_a, name_a, endpoint_a, proof_a = HMAC(K, "acceptor" ‖ th)
//!  proof_a right?
//!  FINISH  proof_d = HMAC(K, "dialer" ‖ th)            ─►  proof_d right?
//!  th = SHA-256(label ‖ HELLO's body ‖ name_a ‖ endpoint_a ‖ nonce_a)
//! ```
//!
//! Both proofs cover both nonces (fresh: nothing recorded passes again),
//! both names and endpoints, and the address the dialer dialed (so a relay
//! that makes a peer dial it and forwards the peer's messages to us is
//! refused: the peer's transcript names the relay's address). Session keys,
//! one per direction, are HKDF-SHA256 of the cluster key salted with `th`.

use super::key::ClusterKey;
use super::AuthError;
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::net::IpAddr;

/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof or a message tag (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Longest name, endpoint, dialed address or context in a handshake.
pub const MAX_FIELD: usize = 512;
/// Longest body of a handshake message (checked before anything is allocated).
pub const MAX_BODY: usize = NONCE_LEN + 4 * (2 + MAX_FIELD) + MAC_LEN;
/// Bytes of a message's header: magic `KVTA`, version, kind, body length (u16 LE).
pub const HEADER_LEN: usize = 8;

const MAGIC: [u8; 4] = *b"KVTA";
const VERSION: u8 = 1;
const LABEL: &[u8] = b"kv-transfer handshake v1";

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 of the concatenated `parts` under `key`.
pub(super) fn mac(key: &[u8; 32], parts: &[&[u8]]) -> [u8; MAC_LEN] {
    // HMAC takes a key of any length: cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Checks `tag` against the HMAC of `parts`, in constant time.
fn verify(key: &[u8; 32], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

fn fresh_nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    if let Err(e) = getrandom::fill(&mut n) {
        // Without randomness there is no freshness: refuse to make a nonce
        // that could repeat, loudly (a handshake with it fails its peer's
        // replay check rather than pass a recorded one).
        tracing::error!(error = %e, "OS random source failed: handshake nonce is all zeros");
    }
    n
}

/// The kind of a handshake message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameKind {
    /// Dialer → acceptor, first.
    Hello = 1,
    /// Acceptor → dialer: its nonce and proof.
    Challenge = 2,
    /// Dialer → acceptor: its proof.
    Finish = 3,
    /// Either way: the handshake was refused, with a [`RefusalCode`].
    Refused = 4,
}

/// Why the other end refused a handshake (what a REFUSED message carries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefusalCode {
    /// A proof did not verify: the two ends hold different keys (or a relay altered the transcript).
    WrongKey = 1,
    /// The HELLO's nonce was seen before.
    Replayed = 2,
    /// The dialer dialed an address that is not the acceptor's.
    AddressMismatch = 3,
    /// The two ends speak for different protocols.
    ContextMismatch = 4,
    /// Malformed, or anything else.
    Other = 255,
}

impl RefusalCode {
    fn from_u8(b: u8) -> Self {
        match b {
            1 => Self::WrongKey,
            2 => Self::Replayed,
            3 => Self::AddressMismatch,
            4 => Self::ContextMismatch,
            _ => Self::Other,
        }
    }

    /// The code that tells the other end about `e`.
    pub fn of(e: &AuthError) -> Self {
        use super::AuthErrorKind as K;
        match e.kind() {
            K::WrongKey => Self::WrongKey,
            K::Replayed => Self::Replayed,
            K::AddressMismatch => Self::AddressMismatch,
            K::ContextMismatch => Self::ContextMismatch,
            _ => Self::Other,
        }
    }
}

/// One handshake message, its header checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Its kind.
    pub kind: FrameKind,
    /// Its body (at most [`MAX_BODY`] bytes).
    pub body: Vec<u8>,
}

impl Frame {
    /// Checks a header; returns the kind and the body's length, so a reader
    /// knows how much to read (never more than [`MAX_BODY`]).
    pub fn check_header(h: &[u8; HEADER_LEN]) -> Result<(FrameKind, usize), AuthError> {
        if h[0..4] != MAGIC {
            return Err(AuthError::Malformed("not a kv-transfer handshake"));
        }
        if h[4] != VERSION {
            return Err(AuthError::Version(h[4]));
        }
        let kind = match h[5] {
            1 => FrameKind::Hello,
            2 => FrameKind::Challenge,
            3 => FrameKind::Finish,
            4 => FrameKind::Refused,
            _ => return Err(AuthError::Malformed("unknown handshake message kind")),
        };
        let len = usize::from(u16::from_le_bytes([h[6], h[7]]));
        if len > MAX_BODY {
            return Err(AuthError::Malformed("handshake message over its size cap"));
        }
        Ok((kind, len))
    }

    /// One whole message from `bytes` (header and body, nothing after).
    pub fn decode(bytes: &[u8]) -> Result<Self, AuthError> {
        let Some((h, body)) = bytes.split_first_chunk::<HEADER_LEN>() else {
            return Err(AuthError::Malformed("short handshake message"));
        };
        let (kind, len) = Self::check_header(h)?;
        if body.len() != len {
            return Err(AuthError::Malformed("handshake message length"));
        }
        Ok(Self { kind, body: body.to_vec() })
    }

    /// Its wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + self.body.len());
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        b.push(self.kind as u8);
        b.extend_from_slice(&(self.body.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.body);
        b
    }

    /// A REFUSED message.
    pub fn refused(code: RefusalCode) -> Self {
        Self { kind: FrameKind::Refused, body: vec![code as u8] }
    }

    fn expect(self, kind: FrameKind) -> Result<Vec<u8>, AuthError> {
        if self.kind == FrameKind::Refused {
            return Err(AuthError::Refused(RefusalCode::from_u8(self.body.first().copied().unwrap_or(255))));
        }
        if self.kind != kind {
            return Err(AuthError::Malformed("unexpected handshake message"));
        }
        Ok(self.body)
    }
}

fn put_field(b: &mut Vec<u8>, f: &[u8]) -> Result<(), AuthError> {
    if f.len() > MAX_FIELD {
        return Err(AuthError::Malformed("a handshake field over its size cap"));
    }
    b.extend_from_slice(&(f.len() as u16).to_le_bytes());
    b.extend_from_slice(f);
    Ok(())
}

/// Reads a body's fields in order, each checked against what is left.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], AuthError> {
        let Some((a, rest)) = self.0.split_first_chunk::<N>() else {
            return Err(AuthError::Malformed("short handshake message"));
        };
        self.0 = rest;
        Ok(*a)
    }

    fn field(&mut self) -> Result<String, AuthError> {
        let n = usize::from(u16::from_le_bytes(self.fixed::<2>()?));
        if n > MAX_FIELD || n > self.0.len() {
            return Err(AuthError::Malformed("a handshake field's length"));
        }
        let (f, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8(f.to_vec()).map_err(|_| AuthError::Malformed("a handshake field that is not UTF-8"))
    }

    fn end(&self) -> Result<(), AuthError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(AuthError::Malformed("bytes after a handshake message's fields"))
        }
    }
}

/// Who one end is: its name and the endpoint it publishes (where it listens).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    /// Its name.
    pub name: String,
    /// Its endpoint (empty for an end that never accepts).
    pub endpoint: String,
}

impl Identity {
    /// `name` at `endpoint`.
    pub fn new(name: impl Into<String>, endpoint: impl Into<String>) -> Self {
        Self { name: name.into(), endpoint: endpoint.into() }
    }
}

/// What the other end proved: it holds the cluster key, it is `identity`
/// (as its key-holding self declared, bound into both proofs), and, for an
/// accepted connection, the address it came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerIdentity {
    /// Its name and endpoint, as both proofs cover them.
    pub identity: Identity,
    /// Where an accepted connection came from (the acceptor's view).
    pub source: Option<IpAddr>,
    /// Whether the key it proved is a secret ([`ClusterKey::authenticates`]).
    pub authenticated: bool,
}

/// A finished handshake.
#[derive(Debug)]
pub struct Established {
    /// Who the other end is.
    pub peer: PeerIdentity,
    /// The session both ends now share.
    pub session: Session,
}

/// Recently seen HELLO nonces, so a recorded HELLO is refused as
/// [`AuthError::Replayed`] (a replay past this window still fails: the
/// acceptor's nonce is new, so the recorded FINISH proves nothing).
/// Bounded: the oldest nonce is forgotten past `capacity`.
#[derive(Debug)]
pub struct ReplayCache {
    inner: parking_lot::Mutex<Seen>,
    capacity: usize,
}

/// Nonces in the order seen, and as a set.
type Seen = (VecDeque<[u8; NONCE_LEN]>, crate::hash::HashSet<[u8; NONCE_LEN]>);

impl ReplayCache {
    /// A cache of the last `capacity` nonces.
    pub fn new(capacity: usize) -> Self {
        Self { inner: parking_lot::Mutex::new(Default::default()), capacity: capacity.max(1) }
    }

    /// True if `n` is new (and remembers it).
    fn fresh(&self, n: &[u8; NONCE_LEN]) -> bool {
        let mut g = self.inner.lock();
        let (order, seen) = &mut *g;
        if !seen.insert(*n) {
            return false;
        }
        order.push_back(*n);
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                seen.remove(&old);
            }
        }
        true
    }
}

impl Default for ReplayCache {
    fn default() -> Self {
        Self::new(4096)
    }
}

/// What a dialer knows before it dials.
#[derive(Clone, Debug)]
pub struct DialerConfig {
    /// The cluster key.
    pub key: ClusterKey,
    /// Which protocol the connection is for (`"tcp-sim"`, `"verbs"`, ...):
    /// a handshake for one is refused by another.
    pub context: String,
    /// This side.
    pub me: Identity,
    /// The address this side dials, exactly as it will connect to it.
    pub dialed: String,
    /// The name the other end must prove, if this side knows it.
    pub expect_name: Option<String>,
}

/// The dialer after its HELLO, waiting for the CHALLENGE.
#[derive(Debug)]
pub struct Dialer {
    cfg: DialerConfig,
    /// The HELLO's body (its nonce first): the transcript starts with it.
    hello_body: Vec<u8>,
}

impl Dialer {
    /// Starts a handshake: the dialer, and the HELLO to send.
    pub fn start(cfg: DialerConfig) -> Result<(Self, Frame), AuthError> {
        let nonce = fresh_nonce();
        let mut body = Vec::with_capacity(NONCE_LEN + 64);
        body.extend_from_slice(&nonce);
        put_field(&mut body, cfg.context.as_bytes())?;
        put_field(&mut body, cfg.me.name.as_bytes())?;
        put_field(&mut body, cfg.me.endpoint.as_bytes())?;
        put_field(&mut body, cfg.dialed.as_bytes())?;
        let hello = Frame { kind: FrameKind::Hello, body: body.clone() };
        Ok((Self { cfg, hello_body: body }, hello))
    }

    /// The acceptor's CHALLENGE: checks its proof, and returns the session
    /// and the FINISH to send.
    pub fn on_challenge(self, frame: Frame) -> Result<(Established, Frame), AuthError> {
        let body = frame.expect(FrameKind::Challenge)?;
        let mut f = Fields(&body);
        let nonce_a: [u8; NONCE_LEN] = f.fixed()?;
        let name_a = f.field()?;
        let endpoint_a = f.field()?;
        let proof_a: [u8; MAC_LEN] = f.fixed()?;
        f.end()?;
        let th = transcript(&self.hello_body, &name_a, &endpoint_a, &nonce_a);
        let k = self.cfg.key.bytes();
        if !verify(k, &[b"acceptor", &th], &proof_a) {
            return Err(AuthError::WrongKey);
        }
        if let Some(want) = &self.cfg.expect_name {
            if *want != name_a {
                return Err(AuthError::NameMismatch { expected: want.clone(), got: name_a });
            }
        }
        let finish = Frame { kind: FrameKind::Finish, body: mac(k, &[b"dialer", &th]).to_vec() };
        let peer = PeerIdentity {
            identity: Identity::new(name_a, endpoint_a),
            source: None,
            authenticated: self.cfg.key.authenticates(),
        };
        Ok((Established { peer, session: Session::new(k, &th, Role::Dialer) }, finish))
    }
}

/// What an acceptor knows before it accepts.
#[derive(Clone, Debug)]
pub struct AcceptorConfig {
    /// The cluster key.
    pub key: ClusterKey,
    /// Which protocol the listener is for (see [`DialerConfig::context`]).
    pub context: String,
    /// This side.
    pub me: Identity,
    /// Every address a dialer may have dialed to reach this side (its
    /// published endpoint, and any other spelling it answers to). A HELLO
    /// that dialed anything else is a relayed one: refused.
    pub addresses: Vec<String>,
    /// The listener's recently seen nonces (shared by its handshakes).
    pub replay: std::sync::Arc<ReplayCache>,
}

impl AcceptorConfig {
    /// An acceptor that answers to `me.endpoint` only.
    pub fn new(key: ClusterKey, context: impl Into<String>, me: Identity) -> Self {
        let addresses = vec![me.endpoint.clone()];
        Self { key, context: context.into(), me, addresses, replay: Default::default() }
    }
}

/// The acceptor after its CHALLENGE, waiting for the FINISH.
#[derive(Debug)]
pub struct Acceptor {
    key: ClusterKey,
    th: [u8; 32],
    peer: PeerIdentity,
}

impl Acceptor {
    /// The dialer's HELLO, from `source`: checks it dialed one of this
    /// side's addresses, for this protocol, with a nonce never seen; returns
    /// the acceptor and the CHALLENGE to send.
    pub fn on_hello(cfg: &AcceptorConfig, frame: Frame, source: Option<IpAddr>) -> Result<(Self, Frame), AuthError> {
        let hello_body = frame.expect(FrameKind::Hello)?;
        let mut f = Fields(&hello_body);
        let nonce_d: [u8; NONCE_LEN] = f.fixed()?;
        let context = f.field()?;
        let name_d = f.field()?;
        let endpoint_d = f.field()?;
        let dialed = f.field()?;
        f.end()?;
        if context != cfg.context {
            return Err(AuthError::ContextMismatch { expected: cfg.context.clone(), got: context });
        }
        if name_d.is_empty() {
            return Err(AuthError::Malformed("an empty name"));
        }
        if !cfg.addresses.contains(&dialed) {
            return Err(AuthError::AddressMismatch { dialed });
        }
        if !cfg.replay.fresh(&nonce_d) {
            return Err(AuthError::Replayed);
        }
        let nonce_a = fresh_nonce();
        let th = transcript(&hello_body, &cfg.me.name, &cfg.me.endpoint, &nonce_a);
        let mut body = Vec::with_capacity(NONCE_LEN + MAC_LEN + 64);
        body.extend_from_slice(&nonce_a);
        put_field(&mut body, cfg.me.name.as_bytes())?;
        put_field(&mut body, cfg.me.endpoint.as_bytes())?;
        body.extend_from_slice(&mac(cfg.key.bytes(), &[b"acceptor", &th]));
        let peer = PeerIdentity {
            identity: Identity::new(name_d, endpoint_d),
            source,
            authenticated: cfg.key.authenticates(),
        };
        Ok((Self { key: cfg.key.clone(), th, peer }, Frame { kind: FrameKind::Challenge, body }))
    }

    /// The dialer's FINISH: checks its proof; returns the session.
    pub fn on_finish(self, frame: Frame) -> Result<Established, AuthError> {
        let body = frame.expect(FrameKind::Finish)?;
        if !verify(self.key.bytes(), &[b"dialer", &self.th], &body) {
            return Err(AuthError::WrongKey);
        }
        Ok(Established { peer: self.peer, session: Session::new(self.key.bytes(), &self.th, Role::Acceptor) })
    }
}

fn transcript(hello_body: &[u8], name_a: &str, endpoint_a: &str, nonce_a: &[u8; NONCE_LEN]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(LABEL);
    h.update((hello_body.len() as u32).to_le_bytes());
    h.update(hello_body);
    for f in [name_a.as_bytes(), endpoint_a.as_bytes()] {
        h.update((f.len() as u32).to_le_bytes());
        h.update(f);
    }
    h.update(nonce_a);
    h.finalize().into()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Dialer,
    Acceptor,
}

/// The keys two ends agreed on: one per direction, each message tagged
/// with its sequence number, so a message is accepted once, in order, only
/// from this session ([`seal`](Self::seal), [`open`](Self::open)).
pub struct Session {
    id: [u8; 16],
    send: [u8; 32],
    recv: [u8; 32],
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("id", &self.id_hex()).field("sent", &self.sent).finish()
    }
}

impl Session {
    fn new(key: &[u8; 32], th: &[u8; 32], role: Role) -> Self {
        let hk = Hkdf::<Sha256>::new(Some(th), key);
        let (mut d2a, mut a2d, mut id) = ([0u8; 32], [0u8; 32], [0u8; 16]);
        // Lengths far below HKDF's limit: cannot fail.
        let _ = hk.expand(b"kv-transfer session dialer to acceptor", &mut d2a);
        let _ = hk.expand(b"kv-transfer session acceptor to dialer", &mut a2d);
        let _ = hk.expand(b"kv-transfer session id", &mut id);
        let (send, recv) = match role {
            Role::Dialer => (d2a, a2d),
            Role::Acceptor => (a2d, d2a),
        };
        Self { id, send, recv, sent: 0, received: 0 }
    }

    /// The session's id (the same at both ends; public).
    pub fn id(&self) -> [u8; 16] {
        self.id
    }

    fn id_hex(&self) -> String {
        self.id[..4].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The tag of the next message this side sends.
    pub fn seal(&mut self, msg: &[u8]) -> [u8; MAC_LEN] {
        let tag = mac(&self.send, &[&self.sent.to_le_bytes(), msg]);
        self.sent += 1;
        tag
    }

    /// Checks the next message this side receives: refused if it was not
    /// sealed by the other end of this session as its next message.
    pub fn open(&mut self, msg: &[u8], tag: &[u8]) -> Result<(), AuthError> {
        if !verify(&self.recv, &[&self.received.to_le_bytes(), msg], tag) {
            return Err(AuthError::BadTag);
        }
        self.received += 1;
        Ok(())
    }
}
