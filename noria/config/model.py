"""The ``model`` section: the policy model (path, family, dtype, device).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, option

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(key: str, device: str) -> None:
    """``device`` must be cpu, cuda or cuda:N."""
    if not DEVICE.fullmatch(device):
        raise ConfigError(f"{key} must be cpu, cuda or cuda:N, got {device!r}")


@dataclass
class ModelConfig:
    """The policy model. Owner: ``noria.models`` (``load_model``, the catalog); the engine and the trainer
    load it with these settings."""

    path: str = option(
        "",
        "A catalog name (see `noria models list`) or an HF model folder (config.json + safetensors), or a Hugging Face "
        "Hub id Org/Name, pinned as Org/Name@revision (branch, tag or commit), fetched with huggingface_hub into its "
        "cache (HF_HOME; HF_HUB_OFFLINE=1 uses the cache only).",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto",
        "Compute dtype of the model weights. auto: bfloat16 on CUDA and on CPUs that compute bf16 natively "
        "(AVX512_BF16 or AMX), float32 on other CPUs (AVX2-only ones run bf16 3-5x slower); the resolved dtype is "
        "what the run folder's config.yaml records. `noria info` shows what this machine gets.",
    )
    impl: Literal["auto", "native", "hf"] = option(
        "auto", "auto: Noria's native model when the architecture is supported, else transformers'."
    )
    device: str = option("cpu", "torch device for the model: cpu, cuda, cuda:1, ...")

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("model.path is required: a catalog name such as smollm2-135m-instruct or a folder")

    def resolve_dtype(self) -> None:
        """Replace ``auto`` by this machine's dtype (``noria.hardware.auto_dtype``); warn once when
        an explicit bfloat16 will run slowly on this CPU."""
        from noria import hardware

        if self.dtype == "auto":
            self.dtype = hardware.auto_dtype(self.device)
        else:
            hardware.warn_slow_dtype(self.dtype, self.device)
