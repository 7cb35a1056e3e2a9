"""The control messages of ``kv_transfer.sglang``: the bootstrap registration
(prefill -> bootstrap server -> decode) and the per-request metadata (decode
-> prefill). Both come from the network, so both are parsed here, bounded and
checked field by field; anything else is a :class:`ProtocolError` and changes
nothing (no lease, no page, no peer).

Frames on the control socket are a 4-byte big-endian length and that many
bytes of UTF-8 JSON.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..frames import (  # noqa: F401  (re-exported: the control port and tests use wire.*)
    ProtocolError,
    _b64,
    _field,
    _json,
    _uint,
    check_shape,
    recv_frame,
    send_frame,
)

#: Largest control frame accepted (an exposure of many pages and buffers fits).
from ..frames import MAX_FRAME  # noqa: E402,F401
#: Largest registration accepted (a descriptor and the buffers' item lengths).
MAX_REGISTRATION = 4 << 20
#: Most JSON values a metadata message may hold (its fields and state exposures),
#: counted on the raw bytes before parsing.
MAX_METADATA_VALUES = 128
#: Most JSON values a registration may hold (fields and item lengths).
MAX_REGISTRATION_VALUES = 16384
#: Most buffers a registration may describe.
MAX_BUFFERS = 4096
#: Most state types (SGLang's StateType: Mamba, SWA, ...) a message may name.
MAX_STATE_TYPES = 64


def _lens(obj: Dict[str, Any], name: str) -> List[int]:
    v = _field(obj, name, list)
    if len(v) > MAX_BUFFERS or any(not isinstance(x, int) or isinstance(x, bool) or x <= 0 for x in v):
        raise ProtocolError(f"field {name!r} must list at most {MAX_BUFFERS} positive ints")
    return v


@dataclass(frozen=True)
class Registration:
    """A prefill rank as the bootstrap server publishes it."""

    rank: int
    ctrl_host: str
    ctrl_port: int
    backend: str
    descriptor: bytes
    page_size: int
    kv_item_lens: List[int]
    aux_item_lens: List[int]
    #: Per state type (Mamba, SWA, ...), its buffers' item lengths.
    state_item_lens: List[List[int]] = ()  # type: ignore[assignment]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "ctrl_host": self.ctrl_host,
                "ctrl_port": self.ctrl_port,
                "backend": self.backend,
                "descriptor": base64.b64encode(self.descriptor).decode(),
                "page_size": self.page_size,
                "kv_item_lens": self.kv_item_lens,
                "aux_item_lens": self.aux_item_lens,
                "state_item_lens": [list(x) for x in self.state_item_lens],
            }
        ).encode()


def parse_registration(data: bytes) -> Registration:
    """Parses a registration (the server on PUT, the decode side on GET)."""
    check_shape(data, max_bytes=MAX_REGISTRATION, max_objects=1, max_lists=3 + MAX_STATE_TYPES,
                max_values=MAX_REGISTRATION_VALUES)
    obj = _json(data)
    host = _field(obj, "ctrl_host", str)
    if not host or len(host) > 255:
        raise ProtocolError("field 'ctrl_host' must be a host name")
    backend = _field(obj, "backend", str)
    if len(backend) > 32:
        raise ProtocolError("field 'backend' too long")
    return Registration(
        rank=_uint(obj, "rank", 1 << 20),
        ctrl_host=host,
        ctrl_port=_uint(obj, "ctrl_port", 1 << 16),
        backend=backend,
        descriptor=_b64(obj, "descriptor") or b"",
        page_size=_uint(obj, "page_size", 1 << 30),
        kv_item_lens=_lens(obj, "kv_item_lens"),
        aux_item_lens=_lens(obj, "aux_item_lens"),
        state_item_lens=_state_lens(obj),
    )


def _state_lens(obj: Dict[str, Any]) -> List[List[int]]:
    v = obj.get("state_item_lens") or []
    if not isinstance(v, list) or len(v) > MAX_STATE_TYPES:
        raise ProtocolError(f"field 'state_item_lens' must list at most {MAX_STATE_TYPES} state types")
    return [_lens({"x": x}, "x") for x in v]


@dataclass(frozen=True)
class Metadata:
    """Decode -> prefill: where one request's pages are, exposed to the prefill."""

    room: int
    descriptor: bytes
    #: The KV pages' exposure; empty when the decode exposes none (its
    #: prefix cache already holds the request's whole prompt).
    kv: bytes
    aux: Optional[bytes]
    #: Tokens the decode already holds (its prefix cache): the prefill sends the rest.
    prefix_len: int = 0
    #: Per state type, the exposure of the request's state items (None: none of that type).
    state: Tuple[Optional[bytes], ...] = ()

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "type": "metadata",
                "room": self.room,
                "prefix_len": self.prefix_len,
                "descriptor": base64.b64encode(self.descriptor).decode(),
                "kv": base64.b64encode(self.kv).decode(),
                "aux": None if self.aux is None else base64.b64encode(self.aux).decode(),
                "state": [None if x is None else base64.b64encode(x).decode() for x in self.state],
            }
        ).encode()


def parse_metadata(data: bytes, admit: Optional[Callable[[int], None]] = None) -> Metadata:
    """Parses a decode worker's metadata message. ``admit(room)``, if given,
    runs once the room is known and before the exposures are decoded, so a
    refusal there (it raises) costs no base64 decoding."""
    check_shape(data, max_bytes=MAX_FRAME, max_objects=1, max_lists=1, max_values=MAX_METADATA_VALUES)
    obj = _json(data)
    if obj.get("type") != "metadata":
        raise ProtocolError(f"unknown message type {obj.get('type')!r}")
    room = _uint(obj, "room", 1 << 63)
    if admit is not None:
        admit(room)
    return Metadata(
        room=room,
        descriptor=_b64(obj, "descriptor") or b"",
        kv=_b64(obj, "kv") or b"",
        aux=_b64(obj, "aux", optional=True),
        prefix_len=_uint(obj, "prefix_len", 1 << 40) if "prefix_len" in obj else 0,
        state=_state_exposures(obj),
    )


def _state_exposures(obj: Dict[str, Any]) -> Tuple[Optional[bytes], ...]:
    v = obj.get("state") or []
    if not isinstance(v, list) or len(v) > MAX_STATE_TYPES:
        raise ProtocolError(f"field 'state' must list at most {MAX_STATE_TYPES} state exposures")
    return tuple(_b64({"x": x}, "x", optional=True) for x in v)
