//! Scenarios 1 and 3-8, and the hostile-peer scenarios, against every backend compiled in: one test per
//! (scenario, backend), named `<scenario>::<backend>` (e.g.
//! `s1_abort_while_writes_in_flight::tcp_sim`), so a failure names both and
//! a filter picks either (`-- ::nixl`, `-- s3_`).
//!
//! A custom harness (`libtest-mimic`, `harness = false` in `Cargo.toml`):
//! a backend whose engine is missing has its tests marked *ignored* (the
//! install hint goes to stderr, once per backend); with `CI=true` they run
//! and fail with the hint instead. `--ignored` / `--include-ignored` run
//! them too, and they fail with the hint. A scenario a backend cannot run
//! anywhere (it needs an out-of-process prefill side, writes held at the
//! decode side, a revocation, a fence, raw accesses...: [`Provides`]) is
//! listed as ignored with what it needs, under `CI=true` too: never shown
//! as passed. No cell runs half its scenario: one with alternatives (a
//! fence or none) is a cell per alternative.

use kv_transfer_tests::harness::Provides;
use kv_transfer_tests::{ci, matrix_backends, test_name, Backend, Failure};
use libtest_mimic::{Arguments, Failed, Trial};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn worker() -> Option<PathBuf> {
    // `KVT_PREFILL_WORKER`: where the binary is when this test binary runs
    // on another machine than it was built on (scripts/device-check.sh --prebuilt).
    Some(
        std::env::var_os("KVT_PREFILL_WORKER")
            .map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_prefill-worker")), PathBuf::from),
    )
}

/// A scenario of the matrix.
type Scenario = fn(&dyn Backend) -> Result<(), Failure>;

/// What a scenario needs of a backend beyond a rig ([`Provides`]). A
/// backend without it has that test listed as ignored (not applicable,
/// with why), even under `CI=true`: it can run nowhere, and it is never
/// shown as passed. A scenario with alternatives (with a fence, without
/// one) is one cell per alternative.
#[derive(Clone, Copy)]
enum Need {
    PrefillProcess,
    HeldWrites,
    Revoke,
    Fence,
    NoFence,
    /// Implicit in every cell of a `<backend>_device` column.
    DeviceMemory,
    RawAccess,
    MalformedFrames,
    RawPeer,
    StalledPeer,
    /// A race rig of the backend's own (scenario 2).
    Race,
}

impl Need {
    /// Why `b` cannot run a scenario with this need, if it cannot.
    fn unmet(self, b: &dyn Backend) -> Option<&'static str> {
        let p: Provides = b.provides();
        if let Need::Race = self {
            return b.race().err();
        }
        let (has, what) = match self {
            Need::PrefillProcess => (p.prefill_process, "an out-of-process prefill side"),
            Need::HeldWrites => (p.held_writes, "writes held at the decode side (a software NIC)"),
            Need::Revoke => (p.revoke, "revocation (a key per tenancy)"),
            Need::Fence => (p.fence, "a fence (a connection the decode side can tear down with confirmation)"),
            Need::NoFence => (!p.fence, "a backend without a fence (this one settles by its fence)"),
            Need::DeviceMemory => match (b.memory(), p.fake_device, p.cuda) {
                (kv_transfer_core::SlotMemory::Cuda { .. }, _, Err(why)) => (false, why),
                (kv_transfer_core::SlotMemory::Cuda { .. }, _, Ok(())) => {
                    (kv_transfer_tests::cuda_device_present(), "a CUDA device (scripts/device-check.sh runs these)")
                }
                (_, Err(why), _) => (false, why),
                _ => (true, ""),
            },
            Need::RawAccess => (p.raw_access, "raw one-sided accesses (a software NIC)"),
            Need::MalformedFrames => (p.malformed_frames, "a wire the test can put malformed frames on"),
            Need::RawPeer => (p.raw_peer, "a peer under the test's control"),
            Need::StalledPeer => (p.stalled_peer, "a peer that stalls mid-WRITE (a byte stream, not a NIC's message)"),
            Need::Race => unreachable!("answered above"),
        };
        (!has).then_some(what)
    }
}

fn unmet(needs: &[Need], b: &dyn Backend) -> Option<&'static str> {
    let device: &[Need] = if b.memory().is_device() { &[Need::DeviceMemory] } else { &[] };
    device.iter().chain(needs).find_map(|n| n.unmet(b))
}

type Cell = (&'static str, &'static [Need], Scenario);

/// The scenarios, by test name (scenario 2: [`RACES`]).
const SCENARIOS: &[Cell] = &[
    ("s1_abort_while_writes_in_flight", &[], kv_transfer_tests::scenarios::abort_in_flight),
    (
        "s1_abort_while_writes_in_flight_settled_by_revocation",
        &[Need::Revoke],
        kv_transfer_tests::scenarios::abort_in_flight_revoked,
    ),
    ("s3_peer_crash_in_process", &[Need::Fence], |b| kv_transfer_tests::scenarios::peer_crash(b, false)),
    (
        "s3_peer_crash_without_fence_stays_quarantined",
        &[Need::NoFence],
        kv_transfer_tests::scenarios::peer_crash_without_fence,
    ),
    ("s3_peer_crash_killed_process", &[Need::PrefillProcess, Need::Fence], |b| {
        kv_transfer_tests::scenarios::peer_crash(b, true)
    }),
    (
        "s4_stale_ack_never_settles_new_tenancy",
        &[Need::Revoke, Need::HeldWrites],
        kv_transfer_tests::scenarios::stale_ack,
    ),
    ("s4_stale_notify_replay_never_settles", &[Need::RawPeer], kv_transfer_tests::scenarios::stale_notify_replay),
    ("s5_bad_input", &[], kv_transfer_tests::scenarios::bad_input),
    ("s5_bad_input_raw_accesses_rejected", &[Need::RawAccess], kv_transfer_tests::scenarios::bad_input_raw_accesses),
    (
        "s5_bad_input_malformed_frames_dropped",
        &[Need::MalformedFrames],
        kv_transfer_tests::scenarios::bad_input_malformed_frames,
    ),
    ("s6_admission_overload", &[], kv_transfer_tests::scenarios::admission_overload),
    ("s7_dropped_handle_and_lease", &[Need::HeldWrites], kv_transfer_tests::scenarios::dropped_handles),
    ("s8_peer_never_acks", &[Need::HeldWrites], kv_transfer_tests::scenarios::never_acks),
    ("s8_stalled_peer_never_acks", &[Need::StalledPeer], kv_transfer_tests::scenarios::stalled_peer_never_acks),
    ("hostile_impersonation_and_guessed_tokens_settle_nothing", &[], kv_transfer_tests::hostile::impersonation),
    (
        "hostile_impersonation_positive_control_settles_unwritten",
        &[],
        kv_transfer_tests::hostile::impersonation_positive_control,
    ),
];

/// Scenario 2, a row like any other: each backend's race rig, or ignored
/// with why it has none.
const RACES: &[Cell] = &[
    ("s2_naive_policy_shows_corruption", &[Need::Race], |b| {
        kv_transfer_tests::scenarios::reassignment_race(b, kv_transfer_core::drain::ReleasePolicy::Naive)
    }),
    ("s2_safe_policy_zero_foreign_bytes", &[Need::Race], |b| {
        kv_transfer_tests::scenarios::reassignment_race(b, kv_transfer_core::drain::ReleasePolicy::Safe)
    }),
];

/// Runs `scenario` against the backend named `backend` (built afresh on
/// the trial's own thread: backends are not `Send`).
fn run_one(backend: &'static str, scenario: Scenario) -> Result<(), Failed> {
    let b = matrix_backends(worker())
        .into_iter()
        .find(|b| b.name() == backend)
        .ok_or_else(|| Failed::from(format!("backend {backend} is not compiled in")))?;
    if let Err(hint) = b.available() {
        let why = if ci() { "not available under CI=true" } else { "not available" };
        return Err(format!("{backend} {why}: needs {hint}").into());
    }
    scenario(b.as_ref()).map_err(|e| format!("[{backend}] {e}").into())
}

fn main() {
    let mut args = Arguments::from_args();
    // libtest honours RUST_TEST_THREADS; libtest-mimic only `--test-threads`.
    if args.test_threads.is_none() {
        if let Ok(v) = std::env::var("RUST_TEST_THREADS") {
            match v.parse::<usize>() {
                Ok(n) if n > 0 => args.test_threads = Some(n),
                _ => {
                    eprintln!("RUST_TEST_THREADS is `{v}`, should be a positive integer");
                    std::process::exit(101);
                }
            }
        }
    }

    let ci = ci();
    let mut trials = Vec::new();
    // Backend name -> (install hint, test names), for the missing ones.
    let mut missing: BTreeMap<&'static str, (String, Vec<String>, bool)> = BTreeMap::new();
    // Test name -> why the scenario does not apply to its backend.
    let mut not_applicable: Vec<(String, &'static str)> = Vec::new();
    for b in matrix_backends(worker()) {
        let backend = b.name();
        let unavailable = b.available().err();
        let ignore_missing = !ci || b.runs_elsewhere_in_ci();
        for &(scenario, needs, f) in SCENARIOS.iter().chain(RACES) {
            let name = test_name(scenario, backend);
            if let Some(why) = unmet(needs, b.as_ref()) {
                let trial = Trial::test(name.clone(), move || run_one(backend, f)).with_ignored_flag(true);
                if !args.is_filtered_out(&trial) {
                    not_applicable.push((name, why));
                }
                trials.push(trial);
                continue;
            }
            let trial = Trial::test(name.clone(), move || run_one(backend, f))
                .with_ignored_flag(unavailable.is_some() && ignore_missing);
            if let Some(hint) = &unavailable {
                if !args.is_filtered_out(&trial) {
                    missing.entry(backend).or_insert_with(|| (hint.clone(), Vec::new(), ignore_missing)).1.push(name);
                }
            }
            trials.push(trial);
        }
    }

    if !args.list {
        for (backend, (hint, names, ignored)) in &missing {
            let what = if *ignored { "ignored" } else { "failing under CI=true" };
            let first = &names[0];
            let more = match names.len() {
                1 => String::new(),
                n => format!(" (and {} more ::{})", n - 1, backend.replace('-', "_")),
            };
            eprintln!("{what}: {first}{more}: needs {hint}");
        }
        for (name, why) in &not_applicable {
            eprintln!("ignored (not applicable): {name}: needs {why}");
        }
    }

    libtest_mimic::run(&args, trials).exit();
}
