"""The floods of the hostile control-plane tests, each run in a child
process of its own so that its peak RSS (VmHWM) is its own:

    python hostile_child.py SCENARIO MODE [N]

prints one JSON line of figures. MODE ``none`` runs the set-up without the
flood (the no-flood control), ``naive`` with the checks off (the old
behaviour, the positive control), ``guarded`` with them on. Loopback only:
the attacker dials from 127.0.0.2, the honest peer from 127.0.0.1. Every
loop is bounded in count and time.
"""

from __future__ import annotations

import ctypes
import http.client
import itertools
import json
import os
import socket
import struct
import sys
import threading
import time

import kv_transfer
from kv_transfer.sglang import wire
from kv_transfer.sglang.bootstrap import BootstrapServer, RegistryLimits
from kv_transfer import peers
from kv_transfer.peers import ControlPlane, PlaneLimits
from kv_transfer.sglang.control import PrefillControlPlane, RoomLimits
from kv_transfer.ports import ServerLimits

ATTACKER = "127.0.0.2"
HONEST = "127.0.0.1"
#: Caps the floods are run against (each flood is at least 10x its cap).
ROOM_CAP = 8
CONN_CAP_PER_ADDRESS = 4
CONN_CAP = 16
RANK_CAP_PER_ADDRESS = 8
#: The frame bytes one address may have in flight in the byte-budget flood.
BYTE_CAP_PER_ADDRESS = 8 << 20
#: The drip: a byte per connection this often, for this long; the deadline cuts before.
DRIP_EVERY_S = 0.3
DRIP_FOR_S = 3.0
IDLE_S = 0.5
DEADLINE_S = 1.0


def pipe(a: socket.socket, b: socket.socket, chunks: int = 100000) -> None:
    """A relay's one direction: what ``a`` sends goes to ``b`` (at most
    ``chunks`` reads), then both are shut down."""
    try:
        for _ in range(chunks):  # bounded
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def dial(port: int, source: str, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout, source_address=(source, 0))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


class RawPeer:
    """A peer that speaks the control plane's wire by hand (as an attacker
    would): the handshake under the cluster key (the deployment's: in these
    tests single-host mode, so anyone can), then sealed frames."""

    def __init__(self, port: int, source: str, name: str, key=None, dialed: str = "", timeout: float = 5.0):
        self.s = dial(port, source, timeout)
        key = key if key is not None else kv_transfer.ClusterKey.from_env()
        hs, hello = kv_transfer.PeerHandshake.dial(key, peers.CONTEXT, name, "", dialed or f"127.0.0.1:{port}")
        self.s.sendall(hello)
        header = _recv_exact(self.s, kv_transfer.handshake_header_len())
        challenge = header + _recv_exact(self.s, kv_transfer.handshake_body_len(header))
        self.session, finish = hs.on_challenge(challenge)
        self.s.sendall(finish)
        self.ids = itertools.count(1)

    def frame(self, body: bytes) -> bytes:
        hdr = peers._HDR.pack(len(body), next(self.ids), peers.REQUEST)
        return hdr + body + self.session.seal(hdr + body)

    def request(self, body: bytes) -> tuple:
        """One request and its answer: (kind, body), the answer's tag checked."""
        self.s.sendall(self.frame(body))
        hdr = _recv_exact(self.s, peers._HDR.size)
        n, _, kind = peers._HDR.unpack(hdr)
        rest = _recv_exact(self.s, n + peers.TAG_LEN)
        self.session.open(hdr + rest[:n], rest[n:])
        return kind, rest[:n]

    def ask(self, body: bytes) -> dict:
        """One request and its answer: the JSON reply, or ``{"error": text}``."""
        kind, reply = self.request(body)
        if kind == peers.ERROR:
            return {"error": reply.decode(errors="replace")}
        return json.loads(reply)

    def close(self) -> None:
        self.s.close()


def ask(port: int, payload: bytes, source: str) -> dict:
    """One request on a connection of its own, under a name per address."""
    p = RawPeer(port, source, f"peer-{source}")
    try:
        return p.ask(payload)
    finally:
        p.close()


class Pair:
    """A decode and a prefill on tcp-sim, ``buffers`` KV buffers of ``pages`` pages."""

    def __init__(self, pages: int, buffers: int = 4, item: int = 64):
        self.keep = []
        self.decode = kv_transfer.Endpoint("tcp-sim", f"hd-{os.getpid()}")
        self.prefill = kv_transfer.Endpoint("tcp-sim", f"hp-{os.getpid()}")
        self.dpool = self.decode.register(self._bufs(pages, buffers, item))
        self.ppool = self.prefill.register(self._bufs(pages, buffers, item))
        self.peer = self.decode.add_peer(self.prefill.descriptor())

    def _bufs(self, pages: int, buffers: int, item: int):
        out = []
        for _ in range(buffers):
            b = ctypes.create_string_buffer(pages * item)
            self.keep.append(b)
            out.append((ctypes.addressof(b), pages * item, item))
        return out

    def metadata(self, room: int, remote) -> bytes:
        return wire.Metadata(room=room, descriptor=bytes(self.decode.descriptor()), kv=bytes(remote.to_bytes()),
                             aux=None).to_json()


def scenario_rooms(mode: str, n: int) -> dict:
    """Attack 12a: metadata for made-up rooms, replaying one big exposure."""
    pair = Pair(pages=16384)
    lease = pair.dpool.reserve(list(range(16384)))
    remote = pair.decode.expose(lease, pair.peer)
    frame_len = len(pair.metadata(0, remote))
    limits = RoomLimits(max_pending_per_peer=ROOM_CAP, max_pending_bytes_per_peer=ROOM_CAP * frame_len * 2,
                        enforce=mode != "naive")
    plane = PrefillControlPlane(pair.prefill, pair.ppool, room_limits=limits)
    port = plane.address[1]
    rss0 = status_kib("VmRSS")
    refused = accepted = 0
    t_end = time.monotonic() + 120
    if mode != "none":
        attacker = RawPeer(port, ATTACKER, "attacker")
        for i in range(n):
            if time.monotonic() > t_end:
                break
            r = attacker.ask(pair.metadata(1_000_000 + i, remote))
            accepted += "ok" in r
            refused += "error" in r
        attacker.close()
    rss1 = status_kib("VmRSS")
    # The honest peer: a room a sender exists for, from its own address.
    honest_room = 77
    plane.expect_room(honest_room)
    t0 = time.perf_counter()
    r = ask(port, pair.metadata(honest_room, remote), HONEST)
    honest_ms = (time.perf_counter() - t0) * 1000
    out = {
        "frame_bytes": frame_len,
        "flood": n if mode != "none" else 0,
        "accepted": accepted,
        "refused": refused,
        "honest_ok": "ok" in r and plane.target_of(honest_room) is not None,
        "honest_ms": honest_ms,
        "rss_growth_kib": rss1 - rss0,
        "hwm_kib": status_kib("VmHWM"),
        "stats": plane.stats(),
    }
    plane.close()
    lease.abort()
    return out


def scenario_frame(mode: str, n: int) -> dict:
    """Attack 12b: one frame of ``[{},{},...]`` of ``n`` MiB."""
    pair = Pair(pages=8)
    plane = PrefillControlPlane(pair.prefill, pair.ppool)
    port = plane.address[1]
    payload = b"[" + b"{}," * ((n << 20) // 3) + b"{}]"
    hwm0 = status_kib("VmHWM")
    reply = None
    if mode == "naive":
        # The old parser: json.loads first, size and shape checked after.
        try:
            obj = json.loads(payload)
            reply = {"error": f"parsed {len(obj)} values before refusing" if not isinstance(obj, dict) else "?"}
            del obj
        except ValueError as e:
            reply = {"error": str(e)}
    elif mode == "guarded":
        reply = ask(port, payload, ATTACKER)
    hwm1 = status_kib("VmHWM")
    lease = pair.dpool.reserve([1])
    remote = pair.decode.expose(lease, pair.peer)
    plane.expect_room(5)
    t0 = time.perf_counter()
    r = ask(port, pair.metadata(5, remote), HONEST)
    honest_ms = (time.perf_counter() - t0) * 1000
    out = {
        "payload_bytes": len(payload),
        "reply": reply,
        "hwm_growth_kib": hwm1 - hwm0,
        "hwm_kib": hwm1,
        "honest_ok": "ok" in r,
        "honest_ms": honest_ms,
        "stats": plane.stats(),
    }
    plane.close()
    lease.abort()
    return out


def _handled(stats: dict, prefix: str) -> int:
    if prefix == "ctrl":  # the control plane counts every connection it took from the listener
        return stats.get("ctrl_connections", 0)
    return sum(stats[f"{prefix}_{k}"] for k in ("accepted", "refused_busy", "refused_per_address"))


def _drip(port: int, n: int, header: bytes, handled) -> dict:
    """``n`` connections from the attacker, each a byte every DRIP_EVERY_S
    (also while the rest are still being dialled); ``handled()`` says how
    many the server has accepted or refused. Samples are taken once all are
    dialled, so every connection is older than the sample's time."""
    socks: list = []
    sent: list = []
    last: list = []
    open_: list = []
    refused_at_once = 0

    def tick() -> None:
        now = time.monotonic()
        for i, s in enumerate(socks):
            if open_[i] and now - last[i] >= DRIP_EVERY_S:
                try:
                    s.send(header[sent[i] % len(header):][:1])
                    sent[i] += 1
                    last[i] = now
                except OSError:
                    open_[i] = False

    for i in range(n):
        try:
            socks.append(dial(port, ATTACKER, 2.0))
            sent.append(0)
            last.append(0.0)
            open_.append(True)
        except OSError:
            refused_at_once += 1
        if i % 16 == 15:
            # Let the accept loop keep up (the listen backlog is no part of the test), bounded.
            t_end = time.monotonic() + 2.0
            while handled() < len(socks) and time.monotonic() < t_end:
                time.sleep(0.002)
        tick()
    start = time.monotonic()
    samples = []
    next_sample = start
    while time.monotonic() - start < DRIP_FOR_S:  # bounded in time; each pass bounded by n
        tick()
        if time.monotonic() >= next_sample:
            samples.append((round(time.monotonic() - start, 2), threading.active_count(), sum(open_)))
            next_sample += DRIP_EVERY_S
        time.sleep(0.02)
    # One more pass: a connection the server cut answers with an error or EOF.
    for i, s in enumerate(socks):
        s.setblocking(False)
        try:
            if open_[i] and s.recv(1) == b"":
                open_[i] = False
        except BlockingIOError:
            pass
        except OSError:
            open_[i] = False
    left_open = sum(open_)
    for s in socks:
        s.close()
    return {"samples": samples, "left_open_after_s": round(time.monotonic() - start, 2), "left_open": left_open,
            "dialled": len(socks), "refused_at_dial": refused_at_once,
            "threads_past_deadline": max(t for ts, t, _ in samples if ts > DEADLINE_S + 0.5)}


def _limits(mode: str) -> ServerLimits:
    if mode == "naive":
        return ServerLimits(idle_timeout_s=IDLE_S, enforce=False)
    return ServerLimits(max_connections=CONN_CAP, max_per_address=CONN_CAP_PER_ADDRESS, idle_timeout_s=IDLE_S,
                        message_deadline_s=DEADLINE_S)


def _plane_limits(mode: str) -> PlaneLimits:
    if mode == "naive":  # the positive control: no caps on handshakes, no deadline to speak of
        return PlaneLimits(max_handshakes=1 << 30, max_handshakes_per_address=1 << 30, handshake_deadline_s=3600.0)
    return PlaneLimits(max_handshakes=CONN_CAP, max_handshakes_per_address=CONN_CAP_PER_ADDRESS,
                       handshake_deadline_s=DEADLINE_S)


def scenario_drip_ctrl(mode: str, n: int) -> dict:
    """Attack 12c: connections to the control port that drip a byte at a time."""
    pair = Pair(pages=8)
    cp = ControlPlane("prefill", limits=_plane_limits(mode))
    plane = PrefillControlPlane(pair.prefill, pair.ppool, plane=cp)
    port = plane.address[1]
    lease = pair.dpool.reserve([1])
    remote = pair.decode.expose(lease, pair.peer)
    plane.expect_room(5)
    base_threads = threading.active_count()
    rss0 = status_kib("VmRSS")
    honest: dict = {}

    def honest_peer() -> None:
        time.sleep(DEADLINE_S + 0.5)  # in the thick of the flood
        t0 = time.perf_counter()
        r = ask(plane.address[1], pair.metadata(5, remote), HONEST)
        honest.update(ok="ok" in r, ms=(time.perf_counter() - t0) * 1000)

    h = threading.Thread(target=honest_peer)
    h.start()
    drip = _drip(port, n, struct.pack(">I", 100) + b"x" * 100,
                 lambda: _handled(plane.stats(), "ctrl")) if mode != "none" else {}
    h.join(30)
    out = {"base_threads": base_threads, "drip": drip, "honest": honest, "rss_growth_kib": status_kib("VmRSS") - rss0,
           "hwm_kib": status_kib("VmHWM"), "stats": plane.stats()}
    plane.close()
    cp.close()
    lease.abort()
    return out


def scenario_drip_bootstrap(mode: str, n: int) -> dict:
    """Attack 13's port: connections to the bootstrap server that drip a header."""
    server = BootstrapServer("127.0.0.1", 0, server_limits=_limits(mode))
    reg = wire.Registration(rank=0, ctrl_host="127.0.0.1", ctrl_port=1, backend="tcp-sim", descriptor=b"d",
                            page_size=1, kv_item_lens=[64], aux_item_lens=[])
    code, _ = server.registry.put(reg.to_json(), None, HONEST)
    base_threads = threading.active_count()
    rss0 = status_kib("VmRSS")
    honest: dict = {}

    def honest_peer() -> None:
        time.sleep(DEADLINE_S + 0.5)
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5, source_address=(HONEST, 0))
        c.request("GET", "/route?rank=0")
        resp = c.getresponse()
        honest.update(ok=resp.status == 200 and resp.read() == reg.to_json(), ms=(time.perf_counter() - t0) * 1000)
        c.close()

    h = threading.Thread(target=honest_peer)
    h.start()
    drip = _drip(server.port, n, b"GET /route?rank=0 HTTP/1.1\r\nX-Pad: " + b"a" * 64,
                 lambda: _handled(server.stats(), "bootstrap")) if mode != "none" else {}
    h.join(30)
    out = {"put": code, "base_threads": base_threads, "drip": drip, "honest": honest,
           "rss_growth_kib": status_kib("VmRSS") - rss0, "hwm_kib": status_kib("VmHWM"), "stats": server.stats()}
    server.close()
    return out


def scenario_ranks(mode: str, n: int) -> dict:
    """A registration flood: ``n`` made-up ranks from the attacker's address."""
    limits = RegistryLimits(max_ranks_per_address=RANK_CAP_PER_ADDRESS)
    if mode == "naive":
        limits = RegistryLimits(max_ranks_per_address=1 << 30, max_ranks=1 << 30, first_writer_wins=False)
    server = BootstrapServer("127.0.0.1", 0, registry_limits=limits)
    rss0 = status_kib("VmRSS")
    big = b"\x01" * (256 << 10)  # a 256 KiB descriptor each
    codes: dict = {}
    if mode != "none":
        for i in range(n):
            reg = wire.Registration(rank=1000 + i, ctrl_host="127.0.0.2", ctrl_port=1, backend="tcp-sim",
                                    descriptor=big, page_size=1, kv_item_lens=[64], aux_item_lens=[])
            c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5, source_address=(ATTACKER, 0))
            c.request("PUT", "/route", body=reg.to_json())
            st = c.getresponse().status
            c.close()
            codes[st] = codes.get(st, 0) + 1
    honest = wire.Registration(rank=0, ctrl_host="127.0.0.1", ctrl_port=1, backend="tcp-sim", descriptor=b"d",
                               page_size=1, kv_item_lens=[64], aux_item_lens=[])
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5, source_address=(HONEST, 0))
    c.request("PUT", "/route", body=honest.to_json())
    st = c.getresponse().status
    c.close()
    out = {"codes": {str(k): v for k, v in codes.items()}, "honest_status": st,
           "honest_ms": (time.perf_counter() - t0) * 1000, "rss_growth_kib": status_kib("VmRSS") - rss0,
           "hwm_kib": status_kib("VmHWM"), "stats": server.stats()}
    server.close()
    return out


def scenario_declared(mode: str, n: int) -> dict:
    """Frames that declare 4 MiB each, send 1 MiB of it and stall: ``n``
    authenticated connections under the attacker's one name, against a
    per-peer byte budget of BYTE_CAP_PER_ADDRESS and two connections per
    peer (the positive control: no caps)."""
    pair = Pair(pages=8)
    if mode == "naive":
        limits = PlaneLimits(max_links_per_peer=1 << 30, max_inflight_bytes_per_peer=1 << 40, max_inflight_bytes=1 << 40)
    else:
        limits = PlaneLimits(max_inflight_bytes_per_peer=BYTE_CAP_PER_ADDRESS)
    cp = ControlPlane("prefill", limits=limits)
    plane = PrefillControlPlane(pair.prefill, pair.ppool, plane=cp)
    port = plane.address[1]
    lease = pair.dpool.reserve([1])
    remote = pair.decode.expose(lease, pair.peer)
    plane.expect_room(5)
    rss0 = status_kib("VmRSS")
    socks, refused = [], 0
    chunk = b"x" * (1 << 20)
    t_end = time.monotonic() + 30
    if mode != "none":
        for _ in range(n):
            if time.monotonic() > t_end:
                break
            try:
                p = RawPeer(port, ATTACKER, "attacker")
            except (OSError, kv_transfer.KvTransferError):
                refused += 1
                continue
            try:
                p.s.sendall(peers._HDR.pack(4 << 20, 1, peers.REQUEST) + chunk)
            except OSError:
                pass
            socks.append(p.s)
        time.sleep(0.5)  # the server reads what arrived
        for s in socks:  # a refused connection was closed: EOF
            s.settimeout(0.05)
            try:
                refused += s.recv(4096) == b""
            except OSError as e:
                refused += not isinstance(e, socket.timeout)
    rss1 = status_kib("VmRSS")
    t0 = time.perf_counter()
    r = ask(port, pair.metadata(5, remote), HONEST)
    honest_ms = (time.perf_counter() - t0) * 1000
    stats = plane.stats()
    for s in socks:
        s.close()
    out = {"connections": len(socks), "refused": refused, "rss_growth_kib": rss1 - rss0, "hwm_kib": status_kib("VmHWM"),
           "honest_ok": "ok" in r, "honest_ms": honest_ms, "stats": stats}
    plane.close()
    cp.close()
    lease.abort()
    return out


SCENARIOS = {
    "declared": scenario_declared,
    "rooms": scenario_rooms,
    "frame": scenario_frame,
    "drip_ctrl": scenario_drip_ctrl,
    "drip_bootstrap": scenario_drip_bootstrap,
    "ranks": scenario_ranks,
}

if __name__ == "__main__":
    name, mode = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    print(json.dumps(SCENARIOS[name](mode, n)), flush=True)
