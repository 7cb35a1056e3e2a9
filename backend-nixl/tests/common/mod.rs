//! Shared helpers for the tests that run the real NIXL library.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use backend_nixl::engine::{NixlLibrary, INSTALL_HINT};

/// Loads the library. Missing library: with `CI=true` the test fails loudly with the
/// install command; otherwise it is skipped with a printed message.
pub fn library_or_skip(test: &str) -> Option<NixlLibrary> {
    match NixlLibrary::load() {
        Ok(lib) => Some(lib),
        Err(e) => {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{test}: NIXL library missing under CI=true: {e}\ninstall: {INSTALL_HINT}");
            }
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

/// A process-unique agent name.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Calls `f` until it returns `Some`, at most `max` times and for at most `limit`.
pub fn bounded<T>(max: u64, limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    for _ in 0..max {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    None
}

/// A deterministic pattern for byte checks.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Where one side of a two-process pair runs: a network namespace (`ip
/// netns exec`, which also mounts that namespace's `/sys`: UCX lists its
/// devices there) and the one device UCX may use in it.
#[derive(Clone, Copy, Debug)]
pub struct Place<'a> {
    /// The namespace.
    pub ns: &'a str,
    /// Its network device (`UCX_NET_DEVICES`).
    pub dev: &'a str,
}

struct Kill(Vec<std::process::Child>);

impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if !matches!(c.try_wait(), Ok(Some(_))) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Runs decode and prefill (`nixl_peer`) for `mode`, in this namespace or,
/// with `places`, decode in the first and prefill in the second; `driver`,
/// if any, runs meanwhile with the pair's meeting directory (to act on the
/// files they put there). Returns both stdouts (and prints both outputs).
pub fn run_pair(
    mode: &str,
    mib: usize,
    places: Option<[Place<'_>; 2]>,
    driver: Option<&dyn Fn(&std::path::Path)>,
) -> (String, String) {
    run_pair_in(mode, mib, places, driver, "host")
}

/// [`run_pair`] with both sides' memory in `memory` (`host`, `cuda:N`).
pub fn run_pair_in(
    mode: &str,
    mib: usize,
    places: Option<[Place<'_>; 2]>,
    driver: Option<&dyn Fn(&std::path::Path)>,
    memory: &str,
) -> (String, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvt-nixl-peer-{}-{mode}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let tls = std::env::var("UCX_TLS").unwrap_or_else(|_| "tcp".into());
    let spawn = |role: &str, place: Option<Place<'_>>| {
        // `KVT_NIXL_PEER`: where the binary is when this test binary runs on
        // another machine than it was built on (scripts/device-check.sh --prebuilt).
        let peer = std::env::var("KVT_NIXL_PEER").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nixl_peer").to_string());
        let mut cmd = match place {
            Some(p) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", p.ns, &peer]).env("UCX_NET_DEVICES", p.dev);
                c
            }
            None => Command::new(&peer),
        };
        cmd.args([role, dir.to_str().expect("utf-8 temp dir"), mode, &mib.to_string(), memory])
            .env("UCX_TLS", &tls)
            .env("KVT_PEER_TIMEOUT_S", "60")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nixl_peer")
    };
    let mut kids = Kill(vec![spawn("decode", places.map(|p| p[0])), spawn("prefill", places.map(|p| p[1]))]);
    if let Some(d) = driver {
        d(&dir);
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(120) {
        if kids.0.iter_mut().all(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut outs = Vec::new();
    for c in &mut kids.0 {
        let running = !matches!(c.try_wait(), Ok(Some(_)));
        if running {
            let _ = c.kill();
        }
        let status = c.wait().ok();
        let (mut o, mut e) = (String::new(), String::new());
        if let Some(s) = c.stdout.as_mut() {
            let _ = s.read_to_string(&mut o);
        }
        if let Some(s) = c.stderr.as_mut() {
            let _ = s.read_to_string(&mut e);
        }
        eprintln!("--- nixl_peer ({mode}) status {status:?}{}\n{o}{e}", if running { " (killed)" } else { "" });
        outs.push(o);
    }
    let _ = std::fs::remove_dir_all(&dir);
    (outs.remove(0), outs.remove(0))
}

/// The `key=value` fields of the line starting with `tag` (panics if none).
pub fn fields(out: &str, tag: &str) -> std::collections::HashMap<String, String> {
    let line = out.lines().find(|l| l.starts_with(tag)).unwrap_or_else(|| panic!("no {tag} line in {out:?}"));
    line.split(' ').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}
