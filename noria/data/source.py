"""Reading prompt rows from files: JSONL, Parquet, saved Hugging Face ``datasets`` folders, and hub
dataset ids ``Org/Name`` (``noria.data.hub``).

What this module owns: turning a file into validated ``noria.types.Prompt`` records, before any
model is loaded. Data moves file -> raw rows (plain dicts) -> one check per row -> ``Prompt``.
Every row is checked at load; a bad row raises ``DataError`` naming the file, the row and the
field, unless ``skip_bad_rows`` is on, in which case it is counted on the returned
``PromptDataset`` (``n_skipped`` and the first few ``skip_reasons``).

Row numbers in messages are 1-based: ``line N`` for JSONL (the physical line in the file), ``row N``
for Parquet and Arrow. ``Prompt.index`` is the 0-based position of the row among the file's rows
(blank JSONL lines are not rows), so it stays stable when other rows are skipped.

A JSONL line is read with at most ``MAX_ROW_BYTES`` in memory and decoded on its own, so an
oversized line or one that is not UTF-8 is a bad row naming its line (``jsonl_rows``, shared with
the SFT reader), never a traceback or a memory blow-up.

Not guaranteed: Parquet and Arrow files are read whole into memory; the label and metadata values are
kept as the file gives them (their type is the reward's business); Parquet and ``datasets`` need
``pyarrow`` / ``datasets``, which are imported only when such a file is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noria.errors import NoriaError
from noria.types import Prompt

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat-message prompt may use."""
SUPPORTED_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".arrow": "hf"}
"""File extensions ``format: auto`` recognises (a folder means a saved ``datasets`` dataset)."""
MAX_SKIP_REASONS = 5
MAX_ROW_BYTES = 16 << 20
"""A JSONL line longer than this is a bad row, refused (naming its line) without being held in memory."""


class DataError(NoriaError):
    """A data file or one of its rows is invalid; the message names the file, row and field."""


@dataclass
class PromptDataset:
    """The validated prompts of one file, plus what was skipped on the way."""

    prompts: list[Prompt]
    """The rows that passed validation, in file order."""
    path: str
    """The file or folder they were read from."""
    n_skipped: int = 0
    """Rows dropped as malformed (only non-zero with ``skip_bad_rows``)."""
    skip_reasons: list[str] = field(default_factory=list)
    """The first few skip reasons (at most ``MAX_SKIP_REASONS``), each naming row and field."""

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


@dataclass(frozen=True)
class FieldMap:
    """Which row fields hold the prompt, the label and the metadata (from ``DataConfig``)."""

    prompt_key: str = "prompt"
    label_key: str | None = "label"
    metadata_keys: tuple[str, ...] = ()
    images_key: str | None = "images"
    """The field whose images fill the prompt's bare ``{"type": "image"}`` parts (``noria.data.vision_chat``)."""


# ------------------------------------------------------------------------------------- public API


def read_prompt_file(
    path: str | Path,
    fields: FieldMap = FieldMap(),
    fmt: str = "auto",
    skip_bad_rows: bool = False,
    split: str | None = None,
    subset: str | None = None,
    key: str = "data.path",
) -> PromptDataset:
    """Read and validate every row of ``path``; raise ``DataError`` on the first bad row unless skipping.
    ``path`` may be a hub dataset id ``Org/Name[@revision]`` (``noria.data.hub``); ``split`` picks one
    split of a hub dataset (default train) or of a saved ``DatasetDict``; ``subset`` a hub dataset's config."""
    from noria.data.hub import hub_rows, is_hub_dataset

    if not Path(path).exists() and is_hub_dataset(str(path)):
        rows = hub_rows(str(path), split or "train", subset, key)
        raw: Iterator[tuple[str, Any]] = ((f"row {i + 1}", row) for i, row in enumerate(rows))
    else:
        path = Path(path)
        if not path.exists():
            raise DataError(f"data file not found: {path} (nor a hub dataset id Org/Name)")
        raw = _raw_rows(path, resolve_format(path, fmt), split)
    dataset = PromptDataset(prompts=[], path=str(path))
    base_dir = None if not isinstance(path, Path) else path if path.is_dir() else path.parent
    for index, (where, row) in enumerate(raw):
        try:
            if isinstance(row, BadRow):
                raise DataError(row.reason)
            dataset.prompts.append(row_to_prompt(row, fields, index=index, source=str(path), base_dir=base_dir))
        except DataError as e:
            _skip_or_raise(dataset, f"{path}: {where}: {e}", skip_bad_rows)
    return dataset


def resolve_format(path: Path, fmt: str) -> str:
    """The reader to use for ``path``: ``fmt`` itself, or the one its extension (or folder) implies."""
    if fmt != "auto":
        if fmt not in ("jsonl", "parquet", "hf"):
            raise DataError(f"{path}: unknown data format {fmt!r}; supported: auto, jsonl, parquet, hf")
        return fmt
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(
            f"{path}: cannot tell the data format from extension {suffix or '(none)'!r}; supported: "
            f"{', '.join(SUPPORTED_SUFFIXES)} files or a folder saved with datasets' save_to_disk"
        )
    return SUPPORTED_SUFFIXES[suffix]


def row_to_prompt(row: Any, fields: FieldMap, index: int, source: str, base_dir: Path | None = None) -> Prompt:
    """Validate one raw row and build its ``Prompt``; ``DataError`` names the offending field. Images
    (``noria.data.vision_chat``; relative paths from ``base_dir``) are read and checked here too."""
    if not isinstance(row, dict):
        raise DataError(f"expected an object (a mapping of fields), got {type(row).__name__}")
    value = _require(row, fields.prompt_key)
    images = row.get(fields.images_key) if fields.images_key else None
    if images or _has_content_parts(value):
        from noria.data.vision_chat import image_prompt

        prompt = image_prompt(value, images, base_dir, fields.prompt_key, fields.images_key or "images")
    else:
        prompt = _check_prompt(value, fields.prompt_key)
    label = None
    if fields.label_key is not None:
        label = _require(row, fields.label_key)
        if label is None:
            raise DataError(f"field '{fields.label_key}': label is null")
    metadata = {key: _require(row, key) for key in fields.metadata_keys}
    return Prompt(prompt=prompt, label=label, metadata=metadata, index=index, source=source)


# ----------------------------------------------------------------------------------- row checking


def _has_content_parts(value: Any) -> bool:
    from noria.data.vision_chat import has_content_parts

    return has_content_parts(value)


def _require(row: dict[str, Any], key: str) -> Any:
    if key not in row:
        raise DataError(f"field '{key}' is missing (row has: {', '.join(sorted(map(str, row))) or 'nothing'})")
    return row[key]


def _check_prompt(value: Any, key: str) -> str | tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"field '{key}': the prompt is empty")
        return value
    if isinstance(value, (list, tuple)):
        return _check_messages(value, key)
    raise DataError(f"field '{key}': expected a string or a list of chat messages, got {type(value).__name__}")


def _check_messages(messages: list[Any] | tuple[Any, ...], key: str) -> tuple[dict[str, str], ...]:
    if not messages:
        raise DataError(f"field '{key}': the message list is empty")
    checked = tuple(_check_message(m, f"{key}[{i}]") for i, m in enumerate(messages))
    if not any(m["role"] == "user" for m in checked):
        raise DataError(f"field '{key}': the messages contain no 'user' message")
    return checked


def check_message(message: Any, where: str) -> dict[str, str]:
    """A chat message as ``{"role", "content"}``; ``DataError`` naming ``where`` and the field otherwise."""
    return _check_message(message, where)


def _check_message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise DataError(f"field '{where}': expected a {{'role', 'content'}} object, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise DataError(f"field '{where}.role': {role!r} is not one of {list(CHAT_ROLES)}")
    if not isinstance(content, str):
        raise DataError(f"field '{where}.content': expected a string, got {type(content).__name__}")
    if role == "user" and not content.strip():
        raise DataError(f"field '{where}.content': the user message is empty")
    return {"role": role, "content": content}


def _skip_or_raise(dataset: PromptDataset, reason: str, skip: bool) -> None:
    if not skip:
        raise DataError(reason)
    dataset.n_skipped += 1
    if len(dataset.skip_reasons) < MAX_SKIP_REASONS:
        dataset.skip_reasons.append(reason)


# ---------------------------------------------------------------------------------------- readers


class BadRow:
    """A row that could not even be decoded (too long, not UTF-8, not JSON); validating it raises its reason."""

    def __init__(self, reason: str):
        self.reason = reason


def _raw_rows(path: Path, fmt: str, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row)`` pairs; ``where`` is ``line N`` or ``row N`` (1-based)."""
    if fmt == "jsonl":
        yield from jsonl_rows(path)
        return
    table = _read_parquet(path) if fmt == "parquet" else _read_hf(path, split)
    for i, row in enumerate(table):
        yield f"row {i + 1}", row


def jsonl_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(line N, row)`` for every non-blank line of a JSONL file; ``row`` is the parsed value, or a
    bad row (its ``reason`` says: longer than ``MAX_ROW_BYTES``, not UTF-8, not JSON)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a folder, not a JSONL file")
    with path.open("rb") as f:
        lineno = 0
        while line := f.readline(MAX_ROW_BYTES + 1):
            lineno += 1
            if len(line) > MAX_ROW_BYTES:
                _skip_line(f, line)
                yield f"line {lineno}", BadRow(f"longer than {MAX_ROW_BYTES} bytes (noria.data.source.MAX_ROW_BYTES)")
            elif line.strip():
                yield f"line {lineno}", _parse_line(line)


def _skip_line(f: Any, start: bytes) -> None:
    """Read past the rest of an oversized line, a bounded piece at a time."""
    piece = start
    while piece and not piece.endswith(b"\n"):
        piece = f.readline(1 << 20)


def _parse_line(line: bytes) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(f"not valid UTF-8 (byte {e.start} of the line: {line[e.start : e.start + 4]!r})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(f"not valid JSON ({e})")


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    pq = _lazy_import("pyarrow.parquet", "pyarrow", path)
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt file; classify them all as bad data
        raise DataError(f"{path}: cannot read as Parquet: {e}") from e


def _read_hf(path: Path, split: str | None = None) -> list[dict[str, Any]]:
    if path.is_file():
        return _read_arrow_file(path)
    datasets = _lazy_import("datasets", "datasets", path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{path}: not a dataset folder saved with datasets' save_to_disk: {e}") from e
    from noria.data.hub import pick_split

    return pick_split(loaded, split, str(path)).to_list()


def _read_arrow_file(path: Path) -> list[dict[str, Any]]:
    """A single ``.arrow`` file: the IPC stream format ``datasets`` writes, or the IPC file format."""
    pa = _lazy_import("pyarrow", "pyarrow", path)
    errors = []
    for opener in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(path)) as source:
                return opener(source).read_all().to_pylist()
        except pa.ArrowInvalid as e:
            errors.append(str(e))
    raise DataError(f"{path}: cannot read as an Arrow stream or file: {'; '.join(errors)}")


def _lazy_import(module: str, package: str, path: Path) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"reading {path} needs the '{package}' package: pip install {package}") from e
