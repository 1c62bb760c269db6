"""Weight transports: how trained weights get from the trainer ranks into inference.

One package per transport, registered in ``workers.common.registry.TRANSPORTS`` under the
name ``weights.transport`` gives it (spec.py: :class:`~workers.weights.spec.TransportSpec`):

  filesystem/   trainer ranks write run_dir/weights/step_N; workers load it from disk
  broadcast/    trainer ranks broadcast into inference memory: buckets into embedded workers,
                SGLang's own protocol into SGLang servers (sglang_*.py)
  <plugin>/     anything else, registered from outside (tests/plugins/weights_plugin.py)

Each has ``__init__`` (torch-free: config schema, plan check, the protocol in its docstring),
``publisher.py`` (trainer), ``receiver.py`` (inference) and ``coordinator.py`` (orchestrator).
Shared here: base.py (interfaces, TensorMeta, SyncStats, WeightLoadError, peers and shares),
coordinator.py (pause -> load or send -> verify -> continue), checksums.py, digest.py,
shards.py. Nothing here imports a transport package; transports import these.
"""
