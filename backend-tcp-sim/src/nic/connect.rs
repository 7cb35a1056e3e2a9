//! Bringing connections up: the HELLO handshake, connecting to a peer,
//! the acceptor thread, and `add_conn`, which numbers a connection (a
//! [`PeerId`] is never reused) and starts its sender and receiver.

use super::conn::{Conn, ConnState};
use super::{lock, InboundEvent, NicError, NicInner};
use crate::stats::inc;
use crate::wire::{self, Body, AUTH_CONTEXT, PREFIX_LEN};
use kv_transfer_core::auth::{self, AcceptorConfig, DialerConfig, Established, Identity};
use kv_transfer_core::PeerId;
use kv_transfer_core::{AtFull, GateRefusal};
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A handshake's place at the gate (core's [`PeerGate`]), given back when
/// dropped; held with a clone of its connection, which an eviction closes.
type Admitted = kv_transfer_core::GatePermit<IpAddr, TcpStream>;

/// Reads with a whole-handshake deadline: each read waits at most `idle`
/// and never past `deadline` (a per-read timeout alone is restarted by
/// every byte a trickling peer sends).
struct DeadlineReader<'a> {
    s: &'a TcpStream,
    deadline: Instant,
    idle: Duration,
}

impl std::io::Write for DeadlineReader<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake's deadline passed"));
        }
        self.s.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        (&*self.s).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake's deadline passed"));
        }
        // A zero timeout means "none" to set_read_timeout: at least 1 ms.
        self.s.set_read_timeout(Some(left.min(self.idle).max(Duration::from_millis(1))))?;
        (&*self.s).read(buf)
    }
}

impl NicInner {
    fn hello(&self) -> Result<Vec<u8>, NicError> {
        wire::encode_head(&Body::Hello { name: self.cfg.name.clone(), endpoint: self.endpoint.clone() }, 0)
            .map_err(|e| NicError::Handshake(e.to_string()))
    }

    /// The peer handshake (core's `auth`): both ends prove the cluster key,
    /// and the HELLO that follows must name what the handshake proved.
    fn check_hello(proven: &Established, name: &str, endpoint: &str) -> Result<(), NicError> {
        let id = &proven.peer.identity;
        if id.name != name || id.endpoint != endpoint {
            return Err(NicError::Handshake(format!(
                "HELLO names {name:?} at {endpoint:?}, the handshake proved {:?} at {:?}",
                id.name, id.endpoint
            )));
        }
        Ok(())
    }

    fn read_hello(&self, s: &mut impl Read) -> Result<(String, String), NicError> {
        let mut pre = [0u8; PREFIX_LEN];
        s.read_exact(&mut pre)?;
        let p = wire::decode_prefix(&pre).map_err(|e| NicError::Handshake(e.to_string()))?;
        let mut f = vec![0u8; p.fields_len()];
        s.read_exact(&mut f)?;
        match wire::decode_fields(&p, &f) {
            Ok(Body::Hello { name, endpoint }) => Ok((name, endpoint)),
            Ok(other) => Err(NicError::Handshake(format!("expected HELLO, got {:?}", other.kind()))),
            Err(e) => Err(NicError::Handshake(e.to_string())),
        }
    }

    pub(super) fn connect_new(self: &Arc<Self>, endpoint: &str) -> Result<Arc<Conn>, NicError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(NicError::ShuttingDown);
        }
        let mut s = TcpStream::connect(endpoint)?;
        s.set_nodelay(true)?;
        // The whole handshake by its deadline: a listener that trickles its
        // HELLO a byte at a time holds this call no longer.
        let deadline = Instant::now() + self.cfg.handshake_timeout;
        let dialer = DialerConfig {
            key: self.cluster_key.clone(),
            context: AUTH_CONTEXT.into(),
            me: Identity::new(self.cfg.name.clone(), self.endpoint.clone()),
            dialed: endpoint.into(),
            expect_name: None,
        };
        let proven = auth::dial(
            &mut DeadlineReader { s: &s, deadline, idle: self.cfg.handshake_timeout },
            dialer,
            &self.auth_counters,
        )?;
        s.set_write_timeout(Some(self.cfg.handshake_timeout))?;
        s.write_all(&self.hello()?)?;
        s.set_write_timeout(None)?;
        let (name, ep) = self.read_hello(&mut DeadlineReader { s: &s, deadline, idle: self.cfg.handshake_timeout })?;
        Self::check_hello(&proven, &name, &ep)?;
        s.set_read_timeout(None)?;
        inc(&self.counters.connections_opened);
        self.add_conn(s, name, ep, None)
    }

    /// Accepts connections until shut down. Each handshake runs on a
    /// thread of its own, within the listener's limits (handshakes at once,
    /// per source address, established connections per source address) and
    /// the whole-handshake deadline (`handshake_timeout`, each read at most
    /// `listener.idle`), so an idle or half-hello connection holds only its
    /// own handshake; refusals are closed at once and counted. The positive
    /// control (`ListenerLimits::serial`) handshakes here, one at a time.
    pub(super) fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for s in listener.incoming() {
            if self.shutdown.load(Ordering::SeqCst) {
                break;
            }
            let s = match s {
                Ok(s) => s,
                // The listener was shut down (`wake_acceptor`): nothing more to accept.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(_) => continue,
            };
            if self.cfg.listener.serial {
                self.accept_one(s);
                continue;
            }
            let Ok(from) = s.peer_addr().map(|a| a.ip()) else { continue };
            let Some(place) = self.admit(from, &s) else { continue };
            let me = Arc::clone(&self);
            let spawned = std::thread::Builder::new().name(format!("sim-hs-{}", self.cfg.name)).spawn(move || {
                let _place = place;
                me.accept_one(s);
            });
            if spawned.is_err() {
                inc(&self.counters.handshakes_refused_busy);
            }
        }
    }

    /// A place for a handshake from `addr` on `s`, or a counted refusal.
    fn admit(self: &Arc<Self>, addr: IpAddr, s: &TcpStream) -> Option<Admitted> {
        let limits = &self.cfg.listener;
        let established = lock(&self.conns)
            .values()
            .filter(|c| !c.dead.load(Ordering::SeqCst) && c.stream.peer_addr().is_ok_and(|a| a.ip() == addr))
            .count();
        if established >= limits.connections_per_address {
            inc(&self.counters.connections_refused_per_address);
            tracing::debug!(%addr, "connection refused: its address's connections at their cap");
            return None;
        }
        let Ok(handle) = s.try_clone() else { return None };
        match self.gate.enter_or_evict(addr, handle, AtFull::evict_if(limits.evict_oldest)) {
            Ok((place, evicted)) => {
                if let Some(old) = evicted {
                    // Its handshake's next read fails and its thread ends.
                    let _ = old.shutdown(Shutdown::Both);
                    inc(&self.counters.handshakes_evicted);
                    tracing::debug!(%addr, "the oldest handshake in flight closed to make room");
                }
                Some(place)
            }
            Err(GateRefusal::PerPeer) => {
                inc(&self.counters.handshakes_refused_per_address);
                tracing::debug!(%addr, "connection refused: its address's handshakes at their cap");
                None
            }
            Err(_) => {
                inc(&self.counters.handshakes_refused_busy);
                tracing::debug!(%addr, "connection refused: handshakes at their cap");
                None
            }
        }
    }

    /// One accepted connection's handshake, by its deadline.
    fn accept_one(self: &Arc<Self>, s: TcpStream) {
        let deadline = Instant::now() + self.cfg.handshake_timeout;
        let res = (|| -> Result<(), NicError> {
            s.set_nodelay(true)?;
            // What the dialer must have dialed: the endpoint this NIC
            // publishes, or the address its connection reached.
            let mut acceptor = AcceptorConfig::new(
                self.cluster_key.clone(),
                AUTH_CONTEXT,
                Identity::new(self.cfg.name.clone(), self.endpoint.clone()),
            );
            acceptor.replay = Arc::clone(&self.replay);
            if let Ok(local) = s.local_addr() {
                acceptor.addresses.push(local.to_string());
            }
            acceptor.addresses.extend(self.cfg.answers_to.iter().cloned());
            let source = s.peer_addr().ok().map(|a| a.ip());
            let mut timed = DeadlineReader { s: &s, deadline, idle: self.cfg.listener.idle };
            let proven = auth::accept(&mut timed, &acceptor, source, &self.auth_counters)?;
            let (name, ep) = self.read_hello(&mut timed)?;
            Self::check_hello(&proven, &name, &ep)?;
            s.set_read_timeout(None)?;
            inc(&self.counters.connections_accepted);
            // Our HELLO goes out once the connection is registered here:
            // when the dialer's handshake returns, we know the connection
            // (so a `Target::add_peer` of the dialer finds it, and both
            // sides end on one connection).
            s.set_write_timeout(Some(
                deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
            ))?;
            let conn = self.add_conn(s, name, ep, Some(&self.hello()?))?;
            conn.stream.set_write_timeout(None)?;
            Ok(())
        })();
        if let Err(e) = res {
            inc(&self.counters.malformed_frames);
            tracing::debug!(error = %e, "inbound handshake failed");
        }
    }

    pub(super) fn wake_acceptor(&self) {
        if let Some(l) = &self.listener_handle {
            use std::os::fd::AsRawFd;
            // SAFETY: shutdown(2) on a socket we own; a blocked accept(2)
            // on it returns (EINVAL) and the acceptor sees `shutdown`.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let _ = TcpStream::connect_timeout(
            &match self.endpoint.parse() {
                Ok(a) => a,
                Err(_) => return,
            },
            Duration::from_millis(200),
        );
    }

    fn add_conn(
        self: &Arc<Self>,
        s: TcpStream,
        name: String,
        endpoint: String,
        greet: Option<&[u8]>,
    ) -> Result<Arc<Conn>, NicError> {
        set_socket_buffers(&s, self.cfg.socket_buffer);
        let peer = PeerId(self.next_peer.fetch_add(1, Ordering::SeqCst));
        let index = self.next_conn_index.fetch_add(1, Ordering::SeqCst);
        let rx_stream = s.try_clone()?;
        let tx_stream = s.try_clone()?;
        let conn = Arc::new(Conn {
            peer,
            index,
            name: name.clone(),
            endpoint: endpoint.clone(),
            stream: s,
            tx: Arc::default(),
            st: Mutex::new(ConnState::default()),
            dead: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        let mut conns = lock(&self.conns);
        if self.shutdown.load(Ordering::SeqCst) {
            let _ = conn.stream.shutdown(Shutdown::Both);
            return Err(NicError::ShuttingDown);
        }
        // Registered, then greeted, then started, all under the lock: nothing
        // can be queued to the connection before the HELLO left.
        conns.insert(peer, conn.clone());
        if let Some(hello) = greet {
            if let Err(e) = (&conn.stream).write_all(hello) {
                conns.remove(&peer);
                return Err(e.into());
            }
        }
        let (n1, c1) = (self.clone(), conn.clone());
        let (n2, c2) = (self.clone(), conn.clone());
        let threads = std::thread::Builder::new()
            .name(format!("sim-rx-{}-{}", self.cfg.name, peer.0))
            .spawn(move || n1.rx_loop(c1, rx_stream))
            .and_then(|rx| {
                let tx = std::thread::Builder::new()
                    .name(format!("sim-tx-{}-{}", self.cfg.name, peer.0))
                    .spawn(move || n2.tx_loop(c2, tx_stream));
                Ok((rx, tx?))
            });
        match threads {
            Ok((rx, tx)) => lock(&conn.threads).extend([rx, tx]),
            Err(e) => {
                conns.remove(&peer);
                conn.dead.store(true, Ordering::SeqCst);
                let _ = conn.stream.shutdown(Shutdown::Both);
                return Err(e.into());
            }
        }
        drop(conns);
        tracing::debug!(nic = %self.cfg.name, peer = peer.0, remote = %name, "connection up");
        self.event(InboundEvent::PeerConnected { peer, name, endpoint });
        Ok(conn)
    }
}

/// Sets `SO_SNDBUF` and `SO_RCVBUF` (best effort).
fn set_socket_buffers(s: &TcpStream, bytes: Option<usize>) {
    let Some(n) = bytes else { return };
    let n = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: `fd` is an open socket owned by `s`; the option value is a
        // live `c_int` whose size is passed along.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&n as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(opt, "setsockopt failed");
        }
    }
}
