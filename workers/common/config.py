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


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    name: str = MISSING
    """Preset name."""
    vocab_size: int = MISSING
    """Vocabulary size; must cover the environment's tokenizer."""
    hidden_size: int = 128
    """Residual stream width."""
    num_layers: int = 4
    """Decoder layers (every one is MoE)."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts chosen per token."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + completion) the model accepts."""
    init_seed: int = 1234
    """Seed of the deterministic initial weights (step 0)."""


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
    host: str = "127.0.0.1"
    """Address the servers bind to (never 0.0.0.0 by default)."""
    startup_timeout_s: float = 120.0
    """Deadline for a worker to load the step-0 weights and answer /health."""
    num_threads: int = 1
    """torch intra-op threads per worker (2 cores are shared by all roles locally)."""


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    num_ranks: int = 1
    """Trainer processes (data parallel over gloo locally, NCCL on GPUs)."""
    num_steps: int = 60
    """Trainer steps of the run; each consumes one batch and publishes weights v=step+1."""
    lr: float = 1e-3
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
    """Force the experts chosen at inference in the trainer forward (R3)."""
    batch_timeout_s: float = 600.0
    """Deadline for the orchestrator's next batch before the trainer gives up."""
    num_threads: int = 1
    """torch intra-op threads per trainer rank."""
    simulated_step_delay_s: float = 0.0
    """Benchmarks/tests only: sleep this long per step to emulate a large, slow trainer."""


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
    """Ask inference for the experts each token used (for Router Replay and metrics)."""


@dataclasses.dataclass(kw_only=True)
class WeightsConfig:
    transport: str = "filesystem"
    """``filesystem`` (run_dir/weights/step_N) or ``broadcast`` (torch.distributed)."""
    keep_last: int = 3
    """Published weight steps kept on disk (older ones are deleted)."""


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


@dataclasses.dataclass(kw_only=True)
class LauncherConfig:
    dry_run: bool = False
    """Render configs (and the sbatch script) and print the submit command; start nothing."""
    run_dir: Optional[str] = None
    """Explicit run directory; None creates runs_root/<experiment>-<timestamp>."""
    shutdown_grace_s: float = 10.0
    """On Ctrl-C or a dead role: seconds between SIGTERM and SIGKILL for each child."""


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    experiment: str = "tiny_local"
    """Name of the experiment bundle."""
    seed: int = 0
    """Global seed (sampling, data order)."""
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
