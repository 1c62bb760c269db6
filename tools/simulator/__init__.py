"""Discrete-event simulator of the whole RL system at cluster scale (``python -m tools.simulator``).

Why: the deployments this project is for (GLM-5 on 28+ H200 nodes) cannot run here, yet
their node split, batch size and staleness window must be chosen before anyone submits.
The simulator replays the real orchestrator rules (``groups_to_launch`` and the
``RolloutBuffer`` staleness window, imported from workers/orchestrator/buffer.py) over
models of each role whose costs come from published numbers (assumptions.py) or, for the
tiny local setup, from local runs (calibrate.py).

    engine.py       event loop, processor-sharing servers, shared-CPU contention
    assumptions.py  every published-scale number, with its source
    costs.py        FLOPs, bytes and seconds per role, from the model facts and a layout
    layout.py       JobPlan -> simulated replicas; candidate node splits re-planned by build_plan
    workload.py     rollout shapes: turns, token counts, env latencies (lognormal / Pareto)
    system.py       orchestrator + inference + trainer wired together on the engine
    calibrate.py    fit the local cost terms on runs/*/metrics.jsonl, report prediction error
    study.py        split search, scaling, sensitivity, and the plot
"""
