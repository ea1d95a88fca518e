"""``noria bench spec``: the built-in engine with speculative decoding (n-gram drafter) against without.

For each batch size B, the same B prompts are generated with ``ignore_eos`` for exactly
``--new-tokens`` tokens (a long tail: every request runs to the end) by three engines of one run:

- ``no_spec``: ``engine.speculative.method: none``;
- ``noria``: ``method: ngram`` with the default policy (speculation only while at most
  ``engine.speculative.max_batch`` requests decode together);
- ``spec_always``: ``method: ngram`` with ``max_batch`` above every batch, so every step speculates:
  the figure the default ``max_batch`` was chosen from (run only at batches above the default
  ``max_batch``; below it, it is the ``noria`` engine).

Workloads (``--workloads``):

- ``copy``: agentic tool output. Each prompt (chat template) holds the output of a made-up
  ``list_jobs`` tool, ``--lines`` JSON lines (fewer where the model's context is short), and asks
  for the lines back with one field changed; the answer has begun with its first line (as an
  agent's file edit does), so the rest copies most of the context: where prompt lookup drafts well;
- ``plain``: the arithmetic task's test prompts (``noria bench engine``'s): little to copy.

tokens/s = B * new_tokens / wall seconds of the whole batch (prefill included), after a warm-up of
each engine at that batch size; acceptance = accepted / proposed draft tokens, and tokens per
verify = tokens a verify chunk produced (accepted drafts plus one), from the engine's counters over
the measured batch. Sampling is RL's (``--temperature``, default 1.0, seeded per request).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from noria.bench import print_table, write_json

WORKLOADS = ("copy", "plain")
_NAMES = ("train", "eval", "export", "sync", "index", "backup", "render", "score")
_STATUS = ("ok", "ok", "ok", "failed", "running", "queued")


def add_arguments(parser) -> None:
    """``noria bench spec``'s arguments."""
    parser.description = ("Speculative decoding (n-gram drafter) against plain decoding in one run: tokens/s per batch "
                          "size, acceptance rate, on a tail-heavy workload (every request runs to --new-tokens).")
    parser.add_argument("--model", default="tiny-llama", help="catalog name or model folder (e.g. smollm2-135m-instruct)")
    parser.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--workloads", default="copy", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--lines", type=int, default=12, help="copy workload: JSON lines of tool output per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--num-tokens", type=int, default=4, help="engine.speculative.num_tokens (draft length k)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="model dtype (auto: see noria info)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (a verify step runs eagerly there; plain decode steps replay CUDA graphs)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise SystemExit(f"--workloads: {','.join(unknown) or 'empty'} not supported; choose from {', '.join(WORKLOADS)}")
    run(args.model, batches, args.new_tokens, workloads, args.temperature, args.num_tokens, args.dtype, args.json, args.lines,
        args.device)
    return 0


def run(model: str, batches: list[int], new_tokens: int, workloads: list[str], temperature: float, num_tokens: int,
        dtype: str = "auto", json_path: str | None = None, lines: int = 12, device: str = "cpu") -> list[dict]:
    from noria.bench import machine_name
    from noria.config.engine import SpeculativeConfig
    from noria.hardware import cpu_info, resolve_dtype
    from noria.models.catalog import model_path

    dtype = resolve_dtype(dtype, device)
    print(f"{machine_name() if device.startswith('cuda') else cpu_info().summary()}: {dtype}", file=sys.stderr)
    folder = model_path(model)
    default_max_batch = SpeculativeConfig().max_batch
    sides = {
        "no_spec": SpeculativeConfig(method="none"),
        "noria": SpeculativeConfig(method="ngram", num_tokens=num_tokens),
        "spec_always": SpeculativeConfig(method="ngram", num_tokens=num_tokens, max_batch=max(batches) + 1),
    }
    results = []
    for workload in workloads:
        prompts = _prompts(folder, workload, max(batches), new_tokens, lines)
        figures = {name: _measure(folder, prompts, batches, new_tokens, temperature, dtype, spec, device)
                   for name, spec in sides.items() if name != "spec_always"}
        # Where the default policy speculates, spec_always is the same engine: measured only above it.
        above = [b for b in batches if b > default_max_batch]
        figures["spec_always"] = {**{b: figures["noria"][b] for b in batches if b <= default_max_batch},
                                  **(_measure(folder, prompts, above, new_tokens, temperature, dtype, sides["spec_always"], device) if above else {})}
        for batch in batches:
            on, always = figures["noria"][batch], figures["spec_always"][batch]
            results.append({
                "case": f"{model} {device} {dtype} {workload} batch={batch} new={new_tokens} T={temperature} k={num_tokens}",
                "metric": "tokens_per_s",
                "noria": on["tokens_per_s"],
                "peers": {"no_spec": figures["no_spec"][batch]["tokens_per_s"], "spec_always": always["tokens_per_s"]},
                "bound": None,
                "speculating": batch <= default_max_batch,
                "acceptance": always["acceptance"],
                "tokens_per_verify": always["tokens_per_verify"],
                "prompt_tokens": sum(len(p) for p in prompts[:batch]) / batch,
            })
    _print(results)
    if json_path:
        write_json(json_path, "spec", results, default_max_batch=default_max_batch)
    return results


def _measure(folder: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, temperature: float,
             dtype: str, spec, device: str = "cpu") -> dict[int, dict[str, float]]:
    """Per batch size: tokens/s of one engine with ``spec``, and its speculation counters over the batch."""
    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.engine.protocol import GenerateRequest, SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(
        max_running_requests=max(batches), kv_cache_tokens=max(batches) * (longest + 16) + 1024, speculative=spec,
    )
    engine = Engine.from_path(folder, config, dtype=dtype, device=device)

    def requests(rows, n):
        return [GenerateRequest(input_ids=p, sampling=SamplingParams(
            max_new_tokens=n, temperature=temperature, ignore_eos=True, seed=i)) for i, p in enumerate(rows)]

    try:
        engine.generate_batch(requests(prompts[:2], 8))  # warm-up: kernels built, caches touched
        out = {}
        for batch in batches:
            engine.generate_batch(requests(prompts[:batch], 8))  # this batch size's first use
            engine.flush_cache()
            before = engine.metrics()
            start = time.perf_counter()
            results = engine.generate_batch(requests(prompts[:batch], new_tokens))
            seconds = time.perf_counter() - start
            after = engine.metrics()
            out[batch] = {"tokens_per_s": round(sum(len(r.output_ids) for r in results) / seconds, 1),
                          **_spec_rates(before, after)}
        return out
    finally:
        engine.shutdown(drain_timeout_s=1.0)


def _spec_rates(before: dict, after: dict) -> dict[str, float | None]:
    """Acceptance and tokens per verify chunk between two reads of ``Engine.metrics`` (None without verify chunks)."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                             "spec_verify_rows", "spec_verify_tokens")}
    if not delta["spec_verify_rows"]:
        return {"acceptance": None, "tokens_per_verify": None}
    return {"acceptance": round(delta["spec_accepted_tokens"] / delta["spec_proposed_tokens"], 3),
            "tokens_per_verify": round(delta["spec_verify_tokens"] / delta["spec_verify_rows"], 2)}


def _prompts(folder: Path, workload: str, n: int, new_tokens: int, lines: int = 12) -> list[list[int]]:
    from noria.data import generate_split, render_prompts
    from noria.models import load_tokenizer
    from noria.types import Prompt

    tokenizer = load_tokenizer(folder)
    if workload == "plain":
        records = generate_split("arithmetic", "test", {"n_test": max(n, 8), "seed": 0})
        return [r.ids for r in render_prompts(records[:n], tokenizer)]
    budget = json.loads((folder / "config.json").read_text()).get("max_position_embeddings", 2048) - new_tokens
    for lines in [lines, *(n for n in (12, 8, 6, 4, 3, 2) if n < lines)]:  # as many as the context leaves room for
        tasks = [_tool_task(i, lines) for i in range(n)]
        rendered = render_prompts([Prompt(prompt=text) for text, _ in tasks], tokenizer)
        # The answer has begun (its first line, as an agent's edit does): the rest copies the tool output.
        prompts = [r.ids + tokenizer(start, add_special_tokens=False)["input_ids"] for r, (_, start) in zip(rendered, tasks)]
        if max(len(p) for p in prompts) < budget:
            return prompts
    raise SystemExit(f"--new-tokens {new_tokens}: no room left for a copy prompt in this model's context")


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
    header = ["case", "noria", "no_spec", "spec_always", "noria/no_spec", "always/no_spec", "acceptance", "tok/verify"]
    rows = []
    for r in results:
        off, always = r["peers"]["no_spec"], r["peers"]["spec_always"]
        rows.append([r["case"], r["noria"], off, always, r["noria"] / off, always / off, r["acceptance"], r["tokens_per_verify"]])
    print_table("decode tokens/s (higher is better); acceptance and tokens per verify chunk of spec_always", header, rows)
