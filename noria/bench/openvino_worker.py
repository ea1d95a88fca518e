"""Runs inside OpenVINO's own virtual environment (``noria.bench.openvino_peer``), started by
``noria bench engine --peers openvino``.

It imports nothing from Noria. Input on stdin (JSON): ``model`` (an OpenVINO IR folder exported by
optimum-intel), ``prompts`` (token id lists), ``batches`` (prompts per batch), ``n`` (samples per
prompt, default 1), ``new_tokens``, ``precision`` (``f32`` or ``bf16``: OpenVINO's inference
precision hint, the dtype Noria runs), ``kv_space_gb``. Output on stdout: one JSON line
``{"batch": B, "seconds": S, "tokens": N}`` per batch size (N counts every sample), measured around
one ``ContinuousBatchingPipeline.generate`` of the whole batch after a warm-up at that batch size
(8 tokens), greedy (sampled at temperature 1 when ``n > 1``) with ``ignore_eos``, so every engine
generates exactly the same number of tokens from exactly the same token ids.
"""

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    import numpy as np  # noqa: PLC0415 (only importable in OpenVINO's venv)
    import openvino as ov  # noqa: PLC0415
    import openvino_genai as genai  # noqa: PLC0415

    n = job.get("n", 1)
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = job.get("kv_space_gb", 4)
    scheduler.max_num_seqs = max(job["batches"]) * n
    scheduler.enable_prefix_caching = False  # every batch starts cold, as Noria's and vLLM's runs do
    properties = {"INFERENCE_PRECISION_HINT": job.get("precision", "f32"), **job.get("properties", {})}
    pipe = genai.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)

    def config(tokens: int, samples: int) -> "genai.GenerationConfig":
        c = genai.GenerationConfig()
        c.max_new_tokens = tokens
        c.min_new_tokens = tokens
        c.ignore_eos = True
        c.num_return_sequences = samples
        if samples > 1:  # greedy cannot return several sequences
            c.do_sample, c.temperature, c.top_p, c.top_k = True, 1.0, 1.0, 0
        else:
            c.do_sample = False
        return c

    def generate(rows, tokens: int, samples: int) -> int:
        ids = [ov.Tensor(np.array([r], dtype=np.int64)) for r in rows]
        outs = pipe.generate(ids, [config(tokens, samples)] * len(rows))
        lengths = [len(seq) for o in outs for seq in o.m_generation_ids]
        if lengths != [tokens] * (len(rows) * samples):
            raise SystemExit(f"asked {len(rows)} x {samples} sequences of {tokens} tokens, got lengths {lengths}")
        return sum(lengths)

    generate(job["prompts"][:2], 8, 1)
    for batch in job["batches"]:
        rows = job["prompts"][:batch]
        generate(rows, 8, 1)  # warm at this batch size too, like the other engines
        start = time.perf_counter()
        tokens = generate(rows, job["new_tokens"], n)
        seconds = time.perf_counter() - start
        print(json.dumps({"batch": batch, "seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
