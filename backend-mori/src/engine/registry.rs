//! What the engine knows of the world: its descriptor, remote engines
//! (register, fence, deregister) and local memory registrations, and the
//! check that a descriptor names a live registration of this engine.
//! Deregistration refuses while a transfer touches the memory.

use std::sync::atomic::Ordering;

use super::mori::to_engine_error;
use super::state::{Inner, LocalMem, Peer, State};
use crate::error::{EngineError, TransportError};
use crate::status::StatusCode;
use crate::types::{EngineDesc, EngineKey, MemoryDesc, MemoryId, MemoryLocation, MemoryRegion};
use crate::util::{lock, HashMap, HashSet};
use crate::window::NotifWindow;

impl Inner {
    pub(super) fn engine_desc(&self) -> EngineDesc {
        EngineDesc {
            key: self.key.clone(),
            hostname: self.config.hostname.clone(),
            host: self.config.host.clone(),
            port: self.config.port,
            transport: self.transport_name.clone(),
            transport_info: self.transport_info.clone(),
            notif_seq_start: self.config.notif_seq_start,
        }
    }

    pub(super) fn register_remote_engine(&self, desc: &EngineDesc) -> Result<(), EngineError> {
        if desc.key.as_str().is_empty() {
            return Err(EngineError::InvalidArgs("empty engine key".to_owned()));
        }
        let mut state = lock(&self.state);
        let next_seq = self.config.notif_seq_start;
        if let Some(peer) = state.peers.get_mut(&desc.key) {
            if peer.desc == *desc {
                if peer.fenced {
                    // Same peer, new connection: sequence numbers and window go on.
                    self.transport.connect(desc)?;
                    peer.fenced = false;
                }
                return Ok(());
            }
            if peer.in_flight() > 0 {
                return Err(EngineError::PeerBusy { key: desc.key.clone(), in_flight: peer.in_flight() });
            }
        }
        self.transport.connect(desc)?;
        state.peers.insert(
            desc.key.clone(),
            Peer { desc: desc.clone(), next_seq, pending: HashSet::default(), fenced: false },
        );
        state.windows.insert(desc.key.clone(), NotifWindow::new(desc.notif_seq_start, self.config.notif_window));
        tracing::debug!(engine = %self.key, peer = %desc.key, "registered remote engine");
        Ok(())
    }

    pub(super) fn fence_remote_engine(&self, key: &EngineKey) -> Result<(), EngineError> {
        let mut state = lock(&self.state);
        let Some(peer) = state.peers.get_mut(key) else {
            return Err(EngineError::NotFound(format!("remote engine {key} is not registered")));
        };
        self.transport.fence(key)?;
        peer.fenced = true;
        tracing::info!(engine = %self.key, peer = %key, pending = peer.in_flight(), "fenced remote engine");
        Ok(())
    }

    pub(super) fn deregister_remote_engine(&self, key: &EngineKey) -> Result<(), EngineError> {
        let mut state = lock(&self.state);
        let Some(peer) = state.peers.get(key) else {
            return Err(EngineError::NotFound(format!("remote engine {key} is not registered")));
        };
        if peer.in_flight() > 0 {
            return Err(EngineError::PeerBusy { key: key.clone(), in_flight: peer.in_flight() });
        }
        self.transport.disconnect(key)?;
        state.peers.remove(key);
        state.windows.remove(key);
        Ok(())
    }

    pub(super) fn register_memory(&self, region: MemoryRegion) -> Result<MemoryDesc, EngineError> {
        if region.is_empty() {
            return Err(EngineError::InvalidArgs("cannot register an empty region".to_owned()));
        }
        let mut state = lock(&self.state);
        if self.shutdown.load(Ordering::Acquire) {
            return Err(EngineError::BadState("engine is shut down".to_owned()));
        }
        // Bounded: at most as many turns as regions are registered.
        let mut id = state.next_mem_id;
        while state.memory.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        state.next_mem_id = id.wrapping_add(1);
        let rkey = self.transport.register_memory(id, &region).map_err(|e| match e {
            TransportError::Unsupported(msg) if region.location() == MemoryLocation::Gpu => EngineError::Gpu(msg),
            other => EngineError::Transport(other),
        })?;
        let desc = MemoryDesc {
            engine_key: self.key.clone(),
            id,
            device_id: region.device_id(),
            addr: region.addr(),
            size: region.len(),
            loc: region.location(),
            rkey,
        };
        state.memory.insert(id, LocalMem { desc: desc.clone(), in_flight: 0 });
        Ok(desc)
    }

    pub(super) fn deregister_memory(&self, desc: &MemoryDesc) -> Result<(), EngineError> {
        let mut state = lock(&self.state);
        let (code, msg) = match self.check_local(&state, desc) {
            Ok(()) => (StatusCode::Success, String::new()),
            Err(e) => e,
        };
        if !code.is_success() {
            return Err(to_engine_error(code, msg));
        }
        let in_flight = state.memory.get(&desc.id).map_or(0, |m| m.in_flight);
        if in_flight > 0 {
            return Err(EngineError::MemoryBusy { id: desc.id, in_flight });
        }
        match self.transport.deregister_memory(desc.id) {
            Ok(()) => {}
            Err(TransportError::Busy(id)) => return Err(EngineError::MemoryBusy { id, in_flight: 0 }),
            Err(e) => return Err(EngineError::Transport(e)),
        }
        state.memory.remove(&desc.id);
        Ok(())
    }

    /// `local` must be a live registration of this engine.
    pub(super) fn check_local(&self, state: &State, local: &MemoryDesc) -> Result<(), (StatusCode, String)> {
        self.check_local_in(&state.memory, local)
    }

    /// [`Self::check_local`] against the registrations alone (so a caller
    /// may hold other parts of the state mutably).
    pub(super) fn check_local_in(
        &self,
        memory: &HashMap<MemoryId, LocalMem>,
        local: &MemoryDesc,
    ) -> Result<(), (StatusCode, String)> {
        if local.engine_key != self.key {
            return Err((
                StatusCode::InvalidArgs,
                format!("local memory belongs to engine {}, not {}", local.engine_key, self.key),
            ));
        }
        match memory.get(&local.id) {
            Some(mem) if mem.desc == *local => Ok(()),
            _ => Err((StatusCode::NotFound, format!("local memory {} is not registered (or stale)", local.id))),
        }
    }
}
