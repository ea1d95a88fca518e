"""``noria bench gpu-multi``: several GPUs of one host (issue 10), or the same code on one GPU or the CPU.

Two parts (``--parts fsdp,rl``), each against its one-device peer measured in the same run:

- ``fsdp``: FSDP2 (``train.backend: fsdp2``, NCCL, one rank per GPU) against the one-GPU trainer
  (``backend: single``) on a random-init Qwen3-shaped model. The same ``--sequences`` random
  sequences (seeded lengths in [min_len, max_len], half prompt, half trained response) make one
  batch, trained ``warmup + steps`` times in a row. The loss is the token-mean NLL of the response
  tokens (``train.algorithm: sft``): it depends on every weight, so equal losses step after step mean
  equal models (an on-policy PPO loss is the same number whatever the weights: ratio 1). The compute
  of a step is that of an RL step (forward and backward through the packed rows, trained tokens
  through the head). Figures: step seconds and tokens/s (steps after the warmup), MFU = model FLOP/s
  (6 * params + attention, as in ``gpu-train``) over (ranks x the bf16 matmul rate measured in this
  run on GPU 0), and both runs' losses with their largest relative difference. bf16 numerics differ
  by design (FSDP2 casts parameters, the one-GPU path autocasts; reductions run in another order),
  so the losses agree to bf16 tolerance, not bitwise.
- ``rl``: the main job's algorithm (examples/grpo_smollm2_arithmetic.yaml: GRPO, ppo_clip,
  token_mean, temperature 0.7, arithmetic prompts with the chat template) run twice with ``noria
  train``: synchronous and colocated on the engine's GPU (the peer), and fully asynchronous
  (``rollout.max_staleness`` k, ``loss.off_policy: tis``) with the engine as a ``noria serve``
  process on ``--engine-device`` (``rollout.engine_device``) and the trainer on ``--trainer-device``
  (``train.device``), weights over the ``broadcast`` transport (an NCCL group between the two GPUs).
  Figures (``metrics.jsonl``, steps after the first): trained tokens/s, staleness mean and max of
  the trained groups, weight-sync seconds and GB/s, and a raw broadcast of the same bytes between
  the same two devices over the same backend (two processes, one flat tensor, median of 3) with the
  ratio. The model: the Qwen3 layers of ``--rl-model`` with the vocabulary of a byte-level BPE
  tokenizer trained here (a few hundred ids: no hub on the GPU host), random weights. Reward: a
  random model never answers right, so the main job's ``numeric`` reward would be 0 everywhere and
  every group zero-variance; the reward is the share of digits in the response
  (``noria.bench.async_rl:digit_share``), which differs between random responses, so GRPO has
  non-zero advantages and the trainer real work.

Layouts (``--layout``):

========== ===================================== ============================================ =========
layout     fsdp                                  rl (async side)                              needs
========== ===================================== ============================================ =========
two-gpus   2 NCCL ranks vs 1 GPU                 engine cuda:0, trainer cuda:1, NCCL           2 GPUs
one-gpu    FSDP2 on 1 NCCL rank vs single        engine and trainer on cuda:0 in two           1 GPU
                                                 processes, gloo broadcast of CUDA tensors
cpu        2 gloo ranks vs 1 process, tiny model engine and trainer processes on the CPU, gloo  nothing
========== ===================================== ============================================ =========

Every process runs with NVLink multicast off (``noria.process.env``); the FSDP ranks report the
variables they saw (``multicast_off_env`` in the JSON).

Not measured: more than 2 GPUs, several engines, FSDP2 trainer ranks in the RL job (the local
launcher runs one trainer process), GPUs of different hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.net import free_port
from noria.process import run as run_command
from noria.process import spawn


@dataclass(frozen=True)
class Layout:
    """Where each part runs."""

    device: str
    """cuda or cpu: the FSDP ranks' device type."""
    fsdp_world: int
    """FSDP2 ranks of the ``fsdp`` part."""
    engine: str
    """The engine's device in the ``rl`` part (also the colocated peer's device)."""
    trainer: str
    """The asynchronous side's trainer device."""
    gpus: int
    """CUDA devices it needs."""


LAYOUTS = {
    "two-gpus": Layout("cuda", 2, "cuda:0", "cuda:1", 2),
    "one-gpu": Layout("cuda", 1, "cuda:0", "cuda:0", 1),
    "cpu": Layout("cpu", 2, "cpu", "cpu", 0),
}

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 2048}  # fmt: skip
"""A Qwen3 config small enough for the CPU (``--model tiny``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    a = parser.add_argument
    a("--layout", choices=sorted(LAYOUTS), default="two-gpus",
      help="two-gpus (default), one-gpu (the same code on one GPU: FSDP2 on one NCCL rank; engine and trainer in "
           "two processes on cuda:0 with a gloo broadcast), cpu (gloo, for tests)")  # fmt: skip
    a("--parts", default="fsdp,rl", help="comma-separated: fsdp, rl")
    a("--model", help="fsdp part: qwen3-0.6b, qwen3-1.7b (default on GPUs) or tiny (default on the CPU)")
    a("--sequences", type=int, default=32, help="fsdp part: sequences in the batch")
    a("--min-len", type=int, default=512, help="fsdp part: shortest sequence, in tokens")
    a("--max-len", type=int, default=1536, help="fsdp part: longest sequence, in tokens")
    a("--steps", type=int, default=4, help="fsdp part: timed optimizer steps (after the warmup)")
    a("--warmup", type=int, default=1, help="fsdp part: untimed optimizer steps first")
    a("--micro-batch-tokens", type=int, default=8192, help="fsdp part: train.micro_batch_tokens")
    a("--lr", type=float, default=3e-5, help="fsdp part: AdamW learning rate (the losses must move)")
    a("--rl-model", help="rl part: Qwen3 layers of qwen3-0.6b, qwen3-1.7b (default on GPUs) or tiny (CPU default)")
    a("--rl-steps", type=int, default=6, help="rl part: rollout steps per side (the first is not timed)")
    a("--prompts-per-step", type=int, default=8, help="rl part: rollout.prompts_per_step")
    a("--n-samples", type=int, default=8, help="rl part: rollout.n_samples (the group size)")
    a("--max-new-tokens", type=int, default=256, help="rl part: rollout.max_new_tokens")
    a("--staleness", type=int, default=2, help="rl part: rollout.max_staleness of the asynchronous side")
    a("--rl-micro-batch-tokens", type=int, default=8192, help="rl part: train.micro_batch_tokens")
    a("--work-dir", help="folder for model folders, configs and run folders, kept (default a temp folder, removed)")
    a("--json", help="write the figures to this JSON file")


def main(args: argparse.Namespace) -> int:
    from noria.process.env import multicast_off

    multicast_off()
    layout = LAYOUTS[args.layout]
    check_devices(args.layout, layout)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"fsdp", "rl"}
    if unknown:
        raise SystemExit(f"noria bench gpu-multi: unknown parts {sorted(unknown)}; use fsdp, rl")
    with tempfile.TemporaryDirectory(prefix="noria-bench-multi-") as tmp:  # model folders are GBs: removed after
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows: list[dict] = []
        if "fsdp" in parts:
            rows += fsdp_part(args, layout, work)
        if "rl" in parts:
            rows += rl_part(args, layout, work)
    if args.json:
        from noria.bench import write_json

        write_json(args.json, "gpu-multi", rows)
    return 0


def check_devices(name: str, layout: Layout) -> None:
    """Stop with what the layout needs when this host has fewer CUDA devices."""
    if layout.gpus == 0:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < layout.gpus:
        raise SystemExit(
            f"noria bench gpu-multi --layout {name} needs {layout.gpus} CUDA device(s), this host has {found}. "
            "With one GPU run --layout one-gpu (engine and trainer on cuda:0 in two processes, FSDP2 on one rank); "
            "without a GPU, --layout cpu (gloo, tiny model)."
        )


# ------------------------------------------------------------------------------------ models


def model_config(name: str, vocab_size: int | None = None, special_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """An HF config.json dict: a Qwen3 size (``noria.bench.gpu_common``) or ``tiny``, optionally with
    another vocabulary (and its special token ids)."""
    from noria.bench.gpu_common import QWEN3, qwen3_config

    config = qwen3_config("qwen3-0.6b")
    if name == "tiny":
        config.update(TINY)
    elif name in QWEN3:
        config = qwen3_config(name)
    else:
        raise SystemExit(f"noria bench gpu-multi: unknown model {name!r}; use tiny, {', '.join(QWEN3)}")
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    config.update(special_ids or {})
    return config


def write_random_model(config: dict[str, Any], folder: Path, device: str, seed: int = 0) -> tuple[Path, int]:
    """A native DecoderLM of ``config`` with N(0, 0.02) weights (norms 1) saved as an HF folder in
    bf16; returns (folder, parameter count)."""
    import torch

    from noria.bench.gpu_common import random_model, write_model_folder

    lm = random_model(config, device, seed=seed)
    params = sum(p.numel() for p in lm.parameters())
    write_model_folder(lm, folder)
    del lm
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder, params


def write_tokenizer(folder: Path, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on arithmetic text, with a ChatML template (as SmolLM2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(60) for b in range(0, 60, 3)]
    corpus += ["You are a helpful assistant.", "Compute the sum and give the number."] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def flops_per_token(params: int, config: dict[str, Any], lengths: list[int]) -> float:
    """Model FLOPs per trained token, as ``gpu-train`` counts them: 6 * params (the tied head once, as
    a matmul) + the attention products 6 * layers * 2 * q_width * (mean causal span)."""
    span = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)
    q_width = config["num_attention_heads"] * config["head_dim"]
    return 6 * params + 6 * config["num_hidden_layers"] * 2 * q_width * span


def matmul_rate(device: str) -> float:
    """bf16 FLOP/s of a large square matmul: 8192^3 on CUDA (``gpu_common``), 1024^3 on the CPU."""
    import torch

    if device == "cuda":
        from noria.bench.gpu_common import bf16_matmul_rate

        rate = bf16_matmul_rate()
        torch.cuda.empty_cache()
        return rate
    n = 1024
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    torch.mm(a, b)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


# ------------------------------------------------------------------------------------ fsdp part


def fsdp_part(args: argparse.Namespace, layout: Layout, work: Path) -> list[dict]:
    from noria.bench import print_table

    name = args.model or ("tiny" if layout.device == "cpu" else "qwen3-1.7b")
    config = model_config(name)
    rate = matmul_rate(layout.device)
    folder, params = write_random_model(config, work / f"fsdp-{name}", "cuda" if layout.device == "cuda" else "cpu")
    lengths = seq_lengths(args.sequences, args.min_len, args.max_len)
    spec = {"folder": str(folder), "lengths": lengths, "vocab": config["vocab_size"], "steps": args.steps,
            "warmup": args.warmup, "micro_batch_tokens": args.micro_batch_tokens, "lr": args.lr}  # fmt: skip
    one_device = "cuda:0" if layout.device == "cuda" else "cpu"
    single = spawn_ranks(_fsdp_rank, 1, {**spec, "backend": "single", "device": one_device}, work / "fsdp-single.json")
    sharded = spawn_ranks(_fsdp_rank, layout.fsdp_world, {**spec, "backend": "fsdp2", "device": layout.device}, work / "fsdp.json")
    fpt = flops_per_token(params, config, lengths)
    world = layout.fsdp_world
    fig = {}
    for key, r, ranks in (("fsdp2", sharded, world), ("single", single, 1)):
        tps = sum(lengths) * args.steps / r["seconds"]
        fig[key] = {"tokens_per_s": tps, "step_s": r["seconds"] / args.steps, "mfu": tps * fpt / (ranks * rate), "losses": r["losses"]}
    diffs = [abs(a - b) / abs(b) for a, b in zip(fig["fsdp2"]["losses"], fig["single"]["losses"])]
    max_rel = max(diffs)
    case = (f"{name} random params={params / 1e6:.3g}M fsdp2 x{world} ({layout.device}) vs one {layout.device} "
            f"seqs={args.sequences} len={args.min_len}-{args.max_len} micro_batch_tokens={args.micro_batch_tokens} "
            f"sft-nll bf16 fp32-master checkpointing")  # fmt: skip
    f2, f1 = fig["fsdp2"], fig["single"]
    extra = {"world": world, "matmul_tflops": round(rate / 1e12, 2), "losses": f2["losses"], "losses_one_device": f1["losses"],
             "loss_max_rel_diff": max_rel, "multicast_off_env": sharded["env_ok"] and single["env_ok"], "env_seen": sharded["env"]}  # fmt: skip
    rows = [
        {"case": case, "metric": "tokens_per_s", "noria": round(f2["tokens_per_s"], 1), "peers": {"one_device": round(f1["tokens_per_s"], 1)},
         "bound": round(world * rate / fpt, 1), **extra},
        {"case": case, "metric": "step_s", "noria": round(f2["step_s"], 4), "peers": {"one_device": round(f1["step_s"], 4)}, "bound": None},
        {"case": case, "metric": "mfu", "noria": round(f2["mfu"], 4), "peers": {"one_device": round(f1["mfu"], 4)}, "bound": 1.0},
        {"case": case, "metric": "loss_max_rel_diff", "noria": max_rel, "peers": {}, "bound": None},
    ]  # fmt: skip
    print_table(f"FSDP2 x{world} vs one device: {case}", ["run", "step_s", "tokens/s", "MFU", "losses"],
                [[k, v["step_s"], v["tokens_per_s"], v["mfu"], " ".join(f"{x:.4f}" for x in v["losses"])] for k, v in fig.items()])
    print(f"loss max relative difference {max_rel:.2e}; bf16 matmul {rate / 1e12:.1f} TFLOP/s per device")
    return rows


def seq_lengths(n: int, lo: int, hi: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randint(lo, hi) for _ in range(n)]


def _fsdp_batch(lengths: list[int], vocab: int):
    import torch

    from noria.train.packing import pack_samples
    from noria.types import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[: n // 2], response_ids=ids[n // 2 :], loss_mask=[1] * (n - n // 2)))
    return pack_samples(samples)


def _fsdp_rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """One trainer rank: ``warmup + steps`` optimizer steps on the same batch; rank 0 writes the losses,
    the timed seconds and the multicast variables every rank saw."""
    import torch
    import torch.distributed as dist

    from noria.config import TrainConfig
    from noria.process.env import MULTICAST_OFF
    from noria.train.fsdp import FSDPBackend, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if spec["device"] == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    distributed = spec["backend"] == "fsdp2"
    if distributed:
        init_distributed(spec["device"])
    cfg = TrainConfig(algorithm="sft", backend=spec["backend"], world_size=world, device=spec["device"], param_dtype="bfloat16",
                      micro_batch_tokens=spec["micro_batch_tokens"], activation_checkpointing=True)  # fmt: skip
    cfg.optim.lr = spec["lr"]
    backend = FSDPBackend(cfg, seed=0)
    backend.init(spec["folder"])
    batch = _fsdp_batch(spec["lengths"], spec["vocab"])
    cuda = spec["device"].startswith("cuda")
    losses, seconds = [], 0.0
    for i in range(spec["warmup"] + spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = backend.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        if i >= spec["warmup"]:
            seconds += time.perf_counter() - t0
        losses.append(m["loss"])
    env = {k: os.environ.get(k) for k in MULTICAST_OFF}
    seen = [env]
    if distributed:
        seen = [None] * world
        dist.all_gather_object(seen, env)
    if rank == 0:
        ok = all(e == MULTICAST_OFF for e in seen)
        Path(out).write_text(json.dumps({"losses": losses, "seconds": seconds, "env": seen, "env_ok": ok}))


def spawn_ranks(fn, world: int, spec: dict, out: Path) -> dict:
    """``fn(rank, world, port, spec, out)`` in ``world`` fresh processes (dying with this one); rank 0's JSON."""
    from noria.train.fsdp import rank_process

    spawn(rank_process, (fn, world, free_port(), spec, str(out)), world)
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------ rl part


def rl_part(args: argparse.Namespace, layout: Layout, work: Path) -> list[dict]:
    import yaml

    from noria.bench import print_table
    from noria.launch.parts import same_cuda_device

    name = args.rl_model or ("tiny" if layout.device == "cpu" else "qwen3-1.7b")
    folder = work / f"rl-{name}"
    tok = write_tokenizer(folder)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = model_config(name, vocab_size=len(tok), special_ids=ids)
    _, params = write_random_model(config, folder, "cuda" if layout.device == "cuda" else "cpu")
    backend = "gloo" if layout.device == "cpu" or same_cuda_device(layout.engine, layout.trainer) else "nccl"
    sides: dict[str, dict[str, float]] = {}
    for side in ("sync", "async"):
        path = work / f"rl-{side}.yaml"
        path.write_text(yaml.safe_dump(rl_config(folder, side, layout, args)))
        run_dir = work / f"rl-{side}"
        cmd = [sys.executable, "-m", "noria", "train", str(path), "--run-dir", str(run_dir), "--no-progress"]
        print(f"bench gpu-multi: rl {side} -> {run_dir}", file=sys.stderr, flush=True)
        run_command(cmd)
        sides[side] = rl_figures(run_dir)
    a, s = sides["async"], sides["sync"]
    raw = spawn_ranks(_broadcast_rank, 2, {"bytes": int(a["sync_bytes"]), "backend": backend,
                                           "devices": [layout.trainer, layout.engine]}, work / "raw-broadcast.json")  # fmt: skip
    raw_gbps = a["sync_bytes"] / raw["seconds"] / 1e9
    case = (f"{name} layers random (vocab {len(tok)}) params={params / 1e6:.3g}M P={args.prompts_per_step} n={args.n_samples} "
            f"new<={args.max_new_tokens}: async k={args.staleness} engine {layout.engine} trainer {layout.trainer} "
            f"{backend} broadcast vs sync colocated on {layout.engine}")  # fmt: skip
    stale = {"staleness_mean": a["staleness_mean"], "staleness_max": a["staleness_max"], "mixed_versions_frac": a["mixed_versions_frac"]}
    rows = [
        {"case": case, "metric": "tokens_per_s", "noria": round(a["tokens_per_s"], 1), "peers": {"sync_colocated": round(s["tokens_per_s"], 1)},
         "bound": None, "steps": a["steps"], "wall_s": round(a["wall_s"], 2), "wall_s_sync_colocated": round(s["wall_s"], 2), **stale},
        {"case": case, "metric": "staleness_mean", "noria": a["staleness_mean"], "peers": {"sync_colocated": s["staleness_mean"]}, "bound": float(args.staleness)},
        {"case": case, "metric": "sync_gb_per_s", "noria": round(a["sync_gb_per_s"], 3), "peers": {}, "bound": round(raw_gbps, 3),
         "sync_bytes": a["sync_bytes"], "raw_broadcast_s": raw["seconds"], "ratio_to_raw": a["sync_gb_per_s"] / raw_gbps,
         "backend": backend, "sync_gb_per_s_colocated_ipc": round(s["sync_gb_per_s"], 3)},
        {"case": case, "metric": "sync_s", "noria": round(a["sync_s"], 4), "peers": {"sync_colocated_ipc": round(s["sync_s"], 4)},
         "bound": round(raw["seconds"], 4)},
    ]  # fmt: skip
    header = ["side", "tokens/s", "wall s", "trainer idle", "staleness mean", "staleness max", "sync s", "sync GB/s"]
    print_table(f"async RL on two devices vs sync colocated: {case}", header,
                [[k, v["tokens_per_s"], v["wall_s"], v["trainer_idle_frac"], v["staleness_mean"], v["staleness_max"], v["sync_s"], v["sync_gb_per_s"]]
                 for k, v in sides.items()])  # fmt: skip
    print(f"raw {backend} broadcast {layout.trainer} -> {layout.engine} of {a['sync_bytes'] / 1e9:.3f} GB: {raw['seconds']:.4f} s, "
          f"{raw_gbps:.2f} GB/s; the weight sync reaches {a['sync_gb_per_s'] / raw_gbps:.2f} of it")  # fmt: skip
    return rows


def rl_config(folder: Path, side: str, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """The main job's config (examples/grpo_smollm2_arithmetic.yaml) on this layout; see the module docstring."""
    cpu = layout.device == "cpu"
    cfg: dict[str, Any] = {
        "name": f"gpu-multi-{side}", "seed": 0,
        "model": {"path": str(folder), "dtype": "bfloat16", "device": layout.engine},
        "data": {"task": "arithmetic", "task_args": {"n_train": 2000, "n_test": 8, "seed": 0, "ops": ["+"]},
                 "chat_template": True, "max_prompt_tokens": 256},
        "reward": {"name": "noria.bench.async_rl:digit_share"},
        "rollout": {"n_samples": args.n_samples, "prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens,
                    "temperature": 0.7, "placement": "colocated"},
        "engine": {"kv_cache_tokens": 8192} if cpu else {},
        "train": {"algorithm": "rl", "max_steps": args.rl_steps, "device": layout.engine, "micro_batch_tokens": args.rl_micro_batch_tokens,
                  "activation_checkpointing": not cpu, "optim": {"lr": 5e-6, "grad_clip": 1.0},
                  "loss": {"advantage": "grpo", "policy_loss": "ppo_clip", "aggregation": "token_mean"}},
        "eval": {"every": 0},
    }  # fmt: skip
    if side == "async":
        cfg["rollout"].update(placement="disaggregated", engine_device=layout.engine, max_staleness=args.staleness)
        cfg["train"]["device"] = layout.trainer
        cfg["train"]["loss"]["off_policy"] = "tis"
        cfg["sync"] = {"transport": "broadcast"}
    return cfg


def rl_figures(run: Path) -> dict[str, float]:
    """Per-run figures from metrics.jsonl, steps after the first (it builds kernels and caches)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    if not rows:
        raise SystemExit(f"noria bench gpu-multi: {run} has no timed steps (need --rl-steps >= 2)")
    wall = sum(r["seconds"] for r in rows)
    return {
        "steps": len(rows),
        "wall_s": wall,
        "tokens_per_s": sum(r["rollout/trained_tokens"] for r in rows) / wall,
        "trainer_idle_frac": sum(r["time/trainer_wait_s"] for r in rows) / wall,
        "staleness_mean": statistics.mean(r["buffer/staleness_mean"] for r in rows),
        "staleness_max": max(r["buffer/staleness_max"] for r in rows),
        "mixed_versions_frac": statistics.mean(r["rollout/groups_mixed_versions_frac"] for r in rows),
        "sync_s": statistics.mean(r["sync/seconds"] for r in rows),
        "sync_gb_per_s": statistics.mean(r["sync/gb_per_s"] for r in rows),
        "sync_bytes": rows[-1]["sync/bytes"],
    }


def _broadcast_rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """The raw primitive: rank 0 (on the trainer's device) broadcasts one flat tensor of ``bytes`` to
    rank 1 (the engine's), over ``backend``; rank 0 writes the median seconds of 3 (after one warm-up),
    each up to a barrier after the broadcast (so the receiver has it)."""
    import torch
    import torch.distributed as dist

    device = torch.device(spec["devices"][rank])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if spec["backend"] == "nccl":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    buf = torch.empty(spec["bytes"], dtype=torch.uint8, device=device)
    if rank == 0:
        buf.random_(0, 256)
    times = []
    for i in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": statistics.median(times)}))
