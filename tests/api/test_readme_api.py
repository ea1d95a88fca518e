"""README "Python API": the one-line ``python -c "import noria; noria.train(...)"`` runs exactly as
written, from the repository root with no PYTHONPATH, and trains the tiny example. The catalog's
``tiny-llama`` folder is put in place from the test's tiny model (the warm start takes minutes), in
the catalog's own cache layout, so that the line's ``model='tiny-llama'`` resolves as it does for a
user who ran ``noria models import tiny-llama``. The Python blocks of README and docs/python.md
compile, and the registry block of docs/python.md runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import yaml

from repo_util import ROOT


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def readme_line() -> str:
    (block,) = fenced(section((ROOT / "README.md").read_text(), "## Python API"), "bash")
    (line,) = [line for line in block.splitlines() if line.strip()]
    return line


def test_the_readme_line_trains_the_tiny_example(tiny_model_dir, tmp_path):
    from noria.models.catalog import BUILD_MARK, CATALOG

    home = tmp_path / "home"
    shutil.copytree(tiny_model_dir, home / "models" / "tiny-llama")
    mark = {"name": "tiny-llama", "version": CATALOG["tiny-llama"].version}
    (home / "models" / "tiny-llama" / BUILD_MARK).write_text(json.dumps(mark) + "\n")
    argv = shlex.split(readme_line())
    assert argv[:2] == ["python", "-c"] and argv[2].startswith("import noria; ")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NORIA_HOME"] = str(home)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = ROOT / proc.stdout.strip().splitlines()[-1]
    try:
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["model"]["path"] == "tiny-llama" and saved["reward"] == {**saved["reward"], "name": "numeric", "kwargs": {}}
        assert saved["data"]["path"].startswith(str(home / "datasets")) and saved["data"]["label_key"] == "label"
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2] and all(s["reward/scored"] > 0 for s in steps)
        assert (run / "final" / "config.json").is_file()
    finally:
        shutil.rmtree(run, ignore_errors=True)  # the line writes under runs/ of the repository, as for a user


def test_the_python_blocks_compile_and_the_registry_block_runs():
    readme = fenced(section((ROOT / "README.md").read_text(), "## Python API"), "python")
    page = fenced((ROOT / "docs" / "python.md").read_text(), "python")
    assert len(readme) == 1 and len(page) == 3
    for i, block in enumerate(readme + page):
        compile(block, f"block {i}", "exec")
    registry = next(b for b in page if "register_reward" in b)
    code = registry + "\nassert noria.get_reward('shorter')('abcd', None, {}) == -0.04 and 'numeric' in noria.REWARDS\nprint('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
