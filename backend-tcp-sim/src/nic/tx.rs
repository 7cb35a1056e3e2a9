//! A connection's sender thread: takes batches from the send queue, drops
//! the work requests that were canceled or aborted before they left,
//! applies the fault plan's delays and connection drop, and writes the
//! rest with vectored writes straight from registered memory.

use super::conn::{Conn, Outgoing, Src};
use super::registration::SrcBytes;
use super::{lock, FaultRecord, NicInner};
use crate::stats::inc;
use kv_transfer_core::TransferError;
use std::io::{self, IoSlice, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Items the sender takes from its queue at once (≤ 2 iovecs each).
const MAX_BATCH: usize = 256;

impl NicInner {
    pub(super) fn tx_loop(self: Arc<Self>, conn: Arc<Conn>, mut stream: TcpStream) {
        let faults = &self.cfg.faults;
        let delays = faults.has_delays();
        let mut budget = faults.drop_connection.filter(|d| d.conn_index == conn.index).map(|d| d.after_bytes);
        let mut seq = 0u64;
        let mut batch: Vec<Outgoing> = Vec::with_capacity(MAX_BATCH);
        let mut sent_ids: Vec<u64> = Vec::with_capacity(MAX_BATCH);
        'outer: loop {
            {
                let mut q = lock(&conn.tx.q);
                while q.q.is_empty() && !q.closed {
                    q.waiting = true;
                    q = match conn.tx.cv.wait(q) {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                    q.waiting = false;
                }
                if q.closed {
                    break;
                }
                let n = q.q.len().min(MAX_BATCH);
                batch.extend(q.q.drain(..n));
            }
            // Decide which WRs go: a canceled op that sent nothing yet, or a WR
            // the target asked to abort before it left, completes as canceled.
            let mut canceled = Vec::new();
            {
                let mut st = lock(&conn.st);
                let st = &mut *st;
                batch.retain(|item| {
                    let Outgoing::Wr { wr_id, op, .. } = item else { return true };
                    let aborted = st.wrs.get(wr_id).is_some_and(|w| w.aborted);
                    let Some(o) = st.ops.get_mut(op) else { return false };
                    if aborted || (!o.sent_any && o.cancel_requested()) {
                        canceled.push((*wr_id, aborted));
                        return false;
                    }
                    o.sent_any = true;
                    if let Some(w) = st.wrs.get_mut(wr_id) {
                        w.sent = true;
                    }
                    sent_ids.push(*wr_id);
                    true
                });
            }
            // Build the gather list; flush before every faulted delay.
            let mut sources: Vec<Result<SrcBytes<'_>, TransferError>> = Vec::new();
            for item in &batch {
                if let Outgoing::Wr { src: Some(Src::Local { reg, off, len }), .. } = item {
                    sources.push(reg.source(*off, *len));
                }
            }
            let mut failed_src = Vec::new();
            let mut slices: Vec<&[u8]> = Vec::with_capacity(batch.len() * 2);
            let mut src_i = 0;
            for item in &batch {
                match item {
                    Outgoing::Frame(f) => slices.push(f),
                    Outgoing::Data { head, payload } => {
                        slices.push(head);
                        slices.push(payload);
                    }
                    Outgoing::Messages { head, records } => {
                        slices.push(head);
                        slices.push(records);
                    }
                    Outgoing::Wr { wr_id, head, src, .. } => {
                        let body: Option<&[u8]> = match src {
                            None => None,
                            Some(Src::Owned(b)) => Some(b),
                            Some(Src::Local { .. }) => {
                                let s = &sources[src_i];
                                src_i += 1;
                                match s {
                                    Ok(s) => Some(s.as_slice()),
                                    Err(e) => {
                                        failed_src.push((*wr_id, e.clone()));
                                        continue;
                                    }
                                }
                            }
                        };
                        if delays {
                            let d = faults.wr_delay(conn.index, seq);
                            {
                                let mut log = lock(&self.fault_log);
                                if log.len() < self.cfg.fault_log_limit {
                                    log.push(FaultRecord { conn: conn.index, seq, delay_us: d.as_micros() as u64 });
                                }
                            }
                            if !d.is_zero() {
                                if let Err(()) = self.flush(&conn, &mut stream, &mut slices, &mut budget) {
                                    break 'outer;
                                }
                                std::thread::sleep(d);
                            }
                        }
                        seq += 1;
                        slices.push(head);
                        if let Some(b) = body {
                            slices.push(b);
                        }
                    }
                }
            }
            if let Err(()) = self.flush(&conn, &mut stream, &mut slices, &mut budget) {
                break;
            }
            drop(slices);
            drop(sources);
            batch.clear();
            // Every byte of this batch is in the socket now: the NIC is done
            // reading its sources, so their completions may settle them.
            let mut early = Vec::new();
            {
                let mut st = lock(&conn.st);
                for id in sent_ids.drain(..) {
                    if let Some(w) = st.wrs.get_mut(&id) {
                        w.on_wire = true;
                        if let Some(res) = w.early.take() {
                            early.push((id, res));
                        }
                    }
                }
            }
            for (wr_id, res) in early {
                self.wr_terminal(&conn, wr_id, res);
            }
            for (wr_id, aborted) in canceled {
                let e = if aborted {
                    TransferError::Engine { engine: "tcp-sim", code: 1, message: "aborted by the target".into() }
                } else {
                    TransferError::Canceled
                };
                inc(&self.counters.wrs_canceled);
                self.wr_terminal(&conn, wr_id, Err(e));
            }
            for (wr_id, e) in failed_src {
                self.wr_terminal(&conn, wr_id, Err(e));
            }
        }
        conn.dead.store(true, Ordering::SeqCst);
        self.signal.dead(conn.peer);
    }

    /// Writes the gathered slices (and clears them). On a socket error, or
    /// when the drop-connection fault's budget runs out, shuts the socket
    /// down and returns `Err`.
    fn flush(
        &self,
        conn: &Conn,
        stream: &mut TcpStream,
        slices: &mut Vec<&[u8]>,
        budget: &mut Option<u64>,
    ) -> Result<(), ()> {
        let total: u64 = slices.iter().map(|s| s.len() as u64).sum();
        let mut limit = total;
        let mut cut = false;
        if let Some(b) = budget {
            if total >= *b {
                limit = *b;
                cut = true;
            }
            *b -= limit;
        }
        let res = write_all_vectored(stream, slices, limit);
        slices.clear();
        if res.is_err() || cut {
            if cut {
                tracing::debug!(peer = conn.peer.0, "fault: dropping connection mid-stream");
            }
            let _ = stream.shutdown(Shutdown::Both);
            return Err(());
        }
        Ok(())
    }
}

/// Writes the first `limit` bytes of `bufs` with vectored writes.
fn write_all_vectored(stream: &mut TcpStream, bufs: &[&[u8]], limit: u64) -> io::Result<()> {
    let (mut idx, mut pos) = (0usize, 0usize);
    let mut left = limit;
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(bufs.len().min(1024));
    while left > 0 && idx < bufs.len() {
        iov.clear();
        let mut room = left;
        let mut i = idx;
        let mut p = pos;
        while i < bufs.len() && iov.len() < 1024 && room > 0 {
            let s = &bufs[i][p..];
            let take = (s.len() as u64).min(room) as usize;
            if take > 0 {
                iov.push(IoSlice::new(&s[..take]));
            }
            room -= take as u64;
            i += 1;
            p = 0;
        }
        if iov.is_empty() {
            break;
        }
        let n = match stream.write_vectored(&iov) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        left -= n as u64;
        let mut n = n;
        while n > 0 && idx < bufs.len() {
            let rem = bufs[idx].len() - pos;
            if n >= rem {
                n -= rem;
                idx += 1;
                pos = 0;
            } else {
                pos += n;
                n = 0;
            }
        }
        while idx < bufs.len() && bufs[idx].len() == pos {
            idx += 1;
            pos = 0;
        }
    }
    Ok(())
}
