"""noria.hardware (what the CPU can do, and the dtype `auto` picks) and the kernel build cache keyed
by it: acting as an AVX2-only CPU, a build from another CPU kind never loaded, a half-finished build
never trusted.

Measured on this project's machines (``noria bench engine``; the matmul rates quoted in
noria.hardware): bf16 576x3072 linear vs fp32, on an AMD EPYC with AVX512_BF16: 1.7x faster at 8
rows; the same machine acting as AVX2: 3.9x slower at 8 rows, 5.4x at 128; a real AVX2-only EPYC
(Zen 3): ~5x slower at 512. Hence auto = bf16 only with native bf16.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from noria.config import load_config
from noria.engine import kernels
from noria.hardware import FEATURES, _read_cpuinfo, auto_dtype, cpu_info, kernel_isa

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("NORIA_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                             "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip


REPORT = "import json, torch, noria; from noria.hardware import cpu_info, auto_dtype, packed_linear_ok; " \
    "i = cpu_info(); print(json.dumps({**i.as_dict(), 'auto': auto_dtype('cpu'), 'bf16_packs': packed_linear_ok(torch.bfloat16)}))"


def test_features_are_what_the_kernel_reports():
    _, flags = _read_cpuinfo()
    info = cpu_info()
    if info.acting_as is None:
        assert set(info.features) == {f for f in FEATURES if f in flags}
    assert info.isa in ("avx512", "avx2", "baseline")
    assert auto_dtype("cuda") == "bfloat16"
    assert auto_dtype("cpu") == ("bfloat16" if info.bf16_native else "float32")
    assert info.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_acting_as_avx2_reports_an_avx2_cpu_to_noria_torch_and_onednn():
    out = _python(REPORT, NORIA_CPU_ISA="avx2")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["isa"] == "avx2" and report["acting_as"] == "avx2"
    assert not any(f.startswith(("avx512", "amx")) for f in report["features"])
    assert report["torch_capability"] == "AVX2" and report["onednn_bf16"] is False
    assert report["auto"] == "float32" and report["bf16_packs"] is False


def test_acting_as_another_isa_is_refused():
    out = _python(REPORT, NORIA_CPU_ISA="sse2")
    assert out.returncode != 0 and "the only level Noria can act as is avx2" in out.stderr


def test_acting_as_avx2_after_torch_dispatched_above_it_is_an_error():
    code = ("import os, torch; torch.ones(3).add_(1); os.environ['NORIA_CPU_ISA'] = 'avx2'; "
            "from noria.hardware import cpu_info; print(cpu_info().torch_capability)")  # fmt: skip
    out = _python(code)
    _, flags = _read_cpuinfo()
    if "avx512f" in flags:  # torch already picked AVX512 kernels: too late to act as AVX2
        assert out.returncode != 0 and "export ATEN_CPU_CAPABILITY=avx2" in out.stderr
    else:
        assert out.returncode == 0 and out.stdout.strip() in ("AVX2", "DEFAULT")


def test_dtype_auto_resolves_in_the_config_and_the_trainer_follows():
    config = load_config(ROOT / "examples/grpo_smollm2_arithmetic.yaml")
    assert config.model.dtype == auto_dtype("cpu") and config.train.param_dtype == config.model.dtype
    explicit = load_config(ROOT / "examples/grpo_smollm2_arithmetic.yaml", ["--model.dtype", "float32", "--train.param_dtype", "bfloat16"])
    assert (explicit.model.dtype, explicit.train.param_dtype) == ("float32", "bfloat16")


def test_explicit_bf16_without_native_bf16_warns_once_and_still_resolves():
    code = ("from noria.config import load_config; "
            "c = load_config('examples/grpo_smollm2_arithmetic.yaml', ['--model.dtype', 'bfloat16']); "
            "load_config('examples/grpo_smollm2_arithmetic.yaml', ['--model.dtype', 'bfloat16']); print(c.model.dtype)")  # fmt: skip
    out = _python(code, NORIA_CPU_ISA="avx2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "bfloat16"
    assert out.stderr.count("model.dtype: auto (or float32) picks the fast dtype here") == 1


# ------------------------------------------------------------------------------ the kernel build


def test_kernel_builds_are_keyed_by_isa_and_never_native():
    names = {isa: kernels.build_name(isa) for isa in kernels.ISA_FLAGS}
    assert len({name for name, _ in names.values()}) == 3 and all(isa in names[isa][0] for isa in names)
    for isa, (_, flags) in names.items():
        assert not any(f.startswith(("-march", "-mtune=native")) for f in flags)
        assert any(f.startswith("-mavx512") for f in flags) == (isa == "avx512")
    assert kernel_isa() == cpu_info().isa


def test_two_checkouts_build_into_folders_of_their_own(tmp_path, monkeypatch):
    """The same sources in another folder (a second checkout) get another build name: torch's build
    file names its sources by path, and one shared folder was rebuilt at every switch."""
    copies = []
    for src in kernels._SOURCES:
        copies.append(tmp_path / src.name)
        shutil.copy(src, copies[-1])
    here = kernels.build_name("avx2")
    monkeypatch.setattr(kernels, "_SOURCES", copies)
    there = kernels.build_name("avx2")
    assert there[0] != here[0] and there[1] == here[1] and there[0].startswith("noria_cpu_kernels_avx2_")


@pytest.fixture
def built(tmp_path) -> tuple[Path, str]:
    """A copy of this machine's verified kernel build folder."""
    module = kernels.cpu_kernel()
    assert module is not None, kernels.cpu_kernel_failure()
    source = Path(module.__file__).parent
    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    return folder, source.name


def test_a_verified_build_is_kept(built):
    folder, name = built
    assert not kernels.discard_unverified(folder, name)
    assert (folder / f"{name}.so").exists()


@pytest.mark.parametrize("damage", ["truncated", "no_stamp", "bad_stamp"])
def test_an_unverified_build_is_discarded(built, damage):
    folder, name = built
    library = folder / f"{name}.so"
    if damage == "truncated":  # killed mid-link
        library.write_bytes(library.read_bytes()[: 4096])
    elif damage == "no_stamp":  # killed after linking, before the stamp; or copied in from elsewhere
        (folder / kernels.STAMP).unlink()
    else:
        (folder / kernels.STAMP).write_text("{not json")
    assert kernels.discard_unverified(folder, name)
    assert not library.exists() and folder.is_dir()


@pytest.mark.slow
def test_a_killed_build_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    # A real build killed after it started, then a fresh process: it must rebuild and load, not crash
    # on (or wait forever for) what the killed one left. In a cache of its own (TORCH_EXTENSIONS_DIR):
    # on an AVX2 machine the AVX2 build is the one every engine of the suite loads, and removing it
    # from the real cache made another worker's `noria serve` build it meanwhile (over 90 s beside two
    # busy workers, past its start deadline).
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    env = {"NORIA_CPU_ISA": "avx2", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    folder = Path(_get_build_directory(kernels.build_name("avx2")[0], verbose=False))
    assert folder.is_relative_to(tmp_path) and not any(folder.iterdir())  # made empty by torch
    clean = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    killed = subprocess.Popen([sys.executable, "-c", "from noria.engine.kernels import cpu_kernel; cpu_kernel()"],
                              env={**clean, **env}, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert "building the C++ CPU kernels" in killed.stderr.readline()
    import time

    deadline = time.monotonic() + 120  # on a loaded machine torch takes seconds to reach its baton
    while not (folder / "lock").exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3)  # torch holds its baton: the compilers are running (each source takes 5 s or more)
    # Every process of its session, as closing its terminal does: ninja puts each compiler in a
    # process group of its own, and compilers left running would race the rebuild for the same
    # objects (and for the 2 cores: the rebuild took twice as long beside them).
    kill_session(killed.pid)
    killed.wait()
    assert (folder / "lock").exists()  # torch's baton, left behind by the killed build
    out = _python("from noria.engine.kernels import cpu_kernel, cpu_kernel_failure as f; m = cpu_kernel(); "
                  "print(m is not None and m.paged_decode_attention is not None, f())", **env)  # fmt: skip
    assert out.returncode == 0 and out.stdout.split()[0] == "True", out.stderr
    assert json.loads((folder / kernels.STAMP).read_text())["isa"] == "avx2"


def kill_session(sid: int) -> None:
    """SIGKILL every process whose session id is ``sid`` (/proc/PID/stat: state, ppid, pgrp, session)."""
    import signal

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            session = int(stat.read_text().rsplit(")", 1)[1].split()[3])
            if session == sid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass


def test_the_loaded_kernels_are_this_isas_build():
    out = _python("from noria.engine.kernels import cpu_kernel; print(cpu_kernel().__name__)", NORIA_CPU_ISA="avx2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == kernels.build_name("avx2")[0]
