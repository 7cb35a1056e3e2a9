"""Real vLLM API servers for the tests: launch, wait for health, ask over
HTTP, read vLLM's own metrics, stop. Every wait is bounded."""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from engine_servers import EngineServer, free_port, http_get, http_post, sse_events, start_all  # noqa: F401  (start_all: the tests')

HERE = os.path.dirname(os.path.abspath(__file__))
#: Where the servers' logs go (kept after the run for a failure's post-mortem).
LOG_DIR = os.environ.get("KVT_VLLM_LOGS", "/tmp/kvt-vllm-logs")
BLOCK = 32
#: Engine flags every server of the tests shares (see VLLM facts: the CPU
#: attention wants blocks of 32; fp32 and eager keep greedy decoding exact).
COMMON = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
          "--max-model-len", "512", "--max-num-seqs", "16"]


def ours(role: str, side_port: int, backends: str, connector: str = "KvTransferConnector",
         module: str = "kv_transfer.vllm", **extra: Any) -> Dict[str, Any]:
    cfg = {"backends": backends, "side_port": side_port}
    cfg.update(extra)
    return {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": role,
            "kv_connector_extra_config": cfg}


def nixl(role: str, lease_s: int) -> Dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": lease_s}}


class Server(EngineServer):
    """One ``vllm.entrypoints.openai.api_server`` process tree."""

    def __init__(self, name: str, model: str, kv: Optional[Dict[str, Any]], core: int, blocks: int,
                 env: Optional[Dict[str, str]] = None, tp: int = 1, prefix_caching: bool = False):
        port = free_port()
        e = dict(os.environ)
        # TP > 1: one worker per core (gloo, MultiprocExecutor; SERVING-SHAPES.md).
        bind = "|".join(str(c % 2) for c in range(tp)) if tp > 1 else str(core)
        e.update({
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind, "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": HERE + os.pathsep + e.get("PYTHONPATH", ""), "VLLM_LOGGING_LEVEL": "INFO",
        })
        e.update(env or {})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1", "--num-gpu-blocks-override", str(blocks), *COMMON,
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if tp > 1:
            cmd += ["--tensor-parallel-size", str(tp)]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        super().__init__(name, port, cmd, e, LOG_DIR)

    def metric(self, name: str) -> float:
        """One gauge of vLLM's /metrics (summed over its label sets)."""
        status, body = http_get(self.port, "/metrics", 10.0)
        assert status == 200, status
        total, seen = 0.0, False
        for line in body.decode().splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        if not seen:
            raise KeyError(name)
        return total


def complete(port: int, prompt: List[int], max_tokens: int, params: Optional[Dict[str, Any]] = None,
             timeout: float = 120.0) -> Dict[str, Any]:
    """A greedy /v1/completions call with token ids in and out: the choice's
    ``token_ids`` and the response's ``kv_transfer_params``."""
    body: Dict[str, Any] = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "return_token_ids": True, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    status, data = http_post(port, "/v1/completions", body, timeout)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {data[:500]!r}")
    out = json.loads(data)
    ch = out["choices"][0]
    return {"tokens": list(ch.get("token_ids") or []), "kv_transfer_params": out.get("kv_transfer_params"),
            "finish": ch.get("finish_reason")}


#: The served model name (the model path); set by the fixture.
MODEL_NAME = [""]


def stream_open(port: int, prompt: List[int], max_tokens: int, params: Optional[Dict[str, Any]],
                timeout: float = 120.0) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streaming /v1/completions call (to disconnect from at a chosen point)."""
    body: Dict[str, Any] = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "return_token_ids": True, "ignore_eos": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return c, c.getresponse()


def stream_tokens(resp: http.client.HTTPResponse, stop_after: Optional[int] = None) -> Tuple[List[int], float]:
    """Reads a stream's tokens (all, or ``stop_after`` chunks); and when the first arrived."""
    toks: List[int] = []
    first = 0.0
    chunks = 0
    t0 = time.perf_counter()
    for ev in sse_events(resp):
        for ch in ev.get("choices", []):
            ids = ch.get("token_ids") or []
            if ids and not toks:
                first = time.perf_counter() - t0
            toks.extend(ids)
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
    return toks, first


def count_in_log(server: Server, pattern: str) -> int:
    return len(re.findall(pattern, server.log_text()))


def side_stats(port: int) -> Dict[str, Any]:
    """kv_transfer.vllm's worker counters and pool gauges, from its side port
    (over the control plane, under the deployment's cluster key)."""
    from kv_transfer.peers import ControlPlane
    from kv_transfer.vllm import wire

    plane = ControlPlane("kvt-test-stats")
    try:
        return wire.parse_ok(plane.call("127.0.0.1", port, b'{"op": "stats"}', timeout=10), max_lists=64)["stats"]
    finally:
        plane.close()


def wait_until(what: str, pred, timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last is True:
            return
        time.sleep(every)
    raise AssertionError(f"{what}: not so after {timeout:.0f} s (last: {last!r})")


def prompts(vocab: int, lengths: List[int], seed: int) -> List[List[int]]:
    """Token-id prompts of the given lengths (ids 3.. skip the special tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
