"""Length-prefixed JSON frames and the checks every message from the
network goes through before it is believed: a frame is a 4-byte big-endian
length and that many bytes of UTF-8 JSON; its size is checked (and charged
to the port's byte budget) before a byte of the body is read, its shape
counted on the raw bytes before parsing, and each field typed on the way
out. Anything else is a :class:`ProtocolError` and changes nothing.

Shared by :mod:`kv_transfer.sglang.wire` and :mod:`kv_transfer.vllm.wire`.
"""

from __future__ import annotations

import base64
import binascii
import json
import socket
import struct
from typing import Any, Callable, Dict, Optional

from . import DescriptorError

#: Largest frame a port accepts by default.
MAX_FRAME = 64 << 20


class ProtocolError(DescriptorError):
    """A malformed or hostile control message or registration."""


def _field(obj: Dict[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    if name not in obj or obj[name] is None:
        if optional:
            return None
        raise ProtocolError(f"missing field {name!r}")
    v = obj[name]
    # bool is an int in Python: refuse it where an int is meant.
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ProtocolError(f"field {name!r} must be {kind.__name__}, not {type(v).__name__}")
    return v


def _b64(obj: Dict[str, Any], name: str, *, optional: bool = False) -> Optional[bytes]:
    v = _field(obj, name, str, optional=optional)
    if v is None:
        return None
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"field {name!r} is not base64: {e}") from None


def check_shape(data: bytes, *, max_bytes: int, max_objects: int, max_lists: int, max_values: int) -> None:
    """Refuses, before any parsing, a message whose size or shape cannot be
    a well-formed one: parsing ``[{},{},...]`` costs some 30 times its size
    in Python objects, so the containers and values are counted on the raw
    bytes (C-speed ``bytes.count``) first. Counting also inside strings
    only errs towards refusing: the strings of well-formed messages are
    base64, host and backend names, which hold neither brackets nor commas."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} B exceeds {max_bytes} B")
    objects, lists, values = data.count(b"{"), data.count(b"["), data.count(b",") + 1
    if objects > max_objects or lists > max_lists or values > max_values:
        raise ProtocolError(
            f"message shape refused before parsing: {objects} objects, {lists} lists, {values} values "
            f"(at most {max_objects}, {max_lists}, {max_values})"
        )


def _json(data: bytes) -> Dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a JSON object")
    return obj


def _uint(obj: Dict[str, Any], name: str, limit: int = 1 << 62) -> int:
    v = _field(obj, name, int)
    if not 0 <= v < limit:
        raise ProtocolError(f"field {name!r} out of range: {v}")
    return v


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    # Grows with what arrives (never allocates the declared size up front):
    # a peer that declares 64 MiB and sends 10 bytes holds 10 bytes.
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed mid-frame")
        buf += chunk
    return bytes(buf) if n < (1 << 16) else buf  # type: ignore[return-value]  (bytes-like, no copy)


def recv_frame(
    sock: socket.socket, max_frame: int = MAX_FRAME, reserve: Optional[Callable[[int], Optional[str]]] = None
) -> bytes:
    """One frame. Its declared size is checked (and, with ``reserve``,
    charged to a byte budget that may refuse it) before a byte of the body
    is read or allocated."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > max_frame:
        raise ProtocolError(f"frame of {n} B exceeds {max_frame} B")
    if reserve is not None:
        why = reserve(n)
        if why is not None:
            raise ProtocolError(why)
    return _recv_exact(sock, n)
