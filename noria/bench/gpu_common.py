"""Shared pieces of the GPU benchmarks: random Qwen3-shaped models and the two hardware ceilings.

Ceilings are measured in the same run as the figures they bound (METHOD: datasheet rates are
leads): the device-to-device copy bandwidth (bytes read plus bytes written over the time of a
large ``copy_``) and the bf16 matmul rate (a large square ``torch.mm`` on random data). Both are
medians of CUDA-event timings after a warm-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

QWEN3: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28},
}
"""The shapes that differ between the two Qwen3 sizes (both: 16 query heads, 8 KV heads of 128)."""


def qwen3_config(name: str) -> dict[str, Any]:
    """An HF ``config.json`` dict of a Qwen3 size (random weights are drawn by :func:`random_model`)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
        **QWEN3[name],
    }  # fmt: skip


def random_model(name: str | dict, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A native DecoderLM of a Qwen3 size (``name``) or of an HF ``config.json`` dict, with N(0, 0.02)
    weights (norm weights 1), on ``device``."""
    from noria.models.checkpoint import materialize
    from noria.models.config import ModelArgs
    from noria.models.decoder import DecoderLM

    config = qwen3_config(name) if isinstance(name, str) else name
    with torch.device("meta"):
        lm = DecoderLM(ModelArgs.from_hf_config(config), hf_config=config)
    lm = materialize(lm, device).to(dtype)
    lm.tie_weights()
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return lm.eval()


def write_model_folder(lm, folder: Path) -> Path:
    """Save a model as an HF folder (config.json + model.safetensors) for loaders that read folders."""
    from noria.sync.disk import write_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    seen, tensors = set(), []
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append((name, t.detach().cpu()))
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(lm.hf_config))
    return folder


def cuda_median_s(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device memory bandwidth in bytes/s: (read + write bytes) of a large copy over its time."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = cuda_median_s(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 2 / seconds


def bf16_matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of a large square matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_median_s(lambda: torch.mm(a, b))
    return 2 * n**3 / seconds


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def decode_seconds(timed, new_tokens: int, tries: int = 3) -> float:
    """Seconds of ``new_tokens - 1`` decode steps from ``timed(n)`` (seconds to generate n tokens):
    the best of ``tries`` runs of ``new_tokens`` less the best of ``tries`` runs of 1 (the prefill).
    Best of each, so that a burst of other work during one short run cannot make the difference
    meaningless (or negative, as a single pair did with 6 tokens on a loaded 2-core CPU)."""
    t1 = min(timed(1) for _ in range(tries))
    tn = min(timed(new_tokens) for _ in range(tries))
    if tn <= t1:
        raise RuntimeError(f"{new_tokens} tokens took no longer than 1 ({tn:.4f} s vs {t1:.4f} s): too few tokens to time")
    return tn - t1
