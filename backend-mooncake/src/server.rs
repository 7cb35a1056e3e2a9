//! Target side: the P2P handshake server and the TCP data server.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::EngineError;
use crate::memory::MemoryRegistry;
use crate::proto::{
    BufferDesc, HandshakeFrame, HandshakeType, NotifyDesc, NotifyReply, ProbeReply, RequestHeader, SegmentDesc,
    StatusWord, TcpOpcode, HEADER_LEN, MAX_HANDSHAKE_LEN,
};

/// What a target adds to the handshake server for a transport other than
/// TCP (Mooncake's RDMA: [`crate::rdma::RdmaTarget`], feature `rdma`): the
/// transport's part of the metadata, per requesting peer, and the answer to
/// a Connection exchange; told of every region registered and unregistered
/// so that what remote peers may reach follows the registry.
pub trait TargetHook: Send + Sync + std::fmt::Debug {
    /// Our descriptor as `peer` (the segment name its own metadata gave,
    /// if it sent any) is to see it; `base` is the TCP descriptor.
    fn descriptor(&self, base: SegmentDesc, peer: Option<&str>) -> SegmentDesc;
    /// The reply to a Connection message (`request` is its JSON body).
    fn connection(&self, request: &[u8]) -> Vec<u8>;
    /// `[addr, addr+len)` was registered with the engine.
    fn registered(&self, addr: u64, len: u64) -> Result<(), EngineError>;
    /// The region at `addr` is being unregistered: once this returns, no
    /// remote peer may reach it.
    fn unregistered(&self, addr: u64);
    /// Whether the TCP data server may place requests into registered
    /// memory. A target whose data path is another transport (RDMA, whose
    /// keys are per tenancy) says `false`: TCP carries no key, so a request
    /// on it would reach any registered byte, revoked tenancies included.
    fn serves_tcp_data(&self) -> bool {
        true
    }
}

/// Most concurrent handshake or data connections a server serves.
const MAX_CONNS: usize = 1024;

/// Shared state the servers need.
#[derive(Debug)]
pub(crate) struct ServerShared {
    pub(crate) registry: Arc<MemoryRegistry>,
    pub(crate) notifies: Mutex<VecDeque<NotifyDesc>>,
    pub(crate) segment_name: String,
    pub(crate) data_host: String,
    pub(crate) data_port: u16,
    pub(crate) io_timeout: Duration,
    pub(crate) stop: AtomicBool,
    pub(crate) max_notifies: usize,
    pub(crate) advertised_version: u32,
    pub(crate) stats: TargetCounters,
    pub(crate) hook: Option<Arc<dyn TargetHook>>,
}

/// Target-side counters (see [`TargetStats`]).
#[derive(Debug, Default)]
pub(crate) struct TargetCounters {
    v1: AtomicU64,
    v2: AtomicU64,
    rejected: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
}

impl TargetCounters {
    pub(crate) fn snapshot(&self) -> TargetStats {
        TargetStats {
            v1_requests: self.v1.load(Ordering::Relaxed),
            v2_requests: self.v2.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
        }
    }
}

/// What the data server has served so far. A non-zero `v1_requests` means
/// some initiator speaks v1: its completions prove nothing about our memory
/// (it cannot learn of a rejection or of when bytes were applied).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetStats {
    /// Accepted requests without the v2 flag.
    pub v1_requests: u64,
    /// Accepted requests with the v2 flag.
    pub v2_requests: u64,
    /// Rejected requests (outside registered memory, size 0, bad opcode).
    pub rejected: u64,
    /// Bytes applied by remote WRITEs.
    pub bytes_written: u64,
    /// Bytes served to remote READs.
    pub bytes_read: u64,
}

impl ServerShared {
    /// Our descriptor as `peer` is to see it: the TCP one, or what the
    /// target hook makes of it.
    pub(crate) fn published(&self, peer: Option<&str>) -> SegmentDesc {
        match &self.hook {
            Some(hook) => hook.descriptor(self.descriptor(), peer),
            None => self.descriptor(),
        }
    }

    /// Our segment descriptor as 0.3.13.post1 sends it.
    pub(crate) fn descriptor(&self) -> SegmentDesc {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        SegmentDesc {
            name: self.segment_name.clone(),
            protocol: "tcp".into(),
            tcp_data_port: self.data_port,
            tcp_proto_version: Some(self.advertised_version),
            tcp_data_host: Some(self.data_host.clone()),
            rdma_server_name: Some(String::new()),
            timestamp: Some(secs.to_string()),
            buffers: self
                .registry
                .regions()
                .into_iter()
                .map(|(addr, length)| BufferDesc {
                    name: self.segment_name.clone(),
                    addr,
                    length,
                    rkey: Vec::new(),
                    lkey: Vec::new(),
                })
                .collect(),
            devices: Vec::new(),
            priority_matrix: None,
        }
    }
}

/// A listening thread; stopped and joined on drop.
#[derive(Debug)]
pub(crate) struct Listener {
    addr: SocketAddr,
    /// A second handle on the listening socket: shutting it down wakes the
    /// blocking `accept` whatever network namespace the dropping thread is
    /// in (a wake-up connection from another namespace never arrives).
    handle: Option<TcpListener>,
    shared: Arc<ServerShared>,
    thread: Option<JoinHandle<()>>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    live: Arc<AtomicUsize>,
}

impl Listener {
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept: shut the listener down (accept returns
        // EINVAL), and connect as well where shutdown is not enough.
        if let Some(l) = &self.handle {
            use std::os::fd::AsRawFd;
            // SAFETY: shutdown(2) on a socket this listener owns.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Fence: tear down every connection and wait until no connection
        // thread can touch registered memory any more.
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).values() {
            let _ = c.shutdown(Shutdown::Both);
        }
        while self.live.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn spawn_listener(
    listener: TcpListener,
    shared: Arc<ServerShared>,
    name: &str,
    handler: fn(TcpStream, &ServerShared),
) -> Result<Listener, EngineError> {
    let addr = listener.local_addr().map_err(|e| EngineError::io("local_addr", e))?;
    let handle = listener.try_clone().ok();
    let sh = shared.clone();
    let live = Arc::new(AtomicUsize::new(0));
    let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
    let (live_l, conns_l) = (live.clone(), conns.clone());
    let mut next_id = 0u64;
    let thread = std::thread::Builder::new()
        .name(format!("mc-{name}-accept"))
        .spawn(move || {
            for conn in listener.incoming() {
                if sh.stop.load(Ordering::SeqCst) {
                    break;
                }
                let stream = match conn {
                    Ok(s) => s,
                    // The listener was shut down (drop): nothing more to accept.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                    Err(_) => continue,
                };
                if live.load(Ordering::Acquire) >= MAX_CONNS {
                    tracing::warn!("too many connections; dropping one");
                    continue;
                }
                let Ok(clone) = stream.try_clone() else { continue };
                next_id += 1;
                let id = next_id;
                conns_l.lock().unwrap_or_else(|e| e.into_inner()).insert(id, clone);
                live.fetch_add(1, Ordering::AcqRel);
                let sh2 = sh.clone();
                let (live2, conns2) = (live.clone(), conns_l.clone());
                let spawned = std::thread::Builder::new().name("mc-conn".into()).spawn(move || {
                    handler(stream, &sh2);
                    conns2.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                    live2.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    conns_l.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                    live.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })
        .map_err(|e| EngineError::io("spawn listener", e))?;
    Ok(Listener { addr, handle, shared, thread: Some(thread), conns, live: live_l })
}

/// Starts the handshake server on `bind`.
pub(crate) fn start_handshake(bind: SocketAddr, shared: Arc<ServerShared>) -> Result<Listener, EngineError> {
    let l = TcpListener::bind(bind).map_err(|e| EngineError::io(format!("bind handshake {bind}"), e))?;
    spawn_listener(l, shared, "handshake", serve_handshake)
}

/// Starts the data server on an already bound listener.
pub(crate) fn start_data(l: TcpListener, shared: Arc<ServerShared>) -> Result<Listener, EngineError> {
    spawn_listener(l, shared, "data", serve_data)
}

fn serve_handshake(mut s: TcpStream, sh: &ServerShared) {
    let _ = s.set_read_timeout(Some(sh.io_timeout));
    let _ = s.set_write_timeout(Some(sh.io_timeout));
    let frame = match HandshakeFrame::read_from(&mut s, MAX_HANDSHAKE_LEN) {
        Ok(f) => f,
        Err(e) => {
            tracing::debug!(error = %e, "bad handshake frame");
            return;
        }
    };
    let value: Result<serde_json::Value, _> = serde_json::from_slice(&frame.json);
    if value.is_err() {
        tracing::debug!("handshake with malformed JSON");
        return;
    }
    let reply: Vec<u8> = match frame.kind {
        HandshakeType::Metadata => {
            // The peer's own descriptor names it; any other shape is answered
            // as an anonymous peer.
            let peer = value.as_ref().ok().and_then(|v| v.get("name")).and_then(|n| n.as_str());
            sh.published(peer).to_json()
        }
        HandshakeType::Notify => match NotifyDesc::from_json(&frame.json) {
            Ok(n) => {
                let mut q = sh.notifies.lock().unwrap_or_else(|e| e.into_inner());
                if q.len() >= sh.max_notifies {
                    tracing::warn!("notify queue full, dropping oldest");
                    q.pop_front();
                }
                tracing::debug!(from = %n.name, "notify received");
                q.push_back(n);
                to_json_line(&NotifyReply::success())
            }
            Err(_) => return,
        },
        HandshakeType::Probe => to_json_line(&ProbeReply { status: "success".into() }),
        HandshakeType::Connection => match &sh.hook {
            Some(hook) => hook.connection(&frame.json),
            // RDMA QP exchange; nothing to do for TCP.
            None => b"{}\n".to_vec(),
        },
        HandshakeType::OldProtocol => b"{}\n".to_vec(),
    };
    if HandshakeFrame::new(frame.kind, reply).write_to(&mut s).is_err() {
        return;
    }
    let _ = s.shutdown(Shutdown::Write);
    // Wait (bounded by the read timeout) for the client to close.
    let mut b = [0u8; 64];
    let _ = s.read(&mut b);
}

fn to_json_line<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut out = serde_json::to_vec(v).unwrap_or_default();
    out.push(b'\n');
    out
}

fn serve_data(mut s: TcpStream, sh: &ServerShared) {
    let _ = s.set_nodelay(true);
    // Idle connections may stay open; only stalls mid-request time out.
    let _ = s.set_write_timeout(Some(sh.io_timeout));
    let peer = s.peer_addr().ok();
    // Fixed for the engine's life: whether any request here may be placed.
    let tcp_data = sh.hook.as_ref().map_or(true, |h| h.serves_tcp_data());
    loop {
        let _ = s.set_read_timeout(None);
        let mut hb = [0u8; HEADER_LEN];
        match read_full(&mut s, &mut hb, &sh.stop) {
            Ok(true) => {}
            Ok(false) => return, // clean EOF between requests
            Err(e) => {
                tracing::debug!(?peer, error = %e, "data connection closed");
                return;
            }
        }
        let _ = s.set_read_timeout(Some(sh.io_timeout));
        let (hdr, v2) = match RequestHeader::decode(&hb) {
            Ok(h) => (Some(h), h.v2),
            Err(_) => (None, hb[16] & 0x80 != 0),
        };
        let guard = hdr.filter(|_| tcp_data).and_then(|h| sh.registry.acquire(h.addr, h.size));
        let (Some(h), Some(guard)) = (hdr, guard) else {
            tracing::warn!(
                ?peer,
                ?hdr,
                tcp_data,
                "rejecting request outside registered memory (or any, if tcp_data is off)"
            );
            sh.stats.rejected.fetch_add(1, Ordering::Relaxed);
            if v2 {
                let _ = s.write_all(&StatusWord::AddrRejected.encode());
            }
            return;
        };
        let ctr = if v2 { &sh.stats.v2 } else { &sh.stats.v1 };
        ctr.fetch_add(1, Ordering::Relaxed);
        let ok = match h.opcode {
            TcpOpcode::Write => {
                // SAFETY: the range lies inside a region held by `guard`; this
                // thread is the only engine writer of it for this request.
                let Some(dst) = (unsafe { guard.slice_mut(h.addr, h.size) }) else { return };
                match read_exact_stop(&mut s, dst, &sh.stop) {
                    Ok(()) => {
                        sh.stats.bytes_written.fetch_add(h.size, Ordering::Relaxed);
                        !v2 || s.write_all(&StatusWord::Ok.encode()).is_ok()
                    }
                    Err(_) => false,
                }
            }
            TcpOpcode::Read => {
                // SAFETY: as above; we only read the bytes.
                let Some(src) = (unsafe { guard.slice(h.addr, h.size) }) else { return };
                let ok = (!v2 || s.write_all(&StatusWord::Ok.encode()).is_ok()) && s.write_all(src).is_ok();
                if ok {
                    sh.stats.bytes_read.fetch_add(h.size, Ordering::Relaxed);
                }
                ok
            }
        };
        drop(guard);
        if !ok {
            tracing::debug!(?peer, "data connection failed mid-request");
            return;
        }
    }
}

/// Reads exactly `buf`; `Ok(false)` on EOF before the first byte.
fn read_full(s: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> std::io::Result<bool> {
    let mut have = 0;
    while have < buf.len() {
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        match s.read(&mut buf[have..]) {
            Ok(0) if have == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => have += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn read_exact_stop(s: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> std::io::Result<()> {
    if read_full(s, buf, stop)? || buf.is_empty() {
        Ok(())
    } else {
        Err(std::io::ErrorKind::UnexpectedEof.into())
    }
}
