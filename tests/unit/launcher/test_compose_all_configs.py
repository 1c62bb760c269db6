"""Every YAML under hydra_conf composes onto the schema and plans (docs/design.md, "Configuration").

A group file is selected on its own (``<group>=<name>``) on top of the defaults; the few
that only make sense with a companion setting say so in COMPANIONS, with the reason.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from launcher.plan import build_plan
from tests.conftest import CONF_DIR, compose

ROOT = Path(CONF_DIR)
YAMLS = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.yaml"))
COMPANIONS: dict[str, list[str]] = {
    # a byte-level chat env: the default tiny_moe vocab (16 digit tokens) cannot spell code
    "env/code_repair.yaml": ["model.vocab_size=264", "model.max_position_embeddings=576"],
    "env/swe.yaml": ["model.vocab_size=264", "model.max_position_embeddings=576"],
    # SGLang needs GPUs (a Slurm GPU cluster); routed experts do not come back through the PD router
    "inference/sglang.yaml": ["cluster=h200_ib"],
    "inference/sglang_pd.yaml": ["cluster=h200_ib", "orchestrator.return_routed_experts=false"],
    # SGLang on one GPU node without Slurm: GPUs of this machine (here: said by the key) and a checkpoint
    "inference/sglang_node.yaml": ["cluster.num_gpus_per_node=2", "inference.sglang.model_path=/models/x"],
    "inference/embedded_gpu.yaml": ["cluster.num_gpus_per_node=2"],  # an engine on a GPU of this machine
    # a pretrained checkpoint on this machine's GPUs (model.path: tests/unit/launcher/test_one_gpu_node_preset.py)
    "experiment/one_gpu_node.yaml": ["model=smollm2_135m", "cluster.num_gpus_per_node=1"],
    # words in a chat: needs a pretrained model's tokenizer and chat template
    "env/reverse_text.yaml": ["model=smollm2_135m"],
    # your own data: a path is required (docs/examples/byot), text is byte-level on the tiny model
    "env/dataset.yaml": [f"env.path={ROOT.parents[0] / 'docs/examples/byot/train.jsonl'}", "env.prompt_key=question",
                         "model.vocab_size=264", "model.max_position_embeddings=128"],
    # your own env class: the example of docs/examples/own_env (on sys.path, see the test)
    "env/target.yaml": ["env._target_=my_envs:FirstDigit", "+env.args.length=3"],
    # distillation names its teacher (the directory itself is checked at launch: launcher/teacher.py)
    "algorithm/on_policy_distill.yaml": ["algorithm.teacher.path=/teacher"],
}
"""Extra overrides a file needs to plan, keyed by its path under hydra_conf."""


def overrides_for(rel: str) -> list[str]:
    parts = rel[: -len(".yaml")].split("/")
    if len(parts) == 1:  # config.yaml: the defaults themselves
        return []
    group, name = "/".join(parts[:-1]), parts[-1]
    return [f"{group}={name}", *COMPANIONS.get(rel, [])]


def test_the_tree_is_found():
    assert "config.yaml" in YAMLS and "cluster/local_slurm.yaml" in YAMLS and "experiment/glm5_swe_28xh200.yaml" in YAMLS


@pytest.mark.parametrize("rel", YAMLS)
def test_composes_and_plans(rel, monkeypatch):
    if rel == "env/target.yaml":  # the user's package is on their PYTHONPATH
        monkeypatch.syspath_prepend(str(ROOT.parents[0] / "docs/examples/own_env"))
    cfg = compose(overrides_for(rel))
    plan = build_plan(cfg)
    assert plan.roles and plan.components and plan.num_params > 0
    name = Path(rel).stem
    if rel.startswith("cluster/"):
        assert cfg.cluster.name == name
    if rel.startswith("experiment/"):
        assert cfg.experiment == name
    if rel.startswith("model/"):
        assert cfg.model.name == name
