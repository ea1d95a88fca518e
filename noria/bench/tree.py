"""``noria bench tree``: what prefix-tree training saves on real rollouts, sharing off vs on.

The case: one step's trajectories of a finished run (``RUN_DIR/rollouts/step-N.jsonl``, what
``noria train`` writes every step), packed as that run's trainer packs them: the prompt's ids are
the recorded prompt text tokenized again with the run's tokenizer (checked against the recorded
count), the response's ids, loss mask, rollout logprobs, weight versions and advantage as recorded;
samples without an advantage (failed ones) are left out, as the trainer leaves them out. Per run:

- ``tokens``: tokens through the model: ``unshared`` (every sequence whole), ``prompts`` (the same
  trie with untrained tokens only: prompts, within and across groups, and untrained turns after
  them) and ``noria`` (the prefix tree, trained tokens too), trees capped at the run's
  ``train.micro_batch_tokens``; ``skip``: the tree of the samples the trainer puts through the
  model (``train.skip_zero_advantage``: samples whose advantage is 0 everywhere are left out, the
  gradient unchanged; ``noria.train.rl_step.pack_step``).
- ``tflop``: the step's training FLOPs, estimated as 6 x parameters x tokens plus the attention's
  12 x layers x query heads x head width per attended (query, key) pair (each token attends its
  ancestors and itself: ``sum(depth + 1)`` over the tokens through the model).
- ``tokens_per_s``: ``train_step`` of the run's trainer config (``train``: dtype, checkpointing,
  chunks, optimizer) on this batch, the three packings in turn on one backend, after one warm-up
  step: the batch's unshared token count over the median step time (the same work every
  way, so ratios are speed-ups). Old logprobs are the current ones (one optimizer step per
  rollout: the main job's setting).

``--add`` keeps the cases already in ``--json`` (other names), so each case may run as its own
command (each case's command is recorded with it).

Not measured: generation, and the logprob passes before the step (they share the same way).
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from noria.bench import print_table, write_json
from noria.errors import NoriaError


def add_arguments(parser) -> None:
    """``noria bench tree``'s arguments."""
    parser.description = ("One recorded step of each run: tokens through the model, estimated FLOPs and trainer tokens/s "
                          "with prefix-tree sharing off and on (and with untrained tokens shared only).")
    parser.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR[@STEP]",
                        help="a case: a run folder with config.yaml and rollouts/, and which step's rollouts (default 1; repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="timed train steps per side")
    parser.add_argument("--json", default=None, help="write the results to this path")
    parser.add_argument("--add", action="store_true",
                        help="keep the cases of other names already in --json (one case per run of this command)")


def main(args) -> int:
    results, cases = [], {}
    for spec in args.run:
        name, _, folder = spec.partition("=")
        folder, _, step = folder.partition("@")
        if not folder or not (step or "1").isdigit():
            raise NoriaError(f"--run takes NAME=RUN_DIR or NAME=RUN_DIR@STEP, got {spec!r}")
        cases[name] = measure(Path(folder), int(step or 1), args.repeats)
        cases[name]["command"] = "noria " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        results += case_results(name, cases[name])
    report(results)
    if args.json:
        if args.add and Path(args.json).is_file():
            kept = {k: v for k, v in json.loads(Path(args.json).read_text())["cases"].items() if k not in cases}
            cases = {**kept, **cases}
            results = [r for name in cases for r in case_results(name, cases[name])]
        write_json(args.json, "tree", results, cases=cases)
    return 0


def load_step(folder: Path, step: int) -> tuple[Any, list, list[float]]:
    """(the run's config, the step's trainable samples, their advantages)."""
    from noria.config import load_config
    from noria.models import load_tokenizer
    from noria.types import Sample

    config = load_config(folder / "config.yaml")
    tokenizer = load_tokenizer(config.model.path)
    path = folder / "rollouts" / f"step-{step:06d}.jsonl"
    if not path.is_file():
        raise NoriaError(f"{path}: no such rollouts file (a run of noria train writes one per step)")
    samples, advantages = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("advantage") is None:
            continue
        prompt = tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
        if len(prompt) != row["prompt_tokens"]:
            raise NoriaError(f"{path}: the prompt text gives {len(prompt)} tokens, {row['prompt_tokens']} were recorded")
        samples.append(Sample(
            prompt_ids=prompt, response_ids=row["token_ids"], loss_mask=row["loss_mask"],
            rollout_logprobs=row["logprobs"], weight_versions=row["weight_versions"], index=row["index"],
        ))
        advantages.append(float(row["advantage"]))
    if not samples:
        raise NoriaError(f"{path}: no trainable sample")
    return config, samples, advantages


def measure(folder: Path, step: int, repeats: int) -> dict[str, Any]:
    """Tokens, FLOPs and timed train steps of one run's recorded step."""
    from noria.models.catalog import model_path
    from noria.train import build_backend
    from noria.train.packing import pack_samples
    from noria.train.prefix_tree import share_prefixes
    from noria.train.rl_step import pack_step

    config, samples, advantages = load_step(folder, step)
    batch = pack_samples(samples, advantages)
    cap = config.train.micro_batch_tokens
    prompts, _, _ = share_prefixes(batch, max_tokens=cap)
    tree, _, _ = share_prefixes(batch, max_tokens=cap, trained=True)
    config.train.skip_zero_advantage = True
    live = pack_step(samples, advantages, config.train)  # the whole step's normalisers, fewer samples
    live_tree, _, _ = share_prefixes(live, max_tokens=cap, trained=True)
    backend = build_backend(config.train, model_impl=config.model.impl, seed=config.seed)
    backend.init(model_path(config.model.path), total_steps=3 * repeats + 1)
    args = backend.lm.args
    params = sum(p.numel() for p in backend.lm.parameters())
    per_pair = 12 * args.num_layers * args.num_heads * args.head_dim
    out: dict[str, Any] = {
        "run": str(folder), "step": step, "samples": len(samples), "sequences_trained_tokens": int(batch.loss_mask.sum()),
        "tree_cap_tokens": cap, "params": params, "trees": tree.n_sequences, "samples_through_model": live.n_sequences,
    }
    for side, b in (("unshared", batch), ("prompts", prompts), ("noria", tree), ("skip", live_tree)):
        out[side] = {"tokens": b.n_tokens, "tflop": (6 * params * b.n_tokens + per_pair * attended_pairs(b)) / 1e12}
    backend.train_step(batch)  # warm-up: the optimizer state, the first kernels
    times: dict[str, list[float]] = {"unshared": [], "prompts": [], "noria": [], "skip": []}
    for _ in range(repeats):
        # the prompts side trains the batch shared beforehand: a tree of untrained tokens, which the
        # trainer keeps as it is and computes losses on directly
        sides = (("unshared", False, batch), ("prompts", True, prompts), ("noria", True, batch), ("skip", True, live))
        for side, share, b in sides:
            backend.cfg.share_prefix = share
            t0 = time.perf_counter()
            backend.train_step(b)
            times[side].append(time.perf_counter() - t0)
            print(f"{folder.name} step {step}: {side} {times[side][-1]:.1f} s", file=sys.stderr, flush=True)
    for side, seconds in times.items():
        out[side].update(step_s=statistics.median(seconds), steps_s=seconds, tokens_per_s=batch.n_tokens / statistics.median(seconds))
    return out


def attended_pairs(batch) -> int:
    """(query, key) pairs the batch's tokens attend: each its ancestors and itself."""
    from noria.models.attention import TreeLayout
    from noria.train.prefix_tree import packed_trees

    lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    trees = packed_trees(batch.cu_seqlens, batch.parents) or [None] * len(lens)
    return sum(n * (n + 1) // 2 if t is None else sum(TreeLayout(t).depths) + n for n, t in zip(lens, trees))


SIDES = ("unshared", "prompts", "skip")
"""The packings measured beside the tree (``noria``); ``skip`` is absent from cases recorded before it."""


def case_results(name: str, case: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's rows: tokens and TFLOP (lower is better), tokens/s (higher is better)."""
    rows = []
    for metric, digits in (("tokens", 0), ("tflop", 3)):
        rows.append({"case": name, "metric": metric, "noria": round(case["noria"][metric], digits),
                     "peers": {s: round(case[s][metric], digits) for s in SIDES if s in case}, "bound": None})
    rows.append({"case": name, "metric": "tokens_per_s", "noria": round(case["noria"]["tokens_per_s"], 1),
                 "peers": {s: round(case[s]["tokens_per_s"], 1) for s in SIDES if s in case}, "bound": None})
    return rows


def report(results: list[dict[str, Any]]) -> None:
    header = ["case", "metric", "noria (tree)", "prompts only", "unshared", "unshared/noria", "prompts/noria",
              "tree, zero-advantage samples left out", "noria/skip"]
    rows = []
    for r in results:
        peers = [r["peers"]["unshared"], r["peers"]["prompts"]]
        skip = r["peers"].get("skip")
        if r["metric"] == "tokens_per_s":  # the speed-ups
            ratios = [r["noria"] / p if p else None for p in peers]
            gain = skip / r["noria"] if skip and r["noria"] else None
        else:
            ratios = [p / r["noria"] if r["noria"] else None for p in peers]
            gain = r["noria"] / skip if skip else None
        rows.append([r["case"], r["metric"], r["noria"], peers[1], peers[0], *ratios, skip, gain])
    print_table("prefix-tree training on one recorded step: tokens and TFLOP through the trainer (lower is better), "
                "trainer tokens/s (higher is better)", header, rows)
    print("x/noria: how many times the tree's work the other packing's is (tokens/s rows: the tree's speed-up over it); "
          "noria/skip: the same for leaving out the samples whose gradient is zero (train.skip_zero_advantage).")
