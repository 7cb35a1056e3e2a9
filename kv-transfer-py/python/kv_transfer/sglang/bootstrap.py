"""The bootstrap server's registry of prefill ranks: ``PUT /route`` (a
prefill rank registers) and ``GET /route?rank=N`` (a decode looks it up).

What it trusts, and what it bounds (DESIGN.md rule 9):

- **First writer wins.** Within one bootstrap server's life (its session:
  it lives in the prefill's launch), the first valid registration of a rank
  is the rank's; a later, different one is refused (409, counted), so no
  later claimant can make a decode serve it. The same registration again
  (a retry) is answered 200 and changes nothing.
- **An optional shared secret** (``KV_TRANSFER_BOOTSTRAP_SECRET`` in the
  engines' launch environment, the same on prefill and decode): every PUT
  must carry ``X-KVT-Auth: hex(HMAC-SHA256(secret, body))`` or is refused
  (403, counted), so nobody without the secret can even be first; the
  server hands the MAC out with the registration and a decode that holds
  the secret checks it, so a fake bootstrap server is refused as well.
  Without a secret, whoever reaches the port before the prefill rank can
  take that rank (first writer wins cannot tell who is honest).
- Registrations are capped per source address and in all (refusal 429,
  counted); bodies are checked for size and shape before parsing; the
  port's connections go through :mod:`guard` (caps per address and in all,
  idle and whole-request deadlines, a bounded worker pool).

Nothing here imports SGLang.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Dict, Optional, Tuple

from . import wire
from ..ports import GuardedServerMixin, ServerLimits

logger = logging.getLogger("kv_transfer.sglang")

#: Environment: the secret registrations are authenticated with (optional).
SECRET_ENV = "KV_TRANSFER_BOOTSTRAP_SECRET"
#: The header that carries a registration's MAC (PUT) and hands it out (GET).
AUTH_HEADER = "X-KVT-Auth"


def secret_from_env() -> Optional[bytes]:
    """The launch config's shared secret, if any."""
    s = os.environ.get(SECRET_ENV)
    return s.encode() if s else None


def mac(secret: bytes, body: bytes) -> str:
    """A registration's MAC under the shared secret (hex HMAC-SHA256)."""
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def fetch_registration(url: str, timeout: float, secret: Optional[bytes] = None) -> bytes:
    """A decode's ``GET /route?rank=N``: the registration's bytes, at most
    :data:`wire.MAX_REGISTRATION`; with a secret (default: the launch
    config's), only if the server's MAC over them checks, so a server that
    does not hold the secret (a fake bootstrap) is refused (``b""``: no
    check). Raises
    ``OSError`` when unreachable, :class:`wire.ProtocolError` when refused."""
    import urllib.request

    if secret is None:
        secret = secret_from_env()
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data = r.read(wire.MAX_REGISTRATION + 1)
        auth = r.headers.get(AUTH_HEADER)
    if len(data) > wire.MAX_REGISTRATION:
        raise wire.ProtocolError(f"registration from {url} exceeds {wire.MAX_REGISTRATION} B")
    if secret and not (auth and hmac.compare_digest(auth, mac(secret, data))):
        raise wire.ProtocolError(f"the registration from {url} is not authenticated by the shared secret")
    return data


@dataclass(frozen=True)
class RegistryLimits:
    """What the registry keeps. ``first_writer_wins=False`` is the explicit
    opt-out (positive control): a later PUT replaces a rank, as before."""

    #: Ranks registered from one source address.
    max_ranks_per_address: int = 256
    #: Ranks registered in all.
    max_ranks: int = 4096
    #: False: a later registration replaces the first (the old behaviour).
    first_writer_wins: bool = True


class BootstrapRegistry:
    """rank -> (registration, its MAC, the address that registered it)."""

    def __init__(self, limits: RegistryLimits = RegistryLimits(), secret: Optional[bytes] = None):
        self.limits = limits
        self.secret = secret or None  # an empty secret is none
        self._lock = threading.Lock()
        self._ranks: Dict[int, Tuple[bytes, str, str]] = {}
        self._per_addr: Dict[str, int] = {}
        self.counters: Dict[str, int] = {
            "registered": 0,
            "reregistered_same": 0,
            "refused_malformed": 0,
            "refused_unauthenticated": 0,
            "refused_taken": 0,
            "refused_address_cap": 0,
            "refused_full": 0,
            "replaced": 0,
        }

    def _refuse(self, counter: str, code: int, why: str, addr: str) -> Tuple[int, bytes]:
        self.counters[counter] += 1
        logger.warning("kvtransfer bootstrap: refused a registration from %s: %s", addr, why)
        return code, json.dumps({"error": why}).encode()

    def put(self, body: bytes, auth: Optional[str], addr: str) -> Tuple[int, bytes]:
        """A PUT /route; returns (HTTP status, reply body)."""
        with self._lock:
            if self.secret is not None and not (auth and hmac.compare_digest(auth, mac(self.secret, body))):
                return self._refuse("refused_unauthenticated", 403, "registration without a valid " + AUTH_HEADER, addr)
            try:
                reg = wire.parse_registration(body)
            except wire.ProtocolError as e:
                return self._refuse("refused_malformed", 400, str(e), addr)
            stored = reg.to_json()
            tag = mac(self.secret, stored) if self.secret is not None else ""
            old = self._ranks.get(reg.rank)
            if old is not None:
                if old[0] == stored:
                    self.counters["reregistered_same"] += 1
                    return 200, b'{"ok": true}'
                if self.limits.first_writer_wins:
                    return self._refuse("refused_taken", 409, f"rank {reg.rank} is registered already", addr)
                self.counters["replaced"] += 1
                self._ranks[reg.rank] = (stored, tag, old[2])
                return 200, b'{"ok": true}'
            if self._per_addr.get(addr, 0) >= self.limits.max_ranks_per_address:
                return self._refuse("refused_address_cap", 429, f"{addr} registered its cap of ranks", addr)
            if len(self._ranks) >= self.limits.max_ranks:
                return self._refuse("refused_full", 429, "the registry is full", addr)
            self._ranks[reg.rank] = (stored, tag, addr)
            self._per_addr[addr] = self._per_addr.get(addr, 0) + 1
            self.counters["registered"] += 1
            return 200, b'{"ok": true}'

    def get(self, rank: int) -> Optional[Tuple[bytes, str]]:
        """The rank's registration and its MAC ("" without a secret), or None."""
        with self._lock:
            v = self._ranks.get(rank)
        return None if v is None else (v[0], v[1])

    def stats(self) -> Dict[str, int]:
        """Counters and the ranks held."""
        with self._lock:
            out = dict(self.counters)
            out["ranks"] = len(self._ranks)
        return out


class BootstrapServer:
    """The registry behind HTTP, guarded; serves on a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        server_limits: Optional[ServerLimits] = None,
        registry_limits: RegistryLimits = RegistryLimits(),
        secret: Optional[bytes] = None,
    ):
        """Serves on ``host:port`` (0: any free port, then in ``self.port``);
        ``secret`` defaults to the launch config's (``KV_TRANSFER_BOOTSTRAP_SECRET``)."""
        self.host, self.port = host, port
        self.registry = BootstrapRegistry(registry_limits, secret if secret is not None else secret_from_env())
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the logger says what matters
                logger.debug("bootstrap: " + fmt, *args)

            def log_error(self, fmt: str, *args: Any) -> None:
                # http.server catches a read timeout itself and says so here.
                if fmt.startswith("Request timed out"):
                    guard.note_idle_timeout()
                logger.debug("bootstrap: " + fmt, *args)

            def _reply(self, code: int, body: bytes, auth: str = "") -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if auth:
                    self.send_header(AUTH_HEADER, auth)
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    n = -1
                if self.path != "/route" or not 0 < n <= wire.MAX_REGISTRATION:
                    with registry._lock:
                        registry.counters["refused_malformed"] += 1
                    return self._reply(400, json.dumps(
                        {"error": f"PUT /route with a registration body of 1..={wire.MAX_REGISTRATION} B"}).encode())
                data = self.rfile.read(n)
                if len(data) != n:
                    return  # cut short (deadline or peer): nothing stored
                code, body = registry.put(data, self.headers.get(AUTH_HEADER), str(self.client_address[0]))
                self._reply(code, body)

            def do_GET(self) -> None:  # noqa: N802
                rank = 0
                if "?" in self.path:
                    q = dict(p.split("=", 1) for p in self.path.split("?", 1)[1].split("&") if "=" in p)
                    try:
                        rank = max(0, int(q.get("rank", "0")[:12]))
                    except ValueError:
                        return self._reply(400, b'{"error": "rank must be an int"}')
                v = registry.get(rank)
                if v is None:
                    return self._reply(503, b'{"error": "prefill rank not registered yet"}')
                self._reply(200, v[0], v[1])

        class Server(GuardedServerMixin, HTTPServer):
            request_queue_size = 1024  # refusals are ours (counted), not the kernel's backlog

        self._server = Server((host, port), Handler, bind_and_activate=False)
        self._server._init_guard("bootstrap", server_limits or ServerLimits.from_env())
        guard = self._server.guard
        self._server.server_bind()
        self._server.server_activate()
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kvt-bootstrap", daemon=True)
        self._thread.start()

    @property
    def rejected(self) -> int:
        """Registrations refused (every kind)."""
        s = self.registry.stats()
        return sum(v for k, v in s.items() if k.startswith("refused_"))

    def stats(self) -> Dict[str, int]:
        """The registry's and the port's counters."""
        out = {f"bootstrap_{k}": v for k, v in self.registry.stats().items()}
        out.update({f"bootstrap_{k}": v for k, v in self._server.guard.stats().items()})
        return out

    def close(self) -> None:
        """Stops serving."""
        self._server.shutdown()
        self._server.server_close()
        self._server.close_guard()
