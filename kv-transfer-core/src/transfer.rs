//! The `Transfer` trait and the handle of an in-flight operation.
//!
//! Posting moves the local lease into the operation. The [`TransferHandle`]
//! resolves only at a terminal status and gives the lease back settled. The
//! backend keeps the other end, a [`Completer`], which owns the lease while
//! the operation is in flight: dropping the handle parks nothing in the
//! caller's hands (the io_uring owned-buffer pattern), and when the terminal
//! status arrives the completer settles the lease and, with nobody waiting,
//! returns it to the pool.

use crate::lease::{Exposed, Reserved, SettleError, Settled, SlotLease};
use crate::proof::Settlement;
use crate::remote::RemoteSlots;
use crate::sync::{lock, Mutex};
use async_trait::async_trait;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// Direction of a one-sided operation, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Pull remote bytes into the local lease.
    Read,
    /// Push the local lease's bytes into the remote slots.
    Write,
}

/// Options of a posted operation.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferOptions {
    /// After the data, notify the target with the tenancies written, so it
    /// can settle its exposure (`Completed`). Sent only after a successful
    /// terminal status for every part of the operation.
    pub notify: bool,
    /// With `notify` on a WRITE: the DONE carries a crc32c of each slot's
    /// bytes as sent, and the target checks the bytes against it when the
    /// settled lease is read (a write that landed after the DONE is caught
    /// there). Off by default: it reads every byte once more.
    pub digest: bool,
}

impl Default for TransferOptions {
    fn default() -> Self {
        Self { notify: true, digest: false }
    }
}

impl TransferOptions {
    /// Options with notification on or off.
    pub fn notify(notify: bool) -> Self {
        Self { notify, digest: false }
    }
    /// The same options with the DONE's digests on or off.
    pub fn with_digest(mut self, digest: bool) -> Self {
        self.digest = digest;
        self
    }
}

/// Why the remote NIC refused an access. Nothing was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum RejectReason {
    /// The range lies outside the registered memory.
    #[error("out of bounds")]
    OutOfBounds,
    /// The key is not registered.
    #[error("unknown key")]
    UnknownKey,
    /// The generation is not the one bound to the key for that slot.
    #[error("stale generation")]
    StaleGeneration,
    /// A zero-length access.
    #[error("zero length")]
    ZeroLength,
    /// Longer than the target accepts in one operation.
    #[error("oversize")]
    Oversize,
}

/// Terminal failure of an operation. The operation is over (no NIC touches
/// the local lease any more), so the lease still comes back settled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The remote NIC refused the access.
    #[error("rejected by the target: {0}")]
    Rejected(RejectReason),
    /// The connection failed; the backend fenced it before reporting.
    #[error("transport failed: {0}")]
    Transport(String),
    /// The engine reported an error.
    #[error("{engine} error {code}: {message}")]
    Engine {
        /// Which engine.
        engine: &'static str,
        /// Its status code.
        code: i64,
        /// Its words, or ours where it has none.
        message: String,
    },
    /// Cancelled on request before any byte moved.
    #[error("canceled")]
    Canceled,
}

/// Why a post failed. The lease comes back unexposed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostErrorKind {
    /// The local lease belongs to a pool this backend did not register.
    #[error("local lease belongs to a pool this backend did not register")]
    ForeignPool,
    /// Local and remote descriptors do not match.
    #[error("descriptor mismatch: {0}")]
    Descriptor(String),
    /// The peer named by the descriptor is not known or not reachable.
    #[error("unknown or unreachable peer: {0}")]
    Peer(String),
    /// The backend cannot do this operation.
    #[error("not supported by this backend: {0}")]
    Unsupported(&'static str),
    /// The engine refused the post.
    #[error("engine refused the post: {0}")]
    Engine(String),
    /// The backend is shutting down.
    #[error("backend is shutting down")]
    ShuttingDown,
}

/// A failed post, with the lease handed back (rule 3).
#[derive(thiserror::Error)]
#[error("post failed: {kind}")]
pub struct PostError {
    /// The lease, unexposed.
    pub lease: SlotLease<Reserved>,
    /// What went wrong.
    pub kind: PostErrorKind,
}

impl fmt::Debug for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostError").field("kind", &self.kind).field("lease", &self.lease).finish()
    }
}

/// Checks that a local lease and a remote descriptor describe the same shape
/// (slot count and slot size). Backends call this before exposing anything.
pub fn check_shapes(local: &SlotLease<Reserved>, remote: &RemoteSlots) -> Result<(), PostErrorKind> {
    if local.len() != remote.slots.len() {
        return Err(PostErrorKind::Descriptor(format!(
            "local lease has {} slots, remote descriptor {}",
            local.len(),
            remote.slots.len()
        )));
    }
    if local.pool().slot_size() as u64 != remote.slot_size {
        return Err(PostErrorKind::Descriptor(format!(
            "local slots are {} bytes, remote slots {}",
            local.pool().slot_size(),
            remote.slot_size
        )));
    }
    Ok(())
}

/// A transport that moves KV slots between pools. Object-safe, so a serving
/// engine can hold `Arc<dyn Transfer>` and choose the backend by feature
/// flag and configuration.
#[async_trait]
pub trait Transfer: Send + Sync {
    /// The backend's name (`"tcp-sim"`, `"nixl"`, …).
    fn backend(&self) -> &'static str;

    /// Posts `op` between the local lease and the remote slots. On success
    /// the lease is inside the returned handle; on failure it comes back in
    /// the error, unexposed.
    async fn post(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError>;

    /// Posts a WRITE of the local lease into the remote slots: [`post`](Self::post)'s
    /// own future, so a WRITE costs one allocation, not two. A backend whose
    /// post never waits returns [`PostFuture::deferred`] here instead: no
    /// allocation at all ([`impl_transfer_via_post_now!`](crate::impl_transfer_via_post_now)).
    fn write<'a>(
        &'a self,
        local: SlotLease<Reserved>,
        remote: &'a RemoteSlots,
        opts: TransferOptions,
    ) -> PostFuture<'a> {
        PostFuture::boxed(self.post(Op::Write, local, remote, opts))
    }

    /// Posts a READ of the remote slots into the local lease (as [`write`](Self::write)).
    fn read<'a>(
        &'a self,
        local: SlotLease<Reserved>,
        remote: &'a RemoteSlots,
        opts: TransferOptions,
    ) -> PostFuture<'a> {
        PostFuture::boxed(self.post(Op::Read, local, remote, opts))
    }
}

/// A backend whose post never waits: it admits, exposes and hands the
/// operation to its engine in the calling thread, and returns. Its
/// [`Transfer::write`] and [`Transfer::read`] can then return
/// [`PostFuture::deferred`], which calls [`post_now`](Self::post_now) at its
/// first poll, without boxing a future per post.
pub trait PostNow: Send + Sync {
    /// Posts `op` now; the contract of [`Transfer::post`].
    fn post_now(
        &self,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &RemoteSlots,
        opts: TransferOptions,
    ) -> Result<TransferHandle, PostError>;
}

/// `impl Transfer for $ty`, for a backend whose post never waits: `post`
/// is its [`PostNow::post_now`], and `write` and `read` are
/// [`PostFuture::deferred`] posts (no boxed future per post).
///
/// ```
/// use kv_transfer_core::{block_on, HostRegion, Op, PoolConfig, PostError, PostErrorKind, PostNow, RemoteSlots,
///     Reserved, SlotLease, SlotPool, Transfer, TransferHandle, TransferOptions};
/// use std::sync::Arc;
///
/// /// A backend that is shutting down: it refuses every post, at once.
/// struct Closed;
/// impl PostNow for Closed {
///     fn post_now(&self, _: Op, local: SlotLease<Reserved>, _: &RemoteSlots, _: TransferOptions)
///         -> Result<TransferHandle, PostError> {
///         Err(PostError { lease: local, kind: PostErrorKind::ShuttingDown })
///     }
/// }
/// kv_transfer_core::impl_transfer_via_post_now!(Closed, "closed");
///
/// let (pool, _authority) = SlotPool::new(Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(4096)).unwrap();
/// let remote = RemoteSlots { endpoint: "peer".into(), pool: pool.id(), key: 0, slot_size: 4096, memory: Default::default(), token: Default::default(), slots: vec![] };
/// assert_eq!(Closed.backend(), "closed");
/// let refused = block_on(Closed.write(pool.reserve(1).unwrap(), &remote, TransferOptions::default())).unwrap_err();
/// assert!(matches!(refused.kind, PostErrorKind::ShuttingDown));
/// let refused = block_on(Closed.post(Op::Read, refused.lease, &remote, TransferOptions::default())).unwrap_err();
/// refused.lease.release();
/// assert_eq!(pool.metrics().free, 1);
/// ```
#[macro_export]
macro_rules! impl_transfer_via_post_now {
    ($ty:ty, $backend:expr) => {
        #[$crate::async_trait]
        impl $crate::Transfer for $ty {
            fn backend(&self) -> &'static str {
                $backend
            }

            async fn post(
                &self,
                op: $crate::Op,
                local: $crate::SlotLease<$crate::Reserved>,
                remote: &$crate::RemoteSlots,
                opts: $crate::TransferOptions,
            ) -> ::std::result::Result<$crate::TransferHandle, $crate::PostError> {
                $crate::PostNow::post_now(self, op, local, remote, opts)
            }

            fn write<'a>(
                &'a self,
                local: $crate::SlotLease<$crate::Reserved>,
                remote: &'a $crate::RemoteSlots,
                opts: $crate::TransferOptions,
            ) -> $crate::PostFuture<'a> {
                $crate::PostFuture::deferred(self, $crate::Op::Write, local, remote, opts)
            }

            fn read<'a>(
                &'a self,
                local: $crate::SlotLease<$crate::Reserved>,
                remote: &'a $crate::RemoteSlots,
                opts: $crate::TransferOptions,
            ) -> $crate::PostFuture<'a> {
                $crate::PostFuture::deferred(self, $crate::Op::Read, local, remote, opts)
            }
        }
    };
}

type BoxedPost<'a> = Pin<Box<dyn Future<Output = Result<TransferHandle, PostError>> + Send + 'a>>;

/// The future of [`Transfer::write`] and [`Transfer::read`]. Like any future
/// it does nothing until polled: dropping it unpolled drops the lease it
/// holds, never exposed, back to the free list.
pub struct PostFuture<'a>(PostState<'a>);

enum PostState<'a> {
    Boxed(BoxedPost<'a>),
    /// The post's arguments, until the first poll posts them.
    Deferred(Option<Deferred<'a>>),
}

struct Deferred<'a> {
    backend: &'a dyn PostNow,
    op: Op,
    local: SlotLease<Reserved>,
    remote: &'a RemoteSlots,
    opts: TransferOptions,
}

impl<'a> PostFuture<'a> {
    /// A backend's own post future (what [`Transfer::post`] returns).
    pub fn boxed(f: BoxedPost<'a>) -> Self {
        Self(PostState::Boxed(f))
    }

    /// A post through [`PostNow::post_now`] at the first poll.
    ///
    /// ```
    /// use kv_transfer_core::{block_on, HostRegion, Op, PoolConfig, PostError, PostErrorKind, PostFuture, PostNow,
    ///     RemoteSlots, Reserved, SlotLease, SlotPool, TransferHandle, TransferOptions};
    /// use std::sync::Arc;
    ///
    /// /// Refuses every post (a stand-in for a backend's synchronous post).
    /// struct Refuse;
    /// impl PostNow for Refuse {
    ///     fn post_now(&self, _: Op, local: SlotLease<Reserved>, _: &RemoteSlots, _: TransferOptions)
    ///         -> Result<TransferHandle, PostError> {
    ///         Err(PostError { lease: local, kind: PostErrorKind::ShuttingDown })
    ///     }
    /// }
    /// let (pool, _authority) = SlotPool::new(Arc::new(HostRegion::new(4096).unwrap()), PoolConfig::new(4096)).unwrap();
    /// let remote = RemoteSlots { endpoint: "peer".into(), pool: pool.id(), key: 0, slot_size: 4096, memory: Default::default(), token: Default::default(), slots: vec![] };
    /// let post = PostFuture::deferred(&Refuse, Op::Write, pool.reserve(1).unwrap(), &remote, TransferOptions::default());
    /// assert_eq!(pool.metrics().free, 0); // nothing happened yet: the lease waits in the future
    /// let refused = block_on(post).unwrap_err();
    /// assert!(matches!(refused.kind, PostErrorKind::ShuttingDown));
    /// refused.lease.release();
    /// assert_eq!(pool.metrics().free, 1);
    /// ```
    pub fn deferred(
        backend: &'a dyn PostNow,
        op: Op,
        local: SlotLease<Reserved>,
        remote: &'a RemoteSlots,
        opts: TransferOptions,
    ) -> Self {
        Self(PostState::Deferred(Some(Deferred { backend, op, local, remote, opts })))
    }
}

impl Future for PostFuture<'_> {
    type Output = Result<TransferHandle, PostError>;

    /// Polled again after it resolved, a deferred post stays pending (it
    /// has nothing left to post).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            PostState::Boxed(f) => f.as_mut().poll(cx),
            PostState::Deferred(args) => match args.take() {
                Some(d) => Poll::Ready(d.backend.post_now(d.op, d.local, d.remote, d.opts)),
                None => Poll::Pending,
            },
        }
    }
}

impl fmt::Debug for PostFuture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.0 {
            PostState::Boxed(_) => "boxed",
            PostState::Deferred(Some(_)) => "deferred",
            PostState::Deferred(None) => "done",
        };
        f.debug_tuple("PostFuture").field(&kind).finish()
    }
}

/// What a finished operation hands back.
#[derive(Debug)]
pub struct TransferOutcome {
    /// The local lease, settled: no NIC touches it any more.
    pub lease: SlotLease<Settled>,
    /// The terminal status.
    pub result: Result<(), TransferError>,
}

/// The operation ended without a proof that settles its local lease: the
/// backend dropped it (shutdown, a bug), or it failed in a way that proves
/// nothing about the NIC (an engine error reported while parts of the
/// operation may still run). Its lease went to quarantine and returns to the
/// pool only with a proof.
#[derive(Debug, Clone, PartialEq, Eq, Default, thiserror::Error)]
#[error("the operation ended without settling its lease (quarantined){}", match error {
    Some(e) => format!(": {e}"),
    None => String::new(),
})]
pub struct Abandoned {
    /// The engine's error, when the operation failed rather than being dropped.
    pub error: Option<TransferError>,
}

enum OpState {
    Pending { waker: Option<Waker> },
    Done(Result<TransferOutcome, Abandoned>),
    Taken,
}

/// Both ends' view of the operation under one lock, so that completing and
/// dropping the handle cannot interleave (and a completion costs one lock).
struct OpSlot {
    state: OpState,
    /// Handle still alive (someone may wait for the outcome).
    handle_alive: bool,
}

struct OpShared {
    slot: Mutex<OpSlot>,
    cancel: std::sync::atomic::AtomicBool,
}

/// An in-flight operation: a future that resolves only at a terminal status.
///
/// Dropping it does not release anything: the lease stays with the backend's
/// [`Completer`] until the terminal status, then returns to the pool.
#[must_use = "dropping the handle does not cancel the operation; its lease returns to the pool when it completes"]
pub struct TransferHandle {
    inner: HandleInner,
}

enum HandleInner {
    /// Shared with the backend's [`Completer`].
    Pending(Arc<OpShared>),
    /// Finished before the handle was made ([`TransferHandle::completed`]):
    /// the outcome itself, nothing shared, nothing to lock.
    Ready(Option<Result<TransferOutcome, Abandoned>>),
}

impl fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferHandle").field("cancel_requested", &self.cancel_requested()).finish()
    }
}

/// The backend's end of an in-flight operation. Owns the local lease until
/// the terminal status.
pub struct Completer {
    shared: Arc<OpShared>,
    lease: Option<SlotLease<Exposed>>,
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer").field("lease", &self.lease).finish()
    }
}

impl TransferHandle {
    /// Creates the two ends of an operation around its exposed local lease.
    /// Backends call this when they post.
    pub fn pair(lease: SlotLease<Exposed>) -> (TransferHandle, Completer) {
        let shared = Arc::new(OpShared {
            slot: Mutex::new(OpSlot { state: OpState::Pending { waker: None }, handle_alive: true }),
            cancel: std::sync::atomic::AtomicBool::new(false),
        });
        (TransferHandle { inner: HandleInner::Pending(shared.clone()) }, Completer { shared, lease: Some(lease) })
    }

    /// The handle of an operation that reached its terminal status before
    /// the handle was made (a backend that saw it finish inside its post):
    /// the lease is settled with `proof` now and the handle resolves at its
    /// first poll, with no [`Completer`] and nothing shared. As with
    /// [`Completer::complete`], a proof that does not settle the lease
    /// quarantines it, the handle resolves `Abandoned`, and the error says why.
    ///
    /// ```
    /// use kv_transfer_core::{block_on, HostRegion, PeerId, PoolConfig, SlotPool, TransferHandle};
    /// use std::sync::Arc;
    /// let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(2 * 64).unwrap()), PoolConfig::new(64)).unwrap();
    /// let exposed = authority.expose_local(pool.reserve(1).unwrap(), PeerId(1));
    /// // ... the backend's engine reported the transfer terminal inside its post ...
    /// let proof = authority.completed_lease(&exposed);
    /// let (handle, settled) = TransferHandle::completed(exposed, proof, Ok(()));
    /// assert!(settled.is_ok());
    /// let outcome = block_on(handle).unwrap();
    /// outcome.lease.release();
    /// assert_eq!(pool.metrics().free, 2);
    /// ```
    pub fn completed(
        lease: SlotLease<Exposed>,
        proof: impl Into<Settlement>,
        result: Result<(), TransferError>,
    ) -> (TransferHandle, Result<(), crate::lease::SettleErrorReason>) {
        let (out, err) = match lease.settle(proof) {
            Ok(settled) => (Ok(TransferOutcome { lease: settled, result }), Ok(())),
            Err(SettleError { lease, reason }) => {
                drop(lease);
                (Err(Abandoned::default()), Err(reason))
            }
        };
        (TransferHandle { inner: HandleInner::Ready(Some(out)) }, err)
    }

    /// Asks the backend to stop the operation. A request only: the handle
    /// still resolves at a terminal status (possibly success, possibly
    /// `Canceled`), never earlier. (A completed handle has nothing to stop.)
    pub fn cancel(&self) {
        if let HandleInner::Pending(shared) = &self.inner {
            shared.cancel.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Whether `cancel` was called (never, for a completed handle).
    pub fn cancel_requested(&self) -> bool {
        match &self.inner {
            HandleInner::Pending(shared) => shared.cancel.load(std::sync::atomic::Ordering::Acquire),
            HandleInner::Ready(_) => false,
        }
    }
}

impl Future for TransferHandle {
    type Output = Result<TransferOutcome, Abandoned>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let shared = match &mut self.get_mut().inner {
            HandleInner::Pending(shared) => shared,
            // Taken once; polled again after that, it never resolves twice.
            HandleInner::Ready(out) => return out.take().map_or(Poll::Pending, Poll::Ready),
        };
        let mut slot = lock(&shared.slot);
        match &mut slot.state {
            OpState::Pending { waker } => {
                // Re-polled by the same task: keep its waker (no clone).
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            OpState::Taken => Poll::Pending,
            OpState::Done(_) => match std::mem::replace(&mut slot.state, OpState::Taken) {
                OpState::Done(out) => Poll::Ready(out),
                _ => Poll::Pending,
            },
        }
    }
}

impl Drop for TransferHandle {
    fn drop(&mut self) {
        // A completed handle's outcome, if never taken, drops with it (its
        // settled lease goes back to the pool).
        let HandleInner::Pending(shared) = &self.inner else { return };
        // An outcome already delivered but never taken: release its lease
        // (outside the lock: releasing takes the pool's).
        let leftover = {
            let mut slot = lock(&shared.slot);
            slot.handle_alive = false;
            match &slot.state {
                OpState::Done(_) => Some(std::mem::replace(&mut slot.state, OpState::Taken)),
                _ => None,
            }
        };
        drop(leftover);
    }
}

impl Completer {
    /// The local lease of the operation.
    pub fn lease(&self) -> &SlotLease<Exposed> {
        match &self.lease {
            Some(l) => l,
            None => unreachable!("completer used after completion"),
        }
    }

    /// Whether the caller asked to cancel.
    pub fn cancel_requested(&self) -> bool {
        self.shared.cancel.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the handle was dropped (nobody waits for the outcome).
    pub fn is_detached(&self) -> bool {
        !lock(&self.shared.slot).handle_alive
    }

    /// Finishes the operation at a terminal status with the proof that
    /// settles its local lease. The lease goes to the waiting handle, or back
    /// to the pool if the handle was dropped. If the proof does not settle
    /// the lease, the lease is quarantined, the handle resolves `Abandoned`,
    /// and the error says why.
    pub fn complete(
        mut self,
        proof: impl Into<Settlement>,
        result: Result<(), TransferError>,
    ) -> Result<(), crate::lease::SettleErrorReason> {
        let Some(lease) = self.lease.take() else { return Ok(()) };
        match lease.settle(proof) {
            Ok(settled) => {
                self.finish(Ok(TransferOutcome { lease: settled, result }));
                Ok(())
            }
            Err(SettleError { lease, reason }) => {
                drop(lease);
                self.finish(Err(Abandoned::default()));
                Err(reason)
            }
        }
    }

    /// Ends the operation with an error that proves nothing about the NIC
    /// (an engine that may report failure while parts of the operation still
    /// run). The lease is quarantined, so only a later proof (a fence, a
    /// peer's drain) returns it; the handle resolves `Abandoned` carrying
    /// `error`.
    pub fn abandon(mut self, error: TransferError) {
        if let Some(lease) = self.lease.take() {
            drop(lease);
            tracing::warn!(%error, "operation failed without a settlement proof; lease quarantined");
            self.finish(Err(Abandoned { error: Some(error) }));
        }
    }

    fn finish(&self, out: Result<TransferOutcome, Abandoned>) {
        let (waker, unclaimed) = {
            let mut slot = lock(&self.shared.slot);
            if slot.handle_alive {
                match std::mem::replace(&mut slot.state, OpState::Done(out)) {
                    OpState::Pending { waker } => (waker, None),
                    _ => (None, None),
                }
            } else {
                (None, Some(out))
            }
        };
        // Nobody waits: dropping the outcome (outside the lock) releases the
        // settled lease.
        drop(unclaimed);
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            // No terminal status: the lease must not come back unsettled.
            drop(lease);
            tracing::warn!("operation dropped by its backend before a terminal status; lease quarantined");
            self.finish(Err(Abandoned::default()));
        }
    }
}
