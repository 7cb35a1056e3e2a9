"""The vLLM connector's view of KV tensors: host or one CUDA device, a block
one contiguous run (unit tests: no server, no GPU needed)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import kv_transfer  # noqa: E402
from kv_transfer.vllm.connector import kv_buffers, kv_device  # noqa: E402


def test_host_tensors_are_host_memory_and_one_buffer_per_layer():
    kv = {f"layer.{i}": torch.zeros(8, 2, 16, 32) for i in range(3)}
    assert kv_device(kv) is None
    bufs = kv_buffers(kv, 8)
    assert [b[0] for b in bufs] == [t.data_ptr() for t in kv.values()]
    assert all(b[1] == 8 * b[2] and b[2] == 2 * 16 * 32 * 4 for b in bufs)


def test_a_k_v_split_layout_gives_two_buffers_per_layer():
    kv = {"layer.0": torch.zeros(2, 8, 16, 4, 8)}
    bufs = kv_buffers(kv, 8)
    assert len(bufs) == 2 and bufs[1][0] - bufs[0][0] == 8 * 16 * 4 * 8 * 4


def test_tensors_off_the_host_and_cuda_are_refused():
    kv = {"layer.0": torch.zeros(8, 4, device="meta")}
    with pytest.raises(kv_transfer.DescriptorError, match="meta"):
        kv_device(kv)
