"""``noria bench fleet``: what scale-out costs and gives, in ratios taken in one run.

Cases (each side a fresh ``noria train`` subprocess on the same config but the one setting named):

- ``launcher``: the same RL work (1 engine, 1 trainer rank, disaggregated, synchronous) on
  ``launch: local`` and ``launch: ray`` (a private Ray instance; run inside a network namespace with
  only loopback when this runs as root, since Ray binds the external interface): ``step_s``, the
  mean seconds of a step after the first. Ray's overhead per step is ray / local - 1. Both sides
  run in deterministic mode (``engine.deterministic``), so they sample the same tokens and train the
  same batches: the steps differ only by the launcher (the figure is checked: same rewards). Both sides
  run each part on the same number of torch threads: Ray gives an actor as many as its bundle has
  CPUs (``OMP_NUM_THREADS``, 1 for the default ``{CPU: 1}``), so the local side runs with
  ``OMP_NUM_THREADS`` set to that number too (else the figure is 1 thread against all cores).
- ``engines``: ``rollout.engines`` 2 against 1 (behind sglang-router), asynchronous (k = 2): trained
  tokens per second and the engine busy fraction (``engine/busy_frac``), steps after the first.
- ``push``: one weight push of ``--push-model`` (bf16) from a trainer rank to N ``noria serve``
  engines (N in ``--push-engines``) through the path the RL job uses (``noria.launch.ranks``), with
  each transport of ``--push-transports``: ``ipc`` (what ``sync.transport: auto`` picks for engines
  on the trainer's machine: written into each engine's staging memory) and ``broadcast`` (one gloo
  group, bucketed), against the raw primitive: gloo broadcasts of the same bucket sizes from one
  process to N receiver processes. Best of ``--repeats``, push and primitive taking turns. A push
  includes what the raw broadcast does not: gathering the trainer's tensors, each engine's checks
  and its commit (``push_s``: until every engine serves the new version). A CPU engine then
  re-packs its weights for its matmuls on a background thread while serving through the model's
  modules: ``push_packed_s`` is the time until every engine has its packed weights again; the
  primitive runs only after that, on idle cores.

Not measured: GPUs, several machines. Figures from a machine others are using measure contention;
run it on a quiet one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from noria.process import Child
from noria.process import run as run_command


def add_arguments(parser) -> None:
    parser.description = ("Scale-out costs in ratios from one run: launch local vs ray (1 engine, 1 rank) seconds per step; "
                          "2 engines vs 1 trained tokens/s and engine busy fraction; a weight push to N engines vs the raw "
                          "gloo broadcast of the same bytes.")  # fmt: skip
    parser.add_argument("--model", default="tiny-llama", help="model of the RL cases (catalog name or folder)")
    parser.add_argument("--push-model", default="smollm2-135m-instruct", help="model of the push case")
    parser.add_argument("--steps", type=int, default=12, help="rollout steps per RL side (the first is not timed)")
    parser.add_argument("--push-engines", default="1,2,4", help="engine counts of the push case")
    parser.add_argument("--push-transports", default="ipc,broadcast", help="transports of the push case")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per engine count")
    parser.add_argument("--cases", default="launcher,engines,push", help="which cases to run")
    parser.add_argument("--tiny", action="store_true", help="a smoke test: tiny-llama everywhere, 2 steps, push to 1 and 2")
    parser.add_argument("--work-dir", help="folder for configs and run folders (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    from noria.bench import print_table, work_folder, write_json

    if args.tiny:
        args.push_model, args.steps, args.push_engines, args.repeats = args.model, 2, "1,2", 1
    work = work_folder(args.work_dir, "noria-bench-fleet-")
    cases = args.cases.split(",")
    results: list[dict[str, Any]] = []
    if "launcher" in cases:
        results += launcher_case(args.model, args.steps, work)
    if "engines" in cases:
        results += engines_case(args.model, args.steps, work)
    if "push" in cases:
        counts = [int(n) for n in args.push_engines.split(",")]
        results += push_case(args.push_model, counts, args.push_transports.split(","), args.repeats, work)
    rows = [[r["case"], r["metric"], r["noria"], json.dumps(r["peers"]), r["bound"]] for r in results]
    print_table("fleet: scale-out figures (ratios are what to read)", ["case", "metric", "noria", "peers", "bound"], rows)
    if args.json:
        write_json(args.json, "fleet", results)
    return 0


# ------------------------------------------------------------------------------------------ RL runs


def rl_config(model: str, steps: int, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "bench-fleet",
        "model": {"path": model},
        "data": {"task": "arithmetic", "task_args": {"n_train": 2000, "n_test": 8, "ops": ["+"]}},
        "rollout": {"n_samples": 4, "prompts_per_step": 8, "max_new_tokens": 32, "placement": "disaggregated"},
        "train": {"max_steps": steps},
    }
    for key, value in overrides.items():
        section, _, leaf = key.rpartition(".")
        target = cfg
        for part in section.split(".") if section else []:
            target = target.setdefault(part, {})
        target[leaf] = value
    return cfg


def train(name: str, cfg: dict[str, Any], work: Path, netns: bool = False, threads: int | None = None) -> list[dict[str, Any]]:
    """``noria train`` of ``cfg`` in a subprocess (in a loopback-only network namespace if asked;
    ``threads``: its ``OMP_NUM_THREADS``); the metrics rows after the first step."""
    path, run = work / f"{name}.yaml", work / name
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "noria", "train", str(path), "--run-dir", str(run), "--no-progress"]
    if netns:
        cmd = ["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + " ".join(cmd)]
    print(f"bench fleet: {name} -> {run}", file=sys.stderr)
    run_command(cmd, env={"OMP_NUM_THREADS": str(threads)} if threads else None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows[1:]


def launcher_case(model: str, steps: int, work: Path) -> list[dict[str, Any]]:
    from noria.config import RayConfig

    netns = os.geteuid() == 0
    threads = max(1, int(RayConfig().trainer_resources.get("CPU", 1)))  # what Ray gives each actor
    same = {"engine.deterministic": True}
    local = train("local", rl_config(model, steps, **same), work, threads=threads)
    ray = train("ray", rl_config(model, steps, launch="ray", **same), work, netns=netns)
    if [r["rollout/reward_mean"] for r in local] != [r["rollout/reward_mean"] for r in ray]:
        raise SystemExit("bench fleet: launch local and ray sampled different tokens in deterministic mode (rewards differ)")
    mean = lambda rows: sum(r["seconds"] for r in rows) / len(rows)  # noqa: E731
    case = (f"{model} 1 engine 1 rank sync P=8 n=4, {threads} thread(s) per part, launch ray"
            f"{' (own netns)' if netns else ''} vs local")
    return [{"case": case, "metric": "step_s", "noria": mean(ray), "peers": {"local": mean(local)}, "bound": None}]


def engines_case(model: str, steps: int, work: Path) -> list[dict[str, Any]]:
    sides = {}
    for n in (1, 2):
        cfg = rl_config(model, steps, **{"rollout.engines": n, "rollout.max_staleness": 2, "train.loss.off_policy": "tis"})
        rows = train(f"engines-{n}", cfg, work)
        wall = sum(r["seconds"] for r in rows)
        sides[n] = {
            "tokens_per_s": sum(r["rollout/trained_tokens"] for r in rows) / wall,
            "busy": sum(r["engine/busy_frac"] * r["seconds"] for r in rows) / wall,
        }
    case = f"{model} async k=2 P=8 n=4 rollout.engines 2 vs 1"
    return [
        {"case": case, "metric": "tokens_per_s", "noria": sides[2]["tokens_per_s"], "peers": {"one_engine": sides[1]["tokens_per_s"]}, "bound": None},
        {"case": case, "metric": "engine_busy_frac", "noria": sides[2]["busy"], "peers": {"one_engine": sides[1]["busy"]}, "bound": None},
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------- pushes


def push_case(model: str, counts: list[int], transports: list[str], repeats: int, work: Path) -> list[dict[str, Any]]:
    """Each count N: N engines started as a fleet of N starts them (``start_local_engine``: the
    machine's memory and cores shared among them), pushed to with each transport."""
    import secrets

    from noria.config import load_config
    from noria.engine.child import ready_all
    from noria.launch.fleet import start_local_engine
    from noria.launch.ranks import TrainerRank

    config = load_config(None, ["--model.path", model, "--data.task", "arithmetic", "--model.dtype", "bfloat16",
                                "--rollout.placement", "disaggregated", "--engine.kv_cache_tokens", "4096"])  # fmt: skip  # pushes need no cache: 4 engines fit in 24 GB
    rank = TrainerRank(config, 0, 1, str(work))
    rank.setup("127.0.0.1", 0, 1)
    key, results, version = secrets.token_urlsafe(16), [], [0]
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in rank.backend.state_dict_for_sync(config.sync.bucket_mb << 20)]
    try:
        for n in counts:
            config.rollout.engines = n
            start = start_local_engine(config, work / f"engines-{n}", key)
            engines = []
            try:
                engines += ready_all([start(i) for i in range(n)])
                targets = [(e.url, key) for e in engines]

                def push() -> float:
                    """Seconds until every engine serves the new version; returns once their
                    matmul weights are packed again (the seconds until then: ``packed``)."""
                    version[0] += 1
                    t0 = time.perf_counter()
                    rank.push(targets, version[0])
                    pushed = time.perf_counter() - t0
                    wait_packed([e.url for e in engines], key)
                    packed.append(time.perf_counter() - t0)
                    return pushed

                primitive = raw_broadcast(sizes, n)
                for transport in transports:
                    config.sync.transport = transport
                    rank.drop_syncs()
                    packed: list[float] = []
                    push_s, prim_s = interleaved(push, primitive, repeats)
                    case = f"{model} bf16 bytes={sum(sizes) / 1e6:.0f}MB push to {n} engine(s) ({transport}) vs raw gloo broadcast (one group)"
                    results.append({"case": case, "metric": "push_s", "noria": push_s, "peers": {}, "bound": prim_s})
                    results.append({"case": case, "metric": "push_packed_s", "noria": min(packed[1:]), "peers": {}, "bound": prim_s})
                rank.drop_syncs()
            finally:
                for engine in engines:
                    engine.stop()
    finally:
        rank.close()
    return results


def interleaved(push: Any, primitive: Any, repeats: int) -> tuple[float, float]:
    """Best times of ``push`` (the seconds it returns) and ``primitive`` (wall) taking turns, the
    first of each untimed. ``push`` returns only when the engines are idle again, so the primitive
    never shares the cores with an engine's background work."""
    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    push(), timed(primitive)
    rounds = [(push(), timed(primitive)) for _ in range(repeats)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


def wait_packed(urls: list[str], key: str, timeout_s: float = 60.0) -> None:
    """Until no engine reports ``packing_weights`` (its /metrics), polling every 10 ms."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        for url in urls:
            while "noria_engine_packing_weights 1" in client.get(f"{url}/metrics").text:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} still packing its weights after {timeout_s} s")
                time.sleep(0.01)


def raw_broadcast(sizes: list[int], n: int) -> Any:
    """A callable broadcasting flat buffers of ``sizes`` from here to ``n`` receiver processes (one
    gloo group, as the push's); the receivers stay up until this process exits (they die with it)."""
    import torch

    from noria.engine.weight_sources import create_update_group
    from noria.net import free_port

    port = free_port()
    job = json.dumps({"port": port, "sizes": sizes, "world": n + 1})
    receivers = [Child.start([sys.executable, "-m", "noria.bench.fleet", "recv", job, str(r + 1)], name=f"bench fleet receiver {r + 1}")
                 for r in range(n)]  # fmt: skip
    try:
        group = create_update_group("127.0.0.1", port, 0, n + 1, "bench-fleet", "gloo", 300)
    except BaseException:
        for child in receivers:
            child.stop()
        raise
    buffers = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
    ack = torch.zeros(1)

    def round_trip() -> None:
        for buf in buffers:
            group.broadcast(buf, 0).wait()
        for r in range(1, n + 1):
            group.broadcast(ack, r).wait()

    round_trip.receivers = receivers  # the Child handles live as long as the callable
    return round_trip


def receive(job: dict[str, Any], rank: int) -> None:
    import torch

    from noria.engine.weight_sources import create_update_group

    group = create_update_group("127.0.0.1", job["port"], rank, job["world"], "bench-fleet", "gloo", 300)
    buffers = [torch.empty(s, dtype=torch.uint8) for s in job["sizes"]]
    ack = torch.zeros(1)
    while True:
        try:
            for buf in buffers:
                group.broadcast(buf, 0).wait()
            for r in range(1, job["world"]):
                group.broadcast(ack, r).wait()
        except Exception:  # noqa: BLE001 -- the benchmark ended and the group went away
            return


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "recv":
    receive(json.loads(sys.argv[2]), int(sys.argv[3]))
