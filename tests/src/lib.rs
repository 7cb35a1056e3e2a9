//! # kv-transfer-tests
//!
//! The conformance and race suite: scenarios written once, as functions over
//! a [`Backend`], run against every backend compiled in (the TCP simulator
//! always; the others behind this crate's features), one test per scenario
//! and backend (see below).
//! Every scenario checks bytes, not only statuses: payloads are tagged with
//! their request id and destination tenancy ([`kv_transfer_testkit::payload`]),
//! so a consumer tells its own bytes from anyone else's.
//!
//! | # | scenario | function |
//! | --- | --- | --- |
//! | 1 | abort while writes are in flight | [`scenarios::abort_in_flight`] |
//! | 2 | reassignment race (naive must corrupt, safe must not) | [`scenarios::reassignment_race`] over [`Backend::race`] |
//! | 3 | peer crash mid-transfer | [`scenarios::peer_crash`] |
//! | 4 | stale notification or ack | [`scenarios::stale_ack`] |
//! | 5 | bad input of every kind | [`scenarios::bad_input`] |
//! | 6 | admission overload | [`scenarios::admission_overload`] |
//! | 7 | dropped handle, dropped exposed lease | [`scenarios::dropped_handles`] |
//! | 8 | a peer that never acks | [`scenarios::never_acks`] |
//!
//! ## Plugging in a backend
//!
//! A backend joins the suite by implementing [`harness::Backend`] (say
//! whether it is available, and what to install if not; build a rig). A
//! rig, [`harness::Rig`], is a decode side and a prefill side, connected:
//! the parts every backend has (its name, its [`harness::Behaviour`], the
//! decode pool and the core `Target` that exposes it, the prefill pool and
//! `Transfer`), and [`harness::Faults`], what the backend stages beyond them
//! (hold and release of writes where it can, crash of the prefill side, raw
//! accesses, raw, impostor and stalled peers). What its rigs lack is declared
//! once, in [`Backend::provides`]: the matrix lists the cells that need it
//! as ignored (not applicable, with why), and a cell that runs fails if its
//! rig lacks what was declared. Then add it to [`backends`]. The TCP simulator's
//! harness, [`sim::SimBackend`], is the reference implementation; the NIXL,
//! Mooncake and MORI harnesses go beside it (`src/nixl.rs`, ...; MORI on
//! verbs in `src/mori_verbs.rs`).
//!
//! ## The matrix: one test per (scenario, backend)
//!
//! `tests/conformance.rs` is a custom harness (`libtest-mimic`): it makes
//! one test per scenario and backend compiled in ([`backends`]), named
//! [`test_name`]`(scenario, backend)`, e.g.
//! `s1_abort_while_writes_in_flight::tcp_sim` or
//! `s3_peer_crash_killed_process::nixl`, so a failure names both and a
//! filter selects either (`-- ::mori`, `-- s5_`, `-- --exact NAME`).
//! `--list`, `--ignored`, `--include-ignored`, `--test-threads` (and
//! `RUST_TEST_THREADS`) and `cargo nextest` work as with the built-in
//! harness; the tests run on a thread pool, like libtest's.
//!
//! A backend whose engine is missing ([`Backend::available`] returns the
//! install hint) has its tests marked *ignored*, not passed, and the hint is
//! printed to stderr once per backend (`ignored: <test> (and 7 more
//! ::<backend>): needs <hint>`). With `CI=true` ([`ci`]) those tests are not
//! ignored: they run and fail, the hint in the failure message. Run with
//! `--ignored` outside CI, they fail the same way.
//!
//! Scenario 2 needs a release policy that can be switched to `naive` (the
//! positive control) and writes that outlive their abort: the race is
//! written once in `kv-transfer-examples` (`race/run.rs`), and a backend
//! with a rig for it ([`Backend::race`]: the simulator, Mooncake, verbs on a
//! device, where a large WRITE queued ahead delays the doomed ones) runs
//! `s2_*::<backend>` here; the others list those cells as ignored with why.
//!
//! # Feature flags
//!
//! - `nixl`, `mooncake`, `mori`, `mooncake-rdma`: run the conformance suite
//!   against that backend too (`mori` also as `mori-verbs-fake`; `mooncake-
//!   rdma` as `mooncake-rdma-fake`).
//! - `verbs`: the device columns (`verbs`, and with `mori` and `mooncake-rdma`
//!   their device columns); `scripts/rdma-lab test` runs them in the guest, and
//!   they show as ignored on the host.
#![deny(missing_docs)]

pub mod frames;
pub mod harness;
pub mod hostile;
#[cfg(feature = "mooncake")]
pub mod mooncake;
#[cfg(feature = "mori")]
pub mod mori;
#[cfg(feature = "mori")]
pub mod mori_verbs;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod scenarios;
pub mod sim;
pub mod verbs;

pub use harness::{Backend, Failure, Faults, OnDevice, Rig, RigConfig, SenderIdentity};

/// Every backend compiled into the suite, available or not.
/// `prefill_worker`: path of the `prefill-worker` binary (for the
/// out-of-process crash scenario), if the caller has it.
pub fn backends(prefill_worker: Option<std::path::PathBuf>) -> Vec<Box<dyn Backend>> {
    #[allow(unused_mut)]
    let mut all: Vec<Box<dyn Backend>> = vec![Box::new(sim::SimBackend { prefill_worker })];
    #[cfg(feature = "nixl")]
    all.extend(nixl::backend());
    #[cfg(feature = "mooncake")]
    all.extend(mooncake::backend());
    #[cfg(feature = "mori")]
    all.extend(mori::backend());
    #[cfg(feature = "mori")]
    all.extend(mori_verbs::backends());
    all.extend(verbs::backends());
    all
}

/// The conformance matrix's columns: every backend compiled in ([`backends`]),
/// then each again with its slots in device-like memory ([`OnDevice`],
/// `<backend>_device`), then in a CUDA device's (`<backend>_cuda`: the
/// device `KVT_DEVICE` names, default `cuda:0`; run where a GPU is).
pub fn matrix_backends(prefill_worker: Option<std::path::PathBuf>) -> Vec<Box<dyn Backend>> {
    let cuda = std::env::var("KVT_DEVICE")
        .ok()
        .and_then(|d| d.parse().ok())
        .filter(|m| matches!(m, kv_transfer_core::SlotMemory::Cuda { .. }))
        .unwrap_or(kv_transfer_core::SlotMemory::Cuda { ordinal: 0 });
    let mut all = backends(prefill_worker.clone());
    for memory in [kv_transfer_core::SlotMemory::FakeDevice, cuda] {
        all.extend(
            backends(prefill_worker.clone())
                .into_iter()
                .map(|b| Box::new(OnDevice::new(b, memory)) as Box<dyn Backend>),
        );
    }
    all
}

/// Whether a CUDA device is here (the `_cuda` columns run only then; they
/// are ignored elsewhere, `CI=true` included: CI has no GPU).
pub fn cuda_device_present() -> bool {
    kv_transfer_core::cuda_device_count().is_ok_and(|n| n > 0)
}

/// Whether `CI=true` is set: a backend whose engine is missing then fails
/// its tests (with the install hint) instead of having them ignored.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The conformance test name of `scenario` against the backend named
/// `backend`: `<scenario>::<backend>`, the backend's `-` written `_`
/// (`s5_bad_input::tcp_sim`).
pub fn test_name(scenario: &str, backend: &str) -> String {
    format!("{scenario}::{}", backend.replace('-', "_"))
}

/// Runs `f` for every available backend, in one go; a backend that is not
/// available is reported on stderr and skipped, unless `CI=true`, where it
/// fails. (The conformance suite itself runs one test per scenario and
/// backend instead, where a missing backend shows as ignored.)
pub fn for_each_backend(
    prefill_worker: Option<std::path::PathBuf>,
    f: impl Fn(&dyn Backend) -> Result<(), Failure>,
) -> Result<(), Failure> {
    let ci = ci();
    for b in backends(prefill_worker) {
        match b.available() {
            Ok(()) => {
                f(b.as_ref()).map_err(|e| Failure(format!("[{}] {}", b.name(), e.0)))?;
                eprintln!("[{}] ok", b.name());
            }
            Err(why) if ci => return Err(Failure(format!("[{}] not available under CI=true: {why}", b.name()))),
            Err(why) => eprintln!("skipping backend {}: {why}", b.name()),
        }
    }
    Ok(())
}
