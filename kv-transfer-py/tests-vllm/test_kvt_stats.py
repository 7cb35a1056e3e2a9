"""kv_transfer.vllm's metrics objects without a server: workers' reports
sum, gauges count each worker's latest value, and the Prometheus series
carry NixlConnector's names under ``vllm:kvt_``."""

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kv_transfer.vllm import stats  # noqa: E402


def test_workers_reports_aggregate_and_reduce():
    a, b = stats.KvtKVConnectorStats(), stats.KvtKVConnectorStats()
    a.record_transfer(0.002, 0.0005, 4096, 8, 0.001)
    b.record_transfer(0.004, 0.0015, 4096, 8, 0.003)
    a.count("num_proofs_completed", 2)
    b.count("num_failed_transfers", 1)
    b.count("num_refused", 0)  # nothing: no entry
    a.gauge("slots_quarantined", 0, 3)
    b.gauge("slots_quarantined", 1, 5)
    b.gauge("slots_quarantined", 1, 1)  # worker 1's latest
    assert not a.is_empty() and stats.KvtKVConnectorStats().is_empty()
    got = a.aggregate(b).reduce()
    assert got["Num successful transfers"] == 2 and got["Avg xfer time (ms)"] == 3.0
    assert got["Avg claim time (ms)"] == 2.0
    assert got["num_proofs_completed"] == 2 and got["num_failed_transfers"] == 1 and got["num_refused"] == 0
    assert got["slots_quarantined"] == 3 + 1
    old = a.clone_and_reset()
    assert a.is_empty() and not old.is_empty()


def test_prometheus_series_are_nixls_meanings_under_the_kvt_prefix():
    reg = CollectorRegistry()

    def kind(cls):
        return lambda **kw: cls(registry=reg, **kw)

    types = {Gauge: kind(Gauge), Counter: kind(Counter), Histogram: kind(Histogram)}
    prom = stats.KvtPromMetrics(type("C", (), {"kv_transfer_config": None})(), types, ["engine"], {0: ["0"]})
    s = stats.KvtKVConnectorStats()
    s.record_transfer(0.002, 0.0005, 4096, 8, 0.004)
    s.count("num_proofs_completed", 2)
    s.gauge("slots_quarantined", 0, 3)
    prom.observe(s.data, 0)
    t = stats.KvtKVConnectorStats()
    t.gauge("slots_quarantined", 1, 2)  # another worker's report: the gauge sums both
    prom.observe(t.data, 0)
    value = lambda name: reg.get_sample_value(name, {"engine": "0"})  # noqa: E731
    assert value("vllm:kvt_xfer_time_seconds_count") == 1
    assert value("vllm:kvt_bytes_transferred_sum") == 4096
    assert value("vllm:kvt_claim_time_seconds_count") == 1 and value("vllm:kvt_claim_time_seconds_sum") == 0.004
    assert value("vllm:kvt_num_proofs_completed_total") == 2
    assert value("vllm:kvt_slots_quarantined") == 5
    nixl = {"xfer_time_seconds", "post_time_seconds", "bytes_transferred", "num_descriptors", "num_failed_transfers",
            "num_failed_notifications", "num_kv_expired_reqs"}
    ours = {name.split("vllm:kvt_", 1)[1] for _, name, *_ in stats.TIMED + stats.COUNTED}
    assert nixl <= ours, nixl - ours
