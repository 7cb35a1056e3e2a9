//! kv-transfer backend over NIXL: the **engine layer** and the **adapter**.
//!
//! NIXL's C API (`libnixl_capi.so`, from the `nixl-cu12==1.5.1` wheel) is opened at
//! run time with `libloading`; nothing links against it at build time. Search order
//! for the library:
//!
//! 1. `$NIXL_LIB_DIR/libnixl_capi.so` (when set, the only candidate);
//! 2. `$KVT_ENGINES_VENV/lib*/python3.*/site-packages/.nixl_cu12.mesonpy.libs/`;
//! 3. the same under the first `.engines` venv found walking up from this crate's
//!    source directory (the workspace root).
//!
//! `NIXL_PLUGIN_DIR` is set to the `plugins/` directory beside the library unless
//! already set. A missing library or symbol is a [`engine::LoadError`] whose message
//! says what to install:
//! `python3 -m venv .engines && .engines/bin/pip install --no-deps nixl-cu12==1.5.1`.
//!
//! When no RDMA device is listed under `/sys/class/infiniband` and `UCX_MODULES` is
//! unset, the loader sets `UCX_MODULES=^ib*`: the wheel's IB modules pull in a
//! libnl-route whose destructor crashes the process at exit on such machines.
//! Everything is loaded once per process and never unloaded.
//!
//! On one host UCX picks CMA for large transfers, which completes inside
//! `post_xfer_req`; with `UCX_TLS=tcp` transfers are asynchronous (loopback TCP).
//! With UCX over TCP the target must make progress (NIXL's progress thread, on by
//! default in [`engine::AgentConfig`], or polling).
//!
//! The layer is the trait [`engine::NixlEngine`] (mockable: `MockNixlEngine` with
//! the `mock` feature), its real implementation [`engine::RealNixlEngine`], and
//! the raw handle wrappers in [`engine::raw`]. `unsafe` stays inside this module
//! tree (and one `register_mem` call in the adapter).
//!
//! The adapter, [`adapter::NixlTransfer`], implements `kv-transfer-core`'s
//! `Transfer` over any [`engine::NixlEngine`]: requests are released only after a
//! terminal status and leases returned only after release; target exposures settle
//! from notifications carrying slot, generation and the exposure's token (core's drain codec);
//! aborts are drained and acknowledged (ABORT / ABORT_ACK); teardown waits for
//! every request to or from a peer to be terminal. NIXL offers no per-tenancy
//! revoke and no confirmed per-peer fence, so those escalation steps produce no
//! proof and such slots stay quarantined. The `nixl_peer` binary runs one side of
//! a prefill/decode pair for the two-process tests.
//!
//! # Feature flags
//!
//! - `mock`: exports the engine layer's `mockall` mocks for adapters' tests.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod adapter;
pub mod engine;

pub use adapter::{AdapterConfig, AdapterError, AdapterMetrics, NixlEvent, NixlTransfer, Progress, ShutdownReport};
#[cfg(any(test, feature = "mock"))]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub use engine::MockNixlEngine;
pub use engine::{
    EngineConfig, EngineError, LoadError, MemRegion, MemType, NixlEngine, Notification, RealNixlEngine, RegId, ReqId,
    Status, XferOp, XferSpec, XferState,
};
