//! Data transports behind the batch logic. The engine hands each task to a
//! [`DataTransport`] as a [`TransportWork`] and learns its outcome through the
//! work's [`Completion`]. A later RDMA transport implements the same trait.

use kv_transfer_core::hash::HashMap;
use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::batch::BatchState;
use crate::error::TaskError;
use crate::memory::RegionGuard;
use crate::proto::{ProtoVersion, RequestHeader, SegmentDesc, StatusWord, TcpOpcode, STATUS_LEN};

/// A remote segment as the transports see it.
#[derive(Debug, Clone)]
pub struct RemoteSegment {
    /// Engine-local segment id.
    pub id: u64,
    /// The descriptor the peer sent.
    pub desc: SegmentDesc,
    /// Resolved data address (segment-name host, `tcp_data_port`).
    pub data_addr: SocketAddr,
    /// Framing version the peer speaks.
    pub proto: ProtoVersion,
}

/// Reports one task's outcome exactly once. Dropping it unreported marks the
/// task FAILED with [`TaskError::Dropped`] (the work item, and with it the hold
/// on local memory, is gone, so nothing can touch the memory any more).
#[derive(Debug)]
pub struct Completion {
    batch: Arc<BatchState>,
    task: usize,
    done: bool,
}

impl Completion {
    pub(crate) fn new(batch: Arc<BatchState>, task: usize) -> Self {
        Self { batch, task, done: false }
    }

    /// Marks the task PENDING (the transport started on it).
    pub fn started(&self) {
        self.batch.mark_pending(self.task);
    }

    /// Reports the terminal outcome: `Ok(bytes)` → COMPLETED, `Err` → FAILED.
    /// Call only once no further access to the task's memory can happen.
    pub fn finish(mut self, result: Result<u64, TaskError>) {
        self.done = true;
        self.batch.finish(self.task, result);
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.done {
            self.batch.finish(self.task, Err(TaskError::Dropped));
        }
    }
}

/// One task handed to a transport.
#[derive(Debug)]
pub struct TransportWork {
    /// READ or WRITE.
    pub opcode: TcpOpcode,
    /// Hold on the local region (keeps it registered until dropped).
    pub local: RegionGuard,
    /// Local address (inside `local`).
    pub local_addr: u64,
    /// Target segment.
    pub remote: Arc<RemoteSegment>,
    /// Remote address.
    pub remote_addr: u64,
    /// Length in bytes (> 0).
    pub len: u64,
    /// Where to report the outcome. Report only after the last access to local
    /// memory; drop `local` and `remote` before reporting (after the last
    /// access) so callers can unregister or close as soon as they see it.
    pub completion: Completion,
}

/// A data transport: runs tasks and reports their outcome.
pub trait DataTransport: Send + Sync + std::fmt::Debug {
    /// Protocol name advertised in the descriptor (`"tcp"`).
    fn protocol(&self) -> &'static str;
    /// Queues a task. Must eventually call `work.completion.finish` (or drop it).
    fn submit(&self, work: TransportWork);
    /// Forgets pooled connections to a segment (after close or peer failure).
    fn forget_segment(&self, _segment: u64) {}
}

/// Options of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpTransportConfig {
    /// Worker threads; each keeps its own connection per segment, so this is
    /// also the size of the connection pool per segment.
    pub workers: usize,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Socket read/write timeout mid-request. On expiry the connection is
    /// closed and the task FAILS (our side can then no longer touch its memory).
    pub io_timeout: Duration,
    /// Open a connection per request, like Mooncake's default (slower).
    pub connection_per_request: bool,
    /// A pooled connection idle this long is closed rather than reused:
    /// below the target's idle deadline (its `ConnLimits::idle_timeout`,
    /// 120 s by default), so a request never goes out on a connection the
    /// target is about to close.
    pub max_idle: Duration,
}

impl Default for TcpTransportConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            connection_per_request: false,
            max_idle: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<TransportWork>,
    closed: bool,
    forget: Vec<u64>,
}

/// Mooncake TCP transport (v2 framing to v2 peers, v1 to v1 peers) over a
/// pool of worker threads with persistent connections.
#[derive(Debug)]
pub struct TcpTransport {
    shared: Arc<(Mutex<Queue>, Condvar)>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl TcpTransport {
    /// Starts the workers.
    pub fn new(cfg: TcpTransportConfig) -> std::io::Result<Self> {
        let shared: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let mut threads = Vec::new();
        for i in 0..cfg.workers.max(1) {
            let sh = shared.clone();
            let cfg = cfg.clone();
            threads.push(std::thread::Builder::new().name(format!("mc-tcp-{i}")).spawn(move || worker(sh, cfg))?);
        }
        Ok(Self { shared, threads: Mutex::new(threads) })
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        {
            let mut q = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
            q.closed = true;
        }
        self.shared.1.notify_all();
        for t in self.threads.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = t.join();
        }
    }
}

impl DataTransport for TcpTransport {
    fn protocol(&self) -> &'static str {
        "tcp"
    }

    fn submit(&self, work: TransportWork) {
        let mut q = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            drop(q);
            work.completion.finish(Err(TaskError::Dropped));
            return;
        }
        q.items.push_back(work);
        drop(q);
        self.shared.1.notify_one();
    }

    fn forget_segment(&self, segment: u64) {
        let mut q = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        q.forget.push(segment);
    }
}

fn worker(sh: Arc<(Mutex<Queue>, Condvar)>, cfg: TcpTransportConfig) {
    let mut conns: HashMap<u64, (TcpStream, Instant)> = HashMap::default();
    let mut seen_forget = 0usize;
    loop {
        let work = {
            let mut q = sh.0.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if q.forget.len() > seen_forget {
                    for id in &q.forget[seen_forget..] {
                        conns.remove(id);
                    }
                    seen_forget = q.forget.len();
                }
                if let Some(w) = q.items.pop_front() {
                    break Some(w);
                }
                if q.closed {
                    break None;
                }
                q = sh.1.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(work) = work else { return };
        work.completion.started();
        let seg = work.remote.id;
        let pooled = conns.remove(&seg).filter(|(s, since)| since.elapsed() < cfg.max_idle && still_open(s));
        let stream = match pooled {
            Some((s, _)) => s,
            None => match connect(&work.remote.data_addr, &cfg) {
                Ok(s) => s,
                Err(e) => {
                    let TransportWork { completion, local, remote, .. } = work;
                    drop((local, remote));
                    completion.finish(Err(TaskError::Connect(e.to_string())));
                    continue;
                }
            },
        };
        let mut stream = stream;
        let result = run_one(&mut stream, &work);
        // No more access to local memory: release the holds before reporting,
        // so a caller that sees the terminal status can unregister at once.
        let TransportWork { completion, local, remote, .. } = work;
        drop((local, remote));
        match result {
            Ok(n) => {
                if !cfg.connection_per_request {
                    conns.insert(seg, (stream, Instant::now()));
                }
                completion.finish(Ok(n));
            }
            Err(e) => {
                // Fence the connection before reporting: after shutdown no more
                // bytes of this request leave or enter this process's memory.
                let _ = stream.shutdown(Shutdown::Both);
                drop(stream);
                tracing::debug!(segment = seg, error = %e, "tcp task failed");
                completion.finish(Err(e));
            }
        }
    }
}

/// Whether the peer has not closed a pooled connection (nothing to read,
/// no EOF): a target closes idle connections, and a request sent on a
/// closed one would fail after its bytes may have left.
fn still_open(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let open = matches!(s.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).is_ok() && open
}

fn connect(addr: &SocketAddr, cfg: &TcpTransportConfig) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(addr, cfg.connect_timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(cfg.io_timeout))?;
    s.set_write_timeout(Some(cfg.io_timeout))?;
    Ok(s)
}

fn conn_err(e: std::io::Error) -> TaskError {
    TaskError::Connection(e.to_string())
}

fn read_status(s: &mut TcpStream) -> Result<(), TaskError> {
    let mut b = [0u8; STATUS_LEN];
    s.read_exact(&mut b).map_err(conn_err)?;
    match StatusWord::decode(&b) {
        Ok(StatusWord::Ok) => Ok(()),
        Ok(StatusWord::AddrRejected) => Err(TaskError::AddrRejected),
        Err(e) => Err(TaskError::BadStatus(e)),
    }
}

/// Runs one request on `s`; on `Err` the caller must close the connection.
fn run_one(s: &mut TcpStream, w: &TransportWork) -> Result<u64, TaskError> {
    let v2 = w.remote.proto == ProtoVersion::V2;
    let hdr = RequestHeader { size: w.len, addr: w.remote_addr, opcode: w.opcode, v2 }.encode();
    match w.opcode {
        TcpOpcode::Write => {
            // SAFETY: inside the region held by `w.local`; we only read it.
            unsafe { w.local.with_bytes(w.local_addr, w.len, |payload| write_all_vectored(s, &hdr, payload)) }
                .ok_or(TaskError::Dropped)?
                .map_err(conn_err)?;
            if v2 {
                read_status(s)?;
            }
        }
        TcpOpcode::Read => {
            s.write_all(&hdr).map_err(conn_err)?;
            if v2 {
                read_status(s)?;
            }
            // SAFETY: inside the region held by `w.local`; this worker is the
            // only engine writer of this task's destination.
            unsafe { w.local.fill(w.local_addr, w.len, |dst| s.read_exact(dst)) }
                .ok_or(TaskError::Dropped)?
                .map_err(conn_err)?;
        }
    }
    Ok(w.len)
}

/// Writes header and payload with as few syscalls as possible, no copy.
fn write_all_vectored(s: &mut TcpStream, hdr: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let mut off = 0usize; // bytes of hdr+payload written
    let total = hdr.len() + payload.len();
    while off < total {
        let n = if off < hdr.len() {
            s.write_vectored(&[IoSlice::new(&hdr[off..]), IoSlice::new(payload)])
        } else {
            s.write(&payload[off - hdr.len()..])
        };
        match n {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
