"""The Megatron-Core trainer backend (``train.backend: megatron``); see docs/megatron.md.

Modules::

    config.py    the ``train.megatron`` config section (a leaf: noria.config imports it)
    model.py     everything that imports megatron-core: availability and refusal, parallel state,
                 ModelArgs -> TransformerConfig, the local layer spec with packed core attention,
                 the packed forward to hidden states and the gathered output layer
    backend.py   MegatronBackend: the TrainBackend contract (compute_logprobs, train_step,
                 state_dict_for_sync, save / load, export_hf) over GPTModel, DDP and Megatron's optimizer

The HF <-> Megatron names and layouts live with the models (``noria.models.megatron``): pure tensor
code the CPU suite checks. Importing this package imports neither megatron-core nor the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "MegatronBackend": "noria.train.megatron.backend",
    "MegatronUnavailable": "noria.train.megatron.model",
    "megatron_installed": "noria.train.megatron.model",
    "require_megatron": "noria.train.megatron.model",
}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'noria.train.megatron' has no attribute {name!r}")


__all__ = list(_MODULE_OF)
