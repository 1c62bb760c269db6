"""Table of invalid configurations: each is refused before anything is written or started,
with a message that names the offending key.

Composition runs through Hydra's compose API on the real config tree (so unknown options,
wrong types and unknown keys are caught exactly as on the command line), then through
``reject_unknown_keys`` and ``build_plan``, the steps the CLI takes before it writes anything.
"""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.config_store import register, reject_unknown_keys
from launcher.plan import PlanError, build_plan

register()

CASES = [
    # wrong types
    ("trainer.lr=fast", "trainer.lr"),
    ("trainer.num_steps=1.5", "trainer.num_steps"),
    ("orchestrator.num_prompts_per_step=many", "orchestrator.num_prompts_per_step"),
    ("inference.num_workers=[1,2]", "inference.num_workers"),
    ("trainer.router_replay=maybe", "trainer.router_replay"),
    # unknown keys and options
    ("trainer.no_such_key=1", "no_such_key"),
    ("+orchestrator.batch=4", "batch"),
    ("cluster=nonexistent", "cluster"),
    ("model=gpt9", "model"),
    ("experiment=nope", "experiment"),
    ("inference.backend=vllm", "inference.backend"),
    ("weights.transport=carrier_pigeon", "weights.transport"),
    ("cluster.backend=k8s", "cluster.backend"),
    ("orchestrator.advantage=ppo", "orchestrator.advantage"),
    ("env.name=chess", "env.name"),
    ("env.latency=gaussian", "env.latency"),
    # impossible numbers
    ("orchestrator.num_prompts_per_step=-1", "orchestrator.num_prompts_per_step"),
    ("orchestrator.num_samples_per_prompt=1", "orchestrator.num_samples_per_prompt"),
    ("orchestrator.max_off_policy_steps=-2", "orchestrator.max_off_policy_steps"),
    ("orchestrator.max_inflight_rollouts=2", "orchestrator.max_inflight_rollouts"),
    ("orchestrator.temperature=0", "orchestrator.temperature"),
    ("trainer.num_ranks=0", "trainer.num_ranks"),
    ("trainer.num_ranks=1000", "trainer.num_ranks"),
    ("trainer.lr=-1e-3", "trainer.lr"),
    ("trainer.ratio_cap=0.5", "trainer.ratio_cap"),
    ("trainer.ratio_mask_low=0", "trainer.ratio_mask_low"),
    ("inference.num_workers=0", "inference.num_workers"),
    ("weights.keep_last=1", "weights.keep_last"),
    ("env.latency=lognormal", "env.latency_median_s"),
    ("env.latency=pareto env.latency_median_s=1 env.latency_p99_over_median=0.5", "env.latency_p99_over_median"),
    # model shapes and cross-section conflicts
    ("model.num_heads=3", "model.num_heads"),
    ("model.top_k=9", "model.top_k"),
    ("model.hidden_size=0", "model.hidden_size"),
    ("model.vocab_size=8", "model.vocab_size"),
    ("env.max_digits=1", "env.max_digits"),
    ("model.max_position_embeddings=8", "model.max_position_embeddings"),
    ("inference.backend=sglang", "inference.backend"),  # sglang needs GPUs: not with cluster=local
    ("inference=embedded inference.sglang.mem_fraction_static=0.5", "inference.sglang"),  # another backend's option
    ("inference=sglang cluster=h200_ib inference.num_threads=2", "inference.num_threads"),
    # dense and pretrained models, reverse_text (issue 13)
    ("model=smollm2_135m model.hidden_size=512", "model.hidden_size"),
    ("model=smollm2_135m model.tie_word_embeddings=false", "model.tie_word_embeddings"),
    ("model.pretrained=gpt2", "model.pretrained"),
    ("env=reverse_text", "model.pretrained"),
    ("model=tiny_dense trainer.router_replay=true", "trainer.router_replay"),
    ("model=tiny_dense model.top_k=2", "model.top_k"),
    ("model=tiny_dense model.dense_intermediate_size=0", "model.dense_intermediate_size"),
    ("model=tiny_dense trainer.parallel.ep=2 trainer.num_ranks=2", "trainer.parallel.ep"),
    # the dense decoder families (workers/models/dense/)
    ("inference=sglang cluster=h200_ib model=mistral_tiny", "model.sliding_window"),  # SGLang: no window there
    ("model=mistral_tiny model.layer_types=[sliding_attention]", "model.layer_types"),
    ("model=qwen2_tiny model.sliding_window=0 model.layer_types=[full_attention,sliding_attention]",
     "model.layer_types"),
    ("model=qwen3_tiny model.head_dim=15", "model.head_dim"),
    ("model=qwen3_tiny model.layer_types=[full_attention,local]", "model.layer_types"),
    ("model=qwen2_tiny model.sliding_window=-1", "model.sliding_window"),
    ("model.num_kv_heads=3", "model.num_kv_heads"),
    ("experiment=smollm2_reverse_text env.max_words=99", "env.max_words"),
    ("experiment=smollm2_reverse_text env.num_examples=5", "env.num_examples"),
    ("experiment=smollm2_reverse_text env.max_new_tokens=0", "env.max_new_tokens"),
    # fault tolerance (issue 9)
    ("launcher.max_restarts=-1", "launcher.max_restarts"),
    ("trainer.checkpoint_every_steps=-5", "trainer.checkpoint_every_steps"),
    ("trainer.num_checkpoints_kept=0", "trainer.num_checkpoints_kept"),
    ("orchestrator.health_check_interval_s=0", "orchestrator.health_check_interval_s"),
    ("orchestrator.num_health_misses=0", "orchestrator.num_health_misses"),
]

SG = "inference=sglang cluster=h200_ib "
"""Prefix of cases that need the SGLang backend (GPU cluster)."""
CR = "env=code_repair model.vocab_size=264 model.max_position_embeddings=576 "
"""Prefix of cases on the code_repair env (a byte-level vocabulary)."""
DRY = "launcher.dry_run=true "
"""Prefix of cases on families that only plan."""

RANGE_CASES = [
    # issue 22 item 2: every numeric field has a range, every string field its choices; non-finite floats refused
    # trainer: optimiser, loss, deadlines
    ("trainer.lr=inf", "trainer.lr"),
    ("trainer.lr=nan", "trainer.lr"),
    ("trainer.lr=-inf", "trainer.lr"),
    ("trainer.lr=0", "trainer.lr"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay"),
    ("trainer.weight_decay=nan", "trainer.weight_decay"),
    ("trainer.betas=[1.0,0.99]", "trainer.betas"),
    ("trainer.betas=[-0.1,0.9]", "trainer.betas"),
    ("trainer.betas=[0.9,1.5]", "trainer.betas"),
    ("trainer.betas=[0.9]", "trainer.betas"),
    ("trainer.betas=[0.9,nan]", "trainer.betas"),
    ("trainer.grad_clip=0", "trainer.grad_clip"),
    ("trainer.grad_clip=inf", "trainer.grad_clip"),
    ("trainer.aux_loss_coef=-1", "trainer.aux_loss_coef"),
    ("trainer.aux_loss_coef=nan", "trainer.aux_loss_coef"),
    ("trainer.ratio_mask_high=inf", "trainer.ratio_mask_high"),
    ("trainer.ratio_cap=nan", "trainer.ratio_cap"),
    ("trainer.batch_timeout_s=-1", "trainer.batch_timeout_s"),
    ("trainer.batch_timeout_s=0", "trainer.batch_timeout_s"),
    ("trainer.batch_timeout_s=inf", "trainer.batch_timeout_s"),
    ("trainer.num_threads=0", "trainer.num_threads"),
    ("trainer.simulated_step_delay_s=-1", "trainer.simulated_step_delay_s"),
    ("trainer.simulated_step_delay_s=nan", "trainer.simulated_step_delay_s"),
    ("trainer.dtype=float64", "trainer.dtype"),
    ("trainer.ratio_level=row", "trainer.ratio_level"),
    ("trainer.replay_unreported=guess", "trainer.replay_unreported"),
    ("trainer.parallel.tp=0", "trainer.parallel.tp"),
    ("trainer.parallel.ep=-1", "trainer.parallel.ep"),
    ("trainer.parallel.dp=0", "trainer.parallel.dp"),
    ("trainer.parallel.dp=-2", "trainer.parallel.dp"),
    # orchestrator
    ("orchestrator.temperature=inf", "orchestrator.temperature"),
    ("orchestrator.temperature=nan", "orchestrator.temperature"),
    ("orchestrator.request_timeout_s=-1", "orchestrator.request_timeout_s"),
    ("orchestrator.request_timeout_s=nan", "orchestrator.request_timeout_s"),
    ("orchestrator.weight_update_timeout_s=-5", "orchestrator.weight_update_timeout_s"),
    ("orchestrator.weight_update_timeout_s=inf", "orchestrator.weight_update_timeout_s"),
    ("orchestrator.health_check_timeout_s=-1", "orchestrator.health_check_timeout_s"),
    ("orchestrator.health_check_interval_s=nan", "orchestrator.health_check_interval_s"),
    ("orchestrator.long_episode_policy=maybe", "orchestrator.long_episode_policy"),
    # inference: shared, layouts, embedded
    ("inference.device=tpu", "inference.device"),
    ("inference.device=cuda:x", "inference.device"),
    ("inference.device=cuda:-1", "inference.device"),
    ("inference.num_threads=0", "inference.num_threads"),
    ("inference.startup_timeout_s=-1", "inference.startup_timeout_s"),
    ("inference.startup_timeout_s=nan", "inference.startup_timeout_s"),
    ("inference.dtype=int8", "inference.dtype"),
    ("inference.num_cpus_per_task=0", "inference.num_cpus_per_task"),
    ("inference.mem_gb=-1", "inference.mem_gb"),
    ("inference.worker.tp=0", "inference.worker.tp"),
    ("inference.worker.num_replicas_per_node=0", "inference.worker.num_replicas_per_node"),
    ("inference.num_prefill_replicas=-1", "inference.num_prefill_replicas"),
    ("inference.host=", "inference.host"),
    # inference: sglang
    (SG + "inference.sglang.watchdog_timeout_s=nan", "inference.sglang.watchdog_timeout_s"),
    (SG + "inference.sglang.mem_fraction_static=nan", "inference.sglang.mem_fraction_static"),
    (SG + "inference.sglang.context_length=0", "inference.sglang.context_length"),
    (SG + "inference.sglang.page_size=-1", "inference.sglang.page_size"),
    (SG + "inference.sglang.quantization=int3", "inference.sglang.quantization"),
    (SG + "inference.sglang.attention_backend=fast", "inference.sglang.attention_backend"),
    (SG + "inference.sglang.moe_runner_backend=magic", "inference.sglang.moe_runner_backend"),
    (SG + "inference.sglang.log_level=loud", "inference.sglang.log_level"),
    (SG + "inference.sglang.router.request_timeout_s=0", "inference.sglang.router.request_timeout_s"),
    (SG + "inference.sglang.router.health_check_interval_s=-1", "inference.sglang.router.health_check_interval_s"),
    (SG + "inference.sglang.router.log_level=chatty", "inference.sglang.router.log_level"),
    (SG + "inference.worker.sglang.hicache_ratio=inf", "inference.worker.sglang.hicache_ratio"),
    (SG + "inference.worker.sglang.hicache_size_gb=-1", "inference.worker.sglang.hicache_size_gb"),
    (SG + "inference.worker.sglang.eplb_rebalance_num_iterations=0",
     "inference.worker.sglang.eplb_rebalance_num_iterations"),
    # weights
    ("weights.num_hash_threads=0", "weights.num_hash_threads"),
    ("weights.keep_last=-3", "weights.keep_last"),
    ("weights.delta_full_every=0", "weights.delta_full_every"),
    ("weights.backend=nccl", "weights.backend"),  # the filesystem transport has no backend
    ("weights=broadcast weights.backend=mpi", "weights.backend"),
    ("weights=broadcast weights.broadcast_timeout_s=nan", "weights.broadcast_timeout_s"),
    ("weights=broadcast weights.broadcast_timeout_s=-1", "weights.broadcast_timeout_s"),
    ("weights=broadcast weights.lone_tensor_mb=0", "weights.lone_tensor_mb"),
    ("weights=broadcast weights.group_name=", "weights.group_name"),
    # model: every family
    ("model.rms_norm_eps=0", "model.rms_norm_eps"),
    ("model.rms_norm_eps=nan", "model.rms_norm_eps"),
    ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps"),
    ("model.rope_theta=inf", "model.rope_theta"),
    ("model.rope_theta=-1", "model.rope_theta"),
    ("model.init_seed=-1", "model.init_seed"),
    ("model.num_layers=0", "model.num_layers"),
    ("model.expert_intermediate_size=-8", "model.expert_intermediate_size"),
    ("model=tiny_dense model.rms_norm_eps=inf", "model.rms_norm_eps"),
    (DRY + "model=kimi_k2 model.num_shared_experts=-1", "model.num_shared_experts"),
    (DRY + "model=kimi_k2 model.num_mtp_layers=-1", "model.num_mtp_layers"),
    (DRY + "model=glm5 model.num_indexer_heads=-2", "model.num_indexer_heads"),
    (DRY + "model=nemotron3_ultra model.num_shared_experts=-1", "model.num_shared_experts"),
    (DRY + "model=nemotron3_ultra model.num_mtp_layers=-3", "model.num_mtp_layers"),
    # trainer precision, micro-batches, sharding plans (issue 19)
    ("trainer.master_dtype=bfloat16", "trainer.master_dtype"),  # below the float32 compute dtype
    ("trainer.master_dtype=float16", "trainer.master_dtype"),
    ("trainer.micro_batch_tokens=8", "trainer.micro_batch_tokens"),  # < model.max_position_embeddings
    ("trainer.micro_batch_tokens=-1", "trainer.micro_batch_tokens"),
    ("trainer.activation_checkpointing=partial", "trainer.activation_checkpointing"),
    # env: every env
    ("env.seed=-1", "env.seed"),
    ("env.latency=lognormal env.latency_median_s=nan", "env.latency_median_s"),
    ("env.latency=pareto env.latency_median_s=1 env.latency_p99_over_median=inf", "env.latency_p99_over_median"),
    ("env.latency_median_s=-1", "env.latency_median_s"),
    ("env.num_symbols=-4", "env.num_symbols"),
    ("model=smollm2_135m env=reverse_text env.min_words=0", "env.min_words"),
    (CR + "env.max_turns=0", "env.max_turns"),
    (CR + "env.episode_timeout_s=nan", "env.episode_timeout_s"),
    (CR + "env.episode_timeout_s=-1", "env.episode_timeout_s"),
    (CR + "env.max_concurrent_env_steps=0", "env.max_concurrent_env_steps"),
    (CR + "env.sandbox_timeout_s=inf", "env.sandbox_timeout_s"),
    (CR + "env.sandbox_memory_mb=-1", "env.sandbox_memory_mb"),
    (CR + "env.max_observation_bytes=0", "env.max_observation_bytes"),
    (CR + "env.sandbox_mode=none", "env.sandbox_mode"),
    # cluster and cluster.preflight
    ("cluster.num_gpus_per_node=-1", "cluster.num_gpus_per_node"),
    ("cluster.num_cpus_per_node=0", "cluster.num_cpus_per_node"),
    ("cluster.mem_per_node_gb=-1", "cluster.mem_per_node_gb"),
    ("cluster.gpu_memory_gb=nan", "cluster.gpu_memory_gb"),
    ("cluster.gpu_memory_gb=-80", "cluster.gpu_memory_gb"),
    ("cluster.signal_grace_s=-1", "cluster.signal_grace_s"),
    ("cluster.port_min=-5", "cluster.port_min"),
    ("cluster.port_span=0", "cluster.port_span"),
    ("cluster.preflight.min_free_memory_gb=-1", "cluster.preflight.min_free_memory_gb"),
    ("cluster.preflight.min_free_memory_gb=inf", "cluster.preflight.min_free_memory_gb"),
    ("cluster.preflight.max_retired_pages=-1", "cluster.preflight.max_retired_pages"),
    ("cluster.preflight.max_uncorrected_ecc_errors=-1", "cluster.preflight.max_uncorrected_ecc_errors"),
    ("cluster.preflight.timeout_s=nan", "cluster.preflight.timeout_s"),
    ("cluster.preflight.num_warmup_iters=-1", "cluster.preflight.num_warmup_iters"),
    ("cluster.preflight.min_nvlinks_per_gpu=-1", "cluster.preflight.min_nvlinks_per_gpu"),
    ("cluster.preflight.nccl_tests_mpi=openmpi", "cluster.preflight.nccl_tests_mpi"),
    ("+cluster.preflight.min_busbw_gbps.all_reduce=-5", "cluster.preflight.min_busbw_gbps"),
    ("+cluster.preflight.min_busbw_gbps.all_reduce=nan", "cluster.preflight.min_busbw_gbps"),
    ("cluster.preflight.collectives=[all_reduce,broadcast]", "cluster.preflight.collectives"),
    # launcher, top level
    ("launcher.shutdown_grace_s=-1", "launcher.shutdown_grace_s"),
    ("launcher.shutdown_grace_s=nan", "launcher.shutdown_grace_s"),
    ("launcher.shutdown_grace_s=inf", "launcher.shutdown_grace_s"),
    ("launcher.num_gpu_nodes=-1", "launcher.num_gpu_nodes"),
    ("launcher.trainer.num_nodes=0", "launcher.trainer.num_nodes"),
    ("launcher.trainer.num_cpus_per_task=0", "launcher.trainer.num_cpus_per_task"),
    ("launcher.orchestrator.mem_gb=-1", "launcher.orchestrator.mem_gb"),
    ("launcher.router.num_cpus_per_task=-2", "launcher.router.num_cpus_per_task"),
    ("seed=-1", "seed"),
    ("plugins=[no_such_module]", "plugins"),
    ("plugins=[my-plugin]", "plugins"),
]


def compose_cfg(overrides: list[str]):
    with initialize_config_module(config_module="hydra_conf", version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("override, key", CASES + RANGE_CASES, ids=[c[0] for c in CASES + RANGE_CASES])
def test_invalid_config_is_refused_naming_the_key(override, key, tmp_path):
    overrides = override.split() + [f"cluster.runs_root={tmp_path / 'runs'}"]
    with pytest.raises((HydraException, OmegaConfBaseException, PlanError, ValueError, KeyError)) as err:
        composed = compose_cfg(overrides)
        reject_unknown_keys(composed)
        build_plan(OmegaConf.to_object(composed))
    text = str(err.value) + str(getattr(err.value, "__cause__", "") or "")
    assert key in text, f"{override!r} was refused, but the message does not name {key!r}:\n{text}"
    assert not (tmp_path / "runs").exists(), "a run directory was written for an invalid config"


def test_cli_refuses_another_backends_option_with_exit_2(tmp_path):
    """Hydra refuses an override before the app runs; the CLI still answers 2 (a user error) naming the key."""
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-m", "launcher", "inference=embedded",
                          "inference.sglang.mem_fraction_static=0.5", "launcher.dry_run=true",
                          f"cluster.runs_root={tmp_path / 'runs'}"], cwd=Path(__file__).resolve().parents[3],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "inference.sglang" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


def test_table_is_large_enough():
    assert len(CASES) >= 30 and len(RANGE_CASES) >= 80
    assert len({c[0] for c in CASES + RANGE_CASES}) == len(CASES) + len(RANGE_CASES), "a case is listed twice"


CLI_CASES = [
    # one per category the hostile test of issue 22 found accepted or refused with a traceback
    ("trainer.lr=inf", "trainer.lr"),
    ("trainer.lr=-0.5", "trainer.lr"),
    ("trainer.betas=[0.9,1.0]", "trainer.betas"),
    ("trainer.weight_decay=-1", "trainer.weight_decay"),
    ("inference.device=tpu:0", "inference.device"),
    ("weights=broadcast weights.backend=mpi", "weights.backend"),
    ("weights.backend=nccl", "weights.backend"),
    ("orchestrator.request_timeout_s=-3", "orchestrator.request_timeout_s"),
    ("model.rms_norm_eps=-1e-5", "model.rms_norm_eps"),
    ("launcher.shutdown_grace_s=-2", "launcher.shutdown_grace_s"),
    ("launcher.shutdown_grace_s=nan", "launcher.shutdown_grace_s"),
    ("launcher.max_restarts=-1", "launcher.max_restarts"),
    ("trainer.ratio_level=row", "trainer.ratio_level"),
    ("orchestrator.health_check_interval_s=0", "orchestrator.health_check_interval_s"),
    ("trainer=null", "trainer"),  # Hydra's own ValueError for a group set to null (launcher/__main__.py)
]


@pytest.mark.parametrize("override, key", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_without_a_traceback(override, key, tmp_path):
    """Through ``python -m launcher`` as a user runs it: exit 2, ``slurmrl: error`` (or Hydra's own
    message) naming the key, no Python traceback, no run directory (a dry run would write one)."""
    import subprocess
    import sys
    from pathlib import Path

    runs = tmp_path / "runs"
    res = subprocess.run([sys.executable, "-m", "launcher", *override.split(), f"cluster.runs_root={runs}",
                          f"launcher.run_dir={runs / 'run'}", "launcher.dry_run=true"], cwd=Path(__file__).resolve().parents[3],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    assert key in res.stderr, res.stderr
    assert not runs.exists(), "a run directory was written for an invalid config"


def test_the_default_config_is_valid():
    cfg = OmegaConf.to_object(compose_cfg([]))
    plan = build_plan(cfg)
    assert plan.samples_per_step == cfg.orchestrator.num_prompts_per_step * cfg.orchestrator.num_samples_per_prompt
