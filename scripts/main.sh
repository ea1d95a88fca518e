#!/usr/bin/env bash
# The main job on the embedded default: no cluster, no GPU, no hub.
# Installs everything, imports the real small model, and trains it with GRPO on the arithmetic
# task (held-out accuracy measured on the rollout engine before step 1 and after the last step).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${NORIA_VENV:-.venv}"
"$VENV/bin/noria" models import smollm2-135m-instruct
exec "$VENV/bin/noria" train examples/grpo_smollm2_arithmetic.yaml "$@"
