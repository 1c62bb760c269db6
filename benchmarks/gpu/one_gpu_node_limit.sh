#!/usr/bin/env bash
# Issue 45's evidence in one device call (about 6-8 minutes on one H100 / H200; every part bounded, 530 s in all):
#   bash benchmarks/gpu/one_gpu_node_limit.sh            # GPU: $OUT gets one_gpu_node_limit.json + 6 logs
#   bash benchmarks/gpu/one_gpu_node_limit.sh --cpu-smoke
# Carried: .gpusite (hydra-core, omegaconf, antlr4-python3-runtime and gguf as pure-Python package
# directories) and .ckpt_b (the GGUF's second half; .ckpt_a came with the call just before:
# docs/guide/gpu_evidence.md). Extra arguments go to python3 -m benchmarks.gpu.one_gpu_node_limit.
set -u
OUT=${OUT:-benchmarks/results/gpu/local}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gpusite${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tail -1
python3 -m benchmarks.gpu.one_gpu_node_limit --out "$OUT" --work /tmp/one_gpu_node_limit "$@"
