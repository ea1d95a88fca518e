"""``noria bench reward`` on the tiny model (policy and judge): the JSON shape and the counts that
do not depend on the clock. Timings are never asserted."""

from __future__ import annotations

import json

from noria.bench import parse_bench_args


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
