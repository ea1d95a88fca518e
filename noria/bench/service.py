"""``noria bench service``: N tenants running the cookbook GRPO loop at once against one ``noria service``.

What runs: one ``noria service`` on ``--model`` (a keys file of one tenant per loop, quotas wide
enough that they are not what is measured), then, for each N of ``--tenants`` (1 and 4 by default)
in turn, N processes of ``examples/service_grpo_arithmetic.py`` (``--async``:
``examples/service_grpo_async.py``) started together, each a tenant training its own LoRA adapter
with the same settings and seed: the same prompts, held-out problems and initial adapter, so each
tenant of N = 4 compares with the tenant of N = 1 (their samples differ: the sampler is not seeded).

Figures: per tenant, held-out accuracy before and after (greedy, ``--eval`` problems of the task's
test split); per N, the service's tokens/s: the tokens sampled for training plus the tokens trained
(``forward_backward``) by all N loops, over the wall time from the first loop's first training step
to the last loop's last (the held-out evaluations are outside it), and the ratio of N = max to
N = 1. The loops' client processes run on the same machine as the service and take a little of its
CPU (tokenizing and scoring).

``--placement colocated,disaggregated`` runs it all once per placement of the sampling engine
(``service.placement``), one service after the other; the second placement's cases are prefixed
with its name.

Not measured: latency per call, quotas, the service's start (outside the clock).
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {False: REPO / "examples" / "service_grpo_arithmetic.py", True: REPO / "examples" / "service_grpo_async.py"}


def add_arguments(parser) -> None:
    parser.description = ("N tenants each running the cookbook GRPO loop (examples/service_grpo_arithmetic.py) at once against "
                          "one noria service: held-out accuracy before and after per tenant, and the service's sampled + "
                          "trained tokens/s for each N side by side, with the ratio.")  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or folder: the service's base model")
    parser.add_argument("--dtype", default="auto", help="the service's model.dtype (float32 for the tiny model)")
    parser.add_argument("--device", default="cpu", help="the service's model.device (cpu, cuda): its trainer and its sampling engine")
    parser.add_argument("--tenants", default="1,4", help="comma-separated numbers of concurrent tenants, run in turn")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps of each loop")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="most tokens per answer")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the training groups")
    parser.add_argument("--eval", type=int, default=50, help="held-out problems per evaluation")
    parser.add_argument("--lr", type=float, default=5e-4, help="Adam learning rate of each loop")
    parser.add_argument("--seed", type=int, default=0, help="every tenant's seed (prompts, held-out problems, initial adapter)")
    parser.add_argument("--placement", default="colocated", help="comma-separated service.placement values, run in turn: colocated "
                        "(the sampling engine in the service's process), disaggregated (a noria serve child)")
    parser.add_argument("--async", dest="async_loop", action="store_true", help="run examples/service_grpo_async.py")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds one N's loops may take")
    parser.add_argument("--work-dir", help="folder for the keys, states, logs and figures (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    from noria.bench import print_table, work_folder, write_json
    from noria.models.catalog import model_path

    counts = [int(n) for n in args.tenants.split(",")]
    placements = args.placement.split(",")
    unknown = sorted(set(placements) - {"colocated", "disaggregated"})
    if unknown:
        raise SystemExit(f"--placement: unknown {unknown}; known: colocated, disaggregated")
    model = str(model_path(args.model))  # a catalog model is built now, not on the clock
    work = work_folder(args.work_dir, "noria-bench-service-")
    figures, every = [], {}
    for placement in placements:
        keys = {f"n{n}-t{i}": f"tml-bench-{secrets.token_hex(12)}" for n in counts for i in range(n)}
        where = work / placement
        where.mkdir(exist_ok=True)
        service, url = start_service(model, args.dtype, keys, where, placement, args.device)
        try:
            runs = {n: run_tenants(url, {t: k for t, k in keys.items() if t.startswith(f"n{n}-")}, args, where) for n in counts}
        finally:
            service.stop()
        rows = [[n, t, f["accuracy_before"], f["accuracy_after"], f["sampled_tokens"], f["trained_tokens"], f["train_end"] - f["train_start"]]
                for n, tenants in runs.items() for t, f in tenants.items()]  # fmt: skip
        print_table(f"service ({placement} sampler): {args.model}, {args.steps} steps x {args.prompts} prompts x {args.samples} samples, "
                    f"{args.eval} held-out problems", ["N", "tenant", "acc before", "acc after", "sampled tok", "trained tok", "train s"], rows)  # fmt: skip
        totals = {n: throughput(tenants) for n, tenants in runs.items()}
        print_table(f"service throughput, {placement} sampler (sampled + trained tokens over the loops' training wall time)",
                    ["N", "tokens", "wall s", "tokens/s"], [[n, *totals[n]] for n in counts])  # fmt: skip
        ratio = totals[counts[-1]][2] / totals[counts[0]][2] if len(counts) > 1 and totals[counts[0]][2] else None
        if ratio is not None:
            print(f"{placement}: {counts[-1]} tenants vs {counts[0]}: {ratio:.2f}x the tokens/s")
        prefix = "" if placement == "colocated" else f"{placement}: "
        figures += [{**row, "case": prefix + row["case"]} for row in results(runs, totals, counts, ratio)]
        every[placement] = runs
    if args.json:
        write_json(args.json, "service", figures, tenants=every, settings=vars(args))
    return 0


def start_service(model: str, dtype: str, keys: dict[str, str], work: Path, placement: str = "colocated", device: str = "cpu") -> tuple[Any, str]:
    """``noria service`` on a free loopback port with these tenants and its sampler at ``placement``, ready."""
    from noria.net import free_port
    from noria.process import Child

    keys_file = work / "keys.json"
    wide = {"tokens_per_minute": 10**9, "queue_depth": 256, "max_adapters": 2}
    keys_file.write_text(json.dumps({"tenants": {t: {"key": k, **wide} for t, k in keys.items()}}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "noria", "service", "--model", model, "--port", str(port), "--model.dtype", dtype,
           "--service.keys_file", str(keys_file), "--service.state_dir", str(work / "state"), "--service.placement", placement, "--model.device", device]  # fmt: skip
    service = Child.start(cmd, name=f"noria service at {url}", log_path=work / "service.log", env={"TOKENIZERS_PARALLELISM": "false"})
    try:
        service.wait_http(f"{url}/api/v1/healthz", 600)
    except BaseException:
        service.stop()
        raise
    return service, url


def run_tenants(url: str, keys: dict[str, str], args, work: Path) -> dict[str, dict]:
    """One example loop per tenant, all started together; each one's figures (its ``--json``)."""
    from noria.errors import NoriaError
    from noria.process import Child

    loop = [str(EXAMPLES[args.async_loop]), "--url", url, "--steps", str(args.steps), "--prompts", str(args.prompts),
            "--samples", str(args.samples), "--new-tokens", str(args.new_tokens), "--temperature", str(args.temperature), "--eval", str(args.eval),
            "--lr", str(args.lr), "--seed", str(args.seed)]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    children = {
        t: Child.start([sys.executable, *loop, "--key", k, "--json", str(work / f"{t}.json")], name=f"tenant {t}", log_path=work / f"{t}.log", env=env)
        for t, k in keys.items()
    }  # fmt: skip
    try:
        for t, child in children.items():
            if child.wait(args.timeout) != 0:
                raise NoriaError(f"the loop of tenant {t} failed ({child.exit_note()}): {child.tail()}")
    finally:
        for child in children.values():
            child.stop()
    return {t: json.loads((work / f"{t}.json").read_text()) for t in keys}


def throughput(tenants: dict[str, dict]) -> tuple[int, float, float]:
    """(tokens, wall seconds, tokens/s) of loops that ran together."""
    tokens = sum(f["sampled_tokens"] + f["trained_tokens"] for f in tenants.values())
    wall = max(f["train_end"] for f in tenants.values()) - min(f["train_start"] for f in tenants.values())
    return tokens, wall, tokens / wall if wall > 0 else 0.0


def results(runs: dict[int, dict], totals: dict[int, tuple], counts: list[int], ratio: float | None) -> list[dict]:
    out = [{"case": f"{n} tenants", "metric": "tokens_per_s", "noria": totals[n][2], "peers": {}, "bound": None} for n in counts]
    if ratio is not None:
        out.append({"case": f"{counts[-1]} tenants vs {counts[0]}", "metric": "tokens_per_s_ratio", "noria": ratio, "peers": {}, "bound": None})
    for n, tenants in runs.items():
        for t, f in tenants.items():
            for when in ("before", "after"):
                out.append({"case": f"{n} tenants: {t}", "metric": f"heldout_accuracy_{when}", "noria": f[f"accuracy_{when}"], "peers": {}, "bound": None})
    return out
