"""scripts/setup.sh installs torch's CPU build on a machine without an NVIDIA driver, as the README
says, and leaves a mirror alone. The script's decision (``torch_index``) runs for real in bash; pip is
a stand-in that answers ``pip config list`` and the local-wheel dry run as a given machine would, so
nothing is installed or downloaded (under a second)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

FAKE_PYTHON = """#!/usr/bin/env bash
# python -m pip config list | python -m pip install --dry-run ... --report FILE | python -c ...
if [ "$1 $2 $3" = "-m pip config" ]; then printf '%s\\n' "$FAKE_PIP_CONFIG"; exit 0; fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  [ -n "$FAKE_LOCAL_TORCH" ] || exit 1  # no local wheel of torch==2.13.0: pip --no-index finds nothing
  for ((i = 1; i <= $#; i++)); do
    if [ "${!i}" = --report ]; then j=$((i + 1)); printf '{"install": [{"metadata": {"name": "torch", "version": "%s"}}]}' "$FAKE_LOCAL_TORCH" > "${!j}"; fi
  done
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def torch_index(tmp_path: Path, driver: bool = False, local: str = "", config: str = "", **env: str) -> str:
    """What ``torch_index`` prints on a machine with (or without) an NVIDIA driver, this local wheel of
    torch (a version, or none), this ``pip config list`` and these environment variables."""
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    stub = "has_nvidia_driver() { return 0; }" if driver else "has_nvidia_driver() { return 1; }"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NORIA_TORCH"))}
    done = subprocess.run(
        ["bash", "-c", f'source "{SETUP}"; {stub}; torch_index "{python}"'],
        env={**base, "REAL_PYTHON": sys.executable, "FAKE_LOCAL_TORCH": local, "FAKE_PIP_CONFIG": config, **env},
        capture_output=True, text=True, timeout=30, check=True,
    )
    return done.stdout.strip()


@pytest.mark.parametrize(
    "machine, expected",
    [
        ({}, CPU_INDEX),  # no driver, no local wheel: PyPI alone would give the CUDA build
        ({"local": "2.13.0+cpu"}, ""),  # a local CPU wheel (--find-links) is taken as it is
        ({"local": "2.13.0"}, CPU_INDEX),  # a local wheel of the CUDA build does not count
        ({"driver": True}, ""),  # an NVIDIA driver: PyPI's CUDA build
        ({"PIP_INDEX_URL": "https://mirror.example/simple"}, ""),  # a mirror is the only source: left alone
        ({"config": "global.index-url='https://mirror.example/simple'"}, ""),  # the same, in pip's config
        ({"config": "global.extra-index-url='file:///opt/pypi/simple'"}, CPU_INDEX),  # an extra index is no mirror
        ({"NORIA_TORCH_INDEX": "none"}, ""),  # opted out
        ({"NORIA_TORCH_INDEX": "https://mirror.example/whl/cpu", "driver": True}, "https://mirror.example/whl/cpu"),
    ],
)
def test_setup_takes_torch_from_the_cpu_index_only_without_a_driver_mirror_or_local_cpu_wheel(tmp_path, machine, expected):
    assert torch_index(tmp_path, **machine) == expected


def test_setup_installs_torch_with_that_index_and_the_readme_says_what_it_does():
    script, readme = SETUP.read_text(), (ROOT / "README.md").read_text()
    assert 'pip install ${index:+--extra-index-url "$index"} "torch==$TORCH_VERSION"' in script
    assert script.index("torch==$TORCH_VERSION\"\n") < script.index('pip install -e ".[')  # torch first
    for fact in ("torch==2.13.0", CPU_INDEX, "PIP_INDEX_URL", "NORIA_TORCH_INDEX=none", "NVIDIA driver"):
        assert fact in readme, fact
