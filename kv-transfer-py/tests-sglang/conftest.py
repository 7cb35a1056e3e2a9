"""Fixtures of the end-to-end tests with real SGLang servers: the tiny
model, its greedy reference from a single server, and the prompts. Servers
are started per module and stopped at its end. Without SGLang 0.5.23 (and
kv_transfer) in this environment, or without the model, the tests are
skipped; with CI=true they fail."""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Dict, List, Tuple

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests-common"))

import harness as h  # noqa: E402
from engine_servers import need, report  # noqa: E402,F401  (report: a fixture)

#: Greedy tokens per reference run; shorter requests compare with a prefix.
REF_NEW = 200


@pytest.fixture(scope="session")
def model() -> str:
    try:
        import sglang

        import kv_transfer.sglang  # noqa: F401
    except ImportError as e:
        need(f"SGLang and kv_transfer in this environment ({e}); scripts/sglang-tests makes .sglang")
    from kv_transfer.sglang import SUPPORTED_SGLANG

    if sglang.__version__ not in SUPPORTED_SGLANG:
        need(f"SGLang {', '.join(SUPPORTED_SGLANG)} (this is {sglang.__version__})")
    path = os.environ.get("KVT_SGLANG_MODEL", "")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        need("the tiny model (KVT_SGLANG_MODEL; scripts/sglang-tests builds it)")
    return path


@pytest.fixture(scope="session")
def prompts(model: str) -> Dict[str, List[List[int]]]:
    """Token-id prompts, drawn once from a fixed seed over the model's
    vocabulary (ids 0-2 are its special tokens): eight of varied length
    (chunked sends from 33 tokens on), and the hazard's: A of 200, B1 and B2
    of 96."""
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    rnd = random.Random(20261204)
    draw = lambda n: [rnd.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return {"varied": [draw(n) for n in (3, 6, 11, 17, 26, 40, 65, 100)], "hazard": [draw(200), draw(96), draw(96)]}


@pytest.fixture(scope="session")
def reference(model: str, prompts: Dict[str, List[List[int]]]) -> Dict[Tuple[int, ...], List[int]]:
    """Each prompt's greedy tokens from one single SGLang server (no
    disaggregation), REF_NEW long."""
    s = h.Server("single", model, extra=h.PREFILL_FLAGS)
    try:
        s.wait_healthy()
        refs = {}
        for group in prompts.values():
            for p in group:
                r = h.generate(s.port, p, REF_NEW)
                assert r.get("output_ids") and len(r["output_ids"]) == REF_NEW, r
                refs[tuple(p)] = r["output_ids"]
        return refs
    finally:
        s.stop()
