"""`noria bench learn` on the tiny model: the JSON shape and curves of a 2-step run (the shipped
recipe, and TRL when it is importable), a rerun that keeps the systems already written, and the
time-to-threshold logic as a pure function.

CPU, subprocesses (noria train; the TRL worker). The reward is the tests' ``toy_rewards:digits`` so
that a random model's groups differ and the runs really train. No timing or accuracy assertions:
the figures of a tiny model on a shared machine mean nothing.
"""

import importlib.util
import json
import os

import pytest

from noria.bench import learn
from noria.bench import learn_systems
from noria.metric_names import undocumented
from repo_util import TESTS

HAS_TRL = importlib.util.find_spec("trl") is not None
TINY = {"prompts_per_step": 2, "n_samples": 4, "max_new_tokens": 8, "lr": 1e-3, "reward": "toy_rewards:digits",
        "task_args": {"n_train": 64, "n_test": 16, "max_operand": 30, "ops": ["+"]}}


def point(step, seconds, tokens, accuracy):
    return {"step": step, "train_seconds": seconds, "trained_tokens": tokens, "accuracy": accuracy}


def test_first_reach_is_the_first_evaluation_at_or_above_the_threshold():
    curve = [point(4, 120.0, 400, 0.55), point(0, 0.0, 0, 0.3), point(8, 240.0, 800, 0.72), point(12, 360.0, 1200, 0.65)]
    assert learn.first_reach(curve, 0.3) == {"step": 0, "train_minutes": 0.0, "trained_tokens": 0}
    assert learn.first_reach(curve, 0.5) == {"step": 4, "train_minutes": 2.0, "trained_tokens": 400}
    assert learn.first_reach(curve, 0.6) == {"step": 8, "train_minutes": 4.0, "trained_tokens": 800}
    assert learn.first_reach(curve, 0.72) == {"step": 8, "train_minutes": 4.0, "trained_tokens": 800}
    assert learn.first_reach(curve, 0.8) is None
    assert learn.first_reach([point(0, 0.0, 0, None)], 0.1) is None
    assert learn.reached(curve, [0.5, 0.9]) == {"0.5": learn.first_reach(curve, 0.5), "0.9": None}


def test_noria_curve_sums_step_seconds_and_tokens_up_to_each_evaluation():
    steps = [{"step": i, "seconds": 2.0 * i, "rollout/trained_tokens": 10.0 * i} for i in (1, 2, 3)]
    evals = [{"step": 0, "accuracy": 0.1, "seconds": 5.0}, {"step": 2, "skipped": "export failed"},
             {"step": 3, "accuracy": 0.4, "seconds": 4.0}]
    assert learn_systems.noria_curve(steps, evals) == [
        {"step": 0, "train_seconds": 0.0, "trained_tokens": 0, "accuracy": 0.1, "eval_seconds": 5.0},
        {"step": 3, "train_seconds": 12.0, "trained_tokens": 60, "accuracy": 0.4, "eval_seconds": 4.0}]
    assert not learn_systems.stop_due(steps, evals, None)
    assert learn_systems.stop_due(steps, evals, 6.0)  # the clock reaches 6 s at step 2; step 3 was evaluated
    assert not learn_systems.stop_due(steps, evals[:2], 6.0)  # step 2's evaluation was skipped: wait for the next
    assert not learn_systems.stop_due(steps, evals, 13.0)  # never reached


def test_an_interrupted_system_keeps_the_evaluations_it_made(tmp_path):
    trl, noria = tmp_path / "trl", tmp_path / "sync"
    trl.mkdir(), noria.mkdir()
    points = [point(0, 0.0, 0, 0.25), point(2, 100.0, 900, 0.4)]
    (trl / learn_systems.CURVE_FILE).write_text("".join(json.dumps(p) + "\n" for p in points) + '{"step": 4, "tr')
    assert learn_systems.partial("trl", trl) == {"curve": points, "steps": 2, "train_seconds": 100.0, "skipped_evals": 0}
    (noria / "metrics.jsonl").write_text(json.dumps({"step": 1, "seconds": 3.0, "rollout/trained_tokens": 50.0}) + "\n")
    (noria / "eval.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.25, "seconds": 1.0}) + "\n")
    got = learn_systems.partial("sync", noria)
    assert got["steps"] == 1 and got["train_seconds"] == 3.0 and [p["step"] for p in got["curve"]] == [0]
    assert learn_systems.partial("trl", tmp_path / "missing")["curve"] == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="known"):
        learn.parse_list("shipped,openrlhf", learn.SYSTEMS, "--systems")
    with pytest.raises(ValueError, match="thresholds"):
        learn.parse_thresholds("0.5,80")
    assert learn.parse_thresholds("0.7, 0.5") == [0.5, 0.7]


def test_bench_learn_writes_curves_and_keeps_earlier_systems(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "learn.json"
    kwargs = {"model": str(tiny_model_dir), "steps": 2, "eval_every": 1, "eval_limit": 8, "thresholds": [0.5, 1.0],
              "json_path": str(out), "overrides": TINY}
    learn.run(["shipped"], work_dir=str(tmp_path / "work"), **kwargs)
    first = json.loads(out.read_text())
    peers = ["trl"] if HAS_TRL else ["curriculum"]  # without TRL: the recipe with difficulty pools, end to end
    doc = learn.run(peers, work_dir=str(tmp_path / "again"), **kwargs)
    written = json.loads(out.read_text())
    assert written["benchmark"] == "learn" and {"command", "date", "machine", "cpu", "settings"} <= set(written)
    assert set(written["systems"]) == {"shipped", *peers} == set(doc["systems"])
    # the rerun of another system kept the shipped curve as it was
    assert written["systems"]["shipped"]["curve"] == first["systems"]["shipped"]["curve"]
    if not HAS_TRL:  # the pools' figures are on each step's line, documented
        rows = [json.loads(line) for line in (tmp_path / "again" / "curriculum" / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all({"curriculum/easy_pool", "curriculum/revisits"} <= set(r) for r in rows)
        assert undocumented(k for r in rows for k in r) == []
    for name, system in written["systems"].items():
        curve = system["curve"]
        assert [p["step"] for p in curve] == [0, 1, 2] and system["steps"] == 2, name
        assert curve[0]["train_seconds"] == 0 and curve[0]["trained_tokens"] == 0
        assert 0 < curve[1]["train_seconds"] < curve[2]["train_seconds"] <= system["train_seconds"] + 1e-3
        assert 0 < curve[1]["trained_tokens"] <= 2 * 4 * 8 < curve[2]["trained_tokens"] <= 2 * 2 * 4 * 8
        assert all(0 <= p["accuracy"] <= 1 and p["eval_seconds"] > 0 for p in curve)
        assert system["reached"] == learn.reached(curve, [0.5, 1.0])
        if name != "trl":  # each step's rollout/trainer mismatch, and their mean in the rows
            assert [m["step"] for m in system["mismatch"]] == [1, 2] and all(m["rollout_kl"] >= 0 for m in system["mismatch"])
            assert learn.mean_mismatch(system) == sum(m["rollout_kl"] for m in system["mismatch"]) / 2
    rows = {r["metric"]: r for r in written["results"]}
    assert set(rows) == {"train_minutes_to_0.5", "trained_tokens_to_0.5", "train_minutes_to_1", "trained_tokens_to_1",
                         "final_accuracy", "train_minutes", "mean_rollout_kl"}
    assert rows["final_accuracy"]["noria"] == written["systems"]["shipped"]["curve"][-1]["accuracy"]
    assert set(rows["train_minutes"]["peers"]) == set(peers)
    assert out.with_suffix(".png").stat().st_size > 1000
    with pytest.raises(ValueError, match="other settings.*steps"):
        learn.run(["shipped"], **{**kwargs, "steps": 3})


def test_each_recipe_variant_is_the_recipe_with_its_one_setting_and_loads(tmp_path):
    from noria.config import load_config

    s = {**learn_systems.recipe_settings(learn_systems.RECIPE), "steps": 8, "eval_every": 4, "eval_limit": 20}
    configs = {v: learn_systems.system_config(v, learn_systems.RECIPE, tmp_path, s) for v in learn_systems.RECIPE_VARIANTS}
    loaded = {v: load_config(learn_systems.write(c, tmp_path / f"{v}.yaml")) for v, c in configs.items()}
    shipped = loaded["shipped"]
    assert shipped.reward.overlong_buffer_tokens == 0 and not shipped.data.curriculum.enabled
    assert loaded["overlong"].reward.overlong_buffer_tokens == s["max_new_tokens"] // 4 > 0
    assert loaded["overlong"].reward.overlong_penalty == 1.0
    assert loaded["curriculum"].data.curriculum.enabled
    assert loaded["dynamic"].rollout.buffer.filters == ["zero_reward_variance"]
    assert shipped.engine.quantization == "none" and shipped.train.qat == "none" and shipped.train.loss.off_policy != "tis"
    assert (loaded["int8"].engine.quantization, loaded["int8"].train.loss.off_policy, loaded["int8"].train.qat) == ("int8", "tis", "none")
    assert (loaded["int4_qat"].engine.quantization, loaded["int4_qat"].train.qat) == ("int4", "int4")
    sections = {"overlong": {"reward"}, "curriculum": {"data"}, "dynamic": {"rollout"}, "int8": {"engine", "train"},
                "int4_qat": {"engine", "train"}}
    for variant, config in configs.items():  # nothing else differs from the shipped run's config
        changed = {k for k in config if config[k] != configs["shipped"].get(k)}
        assert changed <= {"name", *sections.get(variant, ())}, (variant, changed)
    assert configs["int8"]["train"]["optim"] == configs["shipped"]["train"]["optim"]
