"""kv_transfer.vllm in real vLLM API servers (the CPU build, the tiny model,
greedy decoding), compared token for token with a single instance.

Servers: a single instance (references only, stopped once they are taken),
a prefill/decode pair with our connector serving every backend (the decode
request picks one: ``kvt_backends``), and, for the positive control and the
cost comparison, a pair with vLLM's own NixlConnector. Pools are small (a
few requests' worth of blocks) so that freed blocks are reused at once: a
block freed too early is soon another request's.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import pytest
from engine_servers import percentile

import harness as h

BACKENDS = ["tcp-sim", "mooncake", "nixl"]
LENGTHS = [1, 2, 7, 31, 32, 33, 64, 97, 150, 200]
NEW = 16
BLOCKS = 48
#: NixlConnector's lease in the positive control (vLLM's default is 30 s).
LEASE_S = 6
HOLD_S = LEASE_S + 5
#: Our prefill withdraws an offer nobody claimed after this (its blocks never exposed):
#: longer than the hold, shorter than the storm's wait for the offers it never forwards.
UNCLAIMED_S = 25
CONTROLLED = dict(connector="ControlledConnector", module="kvt_test_connectors")


class Fleet:
    def __init__(self) -> None:
        self.refs: Dict[tuple, List[int]] = {}
        self.servers: List[h.Server] = []
        self.p: Optional[h.Server] = None
        self.d: Optional[h.Server] = None
        self.p_side = self.d_side = 0
        self.np: Optional[h.Server] = None
        self.nd: Optional[h.Server] = None
        self.rd: Optional[h.Server] = None
        self.rd_side = 0
        self.cd: Optional[h.Server] = None

    def recompute_decode(self) -> h.Server:
        """A second decode of ours whose load failures vLLM recomputes
        (``kv_load_failure_policy: recompute``; the fleet's decode keeps
        vLLM's default, ``fail``)."""
        if self.rd is None:
            assert self.p is not None
            self.rd_side = h.free_port()
            kv = h.ours("kv_consumer", self.rd_side, ",".join(BACKENDS), prefills=[f"127.0.0.1:{self.p_side}"],
                        **CONTROLLED)
            kv["kv_load_failure_policy"] = "recompute"
            self.rd = h.Server("decode-recompute", h.MODEL_NAME[0], kv, 1, BLOCKS)
            self.servers.append(self.rd)
            h.start_all([self.rd])
        return self.rd

    def cost_decode(self) -> h.Server:
        """A decode of ours with the connector as it ships (no test hooks:
        its READs are posted from vLLM's own poll), for the cost table."""
        if self.cd is None:
            assert self.p is not None
            kv = h.ours("kv_consumer", h.free_port(), ",".join(BACKENDS), prefills=[f"127.0.0.1:{self.p_side}"])
            self.cd = h.Server("decode-cost", h.MODEL_NAME[0], kv, 1, BLOCKS)
            self.servers.append(self.cd)
            h.start_all([self.cd])
        return self.cd

    def nixl_pair(self) -> None:
        if self.np is None:
            self.np = h.Server("nixl-prefill", h.MODEL_NAME[0], h.nixl("kv_producer", LEASE_S), 0, BLOCKS,
                               env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port())})
            self.nd = h.Server("nixl-decode", h.MODEL_NAME[0], h.nixl("kv_consumer", LEASE_S), 1, BLOCKS,
                               env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port())})
            self.servers += [self.np, self.nd]
            h.start_all([self.np, self.nd])


@pytest.fixture(scope="module")
def fleet(model: str, vocab: int):
    f = Fleet()
    f.p_side, f.d_side = h.free_port(), h.free_port()
    backends = ",".join(BACKENDS)
    single = h.Server("single", model, None, 0, BLOCKS)
    f.p = h.Server("prefill", model, h.ours("kv_producer", f.p_side, backends, unclaimed_s=UNCLAIMED_S), 0, BLOCKS)
    f.d = h.Server("decode", model, h.ours("kv_consumer", f.d_side, backends, prefills=[f"127.0.0.1:{f.p_side}"],
                                           **CONTROLLED), 1, BLOCKS)
    f.servers = [single, f.p, f.d]
    try:
        h.start_all(f.servers)
        for pr in all_prompts(vocab):
            f.refs[tuple(pr)] = h.complete(single.port, pr, NEW)["tokens"]
        single.stop()
        yield f
    finally:
        for s in f.servers:
            s.stop()


def all_prompts(vocab: int) -> List[List[int]]:
    return h.prompts(vocab, LENGTHS, seed=7) + fillers(vocab)


def fillers(vocab: int) -> List[List[int]]:
    return h.prompts(vocab, [300] * 4, seed=11)


def pd(f: Fleet, prompt: List[int], backend: str, p: Optional[h.Server] = None, d: Optional[h.Server] = None,
       **test: Any) -> List[int]:
    """One disaggregated request: prefill (1 token, held for a decode), then decode."""
    p, d = p or f.p, d or f.d
    params = h.complete(p.port, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert params, "the prefill returned no kv_transfer_params"
    if "kvt_offer" in params:
        params["kvt_backends"] = [backend]
    params.update(test)
    return h.complete(d.port, prompt, NEW, params)["tokens"]


def pools_whole(f: Fleet, timeout: float = 60.0) -> None:
    """vLLM's own KV usage back to 0 on both, and our pools free, nothing stuck."""
    for s in (f.p, f.d):
        h.wait_until(f"{s.name}: vllm:kv_cache_usage_perc == 0", lambda: s.metric("vllm:kv_cache_usage_perc") == 0.0,
                     timeout)
    for port in (f.p_side, f.d_side):
        st = h.side_stats(port)
        for b in BACKENDS:
            assert st[b]["quarantine_stuck"] == 0, st
            assert st[b]["free"] == st[b]["capacity"], (b, st[b])
    st = h.side_stats(f.p_side)
    assert st["offers_waiting_now"] == st["offers_exposed_now"] == st["offers_draining_now"] == 0, st


# --- 1. same tokens ---------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_disaggregated_greedy_tokens_equal_a_single_instance(fleet: Fleet, vocab: int, backend: str):
    prompts = h.prompts(vocab, LENGTHS, seed=7)
    got = {len(pr): pd(fleet, pr, backend) for pr in prompts}
    want = {len(pr): fleet.refs[tuple(pr)] for pr in prompts}
    assert got == want
    pools_whole(fleet)


def test_negative_control_corrupted_kv_changes_the_tokens(fleet: Fleet, vocab: int):
    prompts = h.prompts(vocab, LENGTHS, seed=7)
    differ = [len(pr) for pr in prompts if pd(fleet, pr, "tcp-sim", kvt_test_corrupt=True) != fleet.refs[tuple(pr)]]
    # A 1-token prompt's KV is recomputed by the decode (it loads nothing it uses).
    assert len(differ) >= len(prompts) - 2, f"only prompts of lengths {differ} differ: the comparison is blind"
    pools_whole(fleet)


def test_metrics_operators_scrape_move_with_the_transfers(fleet: Fleet, vocab: int):
    """vLLM's /metrics carries our series (NixlConnector's meanings under
    ``vllm:kvt_``): a decode's transfers, bytes and descriptors, and the
    prefill's proofs; the safety gauges are there and end at 0."""
    prompts = [pr for pr in h.prompts(vocab, LENGTHS, seed=7) if len(pr) in (33, 97, 150)]

    def scrape():
        return {"xfers": fleet.d.metric("vllm:kvt_xfer_time_seconds_count"),
                "bytes": fleet.d.metric("vllm:kvt_bytes_transferred_sum"),
                "descs": fleet.d.metric("vllm:kvt_num_descriptors_sum"),
                "claims": fleet.d.metric("vllm:kvt_claim_time_seconds_count"),
                "claim_s": fleet.d.metric("vllm:kvt_claim_time_seconds_sum"),
                "proofs": fleet.p.metric("vllm:kvt_num_proofs_completed_total")}

    def scrape_or_zero():
        try:
            return scrape()
        except KeyError:  # a series appears with its first observation
            return {"xfers": 0.0, "bytes": 0.0, "descs": 0.0, "claims": 0.0, "claim_s": 0.0, "proofs": 0.0}

    before = scrape_or_zero()
    for pr in prompts:
        assert pd(fleet, pr, "mooncake") == fleet.refs[tuple(pr)]
    # vLLM publishes connector stats with its step outputs: bounded wait.
    h.wait_until("the transfers on /metrics", lambda: scrape_or_zero()["xfers"] - before["xfers"] >= len(prompts), 30)
    h.wait_until("the proofs on /metrics", lambda: scrape_or_zero()["proofs"] - before["proofs"] >= len(prompts), 30)
    after = scrape()
    assert after["bytes"] > before["bytes"] and after["descs"] > before["descs"], (before, after)
    # Every load's claim (vLLM's ask to the prefill's exposure) timed.
    assert after["claims"] - before["claims"] == after["xfers"] - before["xfers"], (before, after)
    assert after["claim_s"] > before["claim_s"], (before, after)
    pools_whole(fleet)
    for s in (fleet.p, fleet.d):
        for name in ("vllm:kvt_num_failed_transfers_total", "vllm:kvt_num_kv_expired_reqs_total"):
            s.metric(name)  # present (0 or more): a dashboard's series exist
    print(f"/metrics: {after}")


def test_load_failure_fails_the_request_under_fail_and_gives_equal_tokens_under_recompute(fleet: Fleet, vocab: int):
    """A load that fails after its offer was claimed (exposed at the
    prefill), before its READ (``kvt_test_fail_read``): under vLLM's
    default policy (``fail``) the request ends in an error, under
    ``recompute`` vLLM recomputes the blocks and the tokens are the single
    instance's; neither decode ever decodes on unread blocks, and every
    block comes back by proof on both sides."""
    prompts = [pr for pr in h.prompts(vocab, LENGTHS, seed=7) if len(pr) in (33, 97)]
    rd = fleet.recompute_decode()
    for d, side in ((fleet.d, fleet.d_side), (rd, fleet.rd_side)):
        failures = h.side_stats(side)["loads_load_failures"]
        for pr in prompts:
            params = h.complete(fleet.p.port, pr, 1, {"do_remote_decode": True})["kv_transfer_params"]
            params.update(kvt_backends=["tcp-sim"], kvt_test_fail_read=True)
            try:
                r = h.complete(d.port, pr, NEW, params)
            except RuntimeError as e:  # vLLM may answer an errored request with an HTTP error
                r = {"tokens": [], "finish": f"http: {e}"}
            if d is rd:
                assert r["tokens"] == fleet.refs[tuple(pr)], (len(pr), r["finish"])
            else:
                assert r["finish"] not in ("length", "stop"), f"decoded on unread blocks: {r}"
        assert h.side_stats(side)["loads_load_failures"] - failures == len(prompts)
    pools_whole(fleet)
    st = h.side_stats(fleet.rd_side)
    assert st["tcp-sim"]["quarantine_stuck"] == 0 and st["tcp-sim"]["free"] == st["tcp-sim"]["capacity"], st
    h.wait_until("decode-recompute: vllm:kv_cache_usage_perc == 0",
                 lambda: rd.metric("vllm:kv_cache_usage_perc") == 0.0, 60)


# --- 2. abort storm ---------------------------------------------------------------


def test_abort_storm_completed_requests_keep_their_tokens_and_pools_come_back_whole(fleet: Fleet, vocab: int, report):
    prompts = h.prompts(vocab, LENGTHS, seed=7)
    rng = random.Random(2026)
    plan = [(i, rng.choice(prompts), rng.choice(BACKENDS), rng.choice(
        ["complete", "complete", "drop_prefill", "late_decode", "abort_in_pull", "abort_in_decode", "never_decode"]),
        rng.random()) for i in range(200)]
    outcome: Dict[str, int] = {}
    wrong: List[Any] = []
    lock = threading.Lock()

    def one(item) -> None:
        i, pr, backend, kind, u = item
        try:
            if kind == "drop_prefill":  # the client gives up during the prefill
                try:
                    h.complete(fleet.p.port, pr, 1, {"do_remote_decode": True}, timeout=0.002 + 0.02 * u)
                except OSError:
                    pass
                res = "dropped"
            else:
                params = h.complete(fleet.p.port, pr, 1, {"do_remote_decode": True})["kv_transfer_params"]
                params["kvt_backends"] = [backend]
                if kind == "never_decode":  # the proxy never forwards it (the offer is withdrawn unclaimed)
                    res = "never"
                elif kind == "late_decode":  # the prefill's response reaches the decode late
                    time.sleep(0.5 * u)
                    res = check(pr, h.complete(fleet.d.port, pr, NEW, params)["tokens"])
                elif kind == "abort_in_pull":  # disconnect while the READ is held in flight
                    params["kvt_test_hold_s"] = 0.05 + 0.3 * u
                    try:
                        done = h.complete(fleet.d.port, pr, NEW, params, timeout=0.02 + 0.3 * rng.random())
                        res = check(pr, done["tokens"])  # finished before the disconnect: its tokens count too
                    except OSError:
                        res = "aborted"
                elif kind == "abort_in_decode":  # disconnect after a few streamed tokens
                    c, r = h.stream_open(fleet.d.port, pr, 64, params)
                    toks, _ = h.stream_tokens(r, stop_after=1 + int(u * 4))
                    c.close()
                    res = check(pr[:0] + pr, toks[:NEW], prefix=True)
                else:
                    res = check(pr, h.complete(fleet.d.port, pr, NEW, params)["tokens"])
        except Exception as e:  # noqa: BLE001 (an unexpected error is a failure, counted)
            res = f"error {type(e).__name__}: {e}"
        with lock:
            outcome[res.split(":")[0]] = outcome.get(res.split(":")[0], 0) + 1
            if res.startswith("wrong") or res.startswith("error"):
                wrong.append((i, len(pr), backend, kind, res))

    def check(pr, toks, prefix=False) -> str:
        ref = fleet.refs[tuple(pr)]
        ok = toks == ref[: len(toks)] if prefix else toks == ref
        return "ok" if ok else f"wrong: {toks[:8]} vs {ref[:8]}"

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, plan))
    report(f"\nabort storm, {len(plan)} requests: outcomes {outcome}")
    assert not wrong, wrong[:10]
    assert outcome.get("ok", 0) >= 60, outcome
    pools_whole(fleet, timeout=90.0)


# --- 3. the hazard ----------------------------------------------------------------


def held_pull(f: Fleet, vocab: int, p: h.Server, d: h.Server, backend: Optional[str]) -> Dict[str, Any]:
    """The schedule: prefill request A; its decode held past NixlConnector's
    lease while the prefill serves other requests into whatever blocks are
    free; then A's decode."""
    a = h.prompts(vocab, LENGTHS, seed=7)[7]
    params = h.complete(p.port, a, 1, {"do_remote_decode": True})["kv_transfer_params"]
    if backend:
        params["kvt_backends"] = [backend]
    held_usage = p.metric("vllm:kv_cache_usage_perc")
    t_end = time.monotonic() + HOLD_S
    served = 0
    while time.monotonic() < t_end or served < 8:
        h.complete(p.port, fillers(vocab)[served % 4], 1)
        served += 1
        time.sleep(0.2)
    usage_before_decode = p.metric("vllm:kv_cache_usage_perc")
    toks = h.complete(d.port, a, NEW, params)["tokens"]
    return {"tokens": toks, "ref": f.refs[tuple(a)], "held": held_usage, "before": usage_before_decode}


def test_hazard_ours_holds_the_blocks_until_the_proof(fleet: Fleet, vocab: int):
    before = h.side_stats(fleet.p_side)["offers_settled_by_done"]
    r = held_pull(fleet, vocab, fleet.p, fleet.d, "nixl")
    assert r["held"] > 0 and r["before"] > 0, f"the prefill let the blocks go before the decode read them: {r}"
    assert r["tokens"] == r["ref"]
    pools_whole(fleet)
    st = h.side_stats(fleet.p_side)
    assert st["offers_settled_by_done"] == before + 1, st  # freed once, by the DONE


def test_positive_control_nixl_connector_frees_on_its_lease_and_decodes_another_requests_kv(fleet: Fleet, vocab: int):
    fleet.nixl_pair()
    # The same pair with no hold decodes correctly (the comparison is fair) ...
    a = h.prompts(vocab, LENGTHS, seed=7)[7]
    assert pd(fleet, a, "nixl", fleet.np, fleet.nd) == fleet.refs[tuple(a)]
    # ... and with the decode held past the lease it does not.
    r = held_pull(fleet, vocab, fleet.np, fleet.nd, None)
    assert h.count_in_log(fleet.np, "Releasing expired KV blocks") >= 1, fleet.np.tail()
    assert r["tokens"] != r["ref"], "NixlConnector's decode read the right KV after its lease: the control is blind"


# --- 4. cost ----------------------------------------------------------------------


def test_cost_decode_latency_against_nixl_connector(fleet: Fleet, vocab: int, report):
    fleet.nixl_pair()
    ours_d = fleet.cost_decode()
    prompts = h.prompts(vocab, [97, 150, 64], seed=3)
    lat: Dict[str, Dict[str, List[float]]] = {"ours": {"ttft": [], "total": []}, "nixl": {"ttft": [], "total": []}}

    def decode_once(which: str, pr: List[int]) -> None:
        p, d = (fleet.p, ours_d) if which == "ours" else (fleet.np, fleet.nd)
        params = h.complete(p.port, pr, 1, {"do_remote_decode": True})["kv_transfer_params"]
        if which == "ours":
            params["kvt_backends"] = ["nixl"]
        t0 = time.perf_counter()
        c, resp = h.stream_open(d.port, pr, NEW, params)
        toks, first = h.stream_tokens(resp)
        total = time.perf_counter() - t0
        c.close()
        assert toks == fleet.refs.get(tuple(pr), toks)
        lat[which]["ttft"].append(first)
        lat[which]["total"].append(total)

    for pr in prompts:  # warm both
        decode_once("ours", pr)
        decode_once("nixl", pr)
    for v in lat.values():
        v["ttft"].clear()
        v["total"].clear()
    for i in range(40):
        order = ["ours", "nixl"] if i % 2 == 0 else ["nixl", "ours"]
        for w in order:
            decode_once(w, prompts[i % len(prompts)])

    rows = {}
    for m in ("ttft", "total"):
        ours, theirs = lat["ours"][m], lat["nixl"][m]
        rows[m] = (statistics.median(ours) / statistics.median(theirs), percentile(ours, 0.99) / percentile(theirs, 0.99),
                   statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3)
    report("\ncost, ours (the connector as it ships) / NixlConnector (40 alternating decode requests each, nixl backend underneath):",
           *(f"  {m:5s}: median {rm:.2f} ({om:.1f} ms vs {tm:.1f} ms), p99 {r99:.2f}" for m, (rm, r99, om, tm) in rows.items()))
    # The goal is 1.05 (README); the assertion only catches a gross regression on a noisy machine.
    assert rows["total"][0] < 1.5, rows
