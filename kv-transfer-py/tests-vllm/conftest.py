"""Fixtures of the real-vLLM tests: the model, and the servers (started once
per module, stopped at its end). Without vLLM 0.32.0 in this environment the
tests are skipped (with CI=true they fail)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests-common"))

import harness as h  # noqa: E402
from engine_servers import need, report  # noqa: E402,F401  (report: a fixture)


@pytest.fixture(scope="session")
def model() -> str:
    try:
        import vllm
    except ImportError as e:
        need(f"vLLM installed in this environment ({e}); scripts/vllm-tests makes .vllm")
    from kv_transfer.vllm import SUPPORTED_VLLM

    if vllm.__version__ != SUPPORTED_VLLM:
        need(f"vLLM {SUPPORTED_VLLM} (this is {vllm.__version__})")
    path = os.environ.get("KVT_VLLM_MODEL", "")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        need("the tiny model (KVT_VLLM_MODEL; scripts/vllm-tests builds it)")
    if "nixl" in os.environ.get("KVT_VLLM_BACKENDS", "nixl") and not os.environ.get("KVT_ENGINES_VENV"):
        need("KVT_ENGINES_VENV (the engines venv with NIXL) for the nixl backend")
    h.MODEL_NAME[0] = path
    return path


@pytest.fixture(scope="session")
def vocab(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])
