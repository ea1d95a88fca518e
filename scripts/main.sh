#!/usr/bin/env bash
# The main job on the embedded default: no cluster, no GPU, no hub.
# Installs everything, imports the real small model, and evaluates it on the arithmetic task.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${NORIA_VENV:-.venv}"
"$VENV/bin/noria" models import smollm2-135m-instruct
exec "$VENV/bin/noria" eval examples/eval_smollm2_arithmetic.yaml "$@"
