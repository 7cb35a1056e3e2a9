//! Rule 9's admission of what a peer's connections hold: places in flight,
//! in all and per peer, each given back when its permit drops. Sans-IO: a
//! backend's acceptor asks for a place before it spends a thread or a
//! buffer on a connection, and refuses (counts, closes) when there is none.

use crate::hash::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

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
struct Places<K> {
    total: usize,
    by_peer: HashMap<K, usize>,
}

/// Places in flight, in all and per peer (`K`: a source address, a peer id).
///
/// ```
/// use kv_transfer_core::{GateRefusal, PeerGate};
/// let gate: PeerGate<u8> = PeerGate::new(3, 2);
/// let a = gate.enter(1).unwrap();
/// let _b = gate.enter(1).unwrap();
/// assert_eq!(gate.enter(1).err(), Some(GateRefusal::PerPeer), "peer 1 holds its 2");
/// let _c = gate.enter(2).unwrap();
/// assert_eq!(gate.enter(3).err(), Some(GateRefusal::Full));
/// drop(a);
/// assert!(gate.enter(3).is_ok(), "a dropped permit gives its place back");
/// ```
#[derive(Debug)]
pub struct PeerGate<K> {
    places: Arc<Mutex<Places<K>>>,
    total: usize,
    per_peer: usize,
}

impl<K> Clone for PeerGate<K> {
    fn clone(&self) -> Self {
        Self { places: Arc::clone(&self.places), total: self.total, per_peer: self.per_peer }
    }
}

/// A place at a [`PeerGate`], given back when dropped.
#[derive(Debug)]
#[must_use = "the place is given back when the permit drops"]
pub struct GatePermit<K: Hash + Eq> {
    places: Arc<Mutex<Places<K>>>,
    peer: K,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The counts stay consistent across a panic (each update is one step).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<K: Hash + Eq + Clone> PeerGate<K> {
    /// A gate of `total` places, at most `per_peer` of them held by one peer.
    pub fn new(total: usize, per_peer: usize) -> Self {
        Self { places: Arc::new(Mutex::new(Places { total: 0, by_peer: HashMap::default() })), total, per_peer }
    }

    /// A place for `peer`, or why not (nothing is taken then).
    pub fn enter(&self, peer: K) -> Result<GatePermit<K>, GateRefusal> {
        let mut p = lock(&self.places);
        if p.by_peer.get(&peer).copied().unwrap_or(0) >= self.per_peer {
            return Err(GateRefusal::PerPeer);
        }
        if p.total >= self.total {
            return Err(GateRefusal::Full);
        }
        p.total += 1;
        *p.by_peer.entry(peer.clone()).or_insert(0) += 1;
        Ok(GatePermit { places: Arc::clone(&self.places), peer })
    }

    /// Places held now, in all.
    pub fn held(&self) -> usize {
        lock(&self.places).total
    }
}

impl<K: Hash + Eq> Drop for GatePermit<K> {
    fn drop(&mut self) {
        let mut p = lock(&self.places);
        p.total = p.total.saturating_sub(1);
        if let Some(n) = p.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                p.by_peer.remove(&self.peer);
            }
        }
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
}
