"""The systems of ``noria bench learn``: their configs, how each one is run, and its curve.

What this module owns: for each system, the run config (all of them from one set of settings: the
model, the task, the reward, the group, prompts per step, max new tokens, temperature, lr and the
evaluation), the process that trains it, and the curve read back from it: one point per evaluation,
``{step, train_seconds, trained_tokens, accuracy, eval_seconds}``.

    shipped  noria train on the main job's recipe (examples/grpo_smollm2_arithmetic.yaml) as it is
    sync     noria train on plain GRPO (``noria bench rl``'s config), colocated, synchronous
    async    sync's config, the engine as its own process (disaggregated), rollout.max_staleness k
             and TIS against the older behaviour policy
    vllm     sync's config with a vLLM server as the rollout engine (``noria bench rl``'s vllm peer)
    curriculum  shipped with difficulty pools (``data.curriculum``)
    dynamic  shipped with dynamic sampling (``rollout.buffer.filters: [zero_reward_variance]``): a group
             whose rewards are all equal is generated, then dropped untrained
    overlong shipped with DAPO's soft overlong punishment (``reward.overlong_buffer_tokens``: the last
             quarter of ``rollout.max_new_tokens``, ``reward.overlong_penalty`` 1)
    int8     shipped with int8 rollout (``engine.quantization: int8``) and TIS against its logprobs
             (``train.loss.off_policy: tis``), the pairing docs/engines.md gives for a quantized engine
    int4_qat shipped with int4 rollout and int4 QAT (``train.qat: int4``): the trained policy is the
             one that rolls out
    trl      TRL's GRPOTrainer (``noria bench rl``'s peer and argument mapping) with an evaluation
             callback

The training clock: the sum of the step seconds. Noria's steps are its metrics.jsonl ``seconds``
(from taking the batch to the end of the weight sync); an evaluation runs between steps, so it is
outside them. TRL's steps are timed from ``on_step_begin`` to ``on_step_end`` by the same callback
that evaluates, after the step's time is taken. Model load, engine start and the final export are
outside the clock for every system.

The scorer: greedy generation on Noria's built-in engine with the recipe's eval section, scored by
the run's reward, on the same held-out prompts. Noria systems evaluate in the loop (``eval.every``,
``eval.mode: shared``, on the rollout engine with the step's weights); TRL's callback saves the
model and runs ``noria eval``'s body (``run_eval``) on the folder. Both load the weights in the
recipe's dtype; the step-0 points (the untrained model through each path) show that they agree.

When a run stops: after ``steps`` steps, or (``max_seconds``) at the first scheduled evaluation at or
after the training clock passes it, for every system alike: TRL's callback stops the trainer; a
Noria run is stopped (SIGTERM to its process group) once that evaluation's row is written.

Not equal: in asynchronous runs, groups already generating when an evaluation starts finish beside
it (the rollout starts no new group meanwhile), so a little generation happens off the clock.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from noria.metrics import read_jsonl

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo_smollm2_arithmetic.yaml"
"""The main job's recipe: the shipped system, and the settings every system shares."""
NORIA_SYSTEMS = ("shipped", "sync", "async", "vllm", "curriculum", "dynamic", "overlong", "int8", "int4_qat")
RECIPE_VARIANTS = ("shipped", "curriculum", "dynamic", "overlong", "int8", "int4_qat")
"""The systems that run the recipe itself, with one setting changed (none for ``shipped``)."""
CURVE_FILE = "curve.jsonl"
"""The TRL worker's evaluations, one JSON line each as it makes them."""


def recipe_settings(recipe: Path) -> dict[str, Any]:
    """The settings every system shares, as the recipe sets them."""
    data = yaml.safe_load(recipe.read_text())
    rollout, optim = data["rollout"], data["train"].get("optim", {})
    return {
        "prompts_per_step": rollout["prompts_per_step"], "n_samples": rollout["n_samples"],
        "max_new_tokens": rollout["max_new_tokens"], "temperature": rollout.get("temperature", 1.0),
        "lr": optim["lr"], "reward": data["reward"]["name"], "task_args": data["data"]["task_args"],
        "eval": {k: v for k, v in data["eval"].items() if k not in ("every", "mode")},
    }  # fmt: skip


def system_config(system: str, recipe: Path, folder: Path, s: dict[str, Any], staleness: int = 2) -> dict[str, Any]:
    """The run config of a Noria system (``trl`` reads ``sync``'s) with the shared settings ``s``
    (``recipe_settings`` with the bench's ``steps``, ``eval_every`` and ``eval_limit`` added)."""
    if system in RECIPE_VARIANTS:
        config = yaml.safe_load(recipe.read_text())
        config["model"]["path"] = str(folder)
        config["reward"]["name"] = s["reward"]
        config["data"]["task_args"] = s["task_args"]
        config["rollout"].update({k: s[k] for k in ("prompts_per_step", "n_samples", "max_new_tokens", "temperature")})
        config["train"].setdefault("optim", {})["lr"] = s["lr"]
        if system == "curriculum":
            config["data"]["curriculum"] = {"enabled": True}
        elif system == "dynamic":
            config["rollout"].setdefault("buffer", {})["filters"] = ["zero_reward_variance"]
        elif system == "overlong":
            config["reward"].update({"overlong_buffer_tokens": max(1, s["max_new_tokens"] // 4), "overlong_penalty": 1.0})
        elif system == "int8":
            config.setdefault("engine", {})["quantization"] = "int8"
            config["train"].setdefault("loss", {})["off_policy"] = "tis"
        elif system == "int4_qat":
            config.setdefault("engine", {})["quantization"] = "int4"
            config["train"]["qat"] = "int4"
    else:
        from noria.bench.rl import ENGINE_PEERS

        config = plain_config(folder, s)
        if system == "async":
            config["rollout"].update({"placement": "disaggregated", "max_staleness": staleness})
            config["train"]["loss"]["off_policy"] = "tis"
        elif system == "vllm":
            for section, values in ENGINE_PEERS["vllm"].items():
                config.setdefault(section, {}).update(values)
    if s.get("n_train"):  # a small training set, passed over as often as the steps need
        config["data"]["task_args"] = {**config["data"]["task_args"], "n_train": s["n_train"]}
        config["data"]["epochs"] = -(-s["steps"] * s["prompts_per_step"] // s["n_train"]) + 1
    config["name"] = f"bench-learn-{system}"
    config["train"]["max_steps"] = s["steps"]
    config["eval"] = {**s["eval"], "every": s["eval_every"], "limit": s["eval_limit"], "mode": "shared"}
    return config


def plain_config(folder: Path, s: dict[str, Any]) -> dict[str, Any]:
    """Plain GRPO: ``noria bench rl``'s config (the one its TRL peer mirrors) with the settings ``s``."""
    import tempfile

    from noria.bench.rl import write_config

    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(Path(tmp) / "config.yaml", folder, s, s["reward"], s["eval_limit"], s["task_args"])
        return yaml.safe_load(path.read_text())


def write(config: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------ curves


def noria_curve(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per scored evaluation of a Noria run: the training clock and trained tokens after its
    step (the sums over ``steps``' ``seconds`` and ``rollout/trained_tokens`` up to it)."""
    clock, tokens = [0.0], [0.0]
    for row in steps:
        clock.append(clock[-1] + row["seconds"])
        tokens.append(tokens[-1] + row["rollout/trained_tokens"])
    return [{"step": e["step"], "train_seconds": round(clock[e["step"]], 3), "trained_tokens": int(tokens[e["step"]]),
             "accuracy": e["accuracy"], "eval_seconds": round(e["seconds"], 3)}
            for e in evals if "accuracy" in e and e["step"] < len(clock)]  # fmt: skip


def stop_due(steps: list[dict[str, Any]], evals: list[dict[str, Any]], max_seconds: float | None) -> bool:
    """Whether a run may stop: a scored evaluation has been written at or after the step whose training
    clock first reached ``max_seconds``."""
    if max_seconds is None:
        return False
    clock = 0.0
    for row in steps:
        clock += row["seconds"]
        if clock >= max_seconds:
            return any(e["step"] >= row["step"] and "accuracy" in e for e in evals)
    return False


def run_noria(config: Path, run_dir: Path, max_seconds: float | None, label: str) -> dict[str, Any]:
    """``noria train CONFIG`` in its own process group, watched; its curve once it ends or may stop."""
    from noria.process import Child

    cmd = [sys.executable, "-m", "noria.cli", "train", str(config), "--run-dir", str(run_dir), "--no-progress"]
    start = time.perf_counter()
    child = Child.start(cmd, name=f"noria train ({label})", log_path=run_dir.parent / f"{run_dir.name}.log", group=True)
    shown = 0
    try:
        while True:
            code = child.poll()
            steps, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
            curve = noria_curve(steps, evals)
            shown = show(label, curve, shown)
            if code is not None:
                if code != 0:
                    raise RuntimeError(f"noria train ({label}) failed ({child.exit_note()}):\n{child.tail(4000)}")
                break
            if stop_due(steps, evals, max_seconds):
                break
            time.sleep(0.5)
    finally:
        child.stop(timeout_s=20)
    return {**partial("noria", run_dir), "run_seconds": round(time.perf_counter() - start, 3)}


MISMATCH = ("rollout_kl", "rollout_logprob_abs_diff")
"""Per-step rollout/trainer mismatch figures a Noria system's result keeps (``noria.train.objective``)."""


def mismatch(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's mismatch between the rollout engine's logprobs and the trainer's: KL (k3) and mean |Δ|."""
    return [{"step": r["step"], **{k: r[k] for k in MISMATCH if k in r}} for r in steps]


def show(label: str, curve: list[dict[str, Any]], shown: int) -> int:
    """Print the points of ``curve`` not yet printed; how many are printed now."""
    for p in curve[shown:]:
        print(f"  {label:<8} step {p['step']:>4}  {p['train_seconds'] / 60:6.2f} min  {p['trained_tokens']:>9,} tokens  "
              f"accuracy {100 * p['accuracy']:5.1f}%", flush=True)
    return len(curve)


# ------------------------------------------------------------------------------------ TRL


def partial(system: str, folder: Path) -> dict[str, Any]:
    """What the run of ``system`` in ``folder`` measured: all of it once it ended, its evaluations so far
    when it was interrupted."""
    if system == "trl":
        curve = read_jsonl(folder / CURVE_FILE)
        last = curve[-1] if curve else {"step": 0, "train_seconds": 0.0}
        return {"curve": curve, "steps": last["step"], "train_seconds": last["train_seconds"], "skipped_evals": 0}
    steps, evals = read_jsonl(folder / "metrics.jsonl"), read_jsonl(folder / "eval.jsonl")
    return {"curve": noria_curve(steps, evals), "steps": len(steps), "train_seconds": round(sum(r["seconds"] for r in steps), 3),
            "skipped_evals": sum("skipped" in e for e in evals), "mismatch": mismatch(steps)}


def run_trl(config: Path, out: Path, s: dict[str, Any], max_seconds: float | None) -> dict[str, Any]:
    """The TRL worker (``python -m noria.bench.learn_systems``) on ``config``; its curve."""
    from noria.process import run as run_command

    job = {"config": str(config), "out": str(out), "max_seconds": max_seconds, "eval_every": s["eval_every"],
           **{k: s[k] for k in ("steps", "prompts_per_step", "n_samples", "max_new_tokens", "lr", "temperature")}}
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    proc = run_command([sys.executable, "-m", "noria.bench.learn_systems"], check=False, input=json.dumps(job), capture=True)
    (out / "worker.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bench learn trl failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"bench learn trl printed no result:\n{proc.stderr[-2000:]}")
    result = json.loads(lines[-1])
    show("trl", result["curve"], 0)
    return {**result, "run_seconds": round(time.perf_counter() - start, 3)}


class TrlClock:
    """The TRL side's training clock and evaluations: a ``TrainerCallback`` that times each step, then
    (every ``eval_every`` steps, before the first and at the last) saves the model and scores it with
    ``run_eval``, off the clock; it stops training at the first evaluation past ``max_seconds``."""

    def __init__(self, base: type, config: Any, job: dict[str, Any]):
        self.config, self.job, self.out = config, job, Path(job["out"])
        self.train_seconds, self.tokens, self.steps = 0.0, 0, 0
        self.curve: list[dict[str, Any]] = []
        clock = self

        class Callback(base):
            def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
                clock.evaluate(0, model, processing_class)

            def on_step_begin(self, args, state, control, **kwargs):
                clock.start = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
                clock.train_seconds += time.perf_counter() - clock.start
                clock.steps = state.global_step
                late = clock.job["max_seconds"] is not None and clock.train_seconds >= clock.job["max_seconds"]
                if state.global_step % clock.job["eval_every"] == 0 or state.global_step >= state.max_steps:
                    clock.evaluate(state.global_step, model, processing_class)
                    control.should_training_stop = control.should_training_stop or late

        self.callback = Callback()

    def count(self, completion_ids: list[list[int]]) -> None:
        """Trained tokens: the response tokens of every completion (called by the reward wrapper)."""
        self.tokens += sum(len(ids) for ids in completion_ids)

    def evaluate(self, step: int, model: Any, tokenizer: Any) -> None:
        import shutil

        from noria.config import load_config
        from noria.eval import run_eval

        folder = self.out / f"step-{step}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        config = load_config(self.job["config"], ["--model.path", str(folder)])
        result = run_eval(config, run_dir=str(self.out / f"eval-step-{step}"), progress=False)
        shutil.rmtree(folder)
        self.curve.append({"step": step, "train_seconds": round(self.train_seconds, 3), "trained_tokens": self.tokens,
                           "accuracy": result.accuracy, "eval_seconds": round(result.seconds, 3)})
        with open(self.out / CURVE_FILE, "a") as f:  # what an interrupted run leaves (``partial``)
            f.write(json.dumps(self.curve[-1]) + "\n")
        print(f"trl eval step {step}: {result.accuracy}", file=sys.stderr, flush=True)


def trl_worker(job: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer as ``noria bench rl`` sets it up, with ``TrlClock``; its curve and step count."""
    from transformers import TrainerCallback

    from noria.bench.rl import trl_reward, trl_trainer
    from noria.config import load_config

    config = load_config(job["config"])
    clock = TrlClock(TrainerCallback, config, job)
    scored = trl_reward(config)

    def reward(completions, label, metadata, completion_ids=(), **kwargs):
        clock.count(completion_ids)
        return scored(completions, label, metadata, **kwargs)

    reward.__name__ = scored.__name__
    trainer = trl_trainer(config, job, [clock.callback], reward)
    trainer.train()
    return {"curve": clock.curve, "steps": clock.steps, "train_seconds": round(clock.train_seconds, 3), "skipped_evals": 0,
            "precision": f"fp32 weights, mixed_precision={trainer.accelerator.mixed_precision}"}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(trl_worker(json.loads(sys.stdin.read()))), flush=True)
