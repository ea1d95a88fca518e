"""``noria bench train``: tokens/s and memory of one RL optimizer step, Noria's trainer vs its peers.

The case: ``n`` sequences with seeded lengths uniform in [min_len, max_len], random token ids from
the model's vocabulary, the first half of each the prompt and the second half the response
(loss tokens), one seeded advantage per sequence. One step is what a GRPO step costs on the
trainer: forward, the clipped-ratio policy loss (ppo_clip, eps 0.2 / 0.28, on-policy so the old
logprobs are the current ones detached, token mean over all response tokens of the step),
backward, grad-norm clip at 1.0, AdamW. Each side runs in a fresh subprocess:

- ``noria``: ``FSDPBackend`` (``backend: single``) packing the sequences into token-budget
  micro-batches of ``micro_batch_tokens`` (no padding, per-sequence attention), chunked logprobs.
- ``hf_padded``: transformers' ``AutoModelForCausalLM`` with the same sequences right-padded into
  micro-batches of the same number of sequences as Noria's average micro-batch, full-vocabulary
  logits, the same loss written out, ``torch.optim.AdamW``.
- ``trl``: TRL's ``GRPOTrainer`` (``loss_type: dapo``, its default: token sum over the generation
  batch's token count, i.e. the same token mean) driven on the fixed batch without generation:
  ``compute_loss`` per micro-batch, ``accelerator.backward``, the accelerator's grad clip, the
  trainer's own AdamW. Its inputs follow TRL's layout: prompts left-padded and completions
  right-padded to the longest of the whole batch, as ``_generate_and_score_completions`` builds them.

Precision is the same everywhere: fp32 master weights and AdamW state, compute in the dtype
``model.dtype: auto`` picks on this CPU (``noria info``: bf16 with native bf16, else fp32): bf16
through ``torch.autocast`` (Noria's single-process path; ``hf_padded`` does the same; TRL through
accelerate's ``mixed_precision=bf16``), or plain fp32 on all sides.

Figures: ``tokens_per_s`` counts real tokens (no padding) over the timed steps, after warm-up
steps that build kernels and the AdamW state. ``peak_rss_mb`` (lower is better) is the peak
resident memory during the timed steps minus the RSS after imports, before the model loads: model,
optimizer state, gradients and activations. The peak is Linux's VmHWM, reset (``/proc/self/
clear_refs``) after the warm-up so that a transient of model loading does not count; where that
reset is refused it is ``ru_maxrss`` of the whole process. ``bound`` is the tokens/s a step would
reach if it were only its matmuls at this machine's GEMM rate in that dtype, measured in the run on the
model's linear shapes: rate / (6 * params); ``noria/bound`` is the MFU.

Not measured: generation, reference or old-logprob passes (both are the same for all sides), and
multi-process FSDP2.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

from noria.process import run as run_command

SEED = 0
PEERS = ("hf_padded", "trl")
CLIP_LOW, CLIP_HIGH, LR, MAX_NORM = 0.2, 0.28, 1e-6, 1.0


def add_arguments(parser) -> None:
    """``noria bench train``'s arguments."""
    parser.description = ("The same sequences (seeded lengths, random ids, half prompt half response) go through one "
                          "GRPO-style optimizer step (forward, backward, AdamW) in Noria's backend and in each peer, every "
                          "side in a fresh subprocess; tokens/s counts real tokens, memory is the peak RSS growth of the "
                          "step; the bound is 6 * params * tokens/s at the bf16 GEMM rate measured in the run.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    parser.add_argument("--sequences", type=int, default=32, help="sequences per step")
    parser.add_argument("--min-len", type=int, default=64, help="shortest sequence (tokens)")
    parser.add_argument("--max-len", type=int, default=512, help="longest sequence (tokens)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="Noria's packed tokens per micro-batch")
    parser.add_argument("--peers", default="hf_padded,trl", help="comma-separated peers: hf_padded, trl (empty for none)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    peers = [p for p in args.peers.split(",") if p]
    run(args.model, args.sequences, args.min_len, args.max_len, args.steps, peers, args.json,
        micro_batch_tokens=args.micro_batch_tokens, warmup=args.warmup)
    return 0


def run(
    model: str,
    sequences: int = 32,
    min_len: int = 64,
    max_len: int = 512,
    steps: int = 3,
    peers: list[str] | tuple[str, ...] = PEERS,
    json_path: str | None = None,
    micro_batch_tokens: int = 4096,
    warmup: int = 1,
) -> list[dict]:
    """Measure every side in its own subprocess, print the table, write the JSON; returns results."""
    from noria.bench import write_json
    from noria.models.catalog import model_path

    unknown = set(peers) - set(PEERS)
    if unknown or not 1 <= min_len <= max_len or sequences < 1 or steps < 1:
        raise ValueError(f"bad arguments: peers {sorted(unknown)} unknown, or empty lengths / sequences / steps")
    from noria.hardware import auto_dtype

    folder = model_path(model)
    job = {"model": str(folder), "sequences": sequences, "min_len": min_len, "max_len": max_len, "steps": steps,
           "warmup": warmup, "micro_batch_tokens": micro_batch_tokens, "dtype": auto_dtype("cpu")}
    job["micro_seqs"] = peer_micro_seqs(job)
    figures = {side: run_side(side, job) for side in ("noria", *peers)}
    bound = gemm_bound(folder, figures["noria"]["params"], min(micro_batch_tokens, 2048), job["dtype"])
    results = build_results(model, job, figures, bound)
    print_results(results, list(peers))
    if json_path:
        write_json(json_path, "train", results)
    return results


# --------------------------------------------------------------------------------------- case


def make_case(job: dict[str, Any]) -> tuple[list[tuple[list[int], list[int]]], list[float]]:
    """(prompt ids, response ids) per sequence and one advantage per sequence, all seeded."""
    import torch

    from noria.models.checkpoint import read_config

    vocab = int(read_config(job["model"])["vocab_size"])
    g = torch.Generator().manual_seed(SEED + 1)
    seqs = []
    for length in case_lengths(job):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        seqs.append((ids[: length // 2], ids[length // 2 :]))
    return seqs, torch.randn(len(seqs), generator=g).tolist()


def peer_micro_seqs(job: dict[str, Any]) -> int:
    """Sequences per peer micro-batch: Noria's sequence count over its micro-batch count."""
    lengths = case_lengths(job)
    batches, used = 1, 0
    for i, n in enumerate(lengths):  # the same cut as noria.train.packing.plan_micro_batches
        if i and used + n > job["micro_batch_tokens"]:
            batches, used = batches + 1, 0
        used += n
    return math.ceil(len(lengths) / batches)


def case_lengths(job: dict[str, Any]) -> list[int]:
    """The seeded sequence lengths, uniform in [min_len, max_len]."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    return torch.randint(job["min_len"], job["max_len"] + 1, (job["sequences"],), generator=g).tolist()


# ------------------------------------------------------------------------------------ parent


def run_side(side: str, job: dict[str, Any]) -> dict[str, float]:
    """Run one side in a fresh interpreter (its memory is its own) and read its JSON line."""
    cmd = [sys.executable, "-m", "noria.bench.train", side]
    proc = run_command(cmd, check=False, input=json.dumps(job), capture=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench train side {side!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"bench train side {side!r} printed no result:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def gemm_bound(folder: Path, params: int, rows: int, dtype: str) -> float:
    """tokens/s of a step made only of matmuls at the measured GEMM rate: rate / (6 * params)."""
    import torch

    from noria.models import load_model

    model = load_model(folder, dtype=getattr(torch, dtype))
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=getattr(torch, dtype)) for w in weights}
    flops = 2 * rows * sum(w.numel() for w in weights)

    def gemms() -> None:
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)

    gemms()  # kernels built, weights touched
    best = min(_seconds(gemms) for _ in range(5))
    return flops / best / (6 * params)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_results(model: str, job: dict[str, Any], figures: dict[str, dict], bound: float) -> list[dict]:
    """Benchmark rows (``noria.bench``): tokens/s (with the MFU bound) and peak memory."""
    case = (f"{Path(model).name} {job['dtype']} rl-step seqs={job['sequences']} len={job['min_len']}-{job['max_len']} "
            f"micro_batch_tokens={job['micro_batch_tokens']} peer_micro_seqs={job['micro_seqs']}")
    peers = {k: v for k, v in figures.items() if k != "noria"}
    return [
        {"case": case, "metric": "tokens_per_s", "noria": round(figures["noria"]["tokens_per_s"], 1),
         "peers": {k: round(v["tokens_per_s"], 1) for k, v in peers.items()}, "bound": round(bound, 1)},
        {"case": case, "metric": "peak_rss_mb", "noria": round(figures["noria"]["peak_rss_mb"], 1),
         "peers": {k: round(v["peak_rss_mb"], 1) for k, v in peers.items()}, "bound": None},
    ]


def print_results(results: list[dict], peers: list[str]) -> None:
    from noria.bench import print_table

    header = ["metric", "noria", *peers, *[f"noria/{p}" for p in peers], "bound", "noria/bound"]
    rows = []
    for r in results:
        values = [r["peers"].get(p) for p in peers]
        ratios = [r["noria"] / v if v else None for v in values]
        mfu = r["noria"] / r["bound"] if r["bound"] else None
        rows.append([r["metric"], r["noria"], *values, *ratios, r["bound"], mfu])
    print_table(f"one RL step: {results[0]['case']} (tokens_per_s higher is better, peak_rss_mb lower)", header, rows)


# ------------------------------------------------------------------------------------ worker


def rss_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(step, job: dict[str, Any], real_tokens: int, baseline_kb: int) -> dict[str, float]:
    """Warm up, reset the memory peak, time ``steps`` steps."""
    for _ in range(job["warmup"]):
        step()
    resettable = reset_peak()
    start = time.perf_counter()
    for _ in range(job["steps"]):
        step()
    seconds = time.perf_counter() - start
    peak_kb = rss_kb("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens_per_s": real_tokens * job["steps"] / seconds, "step_s": seconds / job["steps"],
            "peak_rss_mb": (peak_kb - baseline_kb) / 1024, "peak_reset": resettable}


def noria_step(job: dict[str, Any]):
    """Noria's backend on the packed case; returns (step fn, real tokens, params)."""
    from noria.config import TrainConfig
    from noria.train.fsdp import FSDPBackend
    from noria.train.packing import pack_samples
    from noria.types import Sample

    cfg = TrainConfig(algorithm="rl", backend="single", param_dtype=job["dtype"], micro_batch_tokens=job["micro_batch_tokens"])
    cfg.loss.policy_loss, cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.aggregation = "ppo_clip", CLIP_LOW, CLIP_HIGH, "token_mean"
    cfg.optim.lr, cfg.optim.grad_clip = LR, MAX_NORM
    backend = FSDPBackend(cfg)
    backend.init(job["model"])
    seqs, adv = make_case(job)
    batch = pack_samples([Sample(prompt_ids=p, response_ids=r, loss_mask=[1] * len(r)) for p, r in seqs], adv)
    params = sum(p.numel() for p in backend.lm.parameters())
    return (lambda: backend.train_step(batch)), batch.n_tokens, params


def hf_padded_step(job: dict[str, Any]):
    """transformers on right-padded micro-batches, the loss written out; (step fn, real tokens, params)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    seqs, adv = make_case(job)
    chunks = [right_padded(seqs[i : i + job["micro_seqs"]], adv[i : i + job["micro_seqs"]])
              for i in range(0, len(seqs), job["micro_seqs"])]
    total = float(sum(len(r) for _, r in seqs))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for ids, attn, mask, a in chunks:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=job["dtype"] == "bfloat16"):
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            lp = selected_logprobs(logits, ids[:, 1:])
            (clipped_pg(lp, a, mask[:, 1:]) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()

    return step, sum(len(p) + len(r) for p, r in seqs), sum(p.numel() for p in model.parameters())


def right_padded(seqs, adv):
    """ids, attention mask, response mask [b, T] and advantages [b] of right-padded sequences."""
    import torch

    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros(len(seqs), width)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        mask[i, len(p) : len(p) + len(r)] = 1
    return ids, attn, mask, torch.tensor(adv)


def selected_logprobs(logits, targets):
    """log p(target) per position, one row at a time (TRL's selective_log_softmax for bf16 logits)."""
    import torch

    rows = [row.float().log_softmax(-1).gather(-1, t[:, None])[:, 0] for row, t in zip(logits, targets)]
    return torch.stack(rows)


def clipped_pg(lp, adv, mask):
    """Summed clipped-ratio policy loss over masked tokens (old logprobs = current, detached)."""
    import torch

    ratio = torch.exp(lp - lp.detach())
    a = adv[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
    return (per_token * mask).sum()


def trl_step(job: dict[str, Any]):
    """TRL's GRPOTrainer loss step on the fixed batch; (step fn, real tokens, params)."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    seqs, adv = make_case(job)
    s = job["micro_seqs"]
    m = math.ceil(len(seqs) / s)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="noria-bench-trl-"), per_device_train_batch_size=s,
        gradient_accumulation_steps=m, num_generations=max(s * m, 2), bf16=job["dtype"] == "bfloat16", use_cpu=True, report_to=[],
        loss_type="dapo", beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, learning_rate=LR,
        max_grad_norm=MAX_NORM, weight_decay=0.0, lr_scheduler_type="constant", save_strategy="no",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=_no_reward, args=args, processing_class=AutoTokenizer.from_pretrained(job["model"]),
                          train_dataset=Dataset.from_dict({"prompt": ["-"] * (s * m)}))
    trainer.create_optimizer_and_scheduler(num_training_steps=job["warmup"] + job["steps"])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = m
    inputs = trl_inputs(seqs, adv)
    chunks = [{k: (v[i : i + s] if v.dim() else v) for k, v in inputs.items()} for i in range(0, len(seqs), s)]

    def step() -> None:
        for chunk in chunks:
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, chunk))
        trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), MAX_NORM)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return step, sum(len(p) + len(r) for p, r in seqs), sum(p.numel() for p in model.parameters())


def _no_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trl_inputs(seqs, adv) -> dict[str, Any]:
    """TRL's batch layout: prompts left-padded, completions right-padded, over the whole batch."""
    import torch

    n, pw, cw = len(seqs), max(len(p) for p, _ in seqs), max(len(r) for _, r in seqs)
    prompt_ids, completion_ids = torch.zeros(n, pw, dtype=torch.long), torch.zeros(n, cw, dtype=torch.long)
    prompt_mask, completion_mask = torch.zeros_like(prompt_ids), torch.zeros_like(completion_ids)
    for i, (p, r) in enumerate(seqs):
        prompt_ids[i, pw - len(p) :], prompt_mask[i, pw - len(p) :] = torch.tensor(p), 1
        completion_ids[i, : len(r)], completion_mask[i, : len(r)] = torch.tensor(r), 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor(adv),
            "num_items_in_batch": completion_mask.sum().float()}


SIDES = {"noria": noria_step, "hf_padded": hf_padded_step, "trl": trl_step}


def worker_main(side: str) -> None:
    """Subprocess entry: job JSON on stdin, one JSON line of figures on stdout."""
    job = json.loads(sys.stdin.read())
    import torch  # noqa: F401  (imports are part of the baseline, not of the step's memory)
    import transformers  # noqa: F401

    import noria.train  # noqa: F401

    if side == "trl":
        import trl  # noqa: F401
    baseline_kb = rss_kb("VmRSS")
    step, real_tokens, params = SIDES[side](job)
    out = measure(step, job, real_tokens, baseline_kb)
    out.update(side=side, params=params, real_tokens=real_tokens)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1])
