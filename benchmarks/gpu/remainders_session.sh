#!/usr/bin/env bash
# Issues 43-45's GPU checks (each part bounded; all five take ~12 minutes: run them in two calls with PARTS):
#   1. gpu_tests: the paths CPU CI cannot run (GPT-OSS / Gemma 3 under CUDA graphs, the static engine's
#      staged weight swap under graphs, LoRA on the engine, DSA's fused kernel compiled at GLM-5's widths).
#   2. loop: benchmarks.gpu.one_gpu_node_limit's loop + decode-step parts (random weights at SmolLM2's
#      shapes unless .ckpt_a/.ckpt_b were carried): loop_interval_over_bound after the staged apply.
#   3. dsa: one GLM-5 attention layer at 32k / 131k tokens, torch path and fused kernel side by side.
#   4. lora_step: a qwen3_moe real-shape LoRA step (r 8) against the full step (bench_lora_step.py; each row
#      compiles for ~35 s, so one rank keeps the part within its limit).
#   5. fp8: the static engine in bf16 and fp8 on the same prompts (bench_fp8_decode.py).
# Carry .whl (omegaconf, xxhash, nvidia-ml-py, PyYAML wheels; NOT pytest: the image has pytest 9) and
# .gpusite (hydra-core, omegaconf, antlr4, gguf as package directories). PARTS="gpu_tests dsa" runs a subset.
#   bash benchmarks/gpu/remainders_session.sh          # results and logs under $OUT
set -u
PARTS=${PARTS:-gpu_tests loop dsa lora_step fp8}
source "$(dirname "$0")/session_common.sh"
part gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemma3_gpt_oss_gpu.py \
  tests/gpu/test_static_engine_gpu.py tests/gpu/test_lora_engine_gpu.py tests/gpu/test_dsa_fused_gpu.py tests/gpu/test_fp8_gpu.py
part loop 160 python3 -m benchmarks.gpu.one_gpu_node_limit --out "$OUT/limit" --work /tmp/one_gpu_node_limit \
  --parts loop engine --budget-s 150 --loop-limit-s 90 --engine-limit-s 50 --steps 30
part dsa 170 python3 -m benchmarks.gpu.bench_dsa_layer --out "$OUT"
part lora_step 150 python3 -m benchmarks.lora --gpu-step --ranks 8 --out "$OUT"
part fp8 150 python3 -m benchmarks.gpu.bench_fp8_decode --out "$OUT"
bundle
exit $STATUS
