"""``noria bench soak --minutes N``: an asynchronous RL job run for N minutes, checked for growth.

The job: one ``noria train`` child (``noria.process.Child``) on the tiny model (catalog
``tiny-llama``, built on this machine once), asynchronous (``rollout.max_staleness`` 1, engines in
their own ``noria serve`` processes, ``--engines`` of them; more than one sit behind the real
sglang-router), with an evaluation fleet (``eval.mode: fleet``, one ``noria serve`` evaluating
every few steps while training goes on), agent sessions (:func:`soak_agent`, two turns per
episode through the session server) and a checkpoint every ``--save-every`` steps. Its data
(``data.epochs`` passes) outlasts the soak; after N minutes the job is stopped with SIGTERM (the
path Ctrl-C takes) and must leave none of its processes behind.

What is sampled every ``--interval`` seconds, over the job's whole process tree (the ``noria
train`` process and every descendant, found under ``/proc`` at each sample):

=================  ======================================================================
series             what
=================  ======================================================================
``rss_mb``         sum of the processes' resident memory (``VmRSS``)
``fds``            open file descriptors
``threads``        threads
``processes``      processes in the tree
``shm_segments``   ``/dev/shm`` entries of this job: named with one of its pids, or mapped
                   or held open by one of its processes (once seen, counted until removed)
``shm_mb``         their bytes
``kv_blocks``      the rollout engine's KV blocks in use right after the step's weight
                   sync (``engine/kv_usage`` of the last ``metrics.jsonl`` line x blocks)
``buffer_groups``  groups waiting in the buffer (``buffer/size`` of the last line)
=================  ======================================================================

Figures per series, over the samples after the warm-up (``--warmup``, a share of the run): the
level (their mean), the slope (least squares, per minute), and the growth: the slope times the
measured window, in % of the level. ``kv_blocks`` and ``buffer_groups`` are queues that swing
between 0 and a bound from one step to the next, so their growth is taken in % of that bound
(the cache's blocks, the buffer's capacity): in % of a level near 0 their noise alone would read
as growth. The run FAILS (exit code 1, naming the series) when a growth exceeds
``--max-growth`` %, or when anything of the job is left after it stopped.

``--json PATH`` writes every series' figures and samples; ``--plot PATH`` draws them (PNG,
matplotlib). Not measured: speed (run it niced, beside other work, if you like: it measures
growth), GPU memory, disk use of the run folder (checkpoints and logs grow by design).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHM = Path("/dev/shm")
SERIES = {
    "rss_mb": "MB", "fds": "count", "threads": "count", "processes": "count", "shm_segments": "count",
    "shm_mb": "MB", "kv_blocks": "blocks", "buffer_groups": "groups",
}  # fmt: skip
"""Series sampled -> unit."""
KV_TOKENS = 4096
"""The engines' KV cache (``engine.kv_cache_tokens``)."""
STOP_TIMEOUT_S = 180.0
"""How long the job may take to stop after SIGTERM (a step and a checkpoint may be finishing)."""


def add_arguments(parser) -> None:
    parser.description = ("An asynchronous RL job (tiny model, eval fleet, agent sessions) for N minutes: RSS, fds, "
                          "threads, /dev/shm, KV blocks and buffer size over its process tree; fails on growth.")  # fmt: skip
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the job runs")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the run before the figures start")
    parser.add_argument("--max-growth", type=float, default=5.0, help="growth (%%) past which the soak fails")
    parser.add_argument("--model", default="tiny-llama", help="catalog name or folder")
    parser.add_argument("--engines", type=int, default=2, help="rollout engines (2 or more: behind sglang-router)")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between evaluations on the fleet")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (0: none)")
    parser.add_argument("--work-dir", help="folder for the config and the run folder (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", help="write the figures and samples to this JSON file")
    parser.add_argument("--plot", help="draw the series to this PNG file")


def main(args) -> int:
    from noria.bench import print_table, work_folder, write_json
    from noria.models.catalog import model_path

    model = str(model_path(args.model))  # a catalog model is built now, not on the soak's clock
    work = work_folder(args.work_dir, "noria-bench-soak-")
    soak = Soak(work, soak_config(model, args.engines, args.eval_every, args.save_every))
    soak.run(args.minutes * 60, args.interval)
    figures = [analyse(name, soak.samples, args.warmup, soak.bounds.get(name)) for name in SERIES]
    failed = [f.name for f in figures if f.growth_pct > args.max_growth]
    rows = [[f.name, SERIES[f.name], f.level, f.slope_per_min, f.growth_pct, f.scale, "GREW" if f.name in failed else "flat"]
            for f in figures]  # fmt: skip
    print_table(f"soak: {soak.minutes():.1f} min, {soak.summary()}; growth after the first {args.warmup:.0%} (limit {args.max_growth:g}%)",
                ["series", "unit", "level", "slope/min", "growth %", "of", "verdict"], rows)  # fmt: skip
    if args.json:
        write_json(args.json, "soak", [f.result(args.max_growth) for f in figures], run=soak.describe(args))
    if args.plot:
        plot(args.plot, figures, soak.samples, args.warmup)
    if failed:
        print(f"soak FAILED: grew more than {args.max_growth:g}% after the warm-up: {', '.join(failed)}", file=sys.stderr)
    if soak.left:
        print(f"soak FAILED: left behind after the job stopped: {soak.left}", file=sys.stderr)
    return 1 if failed or soak.left else 0


# ------------------------------------------------------------------------------------------- the job


async def soak_agent(ctx: Any, prompt: Any, base_url: str) -> dict[str, Any]:
    """Agent function (``rollout.agent_fn``): two turns in one session, the question then a request to
    answer again; the configured reward scores the trajectory."""
    import httpx

    messages = [{"role": "user", "content": prompt.prompt if isinstance(prompt.prompt, str) else prompt.prompt[-1]["content"]}]
    async with httpx.AsyncClient(timeout=None) as http:
        for turn in range(2):
            r = await http.post(f"{base_url}/chat/completions", json={"messages": messages})
            r.raise_for_status()
            messages.append(r.json()["choices"][0]["message"])
            if turn == 0:
                messages.append({"role": "user", "content": "Answer again."})
    return {"metadata": {"turns": 2}}


def soak_config(model: str, engines: int, eval_every: int, save_every: int) -> dict[str, Any]:
    """The job: asynchronous RL with agent sessions, an evaluation fleet and checkpoints; data for days."""
    return {
        "name": "soak",
        "model": {"path": model, "dtype": "float32"},
        "data": {"task": "arithmetic", "task_args": {"n_train": 800, "n_test": 16, "max_operand": 30, "ops": ["+"]}, "epochs": 1000},
        "reward": {"name": "numeric"},
        "rollout": {
            "placement": "disaggregated", "engines": engines, "max_staleness": 1, "n_samples": 4, "prompts_per_step": 4,
            "max_new_tokens": 16, "agent_fn": "noria.bench.soak:soak_agent", "agent_timeout_s": 300,
            "buffer": {"filters": []},  # every group trains: the tiny model's groups often agree, and drops in a row stop a run
        },
        "engine": {"kv_cache_tokens": KV_TOKENS},
        "train": {"save_every": save_every, "loss": {"off_policy": "tis"}, "optim": {"lr": 1.0e-4}},
        "eval": {"mode": "fleet", "engines": 1, "every": eval_every, "limit": 8, "max_new_tokens": 16},
    }  # fmt: skip


class Soak:
    """The job as a child process, sampled until its time is up, then stopped and checked for leftovers."""

    def __init__(self, work: Path, config: dict[str, Any]) -> None:
        self.work, self.config = work, config
        self.run_dir = work / "run"
        self.samples: list[dict[str, float]] = []
        self.bounds: dict[str, float] = {}
        self.left: list[str] = []
        self.exit_code: int | None = None
        self.last_row: dict[str, Any] = {}
        self._rows_read = 0

    def run(self, seconds: float, interval: float) -> None:
        import yaml

        from noria.process import Child

        path = self.work / "soak.yaml"
        path.write_text(yaml.safe_dump(self.config))
        cmd = [sys.executable, "-m", "noria", "train", str(path), "--run-dir", str(self.run_dir), "--no-progress"]
        print(f"bench soak: {' '.join(cmd)} for {seconds / 60:g} min", file=sys.stderr)
        tree = ProcessTree()
        child = Child.start(cmd, name="soak job (noria train)", log_path=self.work / "train.log")
        tree.root = child.pid
        try:
            self.sample_until(child, tree, seconds, interval)
        finally:
            self.stop(child, tree)

    def sample_until(self, child: Any, tree: ProcessTree, seconds: float, interval: float) -> None:
        self.start = time.monotonic()
        while time.monotonic() - self.start < seconds:
            if not child.alive():
                raise SystemExit(f"bench soak: the job ended early ({child.exit_note()}):\n{child.tail()}")
            self.samples.append({"t_s": time.monotonic() - self.start, **tree.sample(), **self.from_metrics()})
            time.sleep(max(0.0, interval - (time.monotonic() - self.start - self.samples[-1]["t_s"])))

    def from_metrics(self) -> dict[str, float]:
        """KV blocks and buffer size from the newest line of ``metrics.jsonl`` (NaN before the first)."""
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            whole = [line for line in lines[self._rows_read :] if line.endswith("}")]
            if whole:
                self.last_row = json.loads(whole[-1])
                self._rows_read += len(whole)
        row = self.last_row
        if row and not self.bounds:
            self.bounds = {"kv_blocks": float(self.kv_blocks_total()), "buffer_groups": float(row["buffer/capacity"])}
        kv = row.get("engine/kv_usage")
        return {
            "kv_blocks": kv * self.bounds["kv_blocks"] if kv is not None else float("nan"),
            "buffer_groups": float(row["buffer/size"]) if row else float("nan"),
            "step": float(row.get("step", 0)),
        }

    def kv_blocks_total(self) -> int:
        import yaml

        config = yaml.safe_load((self.run_dir / "config.yaml").read_text())
        return config["engine"]["kv_cache_tokens"] // config["engine"]["block_size"] * config["rollout"]["engines"]

    def stop(self, child: Any, tree: ProcessTree) -> None:
        """SIGTERM (the Ctrl-C path), then: every process the tree ever had, and its shm segments, gone."""
        seen = set(tree.seen)
        if child.alive():
            child.signal(signal.SIGTERM)
        try:
            self.exit_code = child.wait(STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 -- a hang is what the soak reports; the child is killed below
            self.left.append(f"noria train still running {STOP_TIMEOUT_S:g} s after SIGTERM")
        child.stop(timeout_s=0)
        self.end = time.monotonic()
        deadline = time.monotonic() + 30
        while (alive := [p for p in seen if process_alive(p, tree.starts.get(p))]) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.left += [f"process {p} ({tree.names.get(p, '?')})" for p in alive]
        self.left += [f"/dev/shm/{name}" for name in tree.shm_names if (SHM / name).exists()]

    # ------------------------------------------------------------------------------ report

    def minutes(self) -> float:
        return (self.samples[-1]["t_s"] if self.samples else 0.0) / 60

    def summary(self) -> str:
        evals = self.run_dir / "eval.jsonl"
        n_evals = len(evals.read_text().splitlines()) if evals.exists() else 0
        return f"{int(self.last_row.get('step', 0))} steps, {n_evals} evaluations, exit code {self.exit_code}"

    def describe(self, args: Any) -> dict[str, Any]:
        return {
            "minutes": self.minutes(), "interval_s": args.interval, "warmup": args.warmup, "max_growth_pct": args.max_growth,
            "summary": self.summary(), "config": self.config, "left_behind": self.left, "exit_code": self.exit_code,
            "per_process": per_process_series(self.samples),
        }  # fmt: skip


def per_process_series(samples: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Process (``pid name``) -> [[t_s, rss_mb, fds, threads], ...]: where a total's growth comes from."""
    out: dict[str, list[list[float]]] = {}
    for s in samples:
        for key, one in s.get("per_process", {}).items():
            out.setdefault(key, []).append([round(s["t_s"], 1), round(one["rss_mb"], 1), one["fds"], one["threads"]])
    return out


# ------------------------------------------------------------------------------------------ sampling


@dataclass
class ProcessTree:
    """A process and its descendants under ``/proc``, sampled; remembers every pid and shm segment it saw."""

    root: int = 0
    seen: set[int] = field(default_factory=set)
    names: dict[int, str] = field(default_factory=dict)
    starts: dict[int, str] = field(default_factory=dict)
    """pid -> its start time (field 22 of /proc/PID/stat): a reused pid is another process."""
    shm_names: set[str] = field(default_factory=set)
    shm_before: set[str] = field(default_factory=lambda: set(os.listdir(SHM)) if SHM.is_dir() else set())

    def pids(self) -> list[int]:
        parents: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = read_stat(int(entry.name))
                if stat:
                    parents.setdefault(int(stat[1]), []).append(int(entry.name))
        out, todo = [self.root], [self.root]
        while todo:
            kids = parents.get(todo.pop(), [])
            out += kids
            todo += kids
        return out

    def sample(self) -> dict[str, Any]:
        totals = {"rss_mb": 0.0, "fds": 0.0, "threads": 0.0, "processes": 0.0}
        per_process: dict[str, dict[str, float]] = {}
        shm_open: set[str] = set()
        for pid in self.pids():
            one = process_figures(pid)
            if one is None:  # gone meanwhile
                continue
            self.seen.add(pid)
            self.names.setdefault(pid, one.pop("name"))
            self.starts.setdefault(pid, one.pop("start"))
            shm_open |= one.pop("shm")
            for key in ("rss_mb", "fds", "threads"):
                totals[key] += one[key]
            totals["processes"] += 1
            per_process[f"{pid} {self.names[pid]}"] = one
        count, size = self.shm(shm_open)
        return {**totals, "shm_segments": float(count), "shm_mb": size / 2**20, "per_process": per_process}

    def shm(self, open_now: set[str]) -> tuple[int, int]:
        """This job's /dev/shm entries (module docstring) and their bytes."""
        pids = {str(p) for p in self.seen}
        for name in set(os.listdir(SHM)) - self.shm_before if SHM.is_dir() else ():
            if name in open_now or pids & set(_numbers(name)):
                self.shm_names.add(name)
        sizes = []
        for name in self.shm_names:
            try:
                sizes.append((SHM / name).stat().st_size)
            except FileNotFoundError:
                pass
        return len(sizes), sum(sizes)


def _numbers(name: str) -> list[str]:
    """The runs of digits in a segment's name (``noria_sync_<pid>_...``, ``torch_<pid>_...``)."""
    import re

    return re.findall(r"\d+", name)


def read_stat(pid: int) -> list[str] | None:
    """Fields after the command name of /proc/PID/stat (state, ppid, ...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_figures(pid: int) -> dict[str, Any] | None:
    """RSS (MB), fds, threads, name, start time and the /dev/shm names it maps or holds open."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        fds = os.listdir(f"/proc/{pid}/fd")
        maps = Path(f"/proc/{pid}/maps").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    stat = read_stat(pid)
    if stat is None or stat[0] == "Z":
        return None
    shm = {line.split("/dev/shm/", 1)[1].split(" ")[0] for line in maps.splitlines() if "/dev/shm/" in line}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            shm.add(target[len("/dev/shm/") :].split(" ")[0])
    return {
        "rss_mb": int(status.get("VmRSS", "0 kB").split()[0]) / 1024, "fds": float(len(fds)),
        "threads": float(status.get("Threads", "0").strip()), "name": role(cmdline, status.get("Name", "?").strip()),
        "start": stat[19], "shm": shm,
    }  # fmt: skip


def role(cmdline: list[bytes], name: str) -> str:
    """A short name: ``noria train``, ``noria serve :PORT``, or the process's own name."""
    args = [a.decode(errors="replace") for a in cmdline if a]
    if "noria" in args and "serve" in args and "--port" in args:
        return f"noria serve :{args[args.index('--port') + 1]}"
    if "noria" in args and "train" in args:
        return "noria train"
    return name


def process_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` still runs (not a zombie) and is the same process (same start time)."""
    stat = read_stat(pid)
    return stat is not None and stat[0] != "Z" and (start is None or stat[19] == start)


# ------------------------------------------------------------------------------------------ figures


@dataclass
class Figures:
    name: str
    level: float
    slope_per_min: float
    growth_pct: float
    scale: str
    samples: list[tuple[float, float]]

    def result(self, max_growth: float) -> dict[str, Any]:
        return {
            "case": f"{self.name} ({SERIES[self.name]}) after warm-up", "metric": "growth_pct", "noria": self.growth_pct,
            "peers": {}, "bound": max_growth, "level": self.level, "slope_per_min": self.slope_per_min,
            "growth_of": self.scale, "samples": [[round(t, 1), v] for t, v in self.samples],
        }  # fmt: skip


def analyse(name: str, samples: list[dict[str, Any]], warmup: float, bound: float | None = None) -> Figures:
    """Level, least-squares slope and growth of one series after the warm-up (module docstring)."""
    points = [(s["t_s"], float(s[name])) for s in samples if s[name] == s[name]]  # NaN: not measured yet
    if not points:
        return Figures(name, float("nan"), float("nan"), float("inf"), "no samples", [])
    t0 = samples[-1]["t_s"] * warmup
    after = [(t, v) for t, v in points if t >= t0]
    level = sum(v for _, v in after) / len(after)
    slope = least_squares_slope(after)
    span = after[-1][0] - after[0][0]
    scale, of = (bound, f"bound {bound:g}") if bound else (level, "level")
    if scale:
        growth = 100 * slope * span / scale
    else:
        growth = 0.0 if slope == 0 else float("inf")
    return Figures(name, level, slope * 60, growth, of, points)


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    """Slope per second of the least-squares line through ``points`` (0 for fewer than two times)."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def plot(path: str, figures: list[Figures], samples: list[dict[str, Any]], warmup: float) -> None:
    """One panel per series against minutes: the samples, the warm-up shaded, the fitted line after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = -(-len(figures) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    end = samples[-1]["t_s"] / 60 if samples else 0.0
    for ax, f in zip(axes.flat, figures):
        ax.plot([t / 60 for t, _ in f.samples], [v for _, v in f.samples], lw=0.8)
        ax.axvspan(0, end * warmup, color="0.9")
        if f.samples and f.level == f.level:
            t0 = end * warmup
            mid = (t0 + end) / 2
            ax.plot([t0, end], [f.level + f.slope_per_min * (t0 - mid), f.level + f.slope_per_min * (end - mid)], "r--", lw=1)
        ax.set_title(f"{f.name} ({SERIES[f.name]}): {f.growth_pct:+.2f}% of {f.scale}", fontsize=9)
        ax.set_xlabel("minutes", fontsize=8)
    for ax in list(axes.flat)[len(figures) :]:
        ax.axis("off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
