//! `kvt soak --adversary`: a hostile peer on the soak's network. While the
//! honest workload runs, a small fixed set of threads (three lanes on each
//! host: fast, slow, flood) hits every port the honest tcp-sim NICs listen
//! on with a seeded mix of the attacks of `backend-tcp-sim`'s hostile tests
//! (`tests/hostile_auth.rs`, `tests/hostile_listener.rs`). Each attack uses
//! only what a hostile peer has: the public handshake and frame formats
//! (`kv_transfer_core::auth`, `backend_tcp_sim::wire`), the endpoints and
//! names the honest NICs publish, its own addresses, and a guessed key.
//!
//! The attackers sit on the *other* host (the decode is attacked from host b,
//! the prefills from host a), from addresses of their own that the soak adds
//! to that host's interface, so per-address caps tell them apart from the
//! honest peers. Every loop is bounded in count and time: connects time out
//! after [`CONNECT_TIMEOUT`], every read and write has a timeout, each lane
//! sleeps a seeded pause between attacks, and [`Adversary::stop`] ends every
//! lane within one attack (the longest, slowloris, waits at most the
//! targets' whole-handshake deadline plus 2 s).
//!
//! What each attack counts ([`KindCounts`]): attempted; refused (the target
//! said no: a typed REFUSED, a connection closed at a cap or a deadline);
//! established (a session without the key: must stay 0); lost (no verdict:
//! the link was cut by the soak's faults); unrefused (the target did
//! something it must not: kept a connection past its deadline or caps).

use backend_tcp_sim::wire::{self, Body};
use kv_transfer_core::auth::{
    read_frame, AuthError, ClusterKey, Dialer, DialerConfig, Frame, FrameKind, Identity, RefusalCode, HEADER_LEN,
    MAC_LEN, MAX_FIELD, NONCE_LEN,
};
use kv_transfer_examples::race::Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest wait for a TCP connect (the link may be cut).
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Longest wait for any one read or write of an attack.
const IO_TIMEOUT: Duration = Duration::from_secs(3);

/// Every attack kind, one per hostile test mechanism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttackKind {
    /// The whole handshake under a guessed cluster key (`hostile_a_nic_with_another_cluster_key_*`).
    WrongKey,
    /// A HELLO claiming an honest peer's name and endpoint, then a made-up
    /// FINISH (impersonation without the key).
    ForgedFinish,
    /// A recorded HELLO sent again (`hostile_a_replayed_handshake_*`).
    Replayed,
    /// An honest key holder lured to dial the adversary, which forwards
    /// every byte to the target (`hostile_a_relayed_handshake_*`).
    Relayed,
    /// Many made-up names, one handshake each.
    MadeUpNames,
    /// Seeded random bytes instead of a handshake.
    Garbage,
    /// A handshake header over its size cap (and a megabyte behind it), or a
    /// HELLO whose name field is over its cap.
    Oversized,
    /// Half a HELLO, then nothing (`hostile_idle_connections_*`).
    HalfOpen,
    /// A HELLO dripped a byte at a time, each within the idle bound.
    Slowloris,
    /// 10x the per-address handshake cap of idle connections from one address.
    Flood,
    /// 10x the listener's handshake cap of idle connections, spread over many addresses.
    FloodManyAddresses,
}

impl AttackKind {
    /// Every kind.
    pub const ALL: [Self; 11] = [
        Self::WrongKey,
        Self::ForgedFinish,
        Self::Replayed,
        Self::Relayed,
        Self::MadeUpNames,
        Self::Garbage,
        Self::Oversized,
        Self::HalfOpen,
        Self::Slowloris,
        Self::Flood,
        Self::FloodManyAddresses,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::WrongKey => "wrong_key",
            Self::ForgedFinish => "forged_finish",
            Self::Replayed => "replayed",
            Self::Relayed => "relayed",
            Self::MadeUpNames => "made_up_names",
            Self::Garbage => "garbage",
            Self::Oversized => "oversized",
            Self::HalfOpen => "half_open",
            Self::Slowloris => "slowloris",
            Self::Flood => "flood",
            Self::FloodManyAddresses => "flood_many_addresses",
        }
    }

    /// The target's counter that types its refusal (`auth_*`: the NIC's
    /// `auth_stats`; the others: its listener's `stats`).
    pub fn refused_as(self) -> &'static str {
        match self {
            // Our dialer finds the acceptor's proof wrong and says so.
            Self::WrongKey => "auth_refused_by_peer",
            Self::ForgedFinish | Self::MadeUpNames => "auth_wrong_key",
            Self::Replayed => "auth_replayed",
            Self::Relayed => "auth_address_mismatch",
            Self::Garbage | Self::Oversized => "auth_malformed",
            Self::HalfOpen | Self::Slowloris => "auth_io",
            Self::Flood => "handshakes_refused_per_address",
            // The oldest handshakes give way to newer connections.
            Self::FloodManyAddresses => "handshakes_evicted",
        }
    }

    fn lane(self) -> Lane {
        match self {
            Self::HalfOpen | Self::Slowloris => Lane::Slow,
            Self::Flood | Self::FloodManyAddresses => Lane::Flood,
            _ => Lane::Fast,
        }
    }
}

/// Counts of one attack kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KindCounts {
    /// Attacks started.
    pub attempted: u64,
    /// Attacks the target refused (every connection of it).
    pub refused: u64,
    /// Sessions the adversary got without the key (must be 0).
    pub established: u64,
    /// Attacks with no verdict (no connection: the link cut by a fault).
    pub lost: u64,
    /// Attacks the target did not refuse as it must (held a connection past
    /// its deadline or beyond its caps, or answered a replay).
    pub unrefused: u64,
    /// TCP connections opened by these attacks.
    pub connections: u64,
}

impl KindCounts {
    fn add(&mut self, o: &Self) {
        self.attempted += o.attempted;
        self.refused += o.refused;
        self.established += o.established;
        self.lost += o.lost;
        self.unrefused += o.unrefused;
        self.connections += o.connections;
    }
}

/// The positive control: the same attack code with the cluster's real key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ControlCounts {
    /// Handshakes tried with the real key.
    pub attempted: u64,
    /// Of those, sessions established.
    pub established: u64,
    /// Of those, connections the target registered (it sent its HELLO back).
    pub registered: u64,
}

/// A port an honest NIC listens on, as its peers know it (published).
#[derive(Clone, Debug)]
pub struct Target {
    /// The NIC's name.
    pub name: String,
    /// Its endpoint.
    pub endpoint: SocketAddrV4,
    /// Which host it is on (0: a, 1: b).
    pub host: usize,
}

/// Makes an honest key holder on a host dial the given address (a poisoned
/// discovery record): the relay attack's victim. Returns its error.
pub type Lure = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// What the adversary is given.
#[derive(Clone)]
pub struct AdversaryConfig {
    /// Seed of its schedule.
    pub seed: u64,
    /// Its guess at the cluster key (never the real one).
    pub guess: ClusterKey,
    /// Its own addresses on each host (index = host), at least
    /// [`ADDRESSES_PER_HOST`] each.
    pub addresses: [Vec<Ipv4Addr>; 2],
    /// The targets' listener caps (public: an attacker measures them):
    /// handshakes at once, and per address.
    pub handshakes: usize,
    /// See `handshakes`.
    pub per_address: usize,
    /// The targets' whole-handshake deadline.
    pub handshake_timeout: Duration,
    /// Per host, an honest key holder that can be lured to dial (relay).
    pub lures: [Option<Lure>; 2],
    /// The soak's faults, so that an attack they disturbed counts as lost.
    pub faults: Arc<FaultClock>,
}

/// When the soak's faults disturbed the network: an attack that overlapped
/// one and has no verdict, or looks unrefused (a cut link holds a closed
/// connection's FIN back), is counted `lost`, never `refused`.
#[derive(Debug)]
pub struct FaultClock {
    t0: Instant,
    epoch: AtomicU64,
    until_ms: AtomicU64,
}

/// A moment on a [`FaultClock`].
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    epoch: u64,
    ms: u64,
}

impl Mark {
    /// Time from the clock's start to this mark.
    pub fn since_start(&self) -> Duration {
        Duration::from_millis(self.ms)
    }
}

impl Default for FaultClock {
    fn default() -> Self {
        Self { t0: Instant::now(), epoch: AtomicU64::new(0), until_ms: AtomicU64::new(0) }
    }
}

impl FaultClock {
    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    /// A fault starts now and lasts at most `hold`; its effects (fenced
    /// connections, drains) for `grace` after it ends.
    pub fn begin(&self, hold: Duration, grace: Duration) {
        self.until_ms.fetch_max(self.now_ms() + (hold + grace).as_millis() as u64, Ordering::SeqCst);
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// The fault ended now; its effects last `grace`.
    pub fn end(&self, grace: Duration) {
        self.until_ms.fetch_max(self.now_ms() + grace.as_millis() as u64, Ordering::SeqCst);
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Now.
    pub fn mark(&self) -> Mark {
        Mark { epoch: self.epoch.load(Ordering::SeqCst), ms: self.now_ms() }
    }

    /// Whether a fault (or its grace) overlapped `since` .. now.
    pub fn disturbed_since(&self, since: Mark) -> bool {
        self.epoch.load(Ordering::SeqCst) != since.epoch || since.ms < self.until_ms.load(Ordering::SeqCst)
    }
}

/// What every name the adversary makes up starts with (no honest NIC may
/// ever have a peer by such a name).
pub const GHOST: &str = "ghost";

/// Addresses per host the adversary needs: one per lane, and the rest for
/// the many-addresses flood.
pub const ADDRESSES_PER_HOST: usize = 3 + FLOOD_ADDRESSES;
/// Addresses of the many-addresses flood.
pub const FLOOD_ADDRESSES: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    Fast,
    Slow,
    Flood,
}

type Counts = Arc<Mutex<BTreeMap<AttackKind, KindCounts>>>;

/// A lane's work, to run on a thread of its own.
pub type Task = Box<dyn FnOnce() + Send>;
/// Starts a thread inside a host's namespace (`0`: a, `1`: b).
pub type SpawnIn<'a> = dyn Fn(usize, Task) -> Option<JoinHandle<()>> + 'a;

/// A running adversary.
pub struct Adversary {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    counts: Counts,
}

/// How one attack ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Refused,
    Established,
    Lost,
    Unrefused,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A TCP connection to `dst` from `src`, bounded by `timeout`, its reads
/// and writes by [`IO_TIMEOUT`].
pub fn connect_from_timeout(src: Ipv4Addr, dst: SocketAddrV4, timeout: Duration) -> std::io::Result<TcpStream> {
    let s = netns_lab::connect_from_timeout(src, dst.into(), timeout)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// Whether the other end closed `s` (EOF or reset), without waiting.
fn closed_by_peer(s: &TcpStream) -> bool {
    let mut b = [0u8; 64];
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let r = loop {
        match (&*s).read(&mut b) {
            Ok(0) => break true,
            // A REFUSED frame before the close: read on.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    let _ = s.set_nonblocking(false);
    r
}

/// Waits (bounded by `bound`) until the other end closes `s`; how long it took.
fn wait_closed(s: &TcpStream, bound: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let mut b = [0u8; 256];
    while t0.elapsed() < bound {
        match (&*s).read(&mut b) {
            Ok(0) => return Some(t0.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return Some(t0.elapsed()),
        }
    }
    None
}

/// A HELLO under `key` as `name` at `endpoint`, having dialed `dialed`.
fn hello(key: &ClusterKey, name: &str, endpoint: &str, dialed: &str) -> Option<(Dialer, Frame)> {
    Dialer::start(DialerConfig {
        key: key.clone(),
        context: wire::AUTH_CONTEXT.into(),
        me: Identity::new(name, endpoint),
        dialed: dialed.into(),
        expect_name: None,
    })
    .ok()
}

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// One host's lane: its thread's state.
struct LaneRun {
    lane: Lane,
    host: usize,
    rng: Rng,
    cfg: Arc<AdversaryConfig>,
    targets: Arc<Mutex<Vec<Target>>>,
    stop: Arc<AtomicBool>,
    counts: Counts,
    next_name: u64,
    /// Made-up names start with it.
    prefix: &'static str,
}

impl LaneRun {
    fn made_up_name(&mut self) -> String {
        self.next_name += 1;
        format!("{}-{}-{}-{}", self.prefix, self.cfg.seed, self.host, self.next_name)
    }

    /// This lane's own address (lanes never share one: per-address caps
    /// then measure one attack at a time).
    fn me(&self) -> Ipv4Addr {
        let i = match self.lane {
            Lane::Fast => 0,
            Lane::Slow => 1,
            Lane::Flood => 2,
        };
        self.cfg.addresses[self.host][i]
    }

    fn my_endpoint(&self) -> String {
        format!("{}:9", self.me())
    }

    /// The targets this lane attacks: the honest NICs on the other host.
    fn targets(&self) -> Vec<Target> {
        lock(&self.targets).iter().filter(|t| t.host != self.host).cloned().collect()
    }

    /// Names and endpoints of honest NICs (what a peer list publishes).
    fn honest(&self) -> Vec<Target> {
        lock(&self.targets).clone()
    }

    fn dial(&self, t: &Target) -> std::io::Result<TcpStream> {
        connect_from_timeout(self.me(), t.endpoint, CONNECT_TIMEOUT)
    }

    fn sleep(&self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until && !self.stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5).min(until.saturating_duration_since(Instant::now())));
        }
    }

    fn record(&self, kind: AttackKind, v: Verdict, connections: u64, since: Mark) {
        let v = match v {
            Verdict::Unrefused | Verdict::Lost if self.cfg.faults.disturbed_since(since) => Verdict::Lost,
            v => v,
        };
        let mut g = lock(&self.counts);
        let c = g.entry(kind).or_default();
        c.attempted += 1;
        c.connections += connections;
        match v {
            Verdict::Refused => c.refused += 1,
            Verdict::Established => c.established += 1,
            Verdict::Lost => c.lost += 1,
            Verdict::Unrefused => c.unrefused += 1,
        }
    }

    fn run(mut self) {
        let mine: Vec<AttackKind> = AttackKind::ALL.into_iter().filter(|k| k.lane() == self.lane).collect();
        // Every kind once first (in a seeded order), then a seeded mix.
        let mut first = mine.clone();
        for i in (1..first.len()).rev() {
            let j = (self.rng.next_u64() % (i as u64 + 1)) as usize;
            first.swap(i, j);
        }
        let mut n = 0usize;
        while !self.stop.load(Ordering::SeqCst) {
            let kind =
                first.get(n).copied().unwrap_or_else(|| mine[(self.rng.next_u64() % mine.len() as u64) as usize]);
            n += 1;
            let targets = self.targets();
            if targets.is_empty() {
                self.sleep(Duration::from_millis(50));
                continue;
            }
            let t = targets[(self.rng.next_u64() % targets.len() as u64) as usize].clone();
            let since = self.cfg.faults.mark();
            if self.lane == Lane::Slow {
                // Half-open and slowloris connections held together (each
                // waits out a target's deadline: seconds).
                for (kind, v, conns) in self.slow(&t) {
                    self.record(kind, v, conns, since);
                }
            } else {
                let (v, conns) = self.attack(kind, &t);
                self.record(kind, v, conns, since);
            }
            // Paced: the adversary shares the machine with the workload it
            // attacks; the floods are the heaviest, so the rarest.
            let pause = match self.lane {
                Lane::Fast => 10 + self.rng.next_u64() % 40,
                Lane::Slow => 50 + self.rng.next_u64() % 200,
                Lane::Flood => 500 + self.rng.next_u64() % 1_000,
            };
            self.sleep(Duration::from_millis(pause));
        }
    }

    fn attack(&mut self, kind: AttackKind, t: &Target) -> (Verdict, u64) {
        match kind {
            AttackKind::WrongKey => (self.wrong_key(t, &self.cfg.guess.clone()).0, 1),
            AttackKind::ForgedFinish => {
                // Claims another honest NIC's name and endpoint.
                let honest: Vec<Target> = self.honest().into_iter().filter(|h| h.name != t.name).collect();
                let (name, ep) = match honest.get((self.rng.next_u64() % honest.len().max(1) as u64) as usize) {
                    Some(h) => (h.name.clone(), h.endpoint.to_string()),
                    None => ("soak-prefill-0".to_string(), self.my_endpoint()),
                };
                (self.forged_finish(t, &name, &ep), 1)
            }
            AttackKind::Replayed => self.replayed(t),
            AttackKind::Relayed => self.relayed(t),
            AttackKind::MadeUpNames => {
                let n = 4 + self.rng.next_u64() % 13;
                let mut worst = Verdict::Refused;
                let mut conns = 0;
                for _ in 0..n {
                    if self.stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let name = self.made_up_name();
                    let ep = self.my_endpoint();
                    let v = self.forged_finish(t, &name, &ep);
                    conns += 1;
                    worst = worse(worst, v);
                }
                (worst, conns)
            }
            AttackKind::Garbage => (self.garbage(t), 1),
            AttackKind::Oversized => (self.oversized(t), 1),
            AttackKind::HalfOpen | AttackKind::Slowloris => (Verdict::Lost, 0),
            AttackKind::Flood => {
                let n = 10 * self.cfg.per_address;
                let me = self.me();
                self.flood(t, &[me], n, self.cfg.per_address)
            }
            AttackKind::FloodManyAddresses => {
                let n = 10 * self.cfg.handshakes;
                let addrs: Vec<Ipv4Addr> = self.cfg.addresses[self.host][3..].to_vec();
                self.flood(t, &addrs, n, self.cfg.handshakes)
            }
        }
    }

    /// The whole handshake under `key` with a made-up name; with the real
    /// key (the positive control) the HELLO exchange follows and whether
    /// the target registered the connection is the second value.
    fn wrong_key(&mut self, t: &Target, key: &ClusterKey) -> (Verdict, bool) {
        let Ok(mut s) = self.dial(t) else { return (Verdict::Lost, false) };
        let name = self.made_up_name();
        let ep = self.my_endpoint();
        match wire::authenticate_dialed(&mut s, key, &name, &ep, &t.endpoint.to_string()) {
            Ok(_) => {
                let registered = wire::encode_head(&Body::Hello { name, endpoint: ep }, 0)
                    .ok()
                    .is_some_and(|h| s.write_all(&h).is_ok())
                    && read_sim_hello(&mut s).is_some_and(|n| n == t.name);
                let _ = s.shutdown(Shutdown::Both);
                (Verdict::Established, registered)
            }
            Err(AuthError::WrongKey | AuthError::Refused(_)) => (Verdict::Refused, false),
            Err(_) => (Verdict::Lost, false),
        }
    }

    /// A HELLO as `name` at `endpoint` under the guessed key, answered (the
    /// HELLO passes: it names the target's address), then a made-up FINISH.
    fn forged_finish(&mut self, t: &Target, name: &str, endpoint: &str) -> Verdict {
        let Some((_, h)) = hello(&self.cfg.guess, name, endpoint, &t.endpoint.to_string()) else {
            return Verdict::Lost;
        };
        let Ok(mut s) = self.dial(t) else { return Verdict::Lost };
        if s.write_all(&h.encode()).is_err() {
            return Verdict::Lost;
        }
        match read_frame(&mut s) {
            Ok(f) if f.kind == FrameKind::Challenge => {}
            Ok(f) if f.kind == FrameKind::Refused => return Verdict::Refused,
            _ => return Verdict::Lost,
        }
        let finish = Frame { kind: FrameKind::Finish, body: random_bytes(&mut self.rng, MAC_LEN) };
        if s.write_all(&finish.encode()).is_err() {
            return Verdict::Lost;
        }
        refusal(&mut s, RefusalCode::WrongKey)
    }

    /// The same HELLO on two connections: the first is answered (the live
    /// run), the second must be refused as a replay.
    fn replayed(&mut self, t: &Target) -> (Verdict, u64) {
        let name = self.made_up_name();
        let Some((_, h)) = hello(&self.cfg.guess, &name, &self.my_endpoint(), &t.endpoint.to_string()) else {
            return (Verdict::Lost, 0);
        };
        let bytes = h.encode();
        let Ok(mut first) = self.dial(t) else { return (Verdict::Lost, 0) };
        if first.write_all(&bytes).is_err() || !read_frame(&mut first).is_ok_and(|f| f.kind == FrameKind::Challenge) {
            return (Verdict::Lost, 1);
        }
        drop(first);
        let Ok(mut again) = self.dial(t) else { return (Verdict::Lost, 1) };
        if again.write_all(&bytes).is_err() {
            return (Verdict::Lost, 2);
        }
        (refusal(&mut again, RefusalCode::Replayed), 2)
    }

    /// A relay: the adversary listens at its own address, lures an honest
    /// key holder on its host to dial it, and forwards every byte both ways
    /// to the target. The handshake binds the address dialed: refused.
    fn relayed(&mut self, t: &Target) -> (Verdict, u64) {
        let Some(lure) = self.cfg.lures[self.host].clone() else { return (Verdict::Lost, 0) };
        let Ok(m) = TcpListener::bind((self.me(), 0)) else { return (Verdict::Lost, 0) };
        let Ok(m_addr) = m.local_addr() else { return (Verdict::Lost, 0) };
        let (me, dst) = (self.me(), t.endpoint);
        let relay = std::thread::Builder::new().name("kvt-adv-relay".into()).spawn(move || -> bool {
            // Accept (bounded), dial the target, splice until either closes.
            let _ = m.set_nonblocking(true);
            let deadline = Instant::now() + IO_TIMEOUT;
            let from = loop {
                match m.accept() {
                    Ok((s, _)) => break s,
                    Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
                    Err(_) => return false,
                }
            };
            let Ok(to) = connect_from_timeout(me, dst, CONNECT_TIMEOUT) else { return false };
            let _ = from.set_nonblocking(false);
            splice(from, to);
            true
        });
        let Ok(relay) = relay else { return (Verdict::Lost, 0) };
        let r = lure(&m_addr.to_string());
        let reached = relay.join().unwrap_or(false);
        match r {
            Err(e) if e.contains("AddressMismatch") => (Verdict::Refused, 2),
            Ok(()) => (Verdict::Established, 2),
            Err(_) if !reached => (Verdict::Lost, 1),
            Err(_) => (Verdict::Lost, 2),
        }
    }

    fn garbage(&mut self, t: &Target) -> Verdict {
        let Ok(mut s) = self.dial(t) else { return Verdict::Lost };
        let n = 16 + (self.rng.next_u64() % 4_080) as usize;
        let mut b = random_bytes(&mut self.rng, n);
        // Never the handshake's magic by chance.
        b[0] = b'G';
        let _ = s.write_all(&b);
        closed_verdict(&s)
    }

    fn oversized(&mut self, t: &Target) -> Verdict {
        let Ok(mut s) = self.dial(t) else { return Verdict::Lost };
        let frame = if self.rng.chance(0.5) {
            // A header whose length is over the handshake's cap, then a megabyte.
            let mut f = Frame { kind: FrameKind::Hello, body: Vec::new() }.encode();
            f[HEADER_LEN - 2..HEADER_LEN].copy_from_slice(&u16::MAX.to_le_bytes());
            f.extend(vec![0xA5u8; 1 << 20]);
            f
        } else {
            // A HELLO within the frame cap whose name field claims more than
            // its own cap.
            let mut body = random_bytes(&mut self.rng, NONCE_LEN);
            for (i, field) in
                [wire::AUTH_CONTEXT.as_bytes(), &[b'x'; 2 * MAX_FIELD][..], b"1.2.3.4:9", b"d"].into_iter().enumerate()
            {
                let len = if i == 1 { (2 * MAX_FIELD) as u16 } else { field.len() as u16 };
                body.extend_from_slice(&len.to_le_bytes());
                body.extend_from_slice(field);
            }
            let mut f = Frame { kind: FrameKind::Hello, body: Vec::new() }.encode();
            f[HEADER_LEN - 2..HEADER_LEN].copy_from_slice(&(body.len() as u16).to_le_bytes());
            f.extend(body);
            f
        };
        // The target stops reading at the header: the rest may not go out.
        let _ = s.write_all(&frame);
        closed_verdict(&s)
    }

    /// Half-open connections (half a HELLO, then silence: closed at the
    /// target's idle bound) and slowloris ones (a HELLO dripped a byte at a
    /// time, each byte well within the idle bound: cut at the
    /// whole-handshake deadline), held together.
    fn slow(&mut self, t: &Target) -> Vec<(AttackKind, Verdict, u64)> {
        struct Held {
            kind: AttackKind,
            s: TcpStream,
            hello: Vec<u8>,
            sent: usize,
            closed: Option<Duration>,
        }
        let mut held = Vec::new();
        let drippers = 2 + (self.rng.next_u64() % 3) as usize;
        for i in 0..1 + drippers {
            let kind = if i == 0 { AttackKind::HalfOpen } else { AttackKind::Slowloris };
            let name = self.made_up_name();
            let Some((_, h)) = hello(&self.cfg.guess, &name, &self.my_endpoint(), &t.endpoint.to_string()) else {
                continue;
            };
            let hello = h.encode();
            let Ok(s) = self.dial(t) else { continue };
            let sent = if kind == AttackKind::HalfOpen { hello.len() / 2 } else { 0 };
            if (&s).write_all(&hello[..sent]).is_ok() {
                held.push(Held { kind, s, hello, sent, closed: None });
            }
        }
        let t0 = Instant::now();
        let bound = self.cfg.handshake_timeout + Duration::from_secs(2);
        let step = Duration::from_millis(200 + self.rng.next_u64() % 200);
        while t0.elapsed() < bound && held.iter().any(|c| c.closed.is_none()) && !self.stop.load(Ordering::SeqCst) {
            for c in held.iter_mut().filter(|c| c.closed.is_none()) {
                if c.kind == AttackKind::Slowloris && c.sent < c.hello.len() {
                    if (&c.s).write_all(&c.hello[c.sent..c.sent + 1]).is_err() {
                        c.closed = Some(t0.elapsed());
                        continue;
                    }
                    c.sent += 1;
                }
                if closed_by_peer(&c.s) {
                    c.closed = Some(t0.elapsed());
                }
            }
            std::thread::sleep(step);
        }
        let stopped = self.stop.load(Ordering::SeqCst);
        [AttackKind::HalfOpen, AttackKind::Slowloris]
            .into_iter()
            .map(|kind| {
                let mine: Vec<&Held> = held.iter().filter(|c| c.kind == kind).collect();
                let v = if mine.is_empty() || (stopped && mine.iter().any(|c| c.closed.is_none())) {
                    // No connection, or stopped mid-drip: no verdict.
                    Verdict::Lost
                } else if mine.iter().all(|c| c.closed.is_some() && c.sent < c.hello.len()) {
                    // Closed by the target before the HELLO was whole, within its deadline (and margin).
                    Verdict::Refused
                } else {
                    Verdict::Unrefused
                };
                (kind, v, mine.len() as u64)
            })
            .collect()
    }

    /// `n` idle connections from `addrs` in turn; after a moment, no more
    /// than `cap` may still be held by the target (the rest closed at once).
    fn flood(&mut self, t: &Target, addrs: &[Ipv4Addr], n: usize, cap: usize) -> (Verdict, u64) {
        let mut held = Vec::with_capacity(n);
        for i in 0..n {
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            if let Ok(s) = connect_from_timeout(addrs[i % addrs.len()], t.endpoint, CONNECT_TIMEOUT) {
                held.push(s);
            } else if held.is_empty() && i >= addrs.len() {
                // Nothing gets through: the link is cut.
                break;
            }
        }
        let opened = held.len() as u64;
        if held.len() <= cap {
            // Not enough got through to test the cap (a cut link).
            return (Verdict::Lost, opened);
        }
        std::thread::sleep(Duration::from_millis(300));
        let open = held.iter().filter(|s| !closed_by_peer(s)).count();
        drop(held);
        (if open <= cap { Verdict::Refused } else { Verdict::Unrefused }, opened)
    }
}

/// The worse of two verdicts (for an attack made of several connections).
fn worse(a: Verdict, b: Verdict) -> Verdict {
    let rank = |v| match v {
        Verdict::Refused => 0,
        Verdict::Lost => 1,
        Verdict::Unrefused => 2,
        Verdict::Established => 3,
    };
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

/// Refused if the target answers with a REFUSED frame of `code` (or at
/// least closes the connection without a session).
fn refusal(s: &mut TcpStream, code: RefusalCode) -> Verdict {
    match read_frame(s) {
        Ok(f) if f.kind == FrameKind::Refused && f.body.first() == Some(&(code as u8)) => Verdict::Refused,
        Ok(f) if f.kind == FrameKind::Refused => Verdict::Refused,
        Ok(_) => Verdict::Unrefused,
        Err(AuthError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Verdict::Refused,
        Err(AuthError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => Verdict::Refused,
        Err(_) => Verdict::Lost,
    }
}

/// Refused if the target closes the connection within the I/O bound.
fn closed_verdict(s: &TcpStream) -> Verdict {
    match wait_closed(s, IO_TIMEOUT) {
        Some(_) => Verdict::Refused,
        None => Verdict::Unrefused,
    }
}

/// The simulator's HELLO after the handshake: the name it carries.
fn read_sim_hello(s: &mut TcpStream) -> Option<String> {
    let mut pre = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut pre).ok()?;
    let p = wire::decode_prefix(&pre).ok()?;
    let mut f = vec![0u8; p.fields_len()];
    s.read_exact(&mut f).ok()?;
    match wire::decode_fields(&p, &f) {
        Ok(Body::Hello { name, .. }) => Some(name),
        _ => None,
    }
}

/// Forwards bytes both ways until either side closes (each read bounded).
fn splice(a: TcpStream, b: TcpStream) {
    let pipe = |mut from: TcpStream, mut to: TcpStream| {
        let mut buf = [0u8; 4096];
        let _ = from.set_read_timeout(Some(IO_TIMEOUT));
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    };
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else { return };
    let back = std::thread::Builder::new().name("kvt-adv-splice".into()).spawn(move || pipe(b2, a2));
    pipe(a, b);
    if let Ok(h) = back {
        let _ = h.join();
    }
}

impl Adversary {
    /// Starts the lanes: on each host (`spawn_in(host, f)` starts a thread
    /// inside that host's namespace), a fast, a slow and a flood lane, each
    /// seeded from `cfg.seed`.
    pub fn start(cfg: AdversaryConfig, targets: Arc<Mutex<Vec<Target>>>, spawn_in: &SpawnIn<'_>) -> Self {
        let cfg = Arc::new(cfg);
        let (stop, counts): (Arc<AtomicBool>, Counts) = (Arc::default(), Arc::default());
        let mut threads = Vec::new();
        for host in 0..2 {
            for (i, lane) in [Lane::Fast, Lane::Slow, Lane::Flood].into_iter().enumerate() {
                let run = LaneRun {
                    lane,
                    host,
                    rng: Rng::new(cfg.seed ^ 0xad7e_0000 ^ ((host as u64) << 8) ^ i as u64),
                    cfg: cfg.clone(),
                    targets: targets.clone(),
                    stop: stop.clone(),
                    counts: counts.clone(),
                    next_name: 0,
                    prefix: GHOST,
                };
                if let Some(h) = spawn_in(host, Box::new(move || run.run())) {
                    threads.push(h);
                }
            }
        }
        Self { stop, threads, counts }
    }

    /// Counts so far, by kind (every kind listed, attempted or not).
    pub fn counts(&self) -> BTreeMap<AttackKind, KindCounts> {
        snapshot(&self.counts)
    }

    /// Stops every lane (within one attack) and returns the counts.
    pub fn stop(mut self) -> BTreeMap<AttackKind, KindCounts> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        snapshot(&self.counts)
    }
}

impl Drop for Adversary {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn snapshot(c: &Counts) -> BTreeMap<AttackKind, KindCounts> {
    let g = lock(c);
    AttackKind::ALL.into_iter().map(|k| (k, g.get(&k).copied().unwrap_or_default())).collect()
}

/// The counts summed over kinds.
pub fn total(c: &BTreeMap<AttackKind, KindCounts>) -> KindCounts {
    let mut t = KindCounts::default();
    for v in c.values() {
        t.add(v);
    }
    t
}

/// The positive control, run in a host's namespace from the adversary's fast
/// address there: the wrong-key attack's code with the real key against
/// `t`, then a forged-finish replaced by a real one. Sessions must be
/// established and registered: the refusals the soak counts are the key's.
pub fn positive_control(cfg: &AdversaryConfig, host: usize, t: &Target, key: &ClusterKey) -> ControlCounts {
    let mut run = LaneRun {
        lane: Lane::Fast,
        host,
        rng: Rng::new(cfg.seed ^ 0xc0_7701),
        cfg: Arc::new(cfg.clone()),
        targets: Arc::default(),
        stop: Arc::default(),
        counts: Arc::default(),
        next_name: 0,
        prefix: "control",
    };
    let mut c = ControlCounts::default();
    let (v, registered) = run.wrong_key(t, key);
    c.attempted += 1;
    c.established += u64::from(v == Verdict::Established);
    c.registered += u64::from(registered);
    c
}
