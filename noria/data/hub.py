"""Hub datasets: ``data.path: Org/Name`` (or ``Org/Name@revision``) read with the ``datasets`` library.

Flow: the id -> its snapshot folder through huggingface_hub (``noria.models.hub.snapshot``, the one
place hub ids are resolved: ``HF_HOME``, ``HF_HUB_OFFLINE`` and the revision pin are honoured there, and
its error says what was tried) -> the rows of one split: a folder written by ``save_to_disk`` is read
with ``datasets.load_from_disk``, any other repo (Parquet, JSON Lines, CSV files, with or without a
README that declares configs) with ``datasets.load_dataset(folder, name=subset, split=split)``, which
picks the builder from the files as it does for the hub. The rows then go through the same checks
as a local file's (``noria.data.source``): the prompt, label and metadata columns are the config's
``data.prompt_key``, ``data.label_key`` and ``data.metadata_keys``.

Not guaranteed: the whole split is read into memory, as local Parquet files are; datasets with a
loading script (``trust_remote_code``) are refused by the datasets library itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from noria.data.source import DataError

SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files that ``save_to_disk`` writes at a folder's top: such a folder is read with ``load_from_disk``."""


def is_hub_dataset(value: str | Path) -> bool:
    """Whether ``value`` is a hub id (``Org/Name[@revision]``) and not a local path."""
    from noria.models.hub import is_hub_id

    return is_hub_id(value)


def hub_rows(value: str, split: str, subset: str | None, key: str = "data.path") -> list[dict[str, Any]]:
    """The rows of ``split`` of hub dataset ``value`` (``HubError`` when it cannot be resolved)."""
    from noria.models.hub import snapshot

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
