"""How the trainer splits one model over its ranks: everything a sharding plan is made of.

Why a package: these modules change together when a parallelism changes, and for other reasons
than the step does (loss, micro-batches, checkpoints); the step and the loop use them through a
few names (``ParallelDims``, a plan's model, ``context.split``, ``expert_capacity``).

  dims.py             ParallelDims: the degrees, the rank layout and the process groups
  plans.py            the plan table a family's ``ModelSpec.parallelize`` names, holding the functions
  fsdp.py             the FSDP2 plan of any CausalLM (tp = ep = 1)
  mesh.py             FSDP2 + TP + EP (+ CP) on one DeviceMesh (tp or ep > 1)
  tensor.py           TP gradient helpers and the vocab-parallel log-probs
  expert.py           EP: a MoE block's experts over the ep ranks
  expert_exchange.py  EP's row all-to-all (exact and fixed capacity); imports no other EP module
  expert_capacity.py  the step's fixed EP capacity and its overflow redo
  context.py          CP: each rank's chunk of every sequence
  grad_clip.py        the global grad-norm clip over sharded gradients

Nothing is re-exported here: import the module that holds the name.
"""
