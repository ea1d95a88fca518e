"""``noria bench gpu-train``: one RL optimizer step of Noria's trainer on a CUDA GPU, tokens/s and MFU.

Case: a random-init model of a Qwen3 size written to a folder, ``sequences`` sequences with seeded
lengths uniform in [min_len, max_len] (random ids, half prompt, half response), packed into
micro-batches of ``micro_batch_tokens``. One step = ``FSDPBackend.train_step`` (``backend: single``,
``device: cuda``): fp32 master weights, bf16 autocast, per-sequence causal SDPA over the packed row
(flash kernel), activation checkpointing per layer, ppo_clip loss, grad clip, AdamW.

MFU = model FLOPs per second over the bf16 matmul rate measured in this run (8192^3 ``torch.mm``).
Model FLOPs per token = 6 * params (the tied head counted once, as a matmul) + the attention
products 6 * layers * 2 * q_width * (mean causal span), the span of a token being its position;
recomputation under checkpointing is not counted (it is overhead, not model work).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from noria.bench import print_table, write_json
from noria.bench.gpu_common import bf16_matmul_rate, device_name, random_model, write_model_folder


def add_arguments(parser) -> None:
    """``noria bench gpu-train``'s arguments."""
    parser.description = "CUDA: tokens/s and MFU of one RL step on a random Qwen3-shaped model."
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    parser.add_argument("--compile", action="store_true", help="train.compile: torch.compile each decoder layer")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run(args.model, args.sequences, args.min_len, args.max_len, args.steps, args.warmup,
        args.micro_batch_tokens, not args.no_checkpointing, compile=args.compile, json_path=args.json)
    return 0


def run(model: str = "qwen3-1.7b", sequences: int = 24, min_len: int = 512, max_len: int = 1536, steps: int = 3,
        warmup: int = 1, micro_batch_tokens: int = 8192, activation_checkpointing: bool = True, compile: bool = False,
        json_path: str | None = None, work_dir: str | None = None) -> list[dict]:
    rate = bf16_matmul_rate()
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        lm = random_model(model)
        folder = write_model_folder(lm, Path(tmp) / model)
        del lm
        torch.cuda.empty_cache()
        fig = _measure(folder, sequences, min_len, max_len, steps, warmup, micro_batch_tokens, activation_checkpointing,
                       compile)
    tokens_per_s = fig["tokens"] * steps / fig["seconds"]
    mfu = tokens_per_s * fig["flops_per_token"] / rate
    row = {"case": f"{model} random bf16-autocast fp32-master rl-step seqs={sequences} len={min_len}-{max_len} "
                   f"micro_batch_tokens={micro_batch_tokens} checkpointing={activation_checkpointing} compile={compile}",
           "metric": "tokens_per_s", "noria": round(tokens_per_s, 1), "peers": {},
           "bound": round(rate / fig["flops_per_token"], 1), "mfu": round(mfu, 4),
           "matmul_tflops": round(rate / 1e12, 1), "step_s": round(fig["seconds"] / steps, 3),
           "peak_gpu_gb": round(fig["peak_bytes"] / 1e9, 2), "params": fig["params"], "device": device_name()}
    print_table(f"one RL step on {device_name()}", ["case", "tokens/s", "step_s", "bound tokens/s", "MFU", "peak GB"],
                [[row["case"], row["noria"], row["step_s"], row["bound"], mfu, row["peak_gpu_gb"]]])
    if json_path:
        write_json(json_path, "gpu-train", [row])
    return [row]


def _measure(folder, sequences, min_len, max_len, steps, warmup, micro_batch_tokens, checkpointing, compile=False) -> dict:
    from noria.config import TrainConfig
    from noria.models.config import ModelArgs
    from noria.train.fsdp import FSDPBackend
    from noria.train.packing import pack_samples
    from noria.types import Sample

    cfg = TrainConfig(algorithm="rl", backend="single", device="cuda", param_dtype="bfloat16",
                      micro_batch_tokens=micro_batch_tokens, activation_checkpointing=checkpointing, compile=compile)
    cfg.loss.policy_loss, cfg.loss.aggregation = "ppo_clip", "token_mean"
    backend = FSDPBackend(cfg)
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
    params = sum(p.numel() for p in backend.lm.parameters())
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
