"""Family ``gpt_oss`` (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): config.py schema, model.py torch
module from the shared blocks, spec.py registration and config.json mapping (MXFP4 checkpoints are
dequantised by the loader: workers/models/mxfp4.py)."""
