"""docs/: the generated references match the code, every shipped example has a recipe that loads,
and the quickstart matches the README's commands. CPU only, no model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from noria.cli import main as noria_main
from noria.config import field_docs, load_config
from noria.metric_names import METRICS
from noria.runview.docs import config_reference, metrics_reference, stale_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_generated_references_are_up_to_date():
    assert stale_docs(DOCS) == [], "run `noria docs` to regenerate docs/config.md and docs/metrics.md"


def test_config_reference_lists_every_key_and_metrics_reference_every_metric():
    config, metrics = config_reference(), metrics_reference()
    for key, _, _, help_text in field_docs():
        assert f"| `{key}` |" in config and help_text, key
    for m in METRICS:
        assert f"| `{m.name}` | {m.unit} |" in metrics


def test_docs_check_command_fails_on_a_stale_page(tmp_path, capsys):
    assert noria_main(["docs", "--out", str(tmp_path)]) == 0
    assert noria_main(["docs", "--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "config.md").write_text((tmp_path / "config.md").read_text().replace("Samples per prompt", "Samples"))
    assert noria_main(["docs", "--check", "--out", str(tmp_path)]) == 1
    assert "stale: config.md" in capsys.readouterr().err


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_has_a_recipe_and_loads(example):
    assert f"examples/{example.name}" in (DOCS / "recipes.md").read_text()
    load_config(example)  # closed and validated; no model is loaded


def test_quickstart_matches_the_readme():
    readme, quick = (ROOT / "README.md").read_text(), (DOCS / "quickstart.md").read_text()
    for command in ("bash scripts/main.sh", "bash scripts/test.sh", "noria train examples/grpo_smollm2_arithmetic.yaml"):
        assert command in readme and command in quick
    for image in re.findall(r"\]\((images/[^)]+)\)", quick):
        assert (DOCS / image).is_file(), image


def test_the_readme_names_every_config_section():
    import dataclasses

    from noria.config import RunConfig
    from noria.config.schema import optional_section

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Configuration") : readme.index("### Models")]
    hints = __import__("typing").get_type_hints(RunConfig)
    names = [f.name for f in dataclasses.fields(RunConfig) if optional_section(hints[f.name]) is not None]
    assert len(names) >= 10 and [n for n in names if f"`{n}`" not in section] == []


def test_quickstart_and_readme_agree_on_the_first_run_and_its_timings():
    readme, quick = (ROOT / "README.md").read_text(), (DOCS / "quickstart.md").read_text()
    for command in ("noria models import tiny-llama", "noria train examples/grpo_tiny.yaml"):
        assert command in readme and command in quick
    # every progress line quoted in the quickstart is the README's measured one, with its CPU named
    for line in re.findall(r"^(?:eval at step|step \d+/)\S*.*$", quick, flags=re.M):
        assert line in readme, line
    assert "Zen 4" in quick and "Zen 4" in readme


def test_docs_links_resolve():
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            assert (DOCS / target).is_file(), f"{page.name} links to missing {target}"


def test_every_test_the_guarantees_page_names_exists():
    """docs/guarantees.md backs each claim with a test; a renamed or deleted test fails here."""
    named = re.findall(r"tests/((?:\w+/)?test_\w+\.py)::(test_\w+)", (DOCS / "guarantees.md").read_text())
    assert len(named) > 40
    missing = [f"{file}::{name}" for file, name in named if f"def {name}(" not in (ROOT / "tests" / file).read_text()]
    assert missing == [], missing


def test_docs_readme_indexes_every_page():
    """docs/README.md is the table of contents: a page it does not list is a page nobody finds."""
    index = (DOCS / "README.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert len(pages) >= 18 and [p for p in pages if f"]({p})" not in index] == []
    assert [t for t in re.findall(r"\]\(([^)#:]+\.md)\)", index) if not (DOCS / t).is_file()] == []


def test_the_gpu_example_loads_on_a_cpu_machine_and_names_the_gpu():
    """examples/grpo_qwen3_gpu.yaml (docs/gpu.md) validates here; its devices are CUDA's."""
    config = load_config(ROOT / "examples" / "grpo_qwen3_gpu.yaml")
    assert (config.model.device, config.train.device, config.model.dtype) == ("cuda", "cuda", "bfloat16")
    assert config.rollout.placement == "colocated" and config.train.activation_checkpointing
    assert "examples/grpo_qwen3_gpu.yaml" in (DOCS / "gpu.md").read_text()
