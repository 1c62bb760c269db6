"""Inference role: backends behind one interface (spec.py BackendSpec, registry BACKENDS).

  embedded/  the tiny-model engine of this repo behind SGLang's HTTP API (local runs, CI, one GPU)
  sglang/    SGLang servers on GPU nodes behind smg
A server task (``python -m workers.inference``) loads the run config and asks the backend named
by ``inference.backend`` to serve. The orchestrator talks to every backend through
workers.common.inference_client (SGLang's native HTTP API).
"""
