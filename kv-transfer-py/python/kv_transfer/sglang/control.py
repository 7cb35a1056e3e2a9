"""The prefill's control port: decode workers send one metadata request
per request (where its pages are exposed) over their one authenticated
connection to this prefill (:mod:`kv_transfer.peers`: the handshake, the
session, the per-peer budgets); the prefill answers ``{"ok": true}`` or a
typed error.

What a peer (the name its handshake proved) can make the prefill keep is
bounded (DESIGN.md rule 9):

- a request's declared size is charged to the peer's and the port's byte
  budgets before its body is read (:mod:`kv_transfer.peers`), and its JSON
  shape is checked before it is parsed (:func:`wire.check_shape`);
- a room is kept for a request this prefill serves: a room SGLang gave a
  sender for (:meth:`RoomTable.expect`) is filled at once; metadata for a
  room no sender asked for yet (the decode may be first) waits in that
  peer's pending share, capped in rooms and bytes, and expires after
  ``pending_ttl_s``; at a cap it is refused, typed and counted;
- a room is filled once: a second metadata for it is refused (first writer
  wins), so no later claimant redirects a request's KV;
- the decode's descriptor is added as a peer (``add_peer``: a connection,
  threads) only once a sender claims the room: metadata for a room nobody
  has buys no peer.

Forgetting pending metadata is safe: it is not a tombstone. A request whose
metadata expired is never written; the decode's own deadline aborts it and
its pages stay quarantined until a proof. Nothing here imports SGLang.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import kv_transfer

from . import wire
from ..peers import ControlPlane, PlaneLimits

logger = logging.getLogger("kv_transfer.sglang")


@dataclass(frozen=True)
class RoomLimits:
    """What one decode peer's metadata may hold on a prefill before a sender
    claims it. ``enforce=False`` is the explicit opt-out (positive control):
    the old table, every room kept for good, a later metadata replacing an
    earlier one."""

    #: Unclaimed rooms per peer address.
    max_pending_per_peer: int = 256
    #: Bytes (frame sizes) of unclaimed rooms per peer address.
    max_pending_bytes_per_peer: int = 256 << 20
    #: Unclaimed rooms in all (many addresses together).
    max_pending: int = 4096
    #: Bytes of unclaimed rooms in all.
    max_pending_bytes: int = 1 << 30
    #: How long unclaimed metadata waits for its sender.
    pending_ttl_s: float = 120.0
    #: Rooms whose sender failed (aborted) remembered, so that a decode's
    #: metadata arriving after the failure is refused at once instead of
    #: waiting for a sender that will never come (the oldest is forgotten
    #: first: that costs the late decode its waiting timeout, never safety).
    max_failed_rooms: int = 4096
    #: False: the old behaviour, for positive controls only.
    enforce: bool = True


#: How often (at most) the room table looks for expired pending metadata.
SWEEP_EVERY_S = 1.0


class RoomRefused(wire.ProtocolError):
    """Metadata refused by the room table (``kind``: ``duplicate``,
    ``peer_rooms``, ``peer_bytes``, ``total``, ``failed``)."""

    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind


class _Entry:
    __slots__ = ("peer", "nbytes", "value", "expires", "pending")

    def __init__(self, peer: str, nbytes: int, expires: float):
        self.peer = peer
        self.nbytes = nbytes
        self.value: Any = None  # None while reserved (validation in progress)
        self.expires = expires
        self.pending = True


class RoomTable:
    """room -> the decode's exposure for it, bounded per peer (see the module)."""

    def __init__(self, limits: RoomLimits = RoomLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._expected: Set[int] = set()
        self._entries: Dict[int, _Entry] = {}
        # Rooms whose sender failed, oldest first (bounded: max_failed_rooms).
        self._failed: "OrderedDict[int, None]" = OrderedDict()
        # peer -> (pending rooms, pending bytes)
        self._pending: Dict[str, List[int]] = {}
        self._pending_rooms = 0
        self._pending_bytes = 0
        self._next_sweep = 0.0
        self.counters: Dict[str, int] = {
            "rooms_filled": 0,
            "rooms_claimed_from_pending": 0,
            "rooms_expired": 0,
            "refused_duplicate_room": 0,
            "refused_peer_rooms": 0,
            "refused_peer_bytes": 0,
            "refused_pending_total": 0,
            "refused_failed_room": 0,
        }

    # --- pending accounting (under the lock) ------------------------------
    def _charge(self, e: _Entry, sign: int) -> None:
        acct = self._pending.setdefault(e.peer, [0, 0])
        acct[0] += sign
        acct[1] += sign * e.nbytes
        self._pending_rooms += sign
        self._pending_bytes += sign * e.nbytes
        if acct[0] <= 0:
            self._pending.pop(e.peer, None)

    def _unpend(self, e: _Entry) -> None:
        if e.pending:
            e.pending = False
            if self.limits.enforce:
                self._charge(e, -1)

    def _sweep(self, now: float) -> None:
        # Expiry is lazy (no timer thread), and a pass over the table at most
        # once per SWEEP_EVERY_S, so a flood of refused messages stays O(1) each.
        if not self.limits.enforce or not self._pending_rooms or now < self._next_sweep:
            return
        self._next_sweep = now + min(SWEEP_EVERY_S, self.limits.pending_ttl_s)
        for room in [r for r, e in self._entries.items() if e.pending and e.value is not None and e.expires <= now]:
            e = self._entries.pop(room)
            self._unpend(e)
            self.counters["rooms_expired"] += 1

    # --- the prefill's side -----------------------------------------------
    def expect(self, room: int) -> None:
        """A sender for ``room`` exists: its metadata is kept (and is no longer pending)."""
        with self._lock:
            self._expected.add(room)
            e = self._entries.get(room)
            if e is not None and e.pending:
                self._unpend(e)
                self.counters["rooms_claimed_from_pending"] += 1

    def get(self, room: int) -> Any:
        """The room's exposure once validated, else None."""
        with self._lock:
            e = self._entries.get(room)
            return None if e is None else e.value

    def forget(self, room: int, failed: bool = False) -> None:
        """The sender concluded: the room and its expectation go. ``failed``:
        it failed (aborted), and metadata for the room arriving later is
        refused (``RoomRefused("failed")``) so the decode stops waiting."""
        with self._lock:
            self._expected.discard(room)
            e = self._entries.pop(room, None)
            if e is not None:
                self._unpend(e)
            if failed and self.limits.enforce and self.limits.max_failed_rooms > 0:
                self._failed[room] = None
                self._failed.move_to_end(room)
                while len(self._failed) > self.limits.max_failed_rooms:
                    self._failed.popitem(last=False)

    # --- the peer's side ---------------------------------------------------
    def reserve(self, room: int, peer: str, nbytes: int) -> _Entry:
        """Admits metadata for ``room`` from ``peer`` before it is validated
        (so a refused flood costs no validation, no ``add_peer``); raises
        :class:`RoomRefused` (counted) at a cap or for a filled room."""
        lim = self.limits
        with self._lock:
            now = self._clock()
            self._sweep(now)
            if room in self._failed:
                self.counters["refused_failed_room"] += 1
                raise RoomRefused("failed", f"room {room}'s sender failed (aborted) on this prefill")
            old = self._entries.get(room)
            if old is not None and lim.enforce:
                self.counters["refused_duplicate_room"] += 1
                raise RoomRefused("duplicate", f"room {room} already has its metadata (first writer wins)")
            e = _Entry(peer, nbytes, now + lim.pending_ttl_s)
            if room in self._expected or not lim.enforce:
                e.pending = False
            else:
                rooms, nb = self._pending.get(peer, (0, 0))
                kind = ""
                if rooms + 1 > lim.max_pending_per_peer:
                    kind, msg = "peer_rooms", f"{rooms} rooms from {peer} wait for a sender (cap {lim.max_pending_per_peer})"
                elif nb + nbytes > lim.max_pending_bytes_per_peer:
                    kind, msg = "peer_bytes", f"{nb} B from {peer} wait for a sender (cap {lim.max_pending_bytes_per_peer} B)"
                elif (self._pending_rooms + 1 > lim.max_pending
                      or self._pending_bytes + nbytes > lim.max_pending_bytes):
                    kind, msg = "pending_total", "the prefill's table of rooms without a sender is full"
                if kind:
                    self.counters[f"refused_{kind}"] += 1
                    raise RoomRefused(kind, msg)
                self._charge(e, +1)
            if old is not None:  # the opt-out only: a later claimant replaces
                self._unpend(old)
            self._entries[room] = e
            return e

    def replace(self, room: int, old: Any, value: Any) -> None:
        """The room's value ``old`` becomes ``value`` (if it is still ``old``)."""
        with self._lock:
            e = self._entries.get(room)
            if e is not None and e.value is old:
                e.value = value

    def commit(self, room: int, e: _Entry, value: Any) -> None:
        """Validation passed: the room holds ``value``."""
        with self._lock:
            if self._entries.get(room) is e:
                e.value = value
                self.counters["rooms_filled"] += 1

    def cancel(self, room: int, e: _Entry) -> None:
        """Validation failed: the reservation goes, nothing is kept."""
        with self._lock:
            if self._entries.get(room) is e:
                del self._entries[room]
                self._unpend(e)

    def stats(self) -> Dict[str, int]:
        """Counters, rooms held and rooms and bytes pending."""
        with self._lock:
            out = dict(self.counters)
            out["rooms"] = len(self._entries)
            out["rooms_pending"] = sum(1 for e in self._entries.values() if e.pending)
            out["pending_bytes"] = sum(e.nbytes for e in self._entries.values() if e.pending)
            out["pending_peers"] = len(self._pending)
        return out


#: A validated exposure: (peer id, kv, aux, prefix_len, state exposures).
Target = Tuple[int, Any, Any, int, List[Any]]


class _Unresolved:
    """Checked metadata of a room no sender claimed yet: its descriptor is
    not added as a peer until one does."""

    __slots__ = ("descriptor", "rest")

    def __init__(self, descriptor: bytes, rest: Tuple[Any, Any, int, List[Any]]):
        self.descriptor = descriptor
        self.rest = rest


class PrefillControlPlane:
    """The prefill's control port and room table over an endpoint and its
    pools (the SGLang manager owns one; tests drive it without SGLang)."""

    def __init__(
        self,
        endpoint: Any,
        kv_pool: Any,
        aux_pool: Any = None,
        state_pools: Optional[List[Any]] = None,
        host: str = "127.0.0.1",
        plane: Optional[ControlPlane] = None,
        room_limits: RoomLimits = RoomLimits(),
        max_frame: int = wire.MAX_FRAME,
    ):
        self.endpoint = endpoint
        self.kv_pool = kv_pool
        self.aux_pool = aux_pool
        self.state_pools = list(state_pools or [])
        self.max_frame = max_frame
        self.rooms = RoomTable(room_limits)
        self._lock = threading.Lock()
        self.counters: Dict[str, int] = {"bad_control_messages": 0, "peers_added_on_claim": 0}
        self._own_plane = plane is None
        self.plane = plane if plane is not None else ControlPlane(
            f"prefill-{endpoint.name}", limits=PlaneLimits(max_frame=max_frame))
        # The handler never blocks (the decode's add_peer waits for the room's
        # sender, in target_of): it runs on the plane's loop, no thread hop.
        self.address: Tuple[str, int] = self.plane.serve(host, 0, self._on_request, inline=True)

    # --- the port ----------------------------------------------------------
    def _on_request(self, peer: str, data: bytes) -> bytes:
        """One decode request's metadata from ``peer`` (the name its
        handshake proved), on the control plane's handler pool."""
        try:
            self.handle_metadata(data, peer)
        finally:
            del data
        return b'{"ok": true}'

    def _count_bad(self, e: Exception) -> None:
        with self._lock:
            self.counters["bad_control_messages"] += 1
        logger.warning("kvtransfer: refused a control message: %s", e)

    # --- metadata ------------------------------------------------------------
    def handle_metadata(self, data: bytes, peer: str = "local") -> None:
        """One decode request's exposure from ``peer`` (the name its
        handshake proved). A malformed, mismatched or refused message raises
        a typed error, is counted, and changes nothing."""
        held: List[Any] = []  # (room, entry) once admitted

        def admit(room: int) -> None:
            # Before the exposures are decoded: a refused flood costs no decoding, no add_peer.
            held.append((room, self.rooms.reserve(room, peer, len(data))))

        try:
            md = wire.parse_metadata(data, admit)
            # The decode's descriptor becomes a peer when the room's sender
            # first asks for it (target_of), never here: nothing on the
            # control plane's loop blocks, and a room nobody claims buys no peer.
            checked = self._check(md)
            # The positive control (the old table) adds every decode as a peer at once.
            self.rooms.commit(md.room, held[0][1], checked if self.rooms.limits.enforce else self._resolve(checked))
        except (wire.ProtocolError, kv_transfer.KvTransferError) as e:
            if held:
                self.rooms.cancel(*held[0])
            self._count_bad(e)
            raise

    def _check(self, md: wire.Metadata) -> _Unresolved:
        # Empty: the decode exposed no KV page (its prefix cache holds them all).
        kv = kv_transfer.RemotePages.from_bytes(md.kv) if md.kv else None
        if kv is not None and kv.buffers != self.kv_pool.buffers:
            raise wire.ProtocolError(f"the decode exposed {kv.buffers} KV buffers, this prefill has {self.kv_pool.buffers}")
        aux = kv_transfer.RemotePages.from_bytes(md.aux) if md.aux is not None else None
        if aux is not None and (self.aux_pool is None or aux.buffers != self.aux_pool.buffers or aux.pages != 1):
            raise wire.ProtocolError("the decode's aux exposure does not match this prefill's aux buffers")
        state: List[Any] = []
        for t, raw in enumerate(md.state):
            if raw is None:
                state.append(None)
                continue
            pool = self.state_pools[t] if t < len(self.state_pools) else None
            remote = kv_transfer.RemotePages.from_bytes(raw)
            if pool is None or remote.buffers != pool.buffers:
                raise wire.ProtocolError(f"the decode's state exposure {t} does not match this prefill's state buffers")
            state.append(remote)
        return _Unresolved(md.descriptor, (kv, aux, md.prefix_len, state))

    def _resolve(self, checked: _Unresolved) -> Target:
        """Adds the decode as a peer (once a sender claims its room)."""
        peer = self.endpoint.add_peer(checked.descriptor)
        with self._lock:
            self.counters["peers_added_on_claim"] += 1
        kv, aux, prefix_len, state = checked.rest
        return (peer, kv, aux, prefix_len, state)

    # --- the senders' side ---------------------------------------------------
    def expect_room(self, room: int) -> None:
        """SGLang made a sender for ``room``: its metadata is kept."""
        self.rooms.expect(room)

    def target_of(self, room: int) -> Optional[Target]:
        """The room's validated exposure, or None (not arrived yet). Metadata
        that arrived before its sender is resolved here, once (the decode's
        descriptor added as a peer); if that fails the room fails."""
        value = self.rooms.get(room)
        if not isinstance(value, _Unresolved):
            return value
        try:
            target = self._resolve(value)
        except kv_transfer.KvTransferError as e:
            self._count_bad(e)
            self.rooms.forget(room, failed=True)
            return None
        self.rooms.replace(room, value, target)
        return target

    def forget_room(self, room: int, failed: bool = False) -> None:
        """The room's sender concluded (``failed``: it failed or was aborted)."""
        self.rooms.forget(room, failed)

    def stats(self) -> Dict[str, int]:
        """The control plane's and the room table's counters (refusals,
        cuts, handshakes, load)."""
        out = {f"ctrl_{k}": v for k, v in self.plane.stats().items()}
        out.update({f"ctrl_{k}": v for k, v in self.rooms.stats().items()})
        with self._lock:
            out.update(self.counters)
        return out

    def close(self) -> None:
        """Stops listening (a plane given to it is the giver's to close)."""
        if self._own_plane:
            self.plane.close()
