"""Issue 46, attack 6, on kv_transfer.vllm's decode without vLLM: loads go
out on the control plane (one authenticated connection per prefill,
never waited for on the puller), and only to prefills the deployment
named. Real tcp-sim endpoints, loopback only, every wait bounded."""

from __future__ import annotations

import json
import socket
import time

import kv_transfer
from kv_transfer.peers import ControlPlane
from kv_transfer.vllm import decode, prefill, wire

from test_vllm_offers import PAGES, side


def prefill_worker():
    pep, ppool, _ = side("prefill", ord("k"))
    offers = prefill.PrefillOffers({"tcp-sim": (pep, ppool)})
    plane = ControlPlane("prefill")

    def serve(peer: str, body: bytes) -> bytes:
        req = wire.parse_request(body)
        if isinstance(req, wire.Fetch):
            return json.dumps(offers.claim(req, peer)).encode()
        return json.dumps(offers.release(req, peer)).encode()

    host, port = plane.serve("127.0.0.1", 0, serve)
    return offers, plane, port


def wait_loaded(loads, req_id: str, seconds: float = 10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # bounded in time
        done, bad = loads.poll()
        if req_id in done:
            return not bad
        time.sleep(0.005)
    raise AssertionError(f"{req_id} not loaded in {seconds} s")


def run(named: bool, silent_loads: int):
    offers, pplane, pport = prefill_worker()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts, never answers
    sport = silent.getsockname()[1]
    dep, dpool, dbuf = side("decode", 0)
    dplane = ControlPlane("decode")
    loads = decode.DecodeLoads({"tcp-sim": (dep, dpool)}, dplane, {("127.0.0.1", pport)} if named else None)
    try:
        for i in range(silent_loads):  # ten times the old puller's patience, each naming the silent port
            bogus = wire.Offer(prefill.new_offer_id(), "127.0.0.1", sport, ("tcp-sim",), (1,), 32)
            loads.load(f"silent{i}", [PAGES - 1 - (i % 2)], bogus.to_params())
        oid = prefill.new_offer_id()
        offers.offer("honest", oid, [2])
        t0 = time.perf_counter()
        loads.load("honest", [5], wire.Offer(oid, "127.0.0.1", pport, ("tcp-sim",), (2,), 32).to_params())
        ok = wait_loaded(loads, "honest")
        ms = (time.perf_counter() - t0) * 1000
        assert dbuf.raw[5 * 64:6 * 64] == b"k" * 64
        return ok, ms, loads.counters, dplane.stats()
    finally:
        loads.close()
        dplane.close()
        pplane.close()
        silent.close()


def test_hostile_loads_naming_an_unnamed_prefill_fail_at_once_and_an_honest_load_never_waits_behind_them():
    ok, ms, counters, stats = run(named=True, silent_loads=30)
    print(f"named prefills: honest load in {ms:.1f} ms; {counters}; links {stats.get('links_opened')}")
    assert ok and ms < 1000
    assert counters["refused_unnamed_prefill"] == 30
    assert stats.get("dials") == 1, "the decode dialed something it was not told about"
    # Positive control (any prefill a request names, as before): the decode dials the silent port.
    ok, ms, counters, stats = run(named=False, silent_loads=30)
    print(f"any prefill: honest load in {ms:.1f} ms; dials {stats.get('dials')}")
    assert ok and ms < 1000, "even then the honest load does not wait on the puller"
    assert stats.get("dials") == 2, "positive control: the decode dials the port the requests named"
    assert counters["refused_unnamed_prefill"] == 0


def test_a_posted_read_that_fails_reports_its_blocks_as_bad_and_poll_goes_on():
    """A READ that ends failed (its status ``failed``, ``error`` the
    native Transfer's property saying why) ends the load: its blocks
    reported bad to vLLM, counted, its lease given back, and poll() goes
    on. It used to raise out of poll() (``error`` called as a method),
    which killed vLLM's engine core in the abort storm. The READ is a
    stand-in shaped as the native one: a posted READ that fails at the
    NIC cannot be ordered deterministically through public calls."""

    class FailedRead:
        released = False

        def poll(self) -> str:
            return "failed"

        @property
        def error(self) -> str:
            return "the prefill's NIC refused the READ"

        def release(self) -> None:
            self.released = True

    dep, dpool, _ = side("decode", 0)
    dplane = ControlPlane("decode")
    loads = decode.DecodeLoads({"tcp-sim": (dep, dpool)}, dplane, set())
    try:
        read = FailedRead()
        with loads._lock:
            loads._loads["r"] = decode._Load("r", (3, 4), {}, decode.Posted("tcp-sim", read))
        done, bad = loads.poll()
        assert done == {"r"} and bad == {3, 4}
        assert read.released and loads.counters["load_failures"] == 1
        assert loads.poll() == (set(), set()), "reported once"
    finally:
        loads.close()
        dplane.close()
