"""The decode worker's loads: claim the prefill's offer, READ its blocks into
exactly the blocks vLLM allocated, tell vLLM ``finished_recving`` only when
every READ is terminal. Nothing here imports vLLM.

A load's life (one explicit state at a time)::

    Queued --fetch--> Posted --READs terminal--> Done (ok, or failed: its
      |                                                blocks are reported
      |cancel (request aborted before its READ)        as load errors)
      v
    Done (released at the prefill)

The network work (the fetch from the prefill's side port, the post) runs on
one puller thread, off vLLM's step. A request aborted while its READs are in
flight keeps its blocks (vLLM waits for ``finished_recving``), and the
READs' DONE frees the prefill's blocks; a repeated abort (vLLM sends a
second, pre-aborted request on a client disconnect) is one more idempotent
release of an offer that is already claimed or gone.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple, Union

import kv_transfer

from ..frames import ProtocolError, recv_frame, send_frame
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


def side_call(host: str, port: int, payload: bytes, timeout: float = SIDE_TIMEOUT_S) -> bytes:
    """One request frame to a worker's side port, its reply frame."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        send_frame(s, payload)
        return recv_frame(s, wire.MAX_SIDE_FRAME)


class DecodeLoads:
    """Loads by request id over one endpoint and pool per backend (``sides``:
    ``{backend: (endpoint, pool)}``; the first is the default)."""

    def __init__(self, sides: Dict[str, Any], *, before_post: Optional[Callable[[str, Dict[str, Any]], None]] = None,
                 after_load: Optional[Callable[[str, Sequence[int], Dict[str, Any]], None]] = None):
        self.sides = sides
        self._before_post = before_post
        self._after_load = after_load
        self._lock = threading.Lock()
        self._loads: Dict[str, _Load] = {}
        self._peers: Dict[Tuple[str, bytes], int] = {}
        self._work: "queue.Queue[Optional[Tuple[str, Any]]]" = queue.Queue()
        self.counters: Dict[str, int] = {
            "loads": 0, "loaded": 0, "load_failures": 0, "cancelled": 0, "releases_sent": 0, "release_failures": 0,
        }
        self._thread = threading.Thread(target=self._run, name="kvt-vllm-puller", daemon=True)
        self._thread.start()

    # --- vLLM's side -------------------------------------------------------
    def load(self, req_id: str, blocks: Sequence[int], params: Dict[str, Any]) -> None:
        """Starts pulling the offer in ``params`` into ``blocks``. Bad params
        fail the load (its blocks reported as load errors); nothing else."""
        try:
            offer = wire.parse_offer(params)
            if len(offer.blocks) != len(blocks):
                raise wire.ParamsError(f"the prefill offers {len(offer.blocks)} blocks, vLLM allocated {len(blocks)}")
            state: LoadState = Queued(offer, tuple(blocks))
        except wire.ParamsError as e:
            logger.error("kv_transfer.vllm: request %s: %s", req_id, e)
            state = Done(False, str(e))
        with self._lock:
            if req_id in self._loads:
                logger.error("kv_transfer.vllm: request %s loaded twice; kept the first", req_id)
                return
            self._loads[req_id] = _Load(req_id, tuple(blocks), params, state)
            self.counters["loads"] += 1
        if isinstance(state, Queued):
            self._work.put(("load", req_id))

    def release(self, params: Dict[str, Any]) -> None:
        """The request will never read its offer (aborted before it was scheduled)."""
        try:
            offer = wire.parse_offer(params)
        except wire.ParamsError as e:
            logger.warning("kv_transfer.vllm: not releasing unparsable kv_transfer_params: %s", e)
            return
        self._work.put(("release", offer))

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
        else:
            why = s.transfer.error() or status
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
                if kind == "load":
                    self._pull(arg)
                else:
                    self._send_release(arg)
            except Exception:  # the puller must outlive any one request
                logger.exception("kv_transfer.vllm: puller: %s %s", kind, arg if kind == "load" else "")

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
        endpoint, pool = self.sides[backend]
        got = self._fetch(q.offer, backend, endpoint)
        if isinstance(got, str):
            return self._fail(req_id, got)
        remote, peer = got
        if self._before_post is not None:
            self._before_post(req_id, ld.params)
        try:
            lease = pool.reserve(list(q.blocks))
        except kv_transfer.KvTransferError as e:
            self._send_release(q.offer)
            return self._fail(req_id, f"cannot reserve vLLM's blocks {list(q.blocks)[:8]}: {e}")
        try:
            t = endpoint.read(lease, remote)
        except kv_transfer.KvTransferError as e:
            lease.release()
            self._send_release(q.offer)
            return self._fail(req_id, f"READ refused: {e}")
        with self._lock:
            ld.state = Posted(backend, t)

    def _fetch(self, offer: wire.Offer, backend: str, endpoint: Any) -> Union[str, Tuple[Any, int]]:
        req = wire.fetch_request(offer.offer, backend, endpoint.descriptor(), len(offer.blocks))
        deadline = time.monotonic() + EARLY_FOR_S
        while True:
            try:
                remote_b, descriptor = wire.parse_fetch_reply(side_call(offer.host, offer.port, req))
                break
            except wire.Refused as e:
                if e.kind == "unknown_offer" and time.monotonic() < deadline:
                    time.sleep(EARLY_RETRY_S)
                    continue
                return f"the prefill refused the fetch: {e}"
            except (OSError, ProtocolError) as e:
                return f"fetch from {offer.host}:{offer.port}: {e}"
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
        if remote.pages != len(offer.blocks):
            self._send_release(offer)
            return f"the prefill exposed {remote.pages} blocks, the offer names {len(offer.blocks)}"
        return remote, peer

    def _send_release(self, offer: wire.Offer) -> None:
        try:
            wire.parse_ok(side_call(offer.host, offer.port, wire.release_request(offer.offer)))
            self.counters["releases_sent"] += 1
        except (OSError, ProtocolError, wire.Refused) as e:
            # The prefill keeps the offer; its own deadline withdraws it
            # (never exposed) or aborts it (exposed: freed only when proven).
            self.counters["release_failures"] += 1
            logger.warning("kv_transfer.vllm: release to %s:%s failed: %s", offer.host, offer.port, e)


def summarize(loads: Optional[DecodeLoads]) -> Dict[str, Any]:
    if loads is None:
        return {}
    return {f"loads_{k}": v for k, v in loads.counters.items()}

