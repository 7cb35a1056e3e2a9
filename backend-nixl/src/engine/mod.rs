//! The engine layer: NIXL's own API shape, as a trait, with one real implementation.
//!
//! - [`NixlEngine`]: the trait an adapter programs against (and mocks in tests,
//!   with `MockNixlEngine` under `cfg(test)` or the `mock` feature).
//! - [`RealNixlEngine`]: one NIXL agent with a UCX backend, requests kept in a
//!   table behind opaque [`ReqId`]s, plus guards raw NIXL lacks.
//! - [`raw`]: one safe wrapper per C handle ([`Agent`], [`Backend`],
//!   [`Registration`], [`XferRequest`]) for tests and benchmarks that need NIXL's
//!   exact behaviour, hazards included.

mod error;
mod ffi;
pub mod raw;
mod real;
mod types;

pub use error::{xfer_state, EngineError, LoadError, NixlError, NixlOp, RegId, ReqId, Status, XferState, INSTALL_HINT};
pub use raw::{Agent, AgentConfig, Backend, HostBuffer, NixlLibrary, Registration, ThreadSync, XferRequest};
pub use real::{EngineConfig, RealNixlEngine};
pub(crate) use types::IdMap;
pub use types::{validate_descs, MemRegion, MemType, Notification, XferOp, XferSpec};

/// NIXL's API, one agent's worth, with opaque ids instead of handles.
///
/// Every method maps NIXL's statuses faithfully: `IN_PROG` is
/// [`XferState::InProgress`] (never success, never an error), anything but 0 and 1
/// is an [`EngineError`], unknown codes included.
///
/// The contract an adapter must keep, because real NIXL does not protect it:
/// a request must be polled with [`xfer_status`](Self::xfer_status) to `Done` or an
/// error before [`release_xfer`](Self::release_xfer), before the memory it touches
/// is deregistered, and before the peer's metadata is invalidated. [`RealNixlEngine`]
/// refuses the first of these while it last saw `InProgress`; a mock may model raw
/// NIXL, whose release "succeeds" while the writes go on.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait NixlEngine: Send + Sync {
    /// This agent's name (what peers pass as `remote_agent`).
    fn agent_name(&self) -> String;

    /// Registers host memory with the engine's backend (`register_mem`).
    ///
    /// # Safety
    /// Each region must be memory of this process that stays allocated, and that no
    /// Rust reference aliases while a NIC may write it, until
    /// [`deregister`](Self::deregister) succeeded and no request or peer can touch
    /// it any more.
    unsafe fn register_mem(&self, regions: &[MemRegion]) -> Result<RegId, EngineError>;

    /// Deregisters (`deregister_mem`). The real engine refuses while any of its
    /// requests is unreleased ([`EngineError::Busy`]).
    fn deregister(&self, id: RegId) -> Result<(), EngineError>;

    /// This agent's metadata blob (`get_local_md`), to send to peers. Call it
    /// after registering the memory peers will target.
    fn local_metadata(&self) -> Result<Vec<u8>, EngineError>;

    /// Loads a peer's blob (`load_remote_md`); returns the peer's agent name.
    fn load_remote_metadata(&self, metadata: &[u8]) -> Result<String, EngineError>;

    /// Forgets a peer (`invalidate_remote_md`). The real engine refuses while
    /// requests to that peer are unreleased.
    fn invalidate_remote_metadata(&self, remote_agent: &str) -> Result<(), EngineError>;

    /// Creates a transfer request (`create_xfer_req`), not yet posted. Nothing is
    /// exposed to the NIC yet; releasing it is always safe.
    fn create_xfer(&self, spec: &XferSpec) -> Result<ReqId, EngineError>;

    /// Posts a created request (`post_xfer_req`), or re-posts one whose last
    /// observed state is `Done` (NIXL re-posts a completed request; the real engine
    /// refuses one that may be in progress or failed). A failure is
    /// [`EngineError::PostFailed`]; the request then still exists and must be polled
    /// and released by the caller.
    fn post_xfer(&self, id: ReqId) -> Result<XferState, EngineError>;

    /// Polls a request (`get_xfer_status`). Polling also drives progress and the
    /// request's notification when the agent has no progress thread.
    fn xfer_status(&self, id: ReqId) -> Result<XferState, EngineError>;

    /// [`post_xfer`](Self::post_xfer), then, if `poll` and the post left the
    /// request in progress, one [`xfer_status`](Self::xfer_status): the
    /// adapter's re-post of a cached request, in one call (the real engine
    /// looks the request up once). The second value is the poll's result,
    /// `None` when it did not poll.
    #[allow(clippy::type_complexity)]
    fn post_xfer_polled(
        &self,
        id: ReqId,
        poll: bool,
    ) -> (Result<XferState, EngineError>, Option<Result<XferState, EngineError>>) {
        let posted = self.post_xfer(id);
        let polled = (poll && matches!(posted, Ok(XferState::InProgress))).then(|| self.xfer_status(id));
        (posted, polled)
    }

    /// Releases a request (`release_xfer_req` + `destroy_xfer_req`) and forgets its
    /// id. Raw NIXL returns success even while the request is in progress (the
    /// hazard); [`RealNixlEngine`] polls once and refuses with
    /// [`EngineError::StillInProgress`] unless the request is terminal or was
    /// never posted.
    fn release_xfer(&self, id: ReqId) -> Result<(), EngineError>;

    /// Every notification received since the last call (`get_notifs`).
    fn get_notifs(&self) -> Result<Vec<Notification>, EngineError>;

    /// Sends a notification to a peer whose metadata is loaded (`gen_notif`).
    fn gen_notif(&self, remote_agent: &str, msg: &[u8]) -> Result<(), EngineError>;
}

/// Creates and posts in one step. If the post fails, the request is *not*
/// released (it may be partly posted): the error is [`EngineError::PostFailed`]
/// with its id, to be polled and released by the caller.
pub fn create_and_post<E: NixlEngine + ?Sized>(engine: &E, spec: &XferSpec) -> Result<(ReqId, XferState), EngineError> {
    let id = engine.create_xfer(spec)?;
    match engine.post_xfer(id) {
        Ok(st) => Ok((id, st)),
        Err(EngineError::Nixl(source)) => Err(EngineError::PostFailed { id, source }),
        Err(e) => Err(e),
    }
}

/// Polls `id` until it is terminal, at most `max_polls` times and for at most
/// `timeout`, calling `between` after each `InProgress` (e.g. a short sleep or
/// yield). Returns the last state seen: `InProgress` means the bound ran out and
/// the request is still live.
pub fn poll_until_terminal<E: NixlEngine + ?Sized>(
    engine: &E,
    id: ReqId,
    max_polls: u64,
    timeout: std::time::Duration,
    mut between: impl FnMut(),
) -> Result<XferState, EngineError> {
    let start = std::time::Instant::now();
    let mut polls = 0u64;
    loop {
        let st = engine.xfer_status(id)?;
        polls += 1;
        if st == XferState::Done || polls >= max_polls || start.elapsed() >= timeout {
            return Ok(st);
        }
        between();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mockall::predicate::eq;

    fn spec() -> XferSpec {
        XferSpec {
            op: XferOp::Write,
            local: vec![MemRegion::new(0x1000, 64)],
            remote: vec![MemRegion::new(0x2000, 64)],
            remote_agent: "peer".into(),
            notif: Some(b"done".to_vec()),
        }
    }

    #[test]
    fn post_failure_keeps_the_request_id() {
        let mut m = MockNixlEngine::new();
        m.expect_create_xfer().returning(|_| Ok(ReqId(7)));
        m.expect_post_xfer()
            .with(eq(ReqId(7)))
            .returning(|_| Err(EngineError::Nixl(NixlError { op: NixlOp::PostXferReq, status: Status::Backend })));
        m.expect_release_xfer().never();
        match create_and_post(&m, &spec()) {
            Err(EngineError::PostFailed { id, source }) => {
                assert_eq!(id, ReqId(7));
                assert_eq!(source.status, Status::Backend);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn in_prog_forever_is_bounded_and_not_terminal() {
        let mut m = MockNixlEngine::new();
        m.expect_xfer_status().times(5).returning(|_| Ok(XferState::InProgress));
        let st = poll_until_terminal(&m, ReqId(1), 5, std::time::Duration::from_secs(5), || {}).expect("no error");
        assert_eq!(st, XferState::InProgress);
    }

    #[test]
    fn poll_returns_errors() {
        let mut m = MockNixlEngine::new();
        let mut n = 0;
        m.expect_xfer_status().returning(move |_| {
            n += 1;
            if n < 3 {
                Ok(XferState::InProgress)
            } else {
                Err(EngineError::Nixl(NixlError { op: NixlOp::GetXferStatus, status: Status::Unknown(9) }))
            }
        });
        let e = poll_until_terminal(&m, ReqId(1), 100, std::time::Duration::from_secs(5), || {}).unwrap_err();
        assert_eq!(e.status(), Some(Status::Unknown(9)));
    }

    #[test]
    fn mock_is_object_safe_and_shareable() {
        let m: std::sync::Arc<dyn NixlEngine> = std::sync::Arc::new({
            let mut m = MockNixlEngine::new();
            m.expect_agent_name().return_const("a".to_string());
            m
        });
        assert_eq!(m.agent_name(), "a");
    }
}
