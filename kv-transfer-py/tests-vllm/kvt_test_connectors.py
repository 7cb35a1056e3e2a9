"""The tests' connectors, loaded by the test servers through
``kv_connector_module_path`` (this directory is on their PYTHONPATH).

``ControlledConnector`` is kv_transfer.vllm's connector unchanged but for
two controls that a request's ``kv_transfer_params`` switch on (only the
tests send them): ``kvt_test_hold_s`` holds the READ after the offer is
claimed (a pull in flight, for the abort storm and the hazard), and
``kvt_test_corrupt`` overwrites the loaded blocks before vLLM uses them
(the negative control: corrupted KV must change the tokens), and
``kvt_test_fail_read`` makes the READ fail for real: the claimed offer is
released at the prefill first (its exposure aborted), so the READ that
follows is refused by the prefill's side (a load failure, reported through
``get_block_ids_with_load_errors``)."""

import time

from kv_transfer.vllm import KvTransferConnector, wire


class ControlledConnector(KvTransferConnector):
    def _before_post(self, req_id, params):
        hold = float(params.get("kvt_test_hold_s", 0) or 0)
        if 0 < hold <= 60:
            time.sleep(hold)
        if params.get("kvt_test_fail_read"):
            offer = wire.parse_offer(params)
            wire.parse_ok(self.plane.call(offer.host, offer.port + self.rank, wire.release_request(offer.offer),
                                          timeout=10))

    def _after_load(self, req_id, blocks, params):
        if params.get("kvt_test_corrupt"):
            for t in self.kv_caches.values():
                for b in blocks:
                    t[b].mul_(-1.0).add_(0.5)
