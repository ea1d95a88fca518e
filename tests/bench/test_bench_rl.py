"""`noria bench rl` on the tiny model: both sides run 2 steps and the JSON has the benchmark shape (docs/architecture.md).

CPU, subprocesses (noria train, the TRL worker when trl is importable, one eval worker). The reward
is the tests' ``toy_rewards:digits`` so that a random model's groups differ and Noria really trains.
No timing or accuracy assertions: the figures of a tiny model on a shared machine mean nothing.
"""

import importlib.util
import json
import os

import pytest

from noria.bench import rl as bench_rl
from repo_util import TESTS

HAS_TRL = importlib.util.find_spec("trl") is not None


def test_bench_rl_writes_the_json_shape(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    peers = ["trl"] if HAS_TRL else []
    out = tmp_path / "rl.json"
    results = bench_rl.run(str(tiny_model_dir), steps=2, prompts_per_step=2, n_samples=4, max_new_tokens=8, lr=1e-3,
                           eval_limit=8, json_path=str(out), peers=peers, reward="toy_rewards:digits",
                           work_dir=str(tmp_path / "work"),
                           task_args={"n_train": 64, "n_test": 16, "max_operand": 30, "ops": ["+"]})
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "rl" and {"command", "date", "machine"} <= set(doc)
    assert doc["results"] == results
    assert [r["metric"] for r in results] == ["step_s", "total_s", "run_s", "accuracy", "train_reward"]
    for row in results:
        assert "steps=2" in row["case"] and set(row["peers"]) == set(peers) and row["bound"] is None
    step_s, total_s, run_s, accuracy, _ = results
    assert all(len(v) == 2 for v in step_s["steps_s"].values()) and set(step_s["steps_s"]) == {"noria", *peers}
    assert 0 < step_s["noria"] <= total_s["noria"] < run_s["noria"]
    assert all(0 < step_s["peers"][p] <= total_s["peers"][p] < run_s["peers"][p] for p in peers)
    assert 0 <= accuracy["base"] <= 1 and 0 <= accuracy["noria"] <= 1
    assert all(0 <= v <= 1 for v in accuracy["peers"].values())
    assert (tmp_path / "work" / "noria" / "final").is_dir()


@pytest.mark.skipif(not HAS_TRL, reason="trl not installed")
def test_trl_sees_noria_prompts_in_noria_order(tmp_path, tiny_model_dir):
    from noria.config import load_config
    from noria.data import PromptSource, load_prompts

    settings = {"steps": 2, "prompts_per_step": 3, "n_samples": 2, "max_new_tokens": 4, "lr": 1e-3, "temperature": 1.0}
    path = bench_rl.write_config(tmp_path / "c.yaml", tiny_model_dir, settings, "numeric", 4, None)
    config = load_config(path)
    rows = bench_rl.trl_rows(config, settings)
    expected = PromptSource.from_config(load_prompts(config.data, "train"), config.data).next_batch(6)
    assert [r["prompt"][-1]["content"] for r in rows] == [p.prompt for p in expected]
    reward = bench_rl.trl_reward(config)
    label = rows[0]["label"]
    assert reward([[{"role": "assistant", "content": f"= {json.loads(label)}"}], "no number"], [label] * 2, ["{}"] * 2) == [1.0, 0.0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        bench_rl.run("unused", peers=["openrlhf"])
    with pytest.raises(ValueError, match="n_samples"):
        bench_rl.run("unused", n_samples=1, peers=[])


def test_engine_peers_change_only_the_rollout_engine(tmp_path, tiny_model_dir):
    """`--peers vllm,noria_serve` rerun Noria's own config with another rollout engine and nothing else."""
    import yaml

    settings = {"steps": 2, "prompts_per_step": 3, "n_samples": 2, "max_new_tokens": 4, "lr": 1e-3, "temperature": 1.0}
    path = bench_rl.write_config(tmp_path / "c.yaml", tiny_model_dir, settings, "numeric", 4, None)
    base = yaml.safe_load(path.read_text())
    for peer, changes in bench_rl.ENGINE_PEERS.items():
        variant = yaml.safe_load(bench_rl.engine_config(path, peer).read_text())
        assert {k: v for k, v in variant.items() if k not in changes} == {k: v for k, v in base.items() if k not in changes}
        assert variant["rollout"] == {**base["rollout"], **changes["rollout"]} and variant["sync"] == changes["sync"]
