"""``noria.train`` / ``noria.Engine`` / the reward registry from Python (noria.launch.api): the same
config as the CLI, datasets as lists of dicts, ``datasets.Dataset`` or files, TRL-signature reward
functions (importable ones saved by import path, others registered in process), and one real run of
the tiny model through ``noria.train`` with an in-process reward."""

from __future__ import annotations

import json

import pytest
import yaml

import noria
from noria.config import load_config, to_dict
from noria.errors import NoriaError
from noria.launch.api import RewardSum, build_config, reward_name

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": a % 2} for a in range(6) for b in range(4)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NORIA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_import_noria_stays_cheap_and_the_api_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, noria; assert 'torch' not in sys.modules; assert 'train' in dir(noria); noria.Engine\n"
        # noria.train is also the trainer's package: imported first, it stays the package and callable
        "import noria.train.packing as packing; from noria.train import pack_groups\n"
        "assert noria.train is sys.modules['noria.train'] and callable(noria.train) and noria.train.packing is packing\n"
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert noria.get_reward("numeric") is noria.REWARDS["numeric"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        noria.nope  # noqa: B018


def test_the_api_builds_the_config_the_cli_builds(home):
    cli = load_config("examples/grpo_tiny.yaml", ["--train.max_steps", "3", "--rollout.n_samples", "4", "--seed", "7"])
    api = build_config(config="examples/grpo_tiny.yaml", rollout={"n_samples": 4}, seed=7, **{"train.max_steps": 3})
    assert to_dict(api) == to_dict(cli)
    with open("examples/grpo_tiny.yaml") as f:
        as_dict = build_config(config=yaml.safe_load(f), model="tiny-llama", **{"train.max_steps": 3, "rollout.n_samples": 4, "seed": 7})
    assert to_dict(as_dict) == to_dict(cli)
    with pytest.raises(NoriaError, match="train.max_stepz"):  # the CLI's closed keys: a typo names the closest key
        build_config(config="examples/grpo_tiny.yaml", **{"train.max_stepz": 3})


def test_rows_become_a_content_named_jsonl_whose_columns_all_reach_the_reward(home):
    import datasets

    cfg = build_config(model="m", dataset=ROWS, reward_funcs=["exact_match"])
    path = cfg.data.path
    assert path.startswith(str(home / "datasets")) and path.endswith(".jsonl") and cfg.data.task is None
    assert [json.loads(line) for line in open(path)] == ROWS
    assert cfg.data.label_key is None and cfg.data.metadata_keys == ["answer", "level"]
    again = build_config(model="m", dataset=datasets.Dataset.from_list(ROWS), reward_funcs=["exact_match"])
    assert again.data.path == path  # the same rows, the same file
    labelled = build_config(model="m", dataset=[{"prompt": "p", "label": "1", "x": 2}], reward_funcs=["exact_match"])
    assert labelled.data.label_key == "label" and labelled.data.metadata_keys == ["x"]
    kept = build_config(model="m", dataset=ROWS, reward_funcs=["exact_match"], **{"data.label_key": "answer"})
    assert kept.data.label_key == "answer" and kept.data.metadata_keys == ["level"]
    from_file = build_config(model="m", dataset="examples/own_data/prompts.jsonl", reward_funcs=["exact_match"])
    assert from_file.data.path == "examples/own_data/prompts.jsonl"
    held_out = build_config(model="m", dataset=ROWS, eval_dataset=ROWS[:3], reward_funcs=["exact_match"])
    assert held_out.data.path == path and [json.loads(line) for line in open(held_out.data.test_path)] == ROWS[:3]


def test_a_dataset_replaces_the_task_and_reward_funcs_the_reward_and_its_kwargs(home):
    tiny = build_config(config="examples/grpo_tiny.yaml")
    assert tiny.data.task == "arithmetic" and tiny.reward.kwargs == {"boxed": True}
    cfg = build_config(config="examples/grpo_tiny.yaml", dataset=ROWS, reward_funcs=["numeric"], **{"eval.every": 0})
    assert cfg.data.task is None and cfg.data.task_args == {} and cfg.reward.name == "numeric" and cfg.reward.kwargs == {}
    kept = build_config(config="examples/grpo_tiny.yaml", reward_funcs=["exact_match"], reward={"kwargs": {"boxed": False}})
    assert kept.reward.kwargs == {"boxed": False} and kept.data.task == "arithmetic"
    same = build_config(config="examples/grpo_tiny.yaml", reward_funcs=["exact_match"])  # the same reward keeps its kwargs
    assert same.reward.kwargs == {"boxed": True}
    chats = [{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}]
    sft = build_config(config="examples/sft_tiny.yaml", dataset=chats)
    assert sft.train.algorithm == "sft" and [json.loads(line) for line in open(sft.data.path)] == chats


@pytest.mark.parametrize(
    ("dataset", "words"),
    [
        ([{"prompt": "a"}, "b"], "row 1 is a str"),
        ([{"question": "a"}], "no 'prompt' column"),
        ([{"prompt": "a", "when": object()}], "row 0, column 'when': not JSON"),
        ([], "no rows"),
        (42, "expected a file path, a list of dicts or a datasets.Dataset"),
    ],
)
def test_bad_rows_are_named(home, dataset, words):
    with pytest.raises(NoriaError, match=words):
        build_config(model="m", dataset=dataset, reward_funcs=["exact_match"])


def test_a_dataset_dict_asks_for_a_split(home):
    import datasets

    both = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(NoriaError, match=r"several splits \(train, test\); pass one, e.g. dataset\['train'\]"):
        build_config(model="m", dataset=both, reward_funcs=["exact_match"])


def test_importable_rewards_are_saved_by_import_path_others_registered_in_process():
    import trl_rewards

    assert reward_name([trl_rewards.reward_len]) == "trl_rewards:reward_len"
    assert reward_name("numeric") == "numeric"

    def shorter(completions, **kwargs):
        return [-len(c) for c in completions]

    assert reward_name(shorter) == "shorter" and noria.get_reward("shorter") is shorter

    def shorter(completions, **kwargs):  # noqa: F811 -- a notebook cell run again replaces its own registration
        return [-2 * len(c) for c in completions]

    assert reward_name(shorter) == "shorter" and noria.get_reward("shorter") is shorter

    def numeric(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(NoriaError, match="'numeric' is already registered"):
        reward_name(numeric)

    def wrong(a, b):
        return 0.0

    with pytest.raises(NoriaError, match="reward_funcs"):
        reward_name(wrong)


def test_several_rewards_are_summed_with_weights():
    import trl_rewards

    name = reward_name([trl_rewards.reward_len, trl_rewards.reward_func], reward_weights=[0.5, 2.0])
    total = noria.get_reward(name)
    assert isinstance(total, RewardSum) and name == "sum(0.5*reward_len,2*reward_func)"
    completions = ["\\boxed{4}", "x" * 20]
    assert total(completions=completions, ground_truth=["4", "5"]) == [0.5 * -11 + 2.0, 0.0]
    with pytest.raises(NoriaError, match="3 weights for 2 reward functions"):
        reward_name([trl_rewards.reward_len, trl_rewards.reward_func], reward_weights=[1, 2, 3])
    with pytest.raises(NoriaError, match="per-sample form"):
        reward_name([trl_rewards.reward_len, "exact_match"])


def test_engine_generates_what_the_underlying_engine_generates(tiny_model_dir):
    from noria.data.chat import render_prompt
    from noria.engine import GenerateRequest, SamplingParams
    from noria.types import Prompt

    prompts = ["What is 3 + 4?", [{"role": "user", "content": "What is 5 + 1?"}]]
    with noria.Engine(tiny_model_dir, dtype="float32", kv_cache_tokens=2048) as engine:
        texts = engine.generate(prompts, max_new_tokens=6, temperature=0.0)
        ids = render_prompt(Prompt(prompt=prompts[0]), engine.tokenizer)
        out = engine.engine.generate_batch([GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=6, temperature=0.0))])
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert texts[0] == engine.tokenizer.decode(out[0].output_ids, skip_special_tokens=True)
    with pytest.raises(NoriaError, match="engine.kv_cache_tokenz"):
        noria.Engine(tiny_model_dir, kv_cache_tokenz=1)


def test_train_runs_the_tiny_model_with_an_in_process_reward(tiny_model_dir, tmp_path, home):
    calls = []

    def names_the_sum(completions, answer, level, **kwargs):  # TRL's signature: columns arrive by name
        values = [float(len(c) % 3) for c in completions]
        calls.append((list(answer), list(level), values))
        return values

    run = noria.train(
        model=tiny_model_dir, dataset=ROWS, reward_funcs=[names_the_sum], run_dir=tmp_path / "run", progress=False,
        rollout={"n_samples": 2, "prompts_per_step": 2, "max_new_tokens": 4}, **{"train.max_steps": 1, "engine.kv_cache_tokens": 2048},
    )
    assert run == tmp_path / "run"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["reward"]["name"] == "names_the_sum" and saved["data"]["metadata_keys"] == ["answer", "level"]
    assert saved["model"]["path"] == str(tiny_model_dir) and saved["train"]["max_steps"] == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["reward/scored"] == 4
    returned = [v for _, _, values in calls for v in values]  # one call per group of samples
    assert len(returned) == 4 and rows[0]["rollout/reward_mean"] == pytest.approx(sum(returned) / 4)
    for answers, levels, _ in calls:
        assert len(set(answers)) == 1 and any(r["answer"] == answers[0] and r["level"] == levels[0] for r in ROWS)
    # resumed with its own saved config, the in-process reward passed again, and extended by a step
    calls.clear()
    again = noria.train(resume=run, reward_funcs=[names_the_sum], progress=False, **{"train.max_steps": 2})
    assert again == run and len(calls) == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
