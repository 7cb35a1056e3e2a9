//! Rule 9's memory figures for the initiator's abort state: the resident
//! set under an ABORT flood, against a no-flood control, in one process.
//! Run alone (`cargo test -p kv-transfer-core --all-features --test
//! rule9_memory -- --nocapture`) to read the figures it prints.
#![cfg(all(not(loom), target_os = "linux", feature = "naive-positive-control"))]

use kv_transfer_core::drain::{AbortTracker, ControlKind, ControlMessage, ExposureToken, ReleasePolicy};
use kv_transfer_core::{Generation, PoolId, RemoteSlot, RemoteSlots, SlotId, Tenancy};

const FLOOD: u64 = 200_000;

/// The resident set is the process's: the tests measure one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
const CAP: usize = 1 << 12;

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn remote() -> RemoteSlots {
    RemoteSlots {
        endpoint: "decode".into(),
        pool: PoolId(7),
        key: 0,
        slot_size: 4096,
        memory: Default::default(),
        token: ExposureToken::from_bytes([9; 16]),
        slots: vec![RemoteSlot { slot: SlotId(0), generation: Generation(1), addr: 0, key: None }],
    }
}

/// Repeats of one in-flight exposure's ABORT (attack 3) and ABORTs for
/// made-up tenancies (attack 1), `FLOOD` each; returns the tracker's
/// entries and the resident-set growth in KiB.
fn flood(policy: ReleasePolicy, n: u64) -> (usize, u64) {
    let before = rss_kib();
    let mut tr: AbortTracker<u32> = AbortTracker::with_policy(CAP, policy);
    let r = remote();
    tr.admit(1, &1, &r, false).unwrap();
    let abort = ControlMessage::new(ControlKind::Abort, r.pool, r.token, r.tenancies());
    for i in 0..n {
        let _ = tr.on_abort(&1, abort.clone());
        let mut t = [0x5a; 16];
        t[..8].copy_from_slice(&i.to_le_bytes());
        let forged = ControlMessage::new(
            ControlKind::Abort,
            PoolId(7),
            ExposureToken::from_bytes(t),
            vec![Tenancy::new(SlotId(1 + i as u32), Generation(u64::MAX))],
        );
        let _ = tr.on_abort(&1, forged);
    }
    let entries = tr.remembered_for(&1);
    let grown = rss_kib().saturating_sub(before);
    drop(tr);
    (entries, grown)
}

#[test]
fn rule9_hostile_abort_floods_hold_the_peers_cap_in_memory() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (control_entries, control_kib) = flood(ReleasePolicy::Safe, 0);
    let (safe_entries, safe_kib) = flood(ReleasePolicy::Safe, FLOOD);
    let (naive_entries, naive_kib) = flood(ReleasePolicy::Naive, FLOOD);
    eprintln!(
        "rule9 abort flood ({FLOOD} repeats + {FLOOD} made-up): no flood {control_entries} entries +{control_kib} KiB; \
         safe {safe_entries} entries +{safe_kib} KiB; positive control (shared FIFO) {naive_entries} entries +{naive_kib} KiB"
    );
    assert!(safe_entries <= 3 * CAP, "the flood bought more than the peer's caps: {safe_entries}");
    assert!(safe_kib < 4 * 1024, "safe tracker grew {safe_kib} KiB under the flood");
    assert!(naive_entries > 10 * CAP, "positive control: the old tracker keeps every repeat ({naive_entries})");
    assert!(naive_kib > safe_kib, "positive control: the old tracker grows ({naive_kib} KiB vs {safe_kib} KiB)");
}

/// ABORTs under `names` made-up sender names, each filling its name's
/// early-abort share (`PER_NAME` tenancies under a token nobody carries),
/// then the honest peer's own ABORT for its in-flight operation. Returns
/// (peers held, entries, RSS growth in KiB, the honest ABORT's ack after
/// its operation ended).
fn many_names(max_peers: usize, names: u32) -> (usize, usize, u64, bool) {
    const PER_NAME: u32 = 1024;
    let before = rss_kib();
    let mut tr: AbortTracker<u32> = AbortTracker::new(PER_NAME as usize).with_max_peers(max_peers);
    let r = remote();
    tr.admit(1, &0, &r, false).unwrap();
    for name in 1..=names {
        let mut t = [0x77; 16];
        t[..4].copy_from_slice(&name.to_le_bytes());
        let tenancies = (0..PER_NAME).map(|s| Tenancy::new(SlotId(s), Generation(1))).collect();
        let _ = tr.on_abort(
            &name,
            ControlMessage::new(ControlKind::Abort, PoolId(7), ExposureToken::from_bytes(t), tenancies),
        );
    }
    let honest = ControlMessage::new(ControlKind::Abort, r.pool, r.token, r.tenancies());
    let waiting = tr.on_abort(&0, honest).is_none();
    let acked = waiting && tr.finished(1, kv_transfer_core::drain::OpEnd::Proven).len() == 1;
    let (peers, entries) = (tr.peers(), tr.remembered());
    let grown = rss_kib().saturating_sub(before);
    drop(tr);
    (peers, entries, grown, acked)
}

#[test]
fn rule9_hostile_made_up_sender_names_buy_at_most_the_peer_cap() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const MAX_PEERS: usize = 64;
    // Ten times the cap in names.
    let names = 10 * MAX_PEERS as u32;
    let (_, control_entries, control_kib, control_acked) = many_names(MAX_PEERS, 0);
    let (peers, entries, kib, acked) = many_names(MAX_PEERS, names);
    let (open_peers, open_entries, open_kib, _) = many_names(usize::MAX, names);
    eprintln!(
        "rule9 made-up names ({names} names x 1,024 early ABORTs): no flood {control_entries} entries +{control_kib} KiB; \
         capped at {MAX_PEERS} peers: {peers} peers, {entries} entries +{kib} KiB; positive control (no peer cap): \
         {open_peers} peers, {open_entries} entries +{open_kib} KiB"
    );
    assert!(control_acked && acked, "the honest peer's ABORT is answered once its operation ends, flood or not");
    assert!(peers <= MAX_PEERS + 1, "{peers} peers held (cap {MAX_PEERS}, plus the honest one)");
    assert!(entries <= MAX_PEERS * 1024 + 1, "{entries} entries (the cap's names' shares and the honest ABORT)");
    assert_eq!(open_peers, names as usize + 1, "positive control: every made-up name bought a peer");
    assert!(open_entries >= 9 * entries, "positive control: {open_entries} entries against {entries}");
}
