"""Fault hooks for the end-to-end tests, loaded into every SGLang process of
a test server as an ``sglang.srt.plugins`` entry point (this folder is on
the servers' ``PYTHONPATH``; it is never installed). Each hook is off
unless its environment variable is set, and each one acts only on rooms the
test marked through the bootstrap room it chose (``harness.room``):

- ``room % 1000 == 777`` (**held**): with ``KVT_TEST_HOLD=1``, the prefill's
  send of that request's KV waits before it writes: until the test creates
  ``$KVT_TEST_HOLD_DIR/release-<room>``, or at most ``(room // 1000) % 1000``
  hundredths of a second. In SGLang's in-tree mooncake backend the wait
  is in the transfer worker, after its abort check and before the engine
  writes (a slow network: the chunk is dequeued, the write not done); in
  kvtransfer it is before the sender posts its writes (the same point: the
  request's send started, nothing written). Both log ``kvt-test-hook: held``
  and ``kvt-test-hook: late send``.
- ``room % 1000 == 666`` (**corrupt**): with ``KVT_TEST_CORRUPT=1``, the
  kvtransfer decode zeroes the request's KV pages once they arrived, before
  SGLang decodes from them (the negative control: corrupted KV must show).
- ``KVT_TEST_MOONCAKE_CPU=1``: SGLang's in-tree mooncake sender declares
  ``supports_host_tensor_indices``, which makes the prefill pin memory and
  record a ``torch.cuda.Event`` (no NVIDIA driver here); off, the prefill
  takes the generic path every other backend (kvtransfer's too) takes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger("kvt_sglang_test_hooks")
ROOM_MOD, HOLD_RESIDUE, CORRUPT_RESIDUE = 1000, 777, 666
_local = threading.local()


def marked_room(base: int, hold_s: float = 0.0, corrupt: bool = False) -> int:
    """A bootstrap room with ``base`` in its high digits and the mark the
    hooks read in its low six (the one encoding; :func:`hold_seconds` and
    the corrupt hook decode it). ``hold_s``: at most 9.99 s."""
    r = base * ROOM_MOD * ROOM_MOD
    if corrupt:
        return r + CORRUPT_RESIDUE
    if hold_s > 0:
        return r + int(round(hold_s * 100)) % ROOM_MOD * ROOM_MOD + HOLD_RESIDUE
    return r + 1


def hold_seconds(room: Any) -> float:
    try:
        r = int(room)
    except (TypeError, ValueError):
        return 0.0
    if r % ROOM_MOD != HOLD_RESIDUE:
        return 0.0
    return (r // ROOM_MOD) % ROOM_MOD / 100.0


def released(room: Any, since: float, most: float) -> bool:
    """Whether a held room's wait is over (the test's file, or its longest wait)."""
    if time.monotonic() - since >= most:
        return True
    d = os.environ.get("KVT_TEST_HOLD_DIR")
    return bool(d) and os.path.exists(os.path.join(d, f"release-{room}"))


def _on(name: str) -> bool:
    return os.environ.get(name) == "1"


def _mooncake_cpu() -> None:
    from sglang.srt.disaggregation.mooncake import conn

    conn.MooncakeKVSender.supports_host_tensor_indices = False


def _mooncake_hold() -> None:
    from sglang.srt.disaggregation.common import utils
    from sglang.srt.disaggregation.mooncake import conn

    get = utils.FastQueue.get

    def get_noting_room(self: Any, *a: Any, **kw: Any) -> Any:
        item = get(self, *a, **kw)
        _local.room = getattr(item, "room", None)
        return item

    utils.FastQueue.get = get_noting_room
    send = conn.MooncakeKVManager.send_kvcache

    def send_held(self: Any, *a: Any, **kw: Any) -> Any:
        room = getattr(_local, "room", None)
        s = hold_seconds(room)
        if s > 0:
            logger.warning("kvt-test-hook: held room %s: mooncake send waits (at most %.2f s)", room, s)
            t0 = time.monotonic()
            while not released(room, t0, s):
                time.sleep(0.01)
            logger.warning("kvt-test-hook: late send room %s (mooncake writes now)", room)
        return send(self, *a, **kw)

    conn.MooncakeKVManager.send_kvcache = send_held


def _kvtransfer_hold() -> None:
    from kv_transfer.sglang import conn

    drive = conn.KvTransferSender._drive

    def drive_held(self: Any) -> None:
        s = hold_seconds(self.bootstrap_room)
        if s > 0 and self.pending:
            t0 = self.__dict__.setdefault("_kvt_test_hold_t0", time.monotonic())
            if not released(self.bootstrap_room, t0, s):
                if not self.__dict__.get("_kvt_test_hold_logged"):
                    self._kvt_test_hold_logged = True
                    logger.warning("kvt-test-hook: held room %s: kvtransfer send waits (at most %.2f s)",
                                   self.bootstrap_room, s)
                return
            if not self.__dict__.get("_kvt_test_late_logged"):
                self._kvt_test_late_logged = True
                logger.warning("kvt-test-hook: late send room %s (kvtransfer posts now)", self.bootstrap_room)
                drive(self)
                logger.warning("kvt-test-hook: late send room %s: %d write(s) posted, error %r", self.bootstrap_room,
                               len(self.transfers), self.error)
                return
        drive(self)

    conn.KvTransferSender._drive = drive_held


def _kvtransfer_corrupt() -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kv_transfer.sglang import conn

    send_metadata = conn.KvTransferReceiver.send_metadata
    poll = conn.KvTransferReceiver.poll

    def send_metadata_noting(self: Any, kv_indices: Any, *a: Any, **kw: Any) -> Any:
        self._kvt_test_pages = [int(i) for i in list(kv_indices)]
        return send_metadata(self, kv_indices, *a, **kw)

    def poll_corrupting(self: Any) -> Any:
        state = poll(self)
        r = self.bootstrap_room
        if state == KVPoll.Success and int(r or 0) % ROOM_MOD == CORRUPT_RESIDUE and not getattr(self, "_kvt_test_done", False):
            self._kvt_test_done = True
            args = self.kv_mgr.kv_args
            for ptr, item in zip(args.kv_data_ptrs, args.kv_item_lens):
                for page in getattr(self, "_kvt_test_pages", []):
                    ctypes.memset(int(ptr) + page * int(item), 0, int(item))
            logger.warning("kvt-test-hook: zeroed the KV pages of room %s", r)
        return state

    conn.KvTransferReceiver.send_metadata = send_metadata_noting
    conn.KvTransferReceiver.poll = poll_corrupting


def register() -> None:
    """``sglang.srt.plugins`` entry point: installs the hooks the environment asks for."""
    if _on("KVT_TEST_MOONCAKE_CPU"):
        _mooncake_cpu()
    if _on("KVT_TEST_HOLD"):
        try:
            _mooncake_hold()
        except ImportError:
            pass
        _kvtransfer_hold()
    if _on("KVT_TEST_CORRUPT"):
        _kvtransfer_corrupt()
