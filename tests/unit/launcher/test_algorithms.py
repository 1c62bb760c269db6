"""The ``algorithm=`` recipes (hydra_conf/algorithm/) and the safe defaults for a user's checkpoint.

- each preset sets only documented trainer.* / orchestrator.* keys (and its own name), any of them
  can be changed on the command line, and the plan prints the effective settings in one line;
- under the defaults, a batch whose groups all have equal rewards changes no weight (the MoE balance
  loss is opt-in), through the real orchestrator buffer and the real trainer step;
- with model.path, trainer.lr above 1e-4 is a plan warning naming the key and the usual range.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import build_plan
from tests.conftest import CONF_DIR, REPO, compose
from tests.integration import test_parity_parallel as moe
from tests.models.hf_dirs import llama_dir
from workers.common.config import OrchestratorConfig, TrainerConfig
from workers.common.config.algorithm import ALGORITHMS
from workers.orchestrator.buffer import RolloutBuffer, RolloutGroup, Sample
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.step import train_step

PRESETS = sorted(p.stem for p in (Path(CONF_DIR) / "algorithm").glob("*.yaml"))
NEEDS = {"on_policy_distill": ["algorithm.teacher.path=/teacher"]}
"""What a preset needs beside itself to plan (the teacher's directory is checked at launch: launcher/teacher.py)."""
SCHEMAS = {"trainer": TrainerConfig, "orchestrator": OrchestratorConfig}


def test_every_algorithm_has_a_preset():
    assert PRESETS == sorted(ALGORITHMS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_sets_only_documented_trainer_and_orchestrator_keys(name):
    text = (Path(CONF_DIR) / "algorithm" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_")
    data = yaml.safe_load(text)
    algorithm = data.pop("algorithm")
    assert algorithm.pop("name") == name and set(algorithm) <= {"teacher"}
    assert set(data) <= set(SCHEMAS), f"{name} sets {sorted(data)}"
    for section, keys in data.items():
        fields = {f.name for f in dataclasses.fields(SCHEMAS[section])}
        assert set(keys) <= fields, f"{name}: {sorted(set(keys) - fields)} are not {section} keys"
        for key in keys:  # documented: each field has its docstring in the schema's source
            assert key in (Path(__file__).parents[3] / f"workers/common/config/{section}.py").read_text()
    cfg = compose([f"algorithm={name}", *NEEDS.get(name, [])])
    for section, keys in data.items():
        for key, value in keys.items():
            assert getattr(getattr(cfg, section), key) == pytest.approx(value) if isinstance(value, float) \
                else getattr(getattr(cfg, section), key) == value, (section, key)
    line = next(x for x in build_plan(cfg).summary() if x.startswith("algorithm "))
    assert line.startswith(f"algorithm {name}: ") and f"loss_agg={cfg.trainer.loss_agg}" in line
    assert f"advantage={cfg.orchestrator.advantage}/{cfg.orchestrator.advantage_norm}" in line


def test_default_is_grpo_and_keys_change_on_the_command_line():
    cfg = compose([])
    assert cfg.algorithm.name == "grpo" and cfg.orchestrator.advantage_norm == "group_std"
    cfg = compose(["algorithm=dapo", "trainer.clip_high=0.3", "orchestrator.dynamic_sampling=false"])
    assert (cfg.trainer.clip_low, cfg.trainer.clip_high, cfg.orchestrator.dynamic_sampling) == (0.2, 0.3, False)
    line = next(x for x in build_plan(cfg).summary() if x.startswith("algorithm "))
    assert "clip=[1-0.2, 1+0.3]" in line and "dynamic_sampling=off" in line and "overlong=last 0.2 of L" in line


@pytest.mark.parametrize("override, message", [
    ("trainer.loss_agg=sum", "trainer.loss_agg"),
    ("orchestrator.advantage_norm=std", "orchestrator.advantage_norm"),
    ("trainer.clip_low=1.5", "trainer.clip_low"),
    ("trainer.kl_estimator=k4", "trainer.kl_estimator"),
    ("orchestrator.overlong_buffer_frac=1", "orchestrator.overlong_buffer_frac"),
    ("trainer.kl_coef=0.01 inference=sglang cluster=h200_ib", "trainer.kl_coef=0.01: the reference policy is scored"),
    ("algorithm=on_policy_distill", "algorithm=on_policy_distill needs algorithm.teacher.path"),
    ("algorithm.teacher.path=/x", "read only by algorithm=on_policy_distill"),
])
def test_bad_recipe_settings_are_refused_with_the_key(override, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[")):
        build_plan(compose(override.split()))


def test_lr_warning_for_a_users_checkpoint(tmp_path):
    """Issue 47 item 16: not for a checkpoint that was never trained (its norms exactly 1, as made to try model.path)."""
    from safetensors.torch import load_file, save_file

    hf = llama_dir(tmp_path / "ckpt", tokenizer_vocab=100)
    random_init = [f"model.path={hf}", "trainer.lr=3e-4"]
    assert not [x for x in build_plan(resolve_model_path(compose(random_init), explicit_model_keys(random_init)))
                .summary() if x.startswith("WARNING trainer.lr")]
    tensors = load_file(hf / "model.safetensors")  # "pretrained": its norms moved away from their init
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = tensors[name] * 1.01
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    overrides = [f"model.path={hf}", "trainer.lr=3e-4"]
    warn = [x for x in build_plan(resolve_model_path(compose(overrides), explicit_model_keys(overrides))).summary()
            if x.startswith("WARNING trainer.lr")]
    assert warn and "trainer.lr=0.0003 with model.path=" in warn[0] and "1e-7..1e-5" in warn[0]
    overrides[-1] = "trainer.lr=1e-5"
    assert not [x for x in build_plan(resolve_model_path(compose(overrides), explicit_model_keys(overrides))).summary()
                if "trainer.lr" in x]
    assert not [x for x in build_plan(compose(["trainer.lr=3e-4"])).summary() if "WARNING trainer.lr" in x]  # no path


def equal_reward_batch(ocfg: OrchestratorConfig):
    """The tiny MoE test batch (8 rows) with the advantages the orchestrator's buffer gives two groups
    of 4 whose rewards are all equal (all 1, all 0)."""
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=2, advantage=ocfg.advantage,
                        advantage_norm=ocfg.advantage_norm)
    for gid, r in enumerate((1.0, 0.0)):
        buf.add(RolloutGroup(group_id=gid, task_id=gid, samples=[
            Sample(prompt_ids=[1], completion_ids=[2, 3], completion_logprobs=[-1.0, -1.0], token_versions=[0, 0],
                   reward=r, finish_reason="stop", token_rewards=[0.0, r]) for _ in range(4)]))
    adv = torch.tensor([s.advantage for g in buf.take(step=1) for s in g.samples])
    return dataclasses.replace(moe.make_batch(), advantages=adv)


@pytest.mark.parametrize("algorithm", PRESETS)
def test_equal_rewards_change_no_weight_under_the_defaults(dims, algorithm):
    cfg = compose([f"algorithm={algorithm}", *NEEDS.get(algorithm, [])])
    model = parallelize(moe.build_model(moe.CFG, moe.SEED), dims)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    for _ in range(2):
        stats = train_step(model, opt, equal_reward_batch(cfg.orchestrator), cfg.trainer, dims)
    assert stats["grad_norm"] == 0.0
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"{algorithm}: {changed[:4]} moved with no reward difference"


def test_the_balance_loss_would_move_the_weights(dims):
    """The counter-check: the old default (aux_loss_coef 0.01) moves the router on the same batch."""
    cfg = compose(["trainer.aux_loss_coef=0.01"])
    model = parallelize(moe.build_model(moe.CFG, moe.SEED), dims)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    train_step(model, opt, equal_reward_batch(cfg.orchestrator), cfg.trainer, dims)
    assert any("gate" in k and not torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("knob", ["trainer.entropy_coef=0.01", "trainer.kl_coef=0.1"])
def test_an_opted_in_regulariser_moves_the_weights_of_an_equal_reward_batch(dims, knob):
    """Entropy bonus and KL penalty reach the trainer step (the entropy's gradient through the softmax,
    the reference log-probs from the batch): with every advantage 0 they alone move the weights."""
    cfg = compose([knob])
    model = parallelize(moe.build_model(moe.CFG, moe.SEED), dims)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    batch = equal_reward_batch(cfg.orchestrator)
    if "kl_coef" in knob:  # the orchestrator sends the reference's log-probs with the batch (scoring.py)
        batch = dataclasses.replace(batch, ref_logprobs=batch.inference_logprobs - 0.5 * batch.loss_mask)
    stats = train_step(model, opt, batch, cfg.trainer, dims)
    assert stats["grad_norm"] > 0 and stats["pg_loss"] != 0
    assert ("ref_kl" in stats) == ("kl_coef" in knob)
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_dapo_overlong_ramp_over_a_few_tokens_is_warned():
    """Issue 47 item 16: with env.max_new_tokens=8 DAPO's 20% ramp is 2 tokens: most samples lose the penalty."""
    def warns(overrides):
        return [x for x in build_plan(compose(overrides)).summary() if x.startswith("WARNING orchestrator.overlong")]

    short = warns(["algorithm=dapo", "env=dataset", "model.vocab_size=264", "env.max_new_tokens=8",
                   f"env.path={REPO}/docs/examples/byot/train.jsonl", "env.prompt_key=question"])
    assert short and "a ramp of 2 token(s): every sample longer than 6 tokens is penalised" in short[0], short
    assert "env.max_new_tokens or set orchestrator.overlong_buffer_frac=0" in short[0]
    assert not warns(["algorithm=dapo", "env=dataset", "model.vocab_size=264", "env.max_new_tokens=80", "model.max_position_embeddings=128",
                      f"env.path={REPO}/docs/examples/byot/train.jsonl", "env.prompt_key=question"])
    assert not warns(["algorithm=grpo", "env=dataset", "model.vocab_size=264", "env.max_new_tokens=8",
                      f"env.path={REPO}/docs/examples/byot/train.jsonl", "env.prompt_key=question"])
