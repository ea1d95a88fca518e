"""``noria bench gpu-train``: one RL optimizer step of Noria's trainer on a CUDA GPU, tokens/s and MFU.

Case: a random-init model written to a folder — a Qwen3 size (``--model qwen3-1.7b``) or the
pruned Qwen3-30B-A3B MoE shape of ``noria bench gpu-moe`` (``--model qwen3-30b-a3b --layers 6``) —,
``sequences`` sequences with seeded lengths uniform in [min_len, max_len] (random ids, half prompt,
half response), packed into micro-batches of ``micro_batch_tokens``. One step = the backend's
``train_step`` on ``device: cuda``, for each backend of ``--backend`` (``fsdp2``: Noria's PyTorch
backend in one process (``backend: single``): fp32 master weights, bf16 autocast, per-sequence
causal SDPA over the packed row; ``megatron``: megatron-core's GPTModel, bf16 parameters with fp32
masters in Megatron's optimizer, the same packed attention), with activation checkpointing per
layer, ppo_clip loss, grad clip, AdamW. Same batch, same model file, one backend after the other.

MFU = model FLOPs per second over the bf16 matmul rate measured in this run (8192^3 ``torch.mm``).
Model FLOPs per token = 6 * params (active parameters for MoE: experts counted top-k / E; the tied
head counted once, as a matmul) + the attention products 6 * layers * 2 * q_width * (mean causal
span), the span of a token being its position; recomputation under checkpointing is not counted
(it is overhead, not model work).
"""


from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from noria.bench import print_table, write_json
from noria.bench.gpu_common import bf16_matmul_rate, device_name, random_model


def add_arguments(parser) -> None:
    """``noria bench gpu-train``'s arguments."""
    parser.description = "CUDA: tokens/s and MFU of one RL step on a random Qwen3-shaped model."
    parser.add_argument("--model", default="qwen3-1.7b", help="qwen3-0.6b, qwen3-1.7b or qwen3-30b-a3b (pruned: --layers)")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the pruned qwen3-30b-a3b shape")
    parser.add_argument("--backend", default="fsdp2", help="comma-separated: fsdp2, megatron (side by side)")
    parser.add_argument("--sequences", type=int, default=24, help="sequences in the step's batch")
    parser.add_argument("--min-len", type=int, default=512, help="shortest sequence, in tokens (lengths are seeded, uniform)")
    parser.add_argument("--max-len", type=int, default=1536, help="longest sequence, in tokens")
    parser.add_argument("--steps", type=int, default=3, help="timed RL steps (after the warm-up ones)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed RL steps first (compiles, allocator warm-up)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="train.micro_batch_tokens: packed tokens per micro-batch")
    parser.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    parser.add_argument("--compile", action="store_true", help="train.compile: torch.compile each decoder layer")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise SystemExit(f"--backend: unknown {unknown or backends}; choose from {', '.join(BACKENDS)}")
    run(args.model, args.sequences, args.min_len, args.max_len, args.steps, args.warmup,
        args.micro_batch_tokens, not args.no_checkpointing, compile=args.compile, json_path=args.json,
        backends=backends, layers=args.layers)
    return 0


BACKENDS = {"fsdp2": "single", "megatron": "megatron"}
"""``--backend`` names -> ``train.backend`` (one GPU: FSDP2 is the single-process path of the same backend)."""


def model_config(model: str, layers: int) -> dict:
    """The HF config.json dict of ``--model``."""
    from noria.bench.gpu_common import qwen3_config
    from noria.bench.gpu_moe import moe_config

    return moe_config(layers) if model == "qwen3-30b-a3b" else qwen3_config(model)


def run(model: str = "qwen3-1.7b", sequences: int = 24, min_len: int = 512, max_len: int = 1536, steps: int = 3,
        warmup: int = 1, micro_batch_tokens: int = 8192, activation_checkpointing: bool = True, compile: bool = False,
        json_path: str | None = None, work_dir: str | None = None, backends: list[str] = ("fsdp2",),
        layers: int = 6) -> list[dict]:
    from noria.models import save_model

    rate = bf16_matmul_rate()
    rows = []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        lm = random_model(model_config(model, layers))
        folder = save_model(lm, Path(tmp) / model)  # HF layout (one tensor per expert)
        params = active_params(lm)
        del lm
        torch.cuda.empty_cache()
        for name in backends:
            fig = _measure(folder, sequences, min_len, max_len, steps, warmup, micro_batch_tokens,
                           activation_checkpointing, compile, BACKENDS[name], params)
            rows.append(_row(model if model != "qwen3-30b-a3b" else f"{model}-{layers}-layers", name, fig, rate, steps,
                             sequences, min_len, max_len, micro_batch_tokens, activation_checkpointing, compile))
            gc.collect()  # the backend just measured holds the GPU until collected
            torch.cuda.empty_cache()
    print_table(f"one RL step on {device_name()}",
                ["case", "backend", "tokens/s", "step_s", "bound tokens/s", "MFU", "peak GB"],
                [[r["case"], r["backend"], r["noria"], r["step_s"], r["bound"], r["mfu"], r["peak_gpu_gb"]] for r in rows])
    if json_path:
        write_json(json_path, "gpu-train", rows)
    return rows


def active_params(lm) -> int:
    """Parameters one token uses (each once, the tied head included once): all of a dense model;
    for MoE, all but the experts plus top-k / E of them."""
    total = sum(p.numel() for p in lm.parameters())
    moe = lm.args.moe
    if moe is None:
        return total
    experts = sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n)
    return total - experts + experts * moe.top_k // moe.num_experts


def _row(model, backend, fig, rate, steps, sequences, min_len, max_len, micro_batch_tokens, checkpointing, compile):
    tokens_per_s = fig["tokens"] * steps / fig["seconds"]
    precision = "bf16-params fp32-master" if backend == "megatron" else "bf16-autocast fp32-master"
    return {"case": f"{model} random {precision} rl-step seqs={sequences} len={min_len}-{max_len} "
                    f"micro_batch_tokens={micro_batch_tokens} checkpointing={checkpointing} compile={compile}",
            "backend": backend, "metric": "tokens_per_s", "noria": round(tokens_per_s, 1), "peers": {},
            "bound": round(rate / fig["flops_per_token"], 1), "mfu": round(tokens_per_s * fig["flops_per_token"] / rate, 4),
            "matmul_tflops": round(rate / 1e12, 1), "step_s": round(fig["seconds"] / steps, 3),
            "peak_gpu_gb": round(fig["peak_bytes"] / 1e9, 2), "params": fig["params"], "device": device_name()}


def _measure(folder, sequences, min_len, max_len, steps, warmup, micro_batch_tokens, checkpointing, compile=False,
             backend_name: str = "single", params: int | None = None) -> dict:
    from noria.config import TrainConfig
    from noria.models.config import ModelArgs
    from noria.train import build_backend
    from noria.train.packing import pack_samples
    from noria.types import Sample

    cfg = TrainConfig(algorithm="rl", backend=backend_name, device="cuda", param_dtype="bfloat16",
                      micro_batch_tokens=micro_batch_tokens, activation_checkpointing=checkpointing,
                      compile=compile and backend_name != "megatron")
    cfg.loss.policy_loss, cfg.loss.aggregation = "ppo_clip", "token_mean"
    backend = build_backend(cfg)
    backend.init(str(folder))
    args = ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_len, max_len + 1, (sequences,), generator=g).tolist()
    vocab = args.vocab_size
    samples = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[: n // 2], response_ids=ids[n // 2 :], loss_mask=[1] * (n - n // 2)))
    batch = pack_samples(samples, torch.randn(sequences, generator=g).tolist())
    params = params or sum(p.numel() for p in backend.lm.parameters())
    span = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)  # mean keys per query
    flops_per_token = 6 * params + 6 * args.num_layers * 2 * args.num_heads * args.head_dim * span
    for _ in range(warmup):
        backend.train_step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        backend.train_step(batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens": sum(lengths), "seconds": seconds, "params": params, "flops_per_token": flops_per_token,
            "peak_bytes": torch.cuda.max_memory_allocated()}
