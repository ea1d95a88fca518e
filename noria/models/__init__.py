"""Model definitions shared by the rollout engine and the trainer, and their checkpoints.

Entry points::

    model = load_model("smollm2-135m-instruct")     # catalog name or HF folder
    logits = model(input_ids)                       # [B, T] -> [B, T, V]
    hidden = model.hidden_states(input_ids, attn=PackedContext([5, 7]))
    save_model(model, "out/step-100", source=folder)  # HF folder, tokenizer files copied

``load_model`` picks the native :class:`DecoderLM` for the families in :data:`NATIVE_FAMILIES`
(and its vision-language subclass ``noria.models.vlm.VisionLM`` for :data:`VISION_FAMILIES`)
and the transformers wrapper :class:`HFCausalLM` for anything else; both expose
``forward(input_ids, positions=None, attn=None)``, ``hidden_states(...)``, ``lm_head``, and
state-dict names equal to transformers' names.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from noria.models.attention import AttentionContext, CausalContext, PackedContext, PaddedContext
from noria.models.catalog import import_model, list_models, model_path
from noria.models.checkpoint import (
    CheckpointMismatch,
    atomic_folder,
    copy_companion_files,
    load_native,
    native_state_dict,
    read_config,
    save_tensors,
    write_config,
)
from noria.models.config import NATIVE_FAMILIES, VISION_FAMILIES, ModelArgs
from noria.models.decoder import DecoderLM
from noria.models.hf import HFCausalLM, load_hf

IMPLS = ("auto", "native", "hf")

__all__ = [
    "NATIVE_FAMILIES",
    "VISION_FAMILIES",
    "AttentionContext",
    "CausalContext",
    "CheckpointMismatch",
    "DecoderLM",
    "HFCausalLM",
    "ModelArgs",
    "PackedContext",
    "PaddedContext",
    "import_model",
    "list_models",
    "load_model",
    "generation_eos",
    "load_tokenizer",
    "model_path",
    "save_model",
    "try_tokenizer",
]

log = logging.getLogger(__name__)


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    impl: str = "auto",
) -> nn.Module:
    """Load a catalog name or HF folder: native when the family allows, else transformers."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    folder = model_path(path)
    model_type = read_config(folder).get("model_type")
    native = model_type in NATIVE_FAMILIES + VISION_FAMILIES
    if impl == "native" and not native:
        raise ValueError(
            f"impl='native' but model_type {model_type!r} has no native implementation; "
            f"native families: {', '.join(NATIVE_FAMILIES + VISION_FAMILIES)} (use impl='auto' or 'hf')"
        )
    if impl == "hf" or not native:
        return load_hf(folder, dtype=dtype, device=device)
    return load_native(folder, dtype=dtype, device=device)


def save_model(
    model: nn.Module,
    path: str | os.PathLike,
    max_shard_bytes: int | None = None,
    source: str | os.PathLike | None = None,
) -> Path:
    """Write an HF checkpoint folder atomically; copy tokenizer files from ``source`` if given."""
    with atomic_folder(path) as tmp:
        if isinstance(model, DecoderLM):
            _save_native(model, tmp, max_shard_bytes)
        elif isinstance(model, HFCausalLM):
            extra = {} if max_shard_bytes is None else {"max_shard_size": max_shard_bytes}
            model.hf.save_pretrained(tmp, **extra)
        else:
            raise TypeError(
                f"save_model expects DecoderLM or HFCausalLM, got {type(model).__name__}"
            )
        if source is not None:
            copy_companion_files(model_path(source), tmp)
    return Path(path)


def _save_native(model: DecoderLM, folder: Path, max_shard_bytes: int | None) -> None:
    state = native_state_dict(model)
    save_tensors(state, folder, max_shard_bytes)
    dtype = next(iter(state.values())).dtype
    write_config(model.hf_config or model.args.to_hf_config(), folder, dtype)


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer (with chat template) of a catalog name or checkpoint folder.

    A folder whose ``tokenizer_config.json`` names ``TokenizersBackend`` (as transformers 5 saves
    every tokenizer backed by a ``tokenizer.json``: SmolLM2's, the tiny model's, Noria's own
    checkpoints) is loaded with that class directly. ``AutoTokenizer`` picks the same class for it
    (:func:`_tokenizers_backend` keeps the exceptions it makes), but first reads ``config.json``
    through ``AutoConfig``, whose import of a model config pulls in transformers' kernel hub, weight
    conversions and torch's DTensor: 1.5 s of every ``noria train`` and ``noria serve`` start on
    2 cores, for a class it then does not use. Any other folder goes through ``AutoTokenizer``.
    """
    folder = model_path(path)
    if _tokenizers_backend(Path(folder)):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def try_tokenizer(path: str | Path):
    """The tokenizer at ``path``, or None for an ids-only checkpoint (logged)."""
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:  # ids-only checkpoints are fine: no text, no stop strings
        log.warning("no tokenizer at %s (%s); the engine will return ids only", path, e)
        return None


def generation_eos(folder: Path) -> set[int]:
    """EOS ids from generation_config.json (chat models often list several there)."""
    import json

    if not (folder / "generation_config.json").is_file():
        return set()
    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}


TOKENIZERS_BACKEND_FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe")
"""Native families (``NATIVE_FAMILIES``) whose ``TokenizersBackend`` folders ``AutoTokenizer`` loads
as that class; not qwen2, for which it substitutes ``Qwen2Tokenizer``
(``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, checked in tests/models/test_tokenizer_load.py:
importing that set would cost most of what the direct path saves)."""


def _tokenizers_backend(folder: Path) -> bool:
    """``AutoTokenizer`` would load ``folder``'s tokenizer as ``TokenizersBackend``: its config names
    that class, without remote code, next to a ``tokenizer.json``, for a model type of
    :data:`TOKENIZERS_BACKEND_FAMILIES`."""
    import json

    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        tokenizer_config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in tokenizer_config
        and "auto_map" not in config and config.get("model_type") in TOKENIZERS_BACKEND_FAMILIES
        and (folder / "tokenizer.json").exists()
    )  # fmt: skip
