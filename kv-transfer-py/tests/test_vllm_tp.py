"""kv_transfer.vllm at tensor parallel > 1, without vLLM: worker ``r`` of a
prefill of TP ``n`` serves its shard of every block on side port
``port + r``, and worker ``r`` of a decode of the same TP pulls its own
shard from it (the same KV heads); a prefill of another TP size is refused,
typed, before any connection."""

from __future__ import annotations

import json
import os
import sys
import time

from kv_transfer.peers import ControlPlane
from kv_transfer.vllm import decode, prefill, wire

from test_hostile_vllm_decode import wait_loaded
from test_vllm_offers import SIZE, side

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests-common"))
from engine_servers import free_ports  # noqa: E402


def prefill_worker(rank: int, port: int, fill: int):
    """Worker ``rank`` of a prefill: its own pool (its shard, every byte
    ``fill``), its offers, its side port."""
    pep, ppool, _ = side(f"prefill-tp{rank}", fill)
    offers = prefill.PrefillOffers({"tcp-sim": (pep, ppool)})
    plane = ControlPlane(f"prefill-tp{rank}")

    def serve(peer: str, body: bytes) -> bytes:
        req = wire.parse_request(body)
        if isinstance(req, wire.Fetch):
            return json.dumps(offers.claim(req, peer)).encode()
        return json.dumps(offers.release(req, peer)).encode()

    plane.serve("127.0.0.1", port, serve)
    return offers, plane


def test_each_decode_worker_pulls_its_own_shard_from_the_prefill_worker_of_its_rank():
    base = free_ports(2)
    workers = [prefill_worker(r, base + r, ord("a") + r) for r in range(2)]
    oid = prefill.new_offer_id()
    for offers, _ in workers:
        offers.offer("req", oid, [2, 3])  # every worker learns of the offer from the same step's metadata
    offer = wire.Offer(oid, "127.0.0.1", base, ("tcp-sim",), (2, 3), 64, tp=2).to_params()
    decodes = []
    try:
        for r in range(2):
            dep, dpool, dbuf = side(f"decode-tp{r}", 0)
            plane = ControlPlane(f"decode-tp{r}")
            loads = decode.DecodeLoads({"tcp-sim": (dep, dpool)}, plane, {("127.0.0.1", base)}, rank=r, tp=2)
            decodes.append((loads, plane, dbuf))
            loads.load("req", [5, 6], dict(offer))
        for r, (loads, plane, dbuf) in enumerate(decodes):
            assert wait_loaded(loads, "req"), loads.counters
            assert dbuf.raw[5 * SIZE:7 * SIZE] == bytes([ord("a") + r]) * (2 * SIZE), f"worker {r} read another shard"
            assert plane.stats().get("dials") == 1
        # Each prefill worker's blocks go back to vLLM only on its own decode worker's proof.
        for r, (offers, _) in enumerate(workers):
            deadline = time.monotonic() + 10
            got: set = set()
            while not got and time.monotonic() < deadline:  # bounded in time
                offers.finished({"req"})
                got = offers.poll()
                time.sleep(0.005)
            assert got == {"req"}, f"prefill worker {r}"
    finally:
        for loads, plane, _ in decodes:
            loads.close()
            plane.close()
        for _, plane in workers:
            plane.close()


def test_a_prefill_of_another_tp_size_is_refused_typed_before_any_connection():
    dep, dpool, _ = side("decode-tp1", 0)
    plane = ControlPlane("decode-tp1")
    loads = decode.DecodeLoads({"tcp-sim": (dep, dpool)}, plane, {("127.0.0.1", 5700)}, rank=0, tp=1)
    try:
        offer = wire.Offer(prefill.new_offer_id(), "127.0.0.1", 5700, ("tcp-sim",), (2,), 32, tp=2)
        loads.load("req", [4], offer.to_params())
        done, bad = loads.poll()
        assert done == {"req"} and bad == {4}, "failed at once, its block a load error"
        assert loads.counters["refused_tp_mismatch"] == 1
        assert plane.stats().get("dials", 0) == 0
        # An offer without kvt_tp is a one-worker prefill's (older offers).
        params = wire.Offer(prefill.new_offer_id(), "127.0.0.1", 5700, ("tcp-sim",), (2,), 32).to_params()
        del params["kvt_tp"]
        assert wire.parse_offer(params).tp == 1
    finally:
        loads.close()
        plane.close()
