"""kv_transfer as a vLLM KV connector (pull mode), for vLLM 0.32.0.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvTransferConnector",
        "kv_connector_module_path": "kv_transfer.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"backends": "mooncake", "side_port": 5700}}'

and ``"kv_role": "kv_consumer"`` on the decode. A prefill's blocks go back
to vLLM only on a proof (the decode's DONE after its READs, a revocation, a
fence); a decode's only when every READ is terminal. Asking this module for
the connector imports vLLM (and refuses another version than ``SUPPORTED_VLLM``);
:mod:`kv_transfer.vllm.wire`, :mod:`~kv_transfer.vllm.prefill` and
:mod:`~kv_transfer.vllm.decode` hold the logic and import no vLLM.
"""

from typing import Any

__all__ = ["SUPPORTED_VLLM", "KvTransferConnector", "KvTransferMetadata"]


def __getattr__(name: str) -> Any:
    # vLLM's factory imports this module and asks for the class: only then is
    # vLLM imported (the submodules stay importable without it).
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)
