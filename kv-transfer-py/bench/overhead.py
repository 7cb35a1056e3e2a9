"""What the Python layer adds to a transfer: one request (reserve N pages in
every buffer, WRITE them into the peer's exposure, wait for completion,
release) driven from Python through ``kv_transfer`` against the same request
driven from Rust (``kv_transfer._native.rust_baseline``), same endpoints,
same process. The two run in pairs, one request each, in alternating order:
a loopback transfer's latency wanders by tens of microseconds on a shared
machine, far more than the layer costs, and a pair sees the same conditions.

    python kv-transfer-py/bench/overhead.py [--backend tcp-sim] [--buffers 1,8]
        [--pages 1,16,128] [--pairs 2000] [--json]

Reports per request each side's median, the median of the paired
differences, and a least-squares fit of that as ``fixed + per_page * N``
per buffer count. Goal: fixed <= 10 us, per page <= 100 ns.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import kv_transfer
from kv_transfer import _native

PAGE_BYTES = 256


def rig(backend: str, buffers: int, pages: int):
    mem = [ctypes.create_string_buffer(pages * PAGE_BYTES) for _ in range(2 * buffers)]
    tag = f"{backend}-{buffers}-{pages}-{time.monotonic_ns()}"
    decode = kv_transfer.Endpoint(backend, f"bench-decode-{tag}")
    prefill = kv_transfer.Endpoint(backend, f"bench-prefill-{tag}")
    dpool = decode.register([(ctypes.addressof(m), pages * PAGE_BYTES, PAGE_BYTES) for m in mem[:buffers]], owner=mem)
    ppool = prefill.register([(ctypes.addressof(m), pages * PAGE_BYTES, PAGE_BYTES) for m in mem[buffers:]], owner=mem)
    peer = decode.add_peer(prefill.descriptor())
    prefill.add_peer(decode.descriptor())
    lease = dpool.reserve(list(range(pages)))
    remote = decode.expose(lease, peer)
    return dict(decode=decode, prefill=prefill, dpool=dpool, ppool=ppool, lease=lease, remote=remote, mem=mem)


def python_side(r, pages: int, iters: int, poll: bool) -> list:
    ep, pool, remote = r["prefill"], r["ppool"], r["remote"]
    out = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        t = ep.write(pool.reserve_any(pages), remote, notify=False)
        if poll:
            status = t.poll()
            while status == "pending":  # as SGLang's scheduler polls a sender
                status = t.poll()
        else:
            status = t.wait(10.0)
        if status != "success":
            raise SystemExit(f"transfer failed: {t.error}")
        t.release()
        out.append(clock() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="tcp-sim")
    ap.add_argument("--buffers", default="1,8")
    ap.add_argument("--pages", default="1,16,128")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--wait", action="store_true", help="block on completion (Transfer.wait) instead of polling")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for buffers in [int(x) for x in a.buffers.split(",")]:
        for pages in [int(x) for x in a.pages.split(",")]:
            r = rig(a.backend, buffers, pages)
            python_side(r, pages, 20, not a.wait)  # warm up both paths
            _native.rust_baseline(r["prefill"], r["ppool"], r["remote"], 20)
            rust, py, diff = [], [], []
            for k in range(a.pairs):
                if k % 2 == 0:
                    x = _native.rust_baseline(r["prefill"], r["ppool"], r["remote"], 1, poll=not a.wait)[0]
                    y = python_side(r, pages, 1, not a.wait)[0]
                else:
                    y = python_side(r, pages, 1, not a.wait)[0]
                    x = _native.rust_baseline(r["prefill"], r["ppool"], r["remote"], 1, poll=not a.wait)[0]
                rust.append(x)
                py.append(y)
                diff.append(y - x)
            print(f"  buffers={buffers} pages={pages} done", file=sys.stderr)
            rows.append(dict(buffers=buffers, pages=pages, rust_us=statistics.median(rust) / 1e3,
                             python_us=statistics.median(py) / 1e3, extra_us=statistics.median(diff) / 1e3))
            r["lease"].abort()
    print(file=sys.stderr)
    fits = {}
    for buffers in sorted({r["buffers"] for r in rows}):
        pts = [(r["pages"], r["extra_us"]) for r in rows if r["buffers"] == buffers]
        n = len(pts)
        mx = sum(p for p, _ in pts) / n
        my = sum(d for _, d in pts) / n
        var = sum((p - mx) ** 2 for p, _ in pts)
        slope = sum((p - mx) * (d - my) for p, d in pts) / var if var else 0.0
        fits[buffers] = dict(fixed_us=my - slope * mx, per_page_ns=slope * 1e3)
    if a.json:
        print(json.dumps(dict(backend=a.backend, rows=rows, fits=fits), indent=2))
        return 0
    mode = "blocking wait" if a.wait else "send + poll to completion"
    print(f"backend {a.backend}, {mode}: medians per request over {a.pairs} pairs (one Rust, one Python request each)")
    print(f"{'buffers':>7} {'pages':>6} {'rust us':>10} {'python us':>10} {'extra us':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['buffers']:>7} {r['pages']:>6} {r['rust_us']:>10.2f} {r['python_us']:>10.2f} "
              f"{r['extra_us']:>9.2f} {r['python_us'] / r['rust_us']:>6.3f}")
    for b, f in fits.items():
        print(f"buffers={b}: extra = {f['fixed_us']:.2f} us + {f['per_page_ns']:.1f} ns/page (goal <= 10 us + 100 ns/page)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
