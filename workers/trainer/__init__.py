"""Trainer role: data-parallel policy-gradient training of the MoE policy.

Modules: ``loop`` (the per-rank training loop, entry ``train``), ``loss`` (pure loss and
metric math), ``batch`` (rollout batches: wait, load, check, shard, prune), ``parallel``
(ParallelDims + process group), ``metrics`` (metrics.jsonl, TensorBoard, log lines).
Run one process per rank with ``python -m workers.trainer``; the trainer talks to other
roles only through files in run_dir (workers.common.protocol).
"""
