"""kv_transfer.vllm at tensor parallel 2 on both sides, in real vLLM API
servers (the CPU build, gloo, one worker per core), compared token for
token with a single TP 1 instance.

Each of the prefill's two workers serves its shard of every block (one of
the tiny model's two KV heads) on its own side port (``side_port + rank``);
each decode worker pulls its shard from the prefill worker of its rank, and
vLLM frees a request's blocks only once every worker reported it: the
prefill's on every worker's proof, the decode's on every worker's READ.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
from engine_servers import free_ports

import harness as h

LENGTHS = [1, 31, 33, 97, 200]
NEW = 16
BLOCKS = 48
TP = 2
BACKENDS = ["tcp-sim", "mooncake"]


class TpFleet:
    def __init__(self) -> None:
        self.refs: Dict[tuple, List[int]] = {}
        self.p_side = free_ports(TP)
        self.d_side = free_ports(TP)


@pytest.fixture(scope="module")
def tp_fleet(model: str, vocab: int):
    f = TpFleet()
    single = h.Server("tp-single", model, None, 0, BLOCKS)
    servers = [single]
    try:
        h.start_all([single])
        for pr in h.prompts(vocab, LENGTHS, seed=23):
            f.refs[tuple(pr)] = h.complete(single.port, pr, NEW)["tokens"]
        single.stop()  # memory for the two TP 2 engines
        backends = ",".join(BACKENDS)
        f.p = h.Server("tp2-prefill", model, h.ours("kv_producer", f.p_side, backends), 0, BLOCKS, tp=TP)
        f.d = h.Server("tp2-decode", model, h.ours("kv_consumer", f.d_side, backends,
                                                   prefills=[f"127.0.0.1:{f.p_side}"]), 1, BLOCKS, tp=TP)
        servers += [f.p, f.d]
        h.start_all([f.p, f.d])
        yield f
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_to_tp2_greedy_tokens_equal_a_single_instance_and_every_worker_pulls_its_shard(tp_fleet: TpFleet,
                                                                                          backend: str):
    f = tp_fleet
    before = [h.side_stats(f.d_side + r).get("loads_loaded", 0) for r in range(TP)]
    for pr, want in f.refs.items():
        params = h.complete(f.p.port, list(pr), 1, {"do_remote_decode": True})["kv_transfer_params"]
        assert params and params.get("kvt_tp") == TP, params
        params["kvt_backends"] = [backend]
        got = h.complete(f.d.port, list(pr), NEW, params)["tokens"]
        assert got == want, (backend, len(pr))
    for r in range(TP):
        st = h.side_stats(f.d_side + r)
        assert st["loads_loaded"] - before[r] == len(f.refs), (r, st)
        assert st["loads_load_failures"] == 0 and st["loads_refused_tp_mismatch"] == 0, (r, st)
    # Both engines' blocks back: vLLM's usage at 0, every worker's pool free, nothing stuck.
    for s in (f.p, f.d):
        h.wait_until(f"{s.name}: vllm:kv_cache_usage_perc == 0",
                     lambda s=s: s.metric("vllm:kv_cache_usage_perc") == 0.0, 60)
    for base in (f.p_side, f.d_side):
        for r in range(TP):
            st = h.side_stats(base + r)
            assert st[backend]["quarantine_stuck"] == 0 and st[backend]["free"] == st[backend]["capacity"], (r, st)
    for r in range(TP):
        st = h.side_stats(f.p_side + r)
        assert st["offers_waiting_now"] == st["offers_exposed_now"] == st["offers_draining_now"] == 0, (r, st)
