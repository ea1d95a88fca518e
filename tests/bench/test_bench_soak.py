"""``noria bench soak``'s sampler and verdict on real processes: a process tree that leaks file
descriptors, threads, memory and /dev/shm segments is seen growing (so the soak can fail), and a
steady one is seen flat. The soak itself (an hour of RL) is run by hand; its figures are in
docs/guarantees.md."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from noria.bench import BENCHMARKS, parse_bench_args
from noria.bench.soak import SHM, ProcessTree, analyse
from noria.process import Child

LEAKER = """
import os, sys, threading, time
from multiprocessing import shared_memory
leak = sys.argv[1] == "leak"
held, segments = [], []
import subprocess
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a grandchild: the walk goes below one level
print("ready", flush=True)
for i in range(40):
    if leak:
        held.append(open(os.devnull))
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        held.append(bytearray(2 << 20))
        if i % 4 == 0:
            segments.append(shared_memory.SharedMemory(name=f"noria_test_soak_{os.getpid()}_{i}", create=True, size=1 << 16))
    time.sleep(0.05)
time.sleep(60)
"""


def sample_tree(tmp_path: Path, mode: str) -> tuple[list[dict], ProcessTree]:
    script = tmp_path / "leaker.py"
    script.write_text(LEAKER)
    tree = ProcessTree()
    child = Child.start([sys.executable, str(script), mode], name=f"soak test {mode}", log_path=tmp_path / f"{mode}.log",
                        group=True)  # stop() takes its grandchild along
    tree.root = child.pid
    samples = []
    try:
        child.wait_ready(lambda: "ready" in child.tail(), 30)
        start = time.monotonic()
        while time.monotonic() - start < 2.5:
            samples.append({"t_s": time.monotonic() - start, **tree.sample()})
            time.sleep(0.1)
    finally:
        child.stop()
        for name in tree.shm_names:  # the leaker was killed: its segments are this test's to remove
            (SHM / name).unlink(missing_ok=True)
    return samples, tree


def test_a_leaking_tree_grows_and_a_steady_one_is_flat(tmp_path):
    leaking, tree = sample_tree(tmp_path, "leak")
    assert max(s["processes"] for s in leaking) >= 2  # the grandchild is in the tree (and the resource tracker)
    assert len(tree.shm_names) >= 5 and all(n.startswith("noria_test_soak_") for n in tree.shm_names)
    for name in ("fds", "threads", "rss_mb", "shm_segments", "shm_mb"):
        assert analyse(name, leaking, 0.2).growth_pct > 5, (name, analyse(name, leaking, 0.2))
    steady, _ = sample_tree(tmp_path, "steady")
    for name in ("fds", "threads", "processes", "rss_mb"):
        assert abs(analyse(name, steady, 0.2).growth_pct) < 5, (name, analyse(name, steady, 0.2))
    assert analyse("shm_segments", steady, 0.2).growth_pct == 0


def test_bounded_series_grow_against_their_bound():
    samples = [{"t_s": float(t), "buffer_groups": float(t % 3)} for t in range(100)]
    assert abs(analyse("buffer_groups", samples, 0.2, bound=8).growth_pct) < 5
    rising = [{"t_s": float(t), "buffer_groups": t / 10} for t in range(100)]
    assert analyse("buffer_groups", rising, 0.2, bound=8).growth_pct > 5


def test_the_soak_is_a_benchmark():
    _, args = parse_bench_args("soak", ["--minutes", "3", "--json", "x.json", "--plot", "x.png"])
    assert "soak" in BENCHMARKS and args.minutes == 3 and args.warmup == 0.2 and args.max_growth == 5
