"""Trainer role: policy-gradient training of the policy, FSDP2 over data parallel for any family
(tp = ep = 1) or Megatron-style TP x EP x DP through a family's own plan.

Modules: ``loop`` (the per-rank training loop, entry ``train``), ``step`` (one optimizer
step: forward per micro-batch, loss, backward, grad sync), ``fsdp`` (the generic FSDP2 plan
of any CausalLM), ``precision`` (fp32 master weights, compute dtype), ``micro`` (micro-batches,
activation checkpointing), ``dcp_state`` (reshardable checkpoints of the FSDP plan), ``loss`` (pure loss and metric math), ``batch``
(rollout batches: wait, load, check, shard, prune), ``parallel`` (ParallelDims: degrees,
rank layout, process groups), ``tensor_parallel`` / ``expert_parallel`` (the sharded
layers), ``sharded_model`` (tiny_moe with those layers, full HF state dict gather),
``router_replay`` and ``packing`` (per-position data that travels with its token),
``metrics`` (metrics.jsonl, TensorBoard, log lines). Run one process per rank with
``python -m workers.trainer``; the trainer talks to other roles only through files in
run_dir (workers.common.protocol).
"""
