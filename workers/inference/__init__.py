"""Inference role: the embedded tiny-MoE engine (engine.py) behind an SGLang-compatible
HTTP server (server.py). The orchestrator talks to it, and to real SGLang servers, only
through workers.common.inference_client."""
