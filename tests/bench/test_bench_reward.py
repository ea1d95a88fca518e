"""``noria bench reward`` on the tiny model (policy and judge): the JSON shape and the counts that
do not depend on the clock. Timings are never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from noria.bench import parse_bench_args

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_bench_reward_json(tiny_model_dir, tmp_path):
    path = tmp_path / "reward.json"
    module, args = parse_bench_args("reward", [
        "--model", str(tiny_model_dir), "--groups", "2", "--n-samples", "2", "--max-new-tokens", "6", "--judge-tokens", "4",
        "--rows", "4", "--repeats", "1", "--json", str(path),
    ])  # fmt: skip
    assert module.main(args) == 0
    doc = json.loads(path.read_text())
    rows = {r["case"]: r for r in doc["results"]}
    assert doc["benchmark"] == "reward"
    assert list(rows) == ["judge_batched", "judge_one_at_a_time", "rule", "judge_each", "judge_group", "judge_shared"]
    for case in ("judge_batched", "judge_one_at_a_time"):  # every row answered: scored, or a verdict that did not parse
        assert rows[case]["scored"] + sum(rows[case]["failed"].values()) == 4 and rows[case]["noria"] > 0
    assert rows["rule"]["vs_rule"] == 1.0 and rows["rule"]["scored"] == 4 and rows["rule"]["failed"] == 0
    for case in ("judge_each", "judge_group", "judge_shared"):
        assert rows[case]["scored"] + rows[case]["failed"] == 4 and rows[case]["latency_p50_s"] is not None
    assert rows["judge_group"]["reward_hidden_s"] == 0  # scored once the group was done: nothing hidden



def test_bench_reward_whole_steps(tiny_model_dir, tmp_path):
    """A whole-step case: a real `noria train` run, fully async, the policy's engine a process of its own.
    (The judge cases need a judge that answers with a number: the tiny random model replies nothing.)"""
    from noria.bench.reward import whole_steps

    rows = whole_steps(str(tiny_model_dir), str(tiny_model_dir), steps=3, staleness=1, work_dir=str(tmp_path), cases=("steps_rule",),
                       rounds=2)  # fmt: skip
    assert [r["case"] for r in rows] == ["steps_rule"] and rows[0]["vs_rule"] == 1.0 and len(rows[0]["rounds_s"]) == 2
    assert rows[0]["steps"] == 2 and rows[0]["noria"] > 0 and rows[0]["latency_p50_s"] is None  # the first step is not timed
    assert rows[0]["noria"] == pytest.approx(sum(rows[0]["rounds_s"]) / 2, abs=1e-3)  # the median of two
    for r in (1, 2):
        assert yaml.safe_load((tmp_path / f"steps_rule-{r}" / "config.yaml").read_text())["rollout"]["max_staleness"] == 1


def test_bench_reward_judge_is_the_judge_example():
    """The whole-step judge is examples/grpo_smollm2_judge.yaml's, as the bench's docs say."""
    from noria.bench.reward import step_config
    from noria.config import RunConfig, load

    example = load(RunConfig, str(EXAMPLES / "grpo_smollm2_judge.yaml"), [])
    bench = step_config("smollm2-135m-instruct", "smollm2-135m-instruct", 4, 2)["reward"]
    assert bench["rule_weight"] == example.reward.rule_weight == 0.0
    for key, value in bench["model"].items():
        assert getattr(example.reward.model, key) == value, key
