#!/usr/bin/env bash
# Installs everything and runs the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${NORIA_VENV:-.venv}"
# --durations: the slowest tests, listed at the end (the suite must stay well under 30 min on 2 cores).
exec "$VENV/bin/python" -m pytest -q --durations=25 "$@"
