//! A hostile peer on a listening port: a seeded generator of bad frames
//! and a client that sends them, connection after connection.
//!
//! The generator knows a protocol only by a few honest frames (captured
//! from, or built like, a real exchange) and where their length field is.
//! From those it makes, at random (seeded):
//!
//! - **random**: 1 to 128 random bytes;
//! - **truncated**: an honest frame cut short anywhere;
//! - **oversize**: an honest frame whose length field claims up to 2^32 or
//!   2^64 bytes (or just past the protocol's limit);
//! - **replayed**: an honest frame, verbatim;
//! - **mutated** (where the protocol's checks should catch any change):
//!   an honest frame with one to four bytes changed.
//!
//! [`blast`] sends them to a port: per connection an optional preamble
//! (the protocol's hello, so the frames reach the code past it), a few
//! frames, then FIN, and it reads what the service answers until it closes
//! (bounded). A refused or reset connection is the service's right; a
//! service that stops accepting is not, and the caller checks that honest
//! peers are still served afterwards.
//!
//! ```
//! use kv_transfer_tests::frames::{FrameGen, LenField};
//! let honest = vec![vec![1u8, 0, 0, 0, 7, 7, 7, 7]];
//! let mut g = FrameGen::new(7, honest, Some(LenField { offset: 0, width: 4 }), true);
//! let frames: Vec<_> = (0..100).map(|_| g.next_frame()).collect();
//! assert!(frames.iter().all(|(_, f)| !f.is_empty()));
//! assert_eq!(g.counts().iter().sum::<u64>(), 100);
//! ```

use kv_transfer_examples::race::Rng;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Where an honest frame says how long it is.
#[derive(Clone, Copy, Debug)]
pub struct LenField {
    /// Byte offset in the frame.
    pub offset: usize,
    /// 2, 4 or 8 bytes, little-endian.
    pub width: usize,
}

/// What kind of bad frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// Random bytes.
    Random = 0,
    /// An honest frame cut short.
    Truncated = 1,
    /// An honest frame claiming a huge length.
    Oversize = 2,
    /// An honest frame, again.
    Replayed = 3,
    /// An honest frame with a few bytes changed.
    Mutated = 4,
}

/// The seeded generator.
pub struct FrameGen {
    rng: Rng,
    honest: Vec<Vec<u8>>,
    len: Option<LenField>,
    mutate: bool,
    counts: [u64; 5],
}

impl FrameGen {
    /// A generator from `seed` and the protocol's honest frames (at least
    /// one). `mutate`: whether to make mutated frames (off for a protocol
    /// whose payload anyone may write by design, where a changed byte is a
    /// legal write, not an attack the service can tell).
    pub fn new(seed: u64, honest: Vec<Vec<u8>>, len: Option<LenField>, mutate: bool) -> Self {
        assert!(!honest.is_empty() && honest.iter().all(|f| !f.is_empty()), "honest frames needed");
        Self { rng: Rng::new(seed), honest, len, mutate, counts: [0; 5] }
    }

    /// Frames made so far, by [`FrameKind`] (as `usize`).
    pub fn counts(&self) -> [u64; 5] {
        self.counts
    }

    fn below(&mut self, n: usize) -> usize {
        (self.rng.next_u64() % n.max(1) as u64) as usize
    }

    /// The next frame and its kind.
    pub fn next_frame(&mut self) -> (FrameKind, Vec<u8>) {
        let pick = self.below(if self.mutate { 5 } else { 4 });
        let i = self.below(self.honest.len());
        let base = self.honest[i].clone();
        let (kind, frame) = match pick {
            0 => {
                let n = 1 + self.below(128);
                (FrameKind::Random, (0..n).map(|_| self.rng.next_u64() as u8).collect())
            }
            1 => {
                let cut = 1 + self.below(base.len().saturating_sub(1).max(1));
                (FrameKind::Truncated, base[..cut.min(base.len())].to_vec())
            }
            2 => match self.len {
                Some(l) if l.offset + l.width <= base.len() => {
                    let mut f = base;
                    let v: u64 = match self.below(3) {
                        0 => u64::MAX,
                        1 => 1 << 32,
                        _ => (1 << 20) + self.rng.next_u64() % (1 << 30),
                    };
                    f[l.offset..l.offset + l.width].copy_from_slice(&v.to_le_bytes()[..l.width]);
                    if l.width < 8 {
                        // Saturate the narrower field instead of truncating to 0.
                        for b in &mut f[l.offset..l.offset + l.width] {
                            *b |= 0x80;
                        }
                    }
                    (FrameKind::Oversize, f)
                }
                _ => {
                    let mut f = base;
                    f.extend((0..4096).map(|_| self.rng.next_u64() as u8));
                    (FrameKind::Oversize, f)
                }
            },
            3 => (FrameKind::Replayed, base),
            _ => {
                let mut f = base;
                for _ in 0..1 + self.below(4) {
                    let i = self.below(f.len());
                    f[i] ^= 1 + (self.rng.next_u64() % 255) as u8;
                }
                (FrameKind::Mutated, f)
            }
        };
        self.counts[kind as usize] += 1;
        (kind, frame)
    }
}

/// What a blast did.
#[derive(Clone, Debug, Default)]
pub struct BlastReport {
    /// Frames written to a connection.
    pub frames: u64,
    /// Connections opened.
    pub connections: u64,
    /// Connections the service reset or refused (its right).
    pub reset: u64,
    /// Connect attempts that failed (the service not accepting: counted,
    /// and the caller decides whether that is a failure).
    pub connect_failures: u64,
    /// Bytes the service answered with.
    pub reply_bytes: u64,
    /// Frames by kind.
    pub kinds: [u64; 5],
    /// Wall time.
    pub elapsed: Duration,
}

/// What a connection sends before its frames (the protocol's hello).
pub type Preamble = dyn Fn(&mut TcpStream) -> std::io::Result<()> + Sync;

/// How to talk to the port.
pub struct BlastPlan<'a> {
    /// Where.
    pub addr: SocketAddr,
    /// Frames to send in all.
    pub frames: u64,
    /// Frames per connection.
    pub per_connection: usize,
    /// Sent first on each connection (the protocol's hello), if any.
    pub preamble: Option<&'a Preamble>,
    /// Client threads.
    pub threads: usize,
    /// Bound on the whole blast.
    pub deadline: Duration,
}

/// Sends `plan.frames` frames from `gen_for(thread)` generators.
pub fn blast(plan: &BlastPlan<'_>, gen_for: &(dyn Fn(usize) -> FrameGen + Sync)) -> BlastReport {
    let t0 = Instant::now();
    let per_thread = plan.frames.div_ceil(plan.threads.max(1) as u64);
    let reports: Vec<BlastReport> = std::thread::scope(|s| {
        let hs: Vec<_> =
            (0..plan.threads.max(1)).map(|t| s.spawn(move || blast_one(plan, gen_for(t), per_thread, t0))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let mut r = BlastReport::default();
    for x in reports {
        r.frames += x.frames;
        r.connections += x.connections;
        r.reset += x.reset;
        r.connect_failures += x.connect_failures;
        r.reply_bytes += x.reply_bytes;
        for (a, b) in r.kinds.iter_mut().zip(x.kinds) {
            *a += b;
        }
    }
    r.elapsed = t0.elapsed();
    r
}

fn blast_one(plan: &BlastPlan<'_>, mut gen: FrameGen, quota: u64, t0: Instant) -> BlastReport {
    let mut r = BlastReport::default();
    let mut buf = vec![0u8; 64 << 10];
    // Bounded in frames, in connect failures and in time.
    while r.frames < quota && t0.elapsed() < plan.deadline && r.connect_failures < 1_000 {
        let mut s = match TcpStream::connect_timeout(&plan.addr, Duration::from_secs(1)) {
            Ok(s) => s,
            Err(_) => {
                r.connect_failures += 1;
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        r.connections += 1;
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
        if let Some(p) = plan.preamble {
            if p(&mut s).is_err() {
                r.reset += 1;
                continue;
            }
        }
        let mut out = Vec::new();
        let n = (plan.per_connection as u64).min(quota - r.frames);
        for _ in 0..n {
            out.extend_from_slice(&gen.next_frame().1);
        }
        r.frames += n;
        if s.write_all(&out).is_err() {
            r.reset += 1;
            continue;
        }
        let _ = s.shutdown(Shutdown::Write);
        // Until the service closes (bounded by the read timeout).
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => r.reply_bytes += k as u64,
                Err(_) => {
                    r.reset += 1;
                    break;
                }
            }
        }
    }
    r.kinds = gen.counts();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_seeded_and_makes_every_kind() {
        let honest = vec![vec![9u8; 32], vec![3u8; 40]];
        let len = Some(LenField { offset: 4, width: 4 });
        let a: Vec<_> = {
            let mut g = FrameGen::new(11, honest.clone(), len, true);
            (0..500).map(|_| g.next_frame()).collect()
        };
        let mut g = FrameGen::new(11, honest.clone(), len, true);
        let b: Vec<_> = (0..500).map(|_| g.next_frame()).collect();
        assert_eq!(a, b, "same seed, same frames");
        assert!(g.counts().iter().all(|&c| c > 50), "every kind made: {:?}", g.counts());
        for (k, f) in &a {
            match k {
                FrameKind::Replayed => assert!(honest.contains(f)),
                FrameKind::Truncated => assert!(f.len() < 40),
                FrameKind::Oversize => assert!(f[4..8].iter().all(|b| b & 0x80 != 0) || f[4..8] == [0xff; 4]),
                FrameKind::Mutated => assert!(f.len() == 32 || f.len() == 40, "a mutation keeps the length"),
                FrameKind::Random => assert!((1..=128).contains(&f.len())),
            }
        }
        let mut no_mut = FrameGen::new(1, honest, len, false);
        for _ in 0..200 {
            assert_ne!(no_mut.next_frame().0, FrameKind::Mutated);
        }
    }
}
