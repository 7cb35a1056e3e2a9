"""Rule 9 on the bootstrap server (issue 29, attack 13): a registration
cannot be replaced by a later claimant, registrations and connections are
capped per address, every connection has deadlines.

The first tests need no SGLang (the registry and its server are
:mod:`kv_transfer.sglang.bootstrap`); the last one runs the attack through
SGLang's classes end to end. The attacker dials from 127.0.0.2, the honest
prefill and decode from 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest

from conftest import fill, free_port, kv_args, page_bytes, poll_until, server_args
from test_hostile_control import HONEST_BOUND_MS, run_child

ATTACKER, HONEST = "127.0.0.2", "127.0.0.1"


def _reg(rank: int, ctrl_port: int, descriptor: bytes = b"real"):
    from kv_transfer.sglang import wire

    return wire.Registration(rank=rank, ctrl_host="127.0.0.1", ctrl_port=ctrl_port, backend="tcp-sim",
                             descriptor=descriptor, page_size=1, kv_item_lens=[64], aux_item_lens=[])


def _http(port: int, method: str, path: str, source: str, body: bytes = None, headers: dict = None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    out = (r.status, r.read(), r.getheader("X-KVT-Auth"))
    c.close()
    return out


def _challenge(port: int, source: str) -> bytes:
    """A one-time challenge from the server (``GET /challenge``)."""
    status, body, _ = _http(port, "GET", "/challenge", source)
    assert status == 200, body
    return bytes.fromhex(json.loads(body)["challenge"])


def _signed_put(port: int, source: str, body: bytes, secret: bytes):
    """A registration as the launch's prefill makes it: a fresh challenge,
    the MAC over it; returns (status, the headers sent: a recording)."""
    from kv_transfer.sglang import bootstrap

    c = _challenge(port, source)
    headers = {bootstrap.CHALLENGE_HEADER: c.hex(), bootstrap.AUTH_HEADER: bootstrap.put_mac(secret, c, body)}
    return _http(port, "PUT", "/route", source, body, headers)[0], headers


@pytest.mark.parametrize("first_writer_wins", [False, True])
def test_hostile_second_registration_for_a_rank_cannot_replace_the_first(first_writer_wins):
    from kv_transfer.sglang.bootstrap import BootstrapServer, RegistryLimits

    server = BootstrapServer("127.0.0.1", 0, registry_limits=RegistryLimits(first_writer_wins=first_writer_wins))
    try:
        real, impostor = _reg(0, 5000, b"real"), _reg(0, 6666, b"impostor")
        assert _http(server.port, "PUT", "/route", HONEST, real.to_json())[0] == 200
        code, _, _ = _http(server.port, "PUT", "/route", ATTACKER, impostor.to_json())
        t0 = time.perf_counter()
        status, body, _ = _http(server.port, "GET", "/route?rank=0", HONEST)
        ms = (time.perf_counter() - t0) * 1000
        assert status == 200 and ms < HONEST_BOUND_MS
        if not first_writer_wins:
            # Positive control (the old registry): the impostor replaced the rank; decodes would serve it.
            assert code == 200 and body == impostor.to_json()
            return
        assert code == 409 and body == real.to_json()
        assert server.registry.stats()["refused_taken"] == 1
        # The same registration again (a retry of the real one) is answered, and changes nothing.
        assert _http(server.port, "PUT", "/route", HONEST, real.to_json())[0] == 200
        assert server.registry.stats()["reregistered_same"] == 1
        assert _http(server.port, "GET", "/route?rank=0", HONEST)[1] == real.to_json()
    finally:
        server.close()


def test_hostile_registrations_carry_the_launch_secret_and_a_fake_bootstrap_is_refused():
    from kv_transfer.sglang import bootstrap, wire

    secret = b"shared-through-the-launch-config"
    server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=secret)
    fake = bootstrap.BootstrapServer("127.0.0.1", 0, secret=b"")  # a squatter's own server, no secret
    try:
        impostor, real = _reg(0, 6666, b"impostor"), _reg(0, 5000, b"real")
        # Without the secret a claimant cannot even be first.
        assert _http(server.port, "PUT", "/route", ATTACKER, impostor.to_json())[0] == 403
        c = _challenge(server.port, ATTACKER)
        bad = {bootstrap.AUTH_HEADER: bootstrap.put_mac(b"guess", c, impostor.to_json()),
               bootstrap.CHALLENGE_HEADER: c.hex()}
        assert _http(server.port, "PUT", "/route", ATTACKER, impostor.to_json(), bad)[0] == 403
        assert _signed_put(server.port, HONEST, real.to_json(), secret)[0] == 200
        assert server.registry.stats()["refused_unauthenticated"] == 2
        # The decode checks the server's MAC: the real server passes, the fake one is refused.
        data = bootstrap.fetch_registration(f"http://127.0.0.1:{server.port}/route?rank=0", 5, secret)
        assert data == real.to_json()
        assert fake.registry.put(impostor.to_json(), None, ATTACKER)[0] == 200
        with pytest.raises(wire.ProtocolError, match="not authenticated"):
            bootstrap.fetch_registration(f"http://127.0.0.1:{fake.port}/route?rank=0", 5, secret)
        # Positive control: a decode without the secret takes the fake server's word.
        assert bootstrap.fetch_registration(f"http://127.0.0.1:{fake.port}/route?rank=0", 5, b"") == impostor.to_json()
    finally:
        server.close()
        fake.close()


SECRET = b"shared-through-the-launch-config"


def test_hostile_a_lookup_answers_mac_is_not_a_registration_mac(monkeypatch):
    """Issue 46, attack 4 (domain separation): the MAC an unauthenticated
    ``GET /route`` hands out must not register anything. The attacker asks
    a restarted bootstrap server (one launch, same secret) for a challenge,
    sends those bytes as its nonce to a server that holds the prefill's
    registration, and PUTs the answer with that challenge: refused (403,
    ``refused_replayed_mac``). Positive controls: with the GET label equal
    to the PUT label, and under the v1 scheme (MAC over the body alone), the
    same moves register the rank without the secret and the restarted
    prefill is refused (409)."""
    from kv_transfer.sglang import bootstrap

    real, after_restart = _reg(0, 5000, b"real"), _reg(0, 5001, b"restarted")
    fresh = bootstrap.RegistryLimits()
    v1 = bootstrap.RegistryLimits(fresh_registrations=False)
    servers = {k: bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET, registry_limits=lim)
               for k, lim in [("first", fresh), ("restarted", fresh), ("unlabelled", fresh),
                              ("v1_first", v1), ("v1_restarted", v1)]}
    p = {k: s.port for k, s in servers.items()}

    def answer_put_with(first: str, target: str, with_challenge: bool = True) -> int:
        c = _challenge(p[target], ATTACKER) if with_challenge else bootstrap._new_nonce()
        status, body, auth = _http(p[first], "GET", f"/route?rank=0&nonce={c.hex()}", ATTACKER)
        assert status == 200 and body == real.to_json() and auth
        headers = {bootstrap.AUTH_HEADER: auth, bootstrap.CHALLENGE_HEADER: c.hex()} if with_challenge \
            else {bootstrap.AUTH_HEADER: auth}
        return _http(p[target], "PUT", "/route", ATTACKER, body, headers)[0]

    try:
        assert _signed_put(p["first"], HONEST, real.to_json(), SECRET)[0] == 200
        assert answer_put_with("first", "restarted") == 403
        assert answer_put_with("first", "restarted", with_challenge=False) == 403
        st = servers["restarted"].registry.stats()
        assert st["refused_replayed_mac"] == 1 and st["refused_unauthenticated"] == 1 and st["ranks"] == 0
        assert servers["restarted"].stats()["bootstrap_refused_replayed_mac"] == 1  # in get_metrics()' family
        assert servers["restarted"].rejected == 2
        # The restarted prefill registers, unhindered.
        assert _signed_put(p["restarted"], HONEST, after_restart.to_json(), SECRET)[0] == 200

        # Positive control 1: no domain separation (one label for both). The lookup answer is a PUT MAC.
        monkeypatch.setattr(bootstrap, "GET_LABEL", bootstrap.PUT_LABEL)
        assert _signed_put(p["first"], HONEST, real.to_json(), SECRET)[0] == 200  # reregistered_same
        assert answer_put_with("first", "unlabelled") == 200
        assert servers["unlabelled"].registry.get(0)[0] == real.to_json()  # taken without the secret
        monkeypatch.undo()

        # Positive control 2: the v1 scheme. The GET answer's MAC is exactly a PUT's, with no challenge.
        v1_real = {bootstrap.AUTH_HEADER: bootstrap.legacy_mac(SECRET, real.to_json())}
        assert _http(p["v1_first"], "PUT", "/route", HONEST, real.to_json(), v1_real)[0] == 200
        assert answer_put_with("v1_first", "v1_restarted", with_challenge=False) == 200
        v1_after = {bootstrap.AUTH_HEADER: bootstrap.legacy_mac(SECRET, after_restart.to_json())}
        assert _http(p["v1_restarted"], "PUT", "/route", HONEST, after_restart.to_json(), v1_after)[0] == 409
        assert servers["v1_restarted"].registry.get(0)[0] == real.to_json()  # the decode takes the stale one
    finally:
        for s in servers.values():
            s.close()


def test_hostile_a_replayed_registration_is_refused_and_a_restarted_prefill_registers():
    """Issue 46, attack 4 (freshness): a recorded, valid PUT replayed (its
    challenge spent, or unknown to a restarted server) is refused (403,
    ``refused_stale_challenge``); the restarted prefill, holding the secret,
    registers with a fresh challenge (200) and replaces its old registration,
    and decodes get the new one. Positive control (the v1 scheme): the
    replay is accepted (200), the restarted prefill refused (409), and the
    decode-facing GET keeps returning the stale registration."""
    from kv_transfer.sglang import bootstrap

    old, new = _reg(0, 5000, b"before-restart"), _reg(0, 5001, b"after-restart")
    server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET)
    restarted = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET)
    v1 = bootstrap.RegistryLimits(fresh_registrations=False)
    v1_server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET, registry_limits=v1)
    v1_restarted = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET, registry_limits=v1)
    try:
        code, recorded = _signed_put(server.port, HONEST, old.to_json(), SECRET)
        assert code == 200
        # The recorded PUT, replayed: to the same server (challenge spent) and to a restarted one (unknown).
        assert _http(server.port, "PUT", "/route", ATTACKER, old.to_json(), recorded)[0] == 403
        assert _http(restarted.port, "PUT", "/route", ATTACKER, old.to_json(), recorded)[0] == 403
        for s in (server, restarted):
            assert s.registry.stats()["refused_stale_challenge"] == 1
            assert s.stats()["bootstrap_refused_stale_challenge"] == 1
        assert restarted.registry.stats()["ranks"] == 0
        # The restarted prefill registers, on both: it replaces its old registration on the first.
        for s in (server, restarted):
            t0 = time.perf_counter()
            bootstrap.put_registration(f"http://127.0.0.1:{s.port}", new.to_json(), 5, SECRET)
            got = bootstrap.fetch_registration(f"http://127.0.0.1:{s.port}/route?rank=0", 5, SECRET)
            assert got == new.to_json() and (time.perf_counter() - t0) * 1000 < HONEST_BOUND_MS
        assert server.registry.stats()["replaced"] == 1 and restarted.registry.stats()["registered"] == 1
        # Still refused afterwards; a challenge past its deadline is as stale as a spent one.
        assert _http(server.port, "PUT", "/route", ATTACKER, old.to_json(), recorded)[0] == 403
        assert _http(server.port, "GET", "/route?rank=0", HONEST)[1] == new.to_json()
        reg = bootstrap.BootstrapRegistry(bootstrap.RegistryLimits(challenge_ttl_s=0.05), SECRET)
        c = bytes.fromhex(json.loads(reg.challenge(HONEST)[1])["challenge"])
        time.sleep(0.1)
        assert reg.put(new.to_json(), bootstrap.put_mac(SECRET, c, new.to_json()), HONEST, c.hex())[0] == 403
        assert reg.stats()["refused_stale_challenge"] == 1 and reg.stats()["challenges_expired"] == 1

        # Positive control: the v1 scheme (nothing makes a registration fresh).
        v1_old = {bootstrap.AUTH_HEADER: bootstrap.legacy_mac(SECRET, old.to_json())}
        v1_new = {bootstrap.AUTH_HEADER: bootstrap.legacy_mac(SECRET, new.to_json())}
        assert _http(v1_server.port, "PUT", "/route", HONEST, old.to_json(), v1_old)[0] == 200
        assert _http(v1_restarted.port, "PUT", "/route", ATTACKER, old.to_json(), v1_old)[0] == 200  # the replay
        assert _http(v1_restarted.port, "PUT", "/route", HONEST, new.to_json(), v1_new)[0] == 409  # cannot start
        assert _http(v1_restarted.port, "GET", "/route?rank=0", HONEST)[1] == old.to_json()  # the stale one
    finally:
        for s in (server, restarted, v1_server, v1_restarted):
            s.close()


class _Replayer:
    """An attacker's bootstrap (or one on the path) that answers every GET
    with a recorded answer: its bytes and its ``X-KVT-Auth``."""

    def __init__(self, body: bytes, auth: str):
        from http.server import BaseHTTPRequestHandler, HTTPServer

        paths = self.paths = []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):  # noqa: N802
                paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-KVT-Auth", auth)
                self.end_headers()
                self.wfile.write(body)

        self.server = HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/route?rank=0"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_hostile_a_recorded_lookup_answer_replayed_to_a_decode_is_refused(monkeypatch):
    """Issue 46, attack 4 (decode side): an answer recorded before the
    prefill restarted, replayed to a decode (which sends its own fresh
    nonce), is refused; the real server's answer is taken. Positive
    controls: a decode that sent the recorded nonce again takes the stale
    registration, and under the v1 scheme the recorded answer passes the old
    decode check (MAC over the body alone) whatever was asked."""
    import hashlib
    import hmac

    from kv_transfer.sglang import bootstrap, wire

    old, new = _reg(0, 5000, b"before-restart"), _reg(0, 5001, b"after-restart")
    server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET)
    v1_server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET,
                                          registry_limits=bootstrap.RegistryLimits(fresh_registrations=False))
    replayers = []
    try:
        assert _signed_put(server.port, HONEST, old.to_json(), SECRET)[0] == 200
        n1 = bootstrap._new_nonce()
        status, body, auth = _http(server.port, "GET", f"/route?rank=0&nonce={n1.hex()}", ATTACKER)  # recorded
        assert status == 200 and body == old.to_json() and auth == bootstrap.answer_mac(SECRET, n1, body)
        assert _signed_put(server.port, HONEST, new.to_json(), SECRET)[0] == 200  # the prefill restarted
        replay = _Replayer(body, auth)
        replayers.append(replay)
        with pytest.raises(wire.ProtocolError, match="not authenticated"):
            bootstrap.fetch_registration(replay.url, 5, SECRET)
        assert len(replay.paths) == 1 and f"nonce={n1.hex()}" not in replay.paths[0] and "nonce=" in replay.paths[0]
        assert bootstrap.fetch_registration(f"http://127.0.0.1:{server.port}/route?rank=0", 5, SECRET) == new.to_json()
        # A malformed nonce is refused and counted.
        assert _http(server.port, "GET", "/route?rank=0&nonce=zz", ATTACKER)[0] == 400
        assert server.registry.stats()["lookups_refused"] == 1

        # Positive control 1: the same nonce again (no freshness): the decode takes the stale registration.
        monkeypatch.setattr(bootstrap, "_new_nonce", lambda: n1)
        assert bootstrap.fetch_registration(replay.url, 5, SECRET) == old.to_json()
        monkeypatch.undo()

        # Positive control 2: the v1 scheme. A recorded answer passes the old decode check, whatever the decode asks.
        v1_old = {bootstrap.AUTH_HEADER: bootstrap.legacy_mac(SECRET, old.to_json())}
        assert _http(v1_server.port, "PUT", "/route", HONEST, old.to_json(), v1_old)[0] == 200
        status, v1_body, v1_auth = _http(v1_server.port, "GET", "/route?rank=0", ATTACKER)  # recorded
        assert status == 200 and v1_body == old.to_json()
        old_decode_check = hmac.compare_digest(v1_auth, hmac.new(SECRET, v1_body, hashlib.sha256).hexdigest())
        assert old_decode_check  # the v1 decode would take it, replayed any time later
        v1_replay = _Replayer(v1_body, v1_auth)
        replayers.append(v1_replay)
        with pytest.raises(wire.ProtocolError, match="not authenticated"):  # today's decode refuses it too
            bootstrap.fetch_registration(v1_replay.url, 5, SECRET)
    finally:
        for r in replayers:
            r.close()
        server.close()
        v1_server.close()


def test_hostile_challenges_are_bounded_per_address_in_all_and_in_time():
    """``GET /challenge`` needs no secret, so what it keeps is bounded: per
    address (refused, 429), in all (the oldest dropped for a new one; 429
    with ``evict_oldest_challenge=False``), and by deadline (expired ones
    are dropped), all counted. Positive control: with the caps lifted, every
    request leaves a challenge behind."""
    from kv_transfer.sglang import bootstrap

    lim = bootstrap.RegistryLimits(max_challenges=64, max_challenges_per_address=8, challenge_ttl_s=0.2)
    now = [100.0]  # a virtual clock: the caps are checked, not the machine's speed
    reg = bootstrap.BootstrapRegistry(lim, SECRET, clock=lambda: now[0])
    codes = [reg.challenge(ATTACKER)[0] for _ in range(100)]
    assert codes.count(200) == 8 and codes.count(429) == 92
    for i in range(7):  # more addresses fill the total
        [reg.challenge(f"127.0.1.{i}") for _ in range(8)]
    assert reg.stats()["challenges_outstanding"] == 64 and reg.challenge(HONEST)[0] == 200  # the oldest gave way
    assert reg.stats()["challenges_outstanding"] == 64 and reg.stats()["challenges_evicted"] == 1
    assert reg.stats()["challenges_refused"] == 92
    now[0] += 0.25
    assert reg.challenge(HONEST)[0] == 200  # past the deadline the stale ones are dropped
    assert reg.stats()["challenges_outstanding"] == 1 and reg.stats()["challenges_expired"] == 64
    # The old cap in all (a refusal) where eviction is off.
    old = bootstrap.BootstrapRegistry(bootstrap.RegistryLimits(max_challenges=8, max_challenges_per_address=8,
                                                               evict_oldest_challenge=False), SECRET)
    assert [old.challenge(ATTACKER)[0] for _ in range(8)] == [200] * 8 and old.challenge(HONEST)[0] == 429
    # Without a secret there is nothing to challenge and nothing is kept.
    assert bootstrap.BootstrapRegistry(lim, None).challenge(HONEST)[0] == 404
    # Positive control: caps lifted, the map grows with every request.
    naive = bootstrap.BootstrapRegistry(bootstrap.RegistryLimits(max_challenges=1 << 30,
                                                                 max_challenges_per_address=1 << 30), SECRET)
    assert [naive.challenge(ATTACKER)[0] for _ in range(1000)].count(200) == 1000
    assert naive.stats()["challenges_outstanding"] == 1000


@pytest.mark.parametrize("evict", [True, False])
def test_hostile_many_addresses_cannot_fill_the_challenge_table_and_keep_the_prefill_out(evict):
    """Issue 46, attack 8 on ``GET /challenge``: 80 challenges (10x the cap
    of 8 outstanding) asked from 40 addresses, 2 each (the per-address cap),
    never used (the TTL, 30 s, frees nothing here: the registry's clock is
    held still). With eviction each new challenge drops the oldest, so the
    prefill (127.0.0.1) arriving then gets one and registers, and the decode
    reads it back, within 2 s; a third from one address is still a 429.
    Positive control (``evict_oldest_challenge=False``): the first 8 hold
    the table and the prefill's challenge is refused (429). Either way the
    per-address counts add up to the table and drain with it."""
    import urllib.error

    from kv_transfer.sglang import bootstrap

    from test_hostile_peers import MANY

    cap, per_address = 8, 2
    server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET, registry_limits=bootstrap.RegistryLimits(
        max_challenges=cap, max_challenges_per_address=per_address, challenge_ttl_s=30.0,
        evict_oldest_challenge=evict))
    reg = server.registry
    now = [1000.0]
    reg._clock = lambda: now[0]  # held still: the caps are checked, not the machine's speed
    base, real = f"http://127.0.0.1:{server.port}", _reg(0, 5000, b"real")
    try:
        t0 = time.perf_counter()
        codes = [_http(server.port, "GET", "/challenge", src)[0] for src in MANY for _ in range(per_address)]
        flood_ms = (time.perf_counter() - t0) * 1000
        assert _http(server.port, "GET", "/challenge", MANY[-1] if evict else MANY[0])[0] == 429  # per address
        t0 = time.perf_counter()
        if evict:
            bootstrap.put_registration(base, real.to_json(), 2, SECRET)
            assert bootstrap.fetch_registration(f"{base}/route?rank=0", 2, SECRET) == real.to_json()
        else:
            with pytest.raises(urllib.error.HTTPError) as e:
                bootstrap.put_registration(base, real.to_json(), 2, SECRET)
            assert e.value.code == 429
        honest_ms = (time.perf_counter() - t0) * 1000
        st = reg.stats()
        print(f"many addresses, challenges (evict={evict}): {len(codes)} asked from {len(MANY)} addresses in "
              f"{flood_ms:.0f} ms: {codes.count(200)} issued, {codes.count(429)} refused; evicted "
              f"{st['challenges_evicted']}, refused {st['challenges_refused']}; prefill "
              f"{'registered' if evict else 'refused'} in {honest_ms:.1f} ms")
        if evict:
            assert codes == [200] * 10 * cap and honest_ms < 2000
            # 72 by the flood, 1 by the prefill; its own challenge is spent by its PUT.
            assert st["challenges_evicted"] == 9 * cap + 1 and st["challenges_refused"] == 1, st
            assert st["registered"] == 1 and st["ranks"] == 1 and st["challenges_outstanding"] == cap - 1, st
        else:
            assert codes.count(200) == cap and codes.count(429) == 9 * cap
            assert st["challenges_evicted"] == 0 and st["challenges_refused"] == 9 * cap + 2, st
            assert st["ranks"] == 0 and st["challenges_outstanding"] == cap, st
        with reg._lock:  # the per-address counts are the table's, no more
            assert sum(reg._challenges_per_addr.values()) == len(reg._challenges)
        now[0] += 31.0  # past the TTL: everything outstanding drains, and the counts with it
        assert _http(server.port, "GET", "/challenge", HONEST)[0] == 200
        with reg._lock:
            assert reg._challenges_per_addr == {HONEST: 1} and len(reg._challenges) == 1
    finally:
        server.close()


@pytest.mark.parametrize("evict", [True, False])
def test_hostile_many_addresses_cannot_fill_the_bootstrap_port_and_keep_the_prefill_out(evict):
    """Issue 46, attack 8 on the bootstrap server's port (its
    ``ConnectionGuard``): 80 silent connections (10x the cap of 8) from 40
    addresses, 2 each (the per-address cap), none of which sends a byte
    (idle timeout and deadline 30 s: they free nothing here). With eviction
    each newcomer shuts down the oldest connection that has completed no
    request, so the prefill (127.0.0.1) arriving then takes its challenge,
    registers, and the decode reads it back, within 2 s; a third connection
    from one address is still refused by its own cap. Positive control
    (``evict_unserved=False``): the first 8 hold the port and the prefill's
    connection is refused. Either way the port's accounting returns to 0
    once the connections are closed."""
    from kv_transfer.ports import ServerLimits
    from kv_transfer.sglang import bootstrap

    from test_hostile_peers import MANY, silent_flood, wait_for

    cap, per_address = 8, 2
    server = bootstrap.BootstrapServer("127.0.0.1", 0, secret=SECRET, server_limits=ServerLimits(
        max_connections=cap, max_per_address=per_address, idle_timeout_s=30.0, message_deadline_s=30.0,
        evict_unserved=evict))
    guard = server._server.guard
    base, real = f"http://127.0.0.1:{server.port}", _reg(0, 5000, b"real")

    def handled() -> int:
        s = guard.stats()
        return s["accepted"] + s["refused_busy"] + s["refused_per_address"]

    flood: list = []
    try:
        flood = silent_flood(server.port, per_address)
        assert len(flood) == 10 * cap
        wait_for("the flood handled", lambda: handled() >= 10 * cap)
        flood.append(socket.create_connection(("127.0.0.1", server.port), 2,
                                              source_address=(MANY[-1] if evict else MANY[0], 0)))
        wait_for("the third from one address handled", lambda: handled() >= 10 * cap + 1)
        s = guard.stats()
        assert s["refused_per_address"] == 1 and s["active"] == cap, s  # the per-address cap stays a refusal
        t0 = time.perf_counter()
        if evict:
            bootstrap.put_registration(base, real.to_json(), 2, SECRET)
            assert bootstrap.fetch_registration(f"{base}/route?rank=0", 2, SECRET) == real.to_json()
        else:
            with pytest.raises(OSError):  # closed or reset before any answer
                bootstrap.put_registration(base, real.to_json(), 2, SECRET)
        honest_ms = (time.perf_counter() - t0) * 1000
        s = server.stats()
        print(f"many addresses, bootstrap port (evict={evict}): evicted {s['bootstrap_evicted_unserved']}, "
              f"refused busy {s['bootstrap_refused_busy']}, per address {s['bootstrap_refused_per_address']}; "
              f"prefill {'registered' if evict else 'refused'} in {honest_ms:.1f} ms")
        if evict:
            # 72 by the flood, 1 to 3 by the prefill's and decode's 3 connections (each frees its slot as it
            # ends, maybe after the next one arrived).
            assert 9 * cap + 1 <= s["bootstrap_evicted_unserved"] <= 9 * cap + 3, s
            assert s["bootstrap_refused_busy"] == 0 and s["bootstrap_registered"] == 1 and honest_ms < 2000, s
        else:
            assert s["bootstrap_evicted_unserved"] == 0 and s["bootstrap_refused_busy"] == 9 * cap + 1, s
            assert s["bootstrap_ranks"] == 0, s
        assert s["bootstrap_active_peak"] == cap, s
    finally:
        for c in flood:
            c.close()
        try:  # everything closed: no slot or address left charged
            wait_for("the port's accounting back to 0", lambda: guard.stats()["active"] == 0
                     and guard.stats()["active_addresses"] == 0)
            assert not guard._live and not guard._per_addr
        finally:
            server.close()


def test_hostile_registration_flood_is_capped_per_address():
    from hostile_child import RANK_CAP_PER_ADDRESS

    flood = 10 * RANK_CAP_PER_ADDRESS
    none = run_child("ranks", "none")
    naive = run_child("ranks", "naive", flood)
    guarded = run_child("ranks", "guarded", flood)
    # Positive control: every made-up rank kept (and its 256 KiB descriptor).
    assert naive["codes"] == {"200": flood} and naive["stats"]["bootstrap_ranks"] == flood + 1
    assert naive["rss_growth_kib"] > 0.5 * flood * 256, naive
    assert guarded["codes"] == {"200": RANK_CAP_PER_ADDRESS, "429": flood - RANK_CAP_PER_ADDRESS}
    assert guarded["stats"]["bootstrap_refused_address_cap"] == flood - RANK_CAP_PER_ADDRESS
    assert guarded["rss_growth_kib"] < naive["rss_growth_kib"] / 3, (guarded, naive)
    for r in (none, naive, guarded):
        assert r["honest_status"] == 200 and r["honest_ms"] < HONEST_BOUND_MS


def test_hostile_dripping_connections_to_the_bootstrap_hold_no_threads_past_the_deadline():
    from hostile_child import CONN_CAP, CONN_CAP_PER_ADDRESS

    flood = 300
    none = run_child("drip_bootstrap", "none")
    naive = run_child("drip_bootstrap", "naive", flood)
    guarded = run_child("drip_bootstrap", "guarded", flood)
    assert naive["drip"]["threads_past_deadline"] >= naive["base_threads"] + flood - 10, naive["drip"]
    assert naive["drip"]["left_open"] >= flood - 10
    d, s = guarded["drip"], guarded["stats"]
    assert d["threads_past_deadline"] <= guarded["base_threads"] + CONN_CAP + 1, d
    assert d["left_open"] == 0, d
    assert s["bootstrap_refused_per_address"] >= flood - CONN_CAP_PER_ADDRESS * 4, s
    assert s["bootstrap_deadline_cuts"] >= CONN_CAP_PER_ADDRESS and s["bootstrap_active_peak"] <= CONN_CAP, s
    for r in (none, naive, guarded):
        assert r["honest"].get("ok") and r["honest"]["ms"] < HONEST_BOUND_MS, r["honest"]


class _ImpostorPrefill:
    """A prefill impostor: a tcp-sim endpoint with pages of its own bytes
    and a control port that records what decodes send it and says ok."""

    def __init__(self, pages: int, item: int, n_buffers: int = 4):
        import ctypes

        import kv_transfer
        from kv_transfer.sglang import wire

        self.bufs = [ctypes.create_string_buffer(b"\xee" * pages * item, pages * item) for _ in range(n_buffers)]
        self.endpoint = kv_transfer.Endpoint("tcp-sim", f"impostor-{id(self):x}")
        self.pool = self.endpoint.register([(ctypes.addressof(b), pages * item, item) for b in self.bufs])
        self.got = []
        # A control-plane listener like a prefill's (single-host mode: the key is public, so it can be one).
        from kv_transfer.peers import ControlPlane

        def take(peer: str, body: bytes) -> bytes:
            self.got.append(bytes(body))
            return b'{"ok": true}'

        self.plane = ControlPlane("impostor")
        self.port = self.plane.serve("127.0.0.1", 0, take)[1]

    def write_into_what_it_got(self) -> str:
        """Writes its own bytes into the exposure a decode sent it."""
        import kv_transfer
        from kv_transfer.sglang import wire

        md = wire.parse_metadata(self.got[0])
        remote = kv_transfer.RemotePages.from_bytes(md.kv)
        self.endpoint.add_peer(md.descriptor)
        t = self.endpoint.write(self.pool.reserve(list(range(remote.pages))), remote)
        state = t.wait(10.0)
        t.release()
        return state

    def close(self):
        self.plane.close()


@pytest.mark.parametrize("first_writer_wins", [False, True])
def test_hostile_impostor_registration_is_not_served_by_the_decode(sglang, monkeypatch, first_writer_wins):
    """Through SGLang's classes: the real prefill registers rank 0, an
    impostor PUTs rank 0 again pointing at its own control port and
    endpoint. Old registry (positive control): the decode exposes its pages
    to the impostor and consumes the impostor's KV, the real prefill gets
    nothing. Now: the decode serves the real prefill, whose bytes land, and
    the impostor is sent nothing."""
    import base64

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kv_transfer.sglang import conn
    from kv_transfer.sglang.bootstrap import RegistryLimits

    monkeypatch.setenv(conn.BACKEND_ENV, "tcp-sim")
    port = free_port()
    server = conn.KvTransferBootstrapServer("127.0.0.1", port,
                                            registry_limits=RegistryLimits(first_writer_wins=first_writer_wins))
    addr = f"127.0.0.1:{port}"
    impostor = _ImpostorPrefill(8, 128)
    keep_p, keep_d = [], []
    pmgr = conn.KvTransferManager(kv_args(keep_p, 8, 128), DisaggregationMode.PREFILL, server_args(port))
    for b, t in enumerate(keep_p[:4]):
        fill(t, 0x5A, b, list(range(8)), 128)
    try:
        real = json.loads(server.registry.get(0)[0])
        fake = dict(real, ctrl_port=impostor.port,
                    descriptor=base64.b64encode(bytes(impostor.endpoint.descriptor())).decode())
        code = _http(port, "PUT", "/route", ATTACKER, json.dumps(fake).encode())[0]
        dmgr = conn.KvTransferManager(kv_args(keep_d, 8, 128), DisaggregationMode.DECODE, server_args(port))
        assert poll_until(lambda: dmgr.try_ensure_parallel_info(addr), {True}, 10)
        room = 4242
        rcv = conn.KvTransferReceiver(mgr=dmgr, bootstrap_addr=addr, bootstrap_room=room)
        rcv.init(0)
        snd = conn.KvTransferSender(pmgr, addr, room)
        t0 = time.perf_counter()
        rcv.send_metadata(np.array([2, 3]), None)
        assert rcv.conclude_state is None, rcv.error
        if not first_writer_wins:
            # Positive control: the impostor got the exposure, wrote its bytes, and the decode consumed them.
            assert code == 200 and rcv.registration.ctrl_port == impostor.port
            assert poll_until(lambda: len(impostor.got), {1}, 5) == 1
            assert impostor.write_into_what_it_got() == "success"
            assert poll_until(rcv.poll, {KVPoll.Success, KVPoll.Failed}, 10) == KVPoll.Success
            assert page_bytes(keep_d[0], 2, 128) == b"\xee" * 128
            assert pmgr.target_of(room) is None  # the real prefill got nothing
            return
        assert code == 409 and rcv.registration.ctrl_port == pmgr.control.address[1]
        snd.init(2)
        assert poll_until(snd.poll, {KVPoll.WaitingForInput, KVPoll.Failed}, 5) == KVPoll.WaitingForInput
        snd.send(np.array([5, 6]))
        assert poll_until(snd.poll, {KVPoll.Success, KVPoll.Failed}, 10) == KVPoll.Success
        assert poll_until(rcv.poll, {KVPoll.Success, KVPoll.Failed}, 10) == KVPoll.Success
        ms = (time.perf_counter() - t0) * 1000
        assert ms < 10 * HONEST_BOUND_MS  # the honest prefill's request, end to end
        assert page_bytes(keep_d[0], 2, 128) == page_bytes(keep_p[0], 5, 128)
        assert impostor.got == []  # the impostor was sent no exposure
        assert server.registry.stats()["refused_taken"] == 1
    finally:
        impostor.close()
        server.close()
        pmgr.teardown()
