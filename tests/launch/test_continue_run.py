"""A finished run goes on, a run that cannot is refused untouched, and no later run deletes records.

- a finished run leaves a checkpoint of its last step (``train.save_final_state``), so
  ``noria train --resume RUN --train.max_steps N`` extends it from where it ended, bitwise as a
  straight run of N steps (``engine.deterministic``);
- ``--resume`` on a folder without a checkpoint but with records is refused, every file unchanged,
  the error naming what would be lost and the ways on; ``--restart`` moves the records aside;
- a resume from before the last recorded step moves the later rows and files to ``superseded/``;
- ``events.jsonl``, ``noria report`` and ``noria inspect`` show every segment.

CPU, the tiny random Llama, the real CLI entry point in this process (a few seconds per run).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from rl_util import read_jsonl, rl_args
from safetensors.torch import load_file

from noria import faults
from noria.cli import main
from noria.config import load_config
from noria.errors import DiskError
from noria.launch.rl import run_rl

EXACT = {"engine.deterministic": True, "rollout.n_samples": 4}
COMPARED = ("loss", "rollout/reward_mean", "grad_norm", "rollout_logprob_abs_diff_max", "version")


def train(model: Path, *extra: str, **overrides) -> int:
    """``noria train`` (the CLI, in this process) of the tiny arithmetic run."""
    return main(["train", *extra, *rl_args(model, **{**EXACT, **overrides}), "--no-progress"])


def checksums(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def events(run: Path) -> list[tuple[str, int]]:
    return [(e["event"], e["at_step"]) for e in read_jsonl(run / "events.jsonl")]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory) -> Path:
    """An uninterrupted 4-step run: what every continued run here must equal."""
    run = tmp_path_factory.mktemp("straight") / "run"
    config = tmp_path_factory.getbasetemp() / "continue.yaml"
    config.write_text("name: continue\n")
    assert train(tiny_model_dir, str(config), "--run-dir", str(run), **{"train.max_steps": 4}) == 0
    return run


def test_a_finished_run_extended_by_resume_continues_bitwise(tiny_model_dir, tmp_path, straight, capsys):
    run = tmp_path / "run"
    config = tmp_path / "continue.yaml"
    config.write_text("name: continue\n")
    assert train(tiny_model_dir, str(config), "--run-dir", str(run), **{"train.max_steps": 3}) == 0  # save_every 0
    assert (run / "checkpoints" / "step-000003" / "COMMITTED").is_file()  # what a continuation needs, beside final/
    before = (run / "metrics.jsonl").read_text().splitlines()
    capsys.readouterr()

    # The command: the run's own config, one more step.
    assert main(["train", "--resume", str(run), "--train.max_steps", "4", "--no-progress"]) == 0
    assert f"resuming {run} at step 3 (checkpoints/step-000003)" in capsys.readouterr().err
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert after[:3] == before and len(after) == 4  # rows 1-3 untouched, row 4 appended
    rows, whole = read_jsonl(run / "metrics.jsonl"), read_jsonl(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in COMPARED:
        assert [r[key] for r in rows] == [r[key] for r in whole], key
    assert same_weights(run, straight)
    assert events(run) == [("started", 0), ("resumed", 3)]
    assert not (run / "superseded").exists()  # nothing was recorded after step 3

    from noria.runview.report import load_run

    data = load_run(run)
    assert data.resumed_at == [3] and [r["step"] for r in data.steps] == [1, 2, 3, 4]  # one curve, the resume marked
    assert data.segments[0].startswith("segment 1 of 2: started at step 0") and data.segments[0].endswith("steps 1-3")
    assert "segment 2 of 2: resumed at step 3" in data.segments[1] and data.segments[1].endswith("step 4")


def test_resume_with_nothing_to_continue_from_is_refused_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "continue.yaml"
    config.write_text("name: continue\n")
    assert train(tiny_model_dir, str(config), "--run-dir", str(run), **{"train.max_steps": 2, "train.save_final_state": False}) == 0
    assert not (run / "checkpoints").exists()
    sums = checksums(run)
    capsys.readouterr()

    assert main(["train", "--resume", str(run), "--train.max_steps", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert checksums(run) == sums  # every file unchanged, none added
    assert "nothing to continue from" in err and "metrics.jsonl (2 steps)" in err and "final/ (the model of step 2)" in err, err
    assert f"--model.path {run / 'final'}" in err and f"noria train --resume {run} --restart" in err, err
    assert "loading the trainer" not in err  # refused before any model loads

    # --restart: the old records move aside, whole; the run starts again from step 0.
    assert main(["train", "--resume", str(run), "--restart", "--train.max_steps", "1", "--no-progress"]) == 0
    (previous,) = run.glob("previous-*")
    assert checksums(previous) == sums
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    assert events(run) == [("restarted", 0), ("started", 0)]
    assert read_jsonl(run / "events.jsonl")[0]["moved_to"] == previous.name

    from noria.runview.report import load_run

    assert any(line.startswith(f"moved aside by --restart: {previous.name}/") for line in load_run(run).segments)
    # A fresh run on a folder holding a run names --restart among the ways on.
    assert train(tiny_model_dir, str(config), "--run-dir", str(run), **{"train.max_steps": 1}) == 2
    assert "--restart" in capsys.readouterr().err


def test_a_crash_after_the_last_checkpoint_keeps_the_rows_it_drops(tiny_model_dir, tmp_path, straight, monkeypatch, capsys):
    run = tmp_path / "run"
    args = rl_args(tiny_model_dir, **{**EXACT, "train.max_steps": 4, "train.save_every": 2})
    monkeypatch.setattr(faults, "_armed", faults.parse("metrics.write=raise:ENOSPC@4"))  # the run stops in step 4
    monkeypatch.setattr(faults, "_reached", faults.Counter())
    with pytest.raises(DiskError):
        run_rl(load_config(None, args), run_dir=str(run), progress=False)
    monkeypatch.setattr(faults, "_armed", {})
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')  # and a line cut short, as a kill mid-write leaves it
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines[:3]] == [1, 2, 3]
    step3 = (run / "rollouts" / "step-000003.jsonl").read_bytes()
    capsys.readouterr()

    run_rl(load_config(None, args), resume=str(run), progress=False)  # from the step-2 checkpoint
    err = capsys.readouterr().err
    (side,) = (run / "superseded").iterdir()
    assert side.name.startswith("after-step-2-") and f"moved, not deleted, to {side}" in err, err
    assert "metrics.jsonl 2 rows" in err and "rollouts/ 1 file" in err, err
    assert (side / "metrics.jsonl").read_text().splitlines() == lines[2:]  # row 3 and the torn line, as they were
    assert (side / "rollouts" / "step-000003.jsonl").read_bytes() == step3
    rows, whole = read_jsonl(run / "metrics.jsonl"), read_jsonl(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in COMPARED:  # the lost steps repeated exactly
        assert [r[key] for r in rows] == [r[key] for r in whole], key
    assert same_weights(run, straight)
    recorded = read_jsonl(run / "events.jsonl")
    assert [(e["event"], e["at_step"]) for e in recorded] == [("started", 0), ("resumed", 2)]
    assert recorded[1]["checkpoint"] == "step-000002" and recorded[1]["superseded"]["metrics.jsonl"] == 2

    assert main(["inspect", str(run), "--step", "4", "--no-tokens", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "run: 4 steps in 2 segments" in out and "resumed at step 2" in out and "<- this step" in out, out
    assert "moved to superseded/after-step-2-" in out


def test_a_finished_sft_run_is_extended_from_its_last_step(tiny_model_dir, tmp_path):
    from sft_util import args_for, losses, write_chats

    from noria.launch.sft import run_sft

    data = write_chats(tmp_path / "chats.jsonl")
    def config(**extra):
        return load_config(None, args_for(tiny_model_dir, data, **{"train.save_every": 0, **extra}))

    whole = run_sft(config(), run_dir=str(tmp_path / "whole"), progress=False)
    part = tmp_path / "part"
    run_sft(config(**{"train.max_steps": 3}), run_dir=str(part), progress=False)
    assert (part / "checkpoints" / "step-000003" / "COMMITTED").is_file()
    run_sft(config(), resume=str(part), progress=False)
    assert losses(part) == losses(whole)
    assert (part / "final" / "model.safetensors").read_bytes() == (whole / "final" / "model.safetensors").read_bytes()
    assert events(part) == [("started", 0), ("resumed", 3)] and not (part / "superseded").exists()


def test_set_aside_and_restart_move_records_byte_for_byte(tmp_path):
    """The moves alone, on a folder written by hand (no model): nothing is lost, names never collide."""
    from noria.run_folder import move_aside, set_aside_after

    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    rows = [json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(rows) + '{"step": 4, "lo')
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.1}) + "\n" + json.dumps({"step": 3, "accuracy": 0.2}) + "\n")
    for s in (1, 2, 3):
        (run / "rollouts" / f"step-{s:06d}.jsonl").write_text(f"rollouts of {s}\n")
    moved, side = set_aside_after(run, 2)
    assert moved == {"metrics.jsonl": 2, "eval.jsonl": 1, "rollouts/": 1}
    assert (run / "metrics.jsonl").read_text() == "".join(rows[:2])
    assert (side / "metrics.jsonl").read_text() == rows[2] + '{"step": 4, "lo\n'
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [0]
    assert (side / "rollouts" / "step-000003.jsonl").read_text() == "rollouts of 3\n"
    assert set_aside_after(run, 2) == ({}, None)  # nothing after step 2 any more: nothing moved, no folder made
    with (run / "metrics.jsonl").open("a") as f:
        f.write(rows[2])  # step 3 recorded again, then lost again
    _, again = set_aside_after(run, 2)
    assert again != side and again.parent == side.parent and (side / "metrics.jsonl").read_text().startswith(rows[2])

    before = checksums(run)
    first = move_aside(run)
    assert checksums(first) == before and sorted(p.name for p in run.iterdir()) == ["events.jsonl", first.name]
    (run / "metrics.jsonl").write_text(rows[0])
    second = move_aside(run)  # the first restart's folder stays where it is
    assert second != first and first.is_dir() and (second / "metrics.jsonl").read_text() == rows[0]
    assert [e["event"] for e in read_jsonl(second / "events.jsonl")] == ["restarted"]
    assert read_jsonl(run / "events.jsonl")[0]["previous_last_step"] == 1


def test_the_mlp_drafter_is_in_the_checkpoint_and_a_resume_continues_it(tiny_model_dir, tmp_path):
    """``engine.speculative.method: mlp`` in the in-process engine: each checkpoint has the drafter
    beside it (``step-N.drafter.pt``), and a resumed run's engine continues from it (its rounds go
    on counting, an untrained drafter would start again from 0)."""
    run = tmp_path / "run"
    mlp = {"engine.speculative.method": "mlp", "engine.speculative.train_every_tokens": 16, "engine.speculative.train_steps": 2,
           "engine.deterministic": False, "train.save_every": 1}
    config = tmp_path / "mlp.yaml"
    config.write_text("name: mlp\n")
    assert main(["train", str(config), *rl_args(tiny_model_dir, **{**mlp, "train.max_steps": 2}), "--run-dir", str(run), "--no-progress"]) == 0
    saved = torch.load(run / "checkpoints" / "step-000002.drafter.pt", weights_only=True)
    assert saved["kind"] == "mlp" and saved["rounds"] >= 2 and saved["steps"] > 0
    assert main(["train", "--resume", str(run), "--train.max_steps", "3", "--no-progress"]) == 0
    resumed = torch.load(run / "checkpoints" / "step-000003.drafter.pt", weights_only=True)
    assert resumed["rounds"] > saved["rounds"] and resumed["steps"] > saved["steps"]
    assert "rollout/spec_drafter_loss" in read_jsonl(run / "metrics.jsonl")[-1]
