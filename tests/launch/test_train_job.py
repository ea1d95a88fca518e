"""`noria train` (SFT) end to end on the tiny random model: run folder, resume, errors, FSDP2.

CPU only. The kill test runs the CLI in subprocesses (about 30 s); the FSDP2 test spawns two gloo
ranks (about 15 s); the rest run in process in a few seconds each.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from noria.cli import main
from noria.config import load_config
from noria.errors import NoriaError
from noria.launch.sft import run_sft as train
from repo_util import ROOT
from sft_util import CHATS, args_for, losses, write_chats

def test_sft_run_folder(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    config = load_config(None, args_for(tiny_model_dir, write_chats(tmp_path / "chats.jsonl")))
    run = train(config, run_dir=str(tmp_path / "run"), progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert {"step", "loss", "grad_norm", "lr", "tokens", "seconds"} <= set(rows[0])
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns (the same rows come back in epoch 2)
    # every save_every steps, and the last step's (train.save_final_state): what --resume extends it from
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004", "step-000005"]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["global_batch"] == 4 and saved["run_dir"] == str(run)
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model(torch.tensor([[1, 5, 9]])).logits.isfinite().all()


def test_final_model_is_evaluated_by_noria_eval(tmp_path, tiny_model_dir):
    config = load_config(None, args_for(tiny_model_dir, write_chats(tmp_path / "chats.jsonl"), **{"train.max_steps": 1}))
    run = train(config, run_dir=str(tmp_path / "run"), progress=False)
    eval_cfg = tmp_path / "eval.yaml"
    eval_cfg.write_text(yaml.safe_dump({"model": {"path": str(run / "final")}, "data": {"task": "arithmetic",
                        "task_args": {"n_train": 4, "n_test": 3}}, "eval": {"max_new_tokens": 4}}))
    assert main(["eval", str(eval_cfg), "--run-dir", str(tmp_path / "eval"), "--no-progress"]) == 0


def test_stopped_run_resumes_with_the_same_losses(tmp_path, tiny_model_dir):
    data = write_chats(tmp_path / "chats.jsonl")
    whole = train(load_config(None, args_for(tiny_model_dir, data)), run_dir=str(tmp_path / "whole"), progress=False)
    part = tmp_path / "part"
    stopped = {"train.max_steps": 3, "train.save_final_state": False}  # as a run killed after step 3 leaves it
    train(load_config(None, args_for(tiny_model_dir, data, **stopped)), run_dir=str(part), progress=False)
    # Step 3 ran after the last checkpoint (step 2): resuming repeats it from the restored cursor.
    train(load_config(None, args_for(tiny_model_dir, data)), resume=str(part), progress=False)
    assert losses(part) == losses(whole)
    (side,) = (part / "superseded").glob("after-step-2-*/metrics.jsonl")  # the first step 3's row, kept
    assert [json.loads(line)["step"] for line in side.read_text().splitlines()] == [3]
    for name in ("model.safetensors", "config.json"):
        assert (part / "final" / name).read_bytes() == (whole / "final" / name).read_bytes()


def _cli(model_dir, data, *extra) -> list[str]:
    return [sys.executable, "-m", "noria.cli", "train", "examples/sft_tiny.yaml", *args_for(
        model_dir, data, **{"train.save_every": 1, "data.epochs": 8}), *extra]


def test_killed_run_resumes_with_the_same_losses(tmp_path, tiny_model_dir):
    data = write_chats(tmp_path / "chats.jsonl")
    subprocess.run(_cli(tiny_model_dir, data, "--run-dir", str(tmp_path / "whole")), cwd=ROOT, check=True, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(tiny_model_dir, data, "--run-dir", str(killed)), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step-000003" / "COMMITTED").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "the run finished before it could be killed"
    subprocess.run(_cli(tiny_model_dir, data, "--resume", str(killed)), cwd=ROOT, check=True, capture_output=True)
    assert losses(killed) == losses(tmp_path / "whole") and len(losses(killed)) == 20


def test_bad_row_is_named_before_the_model_loads(tmp_path, tiny_model_dir, capsys):
    no_weights = tmp_path / "model"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CHATS[0]}) + "\n\n" + json.dumps({"text": "no messages"}) + "\n")
    assert main(["train", "examples/sft_tiny.yaml", *args_for(no_weights, data)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()  # the run's header line, then the one error line, no traceback
    assert lines[0].startswith("noria train: sft-tiny") and len(lines) == 2 and "Traceback" not in err
    assert f"{data}:3" in lines[1] and "messages" in lines[1]


def test_template_that_breaks_prefix_consistency_is_named(tmp_path, tiny_model_dir, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    (model / "chat_template.jinja").write_text(  # renders only the last two messages
        "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    data = write_chats(tmp_path / "chats.jsonl")
    assert main(["train", "examples/sft_tiny.yaml", *args_for(model, data)]) == 2
    err = capsys.readouterr().err
    assert f"{data}:1" in err and "prefix-consistent" in err


def test_train_cli_runs_rl_and_reports_bad_input_in_one_line(tmp_path, tiny_model_dir, capsys):
    data = write_chats(tmp_path / "chats.jsonl")  # chat rows have no "prompt" field: RL cannot read them
    code = main(["train", "examples/sft_tiny.yaml", "--model.path", str(tiny_model_dir), "--train.algorithm", "rl",
                 "--data.path", str(data), "--reward.name", "numeric", "--run-dir", str(tmp_path / "rl")])
    err = capsys.readouterr().err
    assert code == 2 and "chats.jsonl" in err and "Traceback" not in err


def test_run_folder_guards(tmp_path, tiny_model_dir):
    data = write_chats(tmp_path / "chats.jsonl")
    run = tmp_path / "run"
    train(load_config(None, args_for(tiny_model_dir, data, **{"train.max_steps": 2})), run_dir=str(run), progress=False)
    with pytest.raises(NoriaError, match="already holds a run"):
        train(load_config(None, args_for(tiny_model_dir, data)), run_dir=str(run), progress=False)
    with pytest.raises(NoriaError, match=r"train.global_batch: 4 -> 2"):
        train(load_config(None, args_for(tiny_model_dir, data, **{"train.global_batch": 2})), resume=str(run), progress=False)


def test_fsdp2_ranks_spawned_by_train_match_one_process(tmp_path, tiny_model_dir):
    data = write_chats(tmp_path / "chats.jsonl")
    fp32 = {"train.param_dtype": "float32", "train.max_steps": 3}
    single = train(load_config(None, args_for(tiny_model_dir, data, **fp32)), run_dir=str(tmp_path / "one"), progress=False)
    config = load_config(None, args_for(tiny_model_dir, data, **fp32, **{"train.backend": "fsdp2", "train.world_size": 2}))
    two = train(config, run_dir=str(tmp_path / "two"), progress=False)
    for (s1, l1), (s2, l2) in zip(losses(single), losses(two), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-4)
    assert (two / "final" / "model.safetensors").is_file()
    assert (two / "checkpoints" / "step-000002" / "COMMITTED").is_file()
