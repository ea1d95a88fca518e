#!/usr/bin/env bash
# The GPU tests and benchmarks in one call (one CUDA GPU; see issue 9).
# Each part runs even if an earlier one failed; the exit status is non-zero if any failed.
# JSON figures go to $RESULTS (default benchmarks/results/), logs beside them; with $OUT set
# (the device tool) both are copied there as well.
#   PARTS="tests engine train sync" scripts/gpu.sh
#   PARTS=moe scripts/gpu.sh; PARTS=moe-train scripts/gpu.sh   (Qwen3-MoE: GPU tests, noria bench gpu-moe)
#   PARTS=diffusion scripts/gpu.sh              (image models; bring diffusers' wheel: see docs/diffusion.md)
#   PARTS=megatron scripts/gpu.sh               (train.backend megatron vs FSDP2; bring megatron-core's wheel: docs/megatron.md)
#   PARTS=multi scripts/gpu.sh                  (2 GPUs; LAYOUT=one-gpu on one, see noria bench gpu-multi --help)
set -u
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-benchmarks/results}
PARTS=${PARTS:-"tests engine train sync fp8"}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
status=0

part() {  # part NAME SECONDS COMMAND...: run (killed after SECONDS), log to $RESULTS/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" = 0 ] || status=1
}

$PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
for p in $PARTS; do
  case $p in
    tests) part gpu-tests ${T_TESTS:-300} $PY -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_cuda.py tests/sync/test_sync_gpu.py tests/train/test_train_gpu.py ;;
    engine) part gpu-engine ${T_ENGINE:-600} $PY -m noria bench gpu-engine --json "$RESULTS/gpu-engine.json" ${ENGINE_ARGS:-} ;;
    train) part gpu-train ${T_TRAIN:-300} $PY -m noria bench gpu-train --json "$RESULTS/gpu-train.json" ${TRAIN_ARGS:-} ;;
    sync) part gpu-sync ${T_SYNC:-300} $PY -m noria bench gpu-sync --json "$RESULTS/gpu-sync.json" ${SYNC_ARGS:-} ;;
    rl) part gpu-rl ${T_RL:-420} $PY -m noria bench gpu-rl --json "$RESULTS/gpu-rl.json" ${RL_ARGS:---prompts 8,64 --new-tokens 32,256} ;;
    moe)  # issue 23: Qwen3-MoE on one GPU: tests, then decode vs HF generate and the route capture overhead
      part gpu-moe-tests ${T_MOE_TESTS:-200} $PY -m pytest -q -p no:cacheprovider tests/models/test_models_moe_gpu.py tests/models/test_models_moe.py
      part gpu-moe ${T_MOE:-360} $PY -m noria bench gpu-moe --parts decode,capture --json "$RESULTS/gpu-moe.json" ${MOE_ARGS:-} ;;
    moe-train)  # issue 23: one RL step of the same Qwen3-MoE shape, tokens/s and MFU on active parameters
      part gpu-moe-train ${T_MOE_TRAIN:-540} $PY -m noria bench gpu-moe --parts train --json "$RESULTS/gpu-moe-train.json" ${MOE_TRAIN_ARGS:-} ;;
    diffusion)  # issue 26: needs diffusers (pip install its wheel first): image engine/trainer tests, then noria bench diffusion
      part gpu-diffusion-tests ${T_DIFFUSION_TESTS:-300} $PY -m pytest -q -p no:cacheprovider tests/diffusion/test_diffusion_cuda.py
      part gpu-diffusion ${T_DIFFUSION:-540} $PY -m noria bench diffusion --device cuda --json "$RESULTS/gpu-diffusion.json" ${DIFFUSION_ARGS:-} ;;
    megatron)  # issue 27: train.backend megatron (megatron-core installed first: docs/megatron.md): GPU tests against
      # FSDP2, one RL step side by side (1.7B dense, pruned Qwen3-30B-A3B MoE), the RL loop with weight sync
      part gpu-megatron-tests ${T_MEGATRON_TESTS:-420} $PY -m pytest -q -s -p no:cacheprovider tests/train/test_megatron_gpu.py tests/train/test_megatron.py
      part gpu-megatron-train ${T_MEGATRON_TRAIN:-420} $PY -m noria bench gpu-train --backend megatron,fsdp2 --json "$RESULTS/gpu-megatron-train.json" ${MEGATRON_TRAIN_ARGS:-}
      part gpu-megatron-moe-train ${T_MEGATRON_MOE:-420} $PY -m noria bench gpu-train --backend megatron,fsdp2 --model qwen3-30b-a3b --layers 6 --json "$RESULTS/gpu-megatron-moe-train.json" ${MEGATRON_MOE_ARGS:-}
      part gpu-megatron-rl ${T_MEGATRON_RL:-420} $PY -m noria bench gpu-rl --set train.backend=megatron --json "$RESULTS/gpu-megatron-rl.json" ${MEGATRON_RL_ARGS:---prompts 8 --new-tokens 64} ;;
    fp8) part gpu-fp8 ${T_FP8:-300} $PY -m noria bench gpu-fp8 --json "$RESULTS/gpu-fp8.json" ${FP8_ARGS:-} ;;
    multi)  # issue 10: needs 2 GPUs (LAYOUT=one-gpu runs the same code on one); NVLink multicast off in every process
      export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
      part gpu-multi-tests ${T_MULTI_TESTS:-300} $PY -m pytest -q -x -p no:cacheprovider tests/launch/test_multi_gpu_cuda.py tests/sync/test_sync_gpu.py tests/train/test_train_gpu.py
      part gpu-multi-${LAYOUT:-two-gpus} ${T_MULTI:-600} $PY -m noria bench gpu-multi --layout "${LAYOUT:-two-gpus}" --json "$RESULTS/gpu-multi-${LAYOUT:-two-gpus}.json" ${MULTI_ARGS:-} ;;
    *) echo "unknown part $p"; status=1 ;;
  esac
done
if [ -n "${OUT:-}" ]; then cp "$RESULTS"/gpu-*.json "$OUT"/ 2>/dev/null; cat "$RESULTS"/gpu-*.log > "$OUT/gpu-logs.txt"; fi
exit $status
