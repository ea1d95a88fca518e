"""``model.path: Org/Name`` through huggingface_hub: resolved from a real cache with HF_HUB_OFFLINE=1,
pinned by revision, and refused with an error that says what was tried when the hub cannot answer.

Each test runs its resolution in a fresh interpreter with HF_HOME / HF_HUB_OFFLINE set, as a user
sets them (huggingface_hub reads them at import); the cache is written in huggingface_hub's own
layout (tests/hub_util.py), from the tiny model of the ``tiny_model_dir`` fixture.
"""

from __future__ import annotations

import json

import pytest

from hub_util import cache_repo, run_python

RESOLVE = """
import json
from noria.models.catalog import model_path
from noria.models.checkpoint import read_config
from transformers import AutoTokenizer
out = {}
for value in VALUES:
    folder = model_path(value)
    out[value] = [str(folder), read_config(folder)["model_type"], len(AutoTokenizer.from_pretrained(str(folder)))]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("hf-home")
    commit = cache_repo(home, "noria-test/tiny-llama", tiny_model_dir, refs=("main", "v1"))
    return home, commit


def test_an_org_name_model_resolves_from_the_cache_offline_with_its_revision_pins(hub_home, tiny_model_dir):
    home, commit = hub_home
    values = ["noria-test/tiny-llama", "noria-test/tiny-llama@v1", f"noria-test/tiny-llama@{commit}"]
    proc = run_python(RESOLVE.replace("VALUES", repr(values)), home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    snapshot = home / "hub" / "models--noria-test--tiny-llama" / "snapshots" / commit
    tokens = len(json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"])
    for value in values:
        folder, model_type, vocab = out[value]
        assert folder == str(snapshot), value
        assert model_type == "llama" and vocab >= tokens


def test_an_unknown_revision_or_repo_says_what_was_tried_and_how_to_pass_a_folder(hub_home):
    home, _ = hub_home
    code = """
from noria.models.catalog import model_path
from noria.data.hub import HubError
for value in ("noria-test/tiny-llama@v2", "noria-test/absent"):
    try:
        model_path(value)
    except HubError as e:
        print("ERROR", e)
"""
    proc = run_python(code, home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2, proc.stdout
    for line, repo, revision in zip(errors, ("noria-test/tiny-llama", "noria-test/absent"), ("'v2'", "'main'")):
        assert f"snapshot_download('{repo}'" in line and f"revision={revision}" in line
        assert f"HF_HOME={home}" in line and "HF_HUB_OFFLINE=1" in line and str(home / "hub") in line
        assert "--local-dir DIR" in line and "model.path: DIR" in line


def test_an_unreachable_hub_is_named_in_the_error(tmp_path):
    # Online, with the endpoint on a closed loopback port: the request is refused at once, nothing is cached.
    code = """
from noria.models.catalog import model_path
try:
    model_path("noria-test/never-cached")
except Exception as e:
    print(type(e).__name__, e)
"""
    proc = run_python(code, tmp_path, offline=False, extra_env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("HubError"), proc.stdout
    assert "online (HF_HUB_OFFLINE=0): asked http://127.0.0.1:9" in proc.stdout and "Connection refused" in proc.stdout


def test_a_local_folder_named_like_a_hub_id_wins(tmp_path, monkeypatch):
    from noria.data.hub import is_hub_id, parse_hub_id

    assert parse_hub_id("Qwen/Qwen3-0.6B@main") == ("Qwen/Qwen3-0.6B", "main")
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert not is_hub_id("a/b/c") and not is_hub_id("/abs/path") and not is_hub_id("tiny-llama")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")
