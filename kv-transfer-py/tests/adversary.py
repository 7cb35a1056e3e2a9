"""The attackers of the adversary soak (``test_adversary_soak.py``), each
role in a child process of its own so that the honest process's RSS,
threads and fds are its own:

    python adversary.py CONFIG.json OUT.json

``CONFIG.json`` names the honest ports, the seed, how long to run, the
source addresses to dial from (127.0.0.2..127.0.0.9 on loopback), the role
(``outsider``: no cluster key, no bootstrap secret; ``insider``: holds the
cluster key under made-up names, rule 9's attacker) and the mode
(``attack``, or ``positive``: the same attacker code with the right key and
secret, which must get through). The child writes ``READY {json}`` to
stdout once its own ports (a relay, a fake bootstrap, a silent side port)
listen, then attacks until its time is up and writes its tally to
``OUT.json``: per attack kind, attempts, refusals, gains (anything the
attack was after: a session, an answer with honest bytes, a registration, a
connection held past its deadline), and foreign bytes seen.

Every loop is bounded in count and time; every socket has a timeout;
loopback only. Nothing here is honest code: it speaks the public wire
formats by hand, as an attacker would.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import secrets
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional

import kv_transfer
from kv_transfer import peers
from kv_transfer.sglang import bootstrap
from kv_transfer.sglang import wire as sgl_wire
from kv_transfer.vllm import wire as vllm_wire

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostile_child import RawPeer, _recv_exact, pipe  # noqa: E402

#: Attack kinds by role; ``test_adversary_soak`` checks every one was attempted and refused.
OUTSIDER_KINDS = [
    "wrong_key",  # a handshake under another cluster key (every control-plane port)
    "replayed_handshake",  # a recorded HELLO sent again (every control-plane port)
    "no_handshake",  # a request frame as the first bytes (every control-plane port)
    "drip",  # connections that drip a header a byte at a time (every port, bootstrap included)
    "boot_impostor_put",  # PUT /route for the honest rank (and made-up ranks) without the secret
    "boot_bad_mac",  # PUT /route with a real challenge and a MAC under a guessed secret
    "boot_lookup_mac",  # a lookup answer's MAC (nonce = a challenge) presented as a registration's
    "boot_replayed_put",  # the honest prefill's recorded, valid PUT replayed
    "boot_challenge_flood",  # GET /challenge past the per-address cap
]
INSIDER_KINDS = [
    "many_names",  # key-holding made-up names held idle past the peer cap
    "pipeline_flood",  # one name pipelining 10x its in-flight cap on a slow handler
    "declared_bytes",  # frames declaring 4 MiB, 256 KiB sent, stalled, past the per-name budget
    "oversize_frame",  # a frame header past max_frame
    "forged_tag",  # a frame whose tag is not the session's
    "unexpected_kind",  # a REPLY frame sent to a listener
    "made_up_rooms",  # SGLang metadata for rooms nobody has, past the per-peer pending cap
    "empty_objects_frame",  # SGLang control: a [{},{},...] frame
    "side_guessed_offer",  # vLLM side port: fetch / release of guessed offer ids, many descriptor spellings
    "side_leaked_offer",  # vLLM side port: release / fetch of the honest decode's (leaked) claimed offers
]

#: A byte every this often on a dripping connection; the ports cut it at their deadline.
DRIP_EVERY_S = 0.3
#: Connections one drip attempt opens from one address (above the per-address caps of 4).
DRIP_CONNS = 6


class Tally:
    def __init__(self) -> None:
        self.attempts: Dict[str, int] = defaultdict(int)
        self.refused: Dict[str, int] = defaultdict(int)
        self.gained: Dict[str, int] = defaultdict(int)
        self.inconclusive: Dict[str, int] = defaultdict(int)
        self.refused_at_cap: Dict[str, int] = defaultdict(int)
        self.ports: Dict[str, set] = defaultdict(set)
        self.sources: set = set()
        self.names: set = set()
        self.foreign_bytes = 0
        self.sessions = 0  # handshakes this child completed (an outsider: none, unless positive)
        self.notes: List[str] = []
        self.lock = threading.Lock()

    def out(self, kind: str, what: str, port: str = "", src: str = "") -> None:
        with self.lock:
            getattr(self, what)[kind] += 1
            if port:
                self.ports[kind].add(port)
            if src:
                self.sources.add(src)

    def note(self, s: str) -> None:
        with self.lock:
            if len(self.notes) < 20:
                self.notes.append(s[:300])

    def to_json(self) -> dict:
        kinds = sorted(set(self.attempts) | set(self.refused) | set(self.gained))
        return {
            "kinds": {k: {"attempts": self.attempts[k], "refused": self.refused[k], "gained": self.gained[k],
                          "inconclusive": self.inconclusive[k], "refused_at_cap": self.refused_at_cap[k],
                          "ports": sorted(self.ports[k])} for k in kinds},
            "sources": sorted(self.sources),
            "names": len(self.names),
            "foreign_bytes": self.foreign_bytes,
            "sessions": self.sessions,
            "notes": self.notes,
        }


def dial(port: int, src: str, timeout: float = 3.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout, source_address=(src, 0))


def closed_by_peer(s: socket.socket, wait: float) -> bool:
    """True if the peer closed (or reset) ``s`` within ``wait`` seconds (bytes before the EOF are drained)."""
    end = time.monotonic() + wait
    for _ in range(1000):  # bounded in count and time
        left = end - time.monotonic()
        if left <= 0:
            return False
        s.settimeout(min(left, 0.5))
        try:
            if s.recv(65536) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


class Held:
    """Connections kept open by the attacker (drips, stalled frames, idle
    names): each must be cut by the server by ``cut_by``, or it is a gain."""

    def __init__(self, tally: Tally) -> None:
        self.items: List[dict] = []
        self.tally = tally

    def add(self, kind: str, port: str, s: socket.socket, cut_by: float, drip: Optional[bytes] = None) -> None:
        s.setblocking(False)
        self.items.append({"kind": kind, "port": port, "s": s, "cut_by": cut_by, "drip": drip, "sent": 0,
                           "next": time.monotonic()})

    def service(self, final: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for it in self.items:
            s = it["s"]
            cut = False
            try:
                while True:  # drain what the server sent (a REFUSED, nothing else), bounded by the buffer
                    d = s.recv(65536)
                    if d == b"":
                        cut = True
                        break
                    if len(d) < 65536:
                        break
            except BlockingIOError:
                pass
            except OSError:
                cut = True
            if not cut and it["drip"] is not None and now >= it["next"]:
                try:
                    s.send(it["drip"][it["sent"] % len(it["drip"]):][:1])
                    it["sent"] += 1
                    it["next"] = now + DRIP_EVERY_S
                except BlockingIOError:
                    pass
                except OSError:
                    cut = True
            if cut:
                self.tally.out(it["kind"], "refused", it["port"])
                s.close()
            elif now > it["cut_by"] or final:
                if now > it["cut_by"]:
                    self.tally.out(it["kind"], "gained", it["port"])
                    self.tally.note(f"{it['kind']} on {it['port']}: still open {now - it['cut_by']:.1f} s past its cut")
                else:
                    self.tally.out(it["kind"], "inconclusive", it["port"])
                s.close()
            else:
                keep.append(it)
        self.items = keep


class Attacker:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg["seed"])
        self.tally = Tally()
        self.held = Held(self.tally)
        self.positive = cfg["mode"] == "positive"
        self.sources: List[str] = cfg["sources"]
        self.plane_ports: Dict[str, int] = cfg["plane_ports"]  # echo, ctrl, side
        self.boot_port: int = cfg["boot_port"]
        self.key = kv_transfer.ClusterKey.from_secret(cfg["key_secret"].encode())
        self.boot_secret = cfg["boot_secret"].encode()
        self.hellos = {name: [bytes.fromhex(h) for h in hs] for name, hs in cfg.get("hellos", {}).items()}
        self.recorded_put = cfg.get("recorded_put")
        self.deadlines = cfg["deadlines"]
        self.ids = 0
        self.leak_pos = 0
        self.leaked: List[str] = []
        self._pair: Any = None
        self.stop = False
        self._silent: Optional[socket.socket] = None

    # --- helpers -------------------------------------------------------------
    def src(self) -> str:
        s = self.rng.choice(self.sources)
        return s

    def name(self, prefix: str = "mallory") -> str:
        self.ids += 1
        n = f"{prefix}-{os.getpid()}-{self.ids}"
        self.tally.names.add(n)
        return n

    def check_foreign(self, reply: bytes, mine: bytes) -> None:
        """An echo answer must be this attacker's own name and body, nothing else."""
        if reply != mine:
            self.tally.foreign_bytes += len(reply)
            self.tally.note(f"foreign answer {reply[:80]!r}")

    def http(self, method: str, path: str, src: str, body: Optional[bytes] = None,
             headers: Optional[dict] = None) -> tuple:
        """(status, body, auth); status 0: the server closed the connection unanswered (a cap or a cut)."""
        c = http.client.HTTPConnection("127.0.0.1", self.boot_port, timeout=3, source_address=(src, 0))
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, r.read(1 << 20), r.getheader(bootstrap.AUTH_HEADER)
        except (OSError, http.client.HTTPException):
            return 0, b"", None
        finally:
            c.close()

    def challenge(self, src: str) -> Optional[bytes]:
        status, body, _ = self.http("GET", "/challenge", src)
        if status != 200:
            return None
        return bytes.fromhex(json.loads(body)["challenge"])

    def impostor_reg(self, rank: int) -> bytes:
        return sgl_wire.Registration(rank=rank, ctrl_host="127.0.0.2", ctrl_port=6666, backend="tcp-sim",
                                     descriptor=b"impostor", page_size=1, kv_item_lens=[64],
                                     aux_item_lens=[]).to_json()

    # --- outsider ------------------------------------------------------------
    def wrong_key(self, port_name: str) -> None:
        kind, port, src = "wrong_key", self.plane_ports[port_name], self.src()
        name = self.name("outsider")
        self.tally.out(kind, "attempts", port_name, src)
        try:
            p = RawPeer(port, src, name, key=self.key, timeout=3)
        except kv_transfer.PeerRefused:
            self.tally.out(kind, "refused", port_name)
            return
        except OSError:  # refused at a cap (closed) or cut: no session either
            self.tally.out(kind, "refused", port_name)
            return
        # A session: the key was right (the positive control) or the check is gone.
        self.tally.sessions += 1
        try:
            if port_name == "echo":
                body = b"ping-" + name.encode()
                k, reply = p.request(body)
                if k == peers.REPLY and reply == name.encode() + b":" + body:
                    self.tally.out(kind, "gained", port_name)
                else:
                    self.check_foreign(reply, name.encode() + b":" + body)
                    self.tally.out(kind, "gained", port_name)
            else:
                self.tally.out(kind, "gained", port_name)
        except (OSError, kv_transfer.KvTransferError):
            self.tally.out(kind, "gained", port_name)
        finally:
            p.close()

    def replayed_handshake(self, port_name: str) -> None:
        kind, port, src = "replayed_handshake", self.plane_ports[port_name], self.src()
        pool = self.hellos.get(port_name) or []
        if not pool:
            return
        hello = pool.pop() if len(pool) > 1 else pool[0]
        self.tally.out(kind, "attempts", port_name, src)
        answers = []
        try:
            for _ in range(2):  # first the live HELLO (its positive control: a CHALLENGE), then the replay
                s = dial(port, src)
                try:
                    s.sendall(hello)
                    header = _recv_exact(s, kv_transfer.handshake_header_len())
                    answers.append(header + _recv_exact(s, kv_transfer.handshake_body_len(header)))
                finally:
                    s.close()
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            self.tally.out(kind, "inconclusive", port_name)
            return
        first_challenge = answers[0][5] == 2 or answers[0][5] == 4  # 4: this HELLO was already used once
        if answers[1][5] == 4 and answers[1][-1] == 2 and first_challenge:
            self.tally.out(kind, "refused", port_name)
        elif answers[1][5] == 2:
            self.tally.out(kind, "gained", port_name)  # a replay got a CHALLENGE
            self.tally.note(f"replayed HELLO answered with a CHALLENGE on {port_name}")
        else:
            self.tally.out(kind, "inconclusive", port_name)

    def no_handshake(self, port_name: str) -> None:
        kind, port, src = "no_handshake", self.plane_ports[port_name], self.src()
        self.tally.out(kind, "attempts", port_name, src)
        body = self.rng.choice([b"ABCD", b'{"op": "stats"}', b"\0" * 64])
        try:
            s = dial(port, src)
            try:
                s.sendall(peers._HDR.pack(len(body), 1, peers.REQUEST) + body + b"\0" * peers.TAG_LEN)
                s.settimeout(3)
                got = s.recv(64)
                if got[:4] == b"KVTA" or got == b"":
                    self.tally.out(kind, "refused", port_name)
                else:
                    self.tally.out(kind, "gained", port_name)
                    self.check_foreign(got, b"")
            finally:
                s.close()
        except OSError:
            self.tally.out(kind, "refused", port_name)

    def drip(self, port_name: str) -> None:
        kind, src = "drip", self.src()
        if port_name == "bootstrap":
            port = self.boot_port
            header = b"GET /route?rank=0 HTTP/1.1\r\nX-Pad: " + b"a" * 64
            cut_in = self.deadlines["bootstrap_s"]
        else:
            port = self.plane_ports[port_name]
            header = struct.pack(">I", 100) + b"x" * 100
            cut_in = self.deadlines["handshake_s"]
        for _ in range(DRIP_CONNS):
            self.tally.out(kind, "attempts", port_name, src)
            try:
                s = dial(port, src, 2.0)
            except OSError:
                self.tally.out(kind, "refused", port_name)
                continue
            # Cut by the deadline, plus slack for a loaded 2-core machine.
            self.held.add(kind, port_name, s, time.monotonic() + cut_in + 2.0, drip=header)

    def put_outcome(self, kind: str, status: int) -> None:
        """A PUT's outcome: 200 took effect (a gain); 403 refused by the secret; 0 or 429 refused
        at a cap before the secret was even checked (counted as refused, not as the secret's)."""
        if status == 200:
            self.tally.out(kind, "gained", "bootstrap")
        elif status == 403:
            self.tally.out(kind, "refused", "bootstrap")
        else:
            self.tally.out(kind, "refused_at_cap", "bootstrap")
            self.tally.out(kind, "refused", "bootstrap")

    def boot_impostor_put(self) -> None:
        kind, src = "boot_impostor_put", self.src()
        self.tally.out(kind, "attempts", "bootstrap", src)
        rank = 0 if self.rng.random() < 0.5 else self.rng.randrange(1, 1 << 20)
        status, _, _ = self.http("PUT", "/route", src, self.impostor_reg(rank))
        self.put_outcome(kind, status)

    def boot_bad_mac(self) -> None:
        kind, src = "boot_bad_mac", self.src()
        self.tally.out(kind, "attempts", "bootstrap", src)
        c = self.challenge(src)
        if c is None:  # 429: this address's challenges are spent (the flood); no registration either
            self.tally.out(kind, "refused", "bootstrap")
            return
        body = self.impostor_reg(0)
        headers = {bootstrap.CHALLENGE_HEADER: c.hex(), bootstrap.AUTH_HEADER: bootstrap.put_mac(self.boot_secret, c, body)}
        status, _, _ = self.http("PUT", "/route", src, body, headers)
        self.put_outcome(kind, status)

    def boot_lookup_mac(self) -> None:
        kind, src = "boot_lookup_mac", self.src()
        self.tally.out(kind, "attempts", "bootstrap", src)
        c = self.challenge(src)
        if c is None:
            self.tally.out(kind, "refused", "bootstrap")
            return
        status, body, auth = self.http("GET", f"/route?rank=0&nonce={c.hex()}", src)
        if status != 200 or not auth:
            self.tally.out(kind, "refused", "bootstrap")  # no lookup answer to misuse (a cap)
            return
        # The lookup's MAC over (the challenge as its nonce, the body) presented as a
        # registration's: were the labels one, it would register these bytes without the secret.
        headers = {bootstrap.AUTH_HEADER: auth, bootstrap.CHALLENGE_HEADER: c.hex()}
        status, _, _ = self.http("PUT", "/route", src, body, headers)
        self.put_outcome(kind, status)

    def boot_replayed_put(self) -> None:
        kind, src = "boot_replayed_put", self.src()
        if not self.recorded_put:
            return
        self.tally.out(kind, "attempts", "bootstrap", src)
        body = bytes.fromhex(self.recorded_put["body"])
        status, _, _ = self.http("PUT", "/route", src, body, self.recorded_put["headers"])
        self.put_outcome(kind, status)

    def boot_challenge_flood(self) -> None:
        kind, src = "boot_challenge_flood", self.src()
        self.tally.out(kind, "attempts", "bootstrap", src)
        codes: Dict[int, int] = defaultdict(int)
        for _ in range(self.cfg["challenge_flood"]):
            codes[self.http("GET", "/challenge", src)[0]] += 1
        # Refused: past the per-address cap the server says 429 (or drops the connection).
        self.tally.out(kind, "refused" if codes[429] + codes[0] > 0 else "gained", "bootstrap")

    # --- insider (holds the cluster key, made-up names) ------------------------
    def many_names(self) -> None:
        kind, port_name = "many_names", self.rng.choice(["echo", "ctrl", "side"])
        port = self.plane_ports[port_name]
        n = self.cfg["many_names"]
        self.tally.out(kind, "attempts", port_name)
        held = []
        for _ in range(n):
            src = self.src()
            self.tally.sources.add(src)
            try:
                held.append(RawPeer(port, src, self.name(), key=self.key, timeout=3))
                self.tally.sessions += 1
            except (OSError, ConnectionError, kv_transfer.KvTransferError):
                pass
        time.sleep(0.05)
        evicted = sum(closed_by_peer(p.s, 0.01) for p in held)
        for p in held:
            p.close()
        # Refused: past the peer cap the idlest names were evicted.
        self.tally.out(kind, "refused" if evicted > 0 else "inconclusive", port_name)

    def pipeline_flood(self) -> None:
        kind, src = "pipeline_flood", self.src()
        self.tally.out(kind, "attempts", "echo", src)
        name = self.name()
        try:
            p = RawPeer(self.plane_ports["echo"], src, name, key=self.key, timeout=3)
            self.tally.sessions += 1
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            self.tally.out(kind, "inconclusive", "echo")
            return
        n = 10 * self.cfg["inflight_cap"]
        bodies = [b"slow-%d" % i for i in range(n)]
        try:
            p.s.sendall(b"".join(p.frame(b) for b in bodies))
        except OSError:
            pass
        answered = 0
        p.s.settimeout(3)
        try:
            for _ in range(n):
                hdr = _recv_exact(p.s, peers._HDR.size)
                ln, rid, k = peers._HDR.unpack(hdr)
                rest = _recv_exact(p.s, ln + peers.TAG_LEN)
                p.session.open(hdr + rest[:ln], rest[ln:])
                self.check_foreign(rest[:ln], name.encode() + b":" + bodies[rid - 1])
                answered += 1
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            pass
        p.close()
        # Refused: the connection was dropped past the cap, before every request was answered.
        self.tally.out(kind, "refused" if answered < n else "gained", "echo")

    def declared_bytes(self) -> None:
        kind, src = "declared_bytes", self.src()
        port_name = self.rng.choice(["echo", "ctrl", "side"])
        name = self.name()
        chunk = b"x" * (256 << 10)
        for _ in range(3):  # two links per name; 4 MiB each against an 8 MiB per-name budget
            self.tally.out(kind, "attempts", port_name, src)
            try:
                p = RawPeer(self.plane_ports[port_name], src, name, key=self.key, timeout=3)
                self.tally.sessions += 1
                p.s.sendall(peers._HDR.pack(4 << 20, 1, peers.REQUEST) + chunk)
            except (OSError, ConnectionError, kv_transfer.KvTransferError):
                self.tally.out(kind, "refused", port_name)
                continue
            self.held.add(kind, port_name, p.s, time.monotonic() + self.deadlines["frame_s"] + 2.0)

    def _frame_then_eof(self, kind: str, make: Callable[[Any], bytes]) -> None:
        port_name, src = self.rng.choice(["echo", "ctrl", "side"]), self.src()
        self.tally.out(kind, "attempts", port_name, src)
        try:
            p = RawPeer(self.plane_ports[port_name], src, self.name(), key=self.key, timeout=3)
            self.tally.sessions += 1
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            self.tally.out(kind, "inconclusive", port_name)
            return
        try:
            p.s.sendall(make(p))
            self.tally.out(kind, "refused" if closed_by_peer(p.s, 3.0) else "gained", port_name)
        except OSError:
            self.tally.out(kind, "refused", port_name)
        finally:
            p.close()

    def oversize_frame(self) -> None:
        self._frame_then_eof("oversize_frame",
                             lambda p: peers._HDR.pack(self.cfg["max_frame"] + 1, 1, peers.REQUEST) + b"x" * 64)

    def forged_tag(self) -> None:
        def make(p: Any) -> bytes:
            f = bytearray(p.frame(b"forged"))
            f[-1 - self.rng.randrange(peers.TAG_LEN)] ^= 1 << self.rng.randrange(8)
            return bytes(f)

        self._frame_then_eof("forged_tag", make)
        # Its control, in line: the same frame with the session's own tag is answered, with its own bytes only.
        src = self.src()
        try:
            name = self.name()
            p = RawPeer(self.plane_ports["echo"], src, name, key=self.key, timeout=3)
            self.tally.sessions += 1
            k, reply = p.request(b"forged")
            self.check_foreign(reply, name.encode() + b":forged")
            p.close()
        except (OSError, ConnectionError, kv_transfer.KvTransferError) as e:
            self.tally.note(f"forged_tag control: {e}")

    def unexpected_kind(self) -> None:
        def make(p: Any) -> bytes:
            hdr = peers._HDR.pack(4, 1, peers.REPLY)
            return hdr + b"fake" + p.session.seal(hdr + b"fake")

        self._frame_then_eof("unexpected_kind", make)

    def _metadata(self, room: int) -> bytes:
        if self._pair is None:
            import ctypes

            buf = ctypes.create_string_buffer(64 * 64)
            ep = kv_transfer.Endpoint("tcp-sim", f"mallory-{os.getpid()}")
            pool = ep.register([(ctypes.addressof(buf), 64 * 64, 64)] * 1, owner=buf)
            peer = ep.add_peer(ep.descriptor())
            lease = pool.reserve(list(range(64)))
            remote = ep.expose(lease, peer)
            self._pair = (buf, ep, pool, lease, bytes(ep.descriptor()), bytes(remote.to_bytes()))
        return sgl_wire.Metadata(room=room, descriptor=self._pair[4], kv=self._pair[5], aux=None).to_json()

    def made_up_rooms(self) -> None:
        kind, src = "made_up_rooms", self.src()
        self.tally.out(kind, "attempts", "ctrl", src)
        name = self.name()
        try:
            p = RawPeer(self.plane_ports["ctrl"], src, name, key=self.key, timeout=3)
            self.tally.sessions += 1
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            self.tally.out(kind, "inconclusive", "ctrl")
            return
        refused = 0
        try:
            for _ in range(self.cfg["room_cap"] + 4):
                k, reply = p.request(self._metadata(self.rng.getrandbits(63)))
                if k == peers.ERROR:
                    refused += b"RoomRefused" in reply or b"ProtocolError" in reply
                elif reply != b'{"ok": true}':
                    self.check_foreign(reply, b'{"ok": true}')
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            pass
        p.close()
        self.tally.out(kind, "refused" if refused else "gained", "ctrl")

    def empty_objects_frame(self) -> None:
        kind, src = "empty_objects_frame", self.src()
        self.tally.out(kind, "attempts", "ctrl", src)
        payload = b"[" + b"{}," * ((1 << 20) // 3) + b"{}]"
        try:
            p = RawPeer(self.plane_ports["ctrl"], src, self.name(), key=self.key, timeout=3)
            self.tally.sessions += 1
            k, reply = p.request(payload)
            p.close()
        except (OSError, ConnectionError, kv_transfer.KvTransferError):
            self.tally.out(kind, "refused", "ctrl")
            return
        ok = k == peers.ERROR and b"shape" in reply
        self.tally.out(kind, "refused" if ok else "gained", "ctrl")

    def _side(self, p: Any, body: bytes) -> dict:
        k, reply = p.request(body)
        if k == peers.ERROR:
            return {"ok": False, "error": "error_frame", "message": reply.decode(errors="replace")}
        return json.loads(reply)

    def _spelled(self) -> bytes:
        """A descriptor spelling: junk, or a tcp-sim descriptor of a made-up endpoint."""
        return self.rng.choice([b"\x01" * self.rng.randrange(1, 64), secrets.token_bytes(32),
                                b'{"backend": "tcp-sim", "addr": "127.0.0.%d:%d"}' % (self.rng.randrange(2, 10),
                                                                                     self.rng.randrange(1, 65535))])

    def side_guessed_offer(self) -> None:
        kind, src = "side_guessed_offer", self.src()
        self.tally.out(kind, "attempts", "side", src)
        try:
            p = RawPeer(self.plane_ports["side"], src, self.name(), key=self.key, timeout=3)
            self.tally.sessions += 1
            refused = gained = 0
            for _ in range(8):
                oid = secrets.token_hex(16)
                r = self._side(p, vllm_wire.fetch_request(oid, "tcp-sim", self._spelled(), self.rng.randrange(1, 4)))
                gained += r.get("ok") is True
                refused += r.get("ok") is False
                r = self._side(p, vllm_wire.release_request(oid))
            p.close()
        except (OSError, ConnectionError, kv_transfer.KvTransferError, ValueError):
            self.tally.out(kind, "inconclusive", "side")
            return
        self.tally.out(kind, "gained" if gained else "refused" if refused else "inconclusive", "side")

    def _read_leaks(self) -> None:
        path = self.cfg.get("leak_file")
        if not path or not os.path.exists(path):
            return
        with open(path) as f:
            f.seek(self.leak_pos)
            data = f.read(1 << 16)
        lines = data.split("\n")
        done = data.rfind("\n") + 1
        self.leak_pos += len(data[:done].encode())
        self.leaked = (self.leaked + [ln for ln in lines[:-1] if ln])[-64:]

    def side_leaked_offer(self) -> None:
        kind, src = "side_leaked_offer", self.src()
        self._read_leaks()
        if not self.leaked:
            return
        oid = self.leaked[-1]
        self.tally.out(kind, "attempts", "side", src)
        try:
            p = RawPeer(self.plane_ports["side"], src, self.name(), key=self.key, timeout=3)
            self.tally.sessions += 1
            rel = self._side(p, vllm_wire.release_request(oid))
            fetch = self._side(p, vllm_wire.fetch_request(oid, "tcp-sim", self._spelled(), 1))
            p.close()
        except (OSError, ConnectionError, kv_transfer.KvTransferError, ValueError):
            self.tally.out(kind, "inconclusive", "side")
            return
        if fetch.get("ok") is True:
            self.tally.out(kind, "gained", "side")
            self.tally.note(f"leaked offer {oid[:8]} fetched: {fetch}")
        elif rel.get("error") == "not_claimant" or fetch.get("error") in ("claimed", "unknown_offer", "released"):
            # not_claimant: the release was refused while the honest decode's exposure was live;
            # a release of an offer already freed is a no-op ok (the honest side checks nothing aborted).
            self.tally.out(kind, "refused", "side")
            if rel.get("error") == "not_claimant":
                self.tally.out("side_leaked_offer_not_claimant", "refused", "side")
        else:
            self.tally.out(kind, "inconclusive", "side")

    # --- the ports this attacker serves (the honest process is made to dial them) ---
    def serve_relay(self) -> str:
        """M: splices whoever dials it to the honest echo port (a relayed handshake)."""
        m = socket.socket()
        m.bind((self.sources[0], 0))
        m.listen(64)
        m.settimeout(0.2)
        target = self.plane_ports["echo"]
        relay_src = self.sources[-1]

        def accept() -> None:
            end = time.monotonic() + self.cfg["seconds"] + 30
            while time.monotonic() < end and not self.stop:
                try:
                    a, _ = m.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return
                self.tally.out("relayed_handshake", "attempts", "echo", relay_src)
                try:
                    a.settimeout(5)
                    b = dial(target, relay_src, 3)
                    b.settimeout(5)
                except OSError:
                    a.close()
                    continue
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()
                threading.Thread(target=pipe, args=(b, a), daemon=True).start()
            m.close()

        threading.Thread(target=accept, daemon=True).start()
        return "%s:%d" % m.getsockname()

    def serve_fake_bootstrap(self) -> str:
        """A fake bootstrap: answers every lookup with an answer recorded from the
        real one (its body and MAC, for the attacker's own nonce)."""
        src = self.sources[0]
        status, body, auth = self.http("GET", f"/route?rank=0&nonce={secrets.token_hex(16)}", src)
        tally = self.tally

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                tally.out("fake_bootstrap_replay", "attempts", "decode-lookup", src)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header(bootstrap.AUTH_HEADER, auth or "")
                self.end_headers()
                self.wfile.write(body)

        srv = ThreadingHTTPServer((src, 0), H)
        srv.daemon_threads = True
        self._fake = srv
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        return "http://%s:%d/route?rank=0" % srv.server_address

    def serve_silent(self) -> int:
        """A side port that accepts and never answers (attack 6's lure)."""
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        self._silent = s
        return s.getsockname()[1]

    # --- the run ---------------------------------------------------------------
    def plan(self) -> List[tuple]:
        """Every (kind, port) once, in a seeded order, so each kind hits each of its ports early."""
        if self.cfg["role"] == "outsider":
            ports = ["echo", "ctrl", "side"]
            first = [(k, p) for k in ("wrong_key", "replayed_handshake", "no_handshake") for p in ports]
            first += [("drip", p) for p in ports + ["bootstrap"]]
            first += [(k, None) for k in OUTSIDER_KINDS if k.startswith("boot_")]
        else:
            first = [(k, None) for k in INSIDER_KINDS]
        self.rng.shuffle(first)
        return first

    def run_one(self, kind: str, port: Optional[str]) -> None:
        fn = getattr(self, kind)
        if kind in ("wrong_key", "replayed_handshake", "no_handshake"):
            fn(port or self.rng.choice(["echo", "ctrl", "side"]))
        elif kind == "drip":
            fn(port or self.rng.choice(["echo", "ctrl", "side", "bootstrap"]))
        else:
            fn()

    def run(self) -> dict:
        self.stop = False
        ready: Dict[str, Any] = {}
        if self.cfg["role"] == "outsider" and not self.positive:
            ready = {"relay": self.serve_relay(), "fake_bootstrap": self.serve_fake_bootstrap(),
                     "silent_port": self.serve_silent()}
        print("READY " + json.dumps(ready), flush=True)
        end = time.monotonic() + self.cfg["seconds"]
        if self.positive:
            # The same attacker code with the right key and secret: it must get through.
            for p in ("echo", "ctrl", "side"):
                self.wrong_key(p)
            self.boot_bad_mac()
            return self.tally.to_json()
        kinds = OUTSIDER_KINDS if self.cfg["role"] == "outsider" else INSIDER_KINDS
        queue = self.plan()
        pause = self.cfg["pause_s"]
        for i in range(self.cfg["max_attacks"]):  # bounded in count and time
            if time.monotonic() >= end:
                break
            kind, port = queue.pop(0) if queue else (self.rng.choice(kinds), None)
            try:
                self.run_one(kind, port)
            except Exception as e:  # noqa: BLE001 (an attack that broke is tallied, the soak goes on)
                self.tally.out(kind, "inconclusive")
                self.tally.note(f"{kind}: {type(e).__name__}: {e}")
            self.held.service()
            # Paced: an attacker on the honest host's cores is the test's artefact, not the threat.
            t_pause = time.monotonic() + self.rng.uniform(0.5, 1.5) * pause
            for _ in range(1000):
                if time.monotonic() >= t_pause:
                    break
                time.sleep(0.02)
                self.held.service()
        # What is still held must be cut by its deadline (bounded wait).
        t_end = time.monotonic() + max(self.deadlines.values()) + 3.0
        while self.held.items and time.monotonic() < t_end:
            self.held.service()
            time.sleep(0.05)
        self.held.service(final=True)
        self.stop = True
        out = self.tally.to_json()
        out["silent_port_dials"] = self._silent_dials()
        return out

    def _silent_dials(self) -> int:
        """Connections the honest decode made to the silent port (attack 6: it must make none)."""
        if self._silent is None:
            return 0
        self._silent.setblocking(False)
        n = 0
        for _ in range(1000):  # bounded
            try:
                c, _ = self._silent.accept()
                c.close()
                n += 1
            except OSError:
                break
        return n


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    try:
        os.nice(cfg.get("nice", 10))
    except OSError:
        pass
    out = Attacker(cfg).run()
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
