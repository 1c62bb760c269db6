#!/usr/bin/env bash
# Issue 36's numbers in one call (about 8 minutes on one H200): the log-prob head (fused vs checkpointed
# vs full logits), GLM-5's DSA at 32k and 131k tokens (step_s, peak memory), benchmarks.model_parity's
# real-shape rows (128 experts top-8, 152k / 164k vocabularies; ours and transformers, both compiled)
# and the real trainer step's MFU at those shapes; where that step's time goes (profile: phases and the
# top kernels, ours and transformers compiled). Run from the repo root:
#   bash benchmarks/gpu/kernels_session.sh            # GPU; JSON + logs under $OUT (default: the ignored
#                                                     # benchmarks/results/gpu/local/)
#   bash benchmarks/gpu/kernels_session.sh --record   # also copy the JSON into benchmarks/results/gpu/ (tracked)
#   bash benchmarks/gpu/kernels_session.sh --smoke    # CPU, toy sizes: the same commands, in a minute or two
#   bash benchmarks/gpu/kernels_session.sh --parts model_parity_real,real_step   # only those parts
#   bash benchmarks/gpu/kernels_session.sh --parts lora_step   # issue 44: LoRA r8 / r32 step vs full (bench_lora_step.py)
# Each part has its own time limit, so one that overruns leaves the others' results.
set -u
SMOKE=0; RECORD=0; PARTS=all
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;; --record) RECORD=1 ;;
    --parts) PARTS=${2:?--parts needs a comma list: logprob_head,long_context_dsa,model_parity_real,real_step,profile,lora_step}; shift ;;
    *) echo "unknown argument $1 (--smoke, --record, --parts LIST)"; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-benchmarks/results/gpu/local}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
source "$(dirname "${BASH_SOURCE[0]}")/session_part.sh"

if [ $SMOKE = 1 ]; then
  part logprob_head 300 $PY -m benchmarks.gpu.bench_logprob_head --smoke --out "$OUT"
  part long_context_dsa 600 $PY -m benchmarks.long_context_dsa --seq-lens 512 1024 --dense-max 0 --chunk 64 \
    --out "$OUT/long_context_dsa.json"
  part model_parity_real 600 $PY -m benchmarks.model_parity --size real --toy --families qwen3_moe,deepseek_v3 \
    --compile on --compile-backend aot_eager --iters 1 --batch 2 --seq 32 --out "$OUT/model_parity_real.json"
  part real_step 600 $PY -m benchmarks.gpu.bench_real_step --smoke --out "$OUT"
  part lora_step 300 $PY -m benchmarks.lora --gpu-step --toy --out "$OUT"
  part profile 600 $PY -m benchmarks.gpu.profile_model_parity --toy --device cpu --backend aot_eager --iters 1 \
    --top 5 --families qwen3_moe --out "$OUT"
else
  nvidia-smi > "$OUT/nvidia-smi.log" 2>&1
  part logprob_head 40 $PY -m benchmarks.gpu.bench_logprob_head --out "$OUT"
  part long_context_dsa 90 $PY -m benchmarks.long_context_dsa --device cuda --seq-lens 32768 131072 --dense-max 0 \
    --out "$OUT/long_context_dsa.json"
  part model_parity_real 250 $PY -m benchmarks.model_parity --size real --device cuda --dtype bfloat16 \
    --families qwen3_moe,deepseek_v3 --batch 2 --seq 4096 --iters 3 --out "$OUT/model_parity_real.json"
  part real_step 200 $PY -m benchmarks.gpu.bench_real_step --out "$OUT"
  part lora_step 300 $PY -m benchmarks.lora --gpu-step --out "$OUT"
  part profile 300 $PY -m benchmarks.gpu.profile_model_parity --fused-adamw --top 40 --out "$OUT"
fi

if [ $RECORD = 1 ]; then
  for f in logprob_head.json long_context_dsa.json model_parity_real.json real_step.json profile_model_parity.json \
           lora_step.json; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "benchmarks/results/gpu/$f" && echo "recorded benchmarks/results/gpu/$f"
  done
fi
exit $STATUS
