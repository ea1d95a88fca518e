"""``noria bench gpu-rl``: the main job's algorithm end to end on a random Qwen3-shaped model.

What runs: ``examples/grpo_smollm2_arithmetic.yaml`` (GRPO advantages, ppo_clip, token mean, lr
5e-6, grad clip 1.0, temperature 0.7, colocated built-in engine, synchronous) loaded by the same
``load_config`` and run by the same ``noria.launch.rl.run_rl`` that ``noria train`` calls, with
these changes only (each is a config override, listed in the JSON row's ``overrides``):

- ``model.path``: a random-init model written by this bench (see below); ``model.device`` and
  ``train.device``: ``--device`` (cuda by default);
- ``rollout.prompts_per_step`` / ``n_samples`` / ``max_new_tokens``: ``--prompts`` / ``--samples``
  / ``--new-tokens`` (defaults 8 / 8 / 32, the example's); ``train.max_steps``: ``--steps`` + 1;
- ``reward.name``: ``noria.bench.gpu_rl:digit_share`` (below); ``eval.every`` 0 (no evaluation);
- ``engine.kv_cache_tokens``: at least one step's worth, ``prompts x samples x (64 + new tokens)``,
  so a larger setting is not throttled by retractions (the example's 32768 fits 8 x 8 x 32);
- anything passed with ``--set KEY=VALUE`` (e.g. ``--set engine.max_running_requests=512``);
- ``--launch ray``: ``launch=ray``, ``rollout.placement=disaggregated`` and engine and trainer actors
  of half the GPU each (``ray.engine_resources`` / ``ray.trainer_resources``), so the same job runs
  on the Ray launcher (``noria.launch.ray``; Ray must be installed) against the local launcher's rows.

The model: the Qwen3 body of ``--model`` (``qwen3-0.6b``: 28 layers, hidden 1024, 16 query and 8
KV heads of 128, tied embeddings), N(0, 0.02) weights, bf16 safetensors, with ``vocab_size``
151936 as in Qwen3 (``--vocab``), so the LM head and the trainer's [tokens, vocab] logprobs cost
what they cost in the real model. ``tiny`` (hidden 64, 2 layers) is the CPU test's.

The tokenizer (no hub, nothing to carry): a byte-level BPE trained here with ``tokenizers`` on a
small arithmetic corpus (about 500 tokens, ChatML chat template, as in tests/tiny_util.py), its
vocabulary then filled up to the model's ``vocab_size`` with tokens ``" <hex n>"`` (``" 0"``,
``" 1"``, ... ``" 2503f"``, skipping pieces the BPE already has). The fillers have no merges, so
prompts never encode to them, but every id the model can sample decodes to text: a random model
samples near-uniformly over 151936 ids, and without the fillers almost every response would decode
to an empty string. The stop token ``<|im_end|>`` is one id in 151936, so nearly every response runs
to ``max_new_tokens`` (fixed lengths: good for timing, unlike a real model's).

The reward: a random model never solves arithmetic, so the task's ``numeric`` reward is 0 for every
sample, every group has zero variance and every advantage is 0 (the example has no group filter, so
the optimizer still steps, with a zero gradient: measured here, grad_norm 0). ``digit_share`` (the
share of a response's characters that are digits) varies on random text, so groups keep a spread
of rewards and the trainer takes real steps (``grad_norm_mean`` > 0 in the JSON): a bench-only
reward, not a task.

Figures, from the job's own ``RUN_DIR/metrics.jsonl``, means over the steps after the first (the
first builds kernels and caches): ``seconds`` per step and its stages: ``rollout`` =
``time/trainer_wait_s`` (synchronous and colocated, the trainer waits for the whole rollout:
generation and reward scoring of the step's groups), ``train`` = ``time/train_s``, ``sync`` = ``sync/seconds``, ``other`` = the rest (engine
pause and KV release / re-acquire, step bookkeeping). Tokens per step: ``rollout/tokens``
(generated), ``rollout/trained_tokens`` (response tokens trained), ``tokens`` (prompt + response
through the trainer).

Not measured: the time between two steps outside the step's ``seconds`` (writing
``rollouts/step-N.jsonl``), model load, the final export; they are in ``run_s``.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_smollm2_arithmetic.yaml"
"""The main job's config: the bench runs it with the overrides listed in the module docstring."""

REWARD = "noria.bench.gpu_rl:digit_share"
QWEN3_VOCAB = 151936
SHAPES = ("qwen3-0.6b", "qwen3-1.7b", "tiny")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STAGES = ("rollout", "train", "sync", "other")


def add_arguments(parser) -> None:
    parser.description = ("The main job's GRPO loop (noria train's own code) on a random Qwen3-shaped model: seconds "
                          "per step and the share of each stage. --prompts, --samples and --new-tokens take comma "
                          "lists, one setting per position (a single value applies to all): "
                          "--prompts 8,64 --new-tokens 32,256 runs 8x8x32, then 64x8x256.")
    parser.add_argument("--model", default="qwen3-0.6b", choices=SHAPES, help="Qwen3 body (tiny: the CPU test's)")
    parser.add_argument("--device", default="cuda", help="model.device and train.device (cuda, cpu)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per setting, after one warm-up step")
    parser.add_argument("--prompts", default="8", help="rollout.prompts_per_step (comma list)")
    parser.add_argument("--samples", default="8", help="rollout.n_samples, the group size (comma list)")
    parser.add_argument("--new-tokens", default="32", help="rollout.max_new_tokens (comma list)")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="vocab_size of model and tokenizer")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more config override (repeatable), e.g. engine.max_running_requests=512")
    parser.add_argument("--launch", choices=("local", "ray"), default="local",
                        help="ray: the same job on the Ray launcher (a private instance; engine and trainer actors sharing "
                             "the GPU, half each), the rows' overrides say so")
    parser.add_argument("--work-dir", help="keep the model and run folders here (default: a temp folder, removed)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run(args.model, args.device, args.steps, settings(args.prompts, args.samples, args.new_tokens), args.vocab,
        launch_settings(args.launch, args.device) + args.set, args.json, args.work_dir)
    return 0


def launch_settings(launch: str, device: str) -> list[str]:
    """``--launch ray`` as ``--set`` items: the Ray launcher, the engine its own actor (disaggregated), engine
    and trainer actors each given half of the one GPU (or one CPU)."""
    if launch == "local":
        return []
    share = "{CPU: 1, GPU: 0.5}" if device.startswith("cuda") else "{CPU: 1}"
    return ["launch=ray", "rollout.placement=disaggregated", f"ray.engine_resources={share}", f"ray.trainer_resources={share}"]


def settings(prompts: str, samples: str, new_tokens: str) -> list[tuple[int, int, int]]:
    """Comma lists -> (prompts, samples, new tokens) per setting; a single value applies to every setting."""
    lists = [[int(v) for v in text.split(",") if v.strip()] for text in (prompts, samples, new_tokens)]
    n = max(len(v) for v in lists)
    if any(len(v) not in (1, n) for v in lists):
        raise ValueError(f"--prompts, --samples, --new-tokens: lists of {[len(v) for v in lists]} values; use 1 or {n}")
    return [tuple(v[i] if len(v) > 1 else v[0] for v in lists) for i in range(n)]


def run(model: str = "qwen3-0.6b", device: str = "cuda", steps: int = 3,
        cases: list[tuple[int, int, int]] = ((8, 8, 32),), vocab: int = QWEN3_VOCAB,
        extra: list[str] | tuple[str, ...] = (), json_path: str | None = None, work_dir: str | None = None) -> list[dict]:
    """Build the model once; per setting run the job for ``steps`` + 1 steps; print the table, write the JSON."""
    from noria.bench import write_json

    for prompts, samples, new_tokens in cases:
        if steps < 1 or prompts < 1 or samples < 2 or new_tokens < 1:
            raise ValueError("steps, prompts and new tokens must be >= 1 and samples >= 2 (GRPO needs a group)")
    results = []
    with _folder(work_dir) as work:
        folder = build_model_folder(work / "model", model, vocab, device)
        for prompts, samples, new_tokens in cases:
            overrides = job_overrides(folder, device, steps + 1, prompts, samples, new_tokens) + _pairs(extra)
            rows, run_s = run_job(overrides, work / f"run-{prompts}x{samples}x{new_tokens}")
            results += build_results(model, vocab, device, prompts, samples, new_tokens, rows, run_s, overrides)
            if json_path:  # after each setting: a later one killed by a time limit leaves the earlier figures
                write_json(json_path, "gpu-rl", results)
            _empty_cache(device)
    print_results(results)
    return results


@contextlib.contextmanager
def _folder(work_dir: str | None) -> Iterator[Path]:
    """``work_dir`` (kept), or a temporary folder removed afterwards."""
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        yield Path(work_dir)
        return
    with tempfile.TemporaryDirectory(prefix="noria-gpu-rl-") as tmp:
        yield Path(tmp)


def digit_share(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Bench-only reward: the share of the response's characters that are digits (0 when empty)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


# ---------------------------------------------------------------------------------------- model


def build_model_folder(folder: Path, shape: str, vocab: int, device: str) -> Path:
    """Tokenizer (BPE + fillers up to ``vocab``) and a random-init Qwen3 model of ``shape`` in ``folder``."""
    from noria.bench.gpu_common import random_model, write_model_folder

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder, vocab)
    lm = random_model(model_config(shape, vocab, tok), device)
    write_model_folder(lm, folder)
    del lm
    _empty_cache(device)
    return folder


def model_config(shape: str, vocab: int, tokenizer) -> dict[str, Any]:
    """The HF ``config.json`` of a Qwen3 size with this vocabulary and the tokenizer's special ids."""
    from noria.bench.gpu_common import qwen3_config

    config = qwen3_config("qwen3-0.6b" if shape == "tiny" else shape)
    if shape == "tiny":
        config.update(TINY, max_position_embeddings=4096)
    config.update(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    return config


def build_tokenizer(folder: Path, vocab_size: int):
    """Byte-level BPE trained on a small corpus, vocabulary filled to ``vocab_size`` with " <hex>" pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    if vocab_size < len(vocab):
        raise ValueError(f"vocab {vocab_size} is smaller than the trained BPE's {len(vocab)} tokens")
    n = 0
    while len(vocab) < vocab_size:  # "Ġ" is the byte-level space: the piece decodes to " <hex n>"
        piece, n = f"\u0120{n:x}", n + 1
        vocab.setdefault(piece, len(vocab))
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)), bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def _corpus() -> list[str]:
    lines = [f"What is {a} + {b}? The answer is {a + b}. Compute {a} * {b} = {a * b}."
             for a in range(40) for b in range(0, 40, 3)]
    return lines + ["You are a helpful assistant.", "Use each number once to reach the target."] * 20


def _empty_cache(device: str) -> None:
    import gc

    import torch

    gc.collect()  # the finished job's engine and trainer
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- the job


def job_overrides(folder: Path, device: str, total_steps: int, prompts: int, samples: int, new_tokens: int) -> list[str]:
    """``--key value`` overrides of the example config (the module docstring says why each)."""
    kv_tokens = max(32768, -(-prompts * samples * (64 + new_tokens) // 1024) * 1024)
    return _pairs([
        f"model.path={folder}", f"model.device={device}", f"train.device={device}", f"train.max_steps={total_steps}",
        f"rollout.prompts_per_step={prompts}", f"rollout.n_samples={samples}", f"rollout.max_new_tokens={new_tokens}",
        f"reward.name={REWARD}", "eval.every=0", f"engine.kv_cache_tokens={kv_tokens}",
    ])  # fmt: skip


def _pairs(items) -> list[str]:
    """``KEY=VALUE`` strings -> ``["--KEY", "VALUE", ...]`` (the form ``load_config`` takes)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        out += [f"--{key}", value]
    return out


def run_job(overrides: list[str], run_dir: Path) -> tuple[list[dict[str, Any]], float]:
    """``noria train EXAMPLE OVERRIDES --run-dir RUN_DIR``, in this process; its metrics rows and wall seconds."""
    from noria.config import load_config
    from noria.launch.rl import run_rl

    config = load_config(EXAMPLE, overrides)
    start = time.perf_counter()
    run_rl(config, run_dir=str(run_dir), progress=False)
    run_s = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, run_s


# ---------------------------------------------------------------------------------------- figures


def stage_seconds(row: dict[str, Any]) -> dict[str, float | None]:
    """One metrics row split into STAGES (seconds, disjoint: they sum to the step's)."""
    rollout = row["time/trainer_wait_s"]
    train, sync = row.get("time/train_s", 0.0), row.get("sync/seconds", 0.0)
    return {"rollout": rollout, "train": train, "sync": sync, "other": row["seconds"] - rollout - train - sync}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the measured steps (all rows after the first) of step seconds, stages and tokens."""
    if len(rows) < 2:
        raise RuntimeError(f"the job logged {len(rows)} steps; the bench needs the warm-up and at least one more")
    measured = rows[1:]

    def avg(values):
        values = list(values)
        return sum(values) / len(values)

    stages = [stage_seconds(r) for r in measured]
    seconds = avg(r["seconds"] for r in measured)
    stage_s = {k: avg(s[k] for s in stages) for k in STAGES}
    return {
        "step_s": seconds, "steps_s": [r["seconds"] for r in rows], "warmup_step_s": rows[0]["seconds"],
        "stage_s": stage_s, "share": {k: v / seconds for k, v in stage_s.items()},
        "reward_s": avg(r.get("time/reward_s", 0.0) for r in measured),
        "generated_tokens": avg(r.get("rollout/tokens", 0.0) for r in measured),
        "trained_response_tokens": avg(r.get("rollout/trained_tokens", 0.0) for r in measured),
        "trainer_tokens": avg(r.get("tokens", 0.0) for r in measured),
        "reward_mean": avg(r["rollout/reward_mean"] for r in measured),
        "grad_norm": avg(r.get("grad_norm", 0.0) for r in measured),
        "logprob_abs_diff": avg(r.get("rollout_logprob_abs_diff", 0.0) for r in measured),
        "rollout_kl": avg(r.get("rollout_kl", 0.0) for r in measured),
        "groups_trained": avg(r["groups/trained"] for r in measured),
        "optimizer_steps": int(max(r.get("optimizer_step", 0.0) for r in rows)),
        "skipped_steps": sum(int(r.get("train/skipped_no_samples", 0)) + int(r.get("skipped", 0)) for r in rows),
        "retractions": int(max(r.get("engine/retractions", 0.0) for r in rows)),
        "steps": len(rows),
    }


def build_results(model: str, vocab: int, device: str, prompts: int, samples: int, new_tokens: int,
                  rows: list[dict[str, Any]], run_s: float, overrides: list[str]) -> list[dict]:
    """Benchmark rows (``noria.bench``): seconds per step (with stages), tokens per step, throughputs."""
    from noria.bench import machine_name

    f = summarize(rows)
    given = dict(zip(overrides[::2], overrides[1::2]))  # --key value pairs
    placement = given.get("--rollout.placement", "colocated")
    launch = " launch=ray" if given.get("--launch") == "ray" else ""
    case = (f"{model} vocab={vocab} random bf16 {device} grpo ppo_clip {placement}{launch} prompts={prompts} n={samples} "
            f"new={new_tokens} reward=digit_share")
    rollout_gen = f["stage_s"]["rollout"]
    figures = [
        ("step_s", f["step_s"]),
        ("generated_tokens_per_step", f["generated_tokens"]),
        ("trained_tokens_per_step", f["trainer_tokens"]),
        ("rollout_tokens_per_s", f["generated_tokens"] / rollout_gen if rollout_gen > 0 else None),
        ("trainer_tokens_per_s", f["trainer_tokens"] / f["stage_s"]["train"] if f["stage_s"]["train"] > 0 else None),
    ]
    results = [{"case": case, "metric": m, "noria": None if v is None else round(v, 4), "peers": {}, "bound": None}
               for m, v in figures]
    results[0].update({
        "stages_s": {k: _round(v) for k, v in f["stage_s"].items()},
        "shares": {k: _round(v) for k, v in f["share"].items()},
        "reward_scoring_s": _round(f["reward_s"]),
        "steps_s": [round(s, 4) for s in f["steps_s"]], "warmup_step_s": round(f["warmup_step_s"], 4),
        "measured_steps": f["steps"] - 1, "run_s": round(run_s, 2),
        "trained_response_tokens_per_step": f["trained_response_tokens"], "groups_trained": f["groups_trained"],
        "optimizer_steps": f["optimizer_steps"], "skipped_steps": f["skipped_steps"],
        "engine_retractions": f["retractions"], "reward_mean": round(f["reward_mean"], 4),
        "grad_norm_mean": round(f["grad_norm"], 6),
        "rollout_logprob_abs_diff": round(f["logprob_abs_diff"], 6), "rollout_kl": round(f["rollout_kl"], 6),
        "setting": f"{prompts}x{samples}x{new_tokens}", "overrides": overrides, "device": machine_name(),
    })  # fmt: skip
    return results


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def print_results(results: list[dict]) -> None:
    """One line per setting: step seconds, each stage's seconds and share, tokens per step and per second."""
    from noria.bench import print_table

    heads = [r for r in results if r["metric"] == "step_s"]
    by_case = {r["case"]: {x["metric"]: x["noria"] for x in results if x["case"] == r["case"]} for r in heads}
    lines = []
    for h in heads:
        stages = [f"{h['stages_s'][k]:.3f} s {h['shares'][k]:.0%}" for k in STAGES]
        fig = by_case[h["case"]]
        lines.append([h["setting"], h["noria"], *stages, h["reward_scoring_s"], fig["generated_tokens_per_step"], fig["trained_tokens_per_step"],
                      fig["rollout_tokens_per_s"], fig["trainer_tokens_per_s"], h["rollout_logprob_abs_diff"],
                      h["optimizer_steps"], h["run_s"]])
    print_table(f"{heads[0]['case'].split(' prompts=')[0]}: the main job's loop, mean of the steps after a warm-up "
                f"step ({heads[0]['device']}; reward scoring runs inside the rollout stage)",
                ["prompts x n x new", "step s", *STAGES, "reward s (in rollout)", "gen tok/step", "train tok/step", "gen tok/s", "train tok/s", "|dlogprob| rollout-trainer", "opt steps", "run s"],
                lines)
