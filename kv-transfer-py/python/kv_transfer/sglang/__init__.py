"""kv_transfer as an SGLang disaggregation transfer backend.

Install ``kv-transfer`` into SGLang's environment and launch prefill and
decode with ``--disaggregation-transfer-backend kvtransfer``: SGLang's
plugin loader runs :func:`kv_transfer.sglang.plugin.register` (entry point
group ``sglang.srt.plugins``). ``KV_TRANSFER_BACKEND`` picks the transport
(``mooncake`` over TCP by default, ``verbs`` when ``--disaggregation-ib-device``
names a device and the build has it, ``nixl``, ``tcp-sim``).

The classes live in :mod:`kv_transfer.sglang.conn` (importing it imports
SGLang); this module imports nothing heavy.
"""

from .plugin import BACKEND_NAME, SUPPORTED_SGLANG, register, release_hook_installed

__all__ = ["BACKEND_NAME", "SUPPORTED_SGLANG", "register", "release_hook_installed"]
