"""A small prefill/decode proxy for the xPyD tests, the way vLLM's examples
do it (no proxy ships in the vLLM wheel): for each ``/v1/completions`` call,
the prefill is asked for one token with ``kv_transfer_params:
{"do_remote_decode": true}``, and the decode gets the client's request with
the parameters the prefill returned; the decode's answer (a stream or not)
goes back to the client as it comes.

Pairs are chosen round robin over every (prefill, decode) pair, so each
decode pulls from each prefill. A test rig, not a product: no retries, no
load balancing, one thread per client connection (bounded by the client).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import product
from typing import Any, List, Tuple

from engine_servers import free_port, http_post

TIMEOUT_S = 300.0


class PdProxy:
    """Serves on ``127.0.0.1:port`` in a daemon thread until :meth:`stop`."""

    def __init__(self, prefills: List[int], decodes: List[int]):
        self.pairs: List[Tuple[int, int]] = list(product(prefills, decodes))
        self.used: Counter = Counter()
        self.failures = 0
        self._next = 0
        self._lock = threading.Lock()
        self.port = free_port()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the answer ends with the connection: a stream needs no framing

            def log_message(self, *_: Any) -> None:
                pass

            def do_GET(self) -> None:  # /v1/models, /health: the first decode answers
                proxy._relay(self, "GET", proxy.pairs[0][1], self.path, None)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                p, d = proxy._pick()
                try:
                    params = proxy._prefill(p, body)
                except Exception as e:  # noqa: BLE001 (the client gets a 502, the test counts it)
                    with proxy._lock:
                        proxy.failures += 1
                    self.send_error(502, f"prefill {p}: {e}")
                    return
                proxy._relay(self, "POST", d, self.path, json.dumps(dict(body, kv_transfer_params=params)).encode())

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-proxy", daemon=True)
        self._thread.start()

    def _pick(self) -> Tuple[int, int]:
        with self._lock:
            pair = self.pairs[self._next % len(self.pairs)]
            self._next += 1
            self.used[pair] += 1
        return pair

    @staticmethod
    def _prefill(port: int, body: dict) -> dict:
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        status, data = http_post(port, "/v1/completions", pre, TIMEOUT_S)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        params = json.loads(data).get("kv_transfer_params")
        if not params:
            raise RuntimeError("no kv_transfer_params in the prefill's answer")
        return params

    @staticmethod
    def _relay(h: BaseHTTPRequestHandler, method: str, port: int, path: str, body: Any) -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        try:
            c.request(method, path, body, {"Content-Type": "application/json"} if body else {})
            r = c.getresponse()
            h.send_response(r.status)
            h.send_header("Content-Type", r.getheader("Content-Type", "application/json"))
            h.end_headers()
            while True:
                chunk = r.read1(1 << 16)
                if not chunk:
                    break
                h.wfile.write(chunk)
                h.wfile.flush()
        finally:
            c.close()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
