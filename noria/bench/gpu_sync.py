"""``noria bench gpu-sync``: weight push trainer -> colocated engine on one GPU, for a Qwen3 size.

A thin driver of ``noria bench sync`` (``noria.bench.sync.measure_model``) with ``device=cuda`` on a
random-init Qwen3-shaped folder: ``ipc`` is an in-process engine fed by device copies, ``ipc_shm`` a
``noria serve`` subprocess on the same GPU fed through a CUDA IPC handle (no host copy); the
primitive is a device-to-device ``copy_`` of the same bytes into warm tensors.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from noria.bench import write_json
from noria.bench.gpu_common import device_name, random_model, write_model_folder


def run(model: str = "qwen3-1.7b", transports: tuple[str, ...] = ("ipc", "ipc_shm"), bucket_mb: int = 512,
        repeats: int = 3, json_path: str | None = None, work_dir: str | None = None) -> list[dict]:
    from noria.bench import sync

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        lm = random_model(model)
        folder = write_model_folder(lm, Path(tmp) / model)
        del lm
        torch.cuda.empty_cache()
        rows = sync.measure_model(str(folder), list(transports), bucket_mb << 20, repeats, Path(tmp), device="cuda")
    for r in rows:
        r["device"] = device_name()
    sync.print_results(rows)
    if json_path:
        write_json(json_path, "gpu-sync", rows)
    return rows
