"""HF checkpoints on disk: read and write ``config.json`` + safetensors (single file or sharded).

Layouts handled (the ones transformers writes)::

    folder/config.json + model.safetensors
    folder/config.json + model.safetensors.index.json + model-0000k-of-0000n.safetensors

Names are the files' names: the same as the model's state dict, except MoE experts, which the
model stacks and the files keep one tensor per expert (``noria.models.moe.disk_layout``).

Loading first validates every tensor from the safetensors headers alone (no data read): a tensor
the config implies but the files lack, a tensor the files hold but the model has no place for, or a
shape that differs, raises :class:`CheckpointMismatch` naming the tensor, the file and both shapes.
Only then are tensors copied, one at a time, into a model allocated directly on the target device,
so peak memory is one model plus one tensor.

Saving is atomic with respect to a crashing process: everything is written into a hidden sibling
folder that is renamed into place last, so a folder at ``path`` is always complete. (No fsync:
a power loss may still lose the newest checkpoint, never expose half of it.)
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from noria.errors import NoriaError
from noria.models.config import VISION_FAMILIES, ModelArgs, decoder_config
from noria.models.decoder import DecoderLM
from noria.models.moe import disk_layout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# Files that travel with the weights so a saved folder is usable on its own (tokenizer, chat
# template, generation defaults).
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",  # vision-language models: the image processor's settings
    "processor_config.json",
)

# Old transformers versions saved RoPE tables as state; the native model computes them, so these
# keys carry no information (transformers ignores them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatch(NoriaError):
    """config.json and the safetensors files disagree about a tensor."""


def read_config(path: str | Path) -> dict:
    """The ``config.json`` dict of a checkpoint folder; clear errors for a missing folder/file."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"checkpoint folder {folder} has no {CONFIG_FILE}")
    return json.loads(cfg_file.read_text())


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file holding it, from the index or the single file."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{index} lists shard {f.name}, which does not exist")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"checkpoint folder {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}"
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _file_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    # Headers only: validating a 70B checkpoint must not read 140 GB first.
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(set(files.values())):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if files.get(name) == f:
                    shapes[name] = tuple(sf.get_slice(name).get_shape())
    missing_in_files = sorted(set(files) - set(shapes))
    if missing_in_files:
        name = missing_in_files[0]
        raise CheckpointMismatch(
            f"config/checkpoint mismatch: tensor '{name}' is listed in the index for "
            f"{files[name].name}, but that file does not contain it"
        )
    return shapes


def _expected_shapes(model: DecoderLM) -> dict[str, tuple[int, ...]]:
    expected = {name: tuple(t.shape) for name, t in disk_layout(model.state_dict()).items()}
    if model.args.tie_word_embeddings:
        expected.pop("lm_head.weight")  # stored once, as the embedding
    return expected


def check_tensors(model: DecoderLM, files: dict[str, Path]) -> None:
    """Raise :class:`CheckpointMismatch` unless the files hold exactly the model's tensors."""
    expected = _expected_shapes(model)
    found = {n: s for n, s in _file_shapes(files).items() if not n.endswith(_IGNORED_SUFFIXES)}
    if model.args.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # a redundant copy of a tied head is harmless
    where = sorted({f.name for f in files.values()})
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointMismatch(
                f"config/checkpoint mismatch: tensor '{name}' (shape {shape} from config.json) is "
                f"missing from {', '.join(where)} in {next(iter(files.values())).parent}"
            )
        if found[name] != shape:
            raise CheckpointMismatch(
                f"config/checkpoint mismatch: tensor '{name}' in {files[name]} has shape "
                f"{found[name]}, but config.json implies {shape}"
            )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise CheckpointMismatch(
            f"config/checkpoint mismatch: tensor '{name}' (shape {found[name]}) in {files[name]} "
            "has no place in the model built from config.json"
        )


def native_class(cfg: dict) -> type[DecoderLM]:
    """The native model class of a ``config.json`` dict: ``DecoderLM``, or for a vision-language
    family ``noria.models.vlm.VisionLM`` (a DecoderLM with a vision tower in front); build it as
    ``native_class(cfg)(ModelArgs.from_hf_config(decoder_config(cfg)), hf_config=cfg)``."""
    if cfg.get("model_type") in VISION_FAMILIES:
        from noria.models.vlm import VisionLM

        return VisionLM
    return DecoderLM


@torch.no_grad()
def load_native(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DecoderLM:
    """Build a :class:`DecoderLM` from a checkpoint folder of a native family (a
    ``noria.models.vlm.VisionLM`` for a vision-language one)."""
    cfg = read_config(path)
    args = ModelArgs.from_hf_config(decoder_config(cfg))
    if args is None:
        raise ValueError(f"model_type {cfg.get('model_type')!r} in {path} is not a native family")
    files = tensor_files(path)
    # Meta first: random init of billions of weights would cost more than loading them.
    with torch.device("meta"):
        model = native_class(cfg)(args, hf_config=cfg).to(dtype)
    check_tensors(model, files)
    model = materialize(model, device)
    model.tie_weights()
    _copy_tensors(model, files)
    return model.eval()


def materialize(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)`` for a model built on the meta device: every parameter and
    buffer becomes an uninitialised tensor of its shape and dtype on ``device``. Not ``to_empty``
    itself: its ``torch.empty_like`` of a meta tensor runs torch's Python reference implementation,
    whose first call imports sympy (0.4-0.5 s of every engine, server and trainer start on a 2-core
    AMD EPYC Zen 3, a tenth of a tiny run's start); ``torch.empty`` of the shape does not."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _copy_tensors(model: DecoderLM, files: dict[str, Path]) -> None:
    params = disk_layout(model.state_dict())  # per-expert views fill the stacked MoE tensors
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        if name in params and not (model.args.tie_word_embeddings and name == "lm_head.weight"):
            by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as sf:
            for name in names:
                params[name].copy_(sf.get_tensor(name))


def native_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """Tensors to write for a native model: HF checkpoint names (one tensor per MoE expert, as
    views), tied head left out (as HF does)."""
    state = {name: t.detach() for name, t in disk_layout(model.state_dict()).items()}
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def save_tensors(
    state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None = None
) -> None:
    """Write tensors as one ``model.safetensors`` or as shards plus an index, like transformers."""
    shards = _split_shards(state, max_shard_bytes)
    if len(shards) == 1:
        _write_shard(shards[0], folder / SINGLE_FILE)
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(shard, folder / fname)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _split_shards(
    state: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    # In state-dict order, so each layer's tensors stay together (see ``bucketize``).
    if max_shard_bytes is None or not state:
        return [dict(state)]
    return [dict(bucket) for bucket in bucketize(state, max_shard_bytes)]


Bucket = list[tuple[str, torch.Tensor]]
"""``(name, tensor)`` pairs travelling together: a weight-sync bucket or a checkpoint shard."""


def bucketize(named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], max_bytes: int) -> Iterator[Bucket]:
    """Tensors in order, in buckets of at most ``max_bytes`` (a larger tensor goes alone rather than
    failing). The one bucketing loop: checkpoint shards here, the trainer's weight-sync buckets
    (``FSDPBackend.state_dict_for_sync``) and ``noria.sync.bucketize`` are this function. Lazy: a
    bucket is built only when asked for, so a stream of gathered tensors is never held whole."""
    bucket: Bucket = []
    size = 0
    for name, t in named.items() if isinstance(named, dict) else named:
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _write_shard(shard: dict[str, torch.Tensor], file: Path) -> None:
    # transformers refuses safetensors files without format=pt metadata.
    # A view (one MoE expert of a stacked tensor) is cloned: safetensors refuses shared storage.
    tensors = {name: _own(t.detach().to("cpu")) for name, t in shard.items()}
    save_file(tensors, str(file), metadata={"format": "pt"})


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t._is_view() else t.contiguous()


def write_config(cfg: dict, folder: Path, dtype: torch.dtype) -> None:
    """Write ``config.json`` with the dtype of the saved tensors recorded."""
    cfg = dict(cfg)
    dtype_name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = dtype_name
    if "torch_dtype" in cfg:  # transformers 4.x spelling; keep both in step
        cfg["torch_dtype"] = dtype_name
    (folder / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def copy_companion_files(source: str | Path, folder: Path) -> list[str]:
    """Copy tokenizer / chat template / generation config files present in ``source``."""
    src = Path(source)
    if not src.is_dir():
        raise FileNotFoundError(f"source folder for tokenizer files not found: {src}")
    copied = []
    for name in COMPANION_FILES:
        if (src / name).is_file() and not (folder / name).exists():
            shutil.copy2(src / name, folder / name)
            copied.append(name)
    return copied


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``path``, on error it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _make_readable(tmp)
    _replace_folder(tmp, target)


def _make_readable(folder: Path) -> None:
    # mkdtemp (and some writers' temp files) are owner-only; a checkpoint or model cache is read by
    # other processes and users like any folder.
    folder.chmod(0o755)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def _replace_folder(new: Path, target: Path) -> None:
    # A directory cannot be renamed over a non-empty one, so the old one steps aside first; the
    # window where `target` is absent is harmless (readers see "missing", never "partial").
    if not target.exists():
        new.rename(target)
        return
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
