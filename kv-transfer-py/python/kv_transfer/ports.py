"""Admission for the ports kv_transfer listens on (SGLang's prefill
control port and the bootstrap server): a peer's connections buy only that
peer's share, bounded (DESIGN.md rule 9).

A peer here is the source address the kernel reports for the connection
(what the local side accepted), never a name the peer sends. Every accepted
connection is:

- admitted against a cap on connections in all and per address (a refusal
  is a close, counted, logged); at the cap in all, the oldest connection
  that has completed no request yet gives way to the newcomer (shut down,
  counted), so many source addresses, each under its own cap, cannot hold
  the port full and keep an honest peer out (issue 46, attack 8): they
  would have to open a cap's worth of connections within one honest
  request (about a millisecond), not just hold them;
- served by a bounded pool of worker threads (at most one per admitted
  connection, so no connection waits behind another's slow bytes);
- cut at an idle timeout (the socket's own timeout, per read) and at a
  whole-message deadline (a reaper shuts the socket down, so a peer that
  drips a byte just before each idle timeout is cut all the same);
- charged, before a frame body is read, for the frame's declared size
  against a byte budget in all and per address.

Nothing here imports an engine: kv_transfer.sglang and kv_transfer.vllm listen
through it, and the hostile tests drive it alone.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

logger = logging.getLogger("kv_transfer.ports")


@dataclass(frozen=True)
class ServerLimits:
    """What one listening port grants its peers. ``enforce=False`` is the
    explicit opt-out (the hostile tests' positive control): a thread per
    connection, no caps, no deadline, only the per-read idle timeout that
    the old servers had."""

    #: Connections (and worker threads) served at once, all peers together.
    #: At the cap the oldest unserved one gives way (see ``evict_unserved``).
    max_connections: int = 128
    #: Connections served at once from one source address.
    max_per_address: int = 32
    #: Longest silence between two reads of a connection.
    idle_timeout_s: float = 10.0
    #: Longest a whole connection (request and reply) may take.
    message_deadline_s: float = 15.0
    #: Frame bytes being received at once, all peers together.
    max_inflight_bytes: int = 1 << 30
    #: Frame bytes being received at once from one source address.
    max_inflight_bytes_per_address: int = 256 << 20
    #: False: the old behaviour (no caps, no deadline), for positive controls only.
    enforce: bool = True
    #: At ``max_connections``, the oldest connection that has completed no
    #: request (see :meth:`ConnectionGuard.mark_served`) is shut down
    #: (``evicted_unserved``) and the new one admitted; with none such, the
    #: new one is refused. False: the new one is refused
    #: (``refused_busy``), the old behaviour, for positive controls only.
    evict_unserved: bool = True

    @classmethod
    def from_env(cls) -> "ServerLimits":
        """The defaults, each overridable from the environment for operators:
        ``KV_TRANSFER_PORT_MAX_CONNECTIONS``, ``KV_TRANSFER_PORT_MAX_PER_ADDRESS``,
        ``KV_TRANSFER_PORT_IDLE_S``, ``KV_TRANSFER_PORT_DEADLINE_S``. There
        is no environment switch for ``enforce`` or ``evict_unserved``."""
        d = cls()

        def get(name: str, default: Any, kind: type) -> Any:
            v = os.environ.get(f"KV_TRANSFER_PORT_{name}")
            try:
                return kind(v) if v else default
            except ValueError:
                logger.warning("kvtransfer: ignoring KV_TRANSFER_PORT_%s=%r (not a %s)", name, v, kind.__name__)
                return default

        return cls(
            max_connections=max(1, get("MAX_CONNECTIONS", d.max_connections, int)),
            max_per_address=max(1, get("MAX_PER_ADDRESS", d.max_per_address, int)),
            idle_timeout_s=max(0.01, get("IDLE_S", d.idle_timeout_s, float)),
            message_deadline_s=max(0.01, get("DEADLINE_S", d.message_deadline_s, float)),
        )


class Ticket:
    """One admitted connection: its address, socket, deadline, the frame
    bytes it holds in the budget, and whether it has completed a request
    (``served``: then it no longer gives way to newcomers)."""

    __slots__ = ("addr", "sock", "deadline", "held_bytes", "done", "seq", "served")

    def __init__(self, addr: str, sock: socket.socket, deadline: float, seq: int):
        self.addr = addr
        self.sock = sock
        self.deadline = deadline
        self.held_bytes = 0
        #: Its slot is back (released, or evicted); its bytes go back at release.
        self.done = False
        self.seq = seq
        self.served = False


class ConnectionGuard:
    """Counts, caps and reaps the connections of one port. Thread-safe."""

    def __init__(self, name: str, limits: ServerLimits, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.limits = limits
        self._clock = clock
        self._lock = threading.Condition()
        self._per_addr: Dict[str, int] = {}
        self._bytes_per_addr: Dict[str, int] = {}
        self._bytes = 0
        self._active = 0
        self._heap: List[Tuple[float, int, Ticket]] = []
        #: The admitted connections holding a slot, oldest first (seq -> ticket).
        self._live: Dict[int, Ticket] = {}
        self._seq = itertools.count()
        self._closed = False
        self.counters: Dict[str, int] = {
            "accepted": 0,
            "refused_busy": 0,
            "evicted_unserved": 0,
            "refused_per_address": 0,
            "refused_oversize": 0,
            "refused_byte_budget": 0,
            "idle_timeouts": 0,
            "deadline_cuts": 0,
            "active_peak": 0,
        }
        self._reaper: Optional[threading.Thread] = None
        if limits.enforce:
            self._reaper = threading.Thread(target=self._reap, name=f"kvt-{name}-reaper", daemon=True)
            self._reaper.start()

    # --- admission -------------------------------------------------------
    def admit(self, sock: socket.socket, addr: str) -> Optional[Ticket]:
        """A ticket for a new connection, or None (counted, logged) at a cap.
        At the cap in all, the oldest connection that has completed no
        request gives way (its socket shut down, ``evicted_unserved``) when
        the limits allow it; the cap per address is always a refusal."""
        lim = self.limits
        victim: Optional[Ticket] = None
        with self._lock:
            if lim.enforce:
                refused = ""
                # The address's own cap first: an address at its cap is
                # refused, and evicts nobody on its way out.
                if self._per_addr.get(addr, 0) >= lim.max_per_address:
                    self.counters["refused_per_address"] += 1
                    refused = "per_address"
                elif self._active >= lim.max_connections:
                    if lim.evict_unserved:
                        victim = next((x for x in self._live.values() if not x.served), None)
                    if victim is None:
                        self.counters["refused_busy"] += 1
                        refused = "busy"
                    else:
                        # Its slot is the newcomer's now; its worker, woken by
                        # the shutdown below, ends and gives its bytes back
                        # (release() finds the slot released already).
                        self._free_slot(victim)
                        self.counters["evicted_unserved"] += 1
                if refused:
                    logger.debug("kvtransfer %s: refused a connection from %s (%s cap)", self.name, addr, refused)
                    return None
            self._active += 1
            self._per_addr[addr] = self._per_addr.get(addr, 0) + 1
            self.counters["accepted"] += 1
            self.counters["active_peak"] = max(self.counters["active_peak"], self._active)
            t = Ticket(addr, sock, self._clock() + lim.message_deadline_s, next(self._seq))
            self._live[t.seq] = t
            if lim.enforce:
                if len(self._heap) > 4 * lim.max_connections + 64:
                    # Connections that ended early wait in the heap for their deadline;
                    # drop them so that fast open-close churn keeps the heap bounded.
                    self._heap = [x for x in self._heap if not x[2].done]
                    heapq.heapify(self._heap)
                heapq.heappush(self._heap, (t.deadline, t.seq, t))
                self._lock.notify_all()
        if victim is not None:
            logger.debug("kvtransfer %s: connection cap reached: an unserved connection from %s gives way to %s",
                         self.name, victim.addr, addr)
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        sock.settimeout(lim.idle_timeout_s)
        return t

    def mark_served(self, t: Optional[Ticket] = None) -> None:
        """``t`` (default: this worker's connection) has completed a request
        (read it whole): it has proven it is no idle holder, and no longer
        gives way to a newcomer at the connection cap."""
        t = t or current_ticket()
        if t is not None:
            with self._lock:
                t.served = True

    def reserve_bytes(self, t: Ticket, n: int, max_frame: int) -> Optional[str]:
        """Charges a frame's declared size before its body is read; returns
        None, or why it was refused (counted)."""
        lim = self.limits
        with self._lock:
            if t.done:  # evicted: its connection is being shut down
                return "the connection gave way to a newer one"
            if n > max_frame:
                self.counters["refused_oversize"] += 1
                return f"frame of {n} B exceeds {max_frame} B"
            if lim.enforce and (
                self._bytes + n > lim.max_inflight_bytes
                or self._bytes_per_addr.get(t.addr, 0) + n > lim.max_inflight_bytes_per_address
            ):
                self.counters["refused_byte_budget"] += 1
                return f"{n} B frame refused: the byte budget for {t.addr} or for all peers is spent"
            self._bytes += n
            self._bytes_per_addr[t.addr] = self._bytes_per_addr.get(t.addr, 0) + n
            t.held_bytes += n
        return None

    def _free_slot(self, t: Ticket) -> None:
        # Under the lock. Once per ticket: at its release, or earlier when it
        # is evicted (then its release gives back only its bytes).
        if t.done:
            return
        t.done = True
        self._live.pop(t.seq, None)
        self._active -= 1
        left = self._per_addr.get(t.addr, 0) - 1
        if left > 0:
            self._per_addr[t.addr] = left
        else:
            self._per_addr.pop(t.addr, None)

    def release(self, t: Ticket) -> None:
        """The connection ended: its slot (unless it was evicted) and its bytes go back."""
        with self._lock:
            self._free_slot(t)
            if t.held_bytes:
                self._bytes -= t.held_bytes
                b = self._bytes_per_addr.get(t.addr, 0) - t.held_bytes
                if b > 0:
                    self._bytes_per_addr[t.addr] = b
                else:
                    self._bytes_per_addr.pop(t.addr, None)
                t.held_bytes = 0

    def note_idle_timeout(self, t: Optional[Ticket] = None) -> None:
        """A read of ``t`` (default: this worker's connection) timed out (counted)."""
        t = t or current_ticket()
        with self._lock:
            self.counters["idle_timeouts"] += 1
        logger.debug("kvtransfer %s: connection from %s idle past %.3g s, closed", self.name,
                     t.addr if t else "?", self.limits.idle_timeout_s)

    def stats(self) -> Dict[str, int]:
        """Counters and the current load, for tests and operators."""
        with self._lock:
            out = dict(self.counters)
            out["active"] = self._active
            out["active_addresses"] = len(self._per_addr)
            out["inflight_bytes"] = self._bytes
        return out

    def close(self) -> None:
        """Stops the reaper (connections in flight end on their own)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # --- the whole-message deadline --------------------------------------
    def _reap(self) -> None:
        # One thread per port: sleeps until the earliest deadline, then shuts
        # the late sockets down, which wakes the worker blocked in recv().
        while True:
            late: List[Ticket] = []
            with self._lock:
                if self._closed:
                    return
                now = self._clock()
                while self._heap and (self._heap[0][2].done or self._heap[0][0] <= now):
                    _, _, t = heapq.heappop(self._heap)
                    if not t.done:
                        late.append(t)
                        self.counters["deadline_cuts"] += 1
                if not late:
                    wait = (self._heap[0][0] - now) if self._heap else 1.0
                    self._lock.wait(min(max(wait, 0.005), 1.0))
                    continue
            for t in late:
                logger.warning("kvtransfer %s: connection from %s passed its %.3g s deadline, cut", self.name, t.addr,
                               self.limits.message_deadline_s)
                try:
                    t.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class GuardedServerMixin:
    """A ``socketserver`` server whose connections go through a
    :class:`ConnectionGuard` and a bounded worker pool (instead of
    ``ThreadingMixIn``'s thread per connection)."""

    guard: ConnectionGuard
    _pool: Optional[ThreadPoolExecutor]

    def _init_guard(self, name: str, limits: ServerLimits) -> None:
        self.guard = ConnectionGuard(name, limits)
        # At most one worker per admitted connection: the pool never queues
        # an admitted connection behind another one.
        self._pool = ThreadPoolExecutor(limits.max_connections, f"kvt-{name}") if limits.enforce else None

    def process_request(self, request: Any, client_address: Any) -> None:  # socketserver's hook
        addr = str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
        t = self.guard.admit(request, addr)
        if t is None:
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        if self._pool is not None:
            self._pool.submit(self._work, request, client_address, t)
        else:  # the opt-out: the old thread per connection
            threading.Thread(target=self._work, args=(request, client_address, t), daemon=True).start()

    def _work(self, request: Any, client_address: Any, t: Ticket) -> None:
        # The handler runs on this thread and charges its frames to the ticket.
        _current.ticket = t
        try:
            self.finish_request(request, client_address)  # type: ignore[attr-defined]
        except socket.timeout:
            self.guard.note_idle_timeout(t)
        except Exception as e:  # a handler must never take the worker down
            logger.debug("kvtransfer %s: connection from %s ended: %s", self.guard.name, t.addr, e)
        finally:
            _current.ticket = None
            self.guard.release(t)
            self.shutdown_request(request)  # type: ignore[attr-defined]

    def close_guard(self) -> None:
        """Stops the reaper and the pool (without waiting for workers)."""
        self.guard.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


_current = threading.local()


def current_ticket() -> Optional[Ticket]:
    """The ticket of the connection this worker thread serves (None outside a guarded server)."""
    return getattr(_current, "ticket", None)


class FramePort:
    """A listening port that answers one request frame per connection with
    one JSON reply, every connection admitted through a
    :class:`ConnectionGuard` and every frame's declared size charged before
    its body is read. ``handle(data, peer)`` returns the reply (a dict);
    an exception from it is logged and answered as ``bad_request``."""

    def __init__(
        self,
        name: str,
        handle: Callable[[bytes, str], Dict[str, Any]],
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Optional[ServerLimits] = None,
        max_frame: int = 1 << 20,
    ):
        import json
        import socketserver

        from .frames import ProtocolError, recv_frame, send_frame

        self.max_frame = max_frame
        self.bad_requests = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                conn, peer = self.request, str(self.client_address[0])
                t = current_ticket()
                guard = outer._server.guard

                def reserve(n: int) -> Optional[str]:
                    return None if t is None else guard.reserve_bytes(t, n, outer.max_frame)

                try:
                    data = recv_frame(conn, outer.max_frame, reserve)
                    if t is not None:  # read whole: from here it is ours to answer, not to evict
                        guard.mark_served(t)
                    reply = handle(data, peer)
                except ProtocolError as e:
                    if t is not None and t.done:  # it gave way to a newer connection (the guard counted it)
                        return
                    outer.bad_requests += 1
                    logger.warning("kv_transfer %s: refused a request from %s: %s", name, peer, e)
                    reply = {"ok": False, "error": "bad_request", "message": str(e)[:512]}
                try:
                    send_frame(conn, json.dumps(reply).encode())
                except OSError:
                    pass

        class Server(GuardedServerMixin, socketserver.TCPServer):
            allow_reuse_address = True
            request_queue_size = 1024  # refusals are ours (counted), not the kernel's backlog

        self._server = Server((host, port), Handler, bind_and_activate=False)
        self._server._init_guard(name, limits or ServerLimits.from_env())
        try:
            self._server.server_bind()
            self._server.server_activate()
        except OSError:
            self._server.close_guard()
            self._server.server_close()
            raise
        self.address: Tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name=f"kvt-{name}", daemon=True
        )
        self._thread.start()

    def stats(self) -> Dict[str, int]:
        out = dict(self._server.guard.stats())
        out["bad_requests"] = self.bad_requests
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.close_guard()
        self._server.server_close()
