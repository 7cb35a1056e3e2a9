"""Rule 9 on the prefill's control port (issue 29, attack 12): a decode
peer's bytes buy only that peer's state, bounded.

Each flood runs in a child process (``hostile_child.py``) so that its peak
RSS is its own, three times: without the flood (the no-flood control),
with the checks off (the positive control: the damage happens), with them
on (the damage does not; the honest peer, from another address, is served
within the bound stated). None of these needs SGLang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kv_transfer  # noqa: F401  (the native module must be there)

HERE = os.path.dirname(os.path.abspath(__file__))
#: The honest peer's bound under every flood here (the port's deadline is 1 s, its idle timeout 0.5 s).
HONEST_BOUND_MS = 1000.0


def run_child(scenario: str, mode: str, n: int = 0, timeout: float = 180.0) -> dict:
    p = subprocess.run([sys.executable, os.path.join(HERE, "hostile_child.py"), scenario, mode, str(n)],
                       capture_output=True, text=True, timeout=timeout, cwd=HERE)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"{scenario} {mode}: " + json.dumps({k: v for k, v in out.items() if k not in ("stats",)}))
    return out


def test_hostile_made_up_rooms_are_capped_per_peer_and_cost_bounded_memory():
    from hostile_child import ROOM_CAP

    flood = 10 * ROOM_CAP
    none = run_child("rooms", "none")
    naive = run_child("rooms", "naive", flood)
    guarded = run_child("rooms", "guarded", flood)
    frame_mib = naive["frame_bytes"] / (1 << 20)
    # Positive control: every made-up room is kept, and so is its memory.
    assert naive["accepted"] == flood and naive["stats"]["ctrl_rooms"] == flood + 1
    assert naive["rss_growth_kib"] > 0.5 * flood * 1024, naive  # each room holds a ~1 MiB parsed exposure
    # With the checks: the peer's pending share holds ROOM_CAP rooms, the rest is refused and counted.
    s = guarded["stats"]
    assert guarded["accepted"] == ROOM_CAP and guarded["refused"] == flood - ROOM_CAP
    assert s["ctrl_refused_peer_rooms"] == flood - ROOM_CAP and s["ctrl_rooms_pending"] == ROOM_CAP
    # What is held is ROOM_CAP parsed exposures (~3 MiB each) plus allocator slack, not the flood.
    assert guarded["rss_growth_kib"] < naive["rss_growth_kib"] / 3, (guarded, naive)
    assert guarded["hwm_kib"] < naive["hwm_kib"]
    # Issue 46, attack 7: made-up rooms buy no peer (no add_peer, no connection, no thread); only the honest
    # room's sender added one. Positive control (the old table): every room's descriptor was added at once.
    assert guarded["stats"]["peers_added_on_claim"] == 1, guarded["stats"]
    assert naive["stats"]["peers_added_on_claim"] == flood + 1, naive["stats"]
    # The honest peer's room (a sender exists for it) is kept, at once.
    for r in (none, naive, guarded):  # its frame is the same 5 MiB exposure: parsing it is most of the time
        assert r["honest_ok"] and r["honest_ms"] < 3 * HONEST_BOUND_MS
    print(f"frame {frame_mib:.2f} MiB; RSS growth KiB: none {none['rss_growth_kib']}, naive {naive['rss_growth_kib']}, "
          f"guarded {guarded['rss_growth_kib']}; HWM KiB: {none['hwm_kib']}, {naive['hwm_kib']}, {guarded['hwm_kib']}")


def test_hostile_frame_of_empty_objects_is_refused_before_parsing():
    none = run_child("frame", "none", 16)
    naive = run_child("frame", "naive", 16)
    guarded = run_child("frame", "guarded", 16)
    # Positive control: the old parser builds ~5.6 M dicts before it looks at the shape.
    assert naive["hwm_growth_kib"] > 200 * 1024, naive
    # With the checks: refused by its shape, typed, counted; no parse (the frame's own 16 MiB buffer is all).
    assert "ProtocolError" in guarded["reply"]["error"] and "shape" in guarded["reply"]["error"], guarded
    assert guarded["stats"]["bad_control_messages"] == 1
    assert guarded["hwm_growth_kib"] < 64 * 1024, guarded
    for r in (none, naive, guarded):
        assert r["honest_ok"] and r["honest_ms"] < HONEST_BOUND_MS


def test_hostile_dripping_connections_hold_nothing_past_the_handshake_deadline():
    from hostile_child import CONN_CAP, CONN_CAP_PER_ADDRESS

    flood = 300  # 75x the per-address cap, 18x the port's cap
    none = run_child("drip_ctrl", "none")
    naive = run_child("drip_ctrl", "naive", flood)
    guarded = run_child("drip_ctrl", "guarded", flood)
    def held_past_deadline(r: dict) -> int:
        # Open connections sampled between the 1 s deadline (plus slack) and the 2.4 s at which the drip
        # completes a handshake header (which is then refused as not a HELLO).
        return max(o for ts, _, o in r["drip"]["samples"] if 1.4 < ts < 2.3)

    # Positive control (no handshake caps, no deadline): every dripping connection is held past 1 s.
    assert held_past_deadline(naive) >= flood - 10, naive["drip"]
    # With the checks: CONN_CAP_PER_ADDRESS handshakes at once, each cut at its deadline, the rest refused.
    d, s = guarded["drip"], guarded["stats"]
    assert held_past_deadline(guarded) == 0 and d["left_open"] == 0, d
    assert s["ctrl_refused_handshakes_per_address"] >= flood - CONN_CAP_PER_ADDRESS * 4, s
    assert s["ctrl_handshake_cut"] >= CONN_CAP_PER_ADDRESS and s["ctrl_handshakes_peak"] <= CONN_CAP, s
    # One event loop: no connection, held or not, costs a thread.
    for r in (naive, guarded):
        assert r["drip"]["threads_past_deadline"] <= r["base_threads"] + 2, r["drip"]
    for r in (none, naive, guarded):
        assert r["honest"].get("ok") and r["honest"]["ms"] < HONEST_BOUND_MS, r["honest"]


def test_hostile_declared_frames_are_charged_to_the_peers_byte_budget():
    from hostile_child import BYTE_CAP_PER_ADDRESS

    flood = 20  # frames of 4 MiB: 80 MiB declared, 10x the 8 MiB per-address budget
    admitted = BYTE_CAP_PER_ADDRESS // (4 << 20)
    none = run_child("declared", "none", flood)
    naive = run_child("declared", "naive", flood)
    guarded = run_child("declared", "guarded", flood)
    # Positive control: every frame's body is read and held (1 MiB sent of each).
    assert naive["refused"] == 0 and naive["rss_growth_kib"] > 0.6 * flood * 1024, naive
    # With the budget: two frames at once from that peer (two connections, 4 MiB each), the rest refused
    # before a body byte is read.
    assert guarded["refused"] == flood - admitted, guarded
    s = guarded["stats"]
    assert s.get("ctrl_refused_links_per_peer", 0) + s.get("ctrl_refused_peer_bytes", 0) == flood - admitted, s
    assert guarded["rss_growth_kib"] < naive["rss_growth_kib"] / 3, (guarded, naive)
    for r in (none, naive, guarded):
        assert r["honest_ok"] and r["honest_ms"] < HONEST_BOUND_MS


def test_hostile_unclaimed_rooms_expire_and_a_room_is_filled_once():
    """The room table alone: pending metadata expires after its TTL (it is
    no tombstone: forgetting it frees nothing), and a second metadata for a
    room cannot replace the first (under the opt-out it does)."""
    from kv_transfer.sglang.control import RoomLimits, RoomRefused, RoomTable

    now = [0.0]
    t = RoomTable(RoomLimits(max_pending_per_peer=2, pending_ttl_s=5.0), clock=lambda: now[0])
    for room in (1, 2):
        t.commit(room, t.reserve(room, "a", 10), f"v{room}")
    with pytest.raises(RoomRefused) as e:
        t.reserve(3, "a", 10)
    assert e.value.kind == "peer_rooms"
    t.commit(3, t.reserve(3, "b", 10), "other peer")  # another peer's share is its own
    with pytest.raises(RoomRefused) as e:
        t.reserve(1, "b", 10)
    assert e.value.kind == "duplicate" and t.get(1) == "v1"
    now[0] = 6.0
    t.commit(4, t.reserve(4, "a", 10), "v4")  # the expired ones made room
    assert t.get(1) is None and t.stats()["rooms_expired"] == 3
    t.expect(9)  # a room a sender exists for is not charged to the peer's pending share
    t.commit(9, t.reserve(9, "a", 10), "claimed")
    now[0] = 100.0
    t.reserve(10, "c", 1)
    assert t.get(9) == "claimed"  # claimed rooms do not expire
    naive = RoomTable(RoomLimits(enforce=False))
    naive.commit(1, naive.reserve(1, "a", 10), "real")
    naive.commit(1, naive.reserve(1, "b", 10), "impostor")
    assert naive.get(1) == "impostor"  # the positive control: the later claimant replaced the first


def test_metadata_for_a_room_whose_sender_failed_is_refused_and_the_memory_is_bounded():
    """A router that aborts a request's prefill half but whose abort of the
    decode half is lost (sent before the decode knew the request): the
    decode's metadata, arriving after the prefill's sender failed, is refused
    at once, so the decode fails instead of waiting for a sender that will
    never come. Only failed rooms are remembered, and only so many."""
    from kv_transfer.sglang.control import RoomLimits, RoomRefused, RoomTable

    t = RoomTable(RoomLimits(max_failed_rooms=2))
    t.expect(7)
    t.forget(7, failed=True)
    with pytest.raises(RoomRefused) as e:
        t.reserve(7, "a", 10)
    assert e.value.kind == "failed" and t.stats()["refused_failed_room"] == 1
    t.expect(8)
    t.forget(8)  # concluded, not failed: nothing remembered
    t.commit(8, t.reserve(8, "a", 10), "pending again")
    for room in (20, 21):
        t.forget(room, failed=True)
    t.commit(7, t.reserve(7, "a", 10), "7 was forgotten")  # the oldest went first
    with pytest.raises(RoomRefused):
        t.reserve(21, "a", 10)


@pytest.mark.parametrize("evict", [True, False])
def test_hostile_many_addresses_cannot_fill_a_frame_ports_connections_and_keep_an_honest_peer_out(evict):
    """Issue 46, attack 8 on a guarded port (``kv_transfer.ports``: a
    :class:`FramePort`, the same :class:`ConnectionGuard` as the bootstrap
    server's): 80 silent connections (10x the cap of 8) from 40 addresses,
    2 each (the per-address cap), none of which sends a byte (deadline and
    idle timeout 30 s: they free nothing here). With eviction each newcomer
    shuts down the oldest connection that has completed no request, so the
    honest peer (127.0.0.1) arriving then is answered within 2 s; a third
    connection from one address is still refused by its own cap. Positive
    control (``evict_unserved=False``): the first 8 hold the port, the rest
    and the honest peer are refused. Either way the accounting returns to 0
    once the connections are closed."""
    import socket
    import time

    from kv_transfer.frames import ProtocolError, recv_frame, send_frame
    from kv_transfer.ports import FramePort, ServerLimits

    from test_hostile_peers import MANY, silent_flood, wait_for

    cap, per_address = 8, 2
    port = FramePort("many", lambda data, peer: {"ok": True, "echo": data.decode(), "peer": peer},
                     limits=ServerLimits(max_connections=cap, max_per_address=per_address, idle_timeout_s=30.0,
                                         message_deadline_s=30.0, evict_unserved=evict))
    guard = port._server.guard

    def handled() -> int:
        s = port.stats()
        return s["accepted"] + s["refused_busy"] + s["refused_per_address"]

    flood: list = []
    try:
        flood = silent_flood(port.address[1], per_address)
        assert len(flood) == 10 * cap
        wait_for("the flood handled", lambda: handled() >= 10 * cap)
        flood.append(socket.create_connection(port.address, 2, source_address=(MANY[-1] if evict else MANY[0], 0)))
        wait_for("the third from one address handled", lambda: handled() >= 10 * cap + 1)
        s = port.stats()
        assert s["refused_per_address"] == 1 and s["active"] == cap, s  # the per-address cap stays a refusal
        t0 = time.perf_counter()
        reply = None
        with socket.create_connection(port.address, 2, source_address=("127.0.0.1", 0)) as honest:
            honest.settimeout(2.0)
            try:
                send_frame(honest, b"honest")
                reply = json.loads(recv_frame(honest))
            except (OSError, ProtocolError):  # refused: closed (or reset) without a reply
                pass
        honest_ms = (time.perf_counter() - t0) * 1000
        s = port.stats()
        print(f"many addresses on a FramePort (evict={evict}): evicted {s['evicted_unserved']}, refused busy "
              f"{s['refused_busy']}, per address {s['refused_per_address']}; honest "
              f"{'answered' if reply else 'refused'} in {honest_ms:.1f} ms; bad requests {s['bad_requests']}")
        if evict:
            assert reply == {"ok": True, "echo": "honest", "peer": "127.0.0.1"} and honest_ms < 2000, reply
            # 72 by the flood, 1 by the honest peer; an evicted connection is no bad request.
            assert s["evicted_unserved"] == 9 * cap + 1 and s["refused_busy"] == 0 and s["bad_requests"] == 0, s
        else:
            assert reply is None, reply
            assert s["evicted_unserved"] == 0 and s["refused_busy"] == 9 * cap + 1, s
        assert s["active_peak"] == cap, s
    finally:
        for c in flood:
            c.close()
        # Everything closed: no slot, address or byte left charged.
        try:
            wait_for("the port's accounting back to 0", lambda: port.stats()["active"] == 0
                     and port.stats()["active_addresses"] == 0 and port.stats()["inflight_bytes"] == 0)
            assert not guard._live and not guard._per_addr and not guard._bytes_per_addr
        finally:
            port.close()
