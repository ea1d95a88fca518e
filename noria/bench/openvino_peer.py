"""OpenVINO GenAI as a peer of ``noria bench engine`` (``--peers openvino``).

OpenVINO has the fastest CPU decode we have measured outside Noria, at int8 and int4 weights
(``noria/engine/quant.py``'s recipes are the comparison: per-channel symmetric int8, group-wise
asymmetric int4). It cannot load an HF folder: the model is exported once to OpenVINO IR by
optimum-intel (NNCF compresses the weights at export), which is why it is not an RL rollout engine
(a weight sync would be a re-export: 75 s to 3 min for SmolLM2-135M); here it is a decode peer.

- The venv: ``$NORIA_HOME/bench/openvino`` with :data:`PACKAGES`, created on first use like vLLM's
  (``noria.engine.vllm_server.vllm_python_path``; ``scripts/test.sh`` creates both before the tests).
- The export: ``optimum-cli export openvino`` of the model folder per weight format, cached under
  ``$NORIA_HOME/bench/openvino/models`` (the folder's path, its files' sizes and times and the format
  in the name), written to a temporary folder and renamed when complete. Each export records its
  model folder (:data:`SOURCE`); a new export first deletes those whose model folder is gone (a
  test's temporary model, say), which nothing else would ever remove.
- The run: ``openvino_worker.py`` in that venv, fed the same token ids as every engine of the bench.

Weight formats, by ``--quant`` value: ``none`` the model's own fp32 weights (``--weight-format
fp32``); ``int8``: ``int8 --sym`` (one scale per output channel, as Noria's); ``int4``: ``int4
--group-size 32 --ratio 1.0`` (asymmetric groups of 32 input channels, as Noria's, every linear
layer in int4). Not identical: OpenVINO's int8 also compresses the embedding and the LM head, its
int4 keeps them in int8 (NNCF's backup precision), where Noria keeps both in the model dtype.
As AVX2 (``NORIA_CPU_ISA=avx2``) on an AVX-512 CPU, int8 and int4 are refused: see :func:`check_isa`.
Inference precision: OpenVINO's ``INFERENCE_PRECISION_HINT`` is set to the dtype the bench runs (on
a CPU with native bf16 OpenVINO would otherwise pick bf16 for an fp32 run).

Two peers, by ``--peers`` name (:data:`MODES`):

- ``openvino``: Noria's precision class, weight-only. OpenVINO's CPU plugin by default quantizes
  the activations of every weight-compressed layer to int8 on the fly (groups of 32,
  ``DYNAMIC_QUANTIZATION_GROUP_SIZE``) and multiplies in int8, and stores the KV cache in u8
  (``KV_CACHE_PRECISION``); this peer turns both off (activations and KV cache in the run's dtype),
  as Noria's engine computes, and as a trainer's QAT forward can reproduce.
- ``openvino_defaults``: OpenVINO's defaults (int8 activations, u8 KV cache): a lower precision
  class, reported beside the first. Measured on the 2-core Zen 4 (int8 export, 64 new tokens, bf16):
  410.9 and 630.4 tokens/s at batches 8 and 32 with the defaults; 245.5 and 472.2 with dynamic
  quantization off; 432.7 and 679.3 with only the KV cache in bf16: the int8 activations are what
  makes its int8 export fast, not the u8 cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from noria.process import run as run_command

PACKAGES = ["torch==2.13.0", "openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0", "openvino-genai==2026.4.1.0",
            "optimum-intel[openvino]==2.2.0", "nncf==3.4.0", "transformers==5.5.4"]  # fmt: skip
"""What the venv holds, installed in one resolve (OpenVINO's three packages share a release; torch is
Noria's pinned CPU build, which optimum's export traces the model with; transformers is what
optimum-intel 2.2 resolved to)."""

EXPORT_ARGS = {
    "none": ["--weight-format", "fp32"],
    "int8": ["--weight-format", "int8", "--sym"],
    "int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],
}
"""``optimum-cli export openvino`` arguments per ``--quant`` value (see the module docstring)."""


def openvino_home() -> Path:
    from noria.models.catalog import noria_home

    return noria_home() / "bench" / "openvino"


def openvino_python_path() -> Path:
    """The OpenVINO venv's interpreter, creating the venv on first use (a few minutes)."""
    venv = openvino_home()
    python = venv / "bin" / "python"
    marker = venv / (".installed-" + hashlib.sha256(" ".join(PACKAGES).encode()).hexdigest()[:12])
    if not marker.exists():
        print(f"installing OpenVINO GenAI and optimum-intel into {venv} (once; a few minutes)", file=sys.stderr)
        run_command([sys.executable, "-m", "venv", str(venv)])
        run_command([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PACKAGES])
        # optimum-intel pulls a torchvision built for another torch; transformers then fails to import
        # its models (``torchvision::nms does not exist``). The export needs none of it.
        run_command([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision"], check=False)
        marker.touch()
    return python


SOURCE = "noria_source.json"
"""The file in each export naming the model folder it was made from."""


def exported(folder: Path, quant: str) -> Path:
    """The OpenVINO IR of the model ``folder`` with ``quant``'s weights, exported on first use."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    key = json.dumps([str(folder.resolve()), quant, [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]])
    out = openvino_home() / "models" / f"{folder.name}-{quant}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "openvino_model.xml").exists():
        return out
    python = openvino_python_path()
    prune_exports(out.parent)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"exporting {folder} to OpenVINO IR ({' '.join(EXPORT_ARGS[quant])}) into {out} (once)", file=sys.stderr)
    cli = python.parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "--model", str(folder), "--task", "text-generation-with-past", *EXPORT_ARGS[quant], str(tmp)]
    proc = run_command(cmd, check=False, capture=True, env={"HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0 or not (tmp / "openvino_model.xml").exists():
        raise RuntimeError(f"OpenVINO export of {folder} ({quant}) failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    (tmp / SOURCE).write_text(json.dumps({"folder": str(folder.resolve()), "quant": quant}))
    tmp.rename(out)
    return out


def prune_exports(models: Path) -> list[Path]:
    """Delete the exports under ``models`` whose model folder no longer exists; returns them. An
    export without :data:`SOURCE` (made before it existed) is kept."""
    gone = []
    for export in sorted(models.glob("*")):
        try:
            source = Path(json.loads((export / SOURCE).read_text())["folder"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not source.is_dir():
            shutil.rmtree(export, ignore_errors=True)
            gone.append(export)
    return gone


def check_isa(quants: list[str]) -> None:
    """Refuse int8 and int4 when acting as AVX2 on an AVX-512 CPU: OpenVINO's release build picks its
    kernels on the CPU's own flags (its limit, ``OV_CPU_MAX_ISA``, exists only in debug builds), while
    oneDNN inside it obeys ``ONEDNN_MAX_CPU_ISA=AVX2``, and its weight-compressed linear then fails
    (measured with 2026.4.1; fp32 runs)."""
    from noria.hardware import ENV_ISA, hides_avx512

    compressed = [q for q in quants if q != "none"]
    if compressed and hides_avx512():
        raise SystemExit(
            f"--peers openvino --quant {','.join(compressed)}: OpenVINO cannot act as AVX2 on this AVX-512 CPU "
            f"({ENV_ISA}=avx2): its release build picks its kernels on the CPU's own flags, and with oneDNN limited "
            "to AVX2 its weight-compressed linear fails ('could not create a primitive descriptor'). Measure "
            "OpenVINO's AVX2 figures on an AVX2 machine, or leave openvino out of this run"
        )


MODES = ("openvino", "openvino_defaults")
"""The OpenVINO peers (see the module docstring): Noria's precision class, and OpenVINO's defaults."""


def openvino_figures(folder: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, dtype: str, quant: str,
                     group: int = 1, mode: str = "openvino") -> dict[int, float]:  # fmt: skip
    """tokens/s per batch size of OpenVINO GenAI's continuous-batching pipeline on ``quant``'s export,
    in ``mode`` (:data:`MODES`)."""
    from noria.bench.engine import worker_figures

    if mode not in MODES:
        raise ValueError(f"OpenVINO peer mode {mode!r}: choose from {MODES}")
    precision = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    properties = {} if mode == "openvino_defaults" else {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, "KV_CACHE_PRECISION": precision}
    return worker_figures(openvino_python_path(), "openvino_worker.py", "OpenVINO", exported(folder, quant), prompts, batches,
                          new_tokens, group, precision=precision, properties=properties)  # fmt: skip
