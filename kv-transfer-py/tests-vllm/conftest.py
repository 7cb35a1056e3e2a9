"""Fixtures of the real-vLLM tests: the model, and the servers (started once
per module, stopped at its end). Without vLLM 0.32.0 in this environment the
tests are skipped (with CI=true they fail)."""

from __future__ import annotations

import json
import os

import pytest

import harness as h

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(what: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true and this test needs {what}", pytrace=False)
    pytest.skip(f"needs {what}")


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


@pytest.fixture
def report(capsys):
    """Prints figures past pytest's capture (the storm's outcomes, the cost table)."""

    def say(*lines: str) -> None:
        with capsys.disabled():
            for line in lines:
                print(line, flush=True)

    return say
