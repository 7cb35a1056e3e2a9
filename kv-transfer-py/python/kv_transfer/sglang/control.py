"""The prefill's control port: decode workers send one metadata frame per
request (where its pages are exposed), the prefill answers ``{"ok": true}``
or a typed error.

What a peer (a source address, as the kernel reports it) can make the
prefill keep is bounded (DESIGN.md rule 9):

- a frame's size and JSON shape are checked before it is parsed
  (:func:`wire.check_shape`), its declared size charged to the port's byte
  budget before its body is read (:mod:`guard`);
- a room is kept for a request this prefill serves: a room SGLang gave a
  sender for (:meth:`RoomTable.expect`) is filled at once; metadata for a
  room no sender asked for yet (the decode may be first) waits in that
  peer's pending share, capped in rooms and bytes, and expires after
  ``pending_ttl_s``; at a cap it is refused, typed and counted;
- a room is filled once: a second metadata for it is refused (first writer
  wins), so no later claimant redirects a request's KV.

Forgetting pending metadata is safe: it is not a tombstone. A request whose
metadata expired is never written; the decode's own deadline aborts it and
its pages stay quarantined until a proof. Nothing here imports SGLang.
"""

from __future__ import annotations

import json
import logging
import socketserver
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import kv_transfer

from . import wire
from ..ports import GuardedServerMixin, ServerLimits, current_ticket

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
        server_limits: Optional[ServerLimits] = None,
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
        self.counters: Dict[str, int] = {"bad_control_messages": 0}
        plane = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                plane._serve(self.request, str(self.client_address[0]))

        class Server(GuardedServerMixin, socketserver.TCPServer):
            allow_reuse_address = True
            request_queue_size = 1024  # refusals are ours (counted), not the kernel's backlog

        self._server = Server((host, 0), Handler, bind_and_activate=False)
        self._server._init_guard("ctrl", server_limits or ServerLimits.from_env())
        self._server.server_bind()
        self._server.server_activate()
        self.address: Tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kvt-ctrl", daemon=True)
        self._thread.start()

    # --- the port ----------------------------------------------------------
    def _serve(self, conn: Any, peer: str) -> None:
        t = current_ticket()
        guard = self._server.guard

        def reserve(n: int) -> Optional[str]:
            return None if t is None else guard.reserve_bytes(t, n, self.max_frame)

        try:
            data = wire.recv_frame(conn, self.max_frame, reserve)
        except wire.ProtocolError as e:
            self._count_bad(e)
            return self._reply(conn, {"error": f"{type(e).__name__}: {e}"})
        try:
            self.handle_metadata(data, peer)
            reply: Dict[str, Any] = {"ok": True}
        except (wire.ProtocolError, kv_transfer.KvTransferError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        del data
        self._reply(conn, reply)

    @staticmethod
    def _reply(conn: Any, reply: Dict[str, Any]) -> None:
        try:
            wire.send_frame(conn, json.dumps(reply).encode())
        except OSError:
            pass

    def _count_bad(self, e: Exception) -> None:
        with self._lock:
            self.counters["bad_control_messages"] += 1
        logger.warning("kvtransfer: refused a control message: %s", e)

    # --- metadata ------------------------------------------------------------
    def handle_metadata(self, data: bytes, peer: str = "local") -> None:
        """One decode request's exposure from ``peer`` (its source address).
        A malformed, mismatched or refused message raises a typed error, is
        counted, and changes nothing."""
        held: List[Any] = []  # (room, entry) once admitted

        def admit(room: int) -> None:
            # Before the exposures are decoded: a refused flood costs no decoding, no add_peer.
            held.append((room, self.rooms.reserve(room, peer, len(data))))

        try:
            md = wire.parse_metadata(data, admit)
            self.rooms.commit(md.room, held[0][1], self._validate(md))
        except (wire.ProtocolError, kv_transfer.KvTransferError) as e:
            if held:
                self.rooms.cancel(*held[0])
            self._count_bad(e)
            raise

    def _validate(self, md: wire.Metadata) -> Target:
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
        peer = self.endpoint.add_peer(md.descriptor)
        return (peer, kv, aux, md.prefix_len, state)

    # --- the senders' side ---------------------------------------------------
    def expect_room(self, room: int) -> None:
        """SGLang made a sender for ``room``: its metadata is kept."""
        self.rooms.expect(room)

    def target_of(self, room: int) -> Optional[Target]:
        """The room's validated exposure, or None (not arrived yet)."""
        return self.rooms.get(room)

    def forget_room(self, room: int, failed: bool = False) -> None:
        """The room's sender concluded (``failed``: it failed or was aborted)."""
        self.rooms.forget(room, failed)

    def stats(self) -> Dict[str, int]:
        """The port's and the room table's counters (refusals, cuts, load)."""
        out = {f"ctrl_{k}": v for k, v in self._server.guard.stats().items()}
        out.update({f"ctrl_{k}": v for k, v in self.rooms.stats().items()})
        with self._lock:
            out.update(self.counters)
        return out

    def close(self) -> None:
        """Stops listening (connections in flight end on their deadline)."""
        self._server.shutdown()
        self._server.server_close()
        self._server.close_guard()
