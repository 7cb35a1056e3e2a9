"""kv_transfer.vllm's state machines without vLLM (in-process, tcp-sim, a
virtual clock): an offer is exposed only to the decode that claims it, is
freed only by a proof (the decode's DONE, or the backend's drain after an
abort), never by its deadline; bad input is a typed error that changes
nothing. The real-vLLM tests (``scripts/vllm-tests``) prove the same with
vLLM's scheduler around it."""

from __future__ import annotations

import ctypes
import time

import pytest

import kv_transfer
from kv_transfer.frames import ProtocolError
from kv_transfer.vllm import prefill, wire

PAGES, SIZE = 8, 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def side(name: str, fill: int):
    buf = ctypes.create_string_buffer(PAGES * SIZE)
    ctypes.memset(buf, fill, PAGES * SIZE)
    ep = kv_transfer.Endpoint("tcp-sim", f"{name}-{id(buf)}")
    return ep, ep.register([(ctypes.addressof(buf), PAGES * SIZE, SIZE)], owner=buf), buf


def rig(**limits):
    clock = Clock()
    pep, ppool, _ = side("prefill", ord("k"))
    dep, dpool, dbuf = side("decode", 0)
    offers = prefill.PrefillOffers({"tcp-sim": (pep, ppool)}, prefill.OfferLimits(**limits), clock=clock)
    dep.add_peer(pep.descriptor())
    return offers, clock, (pep, ppool), (dep, dpool, dbuf)


def fetch(offer: str, dep, pages: int, skip: int = 0) -> wire.Fetch:
    return wire.parse_request(wire.fetch_request(offer, "tcp-sim", dep.descriptor(), pages, skip))


def claimed(offers, offer_id: str, dep, pages: int, skip: int = 0):
    reply = offers.claim(fetch(offer_id, dep, pages, skip), "decode")
    assert reply["ok"], reply
    import base64

    return kv_transfer.RemotePages.from_bytes(base64.b64decode(reply["remote"]))


def poll_until(offers, want: str, seconds: float = 10.0) -> set:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = offers.poll()
        if got:
            assert got == {want}
            return got
        time.sleep(0.005)
    return set()


GOOD = wire.Offer("ab" * 16, "127.0.0.1", 5700, ("tcp-sim",), (3, 4), 40).to_params()


@pytest.mark.parametrize(
    "change",
    [
        {"kvt_offer": "AB" * 16},
        {"kvt_offer": "ab" * 15},
        {"kvt_offer": 7},
        {"kvt_host": ""},
        {"kvt_host": "a b"},
        {"kvt_port": 0},
        {"kvt_port": 1 << 16},
        {"kvt_port": -1},
        {"kvt_backends": []},
        {"kvt_backends": ["Mooncake"]},
        {"kvt_backends": ["x"] * 9},
        {"remote_block_ids": [1, 1]},
        {"remote_block_ids": [-1]},
        {"remote_block_ids": [True]},
        {"remote_block_ids": "3,4"},
        {"remote_num_tokens": "40"},
        {"kvt_tp": 0},
        {"kvt_tp": 257},
        {"kvt_tp": "2"},
        {"kvt_port": 65535, "kvt_tp": 2},
    ],
)
def test_bad_offer_params_are_a_params_error(change):
    params = dict(GOOD, **change)
    with pytest.raises(wire.ParamsError):
        wire.parse_offer(params)
    assert isinstance(wire.ParamsError("x"), kv_transfer.DescriptorError)


def test_good_offer_params_round_trip():
    o = wire.parse_offer(GOOD)
    assert (o.offer, o.port, tuple(o.blocks), o.tokens) == ("ab" * 16, 5700, (3, 4), 40)


@pytest.mark.parametrize(
    "frame",
    [b"", b"[]", b"{}", b'{"op": "fetch"}', b'{"op": "steal", "offer": "' + b"ab" * 16 + b'"}',
     b'{"op": "release", "offer": "xyz"}', b'{"op": "fetch", "offer": "' + b"ab" * 16
     + b'", "backend": "tcp-sim", "descriptor": "", "pages": 1}', b"\xff" * 64],
)
def test_bad_side_frames_are_protocol_errors(frame):
    with pytest.raises(ProtocolError):
        wire.parse_request(frame)


def test_an_offer_is_exposed_once_to_the_claimant_and_freed_only_by_its_done():
    offers, clock, _, (dep, dpool, dbuf) = rig(unclaimed_s=5, exposed_s=5)
    oid = prefill.new_offer_id()
    offers.offer("req-1", oid, [2, 5])
    offers.finished(["req-1"])
    assert offers.claim(fetch(oid, dep, 3), "decode") == wire.refused(
        "pages", "the decode asks for 3 blocks after 0, the offer has 2")
    assert offers.claim(fetch("cd" * 16, dep, 2), "decode")["error"] == "unknown_offer"
    remote = claimed(offers, oid, dep, 2)
    assert offers.claim(fetch(oid, dep, 2), "decode")["error"] == "claimed"
    # Exposed and not read: the unclaimed deadline does not apply, nothing is reported.
    clock.now += 4
    assert offers.poll() == set() and offers.held()["exposed"] == 1
    t = dep.read(dpool.reserve([0, 1]), remote)
    assert t.wait(10.0) == "success", t.error
    t.take_lease().release()
    assert poll_until(offers, "req-1") == {"req-1"}
    assert offers.counters["settled_by_done"] == 1 and offers.counters["aborted"] == 0
    assert dbuf.raw[: 2 * SIZE] == b"k" * (2 * SIZE)
    assert offers.poll() == set()  # reported once


def test_an_exposed_offer_past_its_deadline_is_aborted_and_held_until_drained_never_freed_by_the_timer():
    offers, clock, (_, ppool), (dep, _, _) = rig(unclaimed_s=5, exposed_s=5)
    oid = prefill.new_offer_id()
    offers.offer("req-2", oid, [1])
    offers.finished(["req-2"])
    claimed(offers, oid, dep, 1)  # the decode never reads
    clock.now += 6
    assert offers.poll() == set()
    assert offers.held()["draining"] == 1 and offers.counters["aborted"] == 1
    # Not given back to vLLM by the deadline. (The pool's slot itself may
    # already be free here: the decode's endpoint can answer the ABORT within
    # microseconds, and that answer is the proof, not the timer.)
    # The decode's endpoint answers the ABORT (nothing in flight): the drain is the proof.
    assert poll_until(offers, "req-2") == {"req-2"}
    assert offers.counters["drained"] == 1 and ppool.is_free(1)


def test_a_waiting_offer_is_withdrawn_at_its_deadline_or_on_release_and_reported_only_once_vllm_finished_it():
    offers, clock, _, (dep, _, _) = rig(unclaimed_s=5, exposed_s=5)
    late, released = prefill.new_offer_id(), prefill.new_offer_id()
    offers.offer("late", late, [1])
    offers.offer("released", released, [2])
    assert offers.release(wire.Release(released), "decode") == wire.ok()
    assert offers.poll() == set()  # vLLM has not named it in finished_req_ids yet
    offers.finished(["released"])
    assert offers.poll() == {"released"}
    offers.finished(["late"])
    clock.now += 6
    assert offers.poll() == {"late"} and offers.counters["withdrawn"] == 1
    # The late decode gets a typed refusal, not someone else's blocks.
    assert offers.claim(fetch(late, dep, 1), "decode")["error"] == "unknown_offer"
    assert offers.release(wire.Release(late), "decode") == wire.ok()  # idempotent


def test_the_peer_table_is_bounded_per_proven_name():
    offers, _, _, _ = rig(max_peers_per_name=2)
    for i in range(3):
        oid = prefill.new_offer_id()
        offers.offer(f"r{i}", oid, [i])
        dep, _, _ = side(f"d{i}", 0)
        reply = offers.claim(fetch(oid, dep, 1), "one-decode")
        assert reply["ok"] is (i < 2), reply
    assert reply["error"] == "peer"
    assert offers.held()["waiting"] == 1  # the refused claim exposed nothing
    assert offers.peers() == 2


def test_hostile_claims_that_cannot_be_served_buy_no_peer_entry_and_entries_go_with_their_last_offer():
    """Issue 46, attack 5: claims whose blocks cannot be reserved, from 16
    descriptor spellings, used to enter the peer table for good. Checked:
    the blocks are reserved first, so such a claim buys no entry; an entry
    goes when its last offer is freed, so the table does not fill."""
    offers, clock, (_, ppool), (dep, _, _) = rig(max_peers=4, exposed_s=1)
    busy = ppool.reserve([7])  # block 7 is busy in the prefill's pool: no claim of it can be served
    spellings = [side(f"spell{i}", 0)[0] for i in range(16)]  # 4x the table's cap in descriptors
    for i, ep in enumerate(spellings):
        oid = prefill.new_offer_id()
        offers.offer(f"busy{i}", oid, [7])
        assert offers.claim(fetch(oid, ep, 1), "attacker")["error"] == "busy"
    assert offers.peers() == 0, "a claim that reserved nothing bought an entry"
    busy.release()
    # Served claims: each entry lives while its offer does.
    for round_ in range(3):
        oid = prefill.new_offer_id()
        offers.offer(f"ok{round_}", oid, [round_])
        offers.finished([f"ok{round_}"])
        claimed(offers, oid, dep, 1)
        assert offers.peers() == 1
        clock.now += 2  # never read: aborted at its deadline, drained
        assert poll_until(offers, f"ok{round_}") == {f"ok{round_}"}
        assert offers.peers() == 0, "the entry outlived its last offer"


def test_hostile_only_the_claimant_releases_an_exposed_offer():
    """Issue 46, attack 5: anyone holding an offer id could release it,
    aborting the claimant's exposure. Checked: another peer's release is
    refused and counted, the exposure stays; the claimant's aborts it."""
    offers, _, _, (dep, _, _) = rig()
    oid = prefill.new_offer_id()
    offers.offer("r", oid, [3])
    claimed(offers, oid, dep, 1)
    assert offers.release(wire.Release(oid), "someone-else")["error"] == "not_claimant"
    assert offers.held()["exposed"] == 1 and offers.counters["refused_releases"] == 1
    assert offers.release(wire.Release(oid), "decode") == wire.ok()
    assert offers.held()["draining"] == 1


def test_a_decode_with_a_prefix_hit_is_exposed_only_the_blocks_it_lacks():
    """The decode's prefix cache holds the prompt's first blocks: it asks
    for the offer's tail only; the blocks it skips are never exposed and go
    back to vLLM with the offer, on the DONE of the tail."""
    offers, _, (_, ppool), (dep, dpool, dbuf) = rig(unclaimed_s=5, exposed_s=5)
    oid = prefill.new_offer_id()
    offers.offer("req-1", oid, [2, 5, 6])
    offers.finished(["req-1"])
    for pages, skip in ((0, 3), (2, 2), (3, 1)):
        assert offers.claim(fetch(oid, dep, pages, skip), "decode")["error"] == "pages", (pages, skip)
    remote = claimed(offers, oid, dep, 1, skip=2)
    assert remote.pages == 1
    # The skipped blocks were never exposed: they are free in the pool.
    ppool.reserve([2, 5]).release()
    t = dep.read(dpool.reserve([0]), remote)
    assert t.wait(10.0) == "success", t.error
    t.take_lease().release()
    assert poll_until(offers, "req-1") == {"req-1"}
    assert offers.counters["settled_by_done"] == 1


def test_a_claim_on_a_block_another_offer_has_exposed_is_refused_busy_until_that_one_is_proven():
    """Two requests sharing a cached prefix share its blocks in the
    prefill: one exposure per block at a time, the other claim is refused
    ``busy`` (the decode asks again) until the first one's DONE."""
    offers, _, _, (dep, dpool, _) = rig(unclaimed_s=5, exposed_s=5)
    a, b = prefill.new_offer_id(), prefill.new_offer_id()
    offers.offer("req-a", a, [2, 3])
    offers.offer("req-b", b, [2, 4])
    offers.finished(["req-a", "req-b"])
    remote = claimed(offers, a, dep, 2)
    assert offers.claim(fetch(b, dep, 2), "decode")["error"] == "busy"
    t = dep.read(dpool.reserve([0, 1]), remote)
    assert t.wait(10.0) == "success", t.error
    t.take_lease().release()
    assert poll_until(offers, "req-a") == {"req-a"}
    assert claimed(offers, b, dep, 2).pages == 2
