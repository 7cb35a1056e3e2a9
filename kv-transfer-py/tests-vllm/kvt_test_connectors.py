"""The tests' connectors, loaded by the test servers through
``kv_connector_module_path`` (this directory is on their PYTHONPATH).

``ControlledConnector`` is kv_transfer.vllm's connector unchanged but for
two controls that a request's ``kv_transfer_params`` switch on (only the
tests send them): ``kvt_test_hold_s`` holds the READ after the offer is
claimed (a pull in flight, for the abort storm and the hazard), and
``kvt_test_corrupt`` overwrites the loaded blocks before vLLM uses them
(the negative control: corrupted KV must change the tokens), and
``kvt_test_fail_read`` fails the load after the offer was claimed (exposed
at the prefill) and before its READ: the decode hands the offer back (the
prefill aborts the exposure; its blocks return by proof) and reports the
load's blocks through ``get_block_ids_with_load_errors``, as for a READ
that failed. (Releasing the offer first and letting the READ meet the
aborted exposure is not deterministic: the exposure stays readable until
the prefill's ladder revokes it.)"""

import time

from kv_transfer.vllm import KvTransferConnector


class ControlledConnector(KvTransferConnector):
    def _before_post(self, req_id, params):
        hold = float(params.get("kvt_test_hold_s", 0) or 0)
        if 0 < hold <= 60:
            time.sleep(hold)
        if params.get("kvt_test_fail_read"):
            raise RuntimeError("kvt_test_fail_read: an injected load failure")

    def _after_load(self, req_id, blocks, params):
        if params.get("kvt_test_corrupt"):
            for t in self.kv_caches.values():
                for b in blocks:
                    t[b].mul_(-1.0).add_(0.5)
