"""``data.path: Org/Name`` and local ``datasets`` folders through the datasets library: a real
``datasets.Dataset`` written as a hub repo (Parquet files per split, as the hub serves them, and a
``save_to_disk`` folder) into a real huggingface_hub cache, read with HF_HUB_OFFLINE=1 in a fresh
interpreter; splits, subsets and column mapping come from the config's data section."""

from __future__ import annotations

import json

import pytest
import yaml

from hub_util import cache_repo, run_python

ROWS = {
    "train": [{"question": f"What is {a} + 1?", "answer": str(a + 1), "level": a % 3} for a in range(6)],
    "test": [{"question": f"What is {a} + 2?", "answer": str(a + 2), "level": 0} for a in range(3)],
}


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    import datasets

    home, src = tmp_path_factory.mktemp("hf-home"), tmp_path_factory.mktemp("repos")
    parquet = src / "parquet"
    for split, rows in ROWS.items():  # the layout the hub serves: data/<split>-00000-of-00001.parquet
        (parquet / "data").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(parquet / "data" / f"{split}-00000-of-00001.parquet"))
    saved = src / "saved"
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in ROWS.items()}).save_to_disk(str(saved))
    commit = cache_repo(home, "noria-test/add-one", parquet, "dataset", refs=("main", "v1"))
    cache_repo(home, "noria-test/add-one-saved", saved, "dataset")
    return home, commit, saved


LOAD = """
import json
from noria.config import load_config
from noria.data import load_prompts
out = []
for overrides, split in CASES:
    cfg = load_config(None, ["--model.path", "m", "--reward.name", "exact_match", *overrides])
    out.append([[p.prompt, p.label, p.metadata, p.source] for p in load_prompts(cfg.data, split)])
print(json.dumps(out))
"""


def _load(home, cases):
    proc = run_python(LOAD.replace("CASES", repr(cases)), home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_org_name_dataset_resolves_from_the_cache_offline(hub_home):
    home, commit, saved = hub_home
    columns = ["--data.prompt_key", "question", "--data.label_key", "answer", "--data.metadata_keys", "[level]"]
    cases = [
        (["--data.path", "noria-test/add-one", *columns], "train"),
        (["--data.path", "noria-test/add-one", "--data.test_path", f"noria-test/add-one@{commit}", *columns], "test"),
        (["--data.path", "noria-test/add-one@v1", "--data.split", "test", *columns], "train"),
        (["--data.path", "noria-test/add-one-saved", *columns], "train"),
        (["--data.path", str(saved), "--data.split", "test", *columns], "train"),
    ]
    out = _load(home, cases)
    want = {s: [[r["question"], r["answer"], {"level": r["level"]}] for r in rows] for s, rows in ROWS.items()}
    assert [row[:3] for row in out[0]] == want["train"]
    assert [row[:3] for row in out[1]] == want["test"]
    assert [row[:3] for row in out[2]] == want["test"]
    assert [row[:3] for row in out[3]] == want["train"]
    assert [row[:3] for row in out[4]] == want["test"]
    assert out[0][0][3] == "noria-test/add-one" and out[4][0][3] == str(saved)


def test_a_missing_split_or_column_names_it(hub_home):
    home, _, saved = hub_home
    code = """
from noria.config import load_config
from noria.data import load_prompts
for overrides in (["--data.path", "noria-test/add-one", "--data.split", "validation"],
                  ["--data.path", "noria-test/add-one", "--data.prompt_key", "question"],
                  ["--data.path", "SAVED", "--data.split", "validation"],
                  ["--data.path", "noria-test/absent"]):
    cfg = load_config(None, ["--model.path", "m", "--reward.name", "exact_match", *overrides])
    try:
        load_prompts(cfg.data, "train")
    except Exception as e:
        print("ERROR", type(e).__name__, e)
""".replace("SAVED", str(saved))
    proc = run_python(code, home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 4, proc.stdout
    assert "DataError" in errors[0] and "validation" in errors[0] and "train" in errors[0]
    assert "DataError" in errors[1] and "row 1" in errors[1] and "field 'label' is missing" in errors[1]
    assert "DataError" in errors[2] and "has no split 'validation'" in errors[2] and "train, test" in errors[2]
    assert "HubError" in errors[3] and "repo_type='dataset'" in errors[3] and "HF_HUB_OFFLINE=1" in errors[3]
    assert "data.path: DIR" in errors[3] and "--repo-type dataset" in errors[3]


def test_a_missing_data_file_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    from noria.data.hub import is_hub_dataset
    from noria.data.source import DataError, read_prompt_file

    monkeypatch.chdir(tmp_path)
    assert is_hub_dataset("org/name") and is_hub_dataset("org/name@v1") and not is_hub_dataset("data/train.jsonl")
    with pytest.raises(DataError, match="data file not found: data/train.jsonl"):
        read_prompt_file("data/train.jsonl")


def test_a_run_trains_from_a_hub_model_and_a_hub_dataset_offline(hub_home, tiny_model_dir, tmp_path):
    home, _, _ = hub_home
    cache_repo(home, "noria-test/tiny-llama", tiny_model_dir, refs=("main", "v1"))
    run = tmp_path / "run"
    code = f"""
import noria
print(noria.train(model="noria-test/tiny-llama@v1", dataset="noria-test/add-one", reward_funcs=["exact_match"],
                  run_dir={str(run)!r}, progress=False, data={{"prompt_key": "question", "label_key": "answer"}},
                  rollout={{"n_samples": 2, "prompts_per_step": 2, "max_new_tokens": 4}},
                  **{{"train.max_steps": 1, "engine.kv_cache_tokens": 2048}}))
"""
    proc = run_python(code, home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["path"] == "noria-test/tiny-llama@v1" and saved["data"]["path"] == "noria-test/add-one"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["reward/scored"] == 4
