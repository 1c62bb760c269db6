#!/usr/bin/env bash
# The GPU evidence of the new model families and of one GPU node's limit, in ONE device call (~9 minutes):
#   1. GPU tests of the paths CPU CI cannot run: windowed / sink attention on the CUDA kernels, grouped-GEMM
#      GPT-OSS experts, CUDA-graph decode of windowed layers, LoRA adapters under CUDA graphs (tests/gpu/).
#   2. benchmarks.model_parity's real-shape rows of the new families (Qwen3-8B's dense layer, GPT-OSS-20B's
#      MoE layer): ours compiled over transformers compiled, fused AdamW on both, bf16.
#   3. benchmarks.gpu.one_gpu_node_limit with a shorter budget (the loop, the decode step, the real step).
# Run from the repo root on the device, carrying .whl (pytest, omegaconf, xxhash, nvidia-ml-py wheels) and
# .gpusite (hydra-core, omegaconf, antlr4, gguf as package directories):
#   bash benchmarks/gpu/families_session.sh          # results and logs under $OUT
# Each part has its own time limit, so one that overruns leaves the others' results.
set -u
OUT=${OUT:-benchmarks/results/gpu/local}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi
export PYTHONPATH="$PWD:$PWD/.gpusite:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 NCCL_CUMEM_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
STATUS=0
part() {  # part NAME SECONDS CMD...: one part under a time limit, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -8 "$OUT/$name.log"
  echo "== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/session.log"
  [ $rc -eq 0 ] || STATUS=1
}
part gpu_tests 100 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemma3_gpt_oss_gpu.py \
  tests/gpu/test_static_engine_gpu.py tests/gpu/test_lora_engine_gpu.py
part parity_qwen3 120 python3 -m benchmarks.model_parity --device cuda --dtype bfloat16 --size real --families qwen3 --compile on \
  --iters 3 --batch 2 --seq 4096 --adamw fused --out "$OUT/model_parity_real_qwen3.json"
part parity_gpt_oss 120 python3 -m benchmarks.model_parity --device cuda --dtype bfloat16 --size real --families gpt_oss --compile on \
  --iters 3 --batch 2 --seq 4096 --adamw fused --out "$OUT/model_parity_real_gpt_oss.json"
part limit 255 python3 -m benchmarks.gpu.one_gpu_node_limit --out "$OUT" --work /tmp/one_gpu_node_limit \
  --budget-s 250 --loop-limit-s 80 --engine-limit-s 60 --steps 30
exit $STATUS
