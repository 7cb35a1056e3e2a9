//! # netns-lab: two hosts and a real network between them, for tests
//!
//! A [`Lab`] is two Linux network namespaces joined by a veth pair, each
//! with its own address on a subnet of its own, created by the test and
//! removed when the lab is dropped (also on failure and on panic, since
//! `Drop` runs while unwinding). Between them a test can cut the link
//! ([`Lab::cut`]), restore it, and shape it with netem ([`Lab::netem`]:
//! delay, loss, reordering).
//!
//! Code that opens sockets runs *in* a host: [`Host::run`] executes a
//! closure on a thread that entered the host's namespace (`setns`), and
//! every thread spawned from there stays in it, so a backend started inside
//! `run` listens, connects and serves in that namespace only.
//!
//! Creating namespaces needs root (`CAP_SYS_ADMIN`) and iproute2;
//! [`Lab::new`] says why it cannot ([`LabError`]), for the tests to skip
//! (or, under `CI=true`, fail).
//!
//! ```no_run
//! let lab = netns_lab::Lab::new("doc").expect("root and iproute2");
//! let addr = lab.b.addr; // 10.x.y.2
//! let listener = lab.b.run(move || std::net::TcpListener::bind((addr, 0))).unwrap().unwrap();
//! let port = listener.local_addr().unwrap().port();
//! lab.a.run(move || std::net::TcpStream::connect((addr, port))).unwrap().unwrap();
//! lab.cut().unwrap(); // now nothing gets through
//! ```

pub mod probe;
pub use probe::{connect_from, connect_from_timeout, proc_status, rss_kib};

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread;

/// Why a lab could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// Not root: namespaces and links need `CAP_SYS_ADMIN` / `CAP_NET_ADMIN`.
    #[error("network namespaces need root (CAP_SYS_ADMIN); running as uid {0}")]
    NotRoot(u32),
    /// An `ip` or `tc` command failed.
    #[error("`{cmd}` failed: {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// What it printed.
        stderr: String,
    },
    /// Entering a namespace failed.
    #[error("cannot enter namespace {ns}: {error}")]
    Setns {
        /// The namespace.
        ns: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// The host's thread is gone (a closure panicked).
    #[error("the host thread of {0} is gone")]
    HostGone(String),
}

fn sh(args: &[&str]) -> Result<(), LabError> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| LabError::Command { cmd: args.join(" "), stderr: e.to_string() })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(LabError::Command { cmd: args.join(" "), stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() })
    }
}

/// Waits (bounded, 5 s) until both ends of the veth are operationally up
/// (`LOWER_UP`: the carrier is there). `ip link set up` returns before that,
/// and a program that lists its usable devices at start (UCX does) skips a
/// device without carrier.
fn wait_carrier(ends: [(&str, &str); 2]) -> Result<(), LabError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let up = ends.iter().all(|(ns, ifname)| {
            Command::new("ip")
                .args(["-n", ns, "-o", "link", "show", "dev", ifname])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("LOWER_UP"))
        });
        if up {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(LabError::Command {
                cmd: format!("wait for carrier on {} and {}", ends[0].1, ends[1].1),
                stderr: "the veth ends did not come up within 5 s".into(),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// One host: a namespace, its interface and address, and a thread inside it.
pub struct Host {
    /// The namespace's name (`ip netns` name).
    pub ns: String,
    /// Its end of the veth pair.
    pub ifname: String,
    /// Its address.
    pub addr: Ipv4Addr,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Host {
    fn start(ns: String, ifname: String, addr: Ipv4Addr) -> Result<Self, LabError> {
        let path = format!("/var/run/netns/{ns}");
        let file = File::open(&path).map_err(|error| LabError::Setns { ns: ns.clone(), error })?;
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), std::io::Error>>();
        let thread = thread::Builder::new()
            .name(format!("netns-{ns}"))
            .spawn(move || {
                // SAFETY: setns on an fd we hold open, for this thread only.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                let _ = ready_tx.send(if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) });
                if rc != 0 {
                    return;
                }
                drop(file);
                for job in rx {
                    job();
                }
            })
            .map_err(|error| LabError::Setns { ns: ns.clone(), error })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self { ns, ifname, addr, jobs: Some(tx), thread: Some(thread) }),
            Ok(Err(error)) => Err(LabError::Setns { ns, error }),
            Err(_) => Err(LabError::HostGone(ns)),
        }
    }

    /// Runs `f` on this host's thread (inside its namespace) and returns
    /// its result. Threads `f` spawns stay in the namespace.
    pub fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> Result<R, LabError> {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.jobs
            .as_ref()
            .ok_or_else(|| LabError::HostGone(self.ns.clone()))?
            .send(job)
            .map_err(|_| LabError::HostGone(self.ns.clone()))?;
        rx.recv().map_err(|_| LabError::HostGone(self.ns.clone()))
    }

    /// Runs a command inside this host's namespace (`ip netns exec`).
    pub fn exec(&self, args: &[&str]) -> Result<(), LabError> {
        let mut all = vec!["ip", "netns", "exec", self.ns.as_str()];
        all.extend_from_slice(args);
        sh(&all)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Two hosts, `a` (x.x.x.1) and `b` (x.x.x.2), on a veth pair.
pub struct Lab {
    /// The first host.
    pub a: Host,
    /// The second host.
    pub b: Host,
    names: Vec<String>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl Lab {
    /// Creates the namespaces, the veth pair and the addresses. `tag`
    /// names them (with the process id and a counter, so parallel tests and
    /// runs never collide); each lab gets its own /24 in 10.0.0.0/8.
    pub fn new(tag: &str) -> Result<Self, LabError> {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        if uid != 0 {
            return Err(LabError::NotRoot(uid));
        }
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let id = (pid.wrapping_mul(31).wrapping_add(n)) % 60_000;
        let tag: String = tag.chars().filter(|c| c.is_ascii_alphanumeric()).take(12).collect();
        let (na, nb) = (format!("kvt-{tag}-{pid}-{n}-a"), format!("kvt-{tag}-{pid}-{n}-b"));
        // Interface names: at most 15 bytes.
        let (ia, ib) = (format!("kv{id}a"), format!("kv{id}b"));
        let subnet = (10u8, (id / 250) as u8 + 1, (id % 250) as u8 + 1);
        let addr = |h: u8| Ipv4Addr::new(subnet.0, subnet.1, subnet.2, h);
        let mut lab_names = Vec::new();
        let build = || -> Result<(), LabError> {
            for ns in [&na, &nb] {
                sh(&["ip", "netns", "add", ns])?;
            }
            sh(&["ip", "link", "add", &ia, "netns", &na, "type", "veth", "peer", "name", &ib, "netns", &nb])?;
            for (ns, ifname, host) in [(&na, &ia, 1u8), (&nb, &ib, 2u8)] {
                let cidr = format!("{}/24", addr(host));
                sh(&["ip", "-n", ns, "addr", "add", &cidr, "dev", ifname])?;
                sh(&["ip", "-n", ns, "link", "set", ifname, "up"])?;
                sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
            }
            wait_carrier([(&na, &ia), (&nb, &ib)])
        };
        lab_names.push(na.clone());
        lab_names.push(nb.clone());
        if let Err(e) = build() {
            for ns in &lab_names {
                let _ = sh(&["ip", "netns", "del", ns]);
            }
            return Err(e);
        }
        let a = Host::start(na.clone(), ia, addr(1));
        let b = Host::start(nb.clone(), ib, addr(2));
        match (a, b) {
            (Ok(a), Ok(b)) => {
                tracing::debug!(a = %a.ns, b = %b.ns, "netns lab up");
                Ok(Self { a, b, names: lab_names })
            }
            (Err(e), _) | (_, Err(e)) => {
                for ns in &lab_names {
                    let _ = sh(&["ip", "netns", "del", ns]);
                }
                Err(e)
            }
        }
    }

    /// Cuts the link: both ends down (nothing passes either way).
    pub fn cut(&self) -> Result<(), LabError> {
        sh(&["ip", "-n", &self.a.ns, "link", "set", &self.a.ifname, "down"])?;
        sh(&["ip", "-n", &self.b.ns, "link", "set", &self.b.ifname, "down"])
    }

    /// Restores a cut link (returns once both ends have carrier again).
    pub fn restore(&self) -> Result<(), LabError> {
        sh(&["ip", "-n", &self.a.ns, "link", "set", &self.a.ifname, "up"])?;
        sh(&["ip", "-n", &self.b.ns, "link", "set", &self.b.ifname, "up"])?;
        wait_carrier([(&self.a.ns, &self.a.ifname), (&self.b.ns, &self.b.ifname)])
    }

    /// Shapes both directions with netem, e.g. `"loss 100%"` (a cut that
    /// keeps the interfaces up) or `"delay 5ms 1ms loss 1% reorder 25%"`.
    pub fn netem(&self, spec: &str) -> Result<(), LabError> {
        for h in [&self.a, &self.b] {
            let mut args =
                vec!["tc", "-n", h.ns.as_str(), "qdisc", "replace", "dev", h.ifname.as_str(), "root", "netem"];
            args.extend(spec.split_whitespace());
            sh(&args)?;
        }
        Ok(())
    }

    /// Limits both directions to `rate` (a `tc` rate such as `"400mbit"`)
    /// with a token bucket (`sch_tbf`, in kernels that lack netem): a large
    /// transfer then stays on the wire long enough for a test to act while
    /// it is in flight. [`Lab::clear_netem`] removes it.
    pub fn limit_rate(&self, rate: &str) -> Result<(), LabError> {
        for h in [&self.a, &self.b] {
            sh(&[
                "tc", "-n", &h.ns, "qdisc", "replace", "dev", &h.ifname, "root", "tbf", "rate", rate, "burst", "256kb",
                "latency", "100ms",
            ])?;
        }
        Ok(())
    }

    /// Whether this kernel has netem (`sch_netem`): tried on host a's
    /// loopback and removed again.
    pub fn netem_available(&self) -> bool {
        let ok = self.a.exec(&["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]).is_ok();
        if ok {
            let _ = self.a.exec(&["tc", "qdisc", "del", "dev", "lo", "root"]);
        }
        ok
    }

    /// Removes any shaping (netem or a rate limit).
    pub fn clear_netem(&self) -> Result<(), LabError> {
        for h in [&self.a, &self.b] {
            let _ = sh(&["tc", "-n", &h.ns, "qdisc", "del", "dev", &h.ifname, "root"]);
        }
        Ok(())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in &self.names {
            if let Err(e) = sh(&["ip", "netns", "del", ns]) {
                eprintln!("netns-lab: cannot remove namespace {ns}: {e}");
            }
        }
    }
}
