"""The two processes of the data-path test: a prefill worker and a decode
worker, each driving this package's classes in the order SGLang's scheduler
does (prefill: sender, poll to WaitingForInput, init, send by chunks, poll
to Success; decode: prefill info, receiver, init, send_metadata, poll to
Success). Run in spawned processes (multiprocessing)."""

from __future__ import annotations

import os
import traceback

import numpy as np

from conftest import fill, kv_args, page_bytes, pattern, poll_until, server_args

PAGES, ITEM, AUX_ITEM, TAG = 32, 512, 64, 0x5A
#: Tokens the decode says it already holds, by room (SGLang's decode prefix cache).
#: Room 104: the decode's prefix cache holds its whole prompt, so it
#: exposes no KV page and the prefill's only send is a last chunk with no
#: page (the aux row and the state still move).
PREFIX = {103: 16, 104: 24}
#: One state type: 2 buffers of 6 items of 96 bytes; each room sends one item.
STATE = (2, 6, 96)
STATE_ITEM = {101: 4, 102: 0, 103: 5, 104: 2}
N_KV = 4


def prefill_main(backend: str, port: int, rooms, out) -> None:
    try:
        os.environ["KV_TRANSFER_BACKEND"] = backend
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from kv_transfer.sglang.conn import KvTransferManager, KvTransferSender

        tensors: list = []
        args = kv_args(tensors, PAGES, ITEM, aux_item=AUX_ITEM, state=STATE)
        for b, t in enumerate(tensors[:N_KV]):
            fill(t, TAG, b, list(range(PAGES)), ITEM)
        fill(tensors[N_KV], TAG, 0xA0, list(range(8)), AUX_ITEM)
        for b, t in enumerate(tensors[N_KV + 1:]):
            fill(t, TAG, 0xC0 + b, list(range(STATE[1])), STATE[2])
        mgr = KvTransferManager(args, DisaggregationMode.PREFILL, server_args(port))
        for room, src, _dst, aux_index in rooms:
            s = KvTransferSender(mgr, f"127.0.0.1:{port}", room)
            st = poll_until(s.poll, {KVPoll.WaitingForInput, KVPoll.Failed}, 60)
            if st != KVPoll.WaitingForInput:
                out.put(("prefill", room, int(st), s.error, -1))
                continue
            prefix = s.pop_decode_prefix_len()
            s.init(len(src), aux_index)
            half = len(src) // 2
            # SGLang skips a chunk when should_send_kv_chunk says so.
            if s.should_send_kv_chunk(half, False):
                s.send(np.array(src[:half], dtype=np.int64))
            assert s.should_send_kv_chunk(len(src) - half, True)
            s.send(np.array(src[half:], dtype=np.int64), [np.array([STATE_ITEM[room]], dtype=np.int64)])
            st = poll_until(s.poll, {KVPoll.Success, KVPoll.Failed}, 30)
            out.put(("prefill", room, int(st), s.error, prefix))
        out.put(("prefill-metrics", mgr.get_metrics()))
    except BaseException:  # noqa: BLE001  (report everything to the parent)
        out.put(("prefill-error", traceback.format_exc()))


def decode_main(backend: str, port: int, rooms, out) -> None:
    try:
        os.environ["KV_TRANSFER_BACKEND"] = backend
        from sglang.srt.plugins import load_plugins

        load_plugins()  # the manager checks that the release hook is in place
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from kv_transfer.sglang.conn import KvTransferManager, KvTransferReceiver

        tensors: list = []
        args = kv_args(tensors, PAGES, ITEM, aux_item=AUX_ITEM, state=STATE)
        mgr = KvTransferManager(args, DisaggregationMode.DECODE, server_args(port))
        addr = f"127.0.0.1:{port}"
        if not poll_until(lambda: mgr.try_ensure_parallel_info(addr), {True}, 90, step=0.05):
            out.put(("decode-error", "the prefill never registered"))
            return
        for room, src, dst, aux_index in rooms:
            r = KvTransferReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
            r.init(0)
            if r.poll() != KVPoll.WaitingForInput:
                out.put(("decode", room, int(r.poll()), r.error, -1))
                continue
            # The decode's state item for this room: another index than the prefill's.
            d_state = (STATE_ITEM[room] + 1) % STATE[1]
            r.send_metadata(np.array(dst, dtype=np.int32), aux_index, [np.array([d_state], dtype=np.int32)],
                            decode_prefix_len=PREFIX.get(room, 0))
            st = poll_until(r.poll, {KVPoll.Success, KVPoll.Failed}, 30)
            bad = 0
            for b, t in enumerate(tensors[:N_KV]):
                for s_page, d_page in zip(src, dst):
                    bad += page_bytes(t, d_page, ITEM) != pattern(TAG, b, s_page, ITEM)
            if aux_index is not None:
                bad += page_bytes(tensors[N_KV], aux_index, AUX_ITEM) != pattern(TAG, 0xA0, aux_index, AUX_ITEM)
            for b, t in enumerate(tensors[N_KV + 1:]):
                bad += page_bytes(t, d_state, STATE[2]) != pattern(TAG, 0xC0 + b, STATE_ITEM[room], STATE[2])
            out.put(("decode", room, int(st), r.error, bad))
        m = mgr.get_metrics()
        mgr.kv_pool.check()
        out.put(("decode-metrics", m))
    except BaseException:  # noqa: BLE001
        out.put(("decode-error", traceback.format_exc()))
