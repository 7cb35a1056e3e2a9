"""kv_transfer.vllm with vLLM's prefix caching on, on the prefill and the
decode (vLLM's default), in real API servers, compared token for token with
a single instance.

A decode whose prefix cache already holds the first blocks of a prompt
allocates blocks only for the rest; it pulls exactly those (the offer's
tail) and never writes a cached block, which running requests may share.
The prefill exposes only the blocks asked for; the ones skipped go back to
vLLM with the offer, on the DONE of the tail.
"""

from __future__ import annotations

from typing import List

import pytest

import harness as h

NEW = 16
BLOCKS = 64
BACKEND = "tcp-sim"
#: The second prompt shares the first's first 6 full blocks (6 x 32 tokens).
SHARED = 6 * h.BLOCK


@pytest.fixture(scope="module")
def cached_pair(model: str):
    p_side, d_side = h.free_port(), h.free_port()
    single = h.Server("prefix-single", model, None, 0, BLOCKS)
    p = h.Server("prefix-prefill", model, h.ours("kv_producer", p_side, BACKEND), 0, BLOCKS, prefix_caching=True)
    d = h.Server("prefix-decode", model, h.ours("kv_consumer", d_side, BACKEND, prefills=[f"127.0.0.1:{p_side}"]),
                 1, BLOCKS, prefix_caching=True)
    servers = [single, p, d]
    try:
        h.start_all(servers)
        yield single, p, d, p_side, d_side
    finally:
        for s in servers:
            s.stop()


def pd(p: h.Server, d: h.Server, prompt: List[int]) -> List[int]:
    params = h.complete(p.port, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert params and "kvt_offer" in params, params
    params["kvt_backends"] = [BACKEND]
    return h.complete(d.port, prompt, NEW, params)["tokens"]


def test_a_prefix_hit_on_the_decode_pulls_only_the_blocks_it_lacks_and_tokens_equal_a_single_instance(
        cached_pair, vocab: int, report):
    single, p, d, p_side, d_side = cached_pair
    a = h.prompts(vocab, [200], seed=31)[0]
    b = a[:SHARED] + h.prompts(vocab, [8], seed=32)[0]
    want = {tuple(pr): h.complete(single.port, pr, NEW)["tokens"] for pr in (a, b)}

    def pulled() -> int:
        return h.side_stats(d_side)["loads_blocks_pulled"]

    before = pulled()
    assert pd(p, d, a) == want[tuple(a)]
    after_a = pulled()
    assert pd(p, d, b) == want[tuple(b)]
    after_b = pulled()
    blocks = -(-len(b) // h.BLOCK)
    report(f"prefix caching: prompt A pulled {after_a - before} blocks; prompt B (sharing {SHARED} of {len(b)} "
           f"tokens, {blocks} blocks) pulled {after_b - after_a}")
    assert after_a - before == -(-len(a) // h.BLOCK), "the first prompt (nothing cached) pulls every block"
    assert after_b - after_a == blocks - SHARED // h.BLOCK, "the decode pulled blocks its prefix cache holds"
    # Every offer settled by its DONE, the skipped blocks with it; both pools whole.
    st = h.side_stats(p_side)
    assert st["offers_settled_by_done"] >= 2 and st["offers_aborted"] == 0, st
    h.wait_until("the prefill's offers all freed",
                 lambda: h.side_stats(p_side)["offers_exposed_now"] + h.side_stats(p_side)["offers_waiting_now"] == 0,
                 30)
    for port in (p_side, d_side):
        pool = h.side_stats(port)[BACKEND]
        assert pool["quarantine_stuck"] == 0 and pool["free"] == pool["capacity"], pool
