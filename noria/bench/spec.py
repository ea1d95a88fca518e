"""``noria bench spec``: the built-in engine with speculative decoding against without, in one run.

Engines, one per side, all with the same model: ``no_spec`` (``engine.speculative.method: none``)
and one per drafter of ``--methods`` (``ngram``: prompt lookup; ``mlp``: the draft model trained
online, ``noria.engine.drafter``), each with the defaults (speculation only while at most
``engine.speculative.max_batch`` requests decode together, and there only at batch sizes where the
engine measured its speculating steps faster: ``policy: measured``). With ``--always``, also each
drafter with ``policy: always`` (every step within ``max_batch`` speculates), in every case.

The mlp drafter learns from the engine's own samples: before anything is measured its engine
generates ``--warmup-steps`` main-job rollout steps (below) and trains between them as in an RL run
(the engine trains while it has no request); it keeps training during the measurements.

Two kinds of case:

- **batch** (``--batches``, ``--workloads``): the same B prompts generated with ``ignore_eos`` for
  exactly ``--new-tokens`` tokens; tokens/s = B * new_tokens / wall seconds of the whole batch
  (prefill included), after a warm-up at that batch size. Workloads: ``copy``, agentic tool output
  (each prompt holds a made-up ``list_jobs`` tool's ``--lines`` JSON lines and asks for them back
  with one field changed; the answer has begun with its first line, so the rest copies the context);
  ``plain``, the arithmetic task's test prompts (little to copy).
- **rollout** (``--rollout-steps``; 0: none): the main job's rollout, step by step:
  ``--rollout-prompts`` arithmetic training prompts x ``--rollout-samples`` samples at
  ``--rollout-temperature``, up to ``--rollout-new-tokens`` tokens: a step lasts as long as its
  longest answer, and its last rows decode a few at a time (the long tail). Speculation changes the
  draws (not their distribution), and one rambling sample more or less changes a step's time by
  half, so the lengths are fixed: plain decoding first generates the step stopping at EOS (untimed),
  then every engine generates each request's length exactly (``ignore_eos``). Seconds per step
  (lower is better), the mean over the same steps for every engine.

Acceptance = accepted / proposed draft tokens and tokens per verify = tokens a verify chunk produced
(accepted drafts plus one), from the engine's counters over the measured work; the mlp rows also
carry the acceptance of each warm-up and measured rollout step (the drafter's learning curve).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

from noria.bench import print_table, write_json

WORKLOADS = ("copy", "plain")
METHODS = ("ngram", "mlp")
_NAMES = ("train", "eval", "export", "sync", "index", "backup", "render", "score")
_STATUS = ("ok", "ok", "ok", "failed", "running", "queued")


def add_arguments(parser) -> None:
    """``noria bench spec``'s arguments."""
    parser.description = ("Speculative decoding (n-gram and online-trained mlp drafters) against plain decoding in one run: "
                          "tokens/s per batch size and main-job rollout seconds per step, with acceptance rates.")
    parser.add_argument("--model", default="tiny-llama", help="catalog name or model folder (e.g. smollm2-135m-instruct)")
    parser.add_argument("--methods", default="ngram,mlp", help=f"comma-separated drafters: {', '.join(METHODS)}")
    parser.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes (empty: no batch cases)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--workloads", default="copy", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--lines", type=int, default=12, help="copy workload: JSON lines of tool output per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--num-tokens", type=int, default=4, help="engine.speculative.num_tokens (draft length k)")
    parser.add_argument("--always", action="store_true",
                        help="also each drafter with engine.speculative.policy: always (every step within max_batch speculates)")
    parser.add_argument("--rollout-steps", type=int, default=6, help="main-job rollout steps measured per engine (0: none)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="mlp: rollout steps its drafter trains on before measuring")
    parser.add_argument("--rollout-prompts", type=int, default=8, help="rollout: prompts per step (the main job's)")
    parser.add_argument("--rollout-samples", type=int, default=8, help="rollout: samples per prompt (the main job's)")
    parser.add_argument("--rollout-new-tokens", type=int, default=256, help="rollout: max_new_tokens (the main job has 32)")
    parser.add_argument("--rollout-temperature", type=float, default=0.7, help="rollout: temperature (the main job's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="model dtype (auto: see noria info)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (a verify step runs eagerly there; plain decode steps replay CUDA graphs)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    batches = [int(b) for b in args.batches.split(",") if b]
    workloads = [w for w in args.workloads.split(",") if w]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise SystemExit(f"--workloads: {','.join(unknown) or 'empty'} not supported; choose from {', '.join(WORKLOADS)}")
    if not methods or any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods: {args.methods!r}; choose from {', '.join(METHODS)}")
    rollout = Rollout(args.rollout_steps, args.warmup_steps, args.rollout_prompts, args.rollout_samples, args.rollout_new_tokens,
                      args.rollout_temperature)
    run(args.model, batches, args.new_tokens, workloads, args.temperature, args.num_tokens, args.dtype, args.json, args.lines,
        args.device, methods, args.always, rollout)
    return 0


class Rollout:
    """The main job's rollout steps (module docstring)."""

    def __init__(self, steps: int = 6, warmup: int = 8, prompts: int = 8, samples: int = 8, new_tokens: int = 256,
                 temperature: float = 0.7) -> None:
        self.steps, self.warmup, self.prompts, self.samples = steps, warmup, prompts, samples
        self.new_tokens, self.temperature = new_tokens, temperature

    def describe(self) -> str:
        return (f"main-job rollout {self.prompts} prompts x {self.samples} T={self.temperature} "
                f"max_new_tokens={self.new_tokens}")

    def requests(self, prompts: list[list[int]], step: int, lengths: list[int] | None = None) -> list:
        """The step's requests; with ``lengths``, each generates exactly its length (``ignore_eos``)."""
        from noria.engine.protocol import GenerateRequest, SamplingParams

        rows = prompts[step * self.prompts : (step + 1) * self.prompts]
        out = [GenerateRequest(input_ids=p, sampling=SamplingParams(
            max_new_tokens=self.new_tokens, temperature=self.temperature, seed=step * 10_000 + i * self.samples + j))
            for i, p in enumerate(rows) for j in range(self.samples)]
        for r, n in zip(out, lengths or []):
            r.sampling.max_new_tokens, r.sampling.ignore_eos = n, True
        return out


def run(model: str, batches: list[int], new_tokens: int, workloads: list[str], temperature: float, num_tokens: int,
        dtype: str = "auto", json_path: str | None = None, lines: int = 12, device: str = "cpu",
        methods: list[str] = ("ngram",), always: bool = False, rollout: Rollout | None = None) -> list[dict]:
    from noria.bench import machine_name
    from noria.config.engine import SpeculativeConfig
    from noria.hardware import cpu_info, resolve_dtype
    from noria.models.catalog import model_path

    rollout = rollout or Rollout(steps=0, warmup=0)
    dtype = resolve_dtype(dtype, device)
    print(f"{machine_name() if device.startswith('cuda') else cpu_info().summary()}: {dtype}", file=sys.stderr)
    folder = model_path(model)
    default_max_batch = SpeculativeConfig().max_batch
    sides = {"no_spec": SpeculativeConfig(method="none")}
    for m in methods:
        sides[m] = SpeculativeConfig(method=m, num_tokens=num_tokens)
        if always:
            sides[f"{m}_always"] = SpeculativeConfig(method=m, num_tokens=num_tokens, policy="always")
    prompts = {w: _prompts(folder, w, max(batches), new_tokens, lines) for w in workloads} if batches else {}
    train_prompts = _arithmetic(folder, "train", (rollout.warmup + rollout.steps) * rollout.prompts) if rollout.steps + rollout.warmup else []
    figures = _measure(folder, sides, prompts, batches, new_tokens, temperature, dtype, device, rollout, train_prompts,
                       default_max_batch)
    results = []
    for m in methods:
        for workload in prompts:
            for batch in batches:
                on, off = figures[m]["batch"][workload][batch], figures["no_spec"]["batch"][workload][batch]
                peers = {"no_spec": off["tokens_per_s"]}
                if f"{m}_always" in figures:
                    peers["always"] = figures[f"{m}_always"]["batch"][workload][batch]["tokens_per_s"]
                results.append({
                    "case": f"{model} {device} {dtype} {m} {workload} batch={batch} new={new_tokens} T={temperature} k={num_tokens}",
                    "metric": "tokens_per_s", "noria": on["tokens_per_s"], "peers": peers, "bound": None,
                    "method": m, "speculating": batch <= default_max_batch,
                    "acceptance": on["acceptance"], "tokens_per_verify": on["tokens_per_verify"],
                    "prompt_tokens": sum(len(p) for p in prompts[workload][:batch]) / batch,
                })
        if rollout.steps:
            on, off = figures[m]["rollout"], figures["no_spec"]["rollout"]
            results.append({
                "case": f"{model} {device} {dtype} {m} {rollout.describe()} k={num_tokens}",
                "metric": "rollout_s_per_step", "noria": on["s_per_step"], "peers": {
                    "no_spec": off["s_per_step"], **({"always": figures[f"{m}_always"]["rollout"]["s_per_step"]}
                                                     if f"{m}_always" in figures else {})},
                "bound": None, "lower_is_better": True, "method": m,
                "acceptance": on["acceptance"], "tokens_per_verify": on["tokens_per_verify"],
                "tokens_per_step": on["tokens_per_step"], "no_spec_tokens_per_step": off["tokens_per_step"],
                "steps_s": on["steps_s"], "no_spec_steps_s": off["steps_s"],
                "acceptance_by_step": on["acceptance_by_step"], "warmup_acceptance_by_step": on["warmup_acceptance_by_step"],
                "longest_by_step": on["longest_by_step"], "mean_length_by_step": on["mean_length_by_step"],
            })
    _print(results)
    if json_path:
        write_json(json_path, "spec", results, default_max_batch=default_max_batch)
    return results


def _measure(folder: Path, sides: dict, prompts: dict[str, list[list[int]]], batches: list[int], new_tokens: int,
             temperature: float, dtype: str, device: str, rollout: Rollout, train_prompts: list[list[int]],
             default_max_batch: int) -> dict[str, dict]:
    """Every side's figures, its engines all alive and measured in turn, case by case (the order
    rotating from one case to the next), so a machine's drift over minutes reaches every side alike.
    An mlp engine trains its drafter right after its own turn (``trained``), never during another's."""
    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.engine.protocol import GenerateRequest, SamplingParams

    rows = max([*batches, rollout.prompts * rollout.samples if rollout.steps + rollout.warmup else 1])
    longest = max([len(p) for ps in prompts.values() for p in ps] + [len(p) for p in train_prompts] + [1])
    longest += max(new_tokens, rollout.new_tokens if rollout.steps + rollout.warmup else 0)
    engines = {name: Engine.from_path(folder, EngineConfig(max_running_requests=rows, kv_cache_tokens=rows * (longest + 16) + 1024,
                                                           speculative=spec), dtype=dtype, device=device)
               for name, spec in sides.items()}

    def requests(rows, n):
        return [GenerateRequest(input_ids=p, sampling=SamplingParams(
            max_new_tokens=n, temperature=temperature, ignore_eos=True, seed=i)) for i, p in enumerate(rows)]

    def turn(name: str, reqs: list) -> tuple[float, int, dict]:
        """One engine's run of ``reqs``: (seconds, tokens, speculation rates), then its drafter's training."""
        engine = engines[name]
        before = engine.metrics()
        start = time.perf_counter()
        results = engine.generate_batch(reqs)
        seconds = time.perf_counter() - start
        rates = _spec_rates(before, engine.metrics())
        while engine.speculator is not None and engine.speculator.drafter is not None and engine.speculator.drafter.train_due():
            time.sleep(0.02)  # as between two RL steps: the engine trains its drafter while idle
        return seconds, sum(len(r.output_ids) for r in results), rates

    def rotated(names: list[str], i: int) -> list[str]:
        return names[i % len(names):] + names[: i % len(names)]

    try:
        out = {name: {"batch": {w: {} for w in prompts}, "rollout": None, "warmup": []} for name in sides}
        if rollout.steps + rollout.warmup:
            for engine in engines.values():  # kernels built and caches touched at the rollout's batch size
                engine.generate_batch([dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=8))
                                       for r in rollout.requests(train_prompts, 0)])
        for step in range(rollout.warmup):  # the mlp drafters learn from the main job's rollout first
            for name in [n for n in sides if sides[n].method == "mlp"]:
                out[name]["warmup"].append(turn(name, rollout.requests(train_prompts, step))[2]["acceptance"])
        plain = list(sides)
        if rollout.steps:
            steps = {n: [] for n in plain}
            lengths = []
            for step in range(rollout.warmup, rollout.warmup + rollout.steps):
                # The step's answer lengths, from plain decoding stopping at EOS (untimed); then every
                # engine generates exactly those: the same tail for each, whatever its draws.
                probe = engines["no_spec"].generate_batch(rollout.requests(train_prompts, step))
                engines["no_spec"].flush_cache()  # its timed turn prefills the step's prompts as every other engine does
                lengths.append([max(1, len(o.output_ids)) for o in probe])
                for name in rotated(plain, step):
                    steps[name].append(turn(name, rollout.requests(train_prompts, step, lengths[-1])))
            for name, runs in steps.items():
                out[name]["rollout"] = {
                    "s_per_step": round(sum(r[0] for r in runs) / len(runs), 3), "steps_s": [round(r[0], 3) for r in runs],
                    "tokens_per_step": round(sum(r[1] for r in runs) / len(runs), 1),
                    "acceptance_by_step": [r[2]["acceptance"] for r in runs], "warmup_acceptance_by_step": out[name]["warmup"],
                    **_mean_rates([r[2] for r in runs]),
                    "longest_by_step": [max(n) for n in lengths], "mean_length_by_step": [round(sum(n) / len(n), 1) for n in lengths],
                }
        for workload, rows_ in prompts.items():
            for name in engines:
                engines[name].generate_batch(requests(rows_[:2], 8))  # warm-up: kernels built, caches touched
            for i, batch in enumerate(batches):
                names = rotated(list(sides), i)
                for name in names:
                    engines[name].generate_batch(requests(rows_[:batch], 8))  # this batch size's first use
                    engines[name].flush_cache()
                for name in names:
                    seconds, tokens, rates = turn(name, requests(rows_[:batch], new_tokens))
                    out[name]["batch"][workload][batch] = {"tokens_per_s": round(tokens / seconds, 1), **rates}
        return out
    finally:
        for engine in engines.values():
            engine.shutdown(drain_timeout_s=1.0)


def _mean_rates(rates: list[dict]) -> dict[str, float | None]:
    """The steps' acceptance and tokens per verify, averaged over the steps that verified drafts."""
    out = {}
    for key in ("acceptance", "tokens_per_verify"):
        values = [r[key] for r in rates if r[key] is not None]
        out[key] = round(sum(values) / len(values), 3) if values else None
    return out


def _spec_rates(before: dict, after: dict) -> dict[str, float | None]:
    """Acceptance and tokens per verify chunk between two reads of ``Engine.metrics`` (None without verify chunks)."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                             "spec_verify_rows", "spec_verify_tokens")}
    if not delta["spec_verify_rows"]:
        return {"acceptance": None, "tokens_per_verify": None}
    return {"acceptance": round(delta["spec_accepted_tokens"] / delta["spec_proposed_tokens"], 3),
            "tokens_per_verify": round(delta["spec_verify_tokens"] / delta["spec_verify_rows"], 2)}


def _prompts(folder: Path, workload: str, n: int, new_tokens: int, lines: int = 12) -> list[list[int]]:
    from noria.data import render_prompts
    from noria.models import load_tokenizer
    from noria.types import Prompt

    if workload == "plain":
        return _arithmetic(folder, "test", n)
    tokenizer = load_tokenizer(folder)
    budget = json.loads((folder / "config.json").read_text()).get("max_position_embeddings", 2048) - new_tokens
    for lines in [lines, *(n for n in (12, 8, 6, 4, 3, 2) if n < lines)]:  # as many as the context leaves room for
        tasks = [_tool_task(i, lines) for i in range(n)]
        rendered = render_prompts([Prompt(prompt=text) for text, _ in tasks], tokenizer)
        # The answer has begun (its first line, as an agent's edit does): the rest copies the tool output.
        prompts = [r.ids + tokenizer(start, add_special_tokens=False)["input_ids"] for r, (_, start) in zip(rendered, tasks)]
        if max(len(p) for p in prompts) < budget:
            return prompts
    raise SystemExit(f"--new-tokens {new_tokens}: no room left for a copy prompt in this model's context")


def _arithmetic(folder: Path, split: str, n: int) -> list[list[int]]:
    """n prompts of the main job's task (arithmetic, its chat template), from ``split``."""
    from noria.data import generate_split, render_prompts
    from noria.models import load_tokenizer

    records = generate_split("arithmetic", split, {f"n_{split}": max(n, 8), "seed": 0, "ops": ["+"]})
    return [r.ids for r in render_prompts(records[:n], load_tokenizer(folder))]


def _tool_task(seed: int, lines: int = 24) -> tuple[str, str]:
    """A made-up tool call's output and a request to hand it back edited: an agent turn that copies;
    (the user's message, the answer's first line)."""
    rng = random.Random(seed)
    rows = [
        f'{{"id": {rng.randint(1000, 9999)}, "job": "{rng.choice(_NAMES)}_{rng.randint(1, 99)}", '
        f'"status": "{rng.choice(_STATUS)}", "bytes": {rng.randint(1, 10**6)}}}'
        for _ in range(lines)
    ]
    message = ("The tool `list_jobs` returned:\n```\n" + "\n".join(rows) + "\n```\nReturn the same JSON lines, in the "
               'same order, with every "failed" status replaced by "retry". Output only the lines.')
    return message, "```\n" + rows[0].replace('"failed"', '"retry"') + "\n"


def _print(results: list[dict]) -> None:
    header = ["case", "noria", "no_spec", "noria vs no_spec", "always vs no_spec", "acceptance", "tok/verify"]
    rows = []
    for r in results:
        off = r["peers"]["no_spec"]
        always = r["peers"].get("always")
        ratio = off / r["noria"] if r.get("lower_is_better") else r["noria"] / off
        always = None if always is None else off / always if r.get("lower_is_better") else always / off
        rows.append([r["case"], r["noria"], off, ratio, always, r["acceptance"],
                     r["tokens_per_verify"]])
    print_table("speculative decoding: tokens/s (higher is better) or rollout s/step (lower is better; the ratio is "
                "no_spec / noria: > 1 is faster)", header, rows)
