"""Config schemas for every role: keyword-only dataclasses, one docstring per field.

The launcher registers these in Hydra's ConfigStore and composes YAML onto them; it then
writes the resolved tree to ``run_dir/config/run.yaml``. Compute-node roles load that file
with :func:`load_run_config` (plain OmegaConf, no Hydra, no torch needed).
Required values are ``MISSING``; counts are ``num_*``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from workers.common.sglang_config import SGLangConfig, SGLangRoleConfig


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
    sbatch_flags: dict[str, str] = field(default_factory=dict)
    """Extra ``#SBATCH --key=value`` flags for every component (value "" renders a bare ``--key``)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs before any step (``module load ...``, ``source venv``)."""
    python: Optional[str] = None
    """Python interpreter on compute nodes; None: the launcher's own (a shared-filesystem venv)."""
    shared_root: Optional[str] = None
    """Shared filesystem root visible from every node (models, caches); documentation for site profiles."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """Limits of the GPU health and bandwidth checks (run with top-level ``preflight=true``)."""


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    name: str = MISSING
    """Preset name."""
    vocab_size: int = MISSING
    """Vocabulary size; must cover the environment's tokenizer."""
    hidden_size: int = 128
    """Residual stream width."""
    num_layers: int = 4
    """Decoder layers (every one is MoE, or every one dense when num_experts=0)."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention, Llama's ``num_key_value_heads``); 0: num_heads.
    Must divide num_heads."""
    num_experts: int = 8
    """Routed experts per MoE layer; 0 makes a dense model (every layer a SwiGLU MLP of
    dense_intermediate_size, no router: Router Replay and routed experts do not apply)."""
    top_k: int = 2
    """Experts chosen per token (0 for a dense model)."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + completion) the model accepts."""
    init_seed: int = 1234
    """Seed of the deterministic initial weights (step 0)."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of MoE (DeepSeek/GLM ``first_k_dense_replace``)."""
    dense_intermediate_size: int = 0
    """Hidden width of the dense layers' SwiGLU MLP (num_dense_layers > 0, or num_experts=0)."""
    tie_word_embeddings: bool = False
    """The output projection is the input embedding (no ``lm_head.weight`` of its own)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    pretrained: str = ""
    """Start from a pretrained checkpoint instead of the seeded init: a name of
    workers/modeling/pretrained.py SOURCES (``smollm2_135m``); "" = random init from init_seed."""
    pretrained_dir: str = ""
    """Where the converted checkpoint (safetensors + tokenizer) lives; "" lets the launcher pin
    $SLURMRL_CACHE (default ~/.cache/slurmrl)/pretrained/<pretrained>. Must be visible to every node."""
    num_shared_experts: int = 0
    """Always-active experts per MoE layer, besides the routed ones."""
    attention: str = "mha"
    """``mha`` (q/k/v/o projections of hidden x hidden) or ``mla`` (multi-head latent attention)."""
    q_lora_rank: int = 0
    """MLA: rank of the compressed query projection."""
    kv_lora_rank: int = 0
    """MLA: rank of the compressed key/value latent (what the KV cache stores)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding (shared key part)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    num_indexer_heads: int = 0
    """DeepSeek Sparse Attention indexer heads (0: dense attention)."""
    indexer_head_dim: int = 0
    """DeepSeek Sparse Attention indexer head width."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers (not counted in the published parameter total)."""


@dataclasses.dataclass(kw_only=True)
class ServerLayout:
    """One inference server replica on nodes and GPUs, in SGLang's terms (--tp/--ep/--dp, --nnodes)."""

    num_nodes_per_replica: int = 1
    """Nodes one replica spans (SGLang --nnodes); one Slurm task per node."""
    num_replicas_per_node: int = 1
    """Replicas sharing one node (CPU workers, or servers using part of a node's GPUs)."""
    tp: int = 1
    """Tensor-parallel size = GPUs of one replica (SGLang --tp-size); 1 on CPU."""
    ep: int = 1
    """Expert-parallel size inside a replica (SGLang --ep-size); divides tp and model.num_experts."""
    dp_attention: int = 1
    """Data-parallel attention groups inside a replica (SGLang --attn-dp-size)."""
    sglang: SGLangRoleConfig = field(default_factory=SGLangRoleConfig)
    """SGLang options of this role (DeepEP mode, EPLB, HiCache, CUDA graphs); ignored by the embedded engine."""


@dataclasses.dataclass(kw_only=True)
class RoleResources:
    """Slurm resources of a single-task CPU role (orchestrator, router)."""

    num_cpus_per_task: int = 1
    """CPUs of the task (--cpus-per-task)."""
    mem_gb: int = 0
    """Memory of the task's node in GB (0: the cluster default)."""


@dataclasses.dataclass(kw_only=True)
class TrainerLayout:
    """Trainer placement: nodes, and parallel dims with tp * pp * ep * dp == trainer ranks (GPUs)."""

    num_nodes: int = 1
    """Nodes of the trainer component; on GPU clusters one rank per GPU."""
    num_cpus_per_task: int = 1
    """CPUs per trainer rank."""
    mem_gb: int = 0
    """Memory per trainer node in GB (0: the cluster default)."""
    tp: int = 1
    """Tensor parallel size (inside a node: NVLink)."""
    pp: int = 1
    """Pipeline parallel stages."""
    ep: int = 1
    """Expert parallel size: routed experts are split over ep ranks; divides model.num_experts."""
    dp: int = -1
    """Data-parallel replicas of each (tp, pp, ep) shard; -1 derives ranks / (tp * pp * ep)."""


@dataclasses.dataclass(kw_only=True)
class InferenceConfig:
    backend: str = "embedded"
    """``embedded`` (tiny-model server in this repo) or ``sglang``."""
    num_workers: int = 2
    """Inference server processes; the orchestrator spreads rollouts over them."""
    max_batch_size: int = 64
    """Most sequences one worker decodes together."""
    dtype: str = "float32"
    """Compute dtype of the engine: float32 | bfloat16."""
    device: str = "cpu"
    """Torch device of the embedded engine: ``cpu``, ``cuda`` or ``cuda:N`` (one GPU may be shared with the trainer)."""
    host: str = "127.0.0.1"
    """Address the servers bind to (never 0.0.0.0 by default)."""
    startup_timeout_s: float = 120.0
    """Deadline for a worker to load the step-0 weights and answer /health."""
    num_threads: int = 1
    """torch intra-op threads per worker (2 cores are shared by all roles locally)."""
    worker: ServerLayout = field(default_factory=ServerLayout)
    """Layout of each of the ``num_workers`` unified (prefill + decode) servers."""
    num_prefill_replicas: int = 0
    """Prefill servers of prefill/decode disaggregation (then num_workers must be 0)."""
    prefill: ServerLayout = field(default_factory=ServerLayout)
    """Layout of each prefill server."""
    num_decode_replicas: int = 0
    """Decode servers of prefill/decode disaggregation (then num_workers must be 0)."""
    decode: ServerLayout = field(default_factory=ServerLayout)
    """Layout of each decode server."""
    num_cpus_per_task: int = 1
    """Slurm CPUs of one server task (one task per replica and node)."""
    mem_gb: int = 0
    """Slurm memory per node of the server components in GB (0: the cluster default)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options shared by every SGLang server and the router (inference.backend=sglang)."""


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    num_ranks: int = 1
    """Trainer processes (gloo locally, NCCL on GPUs); split tp x ep x dp by launcher.trainer.tp/ep/dp."""
    num_steps: int = 400
    """Trainer steps of the run; each consumes one batch and publishes weights v=step+1."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    dtype: str = "float32"
    """Training compute dtype."""
    aux_loss_coef: float = 0.01
    """Weight of the MoE load-balancing loss."""
    ratio_cap: float = 2.0
    """Truncated importance sampling: per-token ratio pi_train/pi_inference is capped here."""
    ratio_mask_low: float = 0.2
    """Tokens whose ratio is below this are masked out of the loss."""
    ratio_mask_high: float = 5.0
    """Tokens whose ratio is above this are masked out of the loss."""
    router_replay: bool = False
    """Router Replay (R3): force the experts inference chose (the batch's routed_experts) in the
    trainer forward; gate weights still come from the trainer's router, so it still learns."""
    replay_unreported: str = "recompute"
    """Router Replay at positions inference did not report (routed_mask 0: prefix-cache hits, the
    last sampled token): ``recompute`` routes them with the trainer's own router; ``mask`` also drops
    from the loss every token predicted from such a position (strict, never trains on a guess)."""
    ratio_level: str = "token"
    """What ratio_cap / ratio_mask_low / ratio_mask_high apply to: ``token`` (each token's own
    ratio: TIS / MIS), ``sequence`` (the product over a row's loss tokens, the exact sequence-level
    IS ratio) or ``geometric`` (its per-token geometric mean, length-normalised as in GSPO). The two
    row levels cap or mask every token of a row together."""
    pack_sequences: bool = False
    """Pack rows into fewer, fuller rows for the forward (block-diagonal attention, per-sequence
    positions; routed experts move with their tokens); the loss is computed back in row layout."""
    batch_timeout_s: float = 600.0
    """Deadline for the orchestrator's next batch before the trainer gives up."""
    num_threads: int = 1
    """torch intra-op threads per trainer rank."""
    simulated_step_delay_s: float = 0.0
    """Benchmarks/tests only: sleep this long per step to emulate a large, slow trainer."""
    checkpoint_every_steps: int = 10
    """Write a checkpoint (model, optimizer, RNG, step) after every this many steps; 0: only on
    SIGUSR1/SIGTERM. A restarted trainer resumes from the newest COMPLETE one."""
    num_checkpoints_kept: int = 2
    """Complete checkpoints kept on disk (older ones are deleted after a new one is complete)."""

    def __post_init__(self) -> None:
        # Checked here so a typo fails in the launcher (which builds this dataclass), not on a rank.
        for key, choices in (("ratio_level", ("token", "sequence", "geometric")),
                             ("replay_unreported", ("recompute", "mask"))):
            if getattr(self, key) not in choices:
                raise ValueError(f"trainer.{key}={getattr(self, key)!r} is not supported; choose one of {list(choices)}")
        if self.checkpoint_every_steps < 0 or self.num_checkpoints_kept < 1:
            raise ValueError(f"trainer.checkpoint_every_steps({self.checkpoint_every_steps}) must be >= 0 and "
                             f"trainer.num_checkpoints_kept({self.num_checkpoints_kept}) >= 1")


@dataclasses.dataclass(kw_only=True)
class OrchestratorConfig:
    max_off_policy_steps: int = 2
    """A batch for step s takes only samples with s - policy_version <= this; 0 is synchronous."""
    max_inflight_rollouts: int = 64
    """Most generation requests outstanding over all inference workers."""
    num_prompts_per_step: int = 16
    """Distinct prompts in one trainer batch."""
    num_samples_per_prompt: int = 4
    """Samples per prompt; advantages are relative to the prompt's group."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores with the same one)."""
    request_timeout_s: float = 120.0
    """HTTP deadline of one generate call."""
    weight_update_timeout_s: float = 120.0
    """Deadline for a worker to load new weights."""
    advantage: str = "token_rtg"
    """``sequence``: reward minus group mean, same for every token (GRPO). ``token_rtg``:
    each token's reward-to-go minus the group mean at that position (needs an env with
    per-token rewards; sums to the same episode reward, far less credit-assignment noise)."""
    return_routed_experts: bool = True
    """Ask inference for the experts each token used (for Router Replay and metrics); a dense
    model (model.num_experts=0) has none, so nothing is asked whatever this says."""
    long_episode_policy: str = "drop"
    """What a batch does with a group whose oldest tokens are beyond max_off_policy_steps:
    ``drop`` it (counted in samples_dropped_stale; single-turn default), ``truncate`` its
    too-old tokens out of the loss (they stay as context; counted in tokens_truncated_stale),
    or ``keep`` it whole when its newest turn is within the window (TIS corrects; counted in
    tokens_kept_stale). Long multi-turn episodes span many weight updates: drop wastes them."""
    num_spare_groups: int = 0
    """Groups started beyond what the next batches need, so a few long-tail episodes never
    hold a batch back (batches take whichever groups finish first)."""
    health_check_interval_s: float = 2.0
    """Seconds between health checks of every inference worker (dead ones: probes for revival)."""
    health_check_timeout_s: float = 10.0
    """Deadline of one health check (/health_generate: a 1-token generation on a busy engine)."""
    num_health_misses: int = 2
    """Consecutive failed health checks after which a worker is dead: no new groups, its
    in-flight groups resubmitted elsewhere (a refused connection marks it dead at once)."""

    def __post_init__(self) -> None:
        for key in ("health_check_interval_s", "health_check_timeout_s", "num_health_misses"):
            if not getattr(self, key) > 0:
                raise ValueError(f"orchestrator.{key}({getattr(self, key)}) must be > 0")



@dataclasses.dataclass(kw_only=True)
class WeightsConfig:
    transport: str = "filesystem"
    """``filesystem`` (run_dir/weights/step_N) or ``broadcast`` (torch.distributed)."""
    keep_last: int = 3
    """Published weight steps kept on disk (older ones are deleted, unless a kept delta step
    still points at their files)."""
    delta: bool = False
    """Filesystem: write only tensors whose checksum changed since the previous step; index.json
    points unchanged ones at the earlier file (frozen layers then cost nothing per step)."""
    delta_full_every: int = 10
    """Filesystem delta mode: every this many steps a full step is written, bounding how far back
    a step's files may lie (and so what retention must keep)."""
    num_hash_threads: int = 2
    """Threads that checksum tensors while they are written, read or broadcast."""
    bucket_size_mb: int = 64
    """Broadcast: bucket size in MiB; smaller tensors of one dtype and one receiver set are packed
    into buckets up to this. Several buckets let checksums and packing overlap the transfer; each
    broadcast also costs ~1 ms of fixed overhead on gloo (benchmarks/weight_sync.py)."""
    lone_tensor_mb: int = 16
    """Broadcast: tensors of this many MiB or more travel alone, straight from their own memory
    (no packing copy)."""
    broadcast_timeout_s: float = 300.0
    """Broadcast: deadline of forming the group and of each update (the orchestrator's request,
    every bucket); the error names the peer that did not show up."""
    backend: str = "auto"
    """Broadcast: ``auto`` (NCCL when the trainer has CUDA, else gloo), ``gloo`` or ``nccl``."""
    group_name: str = "slurmrl_weights"
    """Broadcast: SGLang's ``group_name`` of the weight-update group."""
    verify: bool = False
    """End-to-end check of every update: the orchestrator compares the trainer's whole-model digest
    (index.json; broadcast: offer.json, one hash pass on trainer rank 0) with the one each embedded
    worker reports after applying; counts land in metrics.jsonl (weight_updates_verified /
    weight_updates_mismatched). Only when trainer and inference dtypes match."""


@dataclasses.dataclass(kw_only=True)
class EnvConfig:
    name: str = MISSING
    """Task name (``reverse_digits``)."""
    min_digits: int = 3
    """Shortest digit string of a prompt."""
    max_digits: int = 4
    """Longest digit string of a prompt."""
    num_symbols: int = 10
    """Distinct digit symbols (0..num_symbols-1)."""
    seed: int = 0
    """Seed of the prompt stream."""
    latency: str = "none"
    """Simulated env-step latency per episode (a sandbox/tool run): none | lognormal | pareto."""
    latency_median_s: float = 0.0
    """Median of the simulated latency in seconds."""
    latency_p99_over_median: float = 20.0
    """Tail heaviness: p99 / median of the simulated latency (>= 1)."""
    # ---- multi-turn agentic envs (code_repair, verifiers); reverse_digits ignores these ----
    max_turns: int = 4
    """Most model turns of one episode; the episode is then scored as it stands."""
    max_new_tokens_per_turn: int = 96
    """Generation budget of one model turn (stop token: end of turn)."""
    max_episode_tokens: int = 512
    """Prompt + every turn + every observation of an episode; must fit model.max_position_embeddings."""
    episode_timeout_s: float = 300.0
    """Wall-clock budget of one episode (generation + env steps); past it no new turn starts."""
    max_observation_bytes: int = 256
    """Tool output shown to the model is cut to this many bytes (long logs would eat the context)."""
    max_concurrent_env_steps: int = 2
    """Env steps (sandbox runs) running at once in this env; episodes beyond it wait, generation goes on."""
    num_functions: int = 1
    """code_repair: buggy functions per generated project (each with its own tests)."""
    num_tests_per_function: int = 3
    """code_repair: test functions per function; reward = fraction of all tests passing."""
    include_tool_help: bool = False
    """code_repair: describe the tool-call format in the first prompt (for models that can read it;
    the tiny model cannot, and the help would cost ~400 tokens of its context)."""
    sandbox_mode: str = "auto"
    """auto | namespaces (root) | userns (unprivileged) | rlimits (weak fallback); see envs/sandbox.py."""
    sandbox_python: str = "/usr/bin/python3"
    """Interpreter that runs the tests inside the sandbox (its prefix is bind-mounted read-only)."""
    sandbox_scratch_root: Optional[str] = None
    """Node-local directory for per-episode scratch projects; None: $TMPDIR/slurmrl-sandbox."""
    sandbox_cpu_s: int = 2
    """CPU seconds of one test run (RLIMIT_CPU)."""
    sandbox_memory_mb: int = 256
    """Address space of each sandboxed process in MiB (RLIMIT_AS)."""
    sandbox_file_size_kb: int = 1024
    """Largest file a sandboxed process may write, KiB (RLIMIT_FSIZE)."""
    sandbox_num_procs: int = 16
    """Processes of the sandbox's uid (RLIMIT_NPROC): a fork bomb stops here."""
    sandbox_timeout_s: float = 10.0
    """Wall-clock deadline of one test run; past it every process of the run is killed."""
    sandbox_tmp_mb: int = 16
    """Size of the sandbox's private /tmp (tmpfs)."""
    verifiers_env: str = ""
    """env=verifiers: module name of an environment written for the ``verifiers`` package."""
    # ---- reverse_text (a pretrained model's tokenizer and chat template) ----
    min_words: int = 3
    """reverse_text: fewest words of a prompt's text."""
    max_words: int = 5
    """reverse_text: most words of a prompt's text."""
    max_new_tokens: int = 24
    """reverse_text: generation budget of the answer (stop token: the chat template's end of turn)."""
    system_prompt: str = ""
    """reverse_text: system message of the chat ("" keeps the model template's default)."""
    num_examples: int = 2
    """reverse_text: worked examples, given as earlier user/assistant turns (0..2)."""



@dataclasses.dataclass(kw_only=True)
class LauncherConfig:
    dry_run: bool = False
    """Render configs (and the sbatch script) and print the submit command; start nothing."""
    run_dir: Optional[str] = None
    """Explicit run directory; None creates runs_root/<experiment>-<timestamp>."""
    shutdown_grace_s: float = 10.0
    """On Ctrl-C or a dead role: seconds between SIGTERM and SIGKILL for each child."""
    max_restarts: int = 0
    """Local backend: times each process (inference worker, trainer rank, orchestrator) is
    restarted after a non-zero exit before the run stops; 0 keeps fail-fast. They resume from
    the trainer checkpoint / orchestrator ledger; a respawned worker loads the newest weights."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"launcher.max_restarts({self.max_restarts}) must be >= 0 (0: a dead process stops the run)")
    follow: bool = True
    """Slurm: after sbatch, print per-step progress until the job ends; False submits and returns."""
    num_gpu_nodes: int = 0
    """Expected GPU nodes of the whole job (0: no check); the plan refuses components that differ."""
    orchestrator: RoleResources = field(default_factory=RoleResources)
    """Slurm resources of the orchestrator task."""
    router: RoleResources = field(default_factory=RoleResources)
    """Slurm resources of the router task (sglang-router; absent with embedded inference)."""
    trainer: TrainerLayout = field(default_factory=TrainerLayout)
    """Nodes and parallel dimensions of the trainer ranks."""


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    experiment: str = "tiny_local"
    """Name of the experiment bundle."""
    seed: int = 0
    """Global seed (sampling, data order)."""
    preflight: bool = False
    """Slurm: check every node's GPUs and the collective bandwidth as the job's first step and stop
    the job with a report before any role starts (limits: ``cluster.preflight``)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


def load_run_config(path: str) -> RunConfig:
    """Load a resolved run.yaml onto the schema (type-checked), returning the dataclass."""
    schema = OmegaConf.structured(RunConfig)
    merged = OmegaConf.merge(schema, OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else cfg)
