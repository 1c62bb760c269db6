"""Cluster section: where the job runs (site profile) and the preflight limits."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from omegaconf import MISSING

from workers.common.config.ranges import LINE, NONEMPTY, TEXT, Each, Pattern, between, ge, gt, limits, one_of


@dataclasses.dataclass(kw_only=True)
class PreflightConfig:
    """Site limits for workers/preflight: GPU health through NVML, then collective bandwidth.

    Checked on every node before the roles start (``preflight=true``) and by ``slurmrl-preflight``.
    A limit of 0 (or an empty dict) only reports the number; docs/preflight.md lists every check.
    """

    expect_gpus_per_node: dict[str, int] = field(default_factory=dict)
    """GPUs NVML must show per node, by component name (``trainer: 8``); a component absent here must
    show the plan's --gpus-per-node (none for CPU components)."""
    gpu_name: Optional[str] = None
    """Text every GPU's NVML name must contain (``H200``); None: all GPUs of the job must share one name."""
    min_free_memory_gb: float = 0.0
    """Free memory each GPU must have in GiB (a leftover process of an earlier job holds memory)."""
    max_uncorrected_ecc_errors: int = 0
    """Uncorrected (double-bit) ECC errors allowed per GPU since its last reset."""
    max_retired_pages: int = 60
    """Retired memory pages allowed per GPU (pre-Ampere; NVIDIA's replacement threshold is about 60).
    A pending retirement, a pending row remap or a failed row remap always fails: the GPU needs a reset."""
    fail_on_throttle: list[str] = field(default_factory=lambda: [
        "hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown"])
    """Clock event reasons (pynvml names without the prefix, snake case) that fail a GPU; others are reported."""
    min_nvlinks_per_gpu: int = 0
    """Active NVLinks each GPU must have (18 on HGX H100/H200); 0: GPUs of a node only need equal counts."""
    nccl_tests_dir: Optional[str] = None
    """Directory with nccl-tests' all_reduce_perf, all_gather_perf, ...; None: the built-in torch benchmark."""
    nccl_tests_mpi: str = "pmix"
    """``srun --mpi`` for nccl-tests built with MPI=1 (one task per GPU); ``none``: one task per node, -g GPUs."""
    collectives: list[str] = field(default_factory=lambda: ["all_reduce", "all_gather", "alltoall", "sendrecv"])
    """Collectives to measure (nccl-tests names without ``_perf``)."""
    min_bytes: int = 1 << 20
    """Smallest message (nccl-tests -b)."""
    max_bytes: int = 1 << 30
    """Largest message (nccl-tests -e); thresholds apply to the busbw measured at this size."""
    size_factor: int = 4
    """Message size multiplier between rows (nccl-tests -f)."""
    num_iters: int = 20
    """Timed iterations per size (nccl-tests -n)."""
    num_warmup_iters: int = 5
    """Untimed iterations per size (nccl-tests -w)."""
    min_busbw_gbps: dict[str, float] = field(default_factory=dict)
    """Least bus bandwidth in GB/s per collective for components spanning several nodes (network-bound)."""
    min_busbw_gbps_intra_node: dict[str, float] = field(default_factory=dict)
    """Least bus bandwidth in GB/s per collective for single-node components and standalone runs (NVLink)."""
    benchmark_cpu_components: bool = False
    """Also measure components without GPUs (gloo over TCP): tests the Slurm path on CPU clusters."""
    timeout_s: float = 900.0
    """Deadline of each preflight step; a node that has not reported by then fails the job."""


@dataclasses.dataclass(kw_only=True)
class GroupSlurmOptions:
    """Slurm options of one het group (added after, and overriding, ``cluster.sbatch_flags``)."""

    sbatch_flags: dict[str, str] = field(default_factory=dict)
    """Extra ``#SBATCH --key=value`` flags of this group only (``constraint``, ``exclusive``, ``gres``,
    ``reservation``, ``mem`` ...); value "" renders a bare ``--key``."""


@dataclasses.dataclass(kw_only=True)
class GroupsConfig:
    """Per-het-group Slurm options: a GPU ``--constraint`` on the GPU groups, never on the CPU control group."""

    control: GroupSlurmOptions = field(default_factory=GroupSlurmOptions)
    """Orchestrator + router (CPU)."""
    inference: GroupSlurmOptions = field(default_factory=GroupSlurmOptions)
    """Unified inference servers."""
    prefill: GroupSlurmOptions = field(default_factory=GroupSlurmOptions)
    """Prefill servers (prefill/decode disaggregation)."""
    decode: GroupSlurmOptions = field(default_factory=GroupSlurmOptions)
    """Decode servers (prefill/decode disaggregation)."""
    trainer: GroupSlurmOptions = field(default_factory=GroupSlurmOptions)
    """Trainer ranks."""


@dataclasses.dataclass(kw_only=True)
class ContainerConfig:
    """Run every srun step in a container image (the batch script itself runs on the host).

    ``pyxis`` (NVIDIA enroot sites): ``--container-image/--container-mounts/--container-workdir`` on
    each srun step. ``apptainer`` (Singularity sites): each step's command runs under
    ``apptainer exec --nv --bind MOUNTS [--pwd WORKDIR] IMAGE``. The image must hold Python with
    slurmrl installed (or mount the shared venv and set ``cluster.python``)."""

    runtime: str = "none"
    """``none`` | ``pyxis`` | ``apptainer``."""
    image: str = ""
    """pyxis: an enroot image (``nvcr.io#nvidia/pytorch:25.01-py3``, a .sqsh path); apptainer: a .sif path."""
    mounts: list[str] = field(default_factory=list)
    """``SRC:DST[:FLAGS]`` bind mounts (the runs root and the shared filesystem, at least)."""
    workdir: str = ""
    """Working directory inside the container; "" keeps the submit directory."""


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    name: str = MISSING
    """Profile name (``local``, ``local_slurm``, a site name)."""
    backend: str = "local"
    """``local``: roles are processes on this machine. ``slurm``: one heterogeneous sbatch job."""
    partition: Optional[str] = None
    """Slurm partition (``#SBATCH --partition``); None leaves the site default."""
    account: Optional[str] = None
    """Slurm account to charge."""
    qos: Optional[str] = None
    """Slurm QoS."""
    num_gpus_per_node: int = 0
    """GPUs on each compute node (0 on CPU-only clusters)."""
    num_cpus_per_node: int = 2
    """CPU cores on each compute node."""
    mem_per_node_gb: int = 0
    """Memory per node in GB to request (0: the node's default)."""
    runs_root: str = "runs"
    """Where run directories are created; on clusters a shared filesystem (Lustre, GPFS)."""
    template_dir: Optional[str] = None
    """Directory of admin-edited sbatch templates; None uses the packaged sbatch_templates/."""
    time_limit: str = "01:00:00"
    """Slurm time limit of the job (HH:MM:SS)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported to every role (NCCL_*, UCX_*, ...)."""
    cpu_partition: Optional[str] = None
    """Partition for components without GPUs (orchestrator, router); None: ``partition``."""
    gpu_memory_gb: float = 0.0
    """Memory of one GPU in GB, for the plan's memory estimates (0: no estimate)."""
    nic_gb_s: float = 50.0
    """Network bandwidth per GPU in GB/s (InfiniBand NDR 400 Gb/s per GPU = 50), for the plan's
    weight-update estimate (workers/weights/sglang/wire.update_cost; the simulator uses the same)."""
    shared_fs_gb_s: float = 100.0
    """Aggregate read bandwidth in GB/s of the shared filesystem holding the run directory (Lustre,
    GPFS), for the plan's estimate of sparse patches pulled by every SGLang rank at once
    (workers/weights/sglang/pull_cost.py; the simulator's ``weights.fs_gb_s`` assumption is the same
    default: a mid-size scratch filesystem)."""
    node_address: str = "{node}"
    """How a Slurm node name becomes an address peers connect to: ``{node}`` (DNS), a pattern such
    as ``{node}-ib``, or a fixed address (``127.0.0.1`` where every virtual node is this host)."""
    port_min: int = 20000
    """Lowest port a job uses; each job gets ``port_span`` ports at a slot chosen by its job id."""
    port_span: int = 64
    """Ports reserved per job (trainer master, router, weight group, two per inference server)."""
    num_port_slots: int = 150
    """Distinct port ranges: job J uses port_min + (J % num_port_slots) * port_span onwards."""
    signal_grace_s: int = 120
    """Seconds of warning before the time limit or preemption (``--signal=B:USR1@N``)."""
    requeue: bool = True
    """Submit with ``--requeue`` and requeue on USR1 (time limit, preemption) up to max_requeues times."""
    max_requeues: int = 2
    """Most automatic requeues of one job (SLURM_RESTART_COUNT stops the batch script beyond it)."""
    server_respawns: int = 2
    """Slurm: times each inference server step (``inference``/``prefill``/``decode``) that died
    (crash, SIGKILL, ``scancel JOB.STEP``) is started again as a new ``srun --het-group=K`` step on
    its nodes before the job fails (launcher/supervisor.py); 0 is fail-fast. The orchestrator
    re-admits the new servers at its current weights (workers/orchestrator/faults.py)."""
    respawn_backoff_s: float = 5.0
    """Seconds before the first respawn of a server step; doubled for each further one."""
    respawn_backoff_max_s: float = 60.0
    """Longest wait before a respawn (the doubling stops here)."""
    sbatch_flags: dict[str, str] = field(default_factory=dict)
    """Extra ``#SBATCH --key=value`` flags for every component (value "" renders a bare ``--key``);
    per-group flags: ``cluster.groups.<control|inference|prefill|decode|trainer>.sbatch_flags``."""
    groups: GroupsConfig = field(default_factory=GroupsConfig)
    """Slurm options of each het group (constraint, exclusive, gres, reservation, mem)."""
    gpu_mem_whole_node: bool = True
    """GPU groups without an explicit memory request ask for the whole node's memory (``--mem=0``)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Run the steps in a container (pyxis or apptainer)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs before any step (``module load ...``, ``source venv``)."""
    python: Optional[str] = None
    """Python interpreter on compute nodes; None: the launcher's own (a shared-filesystem venv)."""
    shared_root: Optional[str] = None
    """Shared filesystem root visible from every node (models, caches); documentation for site profiles."""
    hf_home: str = ""
    """The Hugging Face home (``HF_HOME``) every node mounts: a hub id in ``model.path``
    (``Qwen/Qwen3-8B``) is downloaded once by the launcher into ``<hf_home>/hub`` and every role reads
    it there with ``HF_HUB_OFFLINE=1`` (launcher/hub.py). "": ``cluster.env.HF_HOME``, else
    ``<shared_root>/hf``, else the launcher's own HF_HOME (~/.cache/huggingface: one machine only,
    unless home directories are shared)."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """Limits of the GPU health and bandwidth checks (run with top-level ``preflight=true``)."""


SRUN_MPI = Pattern(r"none|pmix(_v\d+)?|pmi2|cray_shasta", "an srun --mpi plugin: none, pmix, pmix_vN, pmi2 or cray_shasta")
COLLECTIVES = one_of("all_reduce", "all_gather", "alltoall", "sendrecv")
"""workers/preflight/limits.py COLLECTIVES (the bandwidth judge's names; a test keeps them equal)."""
limits(PreflightConfig, expect_gpus_per_node=Each(ge(0)), gpu_name=TEXT, min_free_memory_gb=ge(0),
       max_uncorrected_ecc_errors=ge(0), max_retired_pages=ge(0), fail_on_throttle=Each(TEXT), min_nvlinks_per_gpu=ge(0),
       nccl_tests_dir=TEXT, nccl_tests_mpi=SRUN_MPI, collectives=Each(COLLECTIVES), min_bytes=gt(0), max_bytes=gt(0),
       size_factor=ge(2), num_iters=gt(0), num_warmup_iters=ge(0), min_busbw_gbps=Each(ge(0)),
       min_busbw_gbps_intra_node=Each(ge(0)), timeout_s=gt(0))
limits(GroupSlurmOptions, sbatch_flags=Each(TEXT))
limits(ContainerConfig, runtime=one_of("none", "pyxis", "apptainer"), image=TEXT, mounts=Each(TEXT), workdir=TEXT)
limits(ClusterConfig, name=NONEMPTY, backend=one_of("local", "slurm"), partition=LINE, account=LINE, qos=LINE,
       num_gpus_per_node=ge(0), num_cpus_per_node=gt(0), mem_per_node_gb=ge(0), runs_root=NONEMPTY, template_dir=TEXT,
       time_limit=Pattern(r"(\d+-)?\d+(:\d{2}){0,2}", "a Slurm time: MM, HH:MM:SS or D-HH:MM:SS"), env=Each(TEXT),
       cpu_partition=LINE, gpu_memory_gb=ge(0), nic_gb_s=gt(0), shared_fs_gb_s=gt(0), node_address=NONEMPTY, port_min=between(1024, 65535),
       port_span=gt(0), num_port_slots=gt(0), signal_grace_s=gt(0), max_requeues=ge(0), server_respawns=between(0, 100),
       respawn_backoff_s=between(0, 3600), respawn_backoff_max_s=between(0, 3600), sbatch_flags=Each(LINE),
       setup=Each(TEXT), python=TEXT, shared_root=TEXT, hf_home=TEXT)
