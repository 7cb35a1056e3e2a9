"""One control plane for the package: authenticated peers, one long-lived
connection per peer pair, requests pipelined over it, all on one event loop.

A peer is what a handshake proves (core's ``kv_transfer_core::auth``, driven
here through :class:`kv_transfer.PeerHandshake`): both ends prove they hold
the deployment's cluster key (``KV_TRANSFER_CLUSTER_KEY``; without it a loud
single-host mode), and the handshake binds both names, fresh nonces and the
``host:port`` the dialer dialed, so a relayed or replayed handshake is
refused. Every frame after it carries a tag of that session (in order, once),
so nothing outside the session can be spliced in.

Frame (after the handshake)::

    body_len:u32 | request_id:u64 | kind:u8 | body | tag (32 bytes: the session's seal of all before it)

``kind`` is REQUEST, REPLY, ERROR or GOAWAY. What a peer can make a listener hold is
its own share, bounded (DESIGN.md rule 9): handshakes in flight (in all and
per source address, each by a deadline), authenticated peers (in all, and
connections per proven name), requests in flight and their bytes (per peer
and in all, charged from the declared size before a body byte is read), a
whole-frame deadline and an idle timeout. A refusal closes the connection
and is counted (:meth:`ControlPlane.stats`). At the handshake cap in all
the oldest handshake still in flight gives way to the new connection
(closed, counted), so many source addresses, each under its own cap, cannot
hold the listener full and keep an honest peer out (issue 46, attack 8):
they would have to open a cap's worth of connections within one honest
handshake (about a millisecond), not just hold them. A listener that
lets a peer go (the peer cap's eviction, the idle timeout) does it with a
GOAWAY (empty body, request id 0) once that peer has nothing in flight:
every request the peer sent that it has not had an answer to was never
read, so the dialer sends those again on a new connection instead of
failing them. Handlers run on a
fixed pool of threads, one request at a time per peer, so a peer's slow
request waits only behind its own.

Nothing here imports an engine: ``kv_transfer.sglang`` serves and dials
through it, and its tests drive it alone.

>>> from kv_transfer.peers import ControlPlane
>>> import kv_transfer
>>> key = kv_transfer.ClusterKey.from_secret(b"a deployment's shared secret")
>>> prefill = ControlPlane("prefill", key)
>>> host, port = prefill.serve("127.0.0.1", 0, lambda peer, body: peer.encode() + b" sent " + body)
>>> decode = ControlPlane("decode", key)
>>> decode.call(host, port, b"hello", timeout=5)
b'decode sent hello'
>>> decode.close(); prefill.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import select
import socket
import struct
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import kv_transfer

logger = logging.getLogger("kv_transfer.peers")

#: The handshake's context: a handshake for another protocol is refused.
CONTEXT = "kvt-py-control-v1"
REQUEST, REPLY, ERROR, GOAWAY = 1, 2, 3, 4
#: How long a listener that sent GOAWAY keeps reading (and dropping) what
#: the peer had already sent, so that its close is a FIN, not a reset that
#: could cost the peer the GOAWAY itself.
GOAWAY_DRAIN_S = 2.0
_HDR = struct.Struct(">IQB")
TAG_LEN = 32


class RemoteError(kv_transfer.KvTransferError):
    """The peer answered a request with an error (its type and message)."""


class PlaneClosed(kv_transfer.KvTransferError):
    """The control plane, or the connection a request was on, is closed."""


@dataclass(frozen=True)
class PlaneLimits:
    """What a listener grants its peers, and how long a dialer waits."""

    #: Authenticated peers (distinct proven names) connected at once.
    max_peers: int = 256
    #: Connections held at once per proven name.
    max_links_per_peer: int = 2
    #: Handshakes in flight, all addresses together. At the cap the oldest
    #: one gives way to a new connection (see ``evict_oldest_handshake``).
    max_handshakes: int = 64
    #: Handshakes in flight from one source address.
    max_handshakes_per_address: int = 8
    #: From accept to the handshake's last byte.
    handshake_deadline_s: float = 5.0
    #: Longest silence between two frames of an authenticated connection
    #: (a dialer reconnects on its next request).
    idle_timeout_s: float = 300.0
    #: From a frame's header to its last byte.
    frame_deadline_s: float = 15.0
    #: Largest frame body.
    max_frame: int = 64 << 20
    #: Requests queued or running per peer.
    max_inflight_per_peer: int = 64
    #: Request bytes queued or running per peer.
    max_inflight_bytes_per_peer: int = 256 << 20
    #: Request bytes queued or running, all peers together.
    max_inflight_bytes: int = 1 << 30
    #: Threads that run handlers (one request at a time per peer).
    handler_threads: int = 4
    #: A dialer's default wait for a reply (connecting included).
    request_timeout_s: float = 15.0
    #: At ``max_handshakes``, the connection that has been in its handshake
    #: longest is closed (``handshakes_evicted``) and the new one admitted:
    #: a connection that has proven nothing yet holds its place only until
    #: a newer one needs it. False: the new connection is refused
    #: (``refused_handshakes_busy``), the old behaviour, for positive
    #: controls only.
    evict_oldest_handshake: bool = True
    #: A peer let go (evicted at ``max_peers``, or idle past
    #: ``idle_timeout_s``) gets a GOAWAY, and its unanswered requests are
    #: sent again. False: its connections are closed, and a request it had
    #: on the way fails (the old behaviour, for positive controls only).
    goaway: bool = True


class _PeerState:
    """One proven name's share on a listener."""

    def __init__(self, now: float) -> None:
        self.conns: List["_ServerConn"] = []
        self.inflight = 0
        self.inflight_bytes = 0
        self.last_active = now
        #: Requests waiting for the handler pool: a peer's requests run one
        #: at a time, so its slow request waits only behind its own.
        self.queue: Deque[Tuple["_ServerConn", int, bytes]] = deque()
        self.running = False


class _Service:
    """One listening port: its handler, its handshake listener, its peers."""

    def __init__(self, handler: Callable[[str, bytes], bytes], listener: Any, inline: bool = False):
        self.handler = handler
        self.inline = inline
        self.listener = listener
        self.peers: Dict[str, _PeerState] = {}
        self.handshaking: Counter = Counter()
        #: The connections in their handshake, oldest first (a dict: ordered,
        #: O(1) removal); as many as ``handshaking`` counts.
        self.in_handshake: Dict["_ServerConn", None] = {}
        self.handshakes_peak = 0
        self.inflight_bytes = 0
        self.server: Optional[asyncio.AbstractServer] = None
        self.conns: "set[_ServerConn]" = set()


class _ServerConn(asyncio.Protocol):
    """One accepted connection: the handshake, then frames, all handled
    inside the loop's ``data_received`` callback.

    Why a protocol and not streams: each turn of an asyncio loop calls
    ``select``, which lets go of the GIL, and getting it back from a busy
    thread (a serving engine's scheduler, spinning in Python) can take a
    whole switch interval (5 ms). A stream-based reader spends several
    turns per frame (a task per ``wait_for``, a wake-up per ``readexactly``,
    one per lock); here a frame that arrived whole is checked, opened,
    handled (``inline``) and answered in the one turn that read it.
    Deadlines are timers, not wrappers around each read."""

    def __init__(self, plane: "ControlPlane", service: _Service) -> None:
        self.plane = plane
        self.service = service
        self.loop = plane._loop
        self.transport: Optional[asyncio.Transport] = None
        self.buf = bytearray()
        self.src = "?"
        #: "hello" -> "finish" -> "frames" (or "closed")
        self.state = "hello"
        self.hs: Any = None
        self.session: Any = None
        self.peer = ""
        self.st: Optional[_PeerState] = None
        #: What the buffered partial frame was charged, if its header is in.
        self.partial: Optional[Tuple[int, int]] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.handshaking = False

    # --- asyncio callbacks ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        plane, service, lim = self.plane, self.service, self.plane.limits
        plane._count("connections")
        peername = transport.get_extra_info("peername")
        self.src = str(peername[0]) if peername else "?"
        # The address's own cap first: an address at its cap is refused, and
        # evicts nobody on its way out.
        if service.handshaking[self.src] >= lim.max_handshakes_per_address:
            plane._count("refused_handshakes_per_address")
            return self.close()
        if len(service.in_handshake) >= lim.max_handshakes:
            if not lim.evict_oldest_handshake or not service.in_handshake:
                plane._count("refused_handshakes_busy")
                return self.close()
            # The oldest handshake has had longest to finish and has not: it
            # gives way, so connections from many addresses that hold their
            # handshakes open cannot keep a newcomer out. Its close releases
            # its share (once: its connection_lost finds it closed).
            oldest = next(iter(service.in_handshake))
            plane._count("handshakes_evicted")
            logger.debug("kvtransfer: handshake cap reached: the oldest handshake (from %s) gives way to one from %s",
                         oldest.src, self.src)
            oldest.close()
        service.handshaking[self.src] += 1
        service.in_handshake[self] = None
        self.handshaking = True
        service.handshakes_peak = max(service.handshakes_peak, len(service.in_handshake))
        service.conns.add(self)
        self._arm(lim.handshake_deadline_s, self._handshake_late)

    def data_received(self, data: bytes) -> None:
        if self.state == "draining":  # sent before our GOAWAY reached the peer: never read
            return
        self.buf += data
        try:
            while self.state != "closed" and self._step():
                pass
        except Exception:  # noqa: BLE001 (a bug here must cost this connection only)
            logger.exception("kvtransfer: control connection from %s failed", self.src)
            self.close()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self.state in ("hello", "finish") and self.handshaking:
            # Gone before its handshake ended: what a cut read was before.
            self.service.listener.count_io_failure()
            self.plane._count("handshake_cut")
        self.close()

    def pause_writing(self) -> None:
        # The peer does not read its answers: stop reading its requests
        # until it does (what it can make us buffer stays bounded).
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and self.state != "closed":
            self.transport.resume_reading()

    # --- the steps -----------------------------------------------------------
    def _step(self) -> bool:
        """Handles one complete message from the buffer; False if none."""
        if self.state in ("hello", "finish"):
            return self._on_handshake()
        return self._on_frame()

    def _take_handshake(self) -> Optional[bytes]:
        h = kv_transfer.handshake_header_len()
        if len(self.buf) < h:
            return None
        n = kv_transfer.handshake_body_len(bytes(self.buf[:h]))  # raises PeerRefused on a bad header
        if len(self.buf) < h + n:
            return None
        msg = bytes(self.buf[:h + n])
        del self.buf[:h + n]
        return msg

    def _on_handshake(self) -> bool:
        service, plane = self.service, self.plane
        try:
            msg = self._take_handshake()
            if msg is None:
                return False
            if self.state == "hello":
                self.hs, challenge = service.listener.accept(msg, self.src)
                self.transport.write(challenge)  # type: ignore[union-attr]
                self.state = "finish"
                return True
            session = service.listener.finish(self.hs, msg)
        except kv_transfer.PeerRefused as e:
            kind = e.args[1] if len(e.args) > 1 else "malformed"
            plane._count(f"refused_{kind}")
            logger.warning("kvtransfer: control handshake from %s refused: %s", self.src, e.args[0])
            if self.transport is not None:
                self.transport.write(kv_transfer.handshake_refusal(kind))
            self.close()
            return False
        self._handshake_over()
        return self._admit(session)

    def _handshake_over(self) -> None:
        if self.handshaking:  # released once: the flag goes with the share
            self.handshaking = False
            hs = self.service.handshaking
            hs[self.src] -= 1
            if hs[self.src] <= 0:
                del hs[self.src]
            self.service.in_handshake.pop(self, None)
        self.hs = None

    def _admit(self, session: Any) -> bool:
        service, plane, lim = self.service, self.plane, self.plane.limits
        peer = session.name
        st = service.peers.get(peer)
        if st is None and len(service.peers) >= lim.max_peers and not plane._evict_idlest(service):
            plane._count("refused_peers_full")
            self.close()
            return False
        if st is not None and len(st.conns) >= lim.max_links_per_peer:
            plane._count("refused_links_per_peer")
            self.close()
            return False
        if st is None:
            st = service.peers[peer] = _PeerState(self.loop.time())
        st.conns.append(self)
        self.session, self.peer, self.st, self.state = session, peer, st, "frames"
        plane._count("peers_connected")
        self._arm(lim.idle_timeout_s, self._idle)
        return True

    def _on_frame(self) -> bool:
        lim, service, st, plane = self.plane.limits, self.service, self.st, self.plane
        assert st is not None
        if len(self.buf) < _HDR.size:
            return False
        n, rid, kind = _HDR.unpack_from(self.buf)
        if self.partial is None:
            st.last_active = self.loop.time()
            # Checked and charged before a byte of the body is taken.
            why = None
            if kind != REQUEST:
                why = "unexpected_kind"
            elif n > lim.max_frame:
                why = "oversize"
            elif st.inflight >= lim.max_inflight_per_peer:
                why = "peer_requests"
            elif st.inflight_bytes + n > lim.max_inflight_bytes_per_peer:
                why = "peer_bytes"
            elif service.inflight_bytes + n > lim.max_inflight_bytes:
                why = "total_bytes"
            if why is not None:
                plane._count(f"refused_{why}")
                logger.warning("kvtransfer: control frame of %d B from %s refused (%s): connection closed",
                               n, self.peer, why)
                self.close()
                return False
            st.inflight += 1
            st.inflight_bytes += n
            service.inflight_bytes += n
            self.partial = (rid, n)
        end = _HDR.size + n + TAG_LEN
        if len(self.buf) < end:
            self._arm(lim.frame_deadline_s, self._frame_late)
            return False
        self.partial = None
        frame = bytes(self.buf[:end])
        del self.buf[:end]
        try:
            self.session.open(frame[:_HDR.size + n], frame[_HDR.size + n:])
        except kv_transfer.PeerRefused:
            plane._uncharge(service, st, n)
            plane._count("bad_tags")
            self.close()
            return False
        plane._count("requests")
        self._arm(lim.idle_timeout_s, self._idle)
        body = frame[_HDR.size:_HDR.size + n]
        if service.inline:
            self._answer(rid, *plane._run_handler(service, self.peer, body))
            plane._uncharge(service, st, n)
        else:
            st.queue.append((self, rid, body))
            plane._next_on_pool(service, self.peer, st)
        return True

    def _answer(self, rid: int, reply: bytes, kind: int) -> None:
        if self.state != "frames" or self.transport is None or self.transport.is_closing():
            return
        hdr = _HDR.pack(len(reply), rid, kind)
        self.transport.write(hdr + reply + self.session.seal(hdr + reply))

    # --- deadlines -----------------------------------------------------------
    def _arm(self, after: float, then: Callable[[], None]) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(after, then)

    def _handshake_late(self) -> None:
        if self.state in ("hello", "finish"):
            self.service.listener.count_io_failure()
            self.plane._count("handshake_cut")
            self.close()

    def _idle(self) -> None:
        if self.state == "frames" and self.partial is None and self.st is not None and self.st.inflight == 0:
            self.plane._count("idle_cuts")
            if self.plane.limits.goaway:
                self.go_away()
            else:
                self.close()

    def go_away(self) -> None:
        """Lets the peer go without failing a request of its: a sealed GOAWAY
        says that nothing it sent after its last answer was read (so it
        sends those again elsewhere), then this side stops writing and
        drops whatever still arrives until the peer closes, or for
        ``GOAWAY_DRAIN_S``. Only with nothing in flight (the caller's
        check): an answer owed would be lost."""
        if self.state != "frames" or self.transport is None or self.transport.is_closing():
            return self.close()
        self._answer(0, b"", GOAWAY)
        self._leave_peer()
        self.state = "draining"
        self.buf.clear()
        self._arm(GOAWAY_DRAIN_S, self.close)
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError):
            self.close()

    def _frame_late(self) -> None:
        if self.state == "frames" and self.partial is not None:
            self.plane._count("frame_cuts")
            self.close()

    def close(self) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        if self.timer is not None:
            self.timer.cancel()
        self._handshake_over()
        service, st = self.service, self.st
        service.conns.discard(self)
        self._leave_peer()
        if self.transport is not None:
            self.transport.close()

    def _leave_peer(self) -> None:
        """Gives back this connection's share of its peer's (and the peer's
        place, with its last connection and nothing in flight)."""
        service, st = self.service, self.st
        if self.partial is not None and st is not None:
            self.plane._uncharge(service, st, self.partial[1])
            self.partial = None
        if st is not None:
            if self in st.conns:
                st.conns.remove(self)
            if not st.conns and st.inflight == 0 and service.peers.get(self.peer) is st:
                del service.peers[self.peer]


class _Link:
    """A dialed connection to one listener, shared by every request to it.

    Requests are written by the thread that makes them, straight to the
    socket, under ``lock`` (which also orders the session's tags): a
    request costs no hop to the loop's thread, which under a busy
    interpreter (a serving engine's scheduler) can wait a whole GIL switch
    interval. The loop only connects and reads the answers."""

    def __init__(self, key: Tuple[str, int], window: int) -> None:
        self.key = key
        # Requests in flight on the link: at most what a listener grants a
        # peer (the same limits), so an honest dialer never trips the cap.
        self.window = max(1, window)
        self.lock = threading.Lock()
        self.connecting: Optional[asyncio.Future] = None
        self.sock: Optional[socket.socket] = None
        self.writer: Optional[asyncio.StreamWriter] = None
        self.session: Any = None
        #: request id -> (its future, its deadline on the monotonic clock,
        #: its body: sent again on a new connection after a GOAWAY)
        self.pending: Dict[int, Tuple[concurrent.futures.Future, float, bytes]] = {}
        self.ids = itertools.count(1)


class ControlPlane:
    """One event loop (a daemon thread) for every control connection of a
    process's kv_transfer user: listeners (:meth:`serve`) and one link per
    dialed peer (:meth:`request`). ``name`` is what this side proves in its
    handshakes; ``key`` the cluster key (default: the deployment's)."""

    def __init__(self, name: str, key: Any = None, limits: PlaneLimits = PlaneLimits()):
        self.name = name
        self.key = key if key is not None else kv_transfer.ClusterKey.from_env()
        self.limits = limits
        self.endpoint = ""
        self.counters: Counter = Counter()
        self._services: Dict[Tuple[str, int], _Service] = {}
        self._links: Dict[Tuple[str, int], _Link] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, limits.handler_threads), thread_name_prefix="kvt-plane")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kvt-plane-{name}", daemon=True)
        self._thread.start()
        self._closed = False
        self._expiry: Optional[asyncio.Future] = None

    # --- the loop ------------------------------------------------------------
    def _run(self, coro: Any, timeout: Optional[float] = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] += n

    # --- listening -----------------------------------------------------------
    def serve(self, host: str, port: int, handler: Callable[[str, bytes], bytes],
              advertise: Optional[str] = None, answers_to: Sequence[str] = (), inline: bool = False) -> Tuple[str, int]:
        """Listens on ``host:port`` (0: any free port); ``handler(peer_name,
        body) -> reply`` runs for each request on the handler pool. Dialers
        must dial ``advertise`` (default ``host``) at the bound port, as the
        deployment publishes it, or one of ``answers_to`` (other
        ``host:port`` spellings, e.g. a forwarded port); a handshake that
        dialed anything else is a relayed one, refused. ``inline``: the
        handler never blocks (no network, no lock held long), so it runs on
        the loop itself, saving a thread hop per request. Returns the bound
        ``(host, port)``."""

        async def start() -> Tuple[str, int]:
            service = _Service(handler, None, inline)
            server = await self._loop.create_server(lambda: _ServerConn(self, service), host, port, backlog=1024)
            bound = server.sockets[0].getsockname()[:2]
            addresses = [f"{advertise or host}:{bound[1]}", f"{bound[0]}:{bound[1]}", *answers_to]
            self.endpoint = addresses[0]
            service.listener = kv_transfer.PeerListener(self.key, CONTEXT, self.name, self.endpoint, addresses)
            service.server = server
            self._services[(bound[0], bound[1])] = service
            return bound[0], bound[1]

        return self._run(start(), 10)

    def _evict_idlest(self, service: _Service) -> bool:
        """At the peer cap: the peer idle longest with nothing in flight
        gives way (a GOAWAY on each of its connections: it reconnects, and
        sends again what it had sent unanswered, on its next request), so
        peers that hold connections and send nothing cannot keep a new peer
        out, and an honest peer that loses its place loses no request.
        False if every peer has requests in flight."""
        idle = [(st.last_active, name) for name, st in service.peers.items() if st.inflight == 0]
        if not idle:
            return False
        _, name = min(idle)
        st = service.peers.pop(name)
        for c in list(st.conns):
            if self.limits.goaway:
                c.go_away()
            else:
                c.close()
        self._count("peers_evicted")
        return True

    def _uncharge(self, service: _Service, st: _PeerState, n: int) -> None:
        st.inflight -= 1
        st.inflight_bytes -= n
        service.inflight_bytes -= n

    def _run_handler(self, service: _Service, peer: str, body: bytes) -> Tuple[bytes, int]:
        """The handler's reply and its kind; a handler's error goes back to
        its peer, typed."""
        try:
            return bytes(service.handler(peer, body)), REPLY
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, (kv_transfer.KvTransferError, ValueError)):
                logger.exception("kvtransfer: control handler failed")
            return f"{type(e).__name__}: {e}".encode(), ERROR

    def _next_on_pool(self, service: _Service, peer: str, st: _PeerState) -> None:
        """Starts the peer's next queued request on the pool, if none of its
        runs; its answer comes back to the loop, which starts the next."""
        if st.running or not st.queue:
            return
        conn, rid, body = st.queue.popleft()
        st.running = True
        n = len(body)

        def done(f: "concurrent.futures.Future[Tuple[bytes, int]]") -> None:
            st.running = False
            self._uncharge(service, st, n)
            reply, kind = f.result()
            conn._answer(rid, reply, kind)
            if st.conns or st.queue:
                self._next_on_pool(service, peer, st)
            elif st.inflight == 0 and service.peers.get(peer) is st:
                del service.peers[peer]

        try:
            fut = self._pool.submit(self._run_handler, service, peer, body)
        except RuntimeError:  # the pool is shut down: the plane is closing
            st.running = False
            self._uncharge(service, st, n)
            return
        fut.add_done_callback(lambda f: self._loop.call_soon_threadsafe(done, f))

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` on the loop after ``delay`` seconds (it must not
        block: hand real work to a thread's queue). A timer without a thread
        per timer."""
        self._loop.call_soon_threadsafe(self._loop.call_later, delay, fn, *args)

    # --- dialing -------------------------------------------------------------
    def request(self, host: str, port: int, body: bytes,
                timeout: Optional[float] = None) -> "concurrent.futures.Future[bytes]":
        """Sends ``body`` to the listener at ``host:port`` on this plane's
        link to it (opened, and the handshake run, on first use or after it
        closed); the future resolves to the reply, or raises
        :class:`RemoteError`, :class:`kv_transfer.PeerRefused`,
        :class:`PlaneClosed` or ``TimeoutError`` (connecting included,
        ``timeout`` or the limits' default). On a live link with room in its
        window the request leaves from the calling thread, at once."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(PlaneClosed("the control plane is closed"))
            return fut
        deadline = time.monotonic() + (self.limits.request_timeout_s if timeout is None else timeout)
        key = (host, int(port))
        link = self._links.get(key)
        if link is not None and self._try_send(link, bytes(body), deadline, fut):
            return fut
        asyncio.run_coroutine_threadsafe(self._request_slow(key, bytes(body), deadline, fut), self._loop)
        return fut

    def call(self, host: str, port: int, body: bytes, timeout: Optional[float] = None) -> bytes:
        """:meth:`request`, waited for."""
        t = self.limits.request_timeout_s if timeout is None else timeout
        return self.request(host, port, body, t).result(t + 1)

    def _try_send(self, link: _Link, body: bytes, deadline: float, fut: concurrent.futures.Future) -> bool:
        """Sends on a live link with room in its window; False if it has none
        (the slow path waits for it)."""
        with link.lock:
            if link.sock is None or len(link.pending) >= link.window:
                return False
            rid = next(link.ids)
            hdr = _HDR.pack(len(body), rid, REQUEST)
            frame = hdr + body + link.session.seal(hdr + body)
            link.pending[rid] = (fut, deadline, body)
            try:
                _send_all(link.sock, frame, deadline)
            except (OSError, TimeoutError) as e:
                # A frame cut short breaks the stream: the link goes, and
                # every request on it fails (the next one reconnects).
                self._drop_link(link, PlaneClosed(f"sending on the control connection: {e}"))
            return True

    async def _request_slow(self, key: Tuple[str, int], body: bytes, deadline: float,
                            fut: concurrent.futures.Future) -> None:
        """Connects if need be and waits for room in the window (bounded by
        the deadline), then sends."""
        try:
            link = self._links.get(key)
            if link is None:
                link = self._links[key] = _Link(key, self.limits.max_inflight_per_peer)
            while True:
                if link.sock is None:
                    if link.connecting is None:
                        link.connecting = asyncio.ensure_future(self._connect(link, *key))
                    connecting = link.connecting
                    try:
                        await asyncio.wait_for(asyncio.shield(connecting), max(0.0, deadline - time.monotonic()))
                    finally:
                        if link.connecting is connecting and connecting.done():
                            link.connecting = None
                if self._try_send(link, body, deadline, fut):
                    return
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no room on the connection to {key[0]}:{key[1]} in time")
                await asyncio.sleep(0.001)  # the window is full: an answer frees a place
        except BaseException as e:  # noqa: BLE001 (the caller sees it on its future)
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else PlaneClosed(str(e)))
            if isinstance(e, asyncio.CancelledError):
                raise

    def _drop_link(self, link: _Link, why: BaseException) -> None:
        """The link's connection is gone: every request on it fails with ``why``."""
        sock, link.sock, link.session = link.sock, None, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        pending, link.pending = link.pending, {}
        for fut, _, _ in pending.values():
            if not fut.done():
                fut.set_exception(why)

    def _gone_away(self, link: _Link, raw: socket.socket) -> None:
        """The listener let this link go (GOAWAY): it read nothing we sent
        after its last answer, so every request still unanswered is sent
        again, on a new connection, within its own deadline."""
        with link.lock:
            if link.sock is not raw:
                return
            link.sock, link.session = None, None
            pending, link.pending = link.pending, {}
        try:
            raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._count("goaways")
        for fut, deadline, body in pending.values():
            if not fut.done():
                self._count("resent_after_goaway")
                asyncio.ensure_future(self._request_slow(link.key, body, deadline, fut))

    async def _expire(self) -> None:
        """Fails requests past their deadline (their answer is then dropped)."""
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for link in list(self._links.values()):
                with link.lock:
                    late = [rid for rid, (_, d, _) in link.pending.items() if d <= now]
                    for rid in late:
                        fut, _, _ = link.pending.pop(rid)
                        if not fut.done():
                            fut.set_exception(TimeoutError("no answer in time"))

    async def _connect(self, link: _Link, host: str, port: int) -> None:
        self._count("dials")
        if self._expiry is None:
            self._expiry = asyncio.ensure_future(self._expire())
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 16)
        try:
            hs, hello = kv_transfer.PeerHandshake.dial(self.key, CONTEXT, self.name, self.endpoint, f"{host}:{port}")
            writer.write(hello)
            await writer.drain()
            try:
                session, finish = hs.on_challenge(await _read_handshake(reader))
            except kv_transfer.PeerRefused as e:
                kind = e.args[1] if len(e.args) > 1 else "malformed"
                if kind != "refused_by_peer":  # tell the listener why (it counts it)
                    writer.write(kv_transfer.handshake_refusal(kind))
                    await writer.drain()
                raise
            writer.write(finish)
            await writer.drain()
        except BaseException:
            self._count("dial_failures")
            writer.close()
            raise
        self._count("links_opened")
        ts = writer.get_extra_info("socket")
        # The requests' own handle on the connection (a duplicate of the
        # transport's: the loop only reads from it from now on).
        raw = socket.socket(ts.family, ts.type, ts.proto, fileno=_dup(ts.fileno()))
        raw.setblocking(False)
        with link.lock:
            link.writer, link.session, link.sock = writer, session, raw
        asyncio.ensure_future(self._read_replies(link, reader, writer, raw))

    async def _read_replies(self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            raw: socket.socket) -> None:
        why: BaseException = PlaneClosed("the connection closed")
        try:
            while True:
                hdr = await reader.readexactly(_HDR.size)
                n, rid, kind = _HDR.unpack(hdr)
                if n > self.limits.max_frame or kind not in (REPLY, ERROR, GOAWAY):
                    why = PlaneClosed(f"a reply frame of {n} B, kind {kind}: connection dropped")
                    return
                rest = await reader.readexactly(n + TAG_LEN)
                with link.lock:
                    link.session.open(hdr + rest[:n], rest[n:])
                    if kind == GOAWAY:
                        entry = None
                    else:
                        entry = link.pending.pop(rid, None)
                if kind == GOAWAY:
                    return self._gone_away(link, raw)
                if entry is None or entry[0].done():
                    continue  # its request timed out
                if kind == REPLY:
                    entry[0].set_result(bytes(rest[:n]))
                else:
                    entry[0].set_exception(RemoteError(bytes(rest[:n]).decode(errors="replace")))
        except (asyncio.IncompleteReadError, OSError, AttributeError) as e:
            why = PlaneClosed(f"the connection closed: {e}")
        except kv_transfer.PeerRefused as e:
            self._count("bad_tags")
            why = e
        finally:
            with link.lock:
                if link.sock is raw:
                    self._drop_link(link, why)
            raw.close()
            writer.close()

    # --- the rest --------------------------------------------------------------
    def stats(self) -> Dict[str, int]:
        """Counters (refusals by kind, cuts, evictions, requests), handshake
        counts (``auth_*``), and gauges: peers connected, handshakes in
        flight, links open."""

        async def snap() -> Dict[str, int]:
            out = dict(self.counters)
            out["peers"] = sum(len(s.peers) for s in self._services.values())
            out["handshakes_peak"] = max([s.handshakes_peak for s in self._services.values()] or [0])
            out["handshakes_in_flight"] = sum(len(s.in_handshake) for s in self._services.values())
            out["links"] = sum(1 for link in self._links.values() if link.sock is not None)
            for s in self._services.values():
                for k, v in s.listener.stats().items():
                    out[k] = out.get(k, 0) + v
            return out

        return self._run(snap(), 5)

    def close(self) -> None:
        """Stops listening, closes every connection, stops the loop."""
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            for s in self._services.values():
                if s.server is not None:
                    s.server.close()
                for c in list(s.conns):
                    c.close()
            for link in self._links.values():
                with link.lock:
                    self._drop_link(link, PlaneClosed("the control plane is closed"))
                if link.writer is not None:
                    link.writer.close()
            # Every connection's task ends here, not at interpreter exit.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._run(stop(), 5)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._pool.shutdown(wait=False)


async def _read_handshake(reader: asyncio.StreamReader) -> bytes:
    """One handshake message, its size checked before its body is read."""
    header = await reader.readexactly(kv_transfer.handshake_header_len())
    n = kv_transfer.handshake_body_len(header)
    return header + await reader.readexactly(n)


def _dup(fd: int) -> int:
    import os

    return os.dup(fd)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Writes all of ``data`` on a non-blocking socket by ``deadline``."""
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except (BlockingIOError, InterruptedError):
            n = 0
        view = view[n:]
        if view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the control connection did not take the frame in time")
            select.select([], [sock], [], min(left, 0.1))
