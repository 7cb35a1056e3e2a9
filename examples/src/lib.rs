//! # kv-transfer-examples
//!
//! The disaggregated prefill/decode demo and the race reproduction, as a
//! library so that the demo (`cargo run --release -p kv-transfer-examples --bin demo`),
//! the conformance suite (`kv-transfer-tests`) and `kvt race` share one
//! implementation:
//!
//! - [`payload`]: every byte a prefill worker writes names its request, the
//!   destination slot's generation, the slot and its position, so a consumer
//!   can tell its own bytes from anybody else's and count foreign ones.
//! - [`race`]: the seeded randomized race of aborts, reassignments, held and
//!   delayed writes, over the TCP simulator, under
//!   [`ReleasePolicy::Naive`](backend_tcp_sim::ReleasePolicy::Naive) (the
//!   positive control: it must show corruption) or
//!   [`ReleasePolicy::Safe`](backend_tcp_sim::ReleasePolicy::Safe) (it must not).
//! - [`wait`]: a bounded `block_on` for futures that may never resolve.
//!
//! # Feature flags
//!
//! - `verbs`: `race::verbs`, scenario 2 on real verbs (what `kvt race --backend
//!   verbs` and the suite run).
//! - `mooncake`: `race::mooncake`, scenario 2 on the Mooncake adapter over TCP,
//!   held writes at a gated initiator transport.
//! - `mooncake-rdma`: the same over Mooncake's RDMA transport on the software
//!   NIC, a key per exposure.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod race;

/// The test kit's payloads and waits, which the race is written with.
pub use kv_transfer_testkit::{payload, wait};
