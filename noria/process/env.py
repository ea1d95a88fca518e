"""Process environment every Noria process runs with: NVLink multicast off.

``noria`` sets these at its entry (``noria.cli.main``), before torch.distributed makes any group,
with ``setdefault`` (a value the user exported wins), so every process it starts inherits them:
trainer ranks, ``noria serve`` children, benchmark workers. Every child started through
``noria.process.child`` also gets :func:`child_env` explicitly, for jobs built outside the CLI too.

Why off: NVLink SHARP / multicast (NCCL's NVLS algorithms, torch symmetric memory, NVSHMEM) needs
fabric-manager and IMEX support that shared or partitioned GPU hosts often lack; where it is missing,
communicator or symmetric-memory setup fails or hangs instead of falling back. Broadcasts and FSDP2's
collectives run over plain NVLink / PCIe rings without it.

Not guaranteed: a process started by something else (a hand-run ``torchrun`` script that never
imports ``noria.cli``) gets the variables only from its own environment.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",  # NCCL: no NVLink SHARP (NVLS) algorithms
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # torch symmetric memory: no multicast objects
    "NVSHMEM_DISABLE_NVLS": "1",  # NVSHMEM (symmetric memory's backend): no NVLS
}
"""Variables that keep NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM."""


def multicast_off(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set :data:`MULTICAST_OFF` in ``environ`` (default ``os.environ``) where not set already."""
    environ = os.environ if environ is None else environ
    for key, value in MULTICAST_OFF.items():
        environ.setdefault(key, value)
    return environ


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with multicast off (unless set otherwise) and ``extra``, for a child."""
    return {**multicast_off(dict(os.environ)), **extra}
