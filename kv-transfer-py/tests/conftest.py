"""Shared set-up of the package's pytest suite.

A test whose requirement is missing (SGLang not installed, an engine absent)
is skipped with what it needs; with ``CI=true`` a missing requirement fails
instead, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import List, Optional

import pytest

import kv_transfer

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(what: str) -> None:
    """Skips (or, under CI, fails) a test that needs ``what``."""
    if IN_CI:
        pytest.fail(f"CI=true and this test needs {what}", pytrace=False)
    pytest.skip(f"needs {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_or_skip(name: str) -> None:
    """Skips unless ``name`` is compiled in and its engine starts here."""
    if name not in kv_transfer.backends():
        need(f"the {name} backend compiled into kv_transfer")
    try:
        kv_transfer.Endpoint(name, f"probe-{name}-{os.getpid()}")
    except kv_transfer.BackendUnavailable as e:
        need(f"the {name} engine ({e})")


#: Backends the data-path test runs (verbs needs a device: the verbs lab runs it in Rust).
HOST_BACKENDS = ["tcp-sim", "mooncake", "nixl"]


@pytest.fixture(scope="session")
def sglang():
    """SGLang with the plugins loaded (this package's entry point among them)."""
    try:
        import sglang  # noqa: F401
        from sglang.srt.plugins import load_plugins
    except ImportError as e:
        need(f"SGLang installed in this environment ({e}); .ci/run installs it into .sglang")
    load_plugins()
    import sglang as s

    return s


def kv_args(tensors: List, pages: int, item_len: int, aux_rows: int = 8, aux_item: int = 64, page_size: int = 4,
            n_buffers: int = 4, state: Optional[tuple] = None):
    """A KVArgs over CPU tensors (kept alive in ``tensors``: the KV buffers,
    then the aux buffer, then any state buffers): ``n_buffers`` KV buffers
    of ``pages`` pages of ``item_len`` bytes, one aux buffer, and with
    ``state=(buffers, items, item_len)`` one state type."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    bufs = [torch.zeros(pages * item_len, dtype=torch.uint8) for _ in range(n_buffers)]
    aux = torch.zeros(aux_rows * aux_item, dtype=torch.uint8)
    tensors.extend(bufs + [aux])
    a.engine_rank = 0
    a.kv_data_ptrs = [t.data_ptr() for t in bufs]
    a.kv_data_lens = [t.numel() for t in bufs]
    a.kv_item_lens = [item_len] * n_buffers
    a.aux_data_ptrs = [aux.data_ptr()]
    a.aux_data_lens = [aux.numel()]
    a.aux_item_lens = [aux_item]
    a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], []
    if state is not None:
        n, items, ilen = state
        st = [torch.zeros(items * ilen, dtype=torch.uint8) for _ in range(n)]
        tensors.extend(st)
        a.state_data_ptrs = [[t.data_ptr() for t in st]]
        a.state_data_lens = [[t.numel() for t in st]]
        a.state_item_lens = [[ilen] * n]
    a.page_size = page_size
    a.ib_device = None
    a.gpu_id = 0
    return a


def server_args(bootstrap_port: int) -> SimpleNamespace:
    return SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port)


def pattern(tag: int, buffer: int, page: int, n: int) -> bytes:
    """The bytes a test writes into a page: who (tag), which buffer and page."""
    head = bytes([tag & 0xFF, buffer & 0xFF, page & 0xFF, (page >> 8) & 0xFF])
    return (head * (n // 4 + 1))[:n]


def fill(t, tag: int, buffer: int, pages: List[int], item_len: int) -> None:
    import torch

    for p in pages:
        t[p * item_len:(p + 1) * item_len] = torch.frombuffer(bytearray(pattern(tag, buffer, p, item_len)), dtype=torch.uint8)


def page_bytes(t, page: int, item_len: int) -> bytes:
    return bytes(t[page * item_len:(page + 1) * item_len].numpy().tobytes())


def poll_until(fn, want, timeout: float = 20.0, step: float = 0.002, on_tick: Optional[callable] = None):
    """Calls ``fn`` until it returns one of ``want`` (bounded); returns the last value."""
    import time

    deadline = time.monotonic() + timeout
    v = fn()
    while v not in want and time.monotonic() < deadline:
        if on_tick is not None:
            on_tick()
        time.sleep(step)
        v = fn()
    return v
