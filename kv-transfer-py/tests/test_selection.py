"""Rule: with the package installed, SGLang's own parser and get_kv_class
select kvtransfer, the stock backends still resolve, and the hook that keeps
SGLang's timer from freeing pages is in place on every pinned version."""

import argparse

import pytest

import kv_transfer.sglang as kvs


def test_the_pinned_sglang_version_is_installed(sglang):
    assert sglang.__version__ in kvs.SUPPORTED_SGLANG


def test_sglang_parser_accepts_kvtransfer(sglang):
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    a = p.parse_args(["--model-path", "m", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvtransfer"])
    assert a.disaggregation_transfer_backend == "kvtransfer"
    with pytest.raises(SystemExit):
        p.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvtransferx"])


def test_get_kv_class_returns_this_package_for_every_class_type(sglang):
    import sglang.srt.disaggregation.utils as u
    from sglang.srt.disaggregation.base.conn import KVArgs

    from kv_transfer.sglang import conn

    want = {
        "KVARGS": KVArgs,
        "MANAGER": conn.KvTransferManager,
        "SENDER": conn.KvTransferSender,
        "RECEIVER": conn.KvTransferReceiver,
        "BOOTSTRAP_SERVER": conn.KvTransferBootstrapServer,
    }
    tb = u.TransferBackend("kvtransfer")
    for kind in u.KVClassType:
        assert u.get_kv_class(tb, kind) is want[kind.name]
    # The modules that build a TransferBackend from the CLI value see the extended Enum.
    import sglang.srt.disaggregation.decode as dec
    import sglang.srt.disaggregation.prefill as pre

    assert dec.TransferBackend("kvtransfer") is tb and pre.TransferBackend("kvtransfer") is tb


def test_stock_backends_still_resolve(sglang):
    import sglang.srt.disaggregation.utils as u

    assert u.get_kv_class(u.TransferBackend("mooncake"), u.KVClassType.MANAGER).__name__ == "MooncakeKVManager"
    assert u.get_kv_class(u.TransferBackend("fake"), u.KVClassType.RECEIVER).__name__ == "FakeKVReceiver"
    assert u.get_kv_class(u.TransferBackend("nixl"), u.KVClassType.SENDER).__name__ == "NixlKVSender"


def test_the_release_hook_is_in_place(sglang):
    assert kvs.release_hook_installed()


def test_decode_refuses_to_start_with_deferred_release_off(sglang, monkeypatch):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from conftest import kv_args, server_args
    from kv_transfer.sglang import conn

    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "false")
    monkeypatch.setenv(conn.BACKEND_ENV, "tcp-sim")
    with pytest.raises(RuntimeError, match="DEFERRED_DECODE_KV_RELEASE"):
        conn.KvTransferManager(kv_args([], 4, 64), DisaggregationMode.DECODE, server_args(1))
