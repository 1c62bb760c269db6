"""SGLang's side of both weight transports: everything that speaks to SGLang servers about weights.

Why one package: SGLang servers cannot take our embedded workers' routes (buckets, patch steps from disk), so
each transport needs SGLang-specific code, and both need some of the same (the custom weight loader, the
cost of a patch per server rank). Kept inside the transports, that code made ``filesystem/`` and
``broadcast/`` import each other; here it imports either, and neither imports the other
(tests/unit/repo/test_transport_imports.py).

  wire.py                   SGLang 0.5.23's weight-update protocol as both ends derive it (batches, the
                            update group, the custom loader's import path); torch-free at import
  broadcast_publisher.py    weights.transport=broadcast, trainer side: dense batches or a patch on SGLang's group
  broadcast_coordinator.py  weights.transport=broadcast, orchestrator side: init group, begin/update/end, verify
  patch_loader.py           the custom weight loader SGLang runs in every TP rank: a patch broadcast on its
                            group, or (filesystem) the rank's share pulled from a patch step; verified by sum64
  patch_pull.py             the per-rank selective read of a patch step (one pread per entry held)
  pull_coordinator.py       weights.transport=filesystem + weights.delta, orchestrator side: descriptors, verdicts,
                            fallbacks to a full step
  patch_cost.py, pull_cost.py  the plan's (and the simulator's) cost of a patch update into SGLang servers

Torch-free where the launcher reads it (the transports' checks); whether a run's servers are SGLang's is
:func:`workers.common.registry.speaks_sglang`.
"""
