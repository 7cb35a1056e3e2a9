//! The side channel's acceptor: each handshake on a thread of its own, up
//! to [`SideChannelLimits::handshakes`] at once and
//! [`SideChannelLimits::per_address`] per source address, so a peer that
//! sends half a hello holds only its own handshake (until the whole-
//! handshake deadline), never another peer's. A connection past a cap is
//! closed at once and counted ([`super::VerbsTransportStats::handshakes_busy`],
//! [`super::VerbsTransportStats::handshakes_per_address`]). The thread that
//! ran a handshake then watches the connection's lifeline. Connections up
//! but bound to no engine are capped per address too
//! ([`SideChannelLimits::claims_per_address`];
//! [`super::VerbsTransportStats::claims_refused`]). The positive
//! control ([`SideChannelLimits::serial`]) serves handshakes one at a time
//! on the accepting thread, as before.

use kv_transfer_core::{AtFull, GateRefusal};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{ConnState, Shared, SideChannelLimits};

/// A handshake's place at the gate (core's [`PeerGate`]), given back when
/// dropped; held with a clone of its connection, which an eviction closes.
type Admitted = kv_transfer_core::GatePermit<IpAddr, TcpStream>;

/// A place for a handshake from `addr` on `s`, or a counted refusal.
fn admit(sh: &Arc<Shared>, addr: IpAddr, s: &TcpStream) -> Option<Admitted> {
    let limits: &SideChannelLimits = &sh.cfg.side_channel;
    // Connections up but bound to no engine (claims of engines whose
    // descriptors are not registered, or impostors'), each with its queue
    // pairs, receive buffers and lifeline thread: capped per address. A
    // handshake past its offer counts too: it holds its queue pairs already,
    // and its dialer may connect again the moment it sent READY, before
    // the handshake's thread has marked it unbound (a flood would otherwise
    // get one connection past the cap per handshake in flight).
    let claims = {
        let st = sh.st();
        st.conns
            .values()
            .filter(|c| matches!(c.state, ConnState::Handshaking | ConnState::Unbound { .. } | ConnState::Impostor))
            .filter(|c| c.stream.peer_addr().is_ok_and(|a| a.ip() == addr))
            .count()
    };
    if claims >= limits.claims_per_address {
        sh.st().stats.claims_refused += 1;
        tracing::debug!(%addr, "side-channel connection refused: its address's unbound connections at their cap");
        return None;
    }
    let Ok(handle) = s.try_clone() else { return None };
    match sh.gate.enter_or_evict(addr, handle, AtFull::evict_if(limits.evict_oldest)) {
        Ok((place, evicted)) => {
            if let Some(old) = evicted {
                // Its handshake's next read fails and its thread ends.
                let _ = old.shutdown(std::net::Shutdown::Both);
                sh.st().stats.handshakes_evicted += 1;
                tracing::debug!(%addr, "the oldest side-channel handshake closed to make room");
            }
            Some(place)
        }
        Err(GateRefusal::PerPeer) => {
            sh.st().stats.handshakes_per_address += 1;
            tracing::debug!(%addr, "side-channel connection refused: per-address cap");
            None
        }
        Err(_) => {
            sh.st().stats.handshakes_busy += 1;
            tracing::debug!(%addr, "side-channel connection refused: handshakes at their cap");
            None
        }
    }
}

/// One accepted connection's handshake, then (if it succeeded) its
/// lifeline, on this thread; `place` is given back between the two.
fn serve(
    sh: &Arc<Shared>,
    s: TcpStream,
    from: std::net::SocketAddr,
    place: Option<Admitted>,
) -> Option<(u64, TcpStream)> {
    let r = sh.accept_one(s);
    drop(place);
    match r {
        Ok(x) => Some(x),
        Err(e) => {
            sh.st().stats.refused_hellos += 1;
            tracing::warn!(%from, error = %e, "side-channel connection refused");
            None
        }
    }
}

pub(super) fn accept_loop(sh: Arc<Shared>, listener: TcpListener, threads: Arc<Mutex<Vec<JoinHandle<()>>>>) {
    while !sh.closed.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((s, from)) => {
                if sh.cfg.side_channel.serial {
                    if let Some((id, s)) = serve(&sh, s, from, None) {
                        let w = sh.clone();
                        sh.spawn(&threads, "mori-verbs-life", move || w.watch(id, s));
                    }
                    continue;
                }
                let Some(place) = admit(&sh, from.ip(), &s) else { continue };
                let w = sh.clone();
                sh.spawn(&threads, "mori-verbs-handshake", move || {
                    if let Some((id, s)) = serve(&w, s, from, Some(place)) {
                        w.watch(id, s);
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
