//! The REAL Mooncake engine (0.3.13.post1: the `mooncake.engine` Python
//! module from the venv `.engines` at the workspace root, or
//! `MOONCAKE_ENGINES_DIR`) in a child process, driven by `mc_peer.py`'s line
//! commands and killed on drop. Shared by `backend-mooncake`'s interop tests
//! (loopback) and the netns scenarios (the child in another host's network
//! namespace, through `ip netns exec`). Its methods panic on a broken peer:
//! both harnesses turn a panic into that test's failure.

#![allow(dead_code)] // each includer uses its part

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

pub const INSTALL: &str = "install the real engine: `python3 -m venv .engines && .engines/bin/pip install --no-deps \
mooncake-transfer-engine-non-cuda==0.3.13.post1` (at the workspace root) and `apt-get install libibverbs1`";
pub const LINE_TIMEOUT: Duration = Duration::from_secs(30);
const PEER_LIFETIME_S: &str = "120";
const PEER_PY: &str = include_str!("mc_peer.py");

pub struct Engines {
    pub python: PathBuf,
    pub bench: PathBuf,
    pub ld_path: String,
}

/// Finds the real engine, or skips (returns None) / fails under CI=true.
impl Engines {
    /// The real engine, or why it is not usable (with what to install).
    pub fn find() -> Result<Engines, String> {
        let root = std::env::var_os("MOONCAKE_ENGINES_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.engines"));
        let sp = root.join("lib/python3.11/site-packages");
        let e = Engines {
            python: root.join("bin/python"),
            bench: sp.join("mooncake/transfer_engine_bench"),
            ld_path: format!(
                "{}:{}",
                sp.join("mooncake_transfer_engine_non_cuda.libs").display(),
                sp.join("mooncake").display()
            ),
        };
        let ok = e.python.exists()
            && e.bench.exists()
            && Command::new(&e.python)
                .args(["-c", "import mooncake.engine"])
                .env("LD_LIBRARY_PATH", &e.ld_path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        if ok {
            Ok(e)
        } else {
            Err(format!("real Mooncake engine not usable under {}: {INSTALL}", root.display()))
        }
    }
}

/// A real Mooncake TransferEngine in a Python child, killed on drop and
/// bounded by `timeout` in any case.
pub struct Peer {
    child: Child,
    /// Its command stream.
    pub stdin: ChildStdin,
    /// Its replies, a line each.
    pub lines: Receiver<String>,
    /// Its handshake port.
    pub port: u16,
    /// Its buffer's address.
    pub addr: u64,
    /// Its buffer's size.
    pub size: u64,
    /// The address it serves on.
    pub host: String,
    _dir: TempDir,
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Peer {
    /// On loopback.
    pub fn start(e: &Engines, size: u64, legacy_v1: bool) -> Peer {
        Self::start_in(e, size, legacy_v1, None, "127.0.0.1")
    }

    /// On loopback, over RDMA on verbs device `device` (the verbs guest's
    /// `rxe_lo`).
    pub fn start_rdma(e: &Engines, size: u64, device: &str) -> Peer {
        Self::spawn(e, size, None, "127.0.0.1", &[("MC_PROTOCOL", "rdma"), ("MC_DEVICE", device)])
    }

    /// Inside network namespace `netns` (if any), serving on `host`.
    pub fn start_in(e: &Engines, size: u64, legacy_v1: bool, netns: Option<&str>, host: &str) -> Peer {
        let env: &[(&str, &str)] = if legacy_v1 { &[("MC_TCP_PROTO", "1")] } else { &[] };
        Self::spawn(e, size, netns, host, env)
    }

    fn spawn(e: &Engines, size: u64, netns: Option<&str>, host: &str, env: &[(&str, &str)]) -> Peer {
        let dir = std::env::temp_dir().join(format!("mc-interop-{}-{:x}", std::process::id(), rand_u64()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("mc_peer.py");
        std::fs::write(&script, PEER_PY).unwrap();
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "timeout"]);
                c
            }
            None => Command::new("timeout"),
        };
        cmd.arg(PEER_LIFETIME_S)
            .arg(&e.python)
            .arg(&script)
            .arg(size.to_string())
            .env("LD_LIBRARY_PATH", &e.ld_path)
            .env("MC_HOST", host)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        cmd.envs(env.iter().copied());
        let mut child = cmd.spawn().expect("spawn python peer");
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Peer { child, stdin, lines, port: 0, addr: 0, size, host: host.to_string(), _dir: TempDir(dir) };
        let ready = p.line();
        assert!(ready.starts_with("READY"), "peer did not start: {ready}");
        for kv in ready.split_whitespace().skip(1) {
            let (k, v) = kv.split_once('=').unwrap();
            match k {
                "port" => p.port = v.parse().unwrap(),
                "addr" => p.addr = v.parse().unwrap(),
                _ => {}
            }
        }
        p
    }

    pub fn line(&mut self) -> String {
        self.lines.recv_timeout(LINE_TIMEOUT).expect("peer answered in time")
    }

    pub fn cmd(&mut self, c: &str) -> String {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }

    /// Its segment name, `host:port`.
    pub fn segment(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    pub fn put(&mut self, off: u64, data: &[u8]) {
        assert_eq!(self.cmd(&format!("put {off} {}", hex(data))), "OK");
    }

    pub fn get(&mut self, off: u64, len: u64) -> Vec<u8> {
        let r = self.cmd(&format!("get {off} {len}"));
        unhex(r.strip_prefix("OK ").unwrap_or_else(|| panic!("get failed: {r}")))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(7);
    h.finish()
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}
