#!/usr/bin/env bash
# Installs everything and runs the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${NORIA_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q "$@"
