"""The decode worker's loads: claim the prefill's offer, READ its blocks into
exactly the blocks vLLM allocated, tell vLLM ``finished_recving`` only when
every READ is terminal. Nothing here imports vLLM.

A load's life (one explicit state at a time)::

    Queued --fetch--> Posted --READs terminal--> Done (ok, or failed: its
      |                                                blocks are reported
      |cancel (request aborted before its READ)        as load errors)
      v
    Done (released at the prefill)

The network work runs off vLLM's step: fetches and releases go out on the
worker's control plane (:mod:`kv_transfer.peers`: one authenticated
connection per prefill, requests pipelined, never waited for on a thread),
and one puller thread posts the READs as the prefills' answers come back.
A decode dials only the prefills its deployment named
(``kv_connector_extra_config.prefills``), never an address a request
carries: a load naming another fails, typed, without a connection. A request aborted while its READs are in
flight keeps its blocks (vLLM waits for ``finished_recving``), and the
READs' DONE frees the prefill's blocks; a repeated abort (vLLM sends a
second, pre-aborted request on a client disconnect) is one more idempotent
release of an offer that is already claimed or gone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Optional, Sequence, Set, Tuple, Union

import kv_transfer

from ..frames import ProtocolError
from ..peers import ControlPlane
from . import wire

logger = logging.getLogger("kv_transfer.vllm")

#: How long one side-port exchange may take.
SIDE_TIMEOUT_S = 10.0
#: A fetch that finds the offer not yet known (the prefill's worker learns of it
#: one engine step after its scheduler published it) is retried this often, this long.
EARLY_RETRY_S = 0.005
EARLY_FOR_S = 5.0


@dataclass
class Queued:
    offer: wire.Offer
    blocks: Sequence[int]


@dataclass
class Posted:
    backend: str
    transfer: Any  # kv_transfer.Transfer (a READ)
    #: When the post returned, how long it took, its bytes and descriptors,
    #: and how long the claim took before it (for the metrics).
    posted_at: float = 0.0
    post_s: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    claim_s: float = 0.0


@dataclass
class Done:
    ok: bool
    why: str


LoadState = Union[Queued, Posted, Done]


@dataclass
class _Load:
    req_id: str
    blocks: Sequence[int]
    params: Dict[str, Any]
    state: LoadState
    cancelled: bool = False
    #: When vLLM asked for the load (perf_counter): the claim's time runs from here.
    asked_at: float = 0.0


class DecodeLoads:
    """Loads by request id over one endpoint and pool per backend (``sides``:
    ``{backend: (endpoint, pool)}``; the first is the default), talking to
    prefills on ``plane``, only those in ``prefills`` (``(host, port)`` of
    their first worker's side ports; ``None``: any, for tests only).

    This is worker ``rank`` of a decode of ``tp`` workers: it holds its
    shard of every block (its KV heads) and pulls it from the prefill's
    worker of the same rank (side port ``port + rank``), whose shard is the
    same heads. A prefill of another TP size is refused, typed, before any
    connection (heterogeneous TP is not built yet)."""

    def __init__(self, sides: Dict[str, Any], plane: ControlPlane, prefills: Optional[Set[Tuple[str, int]]], *,
                 rank: int = 0, tp: int = 1,
                 before_post: Optional[Callable[[str, Dict[str, Any]], None]] = None,
                 after_load: Optional[Callable[[str, Sequence[int], Dict[str, Any]], None]] = None,
                 on_loaded: Optional[Callable[[float, float, int, int, float], None]] = None):
        self.sides = sides
        self.plane = plane
        self.prefills = prefills
        self.rank = rank
        self.tp = tp
        self._before_post = before_post
        self._after_load = after_load
        #: Told of each load's transfer time, post time, bytes, descriptors
        #: and claim time (from vLLM's ask to the prefill's exposure: the
        #: round trip, retries included, that admission costs per request).
        self._on_loaded = on_loaded
        self._lock = threading.Lock()
        self._loads: Dict[str, _Load] = {}
        self._peers: Dict[Tuple[str, bytes], int] = {}
        self._work: "queue.Queue[Optional[Tuple[str, Any]]]" = queue.Queue()
        #: Answered fetches, taken (once each) by whichever comes first: the
        #: thread that polls (vLLM's, every engine step) or the puller.
        self._answered: "Deque[Tuple[Any, ...]]" = deque()
        self.counters: Dict[str, int] = {
            "loads": 0, "loaded": 0, "load_failures": 0, "cancelled": 0, "releases_sent": 0, "release_failures": 0,
            "refused_unnamed_prefill": 0, "refused_tp_mismatch": 0,
            # Blocks READ from prefills (with a prefix cache hit here, fewer than offered).
            "blocks_pulled": 0,
        }
        self._thread = threading.Thread(target=self._run, name="kvt-vllm-puller", daemon=True)
        self._thread.start()

    # --- vLLM's side -------------------------------------------------------
    def _named(self, offer: wire.Offer) -> bool:
        return self.prefills is None or (offer.host, offer.port) in self.prefills

    def load(self, req_id: str, blocks: Sequence[int], params: Dict[str, Any]) -> None:
        """Starts pulling the offer in ``params`` into ``blocks``. Bad params,
        or params naming a prefill the deployment did not, fail the load
        (its blocks reported as load errors); nothing else."""
        try:
            offer = wire.parse_offer(params)
            # With a prefix cache hit here, vLLM allocated blocks only for
            # the tail of the prompt: the offer's last ``len(blocks)``.
            if not 0 < len(blocks) <= len(offer.blocks):
                raise wire.ParamsError(f"the prefill offers {len(offer.blocks)} blocks, vLLM allocated {len(blocks)}")
            if not self._named(offer):
                self.counters["refused_unnamed_prefill"] += 1
                raise wire.ParamsError(f"{offer.host}:{offer.port} is not a prefill this decode was configured with")
            if offer.tp != self.tp:
                self.counters["refused_tp_mismatch"] += 1
                raise wire.ParamsError(f"the prefill runs TP {offer.tp}, this decode TP {self.tp}: each worker "
                                       "would need another worker's heads (heterogeneous TP is not supported yet)")
            state: LoadState = Queued(offer, tuple(blocks))
        except wire.ParamsError as e:
            logger.error("kv_transfer.vllm: request %s: %s", req_id, e)
            state = Done(False, str(e))
        with self._lock:
            if req_id in self._loads:
                logger.error("kv_transfer.vllm: request %s loaded twice; kept the first", req_id)
                return
            self._loads[req_id] = _Load(req_id, tuple(blocks), params, state, asked_at=time.perf_counter())
            self.counters["loads"] += 1
        if isinstance(state, Queued):
            # Sent from this thread (vLLM's, in its step): a hop to the
            # puller would wait for the interpreter's lock behind a busy
            # engine loop, once per request (up to a switch interval, 5 ms,
            # and more on a loaded host).
            self._pull(req_id)

    def release(self, params: Dict[str, Any]) -> None:
        """The request will never read its offer (aborted before it was scheduled)."""
        try:
            offer = wire.parse_offer(params)
        except wire.ParamsError as e:
            logger.warning("kv_transfer.vllm: not releasing unparsable kv_transfer_params: %s", e)
            return
        if not self._named(offer):
            self.counters["refused_unnamed_prefill"] += 1
            return
        if offer.tp != self.tp and self.rank != 0:
            return  # a refused (mismatched) offer: worker 0 hands it back at its first worker
        self._send_release(offer)

    def finished(self, req_ids: Any) -> None:
        """vLLM finished these requests (an abort among them): a load not yet
        posted is not posted (its offer is released)."""
        with self._lock:
            for r in req_ids:
                ld = self._loads.get(r)
                if ld is not None and isinstance(ld.state, Queued):
                    ld.cancelled = True

    def poll(self) -> Tuple[Set[str], Set[int]]:
        """One non-blocking pass: the requests whose loads are terminal (each
        reported once), and the blocks of those that failed."""
        done: Set[str] = set()
        bad: Set[int] = set()
        self._take_answers(inline=True)
        with self._lock:
            for r, ld in list(self._loads.items()):
                if isinstance(ld.state, Posted):
                    self._settle(ld, ld.state)
                if isinstance(ld.state, Done):
                    done.add(r)
                    if not ld.state.ok and not ld.cancelled:
                        bad.update(ld.blocks)
                    del self._loads[r]
        return done, bad

    def _settle(self, ld: _Load, s: Posted) -> None:
        status = s.transfer.poll()
        if status == "pending":
            return
        if status == "success":
            lease = s.transfer.take_lease()
            lease.release()
            if self._after_load is not None:
                self._after_load(ld.req_id, ld.blocks, ld.params)
            ld.state = Done(True, "loaded")
            self.counters["loaded"] += 1
            if self._on_loaded is not None:
                self._on_loaded(time.perf_counter() - s.posted_at, s.post_s, s.nbytes, s.descriptors, s.claim_s)
        else:
            why = s.transfer.error or status
            s.transfer.release()
            logger.error("kv_transfer.vllm: request %s: READ failed: %s", ld.req_id, why)
            ld.state = Done(False, why)
            self.counters["load_failures"] += 1

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._loads)

    def close(self) -> None:
        self._work.put(None)

    # --- the puller thread -------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            kind, arg = item
            try:
                if kind == "retry":
                    self._ask_fetch(*arg)
                elif kind == "answered":
                    self._take_answers(inline=False)
                else:
                    self._fetched(*arg)
            except Exception:  # the puller must outlive any one request
                logger.exception("kv_transfer.vllm: puller: %s", kind)

    def _fail(self, req_id: str, why: str) -> None:
        with self._lock:
            ld = self._loads.get(req_id)
            if ld is not None:
                ld.state = Done(False, why)
                self.counters["load_failures"] += 1
        logger.error("kv_transfer.vllm: request %s: load failed: %s", req_id, why)

    def _pull(self, req_id: str) -> None:
        with self._lock:
            ld = self._loads.get(req_id)
            if ld is None or not isinstance(ld.state, Queued):
                return
            q = ld.state
            if ld.cancelled:
                ld.state = Done(False, "cancelled")
                self.counters["cancelled"] += 1
        if ld.cancelled:
            self._send_release(q.offer)
            return
        backend = next((b for b in self.sides if b in q.offer.backends), None)
        if backend is None:
            return self._fail(req_id, f"no common backend: the prefill serves {list(q.offer.backends)}, "
                                      f"this decode {list(self.sides)}")
        endpoint, _ = self.sides[backend]
        self._ask_fetch(req_id, q.offer, backend, endpoint, time.monotonic() + EARLY_FOR_S, len(q.blocks))

    def _ask_fetch(self, req_id: str, offer: wire.Offer, backend: str, endpoint: Any, early_until: float,
                   pages: int) -> None:
        """Sends the fetch for the offer's last ``pages`` blocks (never
        waited for); its answer is taken by the polling thread or the
        puller, whichever comes first (:meth:`_take_answers`)."""
        req = wire.fetch_request(offer.offer, backend, endpoint.descriptor(), pages, len(offer.blocks) - pages)
        f = self.plane.request(offer.host, self._port(offer), req, SIDE_TIMEOUT_S)

        def answered(f: "concurrent.futures.Future[bytes]") -> None:
            self._answered.append((req_id, offer, backend, early_until, pages, f))
            self._work.put(("answered", None))

        f.add_done_callback(answered)

    def _take_answers(self, inline: bool) -> None:
        """Handles the answered fetches. ``inline`` (the polling thread):
        those whose prefill this decode already knows on that backend; one
        that would first connect to a new prefill goes to the puller (a
        handshake has no place in an engine step), and so does every one
        when a ``before_post`` hook is set (a hook may block)."""
        for _ in range(len(self._answered)):  # bounded: what is there now
            try:
                args = self._answered.popleft()
            except IndexError:
                return
            if inline and (self._before_post is not None or self._needs_new_peer(args[2], args[5])):
                self._work.put(("fetched", args))
                continue
            self._fetched(*args)

    def _needs_new_peer(self, backend: str, f: "concurrent.futures.Future[bytes]") -> bool:
        """Whether the READ this answer allows would first connect to a
        prefill this decode has no peer for on ``backend``. A refusal or an
        error needs none (it is handled, or retried, without one)."""
        try:
            _, descriptor = wire.parse_fetch_reply(f.result())
        except Exception:  # noqa: BLE001 (whatever it is, _fetched types it)
            return False
        return (backend, bytes(descriptor)) not in self._peers

    def _fetched(self, req_id: str, offer: wire.Offer, backend: str, early_until: float, pages: int,
                 f: "concurrent.futures.Future[bytes]") -> None:
        endpoint, pool = self.sides[backend]
        try:
            remote_b, descriptor = wire.parse_fetch_reply(f.result())
        except wire.Refused as e:
            if e.kind in ("unknown_offer", "busy") and time.monotonic() < early_until:
                # The prefill's worker learns of an offer one engine step
                # after its scheduler published it; or a block this offer
                # shares with another (a cached prefix) is exposed to that
                # one's claimant for a moment: ask again shortly.
                # The loop's timer only queues the retry (call_later's
                # contract: nothing that may block runs on the loop); the
                # puller sends it.
                self.plane.call_later(EARLY_RETRY_S, self._work.put,
                                      ("retry", (req_id, offer, backend, endpoint, early_until, pages)))
                return
            return self._fail(req_id, f"the prefill refused the fetch: {e}")
        except (kv_transfer.KvTransferError, ProtocolError, OSError, concurrent.futures.TimeoutError) as e:
            return self._fail(req_id, f"fetch from {offer.host}:{self._port(offer)}: {type(e).__name__}: {e}")
        got = self._check_exposure(offer, backend, endpoint, remote_b, descriptor, pages)
        if isinstance(got, str):
            return self._fail(req_id, got)
        remote, _ = got
        with self._lock:
            ld = self._loads.get(req_id)
            live = ld is not None and isinstance(ld.state, Queued) and not ld.cancelled
            if ld is not None and isinstance(ld.state, Queued) and ld.cancelled:
                ld.state = Done(False, "cancelled")
                self.counters["cancelled"] += 1
        if not live:
            # Claimed, and now never read: the claimant hands it back.
            self._send_release(offer)
            return
        q = ld.state
        if self._before_post is not None:
            try:
                self._before_post(req_id, ld.params)
            except Exception as e:  # noqa: BLE001 (a hook's failure fails this load, never the puller)
                self._send_release(offer)
                return self._fail(req_id, f"before the READ: {type(e).__name__}: {e}")
        try:
            lease = pool.reserve(list(q.blocks))
        except kv_transfer.KvTransferError as e:
            self._send_release(offer)
            return self._fail(req_id, f"cannot reserve vLLM's blocks {list(q.blocks)[:8]}: {e}")
        t0 = time.perf_counter()
        try:
            t = endpoint.read(lease, remote)
        except kv_transfer.KvTransferError as e:
            lease.release()
            self._send_release(offer)
            return self._fail(req_id, f"READ refused: {e}")
        t1 = time.perf_counter()
        n = len(q.blocks)
        with self._lock:
            self.counters["blocks_pulled"] += n
            ld.state = Posted(backend, t, t1, t1 - t0, n * sum(pool.page_bytes), n * pool.buffers, t0 - ld.asked_at)

    def _check_exposure(self, offer: wire.Offer, backend: str, endpoint: Any, remote_b: bytes,
                        descriptor: bytes, pages: int) -> Union[str, Tuple[Any, int]]:
        try:
            key = (backend, bytes(descriptor))
            peer = self._peers.get(key)
            if peer is None:
                peer = endpoint.add_peer(bytes(descriptor))
                self._peers[key] = peer
            remote = kv_transfer.RemotePages.from_bytes(bytes(remote_b))
        except kv_transfer.KvTransferError as e:
            self._send_release(offer)
            return f"the prefill's exposure: {e}"
        if remote.pages != pages:
            self._send_release(offer)
            return f"the prefill exposed {remote.pages} blocks, this decode asked for {pages}"
        return remote, peer

    def _send_release(self, offer: wire.Offer) -> None:
        """Tells the prefill this decode will not read (answered off the puller)."""
        def done(f: "concurrent.futures.Future[bytes]") -> None:
            try:
                wire.parse_ok(f.result())
                self.counters["releases_sent"] += 1
            except (kv_transfer.KvTransferError, ProtocolError, OSError, concurrent.futures.TimeoutError) as e:
                # The prefill keeps the offer; its own deadline withdraws it
                # (never exposed) or aborts it (exposed: freed only when proven).
                self.counters["release_failures"] += 1
                logger.warning("kv_transfer.vllm: release to %s:%s failed: %s", offer.host, self._port(offer), e)

        self.plane.request(offer.host, self._port(offer), wire.release_request(offer.offer), SIDE_TIMEOUT_S) \
            .add_done_callback(done)

    def _port(self, offer: wire.Offer) -> int:
        """The side port of the prefill worker that holds this worker's shard."""
        return offer.port + (self.rank if offer.tp == self.tp else 0)


def summarize(loads: Optional[DecodeLoads]) -> Dict[str, Any]:
    if loads is None:
        return {}
    return {f"loads_{k}": v for k, v in loads.counters.items()}

