"""One offline vLLM engine (``vllm.LLM``) driven over stdin/stdout, one JSON
object per line, for the offline prefill/decode test:

    {"op": "generate", "prompts": [[ids...]...], "max_tokens": N, "params": [obj|null...]}
      -> {"tokens": [[ids...]...], "params": [obj|null...]}
    {"op": "pump", "seconds": S}   steps the engine (a prefill's held blocks
                                   are settled and given back in steps) -> {"ok": true}
    {"op": "quit"}

    python offline_worker.py MODEL ROLE SIDE_PORT BACKENDS CORE     (ROLE: single | kv_producer | kv_consumer)
"""

import json
import os
import sys
import time


def main() -> None:
    model, role, side_port, backends, core = sys.argv[1:6]
    prefills = sys.argv[6].split(",") if len(sys.argv) > 6 and sys.argv[6] else []
    # Answers go to the real stdout; whatever vLLM prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core
    from vllm import LLM, SamplingParams

    kw = {}
    if role != "single":
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvTransferConnector", kv_connector_module_path="kv_transfer.vllm", kv_role=role,
            kv_connector_extra_config={"backends": backends, "side_port": int(side_port), "prefills": prefills})
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=False,
              max_model_len=512, num_gpu_blocks_override=48, **kw)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "pump":
            end = time.monotonic() + float(cmd["seconds"])
            while time.monotonic() < end:
                if llm.llm_engine.has_unfinished_requests():
                    llm.llm_engine.step()
                else:
                    time.sleep(0.005)
            out.write(json.dumps({"ok": True}) + "\n")
            out.flush()
            continue
        sps = []
        for p in cmd["params"]:
            extra = {"kv_transfer_params": p} if p is not None else None
            sps.append(SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True, extra_args=extra))
        res = llm.generate([{"prompt_token_ids": pr} for pr in cmd["prompts"]], sps, use_tqdm=False)
        out.write(json.dumps({"tokens": [list(r.outputs[0].token_ids) for r in res],
                              "params": [r.kv_transfer_params for r in res]}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
