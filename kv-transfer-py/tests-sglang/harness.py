"""Real SGLang servers for the end-to-end tests: launch on CPU, wait for
health, generate over HTTP (single server, or a prefill/decode pair driven
with SGLang's bootstrap fields and no router), abort, read SGLang's own
load figures, stop. Every wait is bounded."""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from engine_servers import EngineServer, free_port, http_get, http_post, sse_events, start_all  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
#: The import-only stand-in for SGLang's CPU kernels (see its docstring).
STAND_IN = os.path.join(REPO, "kv-transfer-py", "ci", "sgl-kernel-cpu-stand-in")
#: The tests' SGLang plugin (held sends, corrupted KV, in-tree mooncake on CPU).
HOOKS = os.path.join(HERE, "hooks")
LOG_DIR = os.environ.get("KVT_SGLANG_LOGS", "/tmp/kvt-sglang-logs")

sys.path.insert(0, HOOKS)
# The rooms' marks, encoded where the servers decode them (imports no SGLang).
from kvt_sglang_test_hooks import marked_room  # noqa: E402

#: Engine flags every server shares (SGLang 0.5.23's CPU engine: torch_native
#: attention turns CUDA graphs off; fp32 keeps greedy decoding exact).
COMMON = ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32", "--host", "127.0.0.1",
          "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
          "--mem-fraction-static", "0.5", "--log-level", "info",
          # An idle scheduler otherwise spins a core; the tests run up to six
          # servers on two cores.
          "--sleep-on-idle"]


#: Prefill (and single-server) flags: chunked prefill at 32 tokens, so the
#: longer prompts' KV leaves in several sends.
PREFILL_FLAGS = ["--chunked-prefill-size", "32"]
#: Every test server imports only SGLang's Llama (kvt_sglang_models).
BASE_ENV = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "kvt_sglang_models"}


def room(hold_s: float = 0.0, corrupt: bool = False) -> int:
    """A random bootstrap room; ``hold_s`` > 0 marks it for a delayed
    prefill send of that long at most, ``corrupt`` for zeroed KV on the
    decode."""
    return marked_room(random.randrange(1, 1 << 40), hold_s, corrupt)


class Server(EngineServer):
    """One ``sglang.launch_server`` process tree (tokenizer manager,
    scheduler, detokenizer)."""

    def __init__(self, name: str, model: str, *, mode: str = "single", backend: Optional[str] = None,
                 page_size: int = 1, max_total_tokens: int = 4096, env: Optional[Dict[str, str]] = None,
                 extra: Optional[List[str]] = None):
        self.mode = mode
        self.backend = backend
        port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        e = dict(os.environ)
        e.update(BASE_ENV)
        e.update({
            "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            # prefill.py's early send of a cached prefix records a torch.cuda.Event.
            "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
            "PYTHONPATH": os.pathsep.join(p for p in (STAND_IN, HOOKS, e.get("PYTHONPATH")) if p),
        })
        e.update(env or {})
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
               "--page-size", str(page_size), "--max-total-tokens", str(max_total_tokens),
               "--max-running-requests", "8", *COMMON]
        if mode == "prefill":
            cmd += PREFILL_FLAGS
            cmd += ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
                    "--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        elif mode == "decode":
            # The default retraction backup (host_pool) pins memory with CUDA.
            cmd += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend,
                    "--disaggregation-decode-retraction-backup", "cpu_tensor"]
        cmd += extra or []
        super().__init__(name, port, cmd, e, LOG_DIR)

    def load(self) -> Dict[str, Any]:
        """SGLang's own load snapshot (``/v1/loads``): ``num_used_tokens``,
        ``token_usage``, the disaggregation queues."""
        status, data = http_get(self.port, "/v1/loads?include=all", 10.0)
        if status != 200:
            raise RuntimeError(f"{self.name}: /v1/loads answered HTTP {status}")
        return json.loads(data)["loads"][0]

    def abort(self, rid: str) -> None:
        http_post(self.port, "/abort_request", {"rid": rid}, 10.0)

    def wait_idle(self, timeout: float = 60.0) -> Dict[str, Any]:
        """Waits (bounded) until SGLang reports no used token, no request
        running or queued; returns the last load snapshot."""
        deadline = time.monotonic() + timeout
        while True:
            ld = self.load()
            dq = ld.get("disaggregation") or {}
            busy = (ld["num_used_tokens"] or ld["num_running_reqs"] or ld["num_waiting_reqs"]
                    or any(v for k, v in dq.items() if k.endswith("_reqs")))
            if not busy or time.monotonic() >= deadline:
                return ld
            time.sleep(0.2)

def body(prompt: List[int], max_new: int, **extra: Any) -> Dict[str, Any]:
    b: Dict[str, Any] = {"input_ids": prompt,
                         "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    b.update(extra)
    return b


def generate(port: int, prompt: List[int], max_new: int, timeout: float = 120.0, **extra: Any) -> Dict[str, Any]:
    status, data = http_post(port, "/generate", body(prompt, max_new, **extra), timeout)
    out = json.loads(data) if data else {}
    if status != 200:
        out.setdefault("error", f"HTTP {status}")
    return out


def bootstrap(prefill: Server, room_id: int) -> Dict[str, Any]:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room_id}


def pd_generate(prefill: Server, decode: Server, prompt: List[int], max_new: int, room_id: Optional[int] = None,
                timeout: float = 60.0, rid: Optional[str] = None, abort_prefill: bool = True) -> Dict[str, Any]:
    """One request through a prefill/decode pair, as SGLang's router sends
    it: the same body, with the bootstrap fields, to both at once; the
    decode's reply holds the tokens. A failed decode also aborts the
    prefill's half (a router's job) unless ``abort_prefill`` is False (then
    the prefill learns of the abort only through the transfer backend)."""
    rid = rid or new_rid()
    extra = dict(bootstrap(prefill, room() if room_id is None else room_id), rid=rid)
    res: Dict[str, Dict[str, Any]] = {}

    def go(key: str, port: int) -> None:
        try:
            res[key] = generate(port, prompt, max_new, timeout, **extra)
        except (OSError, ValueError) as e:
            res[key] = {"error": repr(e)}

    tp = threading.Thread(target=go, args=("p", prefill.port))
    tp.start()
    go("d", decode.port)
    d = res["d"]
    if abort_prefill and (d.get("error") or not d.get("output_ids")):
        try:
            prefill.abort(rid)
        except OSError:
            pass
    tp.join(timeout + 5)
    return {"tokens": d.get("output_ids"), "error": d.get("error"), "prefill": res.get("p", {}),
            "meta": d.get("meta_info", {}), "rid": rid}


def new_rid() -> str:
    return f"pd-{random.randrange(1 << 60):x}"


class PdStream:
    """One request through a prefill/decode pair with the decode's reply
    streamed: the test reads tokens as they come, disconnects or aborts at a
    point it chooses, and knows when the first token arrived."""

    def __init__(self, prefill: Server, decode: Server, prompt: List[int], max_new: int, room_id: int,
                 timeout: float = 60.0):
        self.rid = new_rid()
        self.prefill, self.decode = prefill, decode
        b = body(prompt, max_new, rid=self.rid, **bootstrap(prefill, room_id))
        self.prefill_reply: Dict[str, Any] = {}
        self._tp = threading.Thread(target=self._prefill_half, args=(b, timeout), daemon=True)
        self._tp.start()
        self.t0 = time.perf_counter()
        self.conn, self.resp = stream_open(decode.port, b, timeout)
        self._events = sse_events(self.resp)
        self.tokens: List[int] = []
        self.first_token_s: Optional[float] = None
        self.finished = False

    def _prefill_half(self, b: Dict[str, Any], timeout: float) -> None:
        try:
            status, data = http_post(self.prefill.port, "/generate", b, timeout)
            self.prefill_reply = json.loads(data) if data else {"error": f"HTTP {status}"}
        except (OSError, ValueError) as e:
            self.prefill_reply = {"error": repr(e)}

    def read(self, chunks: Optional[int] = None) -> List[int]:
        """Reads ``chunks`` more stream events (all, if None); the tokens so far."""
        n = 0
        while not self.finished and (chunks is None or n < chunks):
            ev = next(self._events, None)
            if ev is None:
                self.finished = True
                break
            ids = ev.get("output_ids") or []
            if ids and self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.t0
            # SGLang streams the tokens so far (incremental output is off).
            if len(ids) >= len(self.tokens):
                self.tokens = list(ids)
            n += 1
        return self.tokens

    def disconnect(self) -> None:
        self.conn.close()
        self.finished = True

    def join(self, timeout: float = 65.0) -> None:
        self._tp.join(timeout)
        self.conn.close()


def stream_open(port: int, b: Dict[str, Any], timeout: float = 120.0
                ) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streaming /generate (to read the first token's time, or to
    disconnect from at a chosen point)."""
    b = dict(b, stream=True)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/generate", json.dumps(b), {"Content-Type": "application/json"})
    return c, c.getresponse()


#: Where the prefills' held sends look for their release files.
HOLD_DIR = os.path.join(LOG_DIR, "hold")


def release_hold(room_id: int) -> None:
    """Lets a held room's send go on (kvt_sglang_test_hooks)."""
    os.makedirs(HOLD_DIR, exist_ok=True)
    open(os.path.join(HOLD_DIR, f"release-{room_id}"), "w").close()


def disaggregated(tag: str, model: str, transfer: str, *, page_size: int = 1, prefills: int = 1,
                  decode_tokens: int = 4096, decode_env: Optional[Dict[str, str]] = None,
                  decode_extra: Optional[List[str]] = None) -> Tuple[List[Server], Server]:
    """Prefill servers and one decode, started together (not yet healthy).
    ``transfer`` is ``stock-mooncake`` (SGLang's in-tree backend over
    Mooncake TCP) or ``kvtransfer:<backend>`` (this package over tcp-sim,
    mooncake or nixl). Every prefill has the held-send hook armed, every
    kvtransfer decode the corrupt-KV hook; both act only on rooms a test
    marks."""
    if transfer == "stock-mooncake":
        backend, env = "mooncake", {"KVT_TEST_MOONCAKE_CPU": "1"}
    else:
        kind, _, inner = transfer.partition(":")
        assert kind == "kvtransfer" and inner, transfer
        backend, env = "kvtransfer", {"KV_TRANSFER_BACKEND": inner, "KVT_TEST_CORRUPT": "1"}
    pre_env = dict(env, KVT_TEST_HOLD="1", KVT_TEST_HOLD_DIR=HOLD_DIR)
    ps = [Server(f"{tag}-prefill{i}", model, mode="prefill", backend=backend, page_size=page_size, env=pre_env)
          for i in range(prefills)]
    d = Server(f"{tag}-decode", model, mode="decode", backend=backend, page_size=page_size,
               max_total_tokens=decode_tokens, env=dict(env, **(decode_env or {})), extra=decode_extra)
    return ps, d


def stop_all(servers: List[Server]) -> None:
    for s in servers:
        s.stop()


def run_parallel(fn, items: List[Any], width: int = 4, timeout: float = 300.0) -> List[Any]:
    """``fn`` over ``items``, ``width`` at a time (several requests in
    flight), results in order."""
    out: List[Any] = [None] * len(items)
    lock = threading.Lock()
    nxt = [0]

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(items):
                return
            try:
                out[i] = fn(items[i])
            except Exception as e:  # noqa: BLE001  (reported as the item's result)
                out[i] = e

    th = [threading.Thread(target=worker, daemon=True) for _ in range(width)]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout)
    return out
