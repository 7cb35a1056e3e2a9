"""Rule: through SGLang's real DecodeTransferQueue, an aborted request's
decode pages are freed only after kv_transfer's pool proved them free; the
deferred-release timer only reports. A write is held in flight at the
decode NIC, the request aborted, its pages handed to the next request, and
then the stale write let go.

Positive control: the same scenario under this package's naive policy (no
proof needed) must show the next request reading the aborted one's bytes.
"""

import time
from types import SimpleNamespace as NS

import numpy as np
import pytest

from conftest import fill, free_port, kv_args, page_bytes, pattern, poll_until, server_args

PAGES, ITEM = 16, 256
DST = [4, 9, 5, 13]  # the decode pages both requests get, in SGLang's allocator order
SRC_A, SRC_B = [0, 1, 2, 3], [8, 9, 10, 11]
TAG_A, TAG_B = 0xA1, 0xB2


def run(monkeypatch, policy: str, hooked: bool):
    import sglang.srt.disaggregation.decode as dec
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, ReqToMetadataIdxAllocator

    import kv_transfer
    from kv_transfer.sglang import conn

    if policy == "naive" and not kv_transfer.NAIVE_POLICY_BUILT:
        pytest.fail("the positive control needs a kv_transfer built with the naive-positive-control feature")
    for k, v in {
        conn.BACKEND_ENV: "tcp-sim",
        conn.POLICY_ENV: policy,
        conn.FAULT_GATE_ENV: "1",
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "true",
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "0.05",
    }.items():
        monkeypatch.setenv(k, v)

    # Single rank, no torch.distributed: the queue's collectives are identities.
    monkeypatch.setattr(dec, "get_parallel", lambda: NS(attn_tp_group=NS(cpu_group=None), tp_rank=0))
    monkeypatch.setattr(dec, "get_disagg", lambda: NS(disaggregation_decode_host_receive_threshold=1.0))
    monkeypatch.setattr(dec, "all_reduce_flags", lambda flags, group, op: list(flags))
    monkeypatch.setattr(
        dec, "poll_and_all_reduce", lambda pollers, g, decode_reqs=None, metadata_buffers=None: [int(p.poll()) for p in pollers]
    )

    # Two prefill servers (A's and B's: each its own connection to the
    # decode NIC, as in a cluster), one decode.
    servers, prefills, addrs = [], [], []
    ptensors: list = []
    for tag, src in ((TAG_A, SRC_A), (TAG_B, SRC_B)):
        port = free_port()
        servers.append(conn.KvTransferBootstrapServer("127.0.0.1", port))
        addrs.append(f"127.0.0.1:{port}")
        tensors: list = []
        pargs = kv_args(tensors, PAGES, ITEM)
        for b, t in enumerate(tensors[:-1]):
            fill(t, tag, b, src, ITEM)
        ptensors.append(tensors)
        prefills.append(conn.KvTransferManager(pargs, DisaggregationMode.PREFILL, server_args(port)))
    dtensors: list = []
    dmgr = conn.KvTransferManager(kv_args(dtensors, PAGES, ITEM), DisaggregationMode.DECODE, server_args(0))
    for addr in addrs:
        assert poll_until(lambda: dmgr.try_ensure_parallel_info(addr), {True}, 10)
    if not hooked:
        # Stock behaviour: SGLang's timer decides (the hook taken off after start-up).
        original = dec.DecodeTransferQueue.resolve_deferred_releases.__wrapped__
        monkeypatch.setattr(dec.DecodeTransferQueue, "resolve_deferred_releases", original)

    # What SGLang frees, and what the pool knew at that moment.
    released = []

    def release_kv_cache(req, tree_cache, *, checkpoint):
        released.append((req.rid, time.monotonic(), all(dmgr.kv_pool.is_free(p) for p in DST)))

    monkeypatch.setattr(dec, "release_kv_cache", release_kv_cache)
    sched = NS(
        spec_algorithm=None, enable_decode_hicache=False, enable_hisparse=False, disagg_decode_prealloc_queue=None,
        metrics_reporter=NS(enable_metrics=False), output_streamer=NS(stream_output=lambda *a, **k: None),
    )
    alloc = ReqToMetadataIdxAllocator(4)
    queue = dec.DecodeTransferQueue(alloc, NS(clear_slot=lambda idx: None), sched, NS(unlock=lambda lock: None))
    assert queue.enable_deferred_kv_release and queue.deferred_kv_release_timeout == 0.05

    def request(room):
        r = conn.KvTransferReceiver(mgr=dmgr, bootstrap_addr=addrs[room - 1], bootstrap_room=room)
        r.init(0)
        r.send_metadata(np.array(DST, dtype=np.int32), None, None, decode_prefix_len=0)
        return r

    def sender(room, src):
        s = conn.KvTransferSender(prefills[room - 1], addrs[room - 1], room)
        assert poll_until(s.poll, {KVPoll.WaitingForInput}, 10) == KVPoll.WaitingForInput
        s.init(len(src))
        s.send(np.array(src))
        return s

    # Request A: its first WRITE is held at the decode NIC; the rest land.
    rcv_a = request(1)
    dmgr.endpoint.hold_next_writes(1)
    snd_a = sender(1, SRC_A)
    assert dmgr.endpoint.wait_held_writes(1, 10.0)
    req_a = NS(rid="A", bootstrap_room=1, return_logprob=False, finished_reason=None)
    queue.add(dec.DecodeRequest(req=req_a, kv_receiver=rcv_a, metadata_buffer_index=alloc.alloc()))
    aborted_at = time.monotonic()
    rcv_a.abort()  # the client went away
    assert queue.pop_transferred() == []
    assert queue.num_pending_deferred_releases() == 1  # held, not freed
    for _ in range(3000):  # bounded: 15 s
        queue.resolve_deferred_releases()
        if released:
            break
        time.sleep(0.005)
    assert released, "A's pages were never released"

    # Request B gets the same pages from SGLang's allocator.
    rcv_b = request(2)
    snd_b = sender(2, SRC_B) if rcv_b.poll() != KVPoll.Failed else None
    b_state = poll_until(rcv_b.poll, {KVPoll.Success, KVPoll.Failed}, 10)
    if snd_b is not None:
        poll_until(snd_b.poll, {KVPoll.Success, KVPoll.Failed}, 10)

    # The stale write goes on; A's sender ends once the NIC applied or rejected it.
    dmgr.endpoint.release_writes()
    a_state = poll_until(snd_a.poll, {KVPoll.Success, KVPoll.Failed}, 10)
    # Pages of B's that hold A's bytes (foreign), and pages that are not B's at all.
    foreign = wrong = 0
    if b_state == KVPoll.Success:
        for b, t in enumerate(dtensors[:-1]):
            for a_page, s_page, d_page in zip(SRC_A, SRC_B, DST):
                got = page_bytes(t, d_page, ITEM)
                foreign += got == pattern(TAG_A, b, a_page, ITEM)
                wrong += got != pattern(TAG_B, b, s_page, ITEM)
    m = dmgr.get_metrics()
    for srv, mgr in zip(servers, prefills):
        srv.close()
        mgr.teardown()
    return NS(
        foreign=foreign, wrong=wrong, b_state=b_state, a_state=a_state, released=released, held_for=released[0][1] - aborted_at,
        metrics=m, b_error=rcv_b.error, pool=dmgr.kv_pool,
    )


def test_positive_control_naive_policy_lets_the_next_request_read_foreign_bytes(sglang, monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = run(monkeypatch, "naive", hooked=True)
    assert r.b_state == KVPoll.Success  # B was served...
    assert r.foreign > 0, "the positive control saw no corruption: the scenario proves nothing"
    print(f"naive: A released {r.held_for * 1e3:.1f} ms after the abort; B read {r.foreign} page(s) of A's ({r.wrong} not B's)")


def test_kvtransfer_frees_aborted_pages_only_on_proof_and_the_timer_only_reports(sglang, monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = run(monkeypatch, "safe", hooked=True)
    assert len(r.released) == 1
    rid, _, proven = r.released[0]
    assert rid == "A" and proven, "SGLang freed A's pages before the pool had a proof"
    assert r.held_for > 0.05  # SGLang's 0.05 s deadline passed, and did not free them
    assert r.metrics["deadline_passed_held"] >= 1
    assert r.metrics["settled_revoked"] >= 1  # the proof: A's tenancy revoked at the NIC
    assert r.b_state == KVPoll.Success and r.foreign == 0 and r.wrong == 0  # B served, its own bytes only
    assert r.a_state == KVPoll.Failed  # the stale write was rejected: A's sender failed
    assert r.metrics["free"] == r.metrics["capacity"] and r.metrics["quarantined"] == 0
    r.pool.check()
    print(f"safe: A released {r.held_for:.2f} s after the abort, on proof (revoked {r.metrics['settled_revoked']}); "
          f"deadline passed and held {r.metrics['deadline_passed_held']}x; B foreign pages {r.foreign}")


def test_stock_timer_frees_early_and_the_pool_refuses_the_reuse(sglang, monkeypatch):
    # SGLang's own timer (hook off) frees A's pages at 0.05 s, before any
    # proof. The pool still holds them in quarantine: B's reservation is
    # refused (typed, B fails), so no request reads A's late bytes.
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = run(monkeypatch, "safe", hooked=False)
    rid, _, proven = r.released[0]
    assert rid == "A" and not proven
    assert r.b_state == KVPoll.Failed and "refused" in r.b_error
    assert r.foreign == 0
    print(f"stock timer: A released {r.held_for * 1e3:.1f} ms after the abort, unproven; B refused: {r.b_error}")
