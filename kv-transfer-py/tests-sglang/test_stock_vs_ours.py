"""SGLang's stock path against kvtransfer, each as three real servers: a
prefill whose sends a test can hold, a second prefill, and a decode with a
small KV pool (so freed pages are soon handed out again) and SGLang's
deferred-release deadline shortened to 1 s.

- ``stock``: the in-tree ``mooncake`` backend over Mooncake TCP.
- ``ours``: ``kvtransfer`` on kv_transfer's mooncake backend (TCP).

The tests: the abort storm (ours); the hazard, the same schedule on each
(stock: the positive control, a later request decodes the aborted one's
late KV; ours: identical tokens); the cost, the same requests through both
in one run."""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Dict, List, Tuple

import pytest
from engine_servers import percentile

import harness as h

#: SGLang's deferred decode KV release deadline on these decodes (default 30 s).
RELEASE_TIMEOUT_S = 1.0
#: Decode pool, in tokens. A (200 tokens) leaves fewer unsorted free pages
#: than B1 (96) needs, so SGLang's decode allocator sorts its free pages
#: for B1 and hands it the lowest ones: the pages A's abort freed.
DECODE_TOKENS = 256
HAZARD_NEW = 120


def _trio(tag: str, model: str, transfer: str):
    ps, d = h.disaggregated(
        tag, model, transfer, prefills=2, decode_tokens=DECODE_TOKENS,
        decode_env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT_S)},
        decode_extra=["--num-reserved-decode-tokens", "16"])
    try:
        h.start_all(ps + [d])
        yield ps[0], ps[1], d
    finally:
        h.stop_all(ps + [d])


@pytest.fixture(scope="module")
def ours(model: str):
    yield from _trio("ours", model, "kvtransfer:mooncake")


@pytest.fixture(scope="module")
def stock(model: str):
    yield from _trio("stock", model, "stock-mooncake")


def _diverges(got: List[int], want: List[int]) -> str:
    i = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), None)
    if i is None and len(got) == len(want):
        return f"the single server's {len(want)} tokens"
    return f"{len(got)} tokens, the first differs from the single server's at {i}"


def _prefix_of(tokens: List[int], ref: List[int]) -> bool:
    return tokens == ref[: len(tokens)]


# --- the abort storm -----------------------------------------------------------


def _storm_one(trio, prompt: List[int], ref: List[int], rnd: random.Random) -> Tuple[str, bool, str]:
    """One request of the storm: (outcome, tokens consistent with the
    single server, detail)."""
    p, p2, d = trio
    pre = p if rnd.random() < 0.5 else p2
    kind = rnd.choices(["plain", "abort_early", "abort_in_flight", "disconnect_decoding", "abort_decoding"],
                       [40, 10, 20, 15, 15])[0]
    new = 24
    if kind == "plain":
        r = h.pd_generate(pre, d, prompt, new)
        if r["tokens"] is None:
            return "failed", True, str(r["error"])
        return ("ok" if len(r["tokens"]) == new else "short"), r["tokens"] == ref[:new], kind
    if kind in ("abort_early", "abort_in_flight"):
        # Early: before the decode bootstrapped with the prefill. In flight:
        # the prefill's send held (at most 0.3-1.5 s) while the decode aborts.
        hold = 0.0 if kind == "abort_early" else rnd.uniform(0.3, 1.5)
        room = h.room(hold_s=hold) if hold else h.room()
        rid = h.new_rid()
        out: Dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(h.pd_generate(pre, d, prompt, new, room_id=room, rid=rid)))
        t.start()
        time.sleep(rnd.uniform(0.0, 0.02) if kind == "abort_early" else rnd.uniform(0.05, hold))
        d.abort(rid)
        if rnd.random() < 0.5:
            pre.abort(rid)
        t.join(90)
        toks = out.get("tokens")
        if toks and len(toks) == new:
            return "ok", toks == ref[:new], kind + " (finished first)"
        return "aborted", toks is None or _prefix_of(toks, ref), kind
    s = h.PdStream(pre, d, prompt, 64, h.room())
    try:
        s.read(rnd.randint(1, 12))
        if kind == "disconnect_decoding":
            s.disconnect()
            return "disconnected", _prefix_of(s.tokens, ref), kind
        d.abort(s.rid)
        s.read()
        return ("ok" if len(s.tokens) == 64 else "aborted"), _prefix_of(s.tokens, ref), kind
    finally:
        s.join()


def test_abort_storm_completed_requests_keep_their_tokens_and_pools_come_back_whole(ours, prompts, reference, report):
    p, p2, d = ours
    rnd = random.Random(31)
    pool = prompts["varied"]
    idle = [s.wait_idle() for s in (p, p2, d)]
    assert all(x["num_used_tokens"] == 0 for x in idle), idle
    jobs = [(pool[rnd.randrange(len(pool))], random.Random(1000 + i)) for i in range(200)]
    t0 = time.monotonic()
    got = h.run_parallel(lambda j: _storm_one(ours, j[0], reference[tuple(j[0])], j[1]), jobs, width=8, timeout=600)
    took = time.monotonic() - t0
    errors = [g for g in got if isinstance(g, Exception)]
    assert not errors, errors[:3]
    outcome: Dict[str, int] = {}
    for o, _, _ in got:
        outcome[o] = outcome.get(o, 0) + 1
    wrong = [(o, k) for o, good, k in got if not good]
    after = [s.wait_idle(90) for s in (p, p2, d)]
    report(f"abort storm (kvtransfer on mooncake, 200 requests, 8 in flight, {took:.0f} s): "
           + ", ".join(f"{k} {v}" for k, v in sorted(outcome.items()))
           + f"; tokens not the single server's: {len(wrong)}; num_used_tokens after: "
           + ", ".join(str(x["num_used_tokens"]) for x in after))
    assert not wrong, wrong[:10]
    assert outcome.get("ok", 0) >= 60, outcome
    for x in after:
        assert x["num_used_tokens"] == 0 and x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0, x
        assert not any(v for k, v in (x.get("disaggregation") or {}).items() if k.endswith("_reqs")), x
    # Nothing is stuck: a new request goes through both prefills.
    for pre in (p, p2):
        assert h.pd_generate(pre, d, pool[-1], 24)["tokens"] == reference[tuple(pool[-1])][:24]


# --- the hazard ------------------------------------------------------------------


def _hazard(trio, prompts, reference) -> Dict[str, Any]:
    """Request A through the first prefill, its send held; the decode
    aborts A; SGLang's deadline passes; B1 comes through the second prefill
    and starts decoding (B2 waits for pool space); then A's send goes on.
    Returns B's tokens and the references."""
    p, p2, d = trio
    a, b1, b2 = prompts["hazard"]
    assert d.wait_idle()["num_used_tokens"] == 0
    ra, rid = h.room(hold_s=9.0), h.new_rid()
    out: Dict[str, Any] = {}
    # Only the decode is aborted: the prefill hears of it only through the
    # transfer backend (stock: mooncake's abort notification; ours: the
    # drain protocol), not from a router.
    ta = threading.Thread(
        target=lambda: out.update(h.pd_generate(p, d, a, 8, room_id=ra, rid=rid, abort_prefill=False)))
    ta.start()
    assert p.wait_log(f"kvt-test-hook: held room {ra}", 20), p.tail()
    d.abort(rid)
    time.sleep(RELEASE_TIMEOUT_S + 1.0)
    bs = [h.PdStream(p2, d, b, HAZARD_NEW, h.room()) for b in (b1, b2)]
    bs[0].read(2)  # B1 decodes: its KV arrived
    h.release_hold(ra)
    assert p.wait_log(f"kvt-test-hook: late send room {ra}", 20), p.tail()
    for s in bs:
        s.read()
        s.join()
    ta.join(70)
    assert [len(s.tokens) for s in bs] == [HAZARD_NEW, HAZARD_NEW], [len(s.tokens) for s in bs]
    return {"got": [s.tokens for s in bs], "want": [reference[tuple(b)][:HAZARD_NEW] for b in (b1, b2)],
            "a": out, "idle": d.wait_idle(30)}


def test_positive_control_stock_mooncake_frees_on_its_timer_and_a_later_request_decodes_foreign_kv(stock, prompts,
                                                                                                    reference, report):
    r = _hazard(stock, prompts, reference)
    report("hazard, stock mooncake: B1 " + _diverges(r["got"][0], r["want"][0]) + "; B2 "
           + _diverges(r["got"][1], r["want"][1]))
    _, _, d = stock
    # SGLang freed A's pages on its timer, without the prefill's drain ack.
    assert d.count_in_log("without a full drain ack from prefill; releasing anyway") >= 1, d.tail()
    assert any(g != w for g, w in zip(r["got"], r["want"])), (
        "stock mooncake's later requests decoded the right tokens: the positive control is blind")


def test_hazard_ours_same_schedule_identical_tokens(ours, prompts, reference, report):
    r = _hazard(ours, prompts, reference)
    report("hazard, kvtransfer: B1 " + _diverges(r["got"][0], r["want"][0]) + "; B2 "
           + _diverges(r["got"][1], r["want"][1]))
    p, _, d = ours
    assert r["got"] == r["want"], [_diverges(g, w) for g, w in zip(r["got"], r["want"])]
    # A's late send was attempted (and refused: its exposure was revoked
    # when the decode aborted; B's pages are a new tenancy).
    assert p.count_in_log("late send room") >= 1
    # SGLang's deadline passed, but nothing was released on it.
    assert d.count_in_log("releasing anyway") == 0, d.tail()
    assert r["idle"]["num_used_tokens"] == 0, r["idle"]


# --- the cost --------------------------------------------------------------------


def test_cost_time_to_first_token_and_latency_against_stock_mooncake(stock, ours, prompts, reference, report):
    pool = prompts["varied"]
    new = 32
    samples: Dict[str, Dict[str, List[float]]] = {k: {"ttft": [], "total": []} for k in ("stock", "ours")}
    paths = {"stock": stock, "ours": ours}

    def once(name: str, pr: List[int]) -> Tuple[float, float]:
        _, p2, d = paths[name]
        s = h.PdStream(p2, d, pr, new, h.room())
        toks = s.read()
        total = time.perf_counter() - s.t0
        s.join()
        assert toks == reference[tuple(pr)][:new], (name, len(pr))
        return s.first_token_s, total

    for pr in pool:  # warm both paths (connections, caches)
        once("stock", pr)
        once("ours", pr)
    # Alternating, one request in flight, the same prompts in the same order.
    for rnd in range(5):
        for pr in pool:
            for name in ("stock", "ours") if rnd % 2 == 0 else ("ours", "stock"):
                ttft, total = once(name, pr)
                samples[name]["ttft"].append(ttft)
                samples[name]["total"].append(total)
    rows = {}
    for metric in ("ttft", "total"):
        for q, label in ((0.5, "median"), (0.99, "p99")):
            theirs = percentile(samples["stock"][metric], q)
            mine = percentile(samples["ours"][metric], q)
            rows[(metric, label)] = (mine, theirs, mine / theirs)
    report("cost (SGLang, stock mooncake TCP vs kvtransfer on mooncake TCP, 40 requests each, alternating):",
           "| metric | ours (ms) | stock mooncake (ms) | ours / stock |", "| --- | --- | --- | --- |",
           *(f"| {m} {l} | {a * 1e3:.1f} | {b * 1e3:.1f} | {c:.2f} |" for (m, l), (a, b, c) in rows.items()))
    # The goal is <= 1.0 (README); the assertion only catches a gross regression on a noisy machine.
    assert rows[("total", "median")][2] < 2.0, rows
