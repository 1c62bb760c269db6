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


def compose_cfg(overrides: list[str]):
    with initialize_config_module(config_module="hydra_conf", version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("override, key", CASES, ids=[c[0] for c in CASES])
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
                          f"cluster.runs_root={tmp_path / 'runs'}"], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "inference.sglang" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


def test_table_is_large_enough():
    assert len(CASES) >= 30


def test_the_default_config_is_valid():
    cfg = OmegaConf.to_object(compose_cfg([]))
    plan = build_plan(cfg)
    assert plan.samples_per_step == cfg.orchestrator.num_prompts_per_step * cfg.orchestrator.num_samples_per_prompt
