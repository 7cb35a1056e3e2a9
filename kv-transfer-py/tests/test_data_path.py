"""Rule: prefill and decode as two processes on loopback move every page's
bytes, driven in SGLang's order, once per backend that runs here (verbs
needs a device: the verbs lab proves it in Rust)."""

import multiprocessing as mp

import pytest

from conftest import HOST_BACKENDS, backend_or_skip, free_port

# (room, prefill pages, decode pages, aux row): scattered, unequal, reused across rooms.
ROOMS = [
    (101, [0, 1, 2, 3, 4, 5, 6, 7], [31, 2, 17, 5, 9, 30, 11, 0], 3),
    (102, [8, 20, 9], [4, 12, 6], 1),
    (103, list(range(10, 26)), list(range(16)), 5),
    # Nothing to move but the aux row and the state: the decode holds the prompt's KV.
    (104, [], [], 6),
]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_every_page_arrives_between_two_processes(sglang, backend):
    backend_or_skip(backend)
    from sglang.srt.disaggregation.base.conn import KVPoll

    import sglang_worker
    from kv_transfer.sglang.conn import KvTransferBootstrapServer

    port = free_port()
    server = KvTransferBootstrapServer("127.0.0.1", port)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=sglang_worker.prefill_main, args=(backend, port, ROOMS, out)),
        ctx.Process(target=sglang_worker.decode_main, args=(backend, port, ROOMS, out)),
    ]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < 2 * len(ROOMS) + 2:
            r = out.get(timeout=240)
            assert not r[0].endswith("-error"), r[1]
            results.append(r)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        server.close()
    decode = {r[1]: r for r in results if r[0] == "decode"}
    prefill = {r[1]: r for r in results if r[0] == "prefill"}
    for room, src, _, _ in ROOMS:
        assert prefill[room][2] == KVPoll.Success, prefill[room]
        assert prefill[room][4] == sglang_worker.PREFIX.get(room, 0)  # the decode's prefix reached the prefill
        assert decode[room][2] == KVPoll.Success, decode[room]
        assert decode[room][4] == 0, f"room {room}: {decode[room][4]} pages with wrong bytes"
    m = next(r[1] for r in results if r[0] == "decode-metrics")
    assert m["free"] == m["capacity"] and m["quarantined"] == 0  # the pool is whole
    assert m["settled_completed"] >= sum(len(r[1]) for r in ROOMS) * 4  # every page by its DONE
