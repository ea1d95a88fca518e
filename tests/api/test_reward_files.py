"""``reward.name: path/to/file.py:fn``: a reward read from a file beside the user's data, with no
PYTHONPATH: relative to the working directory, imported once under its file name, its folder on
``sys.path`` for the modules beside it; a clash of names, a missing file or a broken file is a
``PluginError`` naming the key and the path."""

from __future__ import annotations

import sys

import pytest

from noria.plugins import PluginError, load_plugin


def test_a_reward_file_imports_with_the_module_beside_it(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "noria_test_helpers_abc.py").write_text("def scale(x):\n    return x / 10\n")
    (folder / "noria_test_reward_abc.py").write_text(
        "from noria_test_helpers_abc import scale\n\n"
        "def score(completions, answer, **kwargs):\n    return [scale(len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        fn = load_plugin("mine/noria_test_reward_abc.py:score", "reward.name")
        assert fn(completions=["abcd", "ab"], answer=["x", "y"]) == [0.4, 0.2]
        assert load_plugin(str(folder / "noria_test_reward_abc.py") + ":score", "reward.name") is fn  # imported once
        (tmp_path / "noria_test_reward_abc.py").write_text("def score(completions, **kwargs):\n    return []\n")
        with pytest.raises(PluginError, match="a module named 'noria_test_reward_abc' is already imported from .*mine"):
            load_plugin("noria_test_reward_abc.py:score", "reward.name")
    finally:
        for name in ("noria_test_reward_abc", "noria_test_helpers_abc"):
            sys.modules.pop(name, None)


def test_a_missing_or_broken_file_names_the_key_and_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginError, match=r"reward.name: .*no_such\.py not found \(relative paths start at"):
        load_plugin("no_such.py:score", "reward.name")
    (tmp_path / "noria_test_broken_abc.py").write_text("def score(:\n")
    with pytest.raises(PluginError, match=r"reward.name: cannot import 'noria_test_broken_abc.py'.*SyntaxError"):
        load_plugin("noria_test_broken_abc.py:score", "reward.name")
    assert "noria_test_broken_abc" not in sys.modules
    (tmp_path / "noria_test_wrong_abc.py").write_text("def score(a):\n    return 0.0\n")
    with pytest.raises(PluginError, match="cannot be called as"):
        load_plugin("noria_test_wrong_abc.py:score", "reward.name")
    sys.modules.pop("noria_test_wrong_abc", None)
