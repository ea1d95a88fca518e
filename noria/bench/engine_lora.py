"""``noria bench engine --lora N``: decode throughput with N LoRA adapters mixed in one batch.

For each batch size B, the same B prompts as ``noria bench engine`` (greedy, ``ignore_eos``,
exactly ``new_tokens`` each) run on one engine holding N random adapters of rank ``--lora-rank``
on every linear layer of the decoder blocks (q, k, v, o, gate, up, down), written as peft folders:

- ``base``: every row on the base model (the engine has the adapters loaded, no row uses one);
- ``mixed``: row i on adapter i mod N, for each way of applying the deltas
  (``noria.engine.lora_ops.STRATEGIES``: ``stacked``, the engine's, then ``grouped`` and
  ``gathered``), so the figure says what serving many adapters costs against the base model in the
  same batch, and which strategy is fastest at that N;
- with ``--peers vllm_cpu``: vLLM's offline engine with ``enable_lora`` (``max_loras`` N, the same
  folders, row i on ``LoRARequest`` i mod N) and the same vLLM engine with no adapter on any row
  (``noria.bench.vllm_lora_worker``, in vLLM's own virtual environment).

tokens/s = B x new_tokens / wall seconds of the batch, after a warm-up at that size; the prefix
cache is flushed before each timed batch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from noria.bench import print_table, write_json
from noria.process import run as run_command

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run_lora(model: str, batches: list[int], new_tokens: int, peers: list[str], json_path: str | None,
             vllm_python: str | None, dtype: str, n_adapters: int, rank: int) -> list[dict]:  # fmt: skip
    import tempfile

    from noria.hardware import cpu_info, resolve_dtype
    from noria.models.catalog import model_path

    dtype = resolve_dtype(dtype, "cpu")
    print(f"{cpu_info().summary()}: {dtype}, {n_adapters} LoRA adapters of rank {rank}", file=sys.stderr)
    folder = model_path(model)
    prompts = bench_prompts(folder, max(batches))
    with tempfile.TemporaryDirectory(prefix="noria-bench-lora-") as tmp:
        adapters = write_adapters(folder, Path(tmp), n_adapters, rank)
        figures = _noria(folder, prompts, batches, new_tokens, dtype, adapters)
        if "vllm_cpu" in peers:
            figures.update(_vllm(folder, prompts, batches, new_tokens, vllm_python, dtype, adapters, rank))
    rows = []
    for batch in batches:
        mixed = figures["noria_stacked"][batch]
        rows.append({
            "case": f"{model} {dtype} lora={n_adapters} rank={rank} batch={batch} new={new_tokens}",
            "metric": "tokens_per_s",
            "noria": round(mixed, 1),
            "peers": {name: round(f[batch], 1) for name, f in figures.items() if name != "noria_stacked"},
        })
    names = ["noria_stacked", *[n for n in figures if n != "noria_stacked"]]
    table = [[r["case"], *[r["noria"] if n == "noria_stacked" else r["peers"][n] for n in names],
              r["noria"] / r["peers"]["noria_base"]] for r in rows]  # fmt: skip
    print_table("decode tokens/s with LoRA adapters mixed in the batch (higher is better)", ["case", *names, "mixed/base"], table)
    if json_path:
        write_json(json_path, "engine", rows)
    return rows


def bench_prompts(folder: Path, n: int) -> list[list[int]]:
    """``noria bench engine``'s prompts: the arithmetic task's test prompts with the chat template."""
    from noria.data import generate_split, render_prompts
    from noria.models import load_tokenizer

    records = generate_split("arithmetic", "test", {"n_test": max(n, 8), "seed": 0})
    return [r.ids for r in render_prompts(records[:n], load_tokenizer(folder))]


def write_adapters(folder: Path, out: Path, n: int, rank: int) -> dict[str, Path]:
    """N random peft adapter folders (rank ``rank``, alpha 2 x rank, every decoder-block linear)."""
    from noria.config import LoraConfig
    from noria.models import load_model
    from noria.train.lora import save_adapter

    model = load_model(folder, dtype=torch.float32)
    cfg = LoraConfig(rank=rank, alpha=2 * rank, target_modules=list(TARGETS))
    linears = [(name, m) for name, m in model.model.layers.named_modules(prefix="model.layers") if name.endswith(TARGETS)]
    adapters = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)

        def tensors():
            for name, m in linears:
                yield f"{name}.lora_A.default.weight", torch.randn(rank, m.in_features, generator=g) * 0.02
                yield f"{name}.lora_B.default.weight", torch.randn(m.out_features, rank, generator=g) * 0.02

        adapters[f"lora{i}"] = save_adapter(tensors(), cfg, out / f"lora{i}", str(folder))
    return adapters


def _noria(folder: Path, prompts, batches, new_tokens, dtype, adapters: dict[str, Path]) -> dict[str, dict[int, float]]:
    from noria.config import EngineConfig
    from noria.engine import Engine, lora_ops
    from noria.engine.protocol import GenerateRequest, SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(max_running_requests=max(batches), kv_cache_tokens=max(batches) * (longest + 16) + 1024,
                          lora_max_adapters=max(1, len(adapters)))  # fmt: skip
    engine = Engine.from_path(folder, config, dtype=dtype)
    names = list(adapters)
    default = lora_ops.STRATEGY
    try:
        for name, path in adapters.items():
            engine.load_adapter(name, path)

        def timed(rows, mixed: bool, n: int) -> float:
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            reqs = [GenerateRequest(p, params, adapter=names[i % len(names)] if mixed else None) for i, p in enumerate(rows)]
            engine.flush_cache()
            start = time.perf_counter()
            results = engine.generate_batch(reqs)
            return sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)

        timed(prompts[:2], True, 8)
        out: dict[str, dict[int, float]] = {"noria_base": {}, **{f"noria_{s}": {} for s in lora_ops.STRATEGIES}}
        for batch in batches:
            timed(prompts[:batch], False, 8)
            out["noria_base"][batch] = timed(prompts[:batch], False, new_tokens)
            for strategy in lora_ops.STRATEGIES:
                lora_ops.STRATEGY = strategy  # read by every step's LoraBatch.build
                timed(prompts[:batch], True, 8)
                out[f"noria_{strategy}"][batch] = timed(prompts[:batch], True, new_tokens)
        return out
    finally:
        lora_ops.STRATEGY = default
        engine.shutdown(drain_timeout_s=1.0)


def _vllm(folder, prompts, batches, new_tokens, python, dtype, adapters: dict[str, Path], rank: int) -> dict[str, dict[int, float]]:
    from noria.engine.vllm_server import vllm_python_path

    interpreter = vllm_python_path(python)
    job = {"model": str(folder), "prompts": prompts, "batches": batches, "new_tokens": new_tokens, "kv_space_gb": 4,
           "dtype": dtype, "adapters": [str(p) for p in adapters.values()], "rank": rank}  # fmt: skip
    worker = Path(__file__).with_name("vllm_lora_worker.py")
    proc = run_command([str(interpreter), str(worker)], check=False, input=json.dumps(job), capture=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM LoRA worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out: dict[str, dict[int, float]] = {"vllm_cpu_base": {}, "vllm_cpu_lora": {}}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out["vllm_cpu_lora" if row["lora"] else "vllm_cpu_base"][row["batch"]] = row["tokens"] / row["seconds"]
    return out
