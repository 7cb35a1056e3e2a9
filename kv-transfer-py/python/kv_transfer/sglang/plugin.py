"""The ``sglang.srt.plugins`` entry point: makes
``--disaggregation-transfer-backend kvtransfer`` select this package, and
puts kv_transfer's proof in charge of the decode side's deferred release.

SGLang runs :func:`register` in every process before it parses arguments
(``load_plugins()``); hooks go through its ``HookRegistry``:

- the CLI choice ``kvtransfer``;
- REPLACE ``TransferBackend`` with the same Enum plus ``KVTRANSFER``;
- AROUND ``get_kv_class``: this package's classes for ``kvtransfer``, the
  stock chain for everything else;
- AROUND ``DecodeTransferQueue.resolve_deferred_releases``: for kvtransfer
  requests the deadline becomes a report (warning, metric), never a release:
  only ``is_abort_release_safe`` (the pool's proof) frees;
- AROUND ``DecodeTransferQueue.release_memory_occupation``: refuses to drop
  held kvtransfer requests.

Hooks are bound to SGLang's code, so the versions are pinned
(:data:`SUPPORTED_SGLANG`); on another version :func:`register` installs
nothing and says so, and the manager then refuses to start.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from typing import Any, Callable

logger = logging.getLogger("kv_transfer.sglang")

#: SGLang versions whose code these hooks were written and tested against.
SUPPORTED_SGLANG = ("0.5.23",)
#: The value of ``--disaggregation-transfer-backend``.
BACKEND_NAME = "kvtransfer"

_MARK = "__kv_transfer_hook__"
_registered = False


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


def _ours(decode_req: Any) -> bool:
    from .conn import KvTransferReceiver

    return isinstance(getattr(decode_req, "kv_receiver", None), KvTransferReceiver)


@_mark
def _around_get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any, *a: Any, **kw: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type, *a, **kw)
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from . import conn

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: conn.KvTransferManager,
        KVClassType.SENDER: conn.KvTransferSender,
        KVClassType.RECEIVER: conn.KvTransferReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvTransferBootstrapServer,
    }[KVClassType(getattr(class_type, "value", class_type))]


@_mark
def _around_resolve_deferred_releases(original: Callable[..., Any], self: Any, *a: Any, **kw: Any) -> Any:
    """For kvtransfer entries SGLang's deadline only reports: it becomes
    infinite (``now >= deadline`` never frees), and passing the original
    deadline logs a warning and counts ``deadline_passed_held`` once."""
    entries = getattr(self, "_deferred_releases", None)
    if entries:
        now = time.monotonic()
        rewritten = []
        for entry in entries:
            decode_req, start, deadline, idx, acks = entry
            if _ours(decode_req) and deadline != math.inf:
                timeout = getattr(self, "deferred_kv_release_timeout", deadline - start)
                if now >= deadline:
                    decode_req.kv_receiver.kv_mgr.note_deadline_passed(decode_req.req.bootstrap_room, timeout)
                    deadline = math.inf
                else:
                    # Keep the deadline for the report; hide it from the release.
                    decode_req._kvt_deadline = deadline
                    deadline = math.inf
            elif _ours(decode_req):
                d = getattr(decode_req, "_kvt_deadline", None)
                if d is not None and now >= d:
                    decode_req._kvt_deadline = None
                    decode_req.kv_receiver.kv_mgr.note_deadline_passed(
                        decode_req.req.bootstrap_room, getattr(self, "deferred_kv_release_timeout", 0.0)
                    )
            rewritten.append((decode_req, start, deadline, idx, acks))
        self._deferred_releases = rewritten
    return original(self, *a, **kw)


@_mark
def _around_release_memory_occupation(original: Callable[..., Any], self: Any, *a: Any, **kw: Any) -> Any:
    held = [e for e in getattr(self, "_deferred_releases", []) if _ours(e[0])]
    if held:
        raise RuntimeError(
            f"kvtransfer: {len(held)} aborted request(s) hold KV pages that are not proven free; "
            "releasing memory occupation now would hand them to a NIC that may still write"
        )
    return original(self, *a, **kw)


def _extended_transfer_backend(original: type) -> type:
    if any(m.value == BACKEND_NAME for m in original):
        return original
    members = {m.name: m.value for m in original}
    members["KVTRANSFER"] = BACKEND_NAME
    return enum.Enum("TransferBackend", members, module=original.__module__)


def release_hook_installed() -> bool:
    """Whether the hook that stops SGLang's timer from freeing kvtransfer
    pages is in place (the manager refuses to start without it)."""
    try:
        from sglang.srt.disaggregation.decode import DecodeTransferQueue
    except Exception:  # noqa: BLE001  (no SGLang: nothing to hook)
        return False
    # HookRegistry's wrapper holds our hook in its closure; walk the chain
    # of wrappers (other plugins may wrap it too).
    fn = DecodeTransferQueue.__dict__.get("resolve_deferred_releases")
    for _ in range(16):
        if fn is None:
            return False
        cells = getattr(fn, "__closure__", None) or ()
        if any(getattr(_cell(c), _MARK, False) for c in cells):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: registers the hooks (idempotent)."""
    global _registered
    if _registered:
        return
    import sglang

    version = getattr(sglang, "__version__", "?")
    if version not in SUPPORTED_SGLANG:
        logger.error(
            "kv_transfer.sglang supports SGLang %s, not %s: the kvtransfer backend is not registered",
            ", ".join(SUPPORTED_SGLANG), version,
        )
        return
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.TransferBackend", _extended_transfer_backend(dutils.TransferBackend), HookType.REPLACE
    )
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.resolve_deferred_releases",
        _around_resolve_deferred_releases,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.release_memory_occupation",
        _around_release_memory_occupation,
        HookType.AROUND,
    )
    _registered = True
