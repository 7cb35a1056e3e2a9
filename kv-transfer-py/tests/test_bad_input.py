"""Rule: a malformed bootstrap registration or control message from a
hostile peer gets a typed error and changes no KV byte (no lease, no room,
no page written)."""

import json
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest

import kv_transfer
from conftest import fill, free_port, kv_args, poll_until, server_args

BAD_REGISTRATIONS = [
    b"not json",
    b"[]",
    b'{"rank": 0}',
    json.dumps({"rank": True, "ctrl_host": "h", "ctrl_port": 1, "backend": "tcp-sim", "descriptor": "", "page_size": 1,
                "kv_item_lens": [1], "aux_item_lens": []}).encode(),
    json.dumps({"rank": 0, "ctrl_host": "h", "ctrl_port": 70000, "backend": "tcp-sim", "descriptor": "", "page_size": 1,
                "kv_item_lens": [1], "aux_item_lens": []}).encode(),
    json.dumps({"rank": 0, "ctrl_host": "h", "ctrl_port": 1, "backend": "tcp-sim", "descriptor": "***", "page_size": 1,
                "kv_item_lens": [1], "aux_item_lens": []}).encode(),
    json.dumps({"rank": 0, "ctrl_host": "h", "ctrl_port": 1, "backend": "tcp-sim", "descriptor": "", "page_size": 1,
                "kv_item_lens": [0, -4], "aux_item_lens": []}).encode(),
]


def test_malformed_registrations_are_refused_and_stored_nowhere(sglang):
    from kv_transfer.sglang import wire
    from kv_transfer.sglang.conn import KvTransferBootstrapServer

    for data in BAD_REGISTRATIONS:
        with pytest.raises(wire.ProtocolError):
            wire.parse_registration(data)
    assert issubclass(wire.ProtocolError, kv_transfer.DescriptorError)
    port = free_port()
    server = KvTransferBootstrapServer("127.0.0.1", port)
    try:
        for data in BAD_REGISTRATIONS:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/route", data=data, method="PUT")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 400
        assert server.rejected == len(BAD_REGISTRATIONS)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/route?rank=0", timeout=5)
        assert e.value.code == 503  # nothing was registered
    finally:
        server.close()


def _ctrl(mgr, payload: bytes) -> dict:
    """One control request to ``mgr``'s port, as a decode sends it (its own
    authenticated connection); an error answer as ``{"error": text}``."""
    from kv_transfer.peers import ControlPlane, RemoteError

    host, port = mgr.control.address
    plane = ControlPlane("test-decode")
    try:
        return json.loads(plane.call(host, port, payload, timeout=5))
    except RemoteError as e:
        return {"error": str(e)}
    finally:
        plane.close()


def test_hostile_control_messages_get_typed_errors_and_change_no_kv_byte(sglang, monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kv_transfer.sglang import conn, wire

    monkeypatch.setenv(conn.BACKEND_ENV, "tcp-sim")
    port = free_port()
    server = conn.KvTransferBootstrapServer("127.0.0.1", port)
    addr = f"127.0.0.1:{port}"
    pt, dt = [], []
    pargs = kv_args(pt, 8, 128)
    for b, t in enumerate(pt[:-1]):
        fill(t, 0x77, b, list(range(8)), 128)
    pmgr = conn.KvTransferManager(pargs, DisaggregationMode.PREFILL, server_args(port))
    dmgr = conn.KvTransferManager(kv_args(dt, 8, 128), DisaggregationMode.DECODE, server_args(port))
    assert poll_until(lambda: dmgr.try_ensure_parallel_info(addr), {True}, 10)
    before = [bytes(t.numpy().tobytes()) for t in dt]

    # A real exposure, to tamper with.
    rcv = conn.KvTransferReceiver(mgr=dmgr, bootstrap_addr=addr, bootstrap_room=9)
    rcv.init(0)
    lease = dmgr.kv_pool.reserve([1, 2])
    real = dmgr.endpoint.expose(lease, rcv.peer)
    good = json.loads(real.to_bytes())
    forged = json.loads(real.to_bytes())
    for buf in forged["buffers"]:
        for slot in buf["slots"]:
            slot["generation"] += 1  # a guessed tenancy
        buf["token"] = [0] * len(buf["token"])  # a guessed token
    desc = dmgr.endpoint.descriptor()
    import base64

    def md(room, kv, descriptor=desc, aux=None):
        return wire.Metadata(room=room, descriptor=bytes(descriptor), kv=kv, aux=aux).to_json()

    hostile = [
        b"garbage",
        json.dumps({"type": "metadata", "room": -1, "descriptor": "", "kv": ""}).encode(),
        json.dumps({"type": "other"}).encode(),
        md(20, b"{not an exposure"),
        md(21, json.dumps({"kvt": 1, "buffers": good["buffers"][:1]}).encode()),  # wrong buffer count
        json.dumps({"type": "metadata", "room": 23, "descriptor": base64.b64encode(bytes(desc)).decode(),
                    "kv": "!!notbase64"}).encode(),
    ]
    for payload in hostile:
        reply = _ctrl(pmgr, payload)
        assert "error" in reply and ("ProtocolError" in reply["error"] or "DescriptorError" in reply["error"]), reply
    assert pmgr.get_metrics()["bad_control_messages"] == len(hostile)
    assert pmgr.control.stats()["ctrl_rooms"] == 0  # no room was created
    # A bogus descriptor: taken as metadata (it buys no peer), refused when the room's sender asks for it:
    # the room fails, counted, and no byte moves.
    assert _ctrl(pmgr, md(22, real.to_bytes(), descriptor=b"\x00bogus descriptor")) == {"ok": True}
    s22 = conn.KvTransferSender(pmgr, addr, 22)
    assert pmgr.target_of(22) is None and pmgr.get_metrics()["bad_control_messages"] == len(hostile) + 1
    assert s22.poll() == KVPoll.Bootstrapping
    pmgr.forget_room(22)

    # Well-formed but forged: the prefill writes where the forgery says;
    # the decode NIC refuses (generation and token), and no byte lands.
    assert _ctrl(pmgr, md(30, json.dumps(forged).encode())) == {"ok": True}
    s = conn.KvTransferSender(pmgr, addr, 30)
    assert poll_until(s.poll, {KVPoll.WaitingForInput}, 5) == KVPoll.WaitingForInput
    s.init(2)
    s.send(np.array([3, 4]))
    assert poll_until(s.poll, {KVPoll.Success, KVPoll.Failed}, 10) == KVPoll.Failed
    after = [bytes(t.numpy().tobytes()) for t in dt]
    assert after == before, "a hostile peer changed KV bytes"
    assert lease.state == "exposed"  # the forgery settled nothing
    lease.abort()
    server.close()
    pmgr.teardown()


def test_a_decode_refuses_a_prefill_with_another_page_layout(sglang, monkeypatch):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kv_transfer.sglang import conn

    monkeypatch.setenv(conn.BACKEND_ENV, "tcp-sim")
    port = free_port()
    server = conn.KvTransferBootstrapServer("127.0.0.1", port)
    keep: list = []
    pmgr = conn.KvTransferManager(kv_args(keep, 8, 128), DisaggregationMode.PREFILL, server_args(port))
    dmgr = conn.KvTransferManager(kv_args(keep, 8, 256), DisaggregationMode.DECODE, server_args(port))
    with pytest.raises(kv_transfer.DescriptorError, match="layout"):
        dmgr.prefill_registration(f"127.0.0.1:{port}")
    assert not dmgr.try_ensure_parallel_info(f"127.0.0.1:{port}")
    server.close()
    pmgr.teardown()
