//! Completion queues and RC queue pairs: the state machine, posting work
//! requests, and completions matched back to the work request that posted
//! them.
//!
//! Every work request is signaled, and the memory it names is held (an
//! `Arc` of its region) by the completion queue until its completion is
//! polled, successful or flushed: a region is never deregistered while the
//! NIC may still read or write it through a posted request.

use kv_transfer_core::hash::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::error::VerbsError;
use crate::memory::{MemoryRegion, MemoryWindow, ProtectionDomain, WindowState};
use crate::work::{Completion, Endpoint, QpState, WcKind, WcStatus};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A device's `ibv_wc_status` as a [`WcStatus`].
fn status_from_raw(s: u32) -> WcStatus {
    use ffi::ibv_wc_status as S;
    match s {
        S::IBV_WC_SUCCESS => WcStatus::Success,
        S::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        S::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        S::IBV_WC_MW_BIND_ERR | S::IBV_WC_LOC_PROT_ERR => WcStatus::MemoryManagement(s),
        other => WcStatus::Other(other),
    }
}

/// A completion queue. It holds the memory of every request posted to the
/// queue pairs that complete here until that request's completion is polled.
#[derive(Debug)]
pub struct CompletionQueue {
    cq: NonNull<ffi::ibv_cq>,
    /// `(qp_num, wr_id)` → the memory the request names.
    in_flight: Mutex<HashMap<(u32, u64), Arc<MemoryRegion>>>,
    /// Completions [`CompletionQueue::wait_for`] polled for others: handed
    /// out first by the next poll, in order.
    parked: Mutex<std::collections::VecDeque<Completion>>,
    depth: u32,
    ctx: Arc<crate::device::Context>,
}

// SAFETY: see `Context`; `ibv_poll_cq` on one CQ from several threads is
// serialised by the provider.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A completion queue of `depth` entries on `pd`'s device.
    pub fn new(pd: &ProtectionDomain, depth: u32) -> Result<Arc<Self>, VerbsError> {
        let depth_i = i32::try_from(depth).map_err(|_| VerbsError::invalid("ibv_create_cq", "depth too large"))?;
        // SAFETY: `ctx` is open; no completion channel, vector 0.
        let cq =
            unsafe { ffi::ibv_create_cq(pd.ctx.ctx.as_ptr(), depth_i, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        let cq = NonNull::new(cq).ok_or_else(|| VerbsError::os("ibv_create_cq", 0))?;
        Ok(Arc::new(Self {
            cq,
            in_flight: Mutex::new(HashMap::default()),
            parked: Mutex::default(),
            depth,
            ctx: Arc::clone(&pd.ctx),
        }))
    }

    /// Entries it holds.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Requests posted to it and not yet completed.
    pub fn in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    fn hold(&self, qp_num: u32, wr_id: u64, mr: Option<&Arc<MemoryRegion>>) -> Result<(), VerbsError> {
        let mut m = lock(&self.in_flight);
        if m.contains_key(&(qp_num, wr_id)) {
            return Err(VerbsError::invalid("post", format!("wr_id {wr_id} is already in flight on QP {qp_num}")));
        }
        if let Some(mr) = mr {
            m.insert((qp_num, wr_id), Arc::clone(mr));
        }
        Ok(())
    }

    fn unhold(&self, qp_num: u32, wr_id: u64) {
        lock(&self.in_flight).remove(&(qp_num, wr_id));
    }

    /// Up to `max` completions (none waiting: empty): those parked by
    /// [`CompletionQueue::wait_for`] first, then the device's.
    pub fn poll(&self, max: usize) -> Result<Vec<Completion>, VerbsError> {
        let mut out: Vec<Completion> = {
            let mut parked = lock(&self.parked);
            let n = parked.len().min(max);
            parked.drain(..n).collect()
        };
        if out.len() < max {
            out.extend(self.poll_device(max - out.len())?);
        }
        Ok(out)
    }

    fn poll_device(&self, max: usize) -> Result<Vec<Completion>, VerbsError> {
        let mut wcs: Vec<ffi::ibv_wc> = Vec::with_capacity(max.clamp(1, 64));
        // SAFETY: plain C struct, zero is a valid value.
        wcs.resize_with(max.clamp(1, 64), || unsafe { std::mem::zeroed() });
        // SAFETY: `poll_cq` is the provider's entry for the inline
        // `ibv_poll_cq`; `wcs` has room for `len` entries.
        let n = unsafe {
            let ctx = self.ctx.ctx.as_ptr();
            let Some(poll) = (*ctx).ops.poll_cq else {
                return Err(VerbsError::invalid("ibv_poll_cq", "the provider has no poll_cq"));
            };
            poll(self.cq.as_ptr(), wcs.len() as i32, wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(VerbsError::os("ibv_poll_cq", -n));
        }
        let mut out = Vec::with_capacity(n as usize);
        for wc in wcs.iter().take(n as usize) {
            let status = status_from_raw(wc.error().map_or(ffi::ibv_wc_status::IBV_WC_SUCCESS, |(s, _)| s));
            let kind = if status.is_success() {
                use ffi::ibv_wc_opcode as O;
                match wc.opcode() {
                    O::IBV_WC_RDMA_WRITE => WcKind::Write,
                    O::IBV_WC_RDMA_READ => WcKind::Read,
                    O::IBV_WC_SEND => WcKind::Send,
                    O::IBV_WC_RECV => WcKind::Recv,
                    O::IBV_WC_BIND_MW => WcKind::Bind,
                    O::IBV_WC_LOCAL_INV => WcKind::LocalInv,
                    _ => WcKind::Unknown,
                }
            } else {
                WcKind::Unknown
            };
            self.unhold(wc.qp_num, wc.wr_id());
            out.push(Completion {
                wr_id: wc.wr_id(),
                qp_num: wc.qp_num,
                status,
                kind,
                byte_len: u32::try_from(wc.len()).unwrap_or(u32::MAX),
            });
        }
        Ok(out)
    }

    /// Waits for the completion of `wr_id` on `qp_num` (`None`: not within
    /// `timeout`). Completions of other requests polled meanwhile are
    /// parked for the next [`CompletionQueue::poll`], in order. Bounded:
    /// sleeps 50 µs between empty polls.
    pub fn wait_for(&self, qp_num: u32, wr_id: u64, timeout: Duration) -> Result<Option<Completion>, VerbsError> {
        let deadline = Instant::now() + timeout;
        {
            let mut parked = lock(&self.parked);
            if let Some(i) = parked.iter().position(|c| c.qp_num == qp_num && c.wr_id == wr_id) {
                return Ok(parked.remove(i));
            }
        }
        loop {
            let mut found = None;
            let polled = self.poll_device(16)?;
            let mut parked = lock(&self.parked);
            for c in polled {
                if found.is_none() && c.qp_num == qp_num && c.wr_id == wr_id {
                    found = Some(c);
                } else {
                    parked.push_back(c);
                }
            }
            drop(parked);
            if found.is_some() || Instant::now() >= deadline {
                return Ok(found);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: created in `new`; every QP completing here holds an `Arc`
        // to it, so all are destroyed (nothing more can complete here).
        let ret = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_cq failed");
        }
    }
}

fn mtu_enum(mtu: u32) -> Option<ffi::ibv_mtu> {
    Some(match mtu {
        256 => ffi::IBV_MTU_256,
        512 => ffi::IBV_MTU_512,
        1024 => ffi::IBV_MTU_1024,
        2048 => ffi::IBV_MTU_2048,
        4096 => ffi::IBV_MTU_4096,
        _ => return None,
    })
}

/// An RC queue pair. Holds its protection domain and completion queues.
#[derive(Debug)]
pub struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    state: Mutex<QpState>,
    port: u8,
    gid_index: u8,
    psn: u32,
    cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: see `Context`; posting to one QP from several threads is
// serialised by the provider.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

/// Work requests a queue pair holds at once, each way.
pub const QP_DEPTH: u32 = 256;

impl QueuePair {
    /// An RC queue pair on `pd` completing to `cq`, using `port` and the GID
    /// at `gid_index` (RoCE v2), in [`QpState::Reset`].
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        port: u8,
        gid_index: u8,
    ) -> Result<Self, VerbsError> {
        Self::with_psn(pd, cq, port, gid_index, None)
    }

    /// As [`QueuePair::new`], with first packet sequence number `psn` (24
    /// bits) instead of one derived from the QP number: a peer whose
    /// connection message carries no PSN (Mooncake's) assumes 0.
    pub fn with_psn(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        port: u8,
        gid_index: u8,
        psn: Option<u32>,
    ) -> Result<Self, VerbsError> {
        // SAFETY: plain C struct, zero is a valid value.
        let mut ia: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        ia.send_cq = cq.cq.as_ptr();
        ia.recv_cq = cq.cq.as_ptr();
        ia.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        ia.sq_sig_all = 1;
        ia.cap.max_send_wr = QP_DEPTH;
        ia.cap.max_recv_wr = QP_DEPTH;
        ia.cap.max_send_sge = 1;
        ia.cap.max_recv_sge = 1;
        // SAFETY: `pd` and `cq` are live; `ia` is initialised.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd.as_ptr(), &mut ia) };
        let qp = NonNull::new(qp).ok_or_else(|| VerbsError::os("ibv_create_qp", 0))?;
        // A PSN from the OS's random source would do; the QPN's low bits
        // differ per QP, which is what RC needs.
        // SAFETY: created above.
        let psn = psn.unwrap_or_else(|| unsafe { qp.as_ref().qp_num }.wrapping_mul(2_654_435_761)) & 0x00ff_ffff;
        Ok(Self { qp, state: Mutex::new(QpState::Reset), port, gid_index, psn, cq: Arc::clone(cq), pd: Arc::clone(pd) })
    }

    /// Its number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: created until `Drop`.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// Its state, as this side moved it (an error the NIC caused shows as
    /// flushed completions first; [`QueuePair::to_error`] records it).
    pub fn state(&self) -> QpState {
        *lock(&self.state)
    }

    /// Its state as the NIC has it (`ibv_query_qp`): a QP the NIC moved to
    /// ERR (a rejected access, a broken link) shows here before any flushed
    /// completion is polled.
    pub fn query_state(&self) -> Result<QpState, VerbsError> {
        // SAFETY: plain C structs, zero is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is live; both are valid out-pointers.
        let ret = unsafe {
            ffi::ibv_query_qp(self.qp.as_ptr(), &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32, &mut init)
        };
        if ret != 0 {
            return Err(VerbsError::os("ibv_query_qp", ret));
        }
        use ffi::ibv_qp_state as S;
        Ok(match attr.qp_state {
            S::IBV_QPS_RESET => QpState::Reset,
            S::IBV_QPS_INIT => QpState::Init,
            S::IBV_QPS_RTR => QpState::ReadyToReceive,
            S::IBV_QPS_RTS => QpState::ReadyToSend,
            _ => QpState::Error,
        })
    }

    /// The completion queue it completes to.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    /// What the peer needs to connect to it.
    pub fn endpoint(&self, mtu: u32) -> Result<Endpoint, VerbsError> {
        let gid = self.pd.ctx.gid(self.port, self.gid_index)?;
        Ok(Endpoint { qpn: self.qp_num(), psn: self.psn, gid, mtu })
    }

    fn modify(
        &self,
        op: &'static str,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> Result<(), VerbsError> {
        // SAFETY: the QP is live; `attr` is initialised for `mask`.
        let ret = unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) };
        if ret != 0 {
            return Err(VerbsError::os(op, ret));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS towards `remote`.
    pub fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        use ffi::ibv_qp_attr_mask as M;
        let mut state = lock(&self.state);
        if *state != QpState::Reset {
            return Err(VerbsError::invalid("connect", format!("the QP is in {:?}, not Reset", *state)));
        }
        let mtu = mtu_enum(remote.mtu).ok_or_else(|| VerbsError::invalid("connect", "bad MTU"))?;
        // SAFETY: plain C struct, zero is a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = self.port;
        // Remote access through the QP; what may be reached is decided by
        // the window (or, for the positive control, the region's key).
        use ffi::ibv_access_flags as A;
        a.qp_access_flags = (A::IBV_ACCESS_LOCAL_WRITE | A::IBV_ACCESS_REMOTE_WRITE | A::IBV_ACCESS_REMOTE_READ).0;
        self.modify(
            "modify_qp INIT",
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
        )?;
        *state = QpState::Init;

        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.port_num = self.port;
        a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid.0 };
        a.ah_attr.grh.sgid_index = self.gid_index;
        a.ah_attr.grh.hop_limit = 1;
        self.modify(
            "modify_qp RTR",
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )?;
        *state = QpState::ReadyToReceive;

        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        // 6, not 7: rxe (like an RNR count) takes 7 as "retry forever", and a
        // dead peer must fail the request so that it can be fenced.
        a.retry_cnt = 6;
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 1;
        self.modify(
            "modify_qp RTS",
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )?;
        *state = QpState::ReadyToSend;
        Ok(())
    }

    /// Moves the QP to ERR: every request posted on it completes flushed,
    /// and nothing more leaves it. The fence's first half (the second is
    /// polling those flushes).
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut state = lock(&self.state);
        // SAFETY: plain C struct, zero is a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify("modify_qp ERR", &mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE)?;
        *state = QpState::Error;
        Ok(())
    }

    fn post_send_wr(
        &self,
        op: &'static str,
        wr: &mut ffi::ibv_send_wr,
        mr: Option<&Arc<MemoryRegion>>,
    ) -> Result<(), VerbsError> {
        self.cq.hold(self.qp_num(), wr.wr_id, mr)?;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `post_send` is the provider's entry for the inline
        // `ibv_post_send`; `wr` and its SGE outlive the call (the provider
        // copies them); the memory it names is held until its completion.
        let ret = unsafe {
            let ctx = self.pd.ctx.ctx.as_ptr();
            match (*ctx).ops.post_send {
                Some(post) => post(self.qp.as_ptr(), wr, &mut bad),
                None => -1,
            }
        };
        if ret != 0 {
            self.cq.unhold(self.qp_num(), wr.wr_id);
            return Err(VerbsError::os(op, ret.max(0)));
        }
        Ok(())
    }

    fn sge(mr: &MemoryRegion, op: &'static str, offset: u64, len: u32) -> Result<ffi::ibv_sge, VerbsError> {
        Ok(ffi::ibv_sge { addr: mr.range(op, offset, len)?, length: len, lkey: mr.lkey() })
    }

    #[allow(clippy::too_many_arguments)]
    fn rdma(
        &self,
        op: &'static str,
        opcode: ffi::ibv_wr_opcode::Type,
        wr_id: u64,
        local: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), VerbsError> {
        let mut sge = Self::sge(local, op, offset, len)?;
        // SAFETY: plain C struct, zero is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        self.post_send_wr(op, &mut wr, Some(local))
    }

    /// Posts an RDMA WRITE of `local[offset..offset+len]` to `remote_addr`
    /// under `rkey`.
    pub fn post_write(
        &self,
        wr_id: u64,
        local: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), VerbsError> {
        self.rdma("post WRITE", ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, wr_id, local, offset, len, remote_addr, rkey)
    }

    /// Posts an RDMA READ of `len` bytes at `remote_addr` under `rkey` into
    /// `local[offset..]`.
    pub fn post_read(
        &self,
        wr_id: u64,
        local: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), VerbsError> {
        self.rdma("post READ", ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, wr_id, local, offset, len, remote_addr, rkey)
    }

    /// Posts a zero-length RDMA WRITE (no memory, no key: nothing is
    /// accessed): the peer's NIC acknowledges it, or after the transport's
    /// retries the request fails and the QP goes to ERR. A heartbeat.
    pub fn post_heartbeat(&self, wr_id: u64) -> Result<(), VerbsError> {
        // SAFETY: plain C struct, zero is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.num_sge = 0;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self.post_send_wr("post heartbeat", &mut wr, None)
    }

    /// Posts a SEND of `local[offset..offset+len]`. On RC it is delivered
    /// after every WRITE posted before it on this QP was placed.
    pub fn post_send(&self, wr_id: u64, local: &Arc<MemoryRegion>, offset: u64, len: u32) -> Result<(), VerbsError> {
        let mut sge = Self::sge(local, "post SEND", offset, len)?;
        // SAFETY: plain C struct, zero is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self.post_send_wr("post SEND", &mut wr, Some(local))
    }

    /// Posts a RECV buffer `local[offset..offset+len]`.
    pub fn post_recv(&self, wr_id: u64, local: &Arc<MemoryRegion>, offset: u64, len: u32) -> Result<(), VerbsError> {
        let mut sge = Self::sge(local, "post RECV", offset, len)?;
        // SAFETY: plain C struct, zero is a valid value.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        self.cq.hold(self.qp_num(), wr_id, Some(local))?;
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in `post_send_wr`, for the inline `ibv_post_recv`.
        let ret = unsafe {
            let ctx = self.pd.ctx.ctx.as_ptr();
            match (*ctx).ops.post_recv {
                Some(post) => post(self.qp.as_ptr(), &mut wr, &mut bad),
                None => -1,
            }
        };
        if ret != 0 {
            self.cq.unhold(self.qp_num(), wr_id);
            return Err(VerbsError::os("post RECV", ret.max(0)));
        }
        Ok(())
    }

    /// Posts a bind of the unbound `window` over `mr[offset..offset+len]`
    /// granting remote WRITE and READ, under a fresh key; returns that key. The key
    /// is usable once the bind's completion arrived and
    /// [`MemoryWindow::bind_completed`] recorded it; only through this QP
    /// (type 2B).
    pub fn post_bind(
        &self,
        wr_id: u64,
        window: &mut MemoryWindow,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
    ) -> Result<u32, VerbsError> {
        // A type-2 window binds only from the free state: the next tenancy
        // on a window is an invalidation, then a bind under a new key.
        if !matches!(window.state, WindowState::Unbound) {
            return Err(VerbsError::invalid("post BIND_MW", format!("the window is {:?}, not unbound", window.state)));
        }
        let addr = mr.range("post BIND_MW", offset, len)?;
        let rkey = window.next_rkey();
        // SAFETY: plain C struct, zero is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        use ffi::ibv_access_flags as A;
        // The bind variant of the union, the one this opcode reads.
        wr.__bindgen_anon_2.bind_mw.mw = window.as_ptr();
        wr.__bindgen_anon_2.bind_mw.rkey = rkey;
        wr.__bindgen_anon_2.bind_mw.bind_info = ffi::ibv_mw_bind_info {
            mr: mr.as_ptr(),
            addr,
            length: u64::from(len),
            mw_access_flags: (A::IBV_ACCESS_REMOTE_WRITE | A::IBV_ACCESS_REMOTE_READ).0,
        };
        self.post_send_wr("post BIND_MW", &mut wr, Some(mr))?;
        window.state = WindowState::Binding { rkey, mr: Arc::clone(mr) };
        Ok(rkey)
    }

    /// Posts a `LOCAL_INV` of `window`'s key: once it completed, the key is
    /// refused by the NIC.
    pub fn post_invalidate(&self, wr_id: u64, window: &mut MemoryWindow) -> Result<(), VerbsError> {
        let WindowState::Bound { rkey, .. } = window.state else {
            return Err(VerbsError::invalid("post LOCAL_INV", format!("the window is {:?}", window.state)));
        };
        // SAFETY: plain C struct, zero is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_LOCAL_INV;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.__bindgen_anon_1.invalidate_rkey = rkey;
        self.post_send_wr("post LOCAL_INV", &mut wr, None)?;
        let state = std::mem::replace(&mut window.state, WindowState::Unbound);
        if let WindowState::Bound { rkey, mr, addr, len } = state {
            window.state = WindowState::Invalidating { rkey, mr, addr, len };
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; requests still posted
        // are flushed by the destroy, and their memory is held by the CQ.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_qp failed");
        }
    }
}
