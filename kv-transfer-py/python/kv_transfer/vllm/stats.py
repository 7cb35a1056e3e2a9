"""kv_transfer.vllm's metrics for vLLM's logger and Prometheus endpoint
(vLLM's ``KVConnectorStats`` and ``KVConnectorPromMetrics``).

NixlConnector's series, with the same meaning, under ``vllm:kvt_`` where it
has ``vllm:nixl_`` (a dashboard works by renaming the prefix): the time of
each transfer from its post to its completion, the time the post itself
took, the bytes and descriptors (blocks x buffers) of each, and the failed
transfers, failed notifications (here: a decode's release that did not
reach the prefill) and expired requests (an offer withdrawn unclaimed, or
an exposure aborted at its deadline). Then ours: each load's claim time
(from vLLM's request to the prefill's exposure, the round trip that
admission before exposure costs), the proofs that gave
blocks back, by kind (``completed``: the peer's DONE; ``revoked``,
``fenced``: the ladder's), the refusals (claims, releases and loads
refused, and what the pools refused: stale or forged tokens, admission),
and two gauges, the blocks quarantined and the ones stuck (quarantined
with no proof to come: held for good, never freed).

A worker reports what happened since its last report; vLLM sums the
workers' reports (``aggregate``) and hands each step's sum to
:meth:`KvtPromMetrics.observe`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: One value per transfer: (key, Prometheus name, help, buckets).
TIMED = (
    ("transfer_duration", "vllm:kvt_xfer_time_seconds", "Time of a KV transfer, from its post to its completion.",
     [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
    ("post_duration", "vllm:kvt_post_time_seconds", "Time a KV transfer's post took.",
     [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
    ("bytes_transferred", "vllm:kvt_bytes_transferred", "Bytes of a KV transfer.",
     [2 ** (10 + i) for i in range(1, 25, 2)]),
    ("num_descriptors", "vllm:kvt_num_descriptors", "Descriptors (blocks x buffers) of a KV transfer.",
     [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]),
    ("claim_duration", "vllm:kvt_claim_time_seconds",
     "Time from vLLM's load request to the prefill's exposure (the claim's round trip, retries included), "
     "before the transfer is posted. NixlConnector has no such step.",
     [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]),
)
#: Events counted: (key, Prometheus name, help).
COUNTED = (
    ("num_failed_transfers", "vllm:kvt_num_failed_transfers", "KV transfers (loads) that failed."),
    ("num_failed_notifications", "vllm:kvt_num_failed_notifications",
     "A decode's releases of an offer that did not reach the prefill."),
    ("num_kv_expired_reqs", "vllm:kvt_num_kv_expired_reqs",
     "Offers withdrawn unclaimed, or exposures aborted, at their deadline (prefill). Aborted blocks "
     "come back only with a proof."),
    ("num_proofs_completed", "vllm:kvt_num_proofs_completed", "Blocks given back on the peer's DONE."),
    ("num_proofs_revoked", "vllm:kvt_num_proofs_revoked", "Blocks given back on a revocation's proof."),
    ("num_proofs_fenced", "vllm:kvt_num_proofs_fenced", "Blocks given back on a fence's proof."),
    ("num_refused", "vllm:kvt_num_refused",
     "Claims, releases and loads refused, and stale, forged or inadmissible tokens the pools refused."),
)
#: Gauges, each worker's latest value summed: (key, Prometheus name, help).
GAUGED = (
    ("slots_quarantined", "vllm:kvt_slots_quarantined", "KV blocks quarantined: waiting for a proof."),
    ("slots_stuck", "vllm:kvt_slots_stuck", "KV blocks quarantined with no proof to come: held for good."),
)


@dataclass
class KvtKVConnectorStats(KVConnectorStats):
    """What one or more workers saw in an interval: the timed series and
    the counts as lists (summed on aggregation), the gauges as
    ``[worker, value]`` samples (the latest per worker counts)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: Dict[str, List[Any]] = {k: [] for k, *_ in TIMED + COUNTED + GAUGED}

    def record_transfer(self, duration_s: float, post_s: float, nbytes: int, descriptors: int,
                        claim_s: float = 0.0) -> None:
        for key, v in zip(("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors",
                           "claim_duration"), (duration_s, post_s, nbytes, descriptors, claim_s)):
            self.data[key].append(v)

    def count(self, key: str, n: int) -> None:
        if n:
            self.data[key].append(int(n))

    def gauge(self, key: str, worker: int, value: int) -> None:
        self.data[key].append([int(worker), int(value)])

    def clone_and_reset(self) -> "KvtKVConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k, *_ in TIMED + COUNTED + GAUGED)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data.setdefault(k, []).extend(v)
        return self

    def gauges(self) -> Dict[str, int]:
        """Each gauge: the latest value of every worker that reported it, summed."""
        out = {}
        for key, *_ in GAUGED:
            latest = {w: v for w, v in self.data.get(key, [])}
            if latest:
                out[key] = sum(latest.values())
        return out

    def reduce(self) -> Dict[str, Any]:
        xfer = self.data["transfer_duration"]
        n = len(xfer)
        out: Dict[str, Any] = {"Num successful transfers": n}
        if n:
            out["Avg xfer time (ms)"] = round(sum(xfer) / n * 1e3, 3)
            out["Avg post time (ms)"] = round(sum(self.data["post_duration"]) / n * 1e3, 3)
            out["Avg MB per transfer"] = round(sum(self.data["bytes_transferred"]) / n / 2**20, 3)
            claims = self.data.get("claim_duration") or [0.0]
            out["Avg claim time (ms)"] = round(sum(claims) / len(claims) * 1e3, 3)
        for key, *_ in COUNTED:
            out[key] = sum(self.data[key])
        out.update(self.gauges())
        return out


class KvtPromMetrics(KVConnectorPromMetrics):
    """The series above as Prometheus histograms, counters and gauges, one
    per engine (vLLM's ``engine`` label)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per = self.per_engine_labelvalues
        self.histograms = {k: create_metric_per_engine(
            self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames), per)
            for k, name, doc, buckets in TIMED}
        self.counters = {k: create_metric_per_engine(
            self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per)
            for k, name, doc in COUNTED}
        self.gauges = {k: create_metric_per_engine(
            self._gauge_cls(name=name, documentation=doc, labelnames=labelnames), per)
            for k, name, doc in GAUGED}
        #: Per engine and gauge, each worker's latest value (a step's report
        #: may come from some workers only).
        self._latest: Dict[int, Dict[str, Dict[int, int]]] = {}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        latest = self._latest.setdefault(engine_idx, {})
        for key, g in self.gauges.items():
            samples = transfer_stats_data.get(key) or ()
            if samples:
                mine = latest.setdefault(key, {})
                mine.update({int(w): int(v) for w, v in samples})
                g[engine_idx].set(sum(mine.values()))
        for key, h in self.histograms.items():
            for v in transfer_stats_data.get(key, ()):
                h[engine_idx].observe(v)
        for key, c in self.counters.items():
            n = sum(transfer_stats_data.get(key, ()))
            if n > 0:  # a counter only goes up (a bad report must not take the logger down)
                c[engine_idx].inc(n)
