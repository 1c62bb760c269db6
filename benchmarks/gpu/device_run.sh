#!/usr/bin/env bash
# One call on the lent GPU machine: every GPU benchmark, the GPU tests, then the preflight's
# standalone mode. Run from the repo root with $OUT set (the device tool sets it); Hydra and
# OmegaConf travel as pure-Python packages in .gpusite/ (see benchmarks/results/README.md, "GPU").
#   bash benchmarks/gpu/device_run.sh [run_all args...]
set -u
OUT=${OUT:-benchmarks/out/gpu/latest}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gpusite" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
{ nvidia-smi; env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)_' ; df -hT . /dev/shm /tmp; } > "$OUT/run.log" 2>&1
timeout "${RUN_ALL_TIMEOUT:-420}" python3 -m benchmarks.gpu.run_all --out "$OUT" "$@" 2>&1 | tee -a "$OUT/run.log"
timeout 60 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee -a "$OUT/run.log"
if [ -f workers/preflight/__main__.py ] && [ "${PREFLIGHT:-1}" = 1 ]; then
  { timeout 20 python3 -m workers.preflight --help
    timeout 100 python3 -m workers.preflight standalone --out "$OUT/preflight" --expect-gpus 1
    echo "preflight standalone exit code $?"; } > "$OUT/preflight.log" 2>&1
  tail -30 "$OUT/preflight.log"
fi
