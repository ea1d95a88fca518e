"""The README and docs/*.md agree with the code: every ```yaml snippet loads with the config loader
``noria config`` uses (a fragment merged onto the example it names), every `noria ...` command line
parses with the real argument parser, every config key named in the prose exists (and a value given
with it has its type). Nothing runs: parse only, a few seconds in all. The checks are in
``doccheck.py`` beside this file; the last tests plant wrong pages and show each is caught, named by
file and line."""

from __future__ import annotations

import pytest

import doccheck

PAGES = doccheck.pages()
IDS = [doccheck.where(p) for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_yaml_snippet_loads_with_the_config_loader(page):
    assert doccheck.check_yaml(page, page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_noria_command_line_parses(page):
    assert doccheck.check_commands(page, page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_config_key_named_in_the_prose_exists(page):
    assert doccheck.check_prose_keys(page, page.read_text()) == []


def test_the_checks_read_what_the_pages_hold():
    """Guards against checks that pass because they found nothing to check."""
    texts = [p.read_text() for p in PAGES]
    snippets = [b for t in texts for b in doccheck.blocks(t) if b.lang == "yaml"]
    commands = [c for t in texts for c in doccheck.command_lines(t)]
    keys = [s for t in texts for _, s in doccheck.prose_spans(t) if doccheck.KEY.match(s.strip())]
    assert len(snippets) >= 4 and sum(1 for b in snippets if b.mark) >= 4
    assert len(commands) >= 80 and any(c.startswith("noria bench ") for _, c in commands)
    assert len(keys) >= 500


PLANTED = """# A page with mistakes planted on known lines

```yaml
model: {path: smollm2-135m-instruct}
data: {task: arithmetic}
rollout:
  n_sampels: 8
```

<!-- fragment: examples/grpo_smollm2_arithmetic.yaml -->
```yaml
rollout:
  placement: disaggregated
  max_staleness: 2
```

<!-- fragment: examples/grpo_smollm2_arithmetic.yaml -->
```yaml
train:
  loss:
    advantage: gpro
```

```bash
noria train examples/grpo_tiny.yaml --rollout.n_samples eight
noria inspect RUN_DIR --stepp 5
noria bench sync --transportz ipc
```

A dead engine is restarted `rollout.engine_restart` times; runs log to `log.wandb_entity`.
Evaluate with `eval.mode: everywhere`, and `model.dtype: auto` is fine.
"""


def test_a_planted_contradiction_is_caught_and_named_by_file_and_line(tmp_path):
    page = tmp_path / "docs" / "planted.md"
    page.parent.mkdir()
    page.write_text(PLANTED)
    problems = doccheck.check_page(page)
    where = doccheck.where(page)
    expected = {
        4: "unknown config key 'rollout.n_sampels'; did you mean 'rollout.n_samples'?",  # a misspelled key
        12: "train.loss.off_policy",  # asynchronous RL without a correction: the example refuses it
        19: "unknown advantage estimator 'gpro'",  # no such advantage estimator
        25: "rollout.n_samples: expected int, got str 'eight'",  # a value of the wrong type
        26: "unrecognized arguments: --stepp",  # an option the command does not have
        27: "unrecognized arguments: --transportz",  # a benchmark's own options are parsed too
        30: "no config key 'rollout.engine_restart'",  # keys named in the prose
        31: "'everywhere' is not one of ['shared', 'fleet', 'checkpoint']",  # and their values
    }
    for line, text in expected.items():
        found = [p for p in problems if p.startswith(f"{where}:{line}: ")]
        assert found and text in found[0], (line, text, problems)
    assert any(p.startswith(f"{where}:30: ") and "log.wandb_entity" in p for p in problems)
    assert len(problems) == len(expected) + 1, problems  # `model.dtype: auto` and the rest are right


def test_a_fragment_must_name_an_example_that_exists(tmp_path):
    page = tmp_path / "page.md"
    text = "<!-- fragment: examples/no_such.yaml -->\n```yaml\nrollout: {n_samples: 4}\n```\n"
    assert doccheck.check_yaml(page, text) == [
        f"{doccheck.where(page)}:3: the fragment's example examples/no_such.yaml does not exist"
    ]


def test_spans_marked_unchecked_and_synopses_are_left_alone(tmp_path):
    text = (
        "<!-- unchecked: --rollout.n_sample 8 -->\n"
        "A misspelled key (`--rollout.n_sample 8`) is an error; `noria train CONFIG [--key value ...]` is a synopsis;\n"
        "`noria fleet add` is a command's name; `engine.weights` is a module and `sync.disk_write` a fault point.\n"
    )
    assert doccheck.check_page(tmp_path / "page.md", text) == []
