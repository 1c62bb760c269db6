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
source "$(dirname "$0")/session_common.sh"
part gpu_tests 100 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemma3_gpt_oss_gpu.py \
  tests/gpu/test_static_engine_gpu.py tests/gpu/test_lora_engine_gpu.py
part parity_qwen3 120 python3 -m benchmarks.model_parity --device cuda --dtype bfloat16 --size real --families qwen3 --compile on \
  --iters 3 --batch 2 --seq 4096 --adamw fused --out "$OUT/model_parity_real_qwen3.json"
part parity_gpt_oss 120 python3 -m benchmarks.model_parity --device cuda --dtype bfloat16 --size real --families gpt_oss --compile on \
  --iters 3 --batch 2 --seq 4096 --adamw fused --out "$OUT/model_parity_real_gpt_oss.json"
part limit 255 python3 -m benchmarks.gpu.one_gpu_node_limit --out "$OUT" --work /tmp/one_gpu_node_limit \
  --budget-s 250 --loop-limit-s 80 --engine-limit-s 60 --steps 30
exit $STATUS
