//! Rule 9's admission of what a peer's connections hold: places in flight,
//! in all and per peer, each given back when its permit drops. Sans-IO: a
//! backend's acceptor asks for a place before it spends a thread or a
//! buffer on a connection, and refuses (counts, closes) when there is none.

use crate::hash::HashMap;
use std::collections::BTreeMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

/// What a full [`PeerGate`] does with a newcomer
/// ([`PeerGate::enter_or_evict`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtFull {
    /// Refuse it ([`GateRefusal::Full`]).
    Refuse,
    /// The oldest place gives way to it.
    EvictOldest,
}

impl AtFull {
    /// `EvictOldest` if `evict`, else `Refuse` (for a limits struct's flag).
    pub fn evict_if(evict: bool) -> Self {
        if evict {
            Self::EvictOldest
        } else {
            Self::Refuse
        }
    }
}

/// Why [`PeerGate::enter`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GateRefusal {
    /// This peer holds its cap of places.
    #[error("the peer holds its cap of places")]
    PerPeer,
    /// All places are taken.
    #[error("every place is taken")]
    Full,
}

#[derive(Debug)]
struct Places<K, H> {
    total: usize,
    by_peer: HashMap<K, usize>,
    /// Every place held, oldest first (ids grow with entry order), with its
    /// peer and the holder's handle (what an eviction hands back).
    held: BTreeMap<u64, (K, H)>,
    next: u64,
}

impl<K: Hash + Eq, H> Places<K, H> {
    /// Gives place `id` back; `None` if it was given back already (evicted).
    fn remove(&mut self, id: u64) -> Option<H> {
        let (peer, handle) = self.held.remove(&id)?;
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.by_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.by_peer.remove(&peer);
            }
        }
        Some(handle)
    }
}

/// Places in flight, in all and per peer (`K`: a source address, a peer id),
/// each held with a handle `H` (e.g. the connection a handshake runs on).
///
/// A per-peer cap alone is beaten by many peers (many source addresses)
/// filling the total together. [`PeerGate::enter_or_evict`] answers that
/// for places that prove nothing yet (handshakes in flight): at a full
/// gate the oldest place gives way to the newcomer and its handle is handed
/// back for the caller to close. An honest handshake takes a round trip or
/// two, so a flood must then open a whole gate's worth of connections
/// within that time to starve it, not merely hold them.
///
/// ```
/// use kv_transfer_core::{AtFull, GateRefusal, PeerGate};
/// let gate: PeerGate<u8> = PeerGate::new(3, 2);
/// let a = gate.enter(1).unwrap();
/// let _b = gate.enter(1).unwrap();
/// assert_eq!(gate.enter(1).err(), Some(GateRefusal::PerPeer), "peer 1 holds its 2");
/// let _c = gate.enter(2).unwrap();
/// assert_eq!(gate.enter(3).err(), Some(GateRefusal::Full));
/// drop(a);
/// assert!(gate.enter(3).is_ok(), "a dropped permit gives its place back");
///
/// // Handles, and the oldest giving way at a full gate:
/// let gate: PeerGate<u8, &str> = PeerGate::new(2, 1);
/// let _old = gate.enter_with(1, "first").unwrap();
/// let _mid = gate.enter_with(2, "second").unwrap();
/// let (_new, evicted) = gate.enter_or_evict(3, "third", AtFull::EvictOldest).unwrap();
/// assert_eq!(evicted, Some("first"), "the oldest place is handed back to be closed");
/// assert_eq!(gate.held(), 2);
/// ```
#[derive(Debug)]
pub struct PeerGate<K, H = ()> {
    places: Arc<Mutex<Places<K, H>>>,
    total: usize,
    per_peer: usize,
}

impl<K, H> Clone for PeerGate<K, H> {
    fn clone(&self) -> Self {
        Self { places: Arc::clone(&self.places), total: self.total, per_peer: self.per_peer }
    }
}

/// A place at a [`PeerGate`], given back when dropped (a no-op if the place
/// was evicted: it was given back then).
#[derive(Debug)]
#[must_use = "the place is given back when the permit drops"]
pub struct GatePermit<K: Hash + Eq, H = ()> {
    places: Arc<Mutex<Places<K, H>>>,
    id: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The counts stay consistent across a panic (each update is one step).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<K: Hash + Eq + Clone> PeerGate<K, ()> {
    /// A place for `peer`, or why not (nothing is taken then).
    pub fn enter(&self, peer: K) -> Result<GatePermit<K>, GateRefusal> {
        self.enter_with(peer, ())
    }
}

impl<K: Hash + Eq + Clone, H> PeerGate<K, H> {
    /// A gate of `total` places, at most `per_peer` of them held by one peer.
    pub fn new(total: usize, per_peer: usize) -> Self {
        let places = Places { total: 0, by_peer: HashMap::default(), held: BTreeMap::new(), next: 0 };
        Self { places: Arc::new(Mutex::new(places)), total, per_peer }
    }

    /// A place for `peer`, held with `handle`, or why not (nothing is taken
    /// then).
    pub fn enter_with(&self, peer: K, handle: H) -> Result<GatePermit<K, H>, GateRefusal> {
        self.enter_or_evict(peer, handle, AtFull::Refuse).map(|(permit, _)| permit)
    }

    /// As [`PeerGate::enter_with`], but at a full gate, under
    /// [`AtFull::EvictOldest`], the oldest place gives way: it is taken
    /// from its holder (whose permit then gives nothing back) and its
    /// handle returned, for the caller to close what it names. A peer at
    /// its own cap is still refused ([`GateRefusal::PerPeer`]); so is any
    /// peer at a gate of no places.
    pub fn enter_or_evict(
        &self,
        peer: K,
        handle: H,
        at_full: AtFull,
    ) -> Result<(GatePermit<K, H>, Option<H>), GateRefusal> {
        let mut p = lock(&self.places);
        if p.by_peer.get(&peer).copied().unwrap_or(0) >= self.per_peer {
            return Err(GateRefusal::PerPeer);
        }
        let mut evicted = None;
        if p.total >= self.total {
            let oldest = p.held.keys().next().copied();
            match oldest {
                Some(id) if at_full == AtFull::EvictOldest => evicted = p.remove(id),
                _ => return Err(GateRefusal::Full),
            }
        }
        p.total += 1;
        *p.by_peer.entry(peer.clone()).or_insert(0) += 1;
        let id = p.next;
        p.next += 1;
        p.held.insert(id, (peer, handle));
        Ok((GatePermit { places: Arc::clone(&self.places), id }, evicted))
    }

    /// Places held now, in all.
    pub fn held(&self) -> usize {
        lock(&self.places).total
    }
}

impl<K: Hash + Eq, H> Drop for GatePermit<K, H> {
    fn drop(&mut self) {
        // Dropped outside the lock: a handle may close a socket.
        let handle = lock(&self.places).remove(self.id);
        drop(handle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule9_a_peer_holds_at_most_its_cap_and_its_permits_give_places_back() {
        let gate: PeerGate<u32> = PeerGate::new(4, 2);
        let flood: Vec<_> = (0..20).filter_map(|_| gate.enter(7).ok()).collect();
        assert_eq!(flood.len(), 2, "10x the cap from one peer buys the cap");
        assert!(gate.enter(8).is_ok(), "another peer still gets a place");
        drop(flood);
        assert_eq!(gate.held(), 0);
    }

    #[test]
    fn rule9_many_peers_at_a_full_gate_evict_the_oldest_place_never_one_peer_past_its_cap() {
        let gate: PeerGate<u32, u32> = PeerGate::new(4, 2);
        // 10x the total from 20 peers, each under its own cap.
        let mut permits = Vec::new();
        let mut evicted = Vec::new();
        for peer in 0..40u32 {
            let (p, e) = gate.enter_or_evict(peer / 2, peer, AtFull::EvictOldest).unwrap();
            permits.push(p);
            evicted.extend(e);
        }
        assert_eq!(gate.held(), 4, "the total holds");
        assert_eq!(evicted, (0..36).collect::<Vec<_>>(), "oldest first, each once");
        // The honest newcomer gets in at once, and the per-peer cap still refuses.
        let (honest, e) = gate.enter_or_evict(1000, 1000, AtFull::EvictOldest).unwrap();
        assert_eq!(e, Some(36));
        assert_eq!(gate.enter_or_evict(19, 0, AtFull::EvictOldest).err(), Some(GateRefusal::PerPeer));
        // Evicted permits give nothing back twice; the rest give theirs.
        drop(permits);
        assert_eq!(gate.held(), 1);
        drop(honest);
        assert_eq!(gate.held(), 0);
        let refusing: PeerGate<u32, u32> = PeerGate::new(1, 1);
        let _a = refusing.enter_with(1, 1).unwrap();
        assert_eq!(refusing.enter_with(2, 2).err(), Some(GateRefusal::Full), "without eviction: refused");
    }
}
