#!/usr/bin/env bash
# Issue 45's probe call (one device call, ~7 minutes): where the remaining time goes before the evidence call.
#   1. decode_tests: the static engine on the GPU, incl. the fused decode kernels' start-up self-check.
#   2. decode: the decode step at SmolLM2-135M's shapes (128 rows) with one batch's kernel table.
#   3. trainer: the real qwen3_moe step (4 x 8192-token micro-batches) with one step's kernel table.
#   4. fp8: bf16 vs fp8 engines at 4 and 16 Qwen3-30B-A3B layers with each engine's kernel table.
# Carry .whl and .gpusite (benchmarks/gpu/remainders_session.sh says what they hold). PARTS="decode fp8" runs a subset.
set -u
PARTS=${PARTS:-decode_tests decode trainer fp8}
source "$(dirname "$0")/session_common.sh"
part decode_tests 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_static_engine_gpu.py
part decode 80 python3 -m benchmarks.gpu.bench_decode_step --profile --out "$OUT"
part trainer 170 python3 -m benchmarks.gpu.bench_real_step --families qwen3_moe --heads fused_loss --rows 8 \
  --seq-len 4096 --micro-batch-tokens 8192 --warmup 2 --iters 2 --profile --out "$OUT"
part fp8 150 python3 -m benchmarks.gpu.bench_fp8_decode --shapes qwen3_moe --profile --out "$OUT"
bundle
exit $STATUS
