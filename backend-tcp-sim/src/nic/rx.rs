//! A connection's receiver thread: decodes frames and dispatches them. As
//! the target it applies WRITEs and serves READs (after the checks in
//! `registration`) and delivers application messages; as the initiator it
//! takes completions and read responses to their work requests and hands
//! an operation its terminal status once every work request is terminal.
//! Settlement frames (NOTIFY, ABORT, ABORT_ACK) go to `control`.

use super::conn::{ring_before_read, ring_deferred, Conn, Dest, OpDone, OpEntry, Outgoing, DOORBELLS};
use super::{lock, InboundEvent, MessageHook, NicInner};
use crate::stats::{add, inc};
use crate::wire::{self, AccessHeader, Body, DecodeError, WireStatus, PREFIX_LEN};
use bytes::Bytes;
use kv_transfer_core::drain::OpEnd;
use kv_transfer_core::{PeerId, TransferError};
use std::io::{self, BufReader, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The key a READ's own digests are taken under. They guard bytes that came
/// off the wire against a write landing in the local slot afterwards: the
/// tag is over the received bytes and stays in this process, so what makes
/// a forgery fail is BLAKE3's second-preimage resistance, not the key's
/// secrecy (a crc32c could be fixed up with four bytes).
const READ_DIGEST_KEY: kv_transfer_core::drain::ExposureToken = kv_transfer_core::drain::ExposureToken::ZERO;

impl NicInner {
    pub(super) fn rx_loop(self: Arc<Self>, conn: Arc<Conn>, stream: TcpStream) {
        DOORBELLS.with(|d| *d.borrow_mut() = Some(Vec::new()));
        let mut r = BufReader::with_capacity(8 << 10, stream);
        let mut fields = Vec::with_capacity(wire::READ_FIELDS);
        // User code runs on this thread (message hooks, raw completion
        // callbacks): a panic there must not leave a zombie connection, so
        // the exit path below runs on unwind too (the connection is marked
        // dead and fenced; its operations end with an error).
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), RxExit> {
            loop {
                if r.buffer().is_empty() {
                    // About to block on the socket: wake the senders owed.
                    ring_deferred();
                }
                let mut pre = [0u8; PREFIX_LEN];
                r.read_exact(&mut pre)?;
                let p = wire::decode_prefix(&pre)?;
                fields.resize(p.fields_len(), 0);
                r.read_exact(&mut fields)?;
                let body = wire::decode_fields(&p, &fields)?;
                match body {
                    Body::Write(h) => {
                        self.on_write(&conn, &mut r, h)?;
                    }
                    Body::WriteImm(h, imm) => {
                        // The immediate reaches the application only once the data landed.
                        if self.on_write(&conn, &mut r, h)? {
                            inc(&self.counters.messages_received);
                            let hook = self.message_hook.read().unwrap_or_else(|p| p.into_inner()).clone();
                            self.deliver_message(&conn, hook.as_ref(), imm.as_bytes());
                        }
                    }
                    Body::Read(h) => self.on_read(&conn, h),
                    Body::ReadResp { wr_id, status } => {
                        self.on_read_resp(&conn, &mut r, wr_id, status, p.payload_len())?
                    }
                    Body::Completion { wr_id, status } => {
                        let res = match status {
                            WireStatus::Ok => Ok(None),
                            s => Err(status_error(s)),
                        };
                        self.on_completion(&conn, wr_id, res);
                    }
                    Body::Control(m) => self.on_control(&conn, m),
                    Body::Message => self.on_message(&conn, &mut r, p.payload_len(), &mut fields)?,
                    Body::Hello { .. } => {}
                }
            }
        }))
        .unwrap_or_else(|panic| {
            // The positive control (`Naive`) lets the panic end the thread
            // without the exit path, as before issue 15: a zombie connection.
            if self.cfg.policy.is_naive() {
                std::panic::resume_unwind(panic);
            }
            Err(RxExit::Panicked)
        });
        match res {
            Err(RxExit::Panicked) => {
                inc(&self.counters.hook_panics);
                tracing::error!(
                    peer = conn.peer.0,
                    "a hook or callback panicked on the receiving thread: fencing the connection"
                );
            }
            Err(RxExit::Decode(e)) => {
                inc(&self.counters.malformed_frames);
                tracing::debug!(peer = conn.peer.0, error = %e, "malformed frame: tearing the connection down");
                *lock(&self.last_decode_error) = Some(e);
            }
            Err(RxExit::Io(e)) => tracing::trace!(peer = conn.peer.0, error = %e, "connection closed"),
            Err(RxExit::Closed) | Ok(()) => {}
        }
        ring_deferred();
        DOORBELLS.with(|d| *d.borrow_mut() = None);
        conn.dead.store(true, Ordering::SeqCst);
        let _ = conn.stream.shutdown(Shutdown::Both);
        self.signal.dead(conn.peer);
    }

    fn on_message(
        &self,
        conn: &Conn,
        r: &mut BufReader<TcpStream>,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), RxExit> {
        ring_before_read(r, len);
        buf.resize(len, 0);
        r.read_exact(buf)?;
        let msgs = wire::split_messages(buf)?;
        add(&self.counters.messages_received, msgs.len() as u64);
        let hook = self.message_hook.read().unwrap_or_else(|p| p.into_inner()).clone();
        for m in msgs {
            self.deliver_message(conn, hook.as_ref(), m);
        }
        Ok(())
    }

    /// One application message (a record, or a WRITE's immediate) to the
    /// hook, or to the event queue without one.
    fn deliver_message(&self, conn: &Conn, hook: Option<&MessageHook>, m: &[u8]) {
        match hook {
            Some(h) => h(conn.peer, &conn.name, m),
            None => self.event(InboundEvent::Message { peer: conn.peer, bytes: Bytes::copy_from_slice(m) }),
        }
    }

    fn completion(conn: &Conn, wr_id: u64, status: WireStatus) {
        conn.send_frame(&Body::Completion { wr_id, status });
    }

    /// Applies (or refuses) a WRITE and answers it; returns whether its
    /// bytes landed.
    fn on_write(&self, conn: &Conn, r: &mut BufReader<TcpStream>, h: AccessHeader) -> Result<bool, RxExit> {
        let len = h.len as usize;
        // The payload read may block (and so may a gate or a slow target).
        ring_before_read(r, len);
        // With a gate, the WRITE has arrived at the NIC (payload buffered) and
        // waits there, before any check, until the test opens the gate. While
        // it waits, the NIC still notices the peer going away.
        let mut held = None;
        if let Some(g) = &self.cfg.faults.gate {
            let mut buf = vec![0u8; len];
            r.read_exact(&mut buf)?;
            let sock = r.get_ref();
            let gone = || conn.dead.load(Ordering::SeqCst) || self.shutdown.load(Ordering::SeqCst) || peer_gone(sock);
            if !g.pass(gone) {
                return Err(RxExit::Closed);
            }
            held = Some(buf);
        }
        match self.check_access(conn, &h) {
            Err(reason) => {
                if held.is_none() {
                    io::copy(&mut r.by_ref().take(len as u64), &mut io::sink())?;
                }
                tracing::debug!(peer = conn.peer.0, ?reason, slot = h.slot.0, gen = h.generation.0, "write rejected");
                Self::completion(conn, h.wr_id, WireStatus::Rejected(reason));
                Ok(false)
            }
            Ok((reg, off)) => {
                let res = match &held {
                    Some(b) => reg.fill_from(&mut b.as_slice(), off, len),
                    None => reg.fill_from(r, off, len),
                };
                // A slow target is slow *while applying*: the access stays in
                // flight, so a revocation has to wait for it.
                if let Some(rate) = self.cfg.faults.slow_target_bytes_per_sec.filter(|r| *r > 0) {
                    std::thread::sleep(Duration::from_secs_f64(len as f64 / rate as f64));
                }
                self.end_access(&reg, h.slot);
                let applied = res?;
                if applied {
                    inc(&self.counters.writes_applied);
                    add(&self.counters.bytes_applied, len as u64);
                }
                Self::completion(conn, h.wr_id, if applied { WireStatus::Ok } else { WireStatus::TargetError });
                Ok(applied)
            }
        }
    }

    fn on_read(&self, conn: &Conn, h: AccessHeader) {
        let head = |status: WireStatus, n: usize| wire::encode_head(&Body::ReadResp { wr_id: h.wr_id, status }, n);
        let (status, payload) = match self.check_access(conn, &h) {
            Err(reason) => (WireStatus::Rejected(reason), Bytes::new()),
            Ok((reg, off)) => {
                let mut v = vec![0u8; h.len as usize];
                let ok = reg.region.read(off, &mut v).is_ok();
                self.end_access(&reg, h.slot);
                if ok {
                    inc(&self.counters.reads_served);
                    add(&self.counters.bytes_read, v.len() as u64);
                    (WireStatus::Ok, Bytes::from(v))
                } else {
                    (WireStatus::TargetError, Bytes::new())
                }
            }
        };
        match head(status, payload.len()) {
            Ok(head) => conn.send(Outgoing::Data { head, payload }),
            Err(e) => tracing::warn!(error = %e, "cannot encode read response"),
        }
    }

    fn on_read_resp(
        &self,
        conn: &Conn,
        r: &mut BufReader<TcpStream>,
        wr_id: u64,
        status: WireStatus,
        payload_len: usize,
    ) -> Result<(), RxExit> {
        ring_before_read(r, payload_len);
        let dest = lock(&conn.st).wrs.get(&wr_id).and_then(|w| w.dest.clone());
        let res = match (status, dest) {
            (WireStatus::Ok, Some(Dest::Local { reg, off, len })) if len == payload_len => {
                let digest = {
                    let st = lock(&conn.st);
                    st.wrs.get(&wr_id).and_then(|w| st.ops.get(&w.op)).is_some_and(|o| o.digest_local)
                };
                let placed = if digest {
                    // Digest the bytes as they arrived, then place them.
                    let mut v = vec![0u8; len];
                    r.read_exact(&mut v)?;
                    let crc = kv_transfer_core::drain::digest(&READ_DIGEST_KEY, &v);
                    let placed = reg.fill_from(&mut v.as_slice(), off, len)?;
                    let mut st = lock(&conn.st);
                    let op = st.wrs.get(&wr_id).map(|w| w.op);
                    if let Some(o) = op.and_then(|op| st.ops.get_mut(&op)) {
                        o.read_digests.push((off, crc));
                    }
                    placed
                } else {
                    reg.fill_from(r, off, len)?
                };
                if placed {
                    Ok(None)
                } else {
                    Err(TransferError::Engine { engine: "tcp-sim", code: 2, message: "local region refused".into() })
                }
            }
            (WireStatus::Ok, Some(Dest::Buf(len))) if len == payload_len => {
                let mut v = vec![0u8; len];
                r.read_exact(&mut v)?;
                Ok(Some(Bytes::from(v)))
            }
            (s, _) => {
                io::copy(&mut r.by_ref().take(payload_len as u64), &mut io::sink())?;
                Err(match s {
                    WireStatus::Ok => TransferError::Transport("read response of unexpected length".into()),
                    s => status_error(s),
                })
            }
        };
        self.wr_terminal(conn, wr_id, res);
        Ok(())
    }

    /// A WRITE's completion from the target. One that arrives before the
    /// WR's bytes all left (a hostile target answering early, or the sender
    /// not yet back from its write) is parked: the sender delivers it once
    /// the WR is on the wire, so a source slot never settles while our NIC
    /// still reads it.
    fn on_completion(&self, conn: &Conn, wr_id: u64, res: Result<Option<Bytes>, TransferError>) {
        {
            let mut st = lock(&conn.st);
            if let Some(w) = st.wrs.get_mut(&wr_id) {
                // The positive control (`Naive`) takes the target's word at
                // once, as before issue 15.
                if !w.on_wire && !self.cfg.policy.is_naive() {
                    inc(&self.counters.early_completions);
                    w.early = Some(res);
                    return;
                }
            }
        }
        self.wr_terminal(conn, wr_id, res);
    }

    /// A WR reached its terminal status.
    pub(super) fn wr_terminal(&self, conn: &Conn, wr_id: u64, res: Result<Option<Bytes>, TransferError>) {
        let mut st = lock(&conn.st);
        let Some(wr) = st.wrs.remove(&wr_id) else {
            tracing::debug!(peer = conn.peer.0, wr_id, "completion for an unknown work request dropped");
            return;
        };
        match &res {
            Ok(_) => inc(&self.counters.wrs_ok),
            Err(_) => inc(&self.counters.wrs_failed),
        }
        let mut finished = None;
        if let Some(op) = st.ops.get_mut(&wr.op) {
            op.remaining = op.remaining.saturating_sub(1);
            match res {
                Ok(Some(b)) => op.data = Some(b),
                Ok(None) => {}
                Err(e) => {
                    op.err.get_or_insert(e);
                }
            }
            if op.remaining == 0 {
                finished = st.ops.remove(&wr.op);
            }
        }
        // Every WR of the op is terminal at the target (it answers only after
        // applying or refusing), so its end is proven either way.
        let acks = if finished.is_some() { st.aborts.finished(wr.op, OpEnd::Proven) } else { Vec::new() };
        let done = match &mut finished {
            Some(op) if op.err.is_none() => op.notify.take(),
            _ => None,
        };
        if let Some(n) = &done {
            // Handed back: no later post of ours may name these tenancies.
            st.aborts.tombstone(&(), n.msg.pool, n.msg.token, &n.msg.tenancies);
        }
        drop(st);
        for a in acks {
            inc(&self.counters.abort_acks_sent);
            self.send_control(conn, a.msg);
        }
        if let Some(mut op) = finished {
            let result = match op.err.take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            if let Some(mut n) = done {
                if n.digests {
                    n.msg.digests = Self::digests_of(&op, &n.msg.token);
                }
                inc(&self.counters.notifications_sent);
                self.send_control(conn, n.msg);
            }
            self.finish_op(conn.peer, op, result, false);
        }
    }

    /// The digests of a lease operation's local slots, in lease order
    /// (core's; the slots are still exposed to this operation, so nothing
    /// changed them since they were sent).
    fn digests_of(
        op: &OpEntry,
        token: &kv_transfer_core::drain::ExposureToken,
    ) -> Vec<kv_transfer_core::drain::Digest> {
        match &op.done {
            OpDone::Lease(c) => kv_transfer_core::drain::lease_digests(c.lease(), token).unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// Hands an operation its terminal status. `fenced`: the connection is
    /// torn down and joined, so the proof is `Fenced`; otherwise every WR
    /// reached a terminal status and the proof is `Completed`.
    pub(super) fn finish_op(&self, peer: PeerId, op: OpEntry, result: Result<(), TransferError>, fenced: bool) {
        match op.done {
            OpDone::Lease(c) => {
                let Some(reg) = op.reg else { return };
                let res = if fenced {
                    c.complete(reg.authority.fenced(peer), result)
                } else if op.digest_local && result.is_ok() {
                    let ts = c.lease().tenancies();
                    let pairs: Vec<_> = ts
                        .iter()
                        .filter_map(|t| {
                            let off = t.slot.0 as usize * reg.slot_size;
                            op.read_digests.iter().find(|(o, _)| *o == off).map(|(_, d)| (*t, *d))
                        })
                        .collect();
                    let proof = reg.authority.completed_with_digests(ts, &pairs, READ_DIGEST_KEY);
                    c.complete(proof, result)
                } else {
                    let proof = reg.authority.completed_lease(c.lease());
                    c.complete(proof, result)
                };
                if let Err(e) = res {
                    tracing::warn!(error = %e, "operation's proof did not settle its lease");
                }
            }
            OpDone::Raw(done) => done(result.map(|()| op.data)),
            OpDone::Queue(cq, token) => cq.complete(token, result.map(|()| op.data)),
        }
    }
}

fn status_error(s: WireStatus) -> TransferError {
    match s {
        WireStatus::Rejected(r) => TransferError::Rejected(r),
        WireStatus::TargetError => {
            TransferError::Engine { engine: "tcp-sim", code: 2, message: "target could not access its memory".into() }
        }
        WireStatus::Ok => TransferError::Transport("unexpected status".into()),
    }
}

enum RxExit {
    Io(io::Error),
    Decode(DecodeError),
    Closed,
    /// User code (a hook, a callback) panicked on this thread.
    Panicked,
}

impl From<io::Error> for RxExit {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<DecodeError> for RxExit {
    fn from(e: DecodeError) -> Self {
        Self::Decode(e)
    }
}

/// Whether the peer closed or reset the socket, even with unread data
/// still queued (the kernel's TCP state says so without consuming anything).
fn peer_gone(s: &TcpStream) -> bool {
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    // SAFETY: `tcp_info` is plain data; zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket owned by `s`; `info` and `len` are live
    // and `len` holds the buffer's size.
    let rc = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    if rc != 0 {
        return true;
    }
    // Anything but ESTABLISHED: the peer sent FIN (CLOSE_WAIT), reset, or we closed.
    info.tcpi_state != 1
}
