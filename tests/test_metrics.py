"""Metric names, units and sinks: the registry covers what the loop logs; TensorBoard and W&B
(offline, no network) receive the rows; progress is plain lines off a terminal.

Runs one tiny real RL run (tests/runview_util.py), CPU only.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace

import pytest

from noria.config import ConfigError, load_config
from noria.metric_names import METRICS, metric_doc, undocumented
from noria.metrics import Progress, RunLog
from runview_util import STEPS, tiny_run


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> Path:
    return tiny_run(tmp_path_factory, tiny_model_dir)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_registry_entries_are_unique_and_complete():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(m.unit and m.meaning.endswith(".") for m in METRICS), [m.name for m in METRICS if not m.unit]
    assert metric_doc("buffer/dropped/stale").name == "buffer/dropped/*"
    assert metric_doc("reward/failed/timeout").name == "reward/failed/*"
    assert metric_doc("no_such_metric") is None
    assert undocumented(["loss", "made/up", "rollout/reward_mean"]) == ["made/up"]


def test_every_key_the_loop_logs_is_documented(run):
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    keys = {k for r in rows for k in r}
    assert undocumented(keys) == [], "add these to METRICS in noria/metric_names.py, then run `noria docs`"
    evals = read_jsonl(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert undocumented(f"eval/{k}" for e in evals for k in e if k not in ("step", "version")) == []


def test_tensorboard_receives_steps_and_evaluations(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"rollout/reward_mean", "loss", "sync/seconds", "eval/accuracy"} <= tags
    rewards = read_jsonl(run / "metrics.jsonl")
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([r["rollout/reward_mean"] for r in rewards])
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 2, 3]


def test_wandb_offline_run_is_written_without_network(run):
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run / "wandb").iterdir())
    (data,) = list(runs[0].glob("run-*.wandb"))
    assert data.stat().st_size > 1000  # the logged history, stored for `wandb sync`


def test_loggers_are_validated():
    with pytest.raises(ConfigError, match="log.loggers: unknown sink 'mlflow'"):
        load_config(None, ["--model.path", "m", "--data.task", "arithmetic", "--log.loggers", "[jsonl, mlflow]"])


def test_plain_progress_lines_show_stage_times_staleness_and_eta(tmp_path):
    config = SimpleNamespace(rollout=SimpleNamespace(max_staleness=1), log=SimpleNamespace(loggers=["jsonl"]))
    err = io.StringIO()
    with redirect_stderr(err):
        log = RunLog(tmp_path, total_steps=4, start_step=0, progress=False, config=config)
        log.write_eval({"step": 0, "version": 0, "accuracy": 0.25, "n_prompts": 8, "seconds": 1.0})
        log.write_step({"step": 1, "version": 1, "rollout/reward_mean": 0.5, "rollout/tokens_per_s": 120.0,
                        "time/trainer_wait_s": 2.0, "time/train_s": 4.0, "tokens": 800.0, "sync/seconds": 0.25,
                        "buffer/size": 3.0, "buffer/staleness_mean": 0.5, "buffer/staleness_max": 1.0})
        log.close()
    lines = err.getvalue().splitlines()
    assert lines[0] == "eval at step 0: accuracy 25.0% on 8 prompts (1 s)"
    assert lines[1].startswith("step 1/4 reward 0.500 eval 25.0% @0 stale 0.5/1 buf 3 ")
    for part in ("gen tok/s 120", "train tok/s 200", "wait 2.0s", "train 4.0s", "sync 0.25s", "eta 0m"):
        assert part in lines[1], lines[1]
    assert "\r" not in err.getvalue()


def test_eval_progress_is_plain_lines_off_a_terminal():
    err = io.StringIO()
    with redirect_stderr(err):
        with Progress(20, "eval", "answer") as bar:
            for _ in range(20):
                bar.update(1)
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("eval 2/20 answers") and lines[-1].startswith("eval 20/20 answers")
    assert len(lines) == 10 and "\r" not in err.getvalue()


def _listed(family: str, word: str) -> list[str]:
    """The names a registry entry lists after ``word``: (``...; reasons: a, b, c; ...``)."""
    meaning = metric_doc(family).meaning
    listed = meaning.split(f"{word}: ", 1)[1].split(";")[0].rstrip(".")
    return [name.strip() for name in listed.split(",")]


def test_drop_reasons_documented_are_the_ones_the_buffer_emits():
    import asyncio

    from buffer_util import group
    from noria.rollout.buffer import DROP_REASONS, GroupBuffer, resolve_filters
    from noria.types import Status

    async def main() -> set[str]:
        buf = GroupBuffer(8, max_staleness=0, filters=resolve_filters(["zero_reward_variance", "over_length"]))
        await buf.put(group(0, status=Status.ABORTED, rewards=(None, None)))
        await buf.put(group(1, rewards=(1.0, 1.0)))
        await buf.put(group(2, status=Status.TRUNCATED))
        await buf.put(group(3, versions=(0,)))
        buf.take(1, version=5)
        return set(buf.dropped)

    assert asyncio.run(main()) == set(DROP_REASONS)
    assert _listed("buffer/dropped/*", "reasons") == list(DROP_REASONS)


def test_reward_failure_kinds_documented_are_the_ones_the_runner_emits():
    import reward_plugins

    from noria.config import RewardConfig
    from noria.rewards import score
    from noria.rewards.runner import FAILURE_KINDS
    from noria.types import Sample

    seen = set()
    reward_plugins.RELEASE.clear()
    try:
        for name in ("raises", "hangs", "returns_text", "returns_nan"):
            counts = score([Sample(prompt_ids=[1], response_text="x")], RewardConfig(name=f"reward_plugins:{name}", timeout_s=0.2), [None])
            seen |= set(counts.failed)
    finally:
        reward_plugins.RELEASE.set()
    assert seen == set(FAILURE_KINDS)
    assert _listed("reward/failed/*", "kinds") == list(FAILURE_KINDS)


ROW = {"step": 3, "rollout/reward_mean": 0.5, "loss": 0.0123, "rollout_logprob_abs_diff_max": 0.41,
       "rollout/tokens_per_s": 96.0, "tokens": 2048, "time/train_s": 4.0, "time/trainer_wait_s": 3.5,
       "sync/seconds": 0.21}  # fmt: skip


def test_step_line_fits_the_terminal_dropping_the_least_important_first():
    from noria.metrics import short

    whole = short(ROW, (0.625, 0))
    assert whole.startswith("reward 0.500 eval 62.5% @0 loss 0.0123") and "sync 0.21s" in whole
    for width in (100, 70, 50, 30, 10):
        line = short(ROW, (0.625, 0), width=width)
        assert line.startswith("reward 0.500 eval 62.5% @0")  # never dropped
        assert len(line) <= width or line == "reward 0.500 eval 62.5% @0"
    assert short(ROW, None).startswith("reward 0.500 loss")  # no evaluation yet: no accuracy shown
    narrow = short(ROW, (0.625, 0), width=50)
    assert "loss" in narrow and "sync" not in narrow and "|dlp|max" not in narrow


def test_the_bar_shows_the_latest_evaluation(tmp_path):
    from noria.metrics import RunLog

    log = RunLog(tmp_path, total_steps=3, start_step=0, progress=True)
    try:
        log.write_step(ROW)
        log.write_eval({"step": 3, "accuracy": 0.75, "n_prompts": 8, "seconds": 1.0})
        assert "eval 75.0% @3" in log.bar.postfix  # the final bar carries the final evaluation, with its step
    finally:
        log.close()


def test_a_resumed_run_shows_the_newest_evaluation_it_recorded(tmp_path):
    rows = [{"step": 0, "accuracy": 0.25}, {"step": 10, "skipped": "x"}, {"step": 20, "accuracy": 0.42}, {"step": 30, "accuracy": 0.5}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = RunLog(tmp_path, total_steps=40, start_step=20, progress=False)
    assert log.last_eval == (0.42, 20)  # not the row of step 30, which the resume sets aside
    log.close()
    (tmp_path / "fresh").mkdir()
    assert RunLog(tmp_path / "fresh", total_steps=4, start_step=0, progress=False).last_eval is None
