//! The cluster key: what every member of one deployment holds, and where it
//! comes from (the deployment, never the wire).

use hkdf::Hkdf;
use sha2::Sha256;
use std::path::{Path, PathBuf};

/// The environment variable that carries the cluster's secret (at least
/// [`MIN_SECRET_LEN`] bytes; any bytes, typically 64 hex digits).
pub const CLUSTER_KEY_ENV: &str = "KV_TRANSFER_CLUSTER_KEY";
/// The environment variable that names a file holding the cluster's secret
/// (read whole; one trailing newline is dropped). Wins over [`CLUSTER_KEY_ENV`].
pub const CLUSTER_KEY_FILE_ENV: &str = "KV_TRANSFER_CLUSTER_KEY_FILE";
/// Shortest secret accepted: 16 bytes (128 bits if drawn at random).
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret accepted (a key file is not a place for anything else).
pub const MAX_SECRET_LEN: usize = 4096;

/// Where a [`ClusterKey`] came from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// From [`CLUSTER_KEY_ENV`].
    Env,
    /// From the file [`CLUSTER_KEY_FILE_ENV`] names.
    File(PathBuf),
    /// Given by the program ([`ClusterKey::from_secret`]).
    Given,
    /// No key: single-host mode ([`ClusterKey::single_host`]).
    SingleHost,
}

/// Why no key could be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The secret is shorter than [`MIN_SECRET_LEN`] or longer than [`MAX_SECRET_LEN`].
    #[error("a cluster secret of {0} bytes (accepted: {MIN_SECRET_LEN}..={MAX_SECRET_LEN})")]
    Length(usize),
    /// The key file could not be read.
    #[error("cluster key file {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The key every member of one deployment holds: a handshake proves both
/// ends hold it ([`Dialer`](super::Dialer), [`Acceptor`](super::Acceptor)).
///
/// Built from the deployment's secret by HKDF-SHA256 (so a secret of any
/// shape gives a uniform key). Without a secret it is the single-host key,
/// which is public: the handshake still binds both ends' names and
/// addresses and is fresh, but it proves nothing about who holds it, so any
/// process that can reach a port can be a peer. `Debug` never shows the key.
///
/// ```
/// use kv_transfer_core::auth::ClusterKey;
/// let key = ClusterKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap();
/// assert!(key.authenticates());
/// assert!(!ClusterKey::single_host().authenticates());
/// assert!(ClusterKey::from_secret(b"short").is_err());
/// ```
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
    source: KeySource,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterKey").field("source", &self.source).field("fingerprint", &self.fingerprint()).finish()
    }
}

/// Salt of the key's derivation (fixed: the secret is the only input that varies).
const KEY_SALT: &[u8] = b"kv-transfer cluster key v1";
/// What the single-host key is derived from: public, by design.
const SINGLE_HOST_SECRET: &[u8] = b"kv-transfer single-host mode: no cluster key, no authentication";

impl ClusterKey {
    /// The key of `secret` (the deployment's shared secret).
    pub fn from_secret(secret: &[u8]) -> Result<Self, KeyError> {
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.len()) {
            return Err(KeyError::Length(secret.len()));
        }
        Ok(Self { key: derive(secret), source: KeySource::Given })
    }

    /// The single-host key: public, so it authenticates nobody (see the
    /// type's docs). [`from_env`](Self::from_env) falls back to it, loudly.
    pub fn single_host() -> Self {
        Self { key: derive(SINGLE_HOST_SECRET), source: KeySource::SingleHost }
    }

    /// The deployment's key: the file [`CLUSTER_KEY_FILE_ENV`] names, else
    /// [`CLUSTER_KEY_ENV`], else (with a warning that says what it does not
    /// protect) the [`single_host`](Self::single_host) key. A variable that
    /// is set but wrong is an error, never a silent fallback.
    pub fn from_env() -> Result<Self, KeyError> {
        if let Some(path) = std::env::var_os(CLUSTER_KEY_FILE_ENV).filter(|p| !p.is_empty()) {
            return Self::from_file(Path::new(&path));
        }
        if let Some(secret) = std::env::var_os(CLUSTER_KEY_ENV).filter(|s| !s.is_empty()) {
            use std::os::unix::ffi::OsStrExt;
            let mut k = Self::from_secret(secret.as_bytes())?;
            k.source = KeySource::Env;
            return Ok(k);
        }
        warn_single_host();
        Ok(Self::single_host())
    }

    /// The key of the secret in `path` (one trailing newline dropped).
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let mut secret = std::fs::read(path).map_err(|source| KeyError::File { path: path.into(), source })?;
        if secret.last() == Some(&b'\n') {
            secret.pop();
            if secret.last() == Some(&b'\r') {
                secret.pop();
            }
        }
        let mut k = Self::from_secret(&secret)?;
        k.source = KeySource::File(path.into());
        Ok(k)
    }

    /// Whether a handshake under this key proves anything about the other
    /// end: false for the single-host key, which is public.
    pub fn authenticates(&self) -> bool {
        self.source != KeySource::SingleHost
    }

    /// Where the key came from.
    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// A short public fingerprint (for logs: two ends can compare it
    /// without revealing the key).
    pub fn fingerprint(&self) -> String {
        let fp = super::handshake::mac(&self.key, &[b"kv-transfer key fingerprint"]);
        fp[..4].iter().map(|b| format!("{b:02x}")).collect()
    }

    pub(super) fn bytes(&self) -> &[u8; 32] {
        &self.key
    }
}

fn derive(secret: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    // 32 bytes is far below HKDF-SHA256's limit (255 × 32): cannot fail.
    let _ = Hkdf::<Sha256>::new(Some(KEY_SALT), secret).expand(b"cluster key", &mut out);
    out
}

/// Says once per process what single-host mode does not protect.
fn warn_single_host() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "no {CLUSTER_KEY_ENV} or {CLUSTER_KEY_FILE_ENV}: single-host mode. The peer handshake \
             still binds names, addresses and fresh nonces, but its key is public: any process that \
             can reach a kv-transfer port can be a peer. Set {CLUSTER_KEY_ENV} to the same secret \
             (>= {MIN_SECRET_LEN} bytes) on every prefill and decode of the deployment."
        );
    });
}
