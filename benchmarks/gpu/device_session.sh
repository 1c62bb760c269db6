#!/usr/bin/env bash
# One device call of a session, by part (each fits the 10-minute command limit):
#   loop_delta     full loop, dense vs sparse-patch weight updates, model.path = a transformers-built
#                  0.73B Qwen3-MoE (issue 31)                       -> $OUT/loop_delta/loop.json
#   one_gpu_node   experiment=one_gpu_node on the shared GPU (issue 33) -> $OUT/one_gpu_node/*.json
#   kernels        the trainer-kernel benchmarks (issue 36), if present -> $OUT/kernels/*
#   libraries      the log-prob head against liger-kernel and cut-cross-entropy (carried in .gpusite/),
#                  and whether flash-attn is importable or buildable there (issue 36) -> $OUT/libraries/*
# Hydra and OmegaConf travel as pure-Python packages in .gpusite/ (carried, ignored by git).
#   bash benchmarks/gpu/device_session.sh loop_delta [one_gpu_node ...]
set -u
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gpusite" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
python3 - <<'PY' 2>&1 | tee -a "$OUT/session.log"
import importlib, sys
for m in ("torch", "transformers", "hydra", "omegaconf", "xxhash", "aiohttp", "safetensors", "jinja2", "yaml", "numpy"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"MISSING {m}: {e}")
PY
for part in "$@"; do
  case "$part" in
    loop_delta)
      timeout 590 python3 -m benchmarks.gpu.bench_loop --out "$OUT/loop_delta" --compare delta \
        --make-checkpoint /tmp/slurmrl_ckpt_qwen3moe --steps "${LOOP_STEPS:-15}" --timeout-s "${LOOP_TIMEOUT_S:-250}" \
        2>&1 | tail -40 | tee -a "$OUT/session.log"
      for r in dense delta; do cp "$OUT/loop_delta/runs/$r/metrics.jsonl" "$OUT/loop_delta/${r}_metrics.jsonl" 2>/dev/null
        tail -5 "$OUT/loop_delta/runs/$r/logs/trainer_0.log" 2>/dev/null > "$OUT/loop_delta/${r}_trainer_tail.log"; done
      rm -rf "$OUT/loop_delta/runs" ;;
    one_gpu_node)
      timeout 590 python3 -m benchmarks.gpu.one_gpu_node --out "$OUT/one_gpu_node" 2>&1 | tail -40 | tee -a "$OUT/session.log" ;;
    kernels)
      if [ -f benchmarks/gpu/kernels_session.sh ]; then
        timeout 590 bash benchmarks/gpu/kernels_session.sh "$OUT/kernels" 2>&1 | tail -60 | tee -a "$OUT/session.log"
      else echo "no benchmarks/gpu/kernels_session.sh" | tee -a "$OUT/session.log"; fi ;;
    libraries)
      mkdir -p "$OUT/libraries"
      timeout 300 python3 -m benchmarks.gpu.bench_logprob_head --libs --out "$OUT/libraries" 2>&1 | tail -20 | tee -a "$OUT/session.log"
      { python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
        command -v nvcc && nvcc --version | tail -2 || echo "no nvcc on PATH"
        python3 -m pip download --no-deps flash-attn -d /tmp/fa 2>&1 | tail -3; } > "$OUT/libraries/flash_attn.log" 2>&1
      cat "$OUT/libraries/flash_attn.log" | tee -a "$OUT/session.log" ;;
    *) echo "unknown part $part" ;;
  esac
done
