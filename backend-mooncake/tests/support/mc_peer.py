# A real Mooncake TransferEngine (the `mooncake.engine` Python module) driven by
# line commands on stdin, for the interop tests. Replies go to stdout, one line each.
import json
import os
import sys
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

SIZE = int(sys.argv[1]) if len(sys.argv) > 1 else (4 << 20)
# The address to serve on: loopback, or a network namespace's own (netns tests).
HOST = os.environ.get("MC_HOST", "127.0.0.1")
# "rdma" with MC_DEVICE (rxe_lo in the verbs guest), or TCP.
PROTOCOL = os.environ.get("MC_PROTOCOL", "tcp")
DEVICE = os.environ.get("MC_DEVICE", "")
te = TransferEngine()
rc = te.initialize(HOST, "P2PHANDSHAKE", PROTOCOL, DEVICE)
if rc != 0:
    print("ERR initialize %d" % rc, flush=True)
    sys.exit(1)
if PROTOCOL == "rdma":
    # Memory of our own, registered with the NIC (register_memory).
    import ctypes
    cbuf = ctypes.create_string_buffer(SIZE)
    buf = ctypes.addressof(cbuf)
    rc = te.register_memory(buf, SIZE)
    if rc != 0:
        print("ERR register_memory %d" % rc, flush=True)
        sys.exit(1)
else:
    buf = te.allocate_managed_buffer(SIZE)
if buf == 0:
    print("ERR allocate", flush=True)
    sys.exit(1)
print("READY port=%d addr=%d size=%d" % (te.get_rpc_port(), buf, SIZE), flush=True)
for line in sys.stdin:
    p = line.split()
    if not p:
        continue
    cmd = p[0]
    try:
        if cmd == "put":
            off, data = int(p[1]), bytes.fromhex(p[2])
            te.write_bytes_to_buffer(buf + off, data, len(data))
            print("OK", flush=True)
        elif cmd == "get":
            off, n = int(p[1]), int(p[2])
            print("OK " + te.read_bytes_from_buffer(buf + off, n).hex(), flush=True)
        elif cmd in ("write", "read"):
            seg, loff, raddr, n = p[1], int(p[2]), int(p[3]), int(p[4])
            f = te.transfer_sync_write if cmd == "write" else te.transfer_sync_read
            print("RC %d" % f(seg, buf + loff, raddr, n), flush=True)
        elif cmd == "fill":
            off, n, b = int(p[1]), int(p[2]), int(p[3])
            te.write_bytes_to_buffer(buf + off, bytes([b]) * n, n)
            print("OK", flush=True)
        elif cmd == "notify":
            # A 1-byte READ with a notification: Mooncake sends the message only
            # after the transfer COMPLETED. `name` is our own segment name.
            seg, raddr, msg = p[1], int(p[2]), " ".join(p[3:])
            me = "%s:%d" % (HOST, te.get_rpc_port())
            n = TransferNotify(me, msg)
            print("RC %d" % te.transfer_sync(seg, buf, raddr, 1, TransferOpcode.Read, n), flush=True)
        elif cmd == "notifies":
            ns = [[n.name, n.msg] for n in te.get_notifies()]
            print("OK " + json.dumps(ns, separators=(",", ":")), flush=True)
        elif cmd == "probe":
            print("RC %d" % te.send_probe(p[1]), flush=True)
        elif cmd == "quit":
            print("BYE", flush=True)
            break
        else:
            print("ERR unknown", flush=True)
    except Exception as e:  # report, keep serving
        print("ERR %s" % str(e).replace("\n", " "), flush=True)
