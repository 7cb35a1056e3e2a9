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
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod payload;
pub mod race;
pub mod wait;
