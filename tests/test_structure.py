"""The shape of the code: small functions and files, and no import arrow that runs the wrong way.

Read from the source with ``ast`` (nothing is imported), so a function-level import counts as much
as a top-level one. What each forbidden arrow protects is in docs/architecture.md ("Who imports
whom").
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

NORIA = Path(__file__).resolve().parent.parent / "noria"
MAX_FUNCTION_LINES = 100
MAX_FILE_LINES = 800

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
    if module == "noria":
        return [f"noria.{n}" for n in names]
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
