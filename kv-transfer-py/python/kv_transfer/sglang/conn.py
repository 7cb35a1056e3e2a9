"""SGLang's disaggregation interface (``sglang.srt.disaggregation.base.conn``)
implemented over kv_transfer: a KV manager, sender, receiver and bootstrap
server for ``--disaggregation-transfer-backend kvtransfer``.

What differs from the stock backends is when a decode page may be freed
after an abort: only when kv_transfer's pool holds a settlement proof for it
(the prefill's DONE or ABORT_ACK, a revocation, a fence). The receiver's
``abort`` quarantines the exposed pages and the backend's escalation ladder
starts; ``KvTransferManager.is_abort_release_safe`` answers from the pool;
the plugin's hook on ``DecodeTransferQueue.resolve_deferred_releases`` turns
SGLang's deadline into a report (log and metric), never a release.

Tested against SGLang 0.5.23 (see ``kv_transfer.sglang.SUPPORTED_SGLANG``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

import kv_transfer

from . import bootstrap, wire
from ..peers import ControlPlane, PlaneLimits
from .control import PrefillControlPlane, Target

logger = logging.getLogger("kv_transfer.sglang")

#: Environment: the kv_transfer backend (``tcp-sim``, ``mooncake``, ``nixl``, ``verbs``).
BACKEND_ENV = "KV_TRANSFER_BACKEND"
#: Environment: the tcp-sim release policy (``naive`` only in the race tests' positive control).
POLICY_ENV = "KV_TRANSFER_POLICY"
#: Environment: tcp-sim endpoints with a fault gate (tests hold writes in flight).
FAULT_GATE_ENV = "KV_TRANSFER_FAULT_GATE"
#: How long a control request (and the bootstrap's) may take.
CTRL_TIMEOUT_S = 10.0


def _local_host(server_args: Any) -> str:
    host = os.environ.get("SGLANG_HOST_IP") or getattr(server_args, "host", None) or "127.0.0.1"
    return "127.0.0.1" if host in ("0.0.0.0", "::", "localhost") else host


def _choose_backend(args: KVArgs) -> str:
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        return chosen
    if getattr(args, "ib_device", None) and "verbs" in kv_transfer.backends():
        return "verbs"
    return "mooncake" if "mooncake" in kv_transfer.backends() else "tcp-sim"


def _buffers(ptrs: Optional[List[int]], lens: Optional[List[int]], items: Optional[List[int]]) -> List[Tuple[int, int, int]]:
    ptrs, lens, items = list(ptrs or []), list(lens or []), list(items or [])
    if not (len(ptrs) == len(lens) == len(items)):
        raise kv_transfer.DescriptorError(
            f"KVArgs lists {len(ptrs)} pointers, {len(lens)} lengths and {len(items)} item lengths"
        )
    return [(int(p), int(n), int(i)) for p, n, i in zip(ptrs, lens, items)]


def _index_bytes(indices: Any) -> bytes:
    arr = np.ascontiguousarray(np.asarray(indices).reshape(-1))
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise kv_transfer.AdmissionRefused("page index out of int32 range")
    return arr.astype("<i4", copy=False).tobytes()


class KvTransferBootstrapServer(bootstrap.BootstrapServer, BaseKVBootstrapServer):
    """The prefill ranks' registry (:mod:`kv_transfer.sglang.bootstrap`):
    ``PUT /route`` (a prefill rank registers; validated; first writer wins,
    or with the launch config's shared secret a fresh challenged and
    authenticated registration, ``GET /challenge``), ``GET /route?rank=N``.
    Serves in a daemon thread, its connections bounded per address and in
    all, with idle and whole-request deadlines."""

    def __init__(self, host: str, port: int, **limits: Any):
        bootstrap.BootstrapServer.__init__(self, host, port, **limits)


class KvTransferManager(BaseKVManager):
    """One worker's kv_transfer endpoint, its KV and aux pools, and the
    requests in flight (by bootstrap room)."""

    supports_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
    ):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = is_mla_backend
        self.enable_deferred_decode_kv_release = True
        self.metrics: Dict[str, int] = {
            "bad_control_messages": 0,
            "deadline_passed_held": 0,
            "rooms_released_on_proof": 0,
        }
        self._lock = threading.Condition()
        self.backend = _choose_backend(args)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        name = f"sglang-{role}-{getattr(args, 'engine_rank', 0)}-{os.getpid()}-{id(self):x}"
        opts: Dict[str, Any] = {}
        if self.backend == "tcp-sim":
            opts["policy"] = os.environ.get(POLICY_ENV, "safe")
            opts["fault_gate"] = os.environ.get(FAULT_GATE_ENV, "") == "1"
        elif self.backend == "verbs":
            opts["device"] = getattr(args, "ib_device", None) or os.environ.get("KVT_VERBS_DEVICE", "rxe0")
        elif self.backend == "mooncake":
            opts["host"] = _local_host(server_args)
        if role == "decode":
            self._check_deferred_release()
        self.endpoint = kv_transfer.Endpoint(self.backend, name, **opts)
        # One control plane per worker: the prefill serves on it, the decode
        # keeps one authenticated connection per prefill on it.
        self.plane = ControlPlane(name, limits=PlaneLimits(max_frame=wire.MAX_FRAME))
        self.kv_pool = self.endpoint.register(_buffers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens))
        aux = _buffers(getattr(args, "aux_data_ptrs", None), getattr(args, "aux_data_lens", None), getattr(args, "aux_item_lens", None))
        self.aux_pool = self.endpoint.register(aux) if aux else None
        # One pool per state type (Mamba, SWA, ...): item i of every buffer
        # of that type is one "page" of it. Same layout on both sides
        # (no resharding across TP sizes).
        self.state_pools: List[Optional[kv_transfer.PagePool]] = []
        self.state_item_lens: List[List[int]] = []
        for ptrs, lens, items in zip(
            getattr(args, "state_data_ptrs", None) or [],
            getattr(args, "state_data_lens", None) or [],
            getattr(args, "state_item_lens", None) or [],
        ):
            bufs = _buffers(ptrs, lens, items)
            self.state_pools.append(self.endpoint.register(bufs) if bufs else None)
            self.state_item_lens.append([b[2] for b in bufs])
        # decode: room -> its leases (only rooms this decode exposed).
        self.rooms: Dict[int, Any] = {}
        self.prefill_info_table: Dict[str, Any] = {}
        self._registrations: Dict[str, wire.Registration] = {}
        # prefill: the control port and its bounded room table.
        self.control: Optional[PrefillControlPlane] = None
        if role == "prefill":
            self.control = PrefillControlPlane(self.endpoint, self.kv_pool, self.aux_pool, self.state_pools,
                                               host=_local_host(server_args), plane=self.plane)
            self.register_to_bootstrap()
        logger.info("kvtransfer %s manager: backend %s, %d KV buffers x %d pages", role, self.backend,
                    self.kv_pool.buffers, self.kv_pool.pages)

    # --- startup checks --------------------------------------------------
    @staticmethod
    def _check_deferred_release() -> None:
        from sglang.srt.environ import envs

        if not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
            raise RuntimeError(
                "kvtransfer refuses to start: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off, so SGLang "
                "would free an aborted request's KV pages at once, while the prefill's writes may still land. "
                "Unset it (it defaults to true)."
            )
        from . import plugin

        if not plugin.release_hook_installed():
            raise RuntimeError(
                "kvtransfer refuses to start: its hook on DecodeTransferQueue.resolve_deferred_releases is not in "
                "place (the plugin did not load: is kv_transfer installed in this environment, and SGLANG_PLUGINS "
                "not excluding 'kvtransfer'?), so SGLang's timer could free pages without a proof."
            )

    # --- prefill: bootstrap registration and the control server ----------
    def _bootstrap_base(self) -> str:
        port = getattr(self.server_args, "disaggregation_bootstrap_port", 8998)
        return f"http://{_local_host(self.server_args)}:{port}"

    def _bootstrap_url(self) -> str:
        return f"{self._bootstrap_base()}/route"

    def register_to_bootstrap(self) -> None:
        assert self.control is not None
        host, port = self.control.address
        reg = wire.Registration(
            rank=int(getattr(self.kv_args, "engine_rank", 0) or 0),
            ctrl_host=host,
            ctrl_port=port,
            backend=self.backend,
            descriptor=bytes(self.endpoint.descriptor()),
            page_size=int(getattr(self.kv_args, "page_size", 1) or 1),
            kv_item_lens=[int(x) for x in self.kv_args.kv_item_lens],
            aux_item_lens=[int(x) for x in (getattr(self.kv_args, "aux_item_lens", None) or [])],
            state_item_lens=self.state_item_lens,
        )
        body = reg.to_json()
        for attempt in range(5):
            try:
                # With the launch's secret: a fresh challenge each attempt, the MAC over it and the body.
                bootstrap.put_registration(self._bootstrap_base(), body, CTRL_TIMEOUT_S)
                return
            except urllib.error.HTTPError as e:
                why = e.read()
                # Challenges outstanding at their cap (429), or ours given way
                # to newer ones before our PUT came (403, stale: the server
                # evicts the oldest under a flood from many addresses): a
                # fresh challenge may pass. Anything else is final.
                if e.code == 429 or (e.code == 403 and b"unknown, spent or expired" in why):
                    logger.warning("kvtransfer: bootstrap registration attempt %d refused (%d): %r",
                                   attempt + 1, e.code, why[:120])
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise kv_transfer.DescriptorError(f"the bootstrap server refused our registration: {why!r}") from None
            except OSError as e:
                logger.warning("kvtransfer: bootstrap registration attempt %d failed: %s", attempt + 1, e)
                time.sleep(0.2 * 2**attempt)
        raise kv_transfer.BackendFailure(f"cannot register with the bootstrap server at {self._bootstrap_url()}")

    def handle_metadata(self, data: bytes, peer: str = "local") -> None:
        """Prefill: one decode request's exposure (see :class:`PrefillControlPlane`)."""
        assert self.control is not None
        self.control.handle_metadata(data, peer)

    def expect_room(self, room: int) -> None:
        """Prefill: SGLang made a sender for ``room``; its metadata is kept."""
        if self.control is not None:
            self.control.expect_room(room)

    def target_of(self, room: int) -> Optional[Target]:
        return None if self.control is None else self.control.target_of(room)

    def forget_room(self, room: int, failed: bool = False) -> None:
        if self.control is not None:
            self.control.forget_room(room, failed)
        else:
            with self._lock:
                self.rooms.pop(room, None)

    # --- decode: the prefill's registration ------------------------------
    def prefill_registration(self, bootstrap_addr: str, rank: int = 0) -> wire.Registration:
        key = f"{bootstrap_addr}#{rank}"
        with self._lock:
            reg = self._registrations.get(key)
        if reg is not None:
            return reg
        url = f"http://{bootstrap_addr}/route?rank={rank}"
        try:
            data = bootstrap.fetch_registration(url, CTRL_TIMEOUT_S)
        except (OSError, urllib.error.HTTPError) as e:
            raise kv_transfer.BackendFailure(f"prefill at {bootstrap_addr} not reachable yet: {e}") from None
        reg = wire.parse_registration(data)
        if reg.backend != self.backend:
            raise wire.ProtocolError(f"the prefill runs backend {reg.backend!r}, this decode {self.backend!r}")
        if reg.kv_item_lens != [int(x) for x in self.kv_args.kv_item_lens]:
            raise wire.ProtocolError("the prefill's KV page layout differs from this decode's (kv_item_lens)")
        if [list(x) for x in reg.state_item_lens] != self.state_item_lens:
            raise wire.ProtocolError("the prefill's state buffer layout differs from this decode's (state_item_lens)")
        with self._lock:
            self._registrations[key] = reg
        return reg

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        try:
            self.prefill_registration(bootstrap_addr)
        except kv_transfer.KvTransferError as e:
            logger.debug("kvtransfer: prefill info for %s: %s", bootstrap_addr, e)
            return False
        from types import SimpleNamespace

        self.prefill_info_table[bootstrap_addr] = SimpleNamespace(dp_size=1, follow_bootstrap_room=True)
        return True

    # --- decode: release on proof only -----------------------------------
    def track(self, room: int, leases: List[kv_transfer.PageLease]) -> None:
        with self._lock:
            self.rooms[room] = leases

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Whether every page the room exposed is proven free in the pool
        (``required_acks`` is SGLang's count; the pool's proof is the answer)."""
        with self._lock:
            leases = self.rooms.get(room)
        if leases is None:
            return True
        safe = all(lease.drained for lease in leases)
        if safe:
            with self._lock:
                if self.rooms.pop(room, None) is not None:
                    self.metrics["rooms_released_on_proof"] += 1
        return safe

    def clear_deferred_abort_state(self, room: int) -> None:
        # Only after SGLang released the room, i.e. after the proof (or for a
        # room that never exposed anything).
        with self._lock:
            leases = self.rooms.get(room)
            if leases is None or all(lease.drained for lease in leases):
                self.rooms.pop(room, None)

    def note_deadline_passed(self, room: int, timeout_s: float) -> None:
        """SGLang's deferred-release deadline passed without a proof: held, reported."""
        with self._lock:
            self.metrics["deadline_passed_held"] += 1
            leases = self.rooms.get(room) or []
        pending = sum(len(lease) for lease in leases if not lease.drained)
        logger.warning(
            "kvtransfer: room %s: SGLang's deferred-release deadline (%.3g s) passed; %d page(s) are not proven free "
            "and stay held (the backend's escalation drains, revokes and fences as it can); not releasing",
            room, timeout_s, pending,
        )

    def get_metrics(self) -> Dict[str, Any]:
        """The pools' and backend's metrics plus this manager's counters."""
        m = kv_transfer.metrics(self.kv_pool, self.endpoint)
        with self._lock:
            m.update(self.metrics)
        if self.control is not None:
            m.update(self.control.stats())
        return m

    def teardown(self) -> None:
        if self.control is not None:
            self.control.close()
        self.plane.close()


class _Failed(Exception):
    pass


class KvTransferSender(BaseKVSender):
    """Prefill side of one request: writes its pages into the decode's
    exposed pages, chunk by chunk, then the aux row; DONE settles them."""

    def __init__(self, mgr: KvTransferManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.num_pages: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.sent_pages = 0
        #: The last chunk was handed over (it may carry no page: the decode's
        #: prefix cache can hold the whole prompt).
        self.last_sent = False
        self.pending: List[Tuple[bytes, Any, Any]] = []
        self.transfers: List[kv_transfer.Transfer] = []
        self.conclude_state: Optional[int] = None
        self.error: Optional[str] = None
        self.aborted = False
        self.started_at: Optional[float] = None
        self.bytes_total = 0
        self.latency_s: Optional[float] = None
        # Only rooms a sender exists for keep their metadata beyond a peer's pending share.
        mgr.expect_room(bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages = int(num_kv_indices)
        self.aux_index = aux_index

    def send(self, kv_indices: Any, state_indices: Optional[List[Any]] = None, num_kv_tokens: Optional[int] = None,
             **_: Any) -> None:
        target = self.kv_mgr.target_of(self.bootstrap_room)
        if target is None:
            return self._fail("send() before the decode's metadata arrived")
        _, kv_remote, aux_remote, _, state_remotes = target
        idx = _index_bytes(kv_indices)
        n = len(idx) // 4
        if self.started_at is None:
            self.started_at = time.perf_counter()
        if n:
            exposed = 0 if kv_remote is None else kv_remote.pages
            if self.sent_pages + n > exposed:
                return self._fail(f"prefill sends {self.sent_pages + n} pages, the decode exposed {exposed}")
            self.pending.append((idx, kv_remote.slice(self.sent_pages, self.sent_pages + n), self.kv_mgr.kv_pool))
            self.sent_pages += n
            self.bytes_total += n * sum(self.kv_mgr.kv_pool.page_bytes)
        last = self.num_pages is None or self.sent_pages >= self.num_pages
        self.last_sent = self.last_sent or last
        if last and self.aux_index is not None and aux_remote is not None and self.kv_mgr.aux_pool is not None:
            self.pending.append((_index_bytes([self.aux_index]), aux_remote, self.kv_mgr.aux_pool))
        for t, indices in enumerate(state_indices or []):
            if indices is None:
                continue
            remote = state_remotes[t] if t < len(state_remotes) else None
            idx = _index_bytes(indices)
            if remote is None or remote.pages != len(idx) // 4:
                return self._fail(f"state {t}: the decode exposed no matching items for {len(idx) // 4} state indices")
            self.pending.append((idx, remote, self.kv_mgr.state_pools[t]))
        self._drive()

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A last chunk with no page still carries the aux row (the first
        # token) and the state; without it the request never concludes.
        return num_pages > 0 or last_chunk

    def _drive(self) -> None:
        ep = self.kv_mgr.endpoint
        still = []
        for idx, remote, pool in self.pending:
            try:
                lease = pool.reserve(idx)
            except kv_transfer.AdmissionRefused:
                # A source page another request is still sending (a shared
                # prefix): post when that transfer gave it back.
                still.append((idx, remote, pool))
                continue
            try:
                self.transfers.append(ep.write(lease, remote, notify=True))
            except kv_transfer.KvTransferError as e:
                lease.release()
                self._fail(f"post refused: {e}")
        self.pending = still

    def _fail(self, why: str) -> None:
        self.error = self.error or why
        self.aborted = True

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.kv_mgr.target_of(self.bootstrap_room) is None and not self.aborted:
            return KVPoll.Bootstrapping
        if not self.transfers and not self.pending and not self.aborted and not self.last_sent:
            return KVPoll.WaitingForInput
        if self.pending and not self.aborted:
            self._drive()
        # Never Success or Failed while a transfer may still read source
        # pages: SGLang frees them on either.
        states = [t.poll() for t in self.transfers]
        if "pending" in states:
            return KVPoll.Transferring
        if self.pending and not self.aborted:
            return KVPoll.Transferring
        done = self.num_pages is None or self.sent_pages >= self.num_pages
        if not done and not self.aborted:
            return KVPoll.Transferring
        failed = [t.error for t in self.transfers if t.poll() == "failed"]
        for t in self.transfers:
            t.release()
        self.transfers = []
        if self.started_at is not None:
            self.latency_s = time.perf_counter() - self.started_at
        self.kv_mgr.forget_room(self.bootstrap_room, failed=bool(failed or self.aborted))
        if failed or self.aborted:
            self.error = self.error or (failed[0] if failed else "aborted")
            self.conclude_state = KVPoll.Failed
        else:
            self.conclude_state = KVPoll.Success
        return self.conclude_state

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode already holds: SGLang's prefill starts sending after them."""
        target = self.kv_mgr.target_of(self.bootstrap_room)
        return 0 if target is None else int(target[3])

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self.latency_s, transfer_total_bytes=self.bytes_total)

    def failure_exception(self) -> None:
        raise kv_transfer.BackendFailure(f"kvtransfer send for room {self.bootstrap_room} failed: {self.error}")

    def abort(self) -> None:
        self._fail("aborted")
        for t in self.transfers:
            t.cancel()

    def clear(self) -> None:
        pass


class KvTransferReceiver(BaseKVReceiver):
    """Decode side of one request: reserves the pages SGLang allocated in
    the pool, exposes them to the prefill, and reports Success once the
    prefill's DONE settled every page. Aborted while exposed, the pages are
    quarantined and SGLang may free them only on proof."""

    def __init__(self, mgr: KvTransferManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, **_: Any):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.abort_notified = False
        self.require_staging = False
        self.conclude_state: Optional[int] = None
        self.bootstrap_infos: Optional[List[Dict[str, Any]]] = None
        self.leases: List[kv_transfer.PageLease] = []
        self.peer: Optional[int] = None
        self.registration: Optional[wire.Registration] = None
        self.error: Optional[str] = None
        self.exposed_at: Optional[float] = None
        # The prefill's answer to our metadata (checked in poll: the
        # scheduler never waits on the network).
        self.md_reply: Any = None
        from sglang.srt.environ import envs

        self.waiting_timeout = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())

    def init(self, prefill_dp_rank: int = 0) -> None:
        try:
            reg = self.kv_mgr.prefill_registration(self.bootstrap_addr, 0)
            self.peer = self.kv_mgr.endpoint.add_peer(reg.descriptor)
        except kv_transfer.KvTransferError as e:
            return self._fail(f"bootstrap with {self.bootstrap_addr}: {e}")
        self.registration = reg
        self.bootstrap_infos = [{"rank_ip": reg.ctrl_host, "rank_port": reg.ctrl_port, "is_dummy": False}]

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[List[Any]] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None, **_: Any) -> None:
        if self.registration is None or self.peer is None:
            return self._fail("send_metadata before init")
        mgr = self.kv_mgr
        for t, indices in enumerate(state_indices or []):
            if indices is not None and (t >= len(mgr.state_pools) or mgr.state_pools[t] is None):
                return self._fail(f"state indices for state type {t}, which has no buffers here")
        kv_idx = _index_bytes(kv_indices)
        leases: List[kv_transfer.PageLease] = []
        if kv_idx:
            try:
                leases.append(mgr.kv_pool.reserve(kv_idx))
            except kv_transfer.AdmissionRefused as e:
                # A page still quarantined or leased: SGLang reused it too early.
                return self._fail(f"decode pages refused: {e}")
        # No KV pages: the decode's radix cache holds the whole prompt's
        # KV (decode_prefix_len); only the aux row (and state) moves.
        try:
            kv_remote = mgr.endpoint.expose(leases[0], self.peer) if leases else None
            aux_remote = None
            if aux_index is not None and mgr.aux_pool is not None:
                aux = mgr.aux_pool.reserve([int(aux_index)])
                leases.append(aux)
                aux_remote = mgr.endpoint.expose(aux, self.peer)
            state_remotes: List[Optional[bytes]] = []
            for t, indices in enumerate(state_indices or []):
                if indices is None:
                    state_remotes.append(None)
                    continue
                lease = mgr.state_pools[t].reserve(_index_bytes(indices))
                leases.append(lease)
                state_remotes.append(bytes(mgr.endpoint.expose(lease, self.peer).to_bytes()))
        except kv_transfer.KvTransferError as e:
            self.leases = leases
            self._abort_leases()
            return self._fail(f"expose: {e}")
        if not leases:
            return self._fail("nothing to receive: no KV page, no aux row, no state")
        self.leases = leases
        mgr.track(self.bootstrap_room, leases)
        self.exposed_at = time.monotonic()
        md = wire.Metadata(
            room=int(self.bootstrap_room),
            descriptor=bytes(mgr.endpoint.descriptor()),
            kv=b"" if kv_remote is None else bytes(kv_remote.to_bytes()),
            aux=None if aux_remote is None else bytes(aux_remote.to_bytes()),
            prefix_len=int(decode_prefix_len or 0),
            state=tuple(state_remotes),
        )
        # Pipelined on this worker's one connection to the prefill (the
        # deployment named it: the bootstrap's registration).
        self.md_reply = mgr.plane.request(self.registration.ctrl_host, self.registration.ctrl_port, md.to_json(),
                                          CTRL_TIMEOUT_S)

    def _metadata_refused(self) -> Optional[str]:
        """Why the prefill refused our metadata (or could not be reached),
        once it answered; None while it has not, or if it took it."""
        f = self.md_reply
        if f is None or not f.done():
            return None
        self.md_reply = None
        try:
            reply = json.loads(f.result())
        except Exception as e:  # noqa: BLE001 (a refusal, a closed connection, a timeout: all typed below)
            return f"{type(e).__name__}: {e}"
        return None if isinstance(reply, dict) and reply.get("ok") is True else f"unexpected answer {reply!r:.200}"

    def _abort_leases(self) -> None:
        for lease in self.leases:
            if lease.state == "exposed":
                lease.abort()
                self.abort_notified = True
            elif lease.state in ("reserved", "settled"):
                lease.release()

    def _fail(self, why: str) -> None:
        self.error = self.error or why
        logger.warning("kvtransfer: room %s: %s", self.bootstrap_room, why)
        self.conclude_state = KVPoll.Failed

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.bootstrap_infos is None:
            return KVPoll.Bootstrapping
        if not self.leases:
            return KVPoll.WaitingForInput
        refused = self._metadata_refused()
        if refused is not None:
            self._abort_leases()
            self._fail(f"the prefill refused the metadata: {refused}")
            return KVPoll.Failed
        if all(lease.try_settle() for lease in self.leases):
            # Proven: no NIC writes into these pages any more; SGLang owns them.
            for lease in self.leases:
                lease.release()
            self.kv_mgr.forget_room(int(self.bootstrap_room))
            self.conclude_state = KVPoll.Success
            return self.conclude_state
        if self.exposed_at is not None and time.monotonic() - self.exposed_at > self.waiting_timeout:
            self._abort_leases()
            self._fail(f"no DONE from the prefill within {self.waiting_timeout} s")
            return KVPoll.Failed
        return KVPoll.Transferring

    def abort(self) -> None:
        self._abort_leases()
        self.error = self.error or "Aborted by AbortReq."
        self.conclude_state = KVPoll.Failed

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        # Exposed pages go to quarantine (the ladder sends ABORT to the
        # prefill, then revokes, fences); SGLang must then defer the release.
        self._abort_leases()

    def is_abort_release_safe(self) -> bool:
        return all(lease.drained for lease in self.leases)

    def failure_exception(self) -> None:
        raise kv_transfer.BackendFailure(f"kvtransfer receive for room {self.bootstrap_room} failed: {self.error}")

    def clear(self) -> None:
        pass
