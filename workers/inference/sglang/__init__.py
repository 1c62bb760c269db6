"""The SGLang backend (``inference.backend=sglang``): SGLang servers on GPU nodes behind smg.

  config.py         the schema: SGLangInferenceConfig, per-role SGLangServerLayout, SGLangConfig, RouterConfig
  checks.py         plan-time rules and the sbatch command previews (pure, no sglang import)
  args.py           config + placement -> ``python -m sglang.launch_server`` argv and step env
  server.py         a server task: its place in the replica (from the Topology), exec into SGLang
  router.py         the router task: smg's argv, exec into smg
  router_client.py  the orchestrator's generation client through smg (sticky routing key)
  ports.py          extra ports SGLang needs inside the job's port range
  spec.py           registers the backend (workers/inference/spec.py BackendSpec)
"""
