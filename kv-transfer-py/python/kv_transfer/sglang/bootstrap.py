"""The bootstrap server's registry of prefill ranks: ``PUT /route`` (a
prefill rank registers), ``GET /route?rank=N&nonce=HEX`` (a decode looks it
up) and, with a secret, ``GET /challenge`` (a one-time challenge for a PUT).

What it trusts, and what it bounds (DESIGN.md rule 9):

- **First writer wins** without a secret. Within one bootstrap server's
  life (its session: it lives in the prefill's launch), the first valid
  registration of a rank is the rank's; a later, different one is refused
  (409, counted), so no later claimant can make a decode serve it. The same
  registration again (a retry) is answered 200 and changes nothing.
- **An optional shared secret** (``KV_TRANSFER_BOOTSTRAP_SECRET`` in the
  engines' launch environment, the same on prefill and decode). Every MAC
  is hex HMAC-SHA256 under it, over a label that names its use, a one-time
  value and the registration's bytes, so no MAC is good for another use or
  a second time (issue 46, attack 4):

  * a PUT first takes a challenge (``GET /challenge``: 16 random bytes, good
    once and for :attr:`RegistryLimits.challenge_ttl_s`; at most
    :attr:`RegistryLimits.max_challenges` outstanding, the oldest dropped
    for a new one (``challenges_evicted``: many addresses together cannot
    keep the prefill from getting one, issue 46, attack 8), and
    :attr:`RegistryLimits.max_challenges_per_address` per address, 429
    beyond) and carries ``X-KVT-Challenge: hex(challenge)`` and
    ``X-KVT-Auth: hex(HMAC(secret, PUT_LABEL || challenge || body))``;
    without a valid MAC it is refused (403, ``refused_unauthenticated``, or
    ``refused_replayed_mac`` when the MAC is a GET answer's or the v1
    scheme's), and with a challenge unknown, spent or expired (a replayed
    PUT) it is refused (403, ``refused_stale_challenge``);
  * a fresh, authenticated registration replaces the rank's previous one
    (``replaced``): the secret proves it is the launch's own prefill, so a
    restarted prefill registers again;
  * a decode sends a fresh 16-byte nonce with its GET and the server
    answers with ``X-KVT-Auth: hex(HMAC(secret, GET_LABEL || nonce ||
    body))``; the decode checks it, so a fake bootstrap server, and a
    recorded answer replayed to it, are refused.

  Without a secret, whoever reaches the port before the prefill rank can
  take that rank (first writer wins cannot tell who is honest).
- Registrations are capped per source address and in all (refusal 429,
  counted); bodies are checked for size and shape before parsing; the
  port's connections go through :mod:`kv_transfer.ports` (caps per address
  and in all, where at the cap in all the oldest connection that has
  completed no request gives way to a newcomer; idle and whole-request
  deadlines; a bounded worker pool).

Nothing here imports SGLang.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable, Dict, Optional, Tuple

from . import wire
from ..ports import GuardedServerMixin, ServerLimits

logger = logging.getLogger("kv_transfer.sglang")

#: Environment: the secret registrations are authenticated with (optional).
SECRET_ENV = "KV_TRANSFER_BOOTSTRAP_SECRET"
#: The header that carries a registration's MAC (PUT) and a lookup answer's (GET).
AUTH_HEADER = "X-KVT-Auth"
#: The header that carries the one-time challenge a PUT's MAC covers.
CHALLENGE_HEADER = "X-KVT-Challenge"
#: Bytes of a challenge (server's, for a PUT) and of a nonce (decode's, for a GET).
CHALLENGE_BYTES = NONCE_BYTES = 16
#: The MAC labels (domain separation): a PUT's and a GET answer's MACs are
#: never over the same bytes, so neither can stand for the other.
PUT_LABEL = b"kvt-bootstrap-put-v2\0"
GET_LABEL = b"kvt-bootstrap-get-v2\0"


def secret_from_env() -> Optional[bytes]:
    """The launch config's shared secret, if any."""
    s = os.environ.get(SECRET_ENV)
    return s.encode() if s else None


def _hmac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).hexdigest()


def put_mac(secret: bytes, challenge: bytes, body: bytes) -> str:
    """A registration's MAC: HMAC-SHA256(secret, PUT_LABEL || challenge || body), hex."""
    return _hmac(secret, PUT_LABEL, challenge, body)


def answer_mac(secret: bytes, nonce: bytes, body: bytes) -> str:
    """A lookup answer's MAC: HMAC-SHA256(secret, GET_LABEL || nonce || body), hex."""
    return _hmac(secret, GET_LABEL, nonce, body)


def legacy_mac(secret: bytes, body: bytes) -> str:
    """The v1 scheme's MAC, HMAC-SHA256(secret, body): the same for a PUT and
    a GET answer, and forever (issue 46, attack 4). Accepted only by a
    registry with ``fresh_registrations=False`` (the positive control)."""
    return _hmac(secret, body)


def _same(given: Optional[str], want: str) -> bool:
    """Constant-time MAC comparison that takes any header text (non-ASCII
    is a mismatch, not a TypeError)."""
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want.encode())


def _unhex(v: Optional[str], n: int) -> Optional[bytes]:
    """``v`` as exactly ``n`` bytes of hex, or None."""
    if v is None or len(v) != 2 * n:
        return None
    try:
        return bytes.fromhex(v)
    except ValueError:
        return None


def _new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def fetch_registration(url: str, timeout: float, secret: Optional[bytes] = None) -> bytes:
    """A decode's ``GET /route?rank=N``: the registration's bytes, at most
    :data:`wire.MAX_REGISTRATION`. It sends a fresh nonce; with a secret
    (default: the launch config's) it takes the answer only if the server's
    MAC over (that nonce, the bytes) checks, so a server that does not hold
    the secret (a fake bootstrap) and an answer recorded earlier and replayed
    are refused (``b""``: no check). Raises ``OSError`` when unreachable,
    :class:`wire.ProtocolError` when refused."""
    import urllib.request

    if secret is None:
        secret = secret_from_env()
    nonce = _new_nonce()
    with urllib.request.urlopen(f"{url}{'&' if '?' in url else '?'}nonce={nonce.hex()}", timeout=timeout) as r:
        data = r.read(wire.MAX_REGISTRATION + 1)
        auth = r.headers.get(AUTH_HEADER)
    if len(data) > wire.MAX_REGISTRATION:
        raise wire.ProtocolError(f"registration from {url} exceeds {wire.MAX_REGISTRATION} B")
    if secret and not _same(auth, answer_mac(secret, nonce, data)):
        raise wire.ProtocolError(
            f"the registration from {url} is not authenticated by the shared secret for this request's nonce "
            "(a server without the secret, or a recorded answer replayed)")
    return data


def put_registration(base_url: str, body: bytes, timeout: float, secret: Optional[bytes] = None) -> None:
    """A prefill's registration at the bootstrap server ``base_url``
    (``http://host:port``): with a secret (default: the launch config's),
    ``GET /challenge`` then ``PUT /route`` with the MAC over (challenge,
    body); without, the plain PUT. Raises ``urllib.error.HTTPError`` when
    refused, ``OSError`` when unreachable, :class:`wire.ProtocolError` when
    the challenge answer is malformed."""
    import urllib.request

    if secret is None:
        secret = secret_from_env()
    headers = {}
    if secret:
        with urllib.request.urlopen(f"{base_url}/challenge", timeout=timeout) as r:
            raw = r.read(256)
        try:
            challenge = _unhex(json.loads(raw).get("challenge"), CHALLENGE_BYTES)
        except (ValueError, AttributeError):
            challenge = None
        if challenge is None:
            raise wire.ProtocolError(f"malformed challenge from {base_url}: {raw[:80]!r}")
        headers = {CHALLENGE_HEADER: challenge.hex(), AUTH_HEADER: put_mac(secret, challenge, body)}
    req = urllib.request.Request(f"{base_url}/route", data=body, method="PUT", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read(256)


@dataclass(frozen=True)
class RegistryLimits:
    """What the registry keeps. ``first_writer_wins=False`` and
    ``fresh_registrations=False`` are explicit opt-outs (positive controls
    only): a later PUT replaces a rank, as before; MACs are the v1 scheme's."""

    #: Ranks registered from one source address.
    max_ranks_per_address: int = 256
    #: Ranks registered in all.
    max_ranks: int = 4096
    #: False: a later registration replaces the first (the old behaviour).
    first_writer_wins: bool = True
    #: Challenges outstanding in all (with a secret). At the cap the oldest
    #: gives way to a new one (see ``evict_oldest_challenge``).
    max_challenges: int = 1024
    #: Challenges outstanding for one source address.
    max_challenges_per_address: int = 32
    #: Seconds a challenge stays good (then it is dropped, unused).
    challenge_ttl_s: float = 30.0
    #: False: the v1 scheme, HMAC(secret, body) on PUT and GET alike, no
    #: challenge, no nonce, first writer wins (issue 46, attack 4: replayable).
    fresh_registrations: bool = True
    #: At ``max_challenges``, the oldest outstanding challenge is dropped
    #: (``challenges_evicted``; a PUT that then carries it is refused as
    #: stale, 403) and the new one issued. False: the request
    #: is refused (429, ``challenges_refused``), the old behaviour, for
    #: positive controls only.
    evict_oldest_challenge: bool = True


class BootstrapRegistry:
    """rank -> (registration, the address that registered it); with a
    secret, the challenges outstanding."""

    def __init__(self, limits: RegistryLimits = RegistryLimits(), secret: Optional[bytes] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self.secret = secret or None  # an empty secret is none
        self._lock = threading.Lock()
        self._ranks: Dict[int, Tuple[bytes, str]] = {}
        self._per_addr: Dict[str, int] = {}
        #: challenge -> (deadline on the monotonic clock, the address it was issued to); oldest first.
        self._challenges: "OrderedDict[bytes, Tuple[float, str]]" = OrderedDict()
        self._challenges_per_addr: Dict[str, int] = {}
        self.counters: Dict[str, int] = {
            "registered": 0,
            "reregistered_same": 0,
            "refused_malformed": 0,
            "refused_unauthenticated": 0,
            "refused_replayed_mac": 0,
            "refused_stale_challenge": 0,
            "refused_taken": 0,
            "refused_address_cap": 0,
            "refused_full": 0,
            "replaced": 0,
            "challenges_issued": 0,
            "challenges_expired": 0,
            "challenges_refused": 0,
            "challenges_evicted": 0,
            "lookups_refused": 0,
        }

    def _refuse(self, counter: str, code: int, why: str, addr: str) -> Tuple[int, bytes]:
        self.counters[counter] += 1
        logger.warning("kvtransfer bootstrap: refused a registration from %s: %s", addr, why)
        return code, json.dumps({"error": why}).encode()

    # --- challenges (with a secret) --------------------------------------
    def _drop_challenge(self, c: bytes) -> Optional[Tuple[float, str]]:
        v = self._challenges.pop(c, None)
        if v is not None:
            left = self._challenges_per_addr.get(v[1], 0) - 1
            if left > 0:
                self._challenges_per_addr[v[1]] = left
            else:
                self._challenges_per_addr.pop(v[1], None)
        return v

    def _expire(self, now: float) -> None:
        # Deadlines grow with issue order (one TTL), so the expired ones are at the front.
        while self._challenges:
            c, (deadline, _) = next(iter(self._challenges.items()))
            if deadline > now:
                break
            self._drop_challenge(c)
            self.counters["challenges_expired"] += 1

    def challenge(self, addr: str) -> Tuple[int, bytes]:
        """A GET /challenge; returns (HTTP status, reply body): a one-time
        challenge for the next PUT, bounded per address (429 beyond) and in
        all (the oldest outstanding one dropped for it, or, with
        ``evict_oldest_challenge=False``, 429)."""
        with self._lock:
            if self.secret is None:
                return 404, (b'{"error": "this bootstrap server holds no shared secret: '
                             b'registrations are not challenged"}')
            now = self._clock()
            self._expire(now)
            full = len(self._challenges) >= self.limits.max_challenges
            if (self._challenges_per_addr.get(addr, 0) >= self.limits.max_challenges_per_address
                    or (full and not (self.limits.evict_oldest_challenge and self._challenges))):
                self.counters["challenges_refused"] += 1
                logger.warning("kvtransfer bootstrap: refused a challenge to %s: too many outstanding", addr)
                return 429, b'{"error": "too many challenges outstanding"}'
            if full:
                # The oldest has had longest to be used and was not: it gives
                # way, so challenges asked from many addresses, each under its
                # cap, cannot keep the prefill from getting one. Its PUT, if
                # it comes, is refused as stale (403).
                oldest = next(iter(self._challenges))
                logger.debug("kvtransfer bootstrap: challenge cap reached: the oldest (to %s) gives way to one for %s",
                             self._challenges[oldest][1], addr)
                self._drop_challenge(oldest)
                self.counters["challenges_evicted"] += 1
            c = secrets.token_bytes(CHALLENGE_BYTES)
            self._challenges[c] = (now + self.limits.challenge_ttl_s, addr)
            self._challenges_per_addr[addr] = self._challenges_per_addr.get(addr, 0) + 1
            self.counters["challenges_issued"] += 1
            return 200, json.dumps({"challenge": c.hex(), "ttl_s": self.limits.challenge_ttl_s}).encode()

    def _check_auth(self, body: bytes, auth: Optional[str], challenge: Optional[str], addr: str
                    ) -> Optional[Tuple[int, bytes]]:
        """None when the PUT is authenticated and fresh (its challenge is
        spent now), else the refusal."""
        assert self.secret is not None
        if not self.limits.fresh_registrations:  # the v1 scheme (positive control)
            if _same(auth, legacy_mac(self.secret, body)):
                return None
            return self._refuse("refused_unauthenticated", 403, "registration without a valid " + AUTH_HEADER, addr)
        c = _unhex(challenge, CHALLENGE_BYTES)
        if c is None or not _same(auth, put_mac(self.secret, c, body)):
            replayed = _same(auth, legacy_mac(self.secret, body)) or (
                c is not None and _same(auth, answer_mac(self.secret, c, body)))
            if replayed:
                return self._refuse("refused_replayed_mac", 403, "registration whose " + AUTH_HEADER
                                    + " is a lookup answer's or the v1 scheme's, not a fresh registration's", addr)
            return self._refuse("refused_unauthenticated", 403, "registration without a valid " + AUTH_HEADER
                                + " over a challenge (" + CHALLENGE_HEADER + ") from GET /challenge", addr)
        self._expire(self._clock())
        if self._drop_challenge(c) is None:
            return self._refuse("refused_stale_challenge", 403,
                                "registration with a challenge that is unknown, spent or expired (a replay?)", addr)
        return None

    def put(self, body: bytes, auth: Optional[str], addr: str, challenge: Optional[str] = None) -> Tuple[int, bytes]:
        """A PUT /route; returns (HTTP status, reply body)."""
        with self._lock:
            if self.secret is not None:
                refused = self._check_auth(body, auth, challenge, addr)
                if refused is not None:
                    return refused
            try:
                reg = wire.parse_registration(body)
            except wire.ProtocolError as e:
                return self._refuse("refused_malformed", 400, str(e), addr)
            stored = reg.to_json()
            old = self._ranks.get(reg.rank)
            if old is not None:
                if old[0] == stored:
                    self.counters["reregistered_same"] += 1
                    return 200, b'{"ok": true}'
                # With a secret and fresh registrations, an authenticated PUT is the launch's own
                # prefill (restarted): it replaces. Otherwise first writer wins, unless opted out.
                fresh_auth = self.secret is not None and self.limits.fresh_registrations
                if self.limits.first_writer_wins and not fresh_auth:
                    return self._refuse("refused_taken", 409, f"rank {reg.rank} is registered already", addr)
                if old[1] != addr:
                    if self._per_addr.get(addr, 0) >= self.limits.max_ranks_per_address:
                        return self._refuse("refused_address_cap", 429, f"{addr} registered its cap of ranks", addr)
                    self._per_addr[old[1]] -= 1
                    if not self._per_addr[old[1]]:
                        del self._per_addr[old[1]]
                    self._per_addr[addr] = self._per_addr.get(addr, 0) + 1
                self.counters["replaced"] += 1
                if fresh_auth:
                    logger.warning("kvtransfer bootstrap: rank %d re-registered (authenticated) from %s: "
                                   "the new registration replaces the old", reg.rank, addr)
                self._ranks[reg.rank] = (stored, addr)
                return 200, b'{"ok": true}'
            if self._per_addr.get(addr, 0) >= self.limits.max_ranks_per_address:
                return self._refuse("refused_address_cap", 429, f"{addr} registered its cap of ranks", addr)
            if len(self._ranks) >= self.limits.max_ranks:
                return self._refuse("refused_full", 429, "the registry is full", addr)
            self._ranks[reg.rank] = (stored, addr)
            self._per_addr[addr] = self._per_addr.get(addr, 0) + 1
            self.counters["registered"] += 1
            return 200, b'{"ok": true}'

    def get(self, rank: int, nonce: Optional[bytes] = None) -> Optional[Tuple[bytes, str]]:
        """The rank's registration and its answer MAC for ``nonce`` ("" without
        a secret or a nonce), or None."""
        with self._lock:
            v = self._ranks.get(rank)
        if v is None:
            return None
        if self.secret is None:
            return v[0], ""
        if not self.limits.fresh_registrations:
            return v[0], legacy_mac(self.secret, v[0])
        return v[0], "" if nonce is None else answer_mac(self.secret, nonce, v[0])

    def stats(self) -> Dict[str, int]:
        """Counters, the ranks held and the challenges outstanding."""
        with self._lock:
            out = dict(self.counters)
            out["ranks"] = len(self._ranks)
            out["challenges_outstanding"] = len(self._challenges)
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
                # The request was read whole: this connection no longer gives
                # way to a newcomer at the port's connection cap.
                guard.mark_served()
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
                code, body = registry.put(data, self.headers.get(AUTH_HEADER), str(self.client_address[0]),
                                          self.headers.get(CHALLENGE_HEADER))
                self._reply(code, body)

            def do_GET(self) -> None:  # noqa: N802
                path, _, query = self.path.partition("?")
                if path == "/challenge":
                    return self._reply(*registry.challenge(str(self.client_address[0])))
                q = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
                try:
                    rank = max(0, int(q.get("rank", "0")[:12]))
                except ValueError:
                    with registry._lock:
                        registry.counters["lookups_refused"] += 1
                    return self._reply(400, b'{"error": "rank must be an int"}')
                nonce = _unhex(q.get("nonce"), NONCE_BYTES)
                if "nonce" in q and nonce is None:
                    with registry._lock:
                        registry.counters["lookups_refused"] += 1
                    return self._reply(400, json.dumps(
                        {"error": f"nonce must be {NONCE_BYTES} bytes of hex"}).encode())
                v = registry.get(rank, nonce)
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
