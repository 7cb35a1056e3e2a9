"""Issue 46 on the Python control plane (``kv_transfer.peers``): a peer is
what the handshake proves, and what it can make a listener hold is its own
share, bounded. Each attack goes through the public API and the wire
format, with its positive control. None of these needs SGLang.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest

import kv_transfer
from kv_transfer import peers
from kv_transfer.peers import ControlPlane, PlaneLimits, RemoteError

from hostile_child import ATTACKER, HONEST, RawPeer, pipe

KEY = kv_transfer.ClusterKey.from_secret(b"the deployment's own cluster secret")


def echo(peer: str, body: bytes) -> bytes:
    return peer.encode() + b":" + body


@pytest.fixture
def listener():
    planes = []

    def make(limits: PlaneLimits = PlaneLimits(), key=KEY, advertise=None):
        p = ControlPlane("prefill", key, limits)
        planes.append(p)
        host, port = p.serve("127.0.0.1", 0, echo, advertise=advertise)
        return p, host, port

    yield make
    for p in planes:
        p.close()


def wait_for(what, cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:  # bounded in time
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_requests_are_pipelined_on_one_connection_per_peer(listener):
    p, host, port = listener()
    decode = ControlPlane("decode", KEY)
    try:
        futs = [decode.request(host, port, str(i).encode(), timeout=5) for i in range(200)]
        assert [f.result(10) for f in futs] == [f"decode:{i}".encode() for i in range(200)]
        s = p.stats()
        assert s["connections"] == 1 and s["auth_established"] == 1 and s["requests"] == 200, s
        assert decode.stats()["links_opened"] == 1
    finally:
        decode.close()


def test_hostile_a_peer_under_another_cluster_key_is_refused_typed_and_counted(listener):
    p, host, port = listener()
    honest = ControlPlane("decode", KEY)
    intruder = ControlPlane("decode", kv_transfer.ClusterKey.from_secret(b"a guess at the cluster's secret"))
    try:
        assert honest.call(host, port, b"x", timeout=5) == b"decode:x"  # positive control: one key connects
        with pytest.raises(kv_transfer.PeerRefused) as e:
            intruder.call(host, port, b"x", timeout=5)
        assert e.value.args[1] == "wrong_key"
        wait_for("the refusal counted", lambda: p.stats().get("auth_refused_by_peer", 0) == 1)
        assert p.stats()["auth_established"] == 1
    finally:
        honest.close()
        intruder.close()


def _relay(m: socket.socket, to_port: int) -> None:
    """M: accepts one connection and splices it to the listener."""
    a, _ = m.accept()
    b = socket.create_connection(("127.0.0.1", to_port))

    threading.Thread(target=pipe, args=(a, b), daemon=True).start()
    threading.Thread(target=pipe, args=(b, a), daemon=True).start()


@pytest.mark.parametrize("bound", [False, True])
def test_hostile_a_relayed_handshake_is_refused_because_the_dialed_address_is_bound(bound):
    """M makes B dial M's address for the prefill and splices B's bytes to
    the prefill. Checked: the prefill refuses (B's HELLO names M's address),
    typed at B, counted at the prefill, no peer. Positive control: a prefill
    that answers to M's address too serves M's connection as B's."""
    m = socket.socket()
    m.bind(("127.0.0.1", 0))
    m.listen(1)
    m_addr = "%s:%d" % m.getsockname()
    p = ControlPlane("prefill", KEY)
    _, port = p.serve("127.0.0.1", 0, echo, answers_to=() if bound else (m_addr,))
    threading.Thread(target=_relay, args=(m, port), daemon=True).start()
    b = ControlPlane("B", KEY)
    try:
        host, mport = m_addr.rsplit(":", 1)
        if bound:
            with pytest.raises(kv_transfer.PeerRefused) as e:
                b.call(host, int(mport), b"x", timeout=5)
            assert e.value.args[1] == "refused_by_peer"
            wait_for("the relay counted", lambda: p.stats().get("auth_address_mismatch", 0) == 1)
            assert p.stats().get("peers_connected", 0) == 0
        else:
            assert b.call(host, int(mport), b"x", timeout=5) == b"B:x"
    finally:
        b.close()
        m.close()
        p.close()


def test_hostile_a_replayed_handshake_is_refused_typed_and_counted(listener):
    p, host, port = listener()
    hs, hello = kv_transfer.PeerHandshake.dial(KEY, peers.CONTEXT, "decode", "", f"{host}:{port}")
    answers = []
    for _ in range(2):
        with socket.create_connection((host, port), 5) as s:
            s.sendall(hello)
            header = s.recv(kv_transfer.handshake_header_len(), socket.MSG_WAITALL)
            answers.append(header + s.recv(kv_transfer.handshake_body_len(header), socket.MSG_WAITALL))
    assert answers[0][5] == 2, "positive control: the live HELLO gets a CHALLENGE"
    assert answers[1][5] == 4 and answers[1][-1] == 2, "the replay gets REFUSED(Replayed)"
    wait_for("the replay counted", lambda: p.stats().get("auth_replayed", 0) == 1)


def test_hostile_frames_without_a_handshake_or_with_a_forged_tag_buy_nothing(listener):
    p, host, port = listener()
    # No handshake: a request frame as the first bytes is not a HELLO.
    with socket.create_connection((host, port), 5) as s:
        s.sendall(peers._HDR.pack(4, 1, peers.REQUEST) + b"ABCD" + b"\0" * 32)
        s.settimeout(5)
        assert s.recv(64)[:4] == b"KVTA"  # REFUSED, then closed
    # A frame whose tag is not the session's: the connection is dropped, nothing handled.
    raw = RawPeer(port, HONEST, "decode", key=KEY)
    frame = bytearray(raw.frame(b"hello"))
    frame[-1] ^= 1
    raw.s.sendall(bytes(frame))
    raw.s.settimeout(5)
    assert raw.s.recv(64) == b""
    s = p.stats()
    assert s.get("bad_tags", 0) == 1 and s.get("requests", 0) == 0, s
    # Positive control: the same frame with its own tag is answered.
    raw = RawPeer(port, HONEST, "decode2", key=KEY)
    assert raw.request(b"hello") == (peers.REPLY, b"decode2:hello")
    raw.close()


def test_hostile_many_names_hold_at_most_the_peer_cap_and_never_keep_an_honest_peer_out(listener):
    cap = 8
    p, host, port = listener(PlaneLimits(max_peers=cap))
    held = []
    for i in range(10 * cap):  # ten times the cap, idle once connected
        try:
            held.append(RawPeer(port, ATTACKER, f"made-up-{i}", key=KEY))
        except (OSError, kv_transfer.KvTransferError):
            pass
    wait_for("the flood handled", lambda: p.stats().get("peers_connected", 0) >= 10 * cap)
    assert p.stats()["peers"] <= cap
    decode = ControlPlane("honest", KEY)
    try:
        t0 = time.perf_counter()
        assert decode.call(host, port, b"x", timeout=5) == b"honest:x"
        honest_ms = (time.perf_counter() - t0) * 1000
        s = p.stats()
        print(f"many names: {s['peers']} peers held of {10 * cap} names; evicted {s.get('peers_evicted')}; "
              f"honest served in {honest_ms:.1f} ms")
        assert s["peers"] <= cap and s.get("peers_evicted", 0) >= 9 * cap, s
        assert honest_ms < 1000
    finally:
        decode.close()
        for r in held:
            r.close()


def _busy_peer_under_a_name_flood(listener, limits: PlaneLimits, seconds: float):
    """An honest peer sends requests back to back while an insider opens
    new names as fast as it can (each held a while, then closed), so that
    the honest peer is, now and then, the idlest at the cap. Returns the
    honest peer's answers, its failures, its GOAWAYs and the evictions."""
    cap = 4
    p, host, port = listener(limits)
    stop = threading.Event()

    def flood() -> None:
        held = []
        for i in range(100_000):  # bounded in count, and by the honest side's time
            if stop.is_set():
                break
            try:
                held.append(RawPeer(port, ATTACKER, f"made-up-{i}", key=KEY))
            except (OSError, kv_transfer.KvTransferError):
                pass
            if len(held) > 2 * cap:
                held.pop(0).close()
        for r in held:
            r.close()

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    honest = ControlPlane("honest", KEY)
    answered, failures = 0, []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # bounded in time
            try:
                assert honest.call(host, port, b"x", timeout=5) == b"honest:x"
                answered += 1
            except (peers.PlaneClosed, TimeoutError, concurrent.futures.TimeoutError) as e:
                failures.append(f"{type(e).__name__}: {e}")
            time.sleep(0.001)
    finally:
        stop.set()
        t.join(10)
        goaways = honest.stats().get("goaways", 0)
        honest.close()
    return answered, failures, goaways, p.stats().get("peers_evicted", 0)


def test_hostile_a_name_flood_that_evicts_a_busy_honest_peer_costs_it_no_request(listener):
    answered, failures, goaways, evicted = _busy_peer_under_a_name_flood(listener, PlaneLimits(max_peers=4), 4.0)
    print(f"name flood, GOAWAY: {answered} answered, {len(failures)} failed, the honest peer let go {goaways} "
          f"times, {evicted} evictions")
    assert evicted > 0 and goaways > 0, "the flood never made the honest peer give way: the test proves nothing"
    assert answered > 0 and failures == [], failures[:5]


def test_hostile_positive_control_a_name_flood_that_closes_an_evicted_peer_fails_its_requests(listener):
    limits = PlaneLimits(max_peers=4, goaway=False)
    answered, failures, _, evicted = _busy_peer_under_a_name_flood(listener, limits, 4.0)
    print(f"name flood, closed on eviction: {answered} answered, {len(failures)} failed, {evicted} evictions")
    assert evicted > 0 and failures, "closing an evicted peer's connection failed none of its requests"


def test_hostile_a_peers_requests_in_flight_are_capped_and_it_waits_only_behind_its_own(listener):
    gate = threading.Event()

    def slow(peer: str, body: bytes) -> bytes:
        if peer == "greedy":
            gate.wait(10)
        return b"ok"

    p = ControlPlane("prefill", KEY, PlaneLimits(max_inflight_per_peer=4, handler_threads=2))
    _, port = p.serve("127.0.0.1", 0, slow)
    greedy = ControlPlane("greedy", KEY)
    honest = ControlPlane("honest", KEY)
    try:
        futs = [greedy.request("127.0.0.1", port, b"x", timeout=10) for _ in range(40)]  # 10x the cap
        wait_for("the greedy peer refused", lambda: p.stats().get("refused_peer_requests", 0) >= 1)
        t0 = time.perf_counter()
        assert honest.call("127.0.0.1", port, b"y", timeout=5) == b"ok"
        honest_ms = (time.perf_counter() - t0) * 1000
        gate.set()
        done = [f.exception(10) is None for f in futs]
        print(f"greedy: {sum(done)} of 40 answered, honest in {honest_ms:.1f} ms, {p.stats()}")
        assert honest_ms < 1000, "the honest peer waited behind the greedy one"
        assert not all(done), "positive control: past its cap the greedy peer's connection was dropped"
    finally:
        gate.set()
        greedy.close()
        honest.close()
        p.close()


def test_an_error_in_a_handler_goes_back_typed_and_the_connection_stays(listener):
    def picky(peer: str, body: bytes) -> bytes:
        if body == b"bad":
            raise kv_transfer.DescriptorError("no such thing")
        return b"ok"

    p = ControlPlane("prefill", KEY)
    _, port = p.serve("127.0.0.1", 0, picky)
    d = ControlPlane("decode", KEY)
    try:
        with pytest.raises(RemoteError, match="DescriptorError: no such thing"):
            d.call("127.0.0.1", port, b"bad", timeout=5)
        assert d.call("127.0.0.1", port, b"good", timeout=5) == b"ok"
        assert d.stats()["links_opened"] == 1
    finally:
        d.close()
        p.close()


#: Issue 46, attack 8 ("many addresses"): the attacker's source addresses, each under its own cap.
MANY = [f"127.0.0.{i}" for i in range(2, 42)]


def silent_flood(port: int, per_address: int) -> list:
    """``per_address`` connections from each of :data:`MANY`, in that order,
    sending nothing (bounded: one dial each, 2 s each)."""
    socks = []
    for src in MANY:
        for _ in range(per_address):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), 2, source_address=(src, 0)))
            except OSError:
                pass
    return socks


@pytest.mark.parametrize("evict", [True, False])
def test_hostile_many_addresses_cannot_fill_the_handshake_table_and_keep_an_honest_peer_out(listener, evict):
    """Attack 8 on the control plane: 80 silent connections (10x the
    handshake cap of 8) from 40 addresses, 2 each (the per-address cap),
    none of which starts its handshake (the deadline, 30 s, frees nothing
    here). With eviction, each newcomer closes the oldest handshake in
    flight, so the honest peer (127.0.0.1) arriving then is served within
    2 s; a third connection from one address is still refused by its own
    cap. Positive control (``evict_oldest_handshake=False``): the first 8
    hold the table, the rest and the honest peer are refused. Either way the
    handshake bookkeeping returns to 0 once the connections are gone."""
    cap, per_address = 8, 2
    p, host, port = listener(PlaneLimits(max_handshakes=cap, max_handshakes_per_address=per_address,
                                         handshake_deadline_s=30.0, evict_oldest_handshake=evict))
    flood = silent_flood(port, per_address)
    assert len(flood) == 10 * cap
    wait_for("the flood accepted", lambda: p.stats().get("connections", 0) >= 10 * cap)
    # A third from an address with its 2 in flight (the newest with eviction, the first without).
    extra = socket.create_connection(("127.0.0.1", port), 2, source_address=(MANY[-1] if evict else MANY[0], 0))
    wait_for("the third from one address handled", lambda: p.stats().get("connections", 0) >= 10 * cap + 1)
    s = p.stats()
    assert s.get("refused_handshakes_per_address", 0) == 1, s  # the per-address cap stays a refusal
    assert s["handshakes_in_flight"] == cap and s["handshakes_peak"] == cap, s
    decode = ControlPlane("honest", KEY)
    try:
        t0 = time.perf_counter()
        if evict:
            assert decode.call(host, port, b"x", timeout=5) == b"honest:x"
        else:
            with pytest.raises((EOFError, OSError, kv_transfer.KvTransferError)):
                decode.call(host, port, b"x", timeout=5)
        honest_ms = (time.perf_counter() - t0) * 1000
        s = p.stats()
        print(f"many addresses (evict={evict}): {len(flood)} silent connections from {len(MANY)} addresses; "
              f"evicted {s.get('handshakes_evicted', 0)}, refused busy {s.get('refused_handshakes_busy', 0)}, "
              f"per address {s.get('refused_handshakes_per_address', 0)}; honest "
              f"{'served' if evict else 'refused'} in {honest_ms:.1f} ms")
        if evict:
            # 72 by the flood, 1 by the honest peer: the newest 8 held at any time, never more.
            assert s.get("handshakes_evicted", 0) == 9 * cap + 1 and s.get("refused_handshakes_busy", 0) == 0, s
            assert s["auth_established"] == 1 and s["peers"] == 1 and honest_ms < 2000, s
        else:
            assert s.get("handshakes_evicted", 0) == 0 and s.get("refused_handshakes_busy", 0) == 9 * cap + 1, s
            assert s.get("auth_established", 0) == 0 and s["peers"] == 0, s
        assert s["handshakes_peak"] == cap, s
    finally:
        decode.close()
        for c in flood + [extra]:
            c.close()
    # Everything closed: nothing left charged to any address.
    wait_for("the handshakes released", lambda: p.stats()["handshakes_in_flight"] == 0 and p.stats()["peers"] == 0)

    async def tables() -> tuple:
        svc = next(iter(p._services.values()))
        return dict(svc.handshaking), len(svc.in_handshake), len(svc.conns)

    wait_for("the connections gone", lambda: p._run(tables(), 5) == ({}, 0, 0))
