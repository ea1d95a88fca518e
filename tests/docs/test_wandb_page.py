"""docs/wandb.md's table holds for a real W&B run: Noria's own sink (``noria.metrics.WandbSink``)
started offline in a run folder, with W&B's variables set as the page says, after an earlier run of the
same process (W&B reads its variables once per process unless the sink tears it down). No network,
no account."""

from __future__ import annotations

from pathlib import Path

import pytest

from noria.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_wandb_page_states_what_a_real_offline_run_shows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from noria.metrics import WandbSink

    page = (ROOT / "docs" / "wandb.md").read_text()
    for fact in ("WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_TAGS", "`log.wandb_project`", "`log.wandb_mode`",
                 "wandb login", "WANDB_API_KEY", "--log.wandb_mode online", "wandb sync --entity"):  # fmt: skip
        assert fact in page, fact
    monkeypatch.setenv("HOME", str(tmp_path))  # no login, no settings file of this machine's user
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = load_config(ROOT / "examples" / "grpo_smollm2_arithmetic.yaml", ["--log.loggers", "[jsonl, wandb]", "--log.wandb_project", "my-project"])
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    (tmp_path / "earlier-run").mkdir()
    WandbSink(tmp_path / "earlier-run", config).close()  # an earlier run of this process, before the variables were set
    env = {"WANDB_ENTITY": "my-team", "WANDB_RUN_GROUP": "sweep-1", "WANDB_TAGS": "a,b",
           "WANDB_PROJECT": "not-this-one", "WANDB_MODE": "online"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    folder = tmp_path / "grpo-lr5e-6"
    folder.mkdir()
    sink = WandbSink(folder, config)
    try:
        run = sink.run
        assert (run.entity, run.project, run.name) == ("my-team", "my-project", "grpo-lr5e-6")  # config wins over WANDB_PROJECT
        assert run.group == "sweep-1" and set(run.tags) == {"a", "b"}
        assert run.settings.mode == "offline"  # log.wandb_mode wins over WANDB_MODE
        assert run.config["train"]["optim"]["lr"] == config.train.optim.lr  # the resolved config
        sink.log({"step": 1, "reward_mean": 0.5, "note": "text is left out"}, 1)
    finally:
        sink.close()
    assert list((folder / "wandb").glob("offline-run-*")), "the W&B files live in RUN_DIR/wandb"
