"""kv_transfer.vllm at 2 prefills x 2 decodes behind a proxy (xPyD), in
real API servers: every decode names both prefills (``prefills``) and pulls
from each; greedy tokens through the proxy equal a single instance's; both
sides' pools come back whole.

Not here yet: load from ``vllm bench serve`` through the proxy (32 requests,
4 at a time) completes 30 of 32 on this machine; two fetches stay unanswered
past their deadline (issue 47).
"""

from __future__ import annotations

from typing import Dict, List

import pytest

import harness as h
from pd_proxy import PdProxy

NEW = 16
BLOCKS = 48
BACKEND = "tcp-sim"
LENGTHS = [1, 33, 97, 150, 200, 64, 31, 120]
#: Four engines on two cores: OpenMP's default spin-wait keeps idle workers
#: spinning, and a side port's thread waits seconds for a CPU; sleeping waits,
#: as on any oversubscribed CPU host.
QUIET_OMP = {"OMP_WAIT_POLICY": "PASSIVE"}


class XpYd:
    def __init__(self) -> None:
        self.refs: Dict[tuple, List[int]] = {}
        self.p_sides = [h.free_port(), h.free_port()]
        self.d_sides = [h.free_port(), h.free_port()]


@pytest.fixture(scope="module")
def xpyd(model: str, vocab: int):
    f = XpYd()
    single = h.Server("xpyd-single", model, None, 0, BLOCKS)
    servers = [single]
    proxy = None
    try:
        h.start_all([single])
        for pr in h.prompts(vocab, LENGTHS, seed=41):
            f.refs[tuple(pr)] = h.complete(single.port, pr, NEW)["tokens"]
        single.stop()  # memory and cores for the four
        named = [f"127.0.0.1:{p}" for p in f.p_sides]
        f.p = [h.Server(f"xpyd-prefill{i}", model, h.ours("kv_producer", side, BACKEND), i % 2, BLOCKS,
                        env=QUIET_OMP)
               for i, side in enumerate(f.p_sides)]
        f.d = [h.Server(f"xpyd-decode{i}", model, h.ours("kv_consumer", side, BACKEND, prefills=named), (i + 1) % 2,
                        BLOCKS, env=QUIET_OMP) for i, side in enumerate(f.d_sides)]
        servers += f.p + f.d
        h.start_all(f.p + f.d)
        proxy = f.proxy = PdProxy([s.port for s in f.p], [s.port for s in f.d])
        yield f
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()


def test_xpyd_through_a_proxy_greedy_tokens_equal_a_single_instance_and_each_decode_pulls_from_each_prefill(
        xpyd: XpYd):
    f = xpyd
    before = [h.side_stats(p)["loads_loaded"] for p in f.d_sides]
    for pr, want in f.refs.items():
        assert h.complete(f.proxy.port, list(pr), NEW)["tokens"] == want, len(pr)
    assert f.proxy.failures == 0
    # Round robin over the four pairs: every decode pulled from every prefill.
    assert len(f.proxy.used) == 4 and min(f.proxy.used.values()) >= 2, f.proxy.used
    loaded = [h.side_stats(p)["loads_loaded"] - b for p, b in zip(f.d_sides, before)]
    assert loaded == [len(f.refs) // 2] * 2, loaded
    for side in f.p_sides:
        assert h.side_stats(side)["offers_settled_by_done"] >= len(f.refs) // 2
    for s in f.p + f.d:
        h.wait_until(f"{s.name}: vllm:kv_cache_usage_perc == 0",
                     lambda s=s: s.metric("vllm:kv_cache_usage_perc") == 0.0, 60)
    for side in f.p_sides + f.d_sides:
        st = h.side_stats(side)
        assert st[BACKEND]["quarantine_stuck"] == 0 and st[BACKEND]["free"] == st[BACKEND]["capacity"], st[BACKEND]
