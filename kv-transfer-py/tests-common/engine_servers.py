"""What the real-engine test suites (``tests-vllm``, ``tests-sglang``)
share: a serving engine's HTTP server as a process tree with its log, waits
that are bounded, plain HTTP calls, and the skip-or-fail rule (a test that
cannot run here is skipped with what it needs; with CI=true it fails). Each
suite's conftest puts this folder on ``sys.path``."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(what: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true and this test needs {what}", pytrace=False)
    pytest.skip(f"needs {what}")


@pytest.fixture
def report(capsys):
    """Prints figures past pytest's capture (the storm's outcomes, the cost table)."""

    def say(*lines: str) -> None:
        with capsys.disabled():
            for line in lines:
                print(line, flush=True)

    return say


def percentile(xs: List[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (0.5: the median's rank,
    0.99 of 40 samples: the largest)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


#: Where the servers' fixed ports are drawn from: below Linux's ephemeral
#: range (32768-60999), which every server's own bind(0) sockets (control
#: planes, Mooncake handshake and RPC ports, ZMQ) draw from while the test's
#: servers start. A port taken from the ephemeral range was free when
#: checked and could be an engine's socket by the time its server bound it
#: (seen: "address already in use" on a decode's HTTP port).
PORT_RANGE = (20000, 32000)
_ports = random.Random(os.getpid() ^ time.time_ns())


def free_port() -> int:
    return free_ports(1)


def free_ports(n: int, tries: int = 200) -> int:
    """A port ``p`` with ``p .. p + n - 1`` all free on loopback (a TP
    engine's workers listen on consecutive side ports), drawn from
    :data:`PORT_RANGE`; bounded tries."""
    for _ in range(tries):
        base = _ports.randrange(PORT_RANGE[0], PORT_RANGE[1] - n)
        held = []
        try:
            for i in range(n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no run of {n} free ports in {tries} tries")


def http_get(port: int, path: str, timeout: float) -> Tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def http_post(port: int, path: str, body: Dict[str, Any], timeout: float) -> Tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def sse_events(resp: http.client.HTTPResponse) -> Iterator[Dict[str, Any]]:
    """The JSON events of a server-sent-events stream, to ``[DONE]`` or the
    end of the stream."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


class EngineServer:
    """One engine server's process tree (its own session, so a stop reaches
    every process it forked), its output in ``log_dir/<name>.log``."""

    def __init__(self, name: str, port: int, cmd: List[str], env: Dict[str, str], log_dir: str):
        self.name = name
        self.port = port
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, timeout: float = 420.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if http_get(self.port, "/health", 2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def count_in_log(self, text: str) -> int:
        return self.log_text().count(text)

    def wait_log(self, text: str, timeout: float = 30.0) -> bool:
        """Waits (bounded) until ``text`` appears in this server's log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log_text():
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self.log.close()


def start_all(servers: List[EngineServer], timeout: float = 480.0) -> None:
    for s in servers:
        s.wait_healthy(timeout)
