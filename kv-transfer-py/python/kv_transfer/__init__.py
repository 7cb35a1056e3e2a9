"""kv_transfer: move KV cache between prefill and decode workers without ever
handing a page to a new request while a NIC may still write into it.

The lease, generation and settlement logic is Rust (``kv-transfer-core``);
this package drives it. A minimal round trip on the TCP simulator::

    >>> import ctypes, kv_transfer
    >>> dst = ctypes.create_string_buffer(4 * 64)    # decode side's KV memory
    >>> src = ctypes.create_string_buffer(b"k" * 256, 4 * 64)
    >>> decode = kv_transfer.Endpoint("tcp-sim", "decode-doc")
    >>> prefill = kv_transfer.Endpoint("tcp-sim", "prefill-doc")
    >>> dpool = decode.register([(ctypes.addressof(dst), 256, 64)], owner=dst)
    >>> ppool = prefill.register([(ctypes.addressof(src), 256, 64)], owner=src)
    >>> peer = decode.add_peer(prefill.descriptor()); _ = prefill.add_peer(decode.descriptor())
    >>> lease = dpool.reserve([2, 3])                 # the engine's allocator chose pages 2, 3
    >>> remote = decode.expose(lease, peer)           # bytes of remote.to_bytes() go to prefill
    >>> lease.release()
    Traceback (most recent call last):
    ...
    kv_transfer.LeaseStateError: cannot release a lease that is exposed
    >>> t = prefill.write(ppool.reserve([0, 1]), kv_transfer.RemotePages.from_bytes(remote.to_bytes()))
    >>> t.wait(5.0)
    'success'
    >>> t.release(); lease.wait_settled(5.0)          # the DONE settles the exposure
    True
    >>> lease.read(0, 0)[:4]
    b'kkkk'
    >>> lease.release(); dpool.metrics()["free"]
    4
"""

from __future__ import annotations

import atexit
import logging
from typing import Any, Dict, Optional

from ._native import (  # noqa: F401  (re-exported)
    NAIVE_POLICY_BUILT,
    AdmissionRefused,
    BackendFailure,
    BackendUnavailable,
    ClusterKey,
    DescriptorError,
    Endpoint,
    IntegrityError,
    KvTransferError,
    LeaseStateError,
    PageLease,
    PagePool,
    PeerHandshake,
    PeerListener,
    PeerRefused,
    PeerSession,
    RemotePages,
    Transfer,
    __version__,
    backends,
    handshake_body_len,
    handshake_header_len,
    handshake_refusal,
)

__all__ = [
    "AdmissionRefused",
    "BackendFailure",
    "BackendUnavailable",
    "ClusterKey",
    "DescriptorError",
    "Endpoint",
    "IntegrityError",
    "KvTransferError",
    "LeaseStateError",
    "PageLease",
    "PagePool",
    "PeerHandshake",
    "PeerListener",
    "PeerRefused",
    "PeerSession",
    "RemotePages",
    "Transfer",
    "backends",
    "log_metrics",
    "metrics",
]

from . import _native

logger = logging.getLogger("kv_transfer")

# Backend threads log through Python's logging; at interpreter shutdown a
# foreign thread may no longer take the GIL, so the bridge goes off first.
atexit.register(_native.disable_log_bridge)
set_log_level = _native.set_log_level


def metrics(pool: PagePool, endpoint: Optional[Endpoint] = None) -> Dict[str, Any]:
    """One dict of the pool's gauges and counters and, with ``endpoint``, the
    backend's own counters under ``"backend_counters"``."""
    m = dict(pool.metrics())
    if endpoint is not None:
        m["backend_counters"] = dict(endpoint.metrics())
    return m


def log_metrics(pool: PagePool, endpoint: Optional[Endpoint] = None, level: int = logging.INFO) -> Dict[str, Any]:
    """Logs :func:`metrics` through Python logging (logger ``kv_transfer``);
    a stuck quarantine (pages no proof can free: held, never released) is
    logged as a warning whatever ``level`` is. Returns the dict."""
    m = metrics(pool, endpoint)
    logger.log(level, "kv_transfer metrics %s", m)
    if m.get("quarantine_stuck", 0):
        logger.warning(
            "kv_transfer: %d slot(s) cannot be proven free (escalation exhausted); they stay held, never reused",
            m["quarantine_stuck"],
        )
    return m
