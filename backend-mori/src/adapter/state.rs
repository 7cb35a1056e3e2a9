//! The adapter's shared internals: the tables every side reads (pools,
//! peers, remembered endpoints, failed settlements), the counters, the hub
//! an operation reports to, and `Inner`'s lookups over them (including the
//! route of a post). Kept apart from the code that drives them so that the
//! initiator, the target and the driver share one definition.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kv_transfer_core::drain::{Capabilities, DrainCounters, Driver};
use kv_transfer_core::{PeerId, PoolId, PostErrorKind, SettlementAuthority, SlotPool, Tenancy};

use super::driver::Jobs;
use super::post::OpTable;
use super::wire::decode_endpoint;
use crate::engine::IoEngine;
use crate::types::{EngineKey, MemoryDesc};
use crate::util::{HashMap, HashSet};

/// Decoded remote descriptors kept (see `Inner::endpoints`).
const MAX_ENDPOINTS: usize = 1024;

#[derive(Default)]
pub(super) struct Counters {
    // posts, transfers, transfers_succeeded and ops_completed: in `OpTable`.
    pub(super) transfers_failed: AtomicU64,
    pub(super) transfers_unknown: AtomicU64,
    pub(super) inbound_settled: AtomicU64,
    pub(super) inbound_stale: AtomicU64,
    pub(super) inbound_unknown: AtomicU64,
    pub(super) inbound_failed: AtomicU64,
    pub(super) inbound_no_settle: AtomicU64,
    pub(super) aborts_received: AtomicU64,
    pub(super) abort_acks_sent: AtomicU64,
    pub(super) peers_lost: AtomicU64,
    pub(super) posts_refused_tombstone: AtomicU64,
}

pub(super) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(super) struct PoolEntry {
    pub(super) pool: SlotPool,
    pub(super) authority: SettlementAuthority,
    pub(super) desc: MemoryDesc,
    pub(super) slot_size: u64,
}

#[derive(Default)]
pub(super) struct PeerTable {
    pub(super) by_key: HashMap<EngineKey, PeerId>,
    pub(super) by_id: HashMap<PeerId, EngineKey>,
    pub(super) next: u32,
}

/// Tenancies the target settled from a *failed* inbound status, remembered
/// (bounded) so the application can tell settled-but-not-written slots.
#[derive(Default)]
pub(super) struct FailedSet {
    pub(super) set: HashSet<(PoolId, Tenancy)>,
    pub(super) order: VecDeque<(PoolId, Tenancy)>,
}

/// What a post looks up, behind one lock (one shared lock word taken per
/// post, not three).
#[derive(Default)]
pub(super) struct Routes {
    pub(super) pools: Vec<Arc<PoolEntry>>,
    /// Remote memory descriptors already decoded from an endpoint string,
    /// by key (a fresh registration gets a fresh key): a post then parses
    /// nothing. Bounded by the remote registrations this adapter was shown.
    pub(super) endpoints: HashMap<u64, (String, MemoryDesc)>,
    pub(super) peers: PeerTable,
}

impl Routes {
    /// The local pool, remote memory and peer of a post, if the endpoint
    /// was seen before.
    fn of_post(&self, pool: PoolId, endpoint: &str, rkey: u64) -> Option<(Arc<PoolEntry>, MemoryDesc, Option<PeerId>)> {
        let (e, d) = self.endpoints.get(&rkey)?;
        if e != endpoint {
            return None;
        }
        let entry = self.pools.iter().find(|e| e.pool.id() == pool)?;
        Some((entry.clone(), d.clone(), self.peers.by_key.get(&d.engine_key).copied()))
    }
}

pub(super) struct Inner {
    pub(super) routes: RwLock<Routes>,
    pub(super) failed: Mutex<FailedSet>,
    pub(super) engine: Arc<dyn IoEngine>,
    /// Shared with every operation (held strongly by each, so a
    /// completion reaches it without upgrading a weak reference).
    pub(super) hub: Arc<OpHub>,
    /// Target side of core's drain protocol (core's driver): every tenancy
    /// exposed to a peer, under its token, the pools' authorities, the ladder.
    pub(super) drain: Mutex<Driver>,
    pub(super) drain_counters: Arc<DrainCounters>,
    /// What the transport lets this adapter prove (its pools' ladders).
    pub(super) caps: Capabilities,
}

/// What an operation needs when its statuses end: the op table, the
/// driver's queue and the counters.
pub(super) struct OpHub {
    pub(super) ops: Mutex<OpTable>,
    pub(super) jobs: Arc<Jobs>,
    pub(super) counters: Counters,
}

impl Inner {
    fn routes(&self) -> std::sync::RwLockReadGuard<'_, Routes> {
        self.routes.read().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn routes_mut(&self) -> std::sync::RwLockWriteGuard<'_, Routes> {
        self.routes.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The local pool, remote memory and peer a post names: one read of the
    /// routes once the endpoint was decoded (cached by key; see
    /// [`Routes::endpoints`]).
    pub(super) fn route(
        &self,
        pool: PoolId,
        endpoint: &str,
        rkey: u64,
    ) -> Result<(Arc<PoolEntry>, MemoryDesc, PeerId), PostErrorKind> {
        let found = self.routes().of_post(pool, endpoint, rkey);
        let (entry, rdesc, peer) = match found {
            Some(r) => r,
            None => {
                let entry = self.pool_entry(pool).ok_or(PostErrorKind::ForeignPool)?;
                // The descriptor names no engine this adapter could reach.
                let Some(d) = decode_endpoint(endpoint, rkey) else {
                    return Err(PostErrorKind::Peer(format!("not a MORI endpoint: {endpoint}")));
                };
                let mut routes = self.routes_mut();
                if routes.endpoints.len() >= MAX_ENDPOINTS {
                    routes.endpoints.clear();
                }
                routes.endpoints.insert(rkey, (endpoint.to_owned(), d.clone()));
                let peer = routes.peers.by_key.get(&d.engine_key).copied();
                (entry, d, peer)
            }
        };
        let peer = peer.ok_or_else(|| PostErrorKind::Peer(format!("engine {} was not added", rdesc.engine_key)))?;
        Ok((entry, rdesc, peer))
    }

    pub(super) fn pool_entry(&self, id: PoolId) -> Option<Arc<PoolEntry>> {
        self.routes().pools.iter().find(|e| e.pool.id() == id).cloned()
    }
    pub(super) fn pool_by_mem(&self, mem: u32) -> Option<Arc<PoolEntry>> {
        self.routes().pools.iter().find(|e| e.desc.id == mem).cloned()
    }
    pub(super) fn peer_id(&self, key: &EngineKey) -> Option<PeerId> {
        self.routes().peers.by_key.get(key).copied()
    }
    pub(super) fn peer_key(&self, id: PeerId) -> Option<EngineKey> {
        self.routes().peers.by_id.get(&id).cloned()
    }
}
