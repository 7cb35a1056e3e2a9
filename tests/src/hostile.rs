//! The hostile-peer scenarios: what a third party can do with only the
//! public wire formats and a peer's name, against every backend. Each runs
//! twice: with the checks on (the attack settles nothing and is counted) and
//! as its positive control, with the decode side's policy `Naive`, which
//! turns the checks of who may settle an exposure off (core's
//! `ExposureTable::with_policy`, MORI's connection binding): there the same
//! attack must succeed, or the scenario proves nothing.

use crate::ensure;
use crate::harness::{Backend, Failure, Rig, RigConfig, SenderIdentity};
use kv_transfer_core::drain::{ExposureToken, ReleasePolicy};
use kv_transfer_core::{EscalationLadder, Exposed, RemoteSlots, Settled, SlotLease};
use kv_transfer_testkit::payload::{pattern, verify, Tag};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(10);

/// The request whose bytes are in the slot before the attacked exposure:
/// what a consumer reads if the exposure settles without being written.
const PREVIOUS_TENANT: u64 = 7;

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Failure + '_ {
    move |e| Failure(format!("{what}: {e}"))
}

/// Impersonation and guessed tokens, checks on: an impostor under the
/// exposed peer's name (its own connection, agent or engine) with a guessed
/// token, the same impostor with the real token where the transport
/// authenticates senders (a leaked token), and the real peer with a guessed
/// token. None settles the exposure; each is dropped and counted; the real
/// peer's own proof then settles it.
pub fn impersonation(b: &dyn Backend) -> Result<(), Failure> {
    let run = attack(b, ReleasePolicy::Safe)?;
    ensure!(
        run.settled_by_forgery.is_none(),
        "[{}] a forged proof settled a live exposure; {}",
        run.rig.backend,
        run.rig.faults.diagnostics()
    );
    ensure!(
        run.dropped == run.sent,
        "[{}] {} forged messages sent, {} dropped and counted; {}",
        run.rig.backend,
        run.sent,
        run.dropped,
        run.rig.faults.diagnostics()
    );
    let Some((exposed, remote, mut honest)) = run.live else {
        return Err(Failure("the exposure is gone though nothing settled it".into()));
    };
    honest.notify(&remote, &remote.tenancies())?;
    let settled = settle_within(exposed, WAIT).ok_or_else(|| {
        Failure(format!("[{}] the real peer's proof did not settle; {}", run.rig.backend, run.rig.faults.diagnostics()))
    })?;
    settled.release();
    Ok(())
}

/// The positive control of [`impersonation`]: with the decode side's checks
/// off (policy `Naive`), the impostor's message settles the exposure
/// unwritten and the consumer reads the previous tenant's bytes.
pub fn impersonation_positive_control(b: &dyn Backend) -> Result<(), Failure> {
    let run = attack(b, ReleasePolicy::Naive)?;
    let Some(settled) = run.settled_by_forgery else {
        return Err(Failure(format!(
            "[{}] positive control: with the checks off the forged proof should settle, and did not; {}",
            run.rig.backend,
            run.rig.faults.diagnostics()
        )));
    };
    let bytes = settled.bytes().map_err(err("read"))?;
    let slot = settled.tenancies()[0];
    let previous = verify(&bytes, Tag::new(PREVIOUS_TENANT, slot.slot.0, 0));
    settled.release();
    ensure!(
        previous.own_bytes == bytes.len(),
        "[{}] positive control: expected the previous tenant's bytes in the forged-settled slot, found {previous:?}",
        run.rig.backend
    );
    Ok(())
}

/// One run of the attack.
struct Run {
    rig: Rig,
    /// Forged messages sent.
    sent: u64,
    /// Of those, dropped and counted by the decode side.
    dropped: u64,
    /// The exposure, if a forged message settled it.
    settled_by_forgery: Option<SlotLease<Settled>>,
    /// Otherwise the exposure, its descriptor and its real peer.
    live: Option<(SlotLease<Exposed>, RemoteSlots, Box<dyn crate::harness::RawPeer>)>,
}

/// Leaves the previous tenant's bytes in the decode pool's one slot,
/// exposes it to a raw peer and sends the forgeries.
fn attack(b: &dyn Backend, policy: ReleasePolicy) -> Result<Run, Failure> {
    // No escalation during the attack: only a message can settle.
    let quiet = EscalationLadder { drain: WAIT * 6, revoke: WAIT * 6, fence: WAIT * 6 };
    let rig = b.rig(&RigConfig { decode_slots: 1, ladder: quiet, policy, can_hold: false, ..RigConfig::default() })?;
    let pool = rig.decode_pool.clone();
    let mut previous = pool.reserve(1).map_err(err("reserve"))?;
    let slot = previous.tenancies()[0].slot;
    let len = pool.slot_size();
    previous.write_at(0, 0, &pattern(len, Tag::new(PREVIOUS_TENANT, slot.0, 0))).map_err(err("write"))?;
    previous.release();
    // Every backend has both: a backend without them has no hostile-peer
    // proof, which is a failure, not a pass.
    let mut honest = rig.faults.raw_peer().ok_or_else(|| Failure(format!("[{}] no raw peer", rig.backend)))??;
    let mut impostor = rig.faults.impostor().ok_or_else(|| Failure(format!("[{}] no impostor", rig.backend)))??;
    let (exposed, remote) = rig.faults.expose_to_raw(pool.reserve(1).map_err(err("reserve"))?)?;
    let guessed = RemoteSlots { token: ExposureToken::from_bytes([0xa5; 16]), ..remote.clone() };
    let ts = remote.tenancies();
    let before = rig.dropped_messages();
    let mut sent = 0;
    impostor.notify(&guessed, &ts)?;
    sent += 1;
    if rig.behaviour.sender_identity == SenderIdentity::Connection {
        // The token leaked: still not the connection it was exposed to.
        impostor.notify(&remote, &ts)?;
        sent += 1;
    }
    if rig.behaviour.proofs_carry_token {
        honest.notify(&guessed, &ts)?;
        sent += 1;
    }
    // Bounded: until every forgery is counted, or one settled the exposure.
    // With the checks off (the positive control) the attack may also win
    // by the impostor displacing the real peer's connection, whose loss
    // then fences the peer: that settlement comes on the driver's own
    // time, so the positive control waits for it (bounded) instead of
    // stopping once the forgeries are counted.
    let deadline = Instant::now() + WAIT;
    let naive = policy.is_naive();
    let mut exposed = exposed;
    loop {
        exposed = match exposed.try_settled() {
            Ok(s) => {
                let dropped = rig.dropped_messages() - before;
                return Ok(Run { rig, sent, dropped, settled_by_forgery: Some(s), live: None });
            }
            Err(l) => l,
        };
        if (!naive && rig.dropped_messages() - before >= sent) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // One more look after everything was counted: a forgery processed last
    // must not have settled either.
    std::thread::sleep(Duration::from_millis(20));
    let dropped = rig.dropped_messages() - before;
    match exposed.try_settled() {
        Ok(s) => Ok(Run { rig, sent, dropped, settled_by_forgery: Some(s), live: None }),
        Err(l) => Ok(Run { rig, sent, dropped, settled_by_forgery: None, live: Some((l, remote, honest)) }),
    }
}

fn settle_within(exposed: SlotLease<Exposed>, wait: Duration) -> Option<SlotLease<Settled>> {
    let mut f = Box::pin(exposed.settled());
    kv_transfer_testkit::wait::poll_until(f.as_mut(), wait)
}
