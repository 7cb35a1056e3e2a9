//! What a peer's connections and notifications may cost a target (DESIGN
//! rule 9: a peer's input buys only that peer's state, bounded).
//!
//! Mooncake's handshake and TCP data protocols carry no identity, so a peer
//! here is the source IP address of its connection (what TCP's own
//! handshake vouches for, not a name the peer declares). Every accepted
//! connection has an idle deadline and a whole-request deadline, the number
//! of connections is capped per address and in all, and notifications are
//! queued only up to a count and byte budget per address and in all: a
//! refusal at a cap is typed (a closed connection, a `notify_msg` that is
//! not `success`) and counted in [`crate::TargetStats`], and one address's
//! flood never evicts another's notifications.
//!
//! A per-address cap alone is beaten by many addresses (127.0.0.2 to
//! 127.0.0.6 on loopback, a /24 elsewhere): together they fill the port's
//! total. So the addresses this engine chose (the IPs of segments it
//! opened: the peers its adapter exposes slots to) are told apart from
//! strangers, which share only [`ConnLimits::max_stranger_conns`] of the
//! total; the rest stays for the chosen ones. The wire is Mooncake's and
//! carries no identity: the address the local side chose is the identity.

use kv_transfer_core::hash::HashMap;
use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

use crate::proto::NotifyDesc;

/// Limits of one listening port ([`crate::EngineConfig::data_limits`],
/// [`crate::EngineConfig::handshake_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Most connections served at once on this port; one more is closed at
    /// once and counted (`conns_refused_global`).
    pub max_conns: usize,
    /// Most connections served at once from one source address; one more is
    /// closed at once and counted (`conns_refused_per_addr`).
    pub max_conns_per_addr: usize,
    /// Most connections served at once from strangers together (addresses
    /// of no segment this engine opened); one more is closed at once and
    /// counted (`conns_refused_strangers`). The rest of `max_conns` stays
    /// for the peers this side chose, whatever many addresses do.
    pub max_stranger_conns: usize,
    /// At a full port (or a full strangers' share), the oldest stranger's
    /// connection that has completed no request yet gives way to the new
    /// one (closed, counted `conns_evicted_unserved`) instead of the new
    /// one being refused. Many addresses holding silent or trickling
    /// connections then cannot keep an honest stranger out (on the
    /// handshake port every peer's first contact is a stranger's) for
    /// longer than it takes them to open a port's worth of new ones.
    /// Chosen peers' connections, and any that has been served, are never
    /// evicted. `false`: refuse (the many-addresses tests' positive
    /// control).
    pub evict_unserved_strangers: bool,
    /// Longest wait for the first byte of a request (data: between requests
    /// on one connection; handshake: for the frame) before the connection is
    /// closed and counted (`idle_closed`). `None`: wait for ever (the old
    /// behaviour, the positive control).
    pub idle_timeout: Option<Duration>,
    /// Longest a request may take from its first byte to its last (data:
    /// header and payload or reply; handshake: the frame, the reply and the
    /// peer's close) before the connection is closed and counted
    /// (`deadline_closed`). `None`: no whole-request deadline.
    pub request_timeout: Option<Duration>,
}

impl ConnLimits {
    /// The data port's defaults: 1,024 connections, 256 per address, 256
    /// for strangers together (a real Mooncake initiator our adapter never
    /// added is one), 120 s idle (an initiator's pooled connection is
    /// dropped by it after [`crate::TcpTransportConfig::max_idle`], before
    /// that), 120 s a request.
    pub const DATA: ConnLimits = ConnLimits {
        max_conns: 1024,
        max_conns_per_addr: 256,
        max_stranger_conns: 256,
        evict_unserved_strangers: true,
        idle_timeout: Some(Duration::from_secs(120)),
        request_timeout: Some(Duration::from_secs(120)),
    };

    /// The handshake port's defaults: 256 handshakes at once, 32 per
    /// address, 5 s idle and 10 s for the whole exchange. Strangers are not
    /// given a smaller share here: every peer's first contact (a decode
    /// fetching a prefill's descriptor) comes before this side chose it;
    /// the oldest unserved stranger gives way instead.
    pub const HANDSHAKE: ConnLimits = ConnLimits {
        max_conns: 256,
        max_conns_per_addr: 32,
        max_stranger_conns: 256,
        evict_unserved_strangers: true,
        idle_timeout: Some(Duration::from_secs(5)),
        request_timeout: Some(Duration::from_secs(10)),
    };

    /// The old behaviour (the hostile tests' positive control): 1,024
    /// connections in all, none per address, no idle or request deadline.
    pub const LEGACY: ConnLimits = ConnLimits {
        max_conns: 1024,
        max_conns_per_addr: usize::MAX,
        max_stranger_conns: usize::MAX,
        evict_unserved_strangers: false,
        idle_timeout: None,
        request_timeout: None,
    };
}

/// Limits of the notification queue ([`crate::EngineConfig::notify_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifyLimits {
    /// Most notifications queued in all.
    pub max_total: usize,
    /// Most bytes (name and message) queued in all.
    pub max_total_bytes: usize,
    /// Most notifications queued from one source address.
    pub max_per_addr: usize,
    /// Most bytes queued from one source address.
    pub max_per_addr_bytes: usize,
    /// The old behaviour (positive control only): no byte or per-address
    /// budget, and at `max_total` the oldest notification, whoever sent it,
    /// is dropped to make room.
    pub legacy_drop_oldest: bool,
}

impl Default for NotifyLimits {
    /// 65,536 notifications and 64 MiB in all; 4,096 and 8 MiB per address.
    fn default() -> Self {
        Self {
            max_total: 65536,
            max_total_bytes: 64 << 20,
            max_per_addr: 4096,
            max_per_addr_bytes: 8 << 20,
            legacy_drop_oldest: false,
        }
    }
}

impl NotifyLimits {
    /// The old behaviour: `max_total` notifications of any size, the oldest
    /// dropped beyond (the positive control of the notify-flood test).
    pub fn legacy(max_total: usize) -> Self {
        Self {
            max_total,
            max_total_bytes: usize::MAX,
            max_per_addr: usize::MAX,
            max_per_addr_bytes: usize::MAX,
            legacy_drop_oldest: true,
        }
    }
}

/// Connections per source address of one listener, and each connection
/// held (by its listener id, oldest first): its address, what it was
/// admitted as, and whether it has been served a request.
#[derive(Debug, Default)]
pub(crate) struct AddrCounts {
    by_addr: HashMap<IpAddr, usize>,
    total: usize,
    strangers: usize,
    held: BTreeMap<u64, Held>,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    ip: IpAddr,
    who: Admitted,
    served: bool,
}

/// Why a connection was refused at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnRefusal {
    Global,
    PerAddr,
    Strangers,
}

/// Whether a connection's address is one this engine chose (a segment it
/// opened) or a stranger's: what it was admitted as, so that it is
/// released from the same count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitted {
    Chosen,
    Stranger,
}

impl AddrCounts {
    /// Counts new connection `id` from `ip`, or says which cap refuses it.
    /// At the total or the strangers' share, under
    /// [`ConnLimits::evict_unserved_strangers`], the oldest unserved
    /// stranger gives way first: its id is returned for the caller to
    /// close (it is released already).
    pub(crate) fn admit(
        &mut self,
        id: u64,
        ip: IpAddr,
        who: Admitted,
        l: &ConnLimits,
    ) -> Result<Option<u64>, ConnRefusal> {
        if self.by_addr.get(&ip).copied().unwrap_or(0) >= l.max_conns_per_addr {
            return Err(ConnRefusal::PerAddr);
        }
        let full = if self.total >= l.max_conns {
            Some(ConnRefusal::Global)
        } else if who == Admitted::Stranger && self.strangers >= l.max_stranger_conns {
            Some(ConnRefusal::Strangers)
        } else {
            None
        };
        let mut evicted = None;
        if let Some(why) = full {
            let oldest = self.held.iter().find(|(_, h)| h.who == Admitted::Stranger && !h.served).map(|(id, _)| *id);
            match oldest {
                Some(old) if l.evict_unserved_strangers => {
                    self.release(old);
                    evicted = Some(old);
                }
                _ => return Err(why),
            }
        }
        *self.by_addr.entry(ip).or_insert(0) += 1;
        self.total += 1;
        if who == Admitted::Stranger {
            self.strangers += 1;
        }
        self.held.insert(id, Held { ip, who, served: false });
        Ok(evicted)
    }

    /// Connection `id` was served a request: never evicted from now on.
    pub(crate) fn served(&mut self, id: u64) {
        if let Some(h) = self.held.get_mut(&id) {
            h.served = true;
        }
    }

    /// Connection `id` ended (a no-op if it was evicted: released then).
    pub(crate) fn release(&mut self, id: u64) {
        let Some(h) = self.held.remove(&id) else { return };
        if let Some(n) = self.by_addr.get_mut(&h.ip) {
            *n -= 1;
            self.total -= 1;
            if h.who == Admitted::Stranger {
                self.strangers -= 1;
            }
            if *n == 0 {
                self.by_addr.remove(&h.ip);
            }
        }
    }
}

/// Bytes a queued notification is charged: its name and message, plus
/// the queue's own bookkeeping.
fn notify_cost(n: &NotifyDesc) -> usize {
    n.name.len() + n.notify_msg.len() + 64
}

/// Why a notification was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotifyRefusal {
    /// The sender's own budget (count or bytes) is spent.
    PerAddr,
    /// The queue's budget is spent.
    Total,
}

/// The notifications received and not yet taken, with what each source
/// address has queued.
#[derive(Debug, Default)]
pub(crate) struct NotifyQueue {
    q: VecDeque<(IpAddr, usize, NotifyDesc)>,
    /// Per address: (count, bytes) queued.
    by_addr: HashMap<IpAddr, (usize, usize)>,
    bytes: usize,
}

impl NotifyQueue {
    /// Queues `n` from `ip`, or refuses it at a cap; under
    /// [`NotifyLimits::legacy_drop_oldest`] it makes room by dropping the
    /// oldest instead (the count of those dropped is returned).
    pub(crate) fn push(&mut self, ip: IpAddr, n: NotifyDesc, l: &NotifyLimits) -> Result<usize, NotifyRefusal> {
        let cost = notify_cost(&n);
        let mut dropped = 0;
        if l.legacy_drop_oldest {
            while self.q.len() >= l.max_total.max(1) {
                self.pop_front();
                dropped += 1;
            }
        } else {
            let (c, b) = self.by_addr.get(&ip).copied().unwrap_or((0, 0));
            if c >= l.max_per_addr || b.saturating_add(cost) > l.max_per_addr_bytes {
                return Err(NotifyRefusal::PerAddr);
            }
            if self.q.len() >= l.max_total || self.bytes.saturating_add(cost) > l.max_total_bytes {
                return Err(NotifyRefusal::Total);
            }
        }
        let e = self.by_addr.entry(ip).or_insert((0, 0));
        e.0 += 1;
        e.1 += cost;
        self.bytes += cost;
        self.q.push_back((ip, cost, n));
        Ok(dropped)
    }

    fn pop_front(&mut self) {
        if let Some((ip, cost, _)) = self.q.pop_front() {
            self.bytes -= cost;
            if let Some(e) = self.by_addr.get_mut(&ip) {
                e.0 -= 1;
                e.1 -= cost;
                if e.0 == 0 {
                    self.by_addr.remove(&ip);
                }
            }
        }
    }

    /// Takes every queued notification, oldest first.
    pub(crate) fn drain(&mut self) -> Vec<NotifyDesc> {
        self.by_addr.clear();
        self.bytes = 0;
        self.q.drain(..).map(|(_, _, n)| n).collect()
    }

    /// Bytes queued now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_per_address_and_in_all() {
        let l = ConnLimits {
            max_conns: 3,
            max_conns_per_addr: 2,
            max_stranger_conns: 3,
            evict_unserved_strangers: false,
            idle_timeout: None,
            request_timeout: None,
        };
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap());
        let s = Admitted::Stranger;
        let mut c = AddrCounts::default();
        assert_eq!(c.admit(1, a, s, &l), Ok(None));
        assert_eq!(c.admit(2, a, s, &l), Ok(None));
        assert_eq!(c.admit(3, a, s, &l), Err(ConnRefusal::PerAddr));
        assert_eq!(c.admit(4, b, s, &l), Ok(None));
        assert_eq!(c.admit(5, b, s, &l), Err(ConnRefusal::Global));
        c.release(1);
        assert_eq!(c.admit(6, b, s, &l), Ok(None));
        assert_eq!(c.by_addr.len(), 2);
    }

    #[test]
    fn strangers_share_part_of_the_total_and_chosen_addresses_keep_the_rest() {
        let l = ConnLimits {
            max_conns: 4,
            max_conns_per_addr: 1,
            max_stranger_conns: 2,
            evict_unserved_strangers: false,
            idle_timeout: None,
            request_timeout: None,
        };
        let ip = |i: u8| IpAddr::from([127, 0, 0, i]);
        let mut c = AddrCounts::default();
        assert_eq!(c.admit(2, ip(2), Admitted::Stranger, &l), Ok(None));
        assert_eq!(c.admit(3, ip(3), Admitted::Stranger, &l), Ok(None));
        // A third address, one connection each: still a stranger.
        assert_eq!(c.admit(4, ip(4), Admitted::Stranger, &l), Err(ConnRefusal::Strangers));
        assert_eq!(c.admit(1, ip(1), Admitted::Chosen, &l), Ok(None));
        c.release(2);
        assert_eq!(c.admit(5, ip(4), Admitted::Stranger, &l), Ok(None));
    }

    #[test]
    fn rule9_at_a_full_port_the_oldest_unserved_stranger_gives_way_never_a_served_or_chosen_one() {
        let l = ConnLimits {
            max_conns: 3,
            max_conns_per_addr: 1,
            max_stranger_conns: 3,
            evict_unserved_strangers: true,
            idle_timeout: None,
            request_timeout: None,
        };
        let ip = |i: u8| IpAddr::from([127, 0, 0, i]);
        let mut c = AddrCounts::default();
        assert_eq!(c.admit(1, ip(1), Admitted::Chosen, &l), Ok(None));
        assert_eq!(c.admit(2, ip(2), Admitted::Stranger, &l), Ok(None));
        assert_eq!(c.admit(3, ip(3), Admitted::Stranger, &l), Ok(None));
        c.served(2);
        // Full: the chosen one and the served stranger stay; 3 gives way.
        assert_eq!(c.admit(4, ip(4), Admitted::Stranger, &l), Ok(Some(3)));
        c.release(3); // its thread ends later: nothing is released twice
        assert_eq!((c.total, c.strangers), (3, 2));
        // 40 more from 40 addresses: each evicts the one before; the total holds.
        for i in 0..40u8 {
            assert_eq!(c.admit(10 + u64::from(i), ip(10 + i), Admitted::Stranger, &l).map(|e| e.is_some()), Ok(true));
        }
        assert_eq!((c.total, c.strangers, c.by_addr.len()), (3, 2, 3));
        // The per-address cap still refuses, evicting nothing.
        assert_eq!(c.admit(99, ip(49), Admitted::Stranger, &l), Err(ConnRefusal::PerAddr));
        // Everything served: nothing left to evict, refused.
        c.served(49);
        assert_eq!(c.admit(100, ip(60), Admitted::Stranger, &l), Err(ConnRefusal::Global));
        for id in [1, 2, 49] {
            c.release(id);
        }
        assert_eq!((c.total, c.strangers, c.by_addr.len(), c.held.len()), (0, 0, 0, 0));
    }

    #[test]
    fn notify_budget_per_address_never_evicts() {
        let l = NotifyLimits { max_total: 4, max_total_bytes: 1 << 20, max_per_addr: 2, ..NotifyLimits::default() };
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap());
        let n = |m: &str| NotifyDesc::new("x", m);
        let mut q = NotifyQueue::default();
        q.push(b, n("honest"), &l).unwrap();
        q.push(a, n("1"), &l).unwrap();
        q.push(a, n("2"), &l).unwrap();
        assert_eq!(q.push(a, n("3"), &l), Err(NotifyRefusal::PerAddr));
        q.push(b, n("honest2"), &l).unwrap();
        assert_eq!(q.push(b, n("x"), &l), Err(NotifyRefusal::PerAddr));
        let got: Vec<String> = q.drain().into_iter().map(|n| n.notify_msg).collect();
        assert_eq!(got, ["honest", "1", "2", "honest2"]);
        assert_eq!(q.bytes(), 0);
        let legacy = NotifyLimits::legacy(2);
        q.push(b, n("honest"), &legacy).unwrap();
        q.push(a, n("1"), &legacy).unwrap();
        assert_eq!(q.push(a, n("2"), &legacy), Ok(1), "the old queue drops the oldest, whoever sent it");
        assert_eq!(q.drain().len(), 2);
    }
}
