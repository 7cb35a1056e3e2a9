"""The native module's contract from Python: leases checked at run time,
typed exceptions, nothing freed by a refused call."""

import ctypes
import logging

import pytest

import kv_transfer


def pair(pages=8, size=64, **decode_opts):
    dst = ctypes.create_string_buffer(pages * size)
    src = ctypes.create_string_buffer(pages * size)
    ctypes.memset(src, ord("p"), pages * size)
    decode = kv_transfer.Endpoint("tcp-sim", f"d-{id(dst)}", **decode_opts)
    prefill = kv_transfer.Endpoint("tcp-sim", f"p-{id(src)}")
    dpool = decode.register([(ctypes.addressof(dst), pages * size, size)], owner=dst)
    ppool = prefill.register([(ctypes.addressof(src), pages * size, size)], owner=src)
    peer = decode.add_peer(prefill.descriptor())
    prefill.add_peer(decode.descriptor())
    return decode, prefill, dpool, ppool, peer, dst


def test_an_exposed_lease_cannot_be_released_or_read_and_nothing_is_freed():
    decode, prefill, dpool, _, peer, _ = pair()
    lease = dpool.reserve([1, 2])
    decode.expose(lease, peer)
    with pytest.raises(kv_transfer.LeaseStateError):
        lease.release()
    with pytest.raises(kv_transfer.LeaseStateError):
        lease.read(0, 0)
    assert lease.state == "exposed"
    assert not dpool.is_free(1) and not dpool.is_free(2)
    assert dpool.metrics()["free"] == 6


def test_an_aborted_exposure_stays_quarantined_until_a_proof_and_the_late_write_is_rejected():
    import time

    decode, prefill, dpool, ppool, peer, dst = pair(fault_gate=True)
    lease = dpool.reserve([3])
    remote = decode.expose(lease, peer)
    decode.hold_writes()
    t = prefill.write(ppool.reserve([0]), remote)
    assert decode.wait_held_writes(1, 10.0)  # the write is in flight, held at the NIC
    lease.abort()
    assert lease.state == "aborted" and not lease.drained
    assert dpool.metrics()["quarantined"] == 1
    # The prefill cannot ack a drain with its write unfinished, so the page
    # stays out of the pool: reserving it again is refused, not granted.
    with pytest.raises(kv_transfer.AdmissionRefused, match="quarantined"):
        dpool.reserve([3])
    deadline = time.monotonic() + 15.0
    while not lease.drained and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lease.drained and dpool.is_free(3)  # proven: the ladder revoked it
    assert dpool.metrics()["settled_revoked"] == 1
    nxt = dpool.reserve([3])  # the next tenant
    decode.release_writes()
    assert t.wait(10.0) == "failed"  # the stale write was rejected at the NIC
    assert dst.raw[3 * 64:4 * 64] == bytes(64)  # not one of its bytes landed
    t.release()
    nxt.release()
    dpool.check()


def test_a_transfer_lands_every_byte_and_settles_the_exposure():
    decode, prefill, dpool, ppool, peer, dst = pair()
    lease = dpool.reserve([5, 6])
    remote = kv_transfer.RemotePages.from_bytes(decode.expose(lease, peer).to_bytes())
    t = prefill.write(ppool.reserve([0, 1]), remote)
    assert lease.state == "exposed"
    assert t.wait(10.0) == "success", t.error
    with pytest.raises(kv_transfer.AdmissionRefused):
        ppool.reserve([0])  # the source page is the transfer's until release()
    t.release()
    ppool.reserve([0]).release()
    assert lease.wait_settled(10.0)
    assert lease.read(0, 1) == b"p" * 64
    lease.release()
    assert dpool.metrics()["free"] == 8


def test_refusals_are_typed_and_hand_the_lease_back():
    decode, prefill, dpool, ppool, peer, _ = pair()
    with pytest.raises(kv_transfer.AdmissionRefused):
        dpool.reserve([8])  # outside the pool
    with pytest.raises(kv_transfer.AdmissionRefused):
        dpool.reserve([1, 1])
    with pytest.raises(kv_transfer.DescriptorError):
        kv_transfer.RemotePages.from_bytes(b'{"kvt": 1, "buffers": []}')
    with pytest.raises(kv_transfer.DescriptorError):
        kv_transfer.RemotePages.from_bytes(b"\xff garbage")
    with pytest.raises(kv_transfer.DescriptorError):
        decode.add_peer(b"not a descriptor")
    remote = decode.expose(dpool.reserve([1, 2, 3]), peer)
    local = ppool.reserve([0])
    with pytest.raises(kv_transfer.DescriptorError):
        prefill.write(local, remote)  # 1 page into 3
    assert local.state == "reserved"  # handed back
    local.release()
    with pytest.raises(ValueError):
        decode.register([(0, 64, 64)])
    with pytest.raises(kv_transfer.BackendUnavailable):
        kv_transfer.Endpoint("no-such-backend", "x")
    with pytest.raises(ValueError):
        kv_transfer.Endpoint("mooncake", "x", fault_gate=True)


def test_metrics_come_as_dicts_and_through_logging(caplog):
    decode, prefill, dpool, _, _, _ = pair()
    with caplog.at_level(logging.INFO, logger="kv_transfer"):
        m = kv_transfer.log_metrics(dpool, decode)
    assert m["capacity"] == 8 and m["free"] == 8 and m["backend_counters"]["backend"] == "tcp-sim"
    assert any("kv_transfer metrics" in r.message for r in caplog.records)


def test_cuda_device_memory_is_refused_by_name_without_a_driver_or_device():
    """Asking for CUDA memory on a host without a GPU (or a build without the
    feature `cuda`) is a typed refusal that says what is missing, never a
    crash: the address is never touched from the CPU."""
    buf = ctypes.create_string_buffer(4 * 64)
    ep = kv_transfer.Endpoint("tcp-sim", f"cuda-{id(buf)}")
    with pytest.raises(kv_transfer.BackendUnavailable, match="CUDA"):
        ep.register([(ctypes.addressof(buf), 4 * 64, 64)], owner=buf, device=0)
    # By default the driver is asked, and host memory stays host memory.
    pool = ep.register([(ctypes.addressof(buf), 4 * 64, 64)], owner=buf)
    pool.reserve([0]).release()
