"""Same tokens: real SGLang prefill/decode pairs with
``--disaggregation-transfer-backend kvtransfer`` on each backend of the
package, page sizes 1 and 4, chunked prefill, several requests in flight,
overlap scheduling on (SGLang's default): the decode's greedy tokens equal
a single server's, token for token. The negative control: the same decode,
its received KV zeroed before it decodes, gives other tokens."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import pytest

import harness as h
from conftest import need

NEW = 24
CASES = [(b, ps) for b in ("tcp-sim", "mooncake", "nixl") for ps in (1, 4)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{b}-page{ps}" for b, ps in CASES])
def pair(request, model: str):
    backend, page_size = request.param
    import kv_transfer

    if backend not in kv_transfer.backends():
        need(f"kv_transfer built with the {backend} backend")
    if backend == "nixl" and not os.environ.get("KVT_ENGINES_VENV"):
        need("KVT_ENGINES_VENV (the engines venv with NIXL) for the nixl backend")
    # The larger page size also runs the decode with its radix cache on.
    extra = ["--disaggregation-decode-enable-radix-cache"] if page_size > 1 else None
    ps, d = h.disaggregated(f"same-{backend}-p{page_size}", model, f"kvtransfer:{backend}", page_size=page_size,
                            decode_extra=extra)
    try:
        h.start_all(ps + [d])
        yield ps[0], d
    finally:
        h.stop_all(ps + [d])


def _pd(pair: Tuple[h.Server, h.Server], prompt: List[int], **room: Any) -> Dict[str, Any]:
    p, d = pair
    return h.pd_generate(p, d, prompt, NEW, room_id=h.room(**room))


def test_disaggregated_greedy_tokens_equal_a_single_server(pair, prompts, reference):
    varied = prompts["varied"]
    # Twice over, four in flight: the second round also meets the prefill's radix cache.
    got = h.run_parallel(lambda pr: _pd(pair, pr), varied + varied, width=4)
    for pr, r in zip(varied + varied, got):
        assert not isinstance(r, Exception), r
        assert r["tokens"] == reference[tuple(pr)][:NEW], (len(pr), r)
    _, d = pair
    assert d.wait_idle()["num_used_tokens"] == 0


def test_negative_control_zeroed_kv_changes_the_tokens(pair, prompts, reference):
    varied = prompts["varied"]
    got = h.run_parallel(lambda pr: _pd(pair, pr, corrupt=True), varied, width=4)
    differ = [len(pr) for pr, r in zip(varied, got) if r["tokens"] != reference[tuple(pr)][:NEW]]
    p, d = pair
    assert d.count_in_log("kvt-test-hook: zeroed the KV pages") >= len(varied), d.tail()
    # The shortest prompts hold little KV; the rest must show it.
    assert len(differ) >= len(varied) - 2, f"only prompts of lengths {differ} differ: the comparison is blind"
