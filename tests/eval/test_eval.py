"""`noria eval` end to end on a real (tiny, random) model and a built-in task."""

import json
from pathlib import Path

import pytest
import yaml

from noria.cli import main
from noria.config import load_config
from noria.eval import run_eval


def _config(tmp_path, model_dir, **overrides):
    args = ["--model.path", str(model_dir), "--model.dtype", "float32", "--data.task", "arithmetic",
            "--data.task_args", "{n_train: 20, n_test: 12, seed: 1}", "--eval.max_new_tokens", "6",
            "--eval.batch_size", "5"]
    for key, value in overrides.items():
        args += [f"--{key}", value]
    return load_config(None, args)


def test_eval_writes_figures_and_samples(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir)
    result = run_eval(config, run_dir=str(tmp_path / "run"), progress=False)
    assert result.n_prompts == 12 and result.n_samples == 12
    assert result.n_scored + result.n_failed == 12
    assert result.accuracy is not None and 0.0 <= result.accuracy <= 1.0
    written = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert written["n_samples"] == 12 and written["accuracy"] == result.accuracy
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["status"] in ("completed", "truncated") for r in rows)
    assert all(r["response_tokens"] <= 6 for r in rows)
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert resolved["eval"]["max_new_tokens"] == 6 and resolved["reward"]["name"] is None


def test_eval_samples_several_answers_per_prompt(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, **{"eval.n_samples": "3", "eval.temperature": "1.0", "eval.limit": "4"})
    result = run_eval(config, run_dir=str(tmp_path / "run"), progress=False)
    assert result.n_prompts == 4 and result.n_samples == 12


def test_eval_whose_every_answer_failed_is_an_error(tmp_path, tiny_model_dir):
    from noria.errors import NoriaError

    config = _config(tmp_path, tiny_model_dir, **{"reward.name": "tests.reward_plugins:raises", "eval.limit": "3"})
    with pytest.raises(NoriaError, match="every one of the 3 answers failed.*checker crashed"):
        run_eval(config, run_dir=str(tmp_path / "run"), progress=False)
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["n_failed"] == 3  # written before failing


def test_failed_answers_count_as_wrong_and_are_reported(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, **{"reward.name": "tests.reward_plugins:fails_on_odd_labels"})
    result = run_eval(config, run_dir=str(tmp_path / "run"), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    odd = sum(int(r["label"]) % 2 for r in rows)
    assert 0 < odd < len(rows) and result.n_failed == odd and result.n_scored == len(rows) - odd
    assert result.accuracy == (len(rows) - odd) / len(rows)  # not 1.0: the failures count as wrong


def test_bad_data_fails_before_model_loads(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ok", "label": "1"}\n{"prompt": "", "label": "2"}\n')
    # The model folder does not exist: the data error must be reported first.
    code = main(["eval", "examples/eval_jsonl.yaml", "--model.path", str(tmp_path / "no-model"),
                 "--data.path", str(data), "--data.test_path", str(data), "--data.label_key", "label",
                 "--data.metadata_keys", "[]", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert str(data) in err and "line 2" in err and "prompt" in err
    assert "Traceback" not in err


def test_missing_model_folder_is_clear(tmp_path, capsys):
    code = main(["eval", "examples/eval_smollm2_arithmetic.yaml", "--model.path", str(tmp_path / "nowhere"),
                 "--run-dir", str(tmp_path / "run"), "--eval.limit", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "nowhere" in err and "Traceback" not in err


def test_all_prompts_too_long_is_an_error(tmp_path, tiny_model_dir):
    from noria.errors import NoriaError

    config = _config(tmp_path, tiny_model_dir, **{"data.max_prompt_tokens": "2"})
    with pytest.raises(NoriaError, match="no prompts left"):
        run_eval(config, run_dir=str(tmp_path / "run"), progress=False)


def test_transformers_path_gives_the_same_greedy_answers(tmp_path, tiny_model_dir):
    """Native models run on the built-in engine, others on transformers' generate: same answers."""
    engine = run_eval(_config(tmp_path, tiny_model_dir, **{"eval.limit": "4"}), run_dir=str(tmp_path / "a"), progress=False)
    hf = run_eval(_config(tmp_path, tiny_model_dir, **{"eval.limit": "4", "model.impl": "hf"}), run_dir=str(tmp_path / "b"), progress=False)
    rows = [[json.loads(x)["response"] for x in (tmp_path / d / "samples.jsonl").read_text().splitlines()] for d in "ab"]
    assert rows[0] == rows[1]
    assert engine.generated_tokens == hf.generated_tokens
