"""Preflight and health: check every node's GPUs and the collective bandwidth before a job spends
its allocation, and sample GPU memory/utilization while it runs.

    gpu.py         NVML facts per node (pynvml; guarded where there is no driver)
    checks.py      judge them against the plan and cluster.preflight limits -> findings; reports
    bandwidth.py   results, nccl-tests' busbw formulas, threshold check
    nccl_tests.py  srun command for nccl-tests, parser of its tables
    bench.py       built-in torch.distributed benchmark (NCCL on GPU, gloo on CPU)
    job.py         the hetjob's first step: every node, then bandwidth per component
    heartbeat.py   light per-process GPU sample for metrics during the run
    cli.py         ``slurmrl-preflight`` (also ``python -m workers.preflight``), standalone mode
See docs/preflight.md.
"""
