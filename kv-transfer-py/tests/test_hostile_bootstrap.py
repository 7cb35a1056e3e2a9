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
        bad = {bootstrap.AUTH_HEADER: bootstrap.mac(b"guess", impostor.to_json())}
        assert _http(server.port, "PUT", "/route", ATTACKER, impostor.to_json(), bad)[0] == 403
        good = {bootstrap.AUTH_HEADER: bootstrap.mac(secret, real.to_json())}
        assert _http(server.port, "PUT", "/route", HONEST, real.to_json(), good)[0] == 200
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
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = False

        def loop():
            t_end = time.monotonic() + 60
            while not self._stop and time.monotonic() < t_end:
                try:
                    c, _ = self.sock.accept()
                except OSError:
                    continue
                with c:
                    c.settimeout(5)
                    try:
                        self.got.append(wire.recv_frame(c))
                        wire.send_frame(c, b'{"ok": true}')
                    except (OSError, wire.ProtocolError):
                        pass

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

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
        self._stop = True
        self.thread.join(5)
        self.sock.close()


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
            assert len(impostor.got) == 1 and impostor.write_into_what_it_got() == "success"
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
