"""What this machine's processor can do, in one place: every CPU fast path and the ``auto`` dtype ask here.

Owns: the x86 features Noria's choices depend on, read from ``/proc/cpuinfo`` (AVX2, FMA, F16C,
AVX-512 F/BW/VL/DQ, AVX512_BF16, AMX, AVX-NE-CONVERT), what torch and oneDNN will actually accept on
top of them (torch's dispatch level, ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``), and the
decisions made from them:

- :func:`kernel_isa`: the instruction set the C++ kernels are compiled for (``avx512``, ``avx2`` or
  ``baseline``), which also keys their build cache;
- :func:`packed_linear_ok`: whether oneDNN's prepacked linears (the engine's fast decode) run in
  a dtype here;
- :func:`auto_dtype`: ``model.dtype: auto`` — bf16 on CUDA and on CPUs that compute bf16 natively
  (AVX512_BF16 or AMX with oneDNN's bf16 kernels), fp32 everywhere else. Measured (``noria bench
  engine`` and the matmul probe in ``tests/test_hardware.py``'s docstring): on an AVX-512-BF16 EPYC a
  bf16 576x3072 linear ran 1.7x faster than fp32 at 8 rows; acting as AVX2 on the same machine bf16
  ran 3.9x slower than fp32 at 8 rows and 5.4x at 128, and on a real AVX2-only EPYC (Zen 3) ~5x slower
  at 512 rows. CPUs with AVX-512 but no bf16 instructions (Skylake-X, Cascade Lake) are not measured
  here; they get fp32, the dtype whose speed does not depend on emulated conversions.

Acting as another CPU: ``NORIA_CPU_ISA=avx2`` makes this module report an AVX2-only processor (no
AVX-512, no AMX, no native bf16), and :func:`apply_isa_override` (run when ``noria`` is imported)
sets ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2``
unless already set, so torch's kernels, oneDNN (which then refuses packed bf16 exactly as on a real
AVX2 CPU) and MKL act as on one. torch reads these at its first CPU op, so they must be in the
environment before any tensor work: exporting all four before Python starts always works;
:func:`cpu_info` raises if torch already runs above the requested level.

Not guaranteed: flags are what the kernel reports (a hypervisor may hide some); non-x86 machines
report no features and get the portable code paths.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_ISA = "NORIA_CPU_ISA"
"""Set to ``avx2`` to make Noria (and, through :func:`apply_isa_override`, torch, oneDNN and MKL)
behave as on an AVX2-only CPU."""

FEATURES = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
    "amx_tile", "amx_bf16", "avx_ne_convert",
)  # fmt: skip
"""The ``/proc/cpuinfo`` flags any decision here depends on."""

_ABOVE_AVX2 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16", "avx_ne_convert"}
_AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_OVERRIDE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


class HardwareError(RuntimeError):
    """The requested CPU behaviour cannot be had in this process (e.g. the override came too late)."""


def apply_isa_override() -> None:
    """Under ``NORIA_CPU_ISA=avx2``, point torch, oneDNN and MKL at AVX2 too (values already set win)."""
    requested = os.environ.get(ENV_ISA, "").strip().lower()
    if not requested:
        return
    if requested != "avx2":
        raise HardwareError(f"{ENV_ISA}={requested!r}: the only level Noria can act as is avx2")
    for key, value in _OVERRIDE_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class CpuInfo:
    """The processor as Noria sees it (after any ``NORIA_CPU_ISA`` override)."""

    model: str
    """Model name from /proc/cpuinfo (or platform.processor())."""
    arch: str
    """platform.machine(): x86_64, aarch64, ..."""
    cores: int
    """os.cpu_count()."""
    features: tuple[str, ...]
    """The :data:`FEATURES` this CPU has, in that order (minus AVX-512/AMX when acting as AVX2)."""
    acting_as: str | None
    """``avx2`` when ``NORIA_CPU_ISA`` asks to act as an AVX2-only CPU, else None."""
    torch_capability: str
    """The vector level torch dispatches to: ``torch.backends.cpu.get_cpu_capability()``."""
    onednn_bf16: bool
    """Whether oneDNN runs bf16 kernels here (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``)."""

    def has(self, *names: str) -> bool:
        return all(n in self.features for n in names)

    @property
    def isa(self) -> str:
        """``avx512`` (F, BW, VL, DQ), ``avx2`` (with FMA) or ``baseline``."""
        if self.has(*sorted(_AVX512_CORE)):
            return "avx512"
        return "avx2" if self.has("avx2", "fma") else "baseline"

    @property
    def bf16_native(self) -> bool:
        """bf16 dot products in hardware (AVX512_BF16 or AMX) and oneDNN willing to use them."""
        return self.onednn_bf16 and (self.has("avx512_bf16") or self.has("amx_bf16"))

    def summary(self) -> str:
        """One line for logs, run folders and benchmark JSON."""
        acting = f", acting as {self.acting_as} ({ENV_ISA})" if self.acting_as else ""
        bf16 = "native bf16" if self.bf16_native else "no native bf16"
        return f"{self.model} ({self.arch}, {self.cores} cores, {self.isa}, {bf16}; torch {self.torch_capability}{acting})"

    def as_dict(self) -> dict:
        return {
            "model": self.model, "arch": self.arch, "cores": self.cores, "isa": self.isa,
            "features": list(self.features), "bf16_native": self.bf16_native, "onednn_bf16": self.onednn_bf16,
            "torch_capability": self.torch_capability, "acting_as": self.acting_as,
        }  # fmt: skip


def _read_cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model or platform.processor() or "unknown CPU", flags


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This process's view of the CPU (cached: the environment it depends on is read at start)."""
    import torch

    apply_isa_override()
    model, flags = _read_cpuinfo()
    acting = os.environ.get(ENV_ISA, "").strip().lower() or None
    if acting == "avx2":
        flags -= _ABOVE_AVX2
    capability = torch.backends.cpu.get_cpu_capability()
    if acting == "avx2" and capability not in ("AVX2", "DEFAULT"):
        raise HardwareError(
            f"{ENV_ISA}=avx2 but torch already dispatches to {capability}: export ATEN_CPU_CAPABILITY=avx2 "
            "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 before starting Python"
        )
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if acting == "avx2" and onednn_bf16:
        raise HardwareError(f"{ENV_ISA}=avx2 but oneDNN still runs bf16 kernels: export ONEDNN_MAX_CPU_ISA=AVX2 before starting Python")
    return CpuInfo(
        model=model, arch=platform.machine(), cores=os.cpu_count() or 1,
        features=tuple(f for f in FEATURES if f in flags), acting_as=acting,
        torch_capability=capability, onednn_bf16=onednn_bf16,
    )  # fmt: skip


def hides_avx512() -> bool:
    """Acting as AVX2 (``NORIA_CPU_ISA``) on a processor that has AVX-512: a program that picks its
    kernels on the CPU's own flags, not on the torch, oneDNN and MKL limits set here, still sees it."""
    return cpu_info().acting_as == "avx2" and _AVX512_CORE <= _read_cpuinfo()[1]


def kernel_isa() -> str:
    """The instruction set the C++ kernels are built for: ``avx512``, ``avx2`` or ``baseline``."""
    info = cpu_info()
    return info.isa if info.arch in ("x86_64", "AMD64") else "baseline"


def packed_linear_ok(dtype) -> bool:
    """Whether oneDNN's prepacked linear (``mkldnn._reorder_linear_weight``) runs in ``dtype`` here:
    fp32 wherever oneDNN is built in, bf16 only where oneDNN has bf16 kernels for this CPU."""
    import torch

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu_info().onednn_bf16


def auto_dtype(device: str) -> str:
    """``model.dtype: auto`` resolved: ``bfloat16`` on CUDA and on CPUs with native bf16, else ``float32``."""
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_info().bf16_native else "float32"


def resolve_dtype(dtype: str, device: str) -> str:
    """``dtype`` itself, or :func:`auto_dtype` for ``auto``."""
    return auto_dtype(device) if dtype == "auto" else dtype


_warned: set[str] = set()


def warn_slow_dtype(dtype: str, device: str) -> None:
    """Log, once per process, that an explicit bf16 runs slowly on this CPU (it still runs)."""
    if dtype != "bfloat16" or device.startswith("cuda") or cpu_info().bf16_native or "bf16" in _warned:
        return
    _warned.add("bf16")
    log.warning(
        "bfloat16 on this CPU (%s) runs through slow emulated paths (3-5x slower than float32 in the matmuls); "
        "model.dtype: auto (or float32) picks the fast dtype here", cpu_info().summary(),
    )  # fmt: skip


def device_id(device: Any) -> str | None:
    """A CUDA device's UUID (the same GPU has the same one in every process, whatever
    ``CUDA_VISIBLE_DEVICES`` numbers it); None for the CPU. Weight sync compares the trainer's and
    an engine's to know whether CUDA IPC can hand tensors over (``noria.sync.resolve_transport``)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)
