"""kv_transfer.vllm in two offline ``vllm.LLM`` processes (prefill, decode)
against a third one alone, greedy, token for token, on every backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any, Dict

import harness as h

BACKENDS = ["tcp-sim", "mooncake", "nixl"]
LENGTHS = [1, 2, 7, 31, 32, 33, 64, 97, 150, 200]


class Worker:
    def __init__(self, name: str, model: str, role: str, side_port: int, core: int, prefills: str = ""):
        os.makedirs(h.LOG_DIR, exist_ok=True)
        self.err = open(os.path.join(h.LOG_DIR, f"offline-{name}.log"), "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
        self.p = subprocess.Popen([sys.executable, os.path.join(h.HERE, "offline_worker.py"), model, role,
                                   str(side_port), ",".join(BACKENDS), str(core), prefills],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)

    def recv(self, timeout: float = 300.0) -> Dict[str, Any]:
        box: Dict[str, str] = {}
        t = threading.Thread(target=lambda: box.setdefault("line", self.p.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line", "")
        assert line, f"offline worker gave no answer in {timeout:.0f} s (exit {self.p.poll()}); see {self.err.name}"
        return json.loads(line)

    def ask(self, **cmd: Any) -> Dict[str, Any]:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.recv()

    def close(self) -> None:
        try:
            self.p.stdin.write('{"op": "quit"}\n')
            self.p.stdin.flush()
            self.p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
        self.err.close()


def test_offline_llm_pair_greedy_tokens_equal_a_single_engine(model: str, vocab: int):
    prompts = h.prompts(vocab, LENGTHS, seed=7)
    single = Worker("single", model, "single", 0, 0)
    p_side = h.free_port()
    p = Worker("prefill", model, "kv_producer", p_side, 0)
    d = Worker("decode", model, "kv_consumer", h.free_port(), 1, prefills=f"127.0.0.1:{p_side}")
    try:
        for w in (single, p, d):
            assert w.recv().get("ready")
        refs = single.ask(op="generate", prompts=prompts, max_tokens=16, params=[None] * len(prompts))["tokens"]
        single.close()
        for backend in BACKENDS:
            got = p.ask(op="generate", prompts=prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
            offers = got["params"]
            assert all(o and "kvt_offer" in o for o in offers), offers
            for o in offers:
                o["kvt_backends"] = [backend]
            # The prefill's worker learns of its offers in its next engine step.
            p.p.stdin.write(json.dumps({"op": "pump", "seconds": 3.0}) + "\n")
            p.p.stdin.flush()
            dec = d.ask(op="generate", prompts=prompts, max_tokens=16, params=offers)["tokens"]
            assert p.recv()["ok"]
            assert dec == refs, backend
    finally:
        for w in (single, p, d):
            if w.p.poll() is None:
                w.close()
