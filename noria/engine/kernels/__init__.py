"""C++ kernels of the engine on CPU: paged decode attention, the fused sampler, and the fused
elementwise steps of a layer.

One extension (``paged_attention.cpp`` + ``sampling.cpp`` + ``fused.cpp`` + ``int8_linear.cpp`` +
``int4_linear.cpp``, compiled as one unit, ``kernels.cpp``; bound to Python by ``bind.cpp``: only it includes torch's
pybind11 glue, see there) holds them;
``sample_rows`` is used by ``noria.engine.sampling`` (see there), ``add_rmsnorm`` / ``rope`` /
``silu_mul`` by ``noria.engine.inference``, ``int8_linear`` and ``int4_linear`` by ``noria.engine.quant``; all are off,
like the attention kernel, under ``NORIA_NO_CPU_KERNEL=1``.

``paged_decode_attention`` computes one query token per sequence against that sequence's cached
K/V, which live in a shared pool and are found through a block table (see ``kv_cache``). Two
implementations with one signature:

- ``cpu``: a C++ kernel (``paged_attention.cpp``) compiled at first use with torch's extension
  loader (ninja + the system C++ compiler, about 20 s once on 2 cores; cached under
  ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ``scripts/setup.sh`` builds it
  ahead). It reads K/V in place (no gather copy) and is batch-invariant.

The extension is compiled for the instruction set ``noria.hardware.kernel_isa`` names (AVX-512,
AVX2 or baseline x86-64; explicit flags, never ``-march=native``), and that ISA is part of its
cache name, so a cache shared between CPUs never hands one CPU another's build. A build is trusted
only with its stamp (:data:`STAMP`): a library left by a killed build, or copied in without one, is
deleted and built again.
- ``torch``: gather each sequence's slots and call SDPA: the reference, and the fallback wherever
  the C++ kernel cannot be built or the tensors are not on the CPU.

Not guaranteed: the two agree to rounding (fp32 accumulation in both, different summation order),
not bitwise; deterministic runs must use one implementation throughout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from noria.console import phase

log = logging.getLogger(__name__)

_UNITS = [Path(__file__).with_name(n) for n in ("kernels.cpp", "bind.cpp")]
"""What the compiler is given: ``kernels.cpp`` (the four kernel sources as one translation unit, see
there) and ``bind.cpp``, compiled side by side."""
_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
"""Every source of the build (the units and what ``kernels.cpp`` includes): in its name's hash, and
checked for edits against the built library."""
_lock = threading.Lock()
_module = None
_failure: str | None = None


ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "baseline": [],
}  # fmt: skip
"""Compiler flags per instruction set (``noria.hardware.kernel_isa``). Never ``-march=native``: a
build must run on every CPU of its ISA, since build caches are shared (a home folder on NFS, a
container image, a CI cache). ATen's vector types pick their width from the CPU_CAPABILITY macros."""

STAMP = "noria-build.json"
"""Written beside the built library once it has loaded: the ISA, flags, torch version and the
library's sha256. A library without a matching stamp (a build killed mid-link, a folder copied in
from elsewhere) is deleted and built again, never loaded."""


def cpu_kernel():
    """The compiled C++ module, building it on first call; None if it cannot be built here."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as e:  # no compiler, no ninja, unsupported platform: fall back, loudly
                _failure = f"{type(e).__name__}: {e}"
                log.warning("paged attention C++ kernel unavailable, using the torch fallback (%s)", _failure)
    return _module


def build_name(isa: str) -> tuple[str, list[str]]:
    """The extension's name (sources, their folder, flags, torch version and ISA in it) and its
    compiler flags. The folder too: torch's build file names the sources by path, so two checkouts
    sharing one build folder rebuilt it every time a process of the other one loaded it."""
    source = b"".join(p.read_bytes() for p in _SOURCES) + str(_SOURCES[0].parent.resolve()).encode()
    flags = ["-O3", "-ffast-math", "-fopenmp", *ISA_FLAGS[isa]]
    tag = hashlib.sha256(source + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]
    return f"noria_cpu_kernels_{isa}_{tag}", flags


def _build():
    import sys

    from torch.utils.cpp_extension import _get_build_directory, load

    from noria.hardware import kernel_isa

    # The `ninja` package installs its binary next to this interpreter, which may not be on PATH
    # when the venv is used without activation.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    isa = kernel_isa()
    name, flags = build_name(isa)
    folder = Path(_get_build_directory(name, verbose=False))
    with _build_lock(folder):
        _remove_orphaned_baton(folder)
        discard_unverified(folder, name)
        built = folder / f"{name}.so"
        # torch's load() also recompiles when a source is newer than the library (an edited checkout)
        fresh = not built.exists() or any(p.stat().st_mtime > built.stat().st_mtime for p in _SOURCES)
        building = contextlib.nullcontext()
        if fresh:  # minutes on 2 cores: a line every few seconds says how far the compiler is
            what = f"building the C++ CPU kernels for {isa} in {folder} (once per CPU kind and torch version; about 20 s on 2 cores)"
            since = time.time()
            building = phase(what, detail=lambda: f"{_compiled_since(folder, since)}/{len(_UNITS)} units compiled")
        with building:
            module = load(name=name, sources=[str(p) for p in _UNITS], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        write_stamp(folder, name, isa, flags)
    return module


def _compiled_since(folder: Path, since: float) -> int:
    """Object files the compiler wrote into ``folder`` since ``since`` (the build's progress)."""
    return sum(1 for o in folder.glob("*.o") if o.stat().st_mtime >= since)


@contextlib.contextmanager
def _build_lock(folder: Path):
    """An flock beside the build folder, held while this process builds or loads: the kernel drops it
    when the holder dies, so a killed build never blocks the next one (torch's own baton is a plain
    file that a killed build leaves behind)."""
    import fcntl

    with open(folder.parent / f"{folder.name}.noria-lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another live process builds: say so while waiting for it
            with phase(f"waiting for another process building the C++ CPU kernels in {folder}"):
                fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_orphaned_baton(folder: Path) -> None:
    """Remove torch's build baton left by a killed build: with :func:`_build_lock` held, no live
    Noria process is building in this folder, and torch would otherwise wait on the baton forever."""
    lock = folder / "lock"
    if lock.exists():
        log.warning("removing the kernel build lock %s left by a killed build", lock)
        lock.unlink(missing_ok=True)


def build_status() -> str:
    """Whether this CPU's kernel build is cached and verified (without building it)."""
    from torch.utils.cpp_extension import _get_build_directory

    from noria.hardware import kernel_isa

    isa = kernel_isa()
    name, _ = build_name(isa)
    folder = Path(_get_build_directory(name, verbose=False))
    library = folder / f"{name}.so"
    if not library.exists():
        return f"{isa}: not built yet (built at first use, or by scripts/setup.sh) -> {folder}"
    try:
        verified = json.loads((folder / STAMP).read_text()).get("sha256") == _library_digest(library)
    except (OSError, ValueError):
        verified = False
    return f"{isa}: {'built' if verified else 'unverified (rebuilt at next use)'} in {folder}"


def _library_digest(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()


def write_stamp(folder: Path, name: str, isa: str, flags: list[str]) -> None:
    library = folder / f"{name}.so"
    stamp = {"isa": isa, "flags": flags, "torch": torch.__version__, "sha256": _library_digest(library)}
    tmp = folder / f"{STAMP}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(stamp))
    tmp.replace(folder / STAMP)


def discard_unverified(folder: Path, name: str) -> bool:
    """Delete a build folder whose library has no matching stamp; True if it was deleted. Call with
    :func:`_build_lock` held (a build in progress has no stamp yet)."""
    import shutil

    library = folder / f"{name}.so"
    if not library.exists():
        return False
    try:
        stamp = json.loads((folder / STAMP).read_text())
        if stamp.get("sha256") == _library_digest(library):
            return False
        reason = "its checksum does not match the library (a build killed mid-write, or a copy from elsewhere)"
    except (OSError, ValueError) as e:
        reason = f"it has no valid build stamp ({type(e).__name__}: a killed build, or a cache made elsewhere)"
    log.warning("discarding the kernel build in %s: %s; building again", folder, reason)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return True


def cpu_kernel_failure() -> str | None:
    """Why the C++ kernel could not be built (None if it was, or was never tried)."""
    return _failure


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Gather + SDPA, one sequence at a time (so each result is independent of the batch)."""
    outs = []
    offsets = torch.arange(block_size, device=q.device)
    for s, length in enumerate(context_lens.tolist()):
        n_blocks = -(-length // block_size)
        slots = (block_tables[s, :n_blocks].long()[:, None] * block_size + offsets).flatten()[:length]
        k = k_pool.index_select(0, slots).transpose(0, 1)  # [Hkv, L, D]
        v = v_pool.index_select(0, slots).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q[s].unsqueeze(1), k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[0]
        )  # [Hq, 1, D]
        outs.append(out.squeeze(1))
    return torch.stack(outs) if outs else torch.empty_like(q)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of q [S, Hq, D] over each sequence's cached K/V -> [S, Hq, D].

    ``k_pool``/``v_pool`` [num_slots, Hkv, D]; ``block_tables`` int32 [S, max_blocks];
    ``context_lens`` int32 [S] (tokens cached per sequence, the query's own included).
    ``impl``: ``auto`` (C++ on CPU when available), ``cpu_kernel`` (C++ or error), ``torch``.
    """
    if impl not in ("auto", "cpu_kernel", "torch"):
        raise ValueError(f"impl must be auto, cpu_kernel or torch, got {impl!r}")
    if impl != "torch" and q.device.type == "cpu" and os.environ.get("NORIA_NO_CPU_KERNEL") != "1":
        module = cpu_kernel()
        if module is not None:
            return module.paged_decode_attention(
                q.contiguous(), k_pool, v_pool, block_tables.contiguous(), context_lens.contiguous(), block_size, scale
            )
        if impl == "cpu_kernel":
            raise RuntimeError(f"the C++ paged attention kernel could not be built: {_failure}")
    return reference_paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_size, scale)


def fused_kernels_enabled() -> bool:
    """False when ``NORIA_NO_CPU_KERNEL=1`` asks for the torch code everywhere."""
    return os.environ.get("NORIA_NO_CPU_KERNEL") != "1"
