"""Trainer role: policy-gradient training of the policy, FSDP2 over data parallel for any family
(tp = ep = 1) or FSDP2 + DTensor TP + EP on one DeviceMesh (the mesh plan) when tp or ep > 1.

Modules: ``loop`` (the per-rank training loop, entry ``train``), ``step`` (one optimizer
step: forward per micro-batch, loss, backward, grad sync), ``parallel/`` (how the model is split
over the ranks: ParallelDims and process groups, the FSDP2 and mesh plans, TP, EP, CP, grad
clipping, the plan table), ``precision`` (fp32 master weights, compute dtype), ``micro``
(micro-batches, activation checkpointing), ``dcp_state`` (reshardable checkpoints of both plans),
``loss`` (pure loss and metric math), ``batch`` (rollout batches: wait, load, check, shard, prune),
``router_replay`` and ``packing`` (per-position data that travels with its token),
``metrics`` (metrics.jsonl, TensorBoard, log lines). Run one process per rank with
``python -m workers.trainer``; the trainer talks to other roles only through files in
run_dir (workers.common.protocol).
"""
