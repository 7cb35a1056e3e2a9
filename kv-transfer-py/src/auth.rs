//! `kv_transfer.ClusterKey`, `PeerHandshake`, `PeerSession`: core's peer
//! handshake (`kv_transfer_core::auth`) for the Python control plane, which
//! drives it over its own sockets. The cryptography and the state machine
//! stay in core; this only moves bytes in and out.

use crate::errors::KvTransferError;
use kv_transfer_core::auth::{
    self, Acceptor, AcceptorConfig, AuthCounters, AuthError, Dialer, DialerConfig, Established, Frame, Identity,
    RefusalCode, ReplayCache, Session,
};
use pyo3::create_exception;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;

create_exception!(
    kv_transfer,
    PeerRefused,
    KvTransferError,
    "The peer handshake was refused (another cluster key, a replayed or relayed handshake, a malformed message); `args[1]` names the kind."
);

/// A refusal as Python sees it: the message, and its kind's name (the counter's).
fn refused(e: AuthError) -> PyErr {
    PeerRefused::new_err((e.to_string(), e.kind().as_str()))
}

/// The deployment's cluster key (see `kv_transfer_core::auth::ClusterKey`).
#[pyclass(module = "kv_transfer", frozen)]
#[derive(Clone)]
pub struct ClusterKey {
    pub(crate) key: auth::ClusterKey,
}

#[pymethods]
impl ClusterKey {
    /// The deployment's key: `KV_TRANSFER_CLUSTER_KEY_FILE`, else
    /// `KV_TRANSFER_CLUSTER_KEY`, else single-host mode (with a warning).
    #[staticmethod]
    fn from_env() -> PyResult<Self> {
        auth::ClusterKey::from_env()
            .map(|key| Self { key })
            .map_err(|e| crate::errors::DescriptorError::new_err(e.to_string()))
    }

    /// The key of `secret` (at least 16 bytes).
    #[staticmethod]
    fn from_secret(secret: &[u8]) -> PyResult<Self> {
        auth::ClusterKey::from_secret(secret)
            .map(|key| Self { key })
            .map_err(|e| crate::errors::DescriptorError::new_err(e.to_string()))
    }

    /// The single-host key (public: authenticates nobody).
    #[staticmethod]
    fn single_host() -> Self {
        Self { key: auth::ClusterKey::single_host() }
    }

    /// Whether a handshake under this key proves anything (false in single-host mode).
    #[getter]
    fn authenticates(&self) -> bool {
        self.key.authenticates()
    }

    /// A short public fingerprint, for logs.
    fn fingerprint(&self) -> String {
        self.key.fingerprint()
    }

    fn __repr__(&self) -> String {
        format!("ClusterKey(fingerprint={:?}, authenticates={})", self.key.fingerprint(), self.key.authenticates())
    }
}

/// What the other end proved, and the session both ends share.
#[pyclass(module = "kv_transfer")]
pub struct PeerSession {
    session: Session,
    /// The name the other end proved.
    #[pyo3(get)]
    name: String,
    /// The endpoint the other end proved (where it listens; may be empty).
    #[pyo3(get)]
    endpoint: String,
    /// Whether the key it proved is a secret.
    #[pyo3(get)]
    authenticated: bool,
}

impl PeerSession {
    fn new(est: Established) -> Self {
        let id = est.peer.identity;
        Self { session: est.session, name: id.name, endpoint: id.endpoint, authenticated: est.peer.authenticated }
    }
}

#[pymethods]
impl PeerSession {
    /// The tag of the next message this side sends (32 bytes).
    fn seal<'py>(&mut self, py: Python<'py>, msg: &[u8]) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.session.seal(msg))
    }

    /// Checks the next message received: raises `PeerRefused` unless the
    /// other end of this session sealed it as its next message.
    fn open(&mut self, msg: &[u8], tag: &[u8]) -> PyResult<()> {
        self.session.open(msg, tag).map_err(refused)
    }

    /// The session's id (the same at both ends; public).
    #[getter]
    fn id<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.session.id())
    }
}

enum Step {
    Dialing(Dialer),
    Accepting(Acceptor),
    Done,
}

/// One handshake, sans-IO: feed it the other end's messages, send what it
/// returns. Messages are framed (`header_len`, `body_len`).
#[pyclass(module = "kv_transfer")]
pub struct PeerHandshake {
    step: Step,
}

/// A listener's side of handshakes: its key, context, identity, the
/// addresses it may be dialed at, and its replay cache (shared by every
/// handshake it accepts), with counters.
#[pyclass(module = "kv_transfer", frozen)]
pub struct PeerListener {
    cfg: AcceptorConfig,
    counters: Arc<AuthCounters>,
}

#[pymethods]
impl PeerListener {
    /// `addresses`: every `host:port` a dialer may have dialed to reach it.
    #[new]
    fn new(key: &ClusterKey, context: String, name: String, endpoint: String, addresses: Vec<String>) -> Self {
        let mut cfg = AcceptorConfig::new(key.key.clone(), context, Identity::new(name, endpoint));
        cfg.addresses.extend(addresses);
        cfg.replay = Arc::new(ReplayCache::default());
        Self { cfg, counters: Arc::default() }
    }

    /// Starts the acceptor's side on a HELLO (a whole message) from
    /// `source` (an IP, or None): returns the handshake and the CHALLENGE
    /// to send. Raises `PeerRefused` (counted); `handshake_refusal(kind)`
    /// gives the message that tells the dialer why.
    #[pyo3(signature = (hello, source=None))]
    fn accept<'py>(
        &self,
        py: Python<'py>,
        hello: &[u8],
        source: Option<String>,
    ) -> PyResult<(PeerHandshake, Bound<'py, PyBytes>)> {
        let source = source.and_then(|s| s.parse().ok());
        match Frame::decode(hello).and_then(|f| Acceptor::on_hello(&self.cfg, f, source)) {
            Ok((a, challenge)) => {
                Ok((PeerHandshake { step: Step::Accepting(a) }, PyBytes::new(py, &challenge.encode())))
            }
            Err(e) => {
                self.counters.count_refusal(&e);
                Err(refused(e))
            }
        }
    }

    /// The acceptor's last step, on the dialer's FINISH: the session
    /// (counted). Raises `PeerRefused` (counted).
    fn finish(&self, handshake: &mut PeerHandshake, finish: &[u8]) -> PyResult<PeerSession> {
        let r = handshake.on_finish(finish);
        match &r {
            Ok(_) => self.counters.count_established(),
            Err(e) => self.counters.count_refusal(e),
        }
        r.map(PeerSession::new).map_err(refused)
    }

    /// Counts a handshake that failed by I/O (a deadline, a closed connection).
    fn count_io_failure(&self) {
        self.counters.count_refusal(&AuthError::Io(std::io::ErrorKind::TimedOut.into()));
    }

    /// The counts so far, by kind (`auth_established`, `auth_wrong_key`, ...).
    fn stats(&self) -> std::collections::HashMap<&'static str, u64> {
        self.counters.snapshot().fields().into_iter().collect()
    }
}

#[pymethods]
impl PeerHandshake {
    /// Starts the dialer's side: returns the handshake and the HELLO to send.
    #[staticmethod]
    #[pyo3(signature = (key, context, name, endpoint, dialed, expect_name=None))]
    fn dial<'py>(
        py: Python<'py>,
        key: &ClusterKey,
        context: String,
        name: String,
        endpoint: String,
        dialed: String,
        expect_name: Option<String>,
    ) -> PyResult<(Self, Bound<'py, PyBytes>)> {
        let cfg =
            DialerConfig { key: key.key.clone(), context, me: Identity::new(name, endpoint), dialed, expect_name };
        let (d, hello) = Dialer::start(cfg).map_err(refused)?;
        Ok((Self { step: Step::Dialing(d) }, PyBytes::new(py, &hello.encode())))
    }

    /// The dialer's next step, on the CHALLENGE: the session, and the
    /// FINISH to send. Raises `PeerRefused`.
    fn on_challenge<'py>(&mut self, py: Python<'py>, challenge: &[u8]) -> PyResult<(PeerSession, Bound<'py, PyBytes>)> {
        let Step::Dialing(d) = std::mem::replace(&mut self.step, Step::Done) else {
            return Err(refused(AuthError::Malformed("not a dialer waiting for a CHALLENGE")));
        };
        let (est, finish) = Frame::decode(challenge).and_then(|f| d.on_challenge(f)).map_err(refused)?;
        Ok((PeerSession::new(est), PyBytes::new(py, &finish.encode())))
    }
}

impl PeerHandshake {
    fn on_finish(&mut self, finish: &[u8]) -> Result<Established, AuthError> {
        let Step::Accepting(a) = std::mem::replace(&mut self.step, Step::Done) else {
            return Err(AuthError::Malformed("not an acceptor waiting for a FINISH"));
        };
        Frame::decode(finish).and_then(|f| a.on_finish(f))
    }
}

/// Bytes of a handshake message's header.
#[pyfunction]
pub fn handshake_header_len() -> usize {
    auth::HEADER_LEN
}

/// A handshake message's body length, from its header (checked against the
/// cap before anything is read). Raises `PeerRefused` on a bad header.
#[pyfunction]
pub fn handshake_body_len(header: &[u8]) -> PyResult<usize> {
    let h: &[u8; auth::HEADER_LEN] =
        header.try_into().map_err(|_| refused(AuthError::Malformed("a handshake header of the wrong size")))?;
    Frame::check_header(h).map(|(_, n)| n).map_err(refused)
}

/// The REFUSED message that tells the other end why (`kind` as `PeerRefused` names it).
#[pyfunction]
pub fn handshake_refusal<'py>(py: Python<'py>, kind: &str) -> Bound<'py, PyBytes> {
    let code = match kind {
        "wrong_key" => RefusalCode::WrongKey,
        "replayed" => RefusalCode::Replayed,
        "address_mismatch" => RefusalCode::AddressMismatch,
        "context_mismatch" => RefusalCode::ContextMismatch,
        _ => RefusalCode::Other,
    };
    PyBytes::new(py, &Frame::refused(code).encode())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PeerRefused", m.py().get_type::<PeerRefused>())?;
    m.add_class::<ClusterKey>()?;
    m.add_class::<PeerSession>()?;
    m.add_class::<PeerHandshake>()?;
    m.add_class::<PeerListener>()?;
    m.add_function(wrap_pyfunction!(handshake_header_len, m)?)?;
    m.add_function(wrap_pyfunction!(handshake_body_len, m)?)?;
    m.add_function(wrap_pyfunction!(handshake_refusal, m)?)?;
    Ok(())
}
