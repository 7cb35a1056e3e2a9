"""The prefill worker's offers: a finished request's blocks, held for the
decode that presents the offer, exposed to it only then, and given back to
vLLM (``finished_sending``) only on a proof. Nothing here imports vLLM.

An offer's life (one explicit state at a time, see :class:`Waiting` ...)::

    Waiting --claim--> Exposed --DONE (the decode's READs completed)--> Free
       |                  |
       |release/deadline  |release / deadline: abort, the backend's ladder
       v                  v   (ABORT to the peer, revoke, fence)
     Free <--drained-- Draining          (stuck: held for good, reported)

``Free`` is reported to vLLM once vLLM has named the request in
``finished_req_ids`` (the connector API's rule), then forgotten. Withdrawing
a ``Waiting`` offer is safe at any time: its blocks were never exposed, and
exposure happens only here, under the same lock, so no NIC was ever granted
them. A deadline never frees an exposed block: it only aborts, and the
pages come back when the backend proves them (``drained``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Set, Union

import kv_transfer

from . import wire

logger = logging.getLogger("kv_transfer.vllm")


@dataclass
class Waiting:
    """Offered, not yet claimed: the blocks are held by vLLM, exposed to no one."""

    blocks: Sequence[int]
    since: float


@dataclass
class Exposed:
    """Claimed: exposed to one peer on one backend; settles on its DONE."""

    backend: str
    lease: Any  # kv_transfer.PageLease, state "exposed"
    since: float
    #: The control-plane peer (the name its handshake proved) that claimed
    #: it: the only one whose release aborts it.
    claimant: str = ""
    #: Its entry in the peer table (dropped with the last offer using it).
    peer_key: tuple = ()


@dataclass
class Draining:
    """Aborted while exposed: quarantined until the backend proves every page."""

    backend: str
    lease: Any  # state "aborted"
    since: float
    peer_key: tuple = ()
    warned: bool = False


@dataclass
class Free:
    """Proven free (or never exposed): to be reported to vLLM."""

    how: str


OfferState = Union[Waiting, Exposed, Draining, Free]


@dataclass
class _Offer:
    req_id: str
    state: OfferState
    seen_finished: bool = False


@dataclass(frozen=True)
class OfferLimits:
    """Deadlines of an offer. Neither frees an exposed block."""

    #: An offer nobody claimed is withdrawn after this (its blocks were never exposed).
    unclaimed_s: float = 300.0
    #: An exposure without its DONE after this is aborted (the ladder starts; the
    #: blocks come back only when proven).
    exposed_s: float = 120.0
    #: Peers (distinct descriptors) one control-plane peer (a proven name) may add.
    max_peers_per_name: int = 4
    #: Peers in all.
    max_peers: int = 256


def new_offer_id() -> str:
    """128 random bits: the capability a decode presents to claim the blocks."""
    return secrets.token_hex(16)


class PrefillOffers:
    """Offers by id, over one endpoint and pool per backend (``sides``:
    ``{backend: (endpoint, pool)}``). Thread-safe: the side port's threads
    claim and release, vLLM's worker thread offers and polls."""

    def __init__(self, sides: Dict[str, Any], limits: OfferLimits = OfferLimits(),
                 clock: Callable[[], float] = time.monotonic):
        self.sides = sides
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._offers: Dict[str, _Offer] = {}
        self._by_req: Dict[str, str] = {}
        # (backend, descriptor) -> peer id, and how many offers use it (an
        # entry goes with its last offer); proven name -> descriptors it added
        self._peers: Dict[tuple, int] = {}
        self._peer_uses: Dict[tuple, int] = {}
        self._peers_of: Dict[str, Set[tuple]] = {}
        self.counters: Dict[str, int] = {
            "offered": 0, "claimed": 0, "settled_by_done": 0, "withdrawn": 0, "aborted": 0,
            "drained": 0, "refused_fetches": 0, "released_by_decode": 0, "reported": 0,
            "refused_releases": 0,
            # Deadlines reached: an offer withdrawn unclaimed, an exposure aborted.
            "expired": 0,
        }

    # --- vLLM's side -------------------------------------------------------
    def offer(self, req_id: str, offer_id: str, blocks: Sequence[int]) -> None:
        """The scheduler finished ``req_id`` with its blocks held for a decode."""
        with self._lock:
            if offer_id in self._offers:
                logger.error("kv_transfer.vllm: offer %s offered twice; kept the first", offer_id[:8])
                return
            self._offers[offer_id] = _Offer(req_id, Waiting(tuple(blocks), self._clock()))
            self._by_req[req_id] = offer_id
            self.counters["offered"] += 1

    def finished(self, req_ids: Any) -> None:
        """vLLM named these requests in ``finished_req_ids``."""
        with self._lock:
            for r in req_ids:
                oid = self._by_req.get(r)
                if oid is not None:
                    self._offers[oid].seen_finished = True

    def poll(self) -> Set[str]:
        """One non-blocking pass: settles, drains, applies deadlines; the
        requests whose blocks vLLM may free now (each reported once)."""
        now = self._clock()
        done: Set[str] = set()
        with self._lock:
            for oid, o in list(self._offers.items()):
                self._advance(oid, o, now)
                if isinstance(o.state, Free) and o.seen_finished:
                    done.add(o.req_id)
                    del self._offers[oid]
                    self._by_req.pop(o.req_id, None)
            self.counters["reported"] += len(done)
        return done

    def _advance(self, oid: str, o: _Offer, now: float) -> None:
        s = o.state
        if isinstance(s, Waiting):
            if now - s.since >= self.limits.unclaimed_s:
                logger.warning("kv_transfer.vllm: offer for %s unclaimed after %.0f s: withdrawn (never exposed)",
                               o.req_id, now - s.since)
                o.state = Free("withdrawn")
                self.counters["withdrawn"] += 1
                self.counters["expired"] += 1
        elif isinstance(s, Exposed):
            if not self._settled(o, s) and now - s.since >= self.limits.exposed_s:
                logger.warning("kv_transfer.vllm: exposure for %s without its DONE after %.0f s: aborted "
                               "(its blocks come back only when proven)", o.req_id, now - s.since)
                self._abort(o, s, now)
                self.counters["expired"] += 1
        elif isinstance(s, Draining):
            if s.lease.drained:
                o.state = Free("drained")
                self._unuse(s.peer_key)
                self.counters["drained"] += 1
            elif not s.warned and now - s.since >= self.limits.exposed_s:
                s.warned = True
                logger.warning("kv_transfer.vllm: %s's blocks not proven free %.0f s after the abort: held",
                               o.req_id, now - s.since)

    def _settled(self, o: _Offer, s: Exposed) -> bool:
        """Frees the offer if the decode's DONE has settled its exposure."""
        if not s.lease.try_settle():
            return False
        s.lease.release()
        o.state = Free("done")
        self._unuse(s.peer_key)
        self.counters["settled_by_done"] += 1
        return True

    def _abort(self, o: _Offer, s: Exposed, now: float) -> None:
        s.lease.abort()
        o.state = Draining(s.backend, s.lease, now, s.peer_key)
        self.counters["aborted"] += 1

    def _unuse(self, key: tuple) -> None:
        """An offer no longer uses its peer entry: the last one drops it."""
        if not key:
            return
        left = self._peer_uses.get(key, 0) - 1
        if left > 0:
            self._peer_uses[key] = left
            return
        self._peer_uses.pop(key, None)
        self._peers.pop(key, None)
        for name in [n for n, keys in self._peers_of.items() if key in keys]:
            self._peers_of[name].discard(key)
            if not self._peers_of[name]:
                del self._peers_of[name]

    def held(self) -> Dict[str, int]:
        """Offers by state (``waiting``, ``exposed``, ``draining``, ``free``)."""
        out = {"waiting": 0, "exposed": 0, "draining": 0, "free": 0}
        with self._lock:
            for o in self._offers.values():
                out[type(o.state).__name__.lower()] += 1
        return out

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._offers)

    # --- the decode's side (the side port) ---------------------------------
    def claim(self, req: "wire.Fetch", claimant: str) -> Dict[str, Any]:
        """Exposes the offer's blocks to the peer that presents it (``claimant``:
        the name its control-plane handshake proved); the reply frame. The
        blocks are reserved before the peer enters the table, so a claim
        that cannot be served buys no entry."""
        side = self.sides.get(req.backend)
        if side is None:
            return self._refuse("backend", f"this prefill does not serve {req.backend!r}")
        endpoint, pool = side
        with self._lock:
            o = self._offers.get(req.offer)
            if o is None:
                return self._refuse("unknown_offer", "no such offer (never made, or already freed)")
            s = o.state
            if not isinstance(s, Waiting):
                kind = "claimed" if isinstance(s, (Exposed, Draining)) else "released"
                return self._refuse(kind, f"the offer is {type(s).__name__.lower()}")
            if req.pages < 1 or req.skip + req.pages != len(s.blocks):
                return self._refuse("pages", f"the decode asks for {req.pages} blocks after {req.skip}, the offer "
                                             f"has {len(s.blocks)}")
            try:
                # Only the blocks the decode lacks (its prefix cache holds
                # the first ``skip``); the rest go back with the offer.
                lease = pool.reserve(list(s.blocks[req.skip:]))
            except kv_transfer.AdmissionRefused as e:
                # A block another offer shares (a cached prefix) is exposed
                # to its claimant now: the decode asks again shortly.
                return self._refuse("busy", f"a block is exposed for another offer: {e}")
            except kv_transfer.KvTransferError as e:
                # The pool failed otherwise (not a busy block). Nothing is
                # exposed; the offer stays for a proof-carrying release.
                logger.error("kv_transfer.vllm: cannot reserve %s's blocks: %s", o.req_id, e)
                return self._refuse("expose", str(e))
            key = (req.backend, req.descriptor)
            peer = self._peer(key, endpoint, claimant)
            if isinstance(peer, dict):
                lease.release()  # reserved, never exposed
                return peer
            try:
                remote = endpoint.expose(lease, peer)
            except kv_transfer.KvTransferError as e:
                if lease.state == "reserved":
                    lease.release()  # nothing exposed: the offer stays claimable
                    self._unuse(key)
                else:
                    o.state = Draining(req.backend, lease, self._clock(), key)
                    self.counters["aborted"] += 1
                return self._refuse("expose", str(e))
            o.state = Exposed(req.backend, lease, self._clock(), claimant, key)
            self.counters["claimed"] += 1
        return wire.ok(remote=remote.to_bytes(), descriptor=endpoint.descriptor())

    def _peer(self, key: tuple, endpoint: Any, claimant: str) -> Any:
        """The peer id of ``key`` for one more offer (added if new, within
        the claimant's share and the table's cap), or a refusal."""
        pid = self._peers.get(key)
        if pid is None:
            mine = self._peers_of.get(claimant, set())
            if len(mine) >= self.limits.max_peers_per_name or len(self._peers) >= self.limits.max_peers:
                return self._refuse("peer", f"peer table full for {claimant!r} (rule 9: a peer's input buys "
                                            "only its share)")
            try:
                pid = endpoint.add_peer(key[1])
            except kv_transfer.KvTransferError as e:
                return self._refuse("peer", str(e))
            self._peers[key] = pid
            self._peers_of.setdefault(claimant, set()).add(key)
        self._peer_uses[key] = self._peer_uses.get(key, 0) + 1
        return pid

    def peers(self) -> int:
        """Entries in the peer table (each used by a live offer)."""
        with self._lock:
            return len(self._peers)

    def release(self, req: "wire.Release", peer: str) -> Dict[str, Any]:
        """The decode will not read: withdraw a waiting offer (never
        exposed: any authenticated peer may), abort an exposed one (only its
        claimant, ``peer`` being the name its handshake proved)."""
        with self._lock:
            o = self._offers.get(req.offer)
            if o is not None:
                s = o.state
                if isinstance(s, Waiting):
                    o.state = Free("released")
                    self.counters["released_by_decode"] += 1
                elif isinstance(s, Exposed) and s.claimant != peer:
                    self.counters["refused_releases"] += 1
                    return wire.refused("not_claimant", "only the peer that claimed an offer may release it")
                elif isinstance(s, Exposed) and not self._settled(o, s):
                    self._abort(o, s, self._clock())
        return wire.ok()

    def _refuse(self, kind: str, message: str) -> Dict[str, Any]:
        self.counters["refused_fetches"] += 1
        return wire.refused(kind, message)

    def abort_all(self) -> None:
        """Shutdown: every exposure aborted (its pages stay quarantined until
        proven), every waiting offer withdrawn."""
        with self._lock:
            now = self._clock()
            for o in self._offers.values():
                if isinstance(o.state, Exposed):
                    self._abort(o, o.state, now)
                elif isinstance(o.state, Waiting):
                    o.state = Free("withdrawn")


def summarize(offers: Optional[PrefillOffers]) -> Dict[str, Any]:
    if offers is None:
        return {}
    out: Dict[str, Any] = {f"offers_{k}": v for k, v in offers.counters.items()}
    out.update({f"offers_{k}_now": v for k, v in offers.held().items()})
    return out

