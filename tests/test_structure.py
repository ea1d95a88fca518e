"""The shape of the code: layers, no circle between top-level parts, one owner of child processes,
small functions and files, and no import arrow that runs the wrong way.

Read from the source with ``ast`` (nothing is imported), so a function-level import counts as much
as a top-level one. What each rule protects is in docs/architecture.md ("Who imports whom").
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

NORIA = Path(__file__).resolve().parent.parent / "noria"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600

LAYERS = [
    ("leaves", {"types", "errors", "hardware", "openmp", "net", "console", "plugins", "config", "faults", "metric_names"}),
    ("base", {"models", "data", "metrics", "loop", "process"}),
    ("engine and trainer", {"engine", "train"}),
    ("services", {"sync", "rollout", "router", "agent", "rewards", "eval", "distill", "run_folder", "runview", "preflight", "service"}),
    ("jobs", {"launch", "diffusion"}),
    ("top", {"bench", "cli", "__main__"}),
]
"""Top-level parts of noria, bottom to top: a part imports parts of its own layer or below, never above."""

PROCESS_OWNER = "process"
"""The one part that starts processes (``noria.process``)."""
PROCESS_EXCEPTIONS = {
    "noria.agent.sandbox": "runs with the system Python as other users, so it imports only the standard library; "
    "its chain of namespaces is its own (tests/agent/test_sandbox.py attacks it)",
}
"""Modules that may start processes themselves, and why."""
STARTERS = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnvp", "spawnl",
           "execv", "execve", "execvp", "execvpe", "execl", "execlp"},
    "multiprocessing": {"Process", "Pool", "get_context", "set_start_method"},
    "torch.multiprocessing": {"Process", "Pool", "get_context", "spawn", "start_processes", "set_start_method"},
}  # fmt: skip
"""Module -> the functions of it that start a process (or choose how processes start)."""

FORBIDDEN = [
    ("loop", "launch", "the loop imports no launcher: launchers implement noria.loop.Job"),
    ("agent", "rollout", "agent gets what it needs from the rollout context (ctx.seed_for, ...), not rollout modules"),
    ("engine", "train", "engine and train meet only in sync (weights) and in the loop (records)"),
    ("train", "engine", "engine and train meet only in sync (weights) and in the loop (records)"),
]
"""(importing part, imported part, why): parts are top-level modules or packages of noria."""


def sources() -> list[Path]:
    return sorted(NORIA.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(NORIA.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, set[str], int]]:
    """(imported module, names imported from it, line) for every import in ``path``, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, set(), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((module, {alias.name for alias in node.names}, node.lineno))
    return out


def targets(module: str, names: set[str]) -> list[str]:
    """The noria modules an import reaches: ``from noria import x`` reaches ``noria.x``."""
    if module == "noria":  # a submodule, not a name of noria/__init__.py (``__version__``)
        return [f"noria.{n}" for n in names if (NORIA / f"{n}.py").exists() or (NORIA / n).is_dir()]
    return [module] if module.startswith("noria.") else []


def part(module: str) -> str:
    return module.split(".")[1]


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importing module, imported module) -> where (file:line), over every noria module."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sources():
        src = module_name(path)
        for module, names, line in imports(path):
            for dst in targets(module, names):
                edges[(src, dst)].append(f"{path.relative_to(NORIA.parent)}:{line}")
    return edges


def part_edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> where (file:line), for imports between different top-level parts."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (src, dst), where in import_graph().items():
        if src != "noria" and dst != "noria" and part(src) != part(dst):
            edges[(part(src), part(dst))] += where
    return edges


def layer_of(name: str) -> int:
    return next(i for i, (_, parts) in enumerate(LAYERS) if name in parts)


def test_every_top_level_part_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in NORIA.iterdir() if (p.suffix == ".py" and p.stem != "__init__") or list(p.glob("*.py"))}
    placed = set().union(*(names for _, names in LAYERS))
    assert parts - placed == set(), f"give these parts a layer in LAYERS (and docs/architecture.md): {sorted(parts - placed)}"
    assert placed - parts == set(), f"LAYERS names parts that do not exist: {sorted(placed - parts)}"


def test_imports_go_down_the_layers():
    up = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]}): {where[0]}"
          for (a, b), where in sorted(part_edges().items()) if layer_of(b) > layer_of(a)]  # fmt: skip
    assert not up, "imports that run up the layers:\n" + "\n".join(up)


def circles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one part (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while group[-1:] != [v]:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_between_top_level_parts():
    """A circle is reported with every import line that closes it (both directions of a pair)."""
    edges = part_edges()
    report = []
    for group in circles(edges):
        lines = [f"  {a} -> {b}: {edges[(a, b)][0]}" for a in group for b in group if (a, b) in edges]
        report.append(f"circle {' / '.join(group)}:\n" + "\n".join(lines))
    assert not report, "\n".join(report)


def test_the_circle_check_finds_a_circle():
    """The check above cannot pass vacuously: a made-up pair of arrows is one circle, named."""
    edges = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3"], ("c", "d"): ["c.py:4"]}
    assert circles(edges) == [["a", "b", "c"]]


def test_bench_and_cli_are_imported_by_nothing():
    found = [f"{a} -> {b}: {where[0]}" for (a, b), where in part_edges().items()
             if (b == "bench" and a != "cli") or (b == "cli" and a != "__main__")]  # fmt: skip
    assert not found, found


def process_starts(path: Path) -> list[str]:
    """Calls in ``path`` that start a process (``STARTERS``), through any alias of the module or name."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}  # local name -> module
    names: dict[str, str] = {}  # local name -> module.function
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in STARTERS:
                    modules[alias.asname or alias.name] = full
                elif alias.name in STARTERS.get(node.module, ()):
                    names[alias.asname or alias.name] = full
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr in STARTERS.get(modules.get(f.value.id, ""), ()):
            found.append(f"{path.relative_to(NORIA.parent)}:{node.lineno} {modules[f.value.id]}.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in names:
            found.append(f"{path.relative_to(NORIA.parent)}:{node.lineno} {names[f.id]}")
    return found


def test_only_the_process_owner_starts_processes():
    found = [c for path in sources() if module_name(path).split(".")[1:2] != [PROCESS_OWNER] and module_name(path) not in PROCESS_EXCEPTIONS
             for c in process_starts(path)]  # fmt: skip
    assert not found, "start processes through noria.process (Child, run, start_process, spawn):\n" + "\n".join(found)


def test_the_process_scan_sees_every_spelling(tmp_path):
    """The check above cannot pass vacuously: each way of starting a process is found."""
    probe = NORIA / "probe_process_scan.py"
    probe.write_text(
        "import subprocess\nimport subprocess as sp\nimport torch.multiprocessing as mp\nimport multiprocessing\n"
        "from subprocess import Popen\nfrom asyncio import create_subprocess_exec as cse\nimport os\n"
        "subprocess.run(['x'])\nsp.Popen(['x'])\nmp.spawn(f)\nmultiprocessing.get_context('spawn')\nPopen(['x'])\ncse('x')\n"
        "os.fork()\nsubprocess.PIPE\n"
    )
    try:
        found = [c.split(" ")[1] for c in process_starts(probe)]
    finally:
        probe.unlink()
    assert found == ["subprocess.run", "subprocess.Popen", "torch.multiprocessing.spawn", "multiprocessing.get_context",
                     "subprocess.Popen", "asyncio.create_subprocess_exec", "os.fork"]  # fmt: skip
    assert [c for m in PROCESS_EXCEPTIONS for c in process_starts(NORIA.parent / (m.replace(".", "/") + ".py"))], "exceptions still needed"


@pytest.mark.parametrize("importer, imported, why", FORBIDDEN, ids=[f"{a}->{b}" for a, b, _ in FORBIDDEN])
def test_no_forbidden_arrow_between_parts(importer, imported, why):
    found = [w for (src, dst), where in import_graph().items() if src != "noria" and part(src) == importer
             and part(dst) == imported for w in where]  # fmt: skip
    assert not found, f"{importer} -> {imported} ({why}): {found}"


def test_no_private_name_crosses_modules_of_the_engine():
    """engine/cuda/graphs and engine/runner share the paged attention context through a public
    module (engine/paged_context), not each other's private names."""
    found = []
    for path in sources():
        for module, names, line in imports(path):
            private = sorted(n for n in names if n.startswith("_") and not n.startswith("__"))
            if module.startswith("noria.") and private:
                found.append(f"{path.relative_to(NORIA.parent)}:{line} {module} {private}")
    assert not found, found
    graph = import_graph()
    assert ("noria.engine.cuda.graphs", "noria.engine.runner") not in graph


def test_functions_and_files_are_small():
    too_long = []
    for path in sources():
        text = path.read_text()
        where = path.relative_to(NORIA.parent)
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, f"over {MAX_FUNCTION_LINES} lines a function / {MAX_FILE_LINES} a file: {too_long}"


def test_the_graph_sees_function_level_imports():
    """The checks above would pass vacuously if the graph missed imports inside functions."""
    graph = import_graph()
    assert ("noria.rollout.generate", "noria.agent.plugins") in graph  # inside run_rollout
    assert ("noria.launch.rl", "noria.loop") in graph  # inside run_rl
    assert ("noria.cli", "noria.bench") in graph  # from noria.bench import add_parsers, in a function


def test_the_architecture_page_lists_what_the_code_declares():
    """docs/architecture.md names every Job call, Buffer method, plug point and forbidden arrow."""
    from noria.loop import Job
    from noria.plugins import PLUG_POINTS
    from noria.rollout.buffer import Buffer

    page = (NORIA.parent / "docs" / "architecture.md").read_text()
    job = set(Job.__annotations__) | {n for n in vars(Job) if not n.startswith("_") and callable(getattr(Job, n))}
    assert len(job) == 12 and [n for n in job if f"`{n}" not in page] == []
    buffer = {n for n in vars(Buffer) if callable(getattr(Buffer, n)) and (not n.startswith("_") or n == "__len__")}
    assert len(buffer) == 6 and [n for n in buffer if f"`{n}(" not in page] == []
    assert [k for k in PLUG_POINTS if f"| `{k}` |" not in page] == []
    assert [f"{a} -> {b}" for a, b, _ in FORBIDDEN if f"`{a} -> {b}`" not in page and f"`{b} -> {a}`" not in page] == []
    assert [name for name, _ in LAYERS if f"| {name} |" not in page] == []
    assert [p for _, parts in LAYERS for p in parts if f"`{p}`" not in page] == []
    assert [m for m in PROCESS_EXCEPTIONS if f"`{m}`" not in page] == []
