//! Status codes and the shared [`TransferStatus`] object.
//!
//! MORI-IO hands the caller a `TransferStatus` whose code moves from `INIT` to
//! `IN_PROGRESS` and then to `SUCCESS` or an error above 10. This module keeps
//! the same numbers and adds two guarantees MORI does not give:
//!
//! - a terminal code is sticky: once `SUCCESS` or an error was set, later
//!   updates are ignored, so a status never goes back to "in progress" and
//!   never flips from failure to success;
//! - a code this crate does not know is an *error that proves nothing*: it is
//!   never success, and it is not terminal either (see [`StatusCode::Unknown`]).

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::types::{Tag, TransferUniqueId};
use crate::util::lock;

/// Boundary of MORI-IO's error range: every code above it is an error.
pub const ERR_BEGIN: u32 = 10;

/// A MORI-IO transfer status code.
///
/// Raw values are MORI's: `SUCCESS=0`, `INIT=1`, `IN_PROGRESS=2`, errors above
/// [`ERR_BEGIN`] (`INVALID_ARGS=11`, `NOT_FOUND=12`, `RDMA_OP=13`,
/// `BAD_STATE=14`, `GPU_OP=15`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StatusCode {
    /// `SUCCESS` (0): every operation of the transfer completed without error.
    Success,
    /// `INIT` (1): created, nothing posted yet.
    Init,
    /// `IN_PROGRESS` (2): posted; the NIC may still touch the memory.
    InProgress,
    /// `INVALID_ARGS` (11): rejected before anything was posted (or a post was refused).
    InvalidArgs,
    /// `NOT_FOUND` (12): unknown memory, engine or session.
    NotFound,
    /// `RDMA_OP` (13): a transport (RDMA, simulator, loopback) operation failed.
    RdmaOp,
    /// `BAD_STATE` (14): the engine or transfer was in a state that forbids the call.
    BadState,
    /// `GPU_OP` (15): a GPU-side operation failed or GPU memory is not reachable.
    GpuOp,
    /// Any other raw value. It is an **error**, never success, and it is **not
    /// terminal**: it does not prove that the NIC stopped touching memory, so a
    /// caller must escalate (fence or revoke) rather than settle on it.
    Unknown(u32),
}

impl StatusCode {
    /// Decodes a raw MORI status code. Unknown values map to [`StatusCode::Unknown`].
    pub const fn from_raw(raw: u32) -> Self {
        match raw {
            0 => Self::Success,
            1 => Self::Init,
            2 => Self::InProgress,
            11 => Self::InvalidArgs,
            12 => Self::NotFound,
            13 => Self::RdmaOp,
            14 => Self::BadState,
            15 => Self::GpuOp,
            other => Self::Unknown(other),
        }
    }

    /// The raw MORI value.
    pub const fn raw(self) -> u32 {
        match self {
            Self::Success => 0,
            Self::Init => 1,
            Self::InProgress => 2,
            Self::InvalidArgs => 11,
            Self::NotFound => 12,
            Self::RdmaOp => 13,
            Self::BadState => 14,
            Self::GpuOp => 15,
            Self::Unknown(raw) => raw,
        }
    }

    /// `true` only for `SUCCESS`.
    pub const fn is_success(self) -> bool {
        matches!(self, Self::Success)
    }

    /// `true` for `INIT` and `IN_PROGRESS`: the transfer may still touch memory.
    pub const fn is_pending(self) -> bool {
        matches!(self, Self::Init | Self::InProgress)
    }

    /// `true` for every known error and for every unknown code.
    pub const fn is_error(self) -> bool {
        !matches!(self, Self::Success | Self::Init | Self::InProgress)
    }

    /// `true` for `SUCCESS` and the known error codes: the transfer is over and
    /// no operation of it can touch memory any more. `false` for pending and
    /// for unknown codes.
    pub const fn is_terminal(self) -> bool {
        !self.is_pending() && !matches!(self, Self::Unknown(_))
    }

    /// MORI's upper-case name of the code.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Success => "SUCCESS",
            Self::Init => "INIT",
            Self::InProgress => "IN_PROGRESS",
            Self::InvalidArgs => "ERR_INVALID_ARGS",
            Self::NotFound => "ERR_NOT_FOUND",
            Self::RdmaOp => "ERR_RDMA_OP",
            Self::BadState => "ERR_BAD_STATE",
            Self::GpuOp => "ERR_GPU_OP",
            Self::Unknown(_) => "UNKNOWN",
        }
    }
}

impl fmt::Display for StatusCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unknown(raw) => write!(f, "UNKNOWN({raw})"),
            other => f.write_str(other.name()),
        }
    }
}

impl From<u32> for StatusCode {
    fn from(raw: u32) -> Self {
        Self::from_raw(raw)
    }
}

impl From<StatusCode> for u32 {
    fn from(code: StatusCode) -> Self {
        code.raw()
    }
}

/// A listener that is an object the caller shares already (see
/// [`TransferStatus::on_complete_shared`]): registering it allocates nothing.
pub trait StatusListener: Send + Sync {
    /// Called once with the terminal code and the status's message (empty on
    /// success), on the thread that sets the code, with no engine lock held.
    fn on_status(self: Arc<Self>, code: StatusCode, message: &str);
}

type ListenerFn = Box<dyn FnOnce(StatusCode, &str) + Send + 'static>;

/// Called once with the terminal code and the status's message.
enum Listener {
    Boxed(ListenerFn),
    Shared(Arc<dyn StatusListener>),
}

/// Listeners that panicked (process-wide; see [`listener_panics`]).
static LISTENER_PANICS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many status listeners panicked in this process. A listener runs on
/// the thread that sets the code (the engine's progress thread or the
/// transport's receiving thread): its panic is caught there, logged and
/// counted, so that thread goes on and the other listeners still run. The
/// status itself is terminal already; nothing is settled by the panic.
pub fn listener_panics() -> u64 {
    LISTENER_PANICS.load(std::sync::atomic::Ordering::Relaxed)
}

impl Listener {
    fn call(self, code: StatusCode, message: &str) {
        let run = std::panic::AssertUnwindSafe(|| match self {
            Self::Boxed(f) => f(code, message),
            Self::Shared(l) => l.on_status(code, message),
        });
        if std::panic::catch_unwind(run).is_err() {
            LISTENER_PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(%code, "a status listener panicked; caught, the other listeners still run");
        }
    }
}

struct State {
    code: StatusCode,
    message: String,
    /// The first listener (registration order is call order).
    first_listener: Option<Listener>,
    listeners: Vec<Listener>,
    /// Threads blocked in `wait`/`wait_for` (the condvar is signalled only
    /// when someone waits: a syscall saved per transfer otherwise).
    waiters: usize,
}

struct Shared {
    uid: TransferUniqueId,
    tag: Tag,
    state: Mutex<State>,
    cv: Condvar,
}

/// The status object of one transfer, shared between the caller and the engine.
///
/// Cloning is cheap and every clone sees the same state. `wait_for` returning
/// `IN_PROGRESS` means only that the time ran out: the transfer goes on, and a
/// later `code()` or `wait` will see its terminal status.
#[derive(Clone)]
pub struct TransferStatus {
    shared: Arc<Shared>,
}

impl fmt::Debug for TransferStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferStatus")
            .field("uid", &self.shared.uid)
            .field("tag", &self.shared.tag)
            .field("code", &self.code())
            .finish()
    }
}

/// The writing side of a [`TransferStatus`]: held by the engine (or by a mock)
/// and used to move the status forward.
///
/// Dropping an updater without setting a terminal code leaves the status where
/// it was: a transfer nobody can observe any more stays `IN_PROGRESS`, it is
/// never turned into success or failure.
pub struct StatusUpdater {
    shared: Arc<Shared>,
}

impl fmt::Debug for StatusUpdater {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusUpdater").field("uid", &self.shared.uid).finish()
    }
}

impl TransferStatus {
    /// A fresh status in `INIT` and the updater that moves it.
    pub fn pending(uid: TransferUniqueId, tag: Tag) -> (Self, StatusUpdater) {
        Self::with_code(uid, tag, StatusCode::Init)
    }

    /// A fresh status already `IN_PROGRESS` (what an engine hands back for a
    /// transfer it posted) and the updater that moves it on.
    pub fn posted(uid: TransferUniqueId, tag: Tag) -> (Self, StatusUpdater) {
        Self::with_code(uid, tag, StatusCode::InProgress)
    }

    fn with_code(uid: TransferUniqueId, tag: Tag, code: StatusCode) -> (Self, StatusUpdater) {
        let shared = Arc::new(Shared {
            uid,
            tag,
            state: Mutex::new(State {
                code,
                message: String::new(),
                first_listener: None,
                listeners: Vec::new(),
                waiters: 0,
            }),
            cv: Condvar::new(),
        });
        (Self { shared: Arc::clone(&shared) }, StatusUpdater { shared })
    }

    /// A status that already carries `code` (used for calls rejected at once).
    pub fn ready(uid: TransferUniqueId, tag: Tag, code: StatusCode, message: impl Into<String>) -> Self {
        let (status, updater) = Self::pending(uid, tag);
        updater.set(code, message);
        status
    }

    /// A status stuck in `IN_PROGRESS` forever: nobody holds its updater. This is
    /// MORI at its worst (no completion ever observed); handy for mocks.
    pub fn in_progress_forever(uid: TransferUniqueId, tag: Tag) -> Self {
        let (status, updater) = Self::pending(uid, tag);
        updater.set(StatusCode::InProgress, "");
        status
    }

    /// The transfer id the caller supplied.
    pub fn uid(&self) -> TransferUniqueId {
        self.shared.uid
    }

    /// The tag the caller supplied.
    pub fn tag(&self) -> Tag {
        self.shared.tag
    }

    /// The current code, without blocking.
    pub fn code(&self) -> StatusCode {
        lock(&self.shared.state).code
    }

    /// The current message (empty unless an error or the engine set one).
    pub fn message(&self) -> String {
        lock(&self.shared.state).message.clone()
    }

    /// See [`StatusCode::is_terminal`].
    pub fn is_terminal(&self) -> bool {
        self.code().is_terminal()
    }

    /// `true` only for `SUCCESS`.
    pub fn succeeded(&self) -> bool {
        self.code().is_success()
    }

    /// `true` for any error code, known or not.
    pub fn failed(&self) -> bool {
        self.code().is_error()
    }

    /// `true` while `INIT` or `IN_PROGRESS`.
    pub fn in_progress(&self) -> bool {
        self.code().is_pending()
    }

    /// Blocks until the code is no longer pending and returns it.
    ///
    /// Like MORI's `Wait`, this has no deadline: a transfer that never completes
    /// blocks forever. Prefer [`TransferStatus::wait_for`].
    pub fn wait(&self) -> StatusCode {
        let mut state = lock(&self.shared.state);
        while state.code.is_pending() {
            state.waiters += 1;
            state = self.shared.cv.wait(state).unwrap_or_else(|e| e.into_inner());
            state.waiters -= 1;
        }
        state.code
    }

    /// Blocks at most `timeout` for the code to leave `INIT`/`IN_PROGRESS`.
    ///
    /// On timeout it returns the pending code (`IN_PROGRESS`, or `INIT`); the
    /// transfer is **not** cancelled and goes on.
    pub fn wait_for(&self, timeout: Duration) -> StatusCode {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = lock(&self.shared.state);
        while state.code.is_pending() {
            let left = match deadline {
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return state.code,
                },
                None => Duration::from_secs(3600),
            };
            state.waiters += 1;
            state = self.shared.cv.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
            state.waiters -= 1;
        }
        state.code
    }

    /// MORI's `WaitFor(ms)`.
    pub fn wait_for_ms(&self, ms: u64) -> StatusCode {
        self.wait_for(Duration::from_millis(ms))
    }

    /// Calls `f` once with the code as soon as it is no longer pending (at once
    /// if it already is). `f` runs on the thread that sets the code, with no
    /// engine lock held; keep it short (wake a task, send on a channel).
    pub fn on_complete(&self, f: impl FnOnce(StatusCode) + Send + 'static) {
        self.on_complete_with_message(move |code, _| f(code));
    }

    /// [`Self::on_complete`], with the status's message too (empty on
    /// success): a listener that needs the message does not have to keep the
    /// status alive to read it.
    pub fn on_complete_with_message(&self, f: impl FnOnce(StatusCode, &str) + Send + 'static) {
        self.listen(Listener::Boxed(Box::new(f)));
    }

    /// [`Self::on_complete_with_message`] for a listener that is an object
    /// shared already: no allocation per status.
    ///
    /// ```
    /// use backend_mori::{StatusCode, StatusListener, Tag, TransferStatus};
    /// use std::sync::{Arc, Mutex};
    /// struct Op(Mutex<Option<StatusCode>>);
    /// impl StatusListener for Op {
    ///     fn on_status(self: Arc<Self>, code: StatusCode, _message: &str) {
    ///         *self.0.lock().unwrap() = Some(code);
    ///     }
    /// }
    /// let op = Arc::new(Op(Mutex::new(None)));
    /// let (status, updater) = TransferStatus::posted(1, Tag::default());
    /// status.on_complete_shared(op.clone());
    /// updater.set(StatusCode::Success, "");
    /// assert_eq!(*op.0.lock().unwrap(), Some(StatusCode::Success));
    /// ```
    pub fn on_complete_shared(&self, listener: Arc<dyn StatusListener>) {
        self.listen(Listener::Shared(listener));
    }

    fn listen(&self, listener: Listener) {
        let mut state = lock(&self.shared.state);
        if state.code.is_pending() {
            match state.first_listener {
                // Most statuses get one listener (the adapter's): kept inline.
                None => state.first_listener = Some(listener),
                Some(_) => state.listeners.push(listener),
            }
        } else {
            let (code, message) = (state.code, state.message.clone());
            drop(state);
            listener.call(code, &message);
        }
    }

    /// `true` if both handles share one status.
    pub fn same_as(&self, other: &TransferStatus) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}

impl StatusUpdater {
    /// The status this updater moves.
    pub fn status(&self) -> TransferStatus {
        TransferStatus { shared: Arc::clone(&self.shared) }
    }

    /// Sets `code` unless the status already left the pending states.
    ///
    /// Returns `false` (and changes nothing) when the status was already
    /// terminal or unknown: terminal codes are sticky. Listeners run when the
    /// code leaves the pending states.
    pub fn set(&self, code: StatusCode, message: impl Into<String>) -> bool {
        let mut state = lock(&self.shared.state);
        if !state.code.is_pending() {
            return false;
        }
        state.code = code;
        let message = message.into();
        if !message.is_empty() {
            state.message = message;
        }
        let (first, listeners) = if code.is_pending() {
            (None, Vec::new())
        } else {
            (state.first_listener.take(), std::mem::take(&mut state.listeners))
        };
        let waiters = state.waiters > 0;
        // Listeners see the message without the lock held; the copy is made
        // only when there is one (success carries none).
        let message = if first.is_some() && !state.message.is_empty() { state.message.clone() } else { String::new() };
        drop(state);
        if waiters {
            self.shared.cv.notify_all();
        }
        for listener in first.into_iter().chain(listeners) {
            listener.call(code, &message);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trip_and_unknown_is_error() {
        for raw in 0..=40u32 {
            let code = StatusCode::from_raw(raw);
            assert_eq!(code.raw(), raw);
            if !matches!(raw, 0..=2 | 11..=15) {
                assert_eq!(code, StatusCode::Unknown(raw));
                assert!(code.is_error());
                assert!(!code.is_success());
                assert!(!code.is_terminal());
                assert!(!code.is_pending());
            }
        }
        assert!(StatusCode::from_raw(u32::MAX).is_error());
        assert!(StatusCode::Success.is_terminal());
        assert!(StatusCode::RdmaOp.is_terminal());
        assert!(!StatusCode::InProgress.is_terminal());
        assert!(!StatusCode::Init.is_terminal());
    }

    #[test]
    fn terminal_is_sticky_and_wait_for_times_out() {
        let (status, updater) = TransferStatus::pending(7, Tag::new(1, 2));
        assert_eq!(status.code(), StatusCode::Init);
        assert!(updater.set(StatusCode::InProgress, ""));
        assert_eq!(status.wait_for(Duration::from_millis(5)), StatusCode::InProgress);
        assert!(updater.set(StatusCode::RdmaOp, "boom"));
        assert!(!updater.set(StatusCode::Success, ""));
        assert_eq!(status.wait(), StatusCode::RdmaOp);
        assert_eq!(status.message(), "boom");
    }

    #[test]
    fn listener_runs_once_on_terminal() {
        let (status, updater) = TransferStatus::pending(1, Tag::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        status.on_complete(move |code| {
            let _ = tx.send(code);
        });
        updater.set(StatusCode::InProgress, "");
        assert!(rx.try_recv().is_err());
        updater.set(StatusCode::Success, "");
        assert_eq!(rx.recv_timeout(Duration::from_secs(1)), Ok(StatusCode::Success));
        status.on_complete(move |code| {
            let _ = tx2.send(code);
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(1)), Ok(StatusCode::Success));
    }

    #[test]
    fn shared_listener_gets_code_and_message_once() {
        #[derive(Default)]
        struct Seen(Mutex<Vec<(StatusCode, String)>>);
        impl StatusListener for Seen {
            fn on_status(self: Arc<Self>, code: StatusCode, message: &str) {
                lock(&self.0).push((code, message.to_owned()));
            }
        }
        let seen = Arc::new(Seen::default());
        let (status, updater) = TransferStatus::posted(3, Tag::default());
        assert_eq!(status.code(), StatusCode::InProgress);
        status.on_complete_shared(seen.clone());
        status.on_complete_with_message({
            let seen = seen.clone();
            move |code, message| lock(&seen.0).push((code, format!("second: {message}")))
        });
        assert!(lock(&seen.0).is_empty());
        assert!(updater.set(StatusCode::RdmaOp, "boom"));
        assert!(!updater.set(StatusCode::Success, ""));
        // Registered after the end: called at once, with the message.
        status.on_complete_shared(seen.clone());
        let got = lock(&seen.0).clone();
        let boom = (StatusCode::RdmaOp, "boom".to_owned());
        assert_eq!(got, vec![boom.clone(), (StatusCode::RdmaOp, "second: boom".to_owned()), boom]);
    }
}
