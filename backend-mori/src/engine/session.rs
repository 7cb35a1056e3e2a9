//! The engine's [`IoSession`]: MORI's session over one local and one
//! remote memory, a thin front for the engine's submit path.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::state::Inner;
use super::IoSession;
use crate::status::TransferStatus;
use crate::transport::OpKind;
use crate::types::{MemoryDesc, Segment, Tag, TransferUniqueId};
use crate::util::lock;

pub(super) struct EngineSession {
    pub(super) inner: Arc<Inner>,
    pub(super) local: MemoryDesc,
    pub(super) remote: MemoryDesc,
}

impl IoSession for EngineSession {
    fn local(&self) -> MemoryDesc {
        self.local.clone()
    }

    fn remote(&self) -> MemoryDesc {
        self.remote.clone()
    }

    fn allocate_transfer_unique_id(&self) -> TransferUniqueId {
        self.inner.uids.allocate()
    }

    fn read(
        &self,
        local_offset: u64,
        remote_offset: u64,
        size: u64,
        uid: TransferUniqueId,
        tag: Tag,
    ) -> TransferStatus {
        self.batch_read(&[Segment::new(local_offset, remote_offset, size)], uid, tag)
    }

    fn write(
        &self,
        local_offset: u64,
        remote_offset: u64,
        size: u64,
        uid: TransferUniqueId,
        tag: Tag,
    ) -> TransferStatus {
        self.batch_write(&[Segment::new(local_offset, remote_offset, size)], uid, tag)
    }

    fn batch_read(&self, segments: &[Segment], uid: TransferUniqueId, tag: Tag) -> TransferStatus {
        self.inner.submit(OpKind::Read, &self.local, &self.remote, segments, uid, tag)
    }

    fn batch_write(&self, segments: &[Segment], uid: TransferUniqueId, tag: Tag) -> TransferStatus {
        self.inner.submit(OpKind::Write, &self.local, &self.remote, segments, uid, tag)
    }

    fn alive(&self) -> bool {
        if self.inner.shutdown.load(Ordering::Acquire) {
            return false;
        }
        let state = lock(&self.inner.state);
        self.inner.check_local(&state, &self.local).is_ok() && state.peers.contains_key(&self.remote.engine_key)
    }
}
