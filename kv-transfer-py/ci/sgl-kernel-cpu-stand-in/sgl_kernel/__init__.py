"""A stand-in for SGLang's CPU kernel package, for the end-to-end tests only.

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1``, SGLang 0.5.23 imports eight
names from ``sgl_kernel`` at module level. The CPU build of sgl-kernel that
defines them (built from sgl-kernel's ``csrc/cpu`` sources) is not on PyPI:
the wheels there hold CUDA kernels only. On a CPU without AMX, a dense Llama
served with ``--attention-backend torch_native``, no speculative decoding,
calls none of the eight (SGLang takes its native torch paths), so importing
them is all the server needs.

What it is not: a kernel package. Each name raises ``NotImplementedError``
when called, so a configuration that does reach one fails loudly instead of
computing something else. Put its folder on ``PYTHONPATH`` of the SGLang
processes (``scripts/sglang-tests`` does).
"""

__version__ = "0.0.0+kv-transfer-cpu-stand-in"

#: The module-level imports of SGLang 0.5.23 under SGLANG_USE_CPU_ENGINE=1
#: (kernels/ops/kvcache/cache_move.py, mem_cache/allocation.py,
#: kernels/ops/speculative/{spec_tree,cache_locs,eagle}.py).
NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _not_here(name):
    def op(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called: this is kv-transfer's import-only stand-in, not SGLang's CPU kernels "
            "(build sgl-kernel for CPU to run this configuration)"
        )

    op.__name__ = op.__qualname__ = name
    return op


for _name in NAMES:
    globals()[_name] = _not_here(_name)
del _name
