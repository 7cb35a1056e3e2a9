"""What crosses the network in ``kv_transfer.vllm``: the ``kv_transfer_params``
that vLLM carries from the prefill's response to the decode's request, and
the frames of a worker's side port. Both come from outside, so both are
parsed here, bounded and typed; anything else is a :class:`ParamsError` or
:class:`~kv_transfer.frames.ProtocolError` and changes nothing (no lease, no
block, no peer). Nothing here imports vLLM.

Side-port frames (:mod:`kv_transfer.frames`: 4-byte length, JSON):

* ``{"op": "fetch", "offer": HEX, "backend": NAME, "descriptor": B64, "pages": N, "skip": K}``:
  the decode claims an offer. The prefill exposes the offer's blocks to the
  peer that ``descriptor`` names and answers ``{"ok": true, "remote": B64,
  "descriptor": B64}`` (the exposure, and its own descriptor), or
  ``{"ok": false, "error": KIND, "message": ...}``.
* ``{"op": "release", "offer": HEX}``: the decode will not read (its request
  was aborted). Idempotent.
* ``{"op": "stats"}``: the worker's counters and pool gauges.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .. import DescriptorError
from ..frames import ProtocolError, _b64, _field, _json, _uint, check_shape

#: Largest side-port frame (a NIXL descriptor is the largest field).
MAX_SIDE_FRAME = 4 << 20
#: Most blocks one request's params may name (vLLM's max_model_len / block size is far below).
MAX_BLOCKS = 1 << 16
#: Most backends an offer may list.
MAX_BACKENDS = 8
#: Most workers (tensor-parallel ranks) an offer may name.
MAX_TP = 256
_OFFER = re.compile(r"[0-9a-f]{32}\Z")
_BACKEND = re.compile(r"[a-z][a-z0-9-]{0,15}\Z")


class ParamsError(DescriptorError):
    """``kv_transfer_params`` that cannot be an offer of ours."""


@dataclass(frozen=True)
class Offer:
    """Where a request's prefilled blocks wait (the prefill's answer, in
    ``kv_transfer_params``): the capability ``offer`` (128 random bits; the
    first decode that presents it is the one the blocks are exposed to),
    the side port of the prefill's first worker (worker ``r`` of ``tp``
    listens on ``port + r``, each over its own shard of the blocks), the
    backends it serves and the blocks."""

    offer: str
    host: str
    port: int
    backends: Sequence[str]
    blocks: Sequence[int]
    tokens: int
    #: The prefill's tensor-parallel size (its workers, one shard each).
    tp: int = 1

    def to_params(self) -> Dict[str, Any]:
        """The decode's ``kv_transfer_params`` (vLLM's own keys, plus ours)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(self.blocks),
            "remote_num_tokens": self.tokens,
            "kvt_offer": self.offer,
            "kvt_host": self.host,
            "kvt_port": self.port,
            "kvt_backends": list(self.backends),
            "kvt_tp": self.tp,
        }


def is_offer(params: Optional[Dict[str, Any]]) -> bool:
    """Whether ``params`` claim to carry an offer (to be parsed, maybe refused)."""
    return isinstance(params, dict) and "kvt_offer" in params


def parse_offer(params: Any) -> Offer:
    """The offer in a decode request's ``kv_transfer_params``, checked field
    by field (the client may have written anything there)."""
    if not isinstance(params, dict):
        raise ParamsError("kv_transfer_params must be an object")
    try:
        offer = _field(params, "kvt_offer", str)
        if not _OFFER.match(offer):
            raise ParamsError("kvt_offer must be 32 lower-case hex digits")
        host = _field(params, "kvt_host", str)
        if not 0 < len(host) <= 253 or any(c.isspace() for c in host):
            raise ParamsError("kvt_host is not a host name or address")
        port = _uint(params, "kvt_port", 1 << 16)
        if port == 0:
            raise ParamsError("kvt_port 0")
        backends = _field(params, "kvt_backends", list)
        if not 0 < len(backends) <= MAX_BACKENDS or not all(isinstance(b, str) and _BACKEND.match(b) for b in backends):
            raise ParamsError("kvt_backends must list 1 to 8 backend names")
        blocks = _field(params, "remote_block_ids", list)
        if len(blocks) > MAX_BLOCKS or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < (1 << 31) for b in blocks):
            raise ParamsError("remote_block_ids must be block ids")
        if len(set(blocks)) != len(blocks):
            raise ParamsError("remote_block_ids repeats a block")
        tokens = _uint(params, "remote_num_tokens", 1 << 31)
        # Absent in offers of a one-worker prefill from before TP > 1.
        tp = _uint(params, "kvt_tp", MAX_TP + 1) if "kvt_tp" in params else 1
        if tp == 0 or port + tp - 1 >= 1 << 16:
            raise ParamsError(f"kvt_tp {tp}: 1 to {MAX_TP} workers, each on a side port from kvt_port")
    except ProtocolError as e:
        raise ParamsError(f"kv_transfer_params: {e}") from None
    return Offer(offer, host, port, tuple(backends), tuple(blocks), tokens, tp)


# --- side port ---------------------------------------------------------------


@dataclass(frozen=True)
class Fetch:
    offer: str
    backend: str
    descriptor: bytes
    pages: int
    #: The offer's first ``skip`` blocks are not wanted (the decode's prefix
    #: cache holds them): only the ``pages`` after them are exposed.
    skip: int = 0


@dataclass(frozen=True)
class Release:
    offer: str


@dataclass(frozen=True)
class Stats:
    pass


def parse_request(data: bytes) -> Any:
    """One side-port request: :class:`Fetch`, :class:`Release` or :class:`Stats`."""
    check_shape(data, max_bytes=MAX_SIDE_FRAME, max_objects=1, max_lists=0, max_values=8)
    obj = _json(data)
    op = _field(obj, "op", str)
    if op == "stats":
        return Stats()
    offer = _field(obj, "offer", str)
    if not _OFFER.match(offer):
        raise ProtocolError("offer must be 32 lower-case hex digits")
    if op == "release":
        return Release(offer)
    if op == "fetch":
        backend = _field(obj, "backend", str)
        if not _BACKEND.match(backend):
            raise ProtocolError("not a backend name")
        descriptor = _b64(obj, "descriptor")
        assert descriptor is not None
        if not descriptor:
            raise ProtocolError("empty descriptor")
        skip = _uint(obj, "skip", MAX_BLOCKS + 1) if "skip" in obj else 0
        return Fetch(offer, backend, descriptor, _uint(obj, "pages", MAX_BLOCKS + 1), skip)
    raise ProtocolError(f"unknown op {op[:32]!r}")


def fetch_request(offer: str, backend: str, descriptor: bytes, pages: int, skip: int = 0) -> bytes:
    req = {"op": "fetch", "offer": offer, "backend": backend, "descriptor": base64.b64encode(descriptor).decode(),
           "pages": pages}
    if skip:
        req["skip"] = skip
    return json.dumps(req).encode()


def release_request(offer: str) -> bytes:
    return json.dumps({"op": "release", "offer": offer}).encode()


def ok(**fields: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {"ok": True}
    for k, v in fields.items():
        out[k] = base64.b64encode(v).decode() if isinstance(v, (bytes, bytearray)) else v
    return out


def refused(kind: str, message: str) -> Dict[str, Any]:
    return {"ok": False, "error": kind, "message": message[:512]}


class Refused(DescriptorError):
    """The prefill refused a fetch (``kind``: ``unknown_offer``, ``claimed``,
    ``released``, ``backend``, ``pages``, ``expose``, ``peer``, ``bad_request``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def parse_ok(data: bytes, max_lists: int = 0) -> Dict[str, Any]:
    """A side port's answer as a dict if it says ``ok``, else :class:`Refused`."""
    check_shape(data, max_bytes=MAX_SIDE_FRAME, max_objects=64, max_lists=max_lists, max_values=1024)
    obj = _json(data)
    if obj.get("ok") is not True:
        raise Refused(str(obj.get("error", "bad_reply"))[:64], str(obj.get("message", ""))[:512])
    return obj


def parse_fetch_reply(data: bytes) -> List[bytes]:
    """``[remote, descriptor]`` of a fetch's answer, or :class:`Refused`."""
    obj = parse_ok(data)
    remote, descriptor = _b64(obj, "remote"), _b64(obj, "descriptor")
    assert remote is not None and descriptor is not None
    return [remote, descriptor]
