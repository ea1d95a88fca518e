"""Hugging Face Hub ids: ``model.path``, ``data.path`` and ``data.test_path`` as ``Org/Name``, optionally
pinned as ``Org/Name@revision``, resolved to a local snapshot folder through
``huggingface_hub.snapshot_download``; a dataset's snapshot is then read with the ``datasets`` library.

The download, the cache and its layout are huggingface_hub's own: the cache is ``$HF_HUB_CACHE``
(default ``$HF_HOME/hub``), ``HF_HUB_OFFLINE=1`` resolves from that cache with no network,
``HF_ENDPOINT`` names a mirror, ``HF_TOKEN`` a token. The revision after ``@`` is a branch, a tag or a
commit hash; without one, the repo's ``main``. The pin travels inside the path string, so every
process that loads the model (engines, trainer ranks, evaluation) resolves the same snapshot.

What counts as a hub id: a string of the form ``Org/Name`` (one slash, the characters the hub allows)
that is not an existing local path; an existing folder of that name always wins. When the hub cannot
answer (no network, offline with nothing cached, an unknown repo or revision), :class:`HubError`
says what was tried (the id, the revision, the cache folder, ``HF_HOME``, offline or not, the
endpoint) and how to pass a local folder instead.

Datasets (``hub_rows``): the snapshot folder -> the rows of one split: a folder written by
``save_to_disk`` is read with ``datasets.load_from_disk``, any other repo (Parquet, JSON Lines, CSV
files, with or without a README that declares configs) with ``datasets.load_dataset(folder,
name=subset, split=split)``, which picks the builder from the files as it does for the hub. The rows
then go through the same checks as a local file's (``noria.data.source``): the prompt, label and
metadata columns are ``data.prompt_key``, ``data.label_key`` and ``data.metadata_keys``.

Models (``noria.models.catalog.model_path``) use ``snapshot`` from here: this module sits in
``noria.data`` because ``noria.models`` may import ``noria.data`` and not the other way round.

Not guaranteed: a gated or private repo needs a token (``HF_TOKEN`` or ``hf auth login``); Noria does
not manage it. Two processes resolving the same id at once both call huggingface_hub, whose own
file locks keep the cache consistent. A dataset's whole split is read into memory, as local Parquet
files are; datasets with a loading script are refused by the datasets library itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from noria.data.source import DataError
from noria.errors import NoriaError

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<revision>[^\s@]+))?")
"""``Org/Name`` or ``Org/Name@revision``."""


class HubError(NoriaError):
    """A hub id could not be resolved; the message says what was tried and how to pass a local folder."""


def parse_hub_id(value: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``value`` is a hub id and no local path of that name exists, else None."""
    if not isinstance(value, str) or Path(value).expanduser().exists():
        return None
    match = HUB_ID.fullmatch(value)
    if match is None or ".." in match["repo"]:  # a relative path upwards, never a repo name
        return None
    return match["repo"], match["revision"]


def is_hub_id(value: str | os.PathLike) -> bool:
    """Whether ``value`` names a hub repo (``Org/Name[@revision]``) rather than a local path."""
    return parse_hub_id(value) is not None


def is_hub_dataset(value: str | os.PathLike) -> bool:
    """Whether ``data.path`` / ``data.test_path`` names a hub dataset: a hub id that does not end like a
    data file (``x/train.jsonl`` that is not here is a missing file, not a hub repo)."""
    from noria.data.source import SUPPORTED_SUFFIXES

    return is_hub_id(value) and Path(str(value)).suffix.lower() not in SUPPORTED_SUFFIXES


def snapshot(value: str, repo_type: str = "model", key: str = "model.path") -> Path:
    """The local snapshot folder of hub id ``value`` (downloaded into the cache when online)."""
    parsed = parse_hub_id(value)
    if parsed is None:
        raise HubError(f"{key}: {value!r} is not a hub id of the form Org/Name or Org/Name@revision")
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision))
    except Exception as e:  # huggingface_hub raises many types (HTTP, offline, not found, validation); all mean "not here"
        raise HubError(_not_found(key, value, repo_id, revision, repo_type, e)) from e


def hub_context() -> dict[str, str]:
    """What huggingface_hub uses here: the cache folder, HF_HOME, offline or not, the endpoint."""
    from huggingface_hub import constants

    return {
        "cache": str(constants.HF_HUB_CACHE),
        "HF_HOME": os.environ.get("HF_HOME", f"(unset: {constants.HF_HOME})"),
        "HF_HUB_OFFLINE": "1" if constants.HF_HUB_OFFLINE else "0",
        "endpoint": str(constants.ENDPOINT),
    }


def _not_found(key: str, value: str, repo_id: str, revision: str | None, repo_type: str, error: Exception) -> str:
    ctx = hub_context()
    kind = "dataset" if repo_type == "dataset" else "model"
    mode = "offline (HF_HUB_OFFLINE=1): only the cache was searched" if ctx["HF_HUB_OFFLINE"] == "1" else (
        f"online (HF_HUB_OFFLINE=0): asked {ctx['endpoint']}, then the cache"
    )
    cli = f"hf download {repo_id}" + (" --repo-type dataset" if kind == "dataset" else "") + (
        f" --revision {revision}" if revision else ""
    )
    return (
        f"{key}: {value!r} is not a local path, so it was tried as a Hugging Face Hub {kind} id: "
        f"snapshot_download({repo_id!r}, repo_type={repo_type!r}, revision={revision or 'main'!r}) with the cache "
        f"{ctx['cache']} (HF_HOME={ctx['HF_HOME']}), {mode}; it failed: {type(error).__name__}: {_first_line(error)}. "
        f"To use a local copy instead: on a machine with access run `{cli} --local-dir DIR`, copy DIR here and set "
        f"{key}: DIR; or copy a Hugging Face cache holding it into $HF_HOME/hub and set HF_HUB_OFFLINE=1."
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


# ---------------------------------------------------------------------------------------- datasets


SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files that ``save_to_disk`` writes at a folder's top: such a folder is read with ``load_from_disk``."""


def hub_rows(value: str, split: str, subset: str | None, key: str = "data.path") -> list[dict[str, Any]]:
    """The rows of ``split`` of hub dataset ``value`` (``HubError`` when it cannot be resolved)."""
    folder = snapshot(value, "dataset", key)
    return folder_rows(folder, split, subset, f"{key}: {value} (snapshot {folder})")


def folder_rows(folder: Path, split: str | None, subset: str | None, where: str) -> list[dict[str, Any]]:
    """The rows of ``split`` of a dataset folder: ``save_to_disk`` output, or data files for ``load_dataset``."""
    datasets = _datasets(where)
    if any((folder / marker).is_file() for marker in SAVED_MARKERS):
        return pick_split(datasets.load_from_disk(str(folder)), split, where).to_list()
    try:
        loaded = datasets.load_dataset(str(folder), name=subset, split=split)
    except ValueError as e:  # unknown split or config: the datasets library names the valid ones
        raise DataError(f"{where}: split {split!r}, subset {subset!r}: {e}") from e
    except FileNotFoundError as e:
        raise DataError(f"{where}: no data files the datasets library can read: {e}") from e
    return loaded.to_list()


def pick_split(loaded: Any, split: str | None, where: str) -> Any:
    """One split of a ``DatasetDict`` (``split`` must name one), or a ``Dataset`` as it is."""
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if split is None:
        raise DataError(f"{where}: holds several splits ({', '.join(loaded)}); choose one with data.split / data.test_split")
    if split not in loaded:
        raise DataError(f"{where}: has no split {split!r}; it has: {', '.join(loaded)} (set data.split / data.test_split)")
    return loaded[split]


def _datasets(where: str) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"reading {where} needs the 'datasets' package: pip install datasets") from e
    return datasets
