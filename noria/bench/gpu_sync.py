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


def add_arguments(parser) -> None:
    """``noria bench gpu-sync``'s arguments."""
    parser.description = "CUDA: weight push to a colocated engine (CUDA IPC) vs a device copy."
    parser.add_argument("--model", default="qwen3-1.7b", help="random-init Qwen3 size: qwen3-0.6b, qwen3-1.7b")
    parser.add_argument("--transports", default="ipc,ipc_shm",
                        help="comma-separated: ipc (an Engine in this process, device copies), ipc_shm (a noria serve "
                        "subprocess on the same GPU, CUDA IPC handles)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="sync.bucket_mb: MB per bucket of the push")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per case; the best is reported")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run(args.model, tuple(t for t in args.transports.split(",") if t), args.bucket_mb, args.repeats, args.json)
    return 0


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
