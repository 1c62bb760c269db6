"""The per-field rules (workers/common/config/ranges.py): every builtin schema's numbers and strings
have one, the checker names the key and the valid range, non-finite floats never pass, and the
choices copied from SGLang and the preflight judge stay equal to their sources.

The table of invalid overrides through Hydra and the CLI is tests/unit/launcher/test_invalid_configs.py.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from workers.common.config import RunConfig, TrainerConfig
from workers.common.config.ranges import (ConfigError, Each, OneOf, Pattern, between, check_fields, ge, gt, limits,
                                          unruled_fields)
from workers.common.registry import SECTIONS
from workers.inference.sglang import checks as sglang_checks
from workers.preflight.limits import COLLECTIVES


def builtin_schemas() -> list[type]:
    out = [RunConfig]
    for _key, registry in SECTIONS.values():
        out += [s.config for s in registry.specs() if s.config.__module__.startswith("workers.")]
    return out


@pytest.mark.parametrize("schema", builtin_schemas(), ids=lambda s: s.__name__)
def test_every_number_and_string_has_a_rule(schema):
    """A new int, float or str field (nested, in a list or dict too) needs a rule beside its schema."""
    assert unruled_fields(schema) == [], f"{schema.__name__}: add limits(...) for these fields"


def error_of(obj, prefix: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_fields(obj, prefix)
    return str(e.value)


def test_the_message_names_the_key_the_value_and_the_range():
    assert error_of(TrainerConfig(lr=-1.0), "trainer") == "trainer.lr must be > 0, got -1.0"
    assert error_of(TrainerConfig(lr=float("inf")), "trainer") == "trainer.lr must be a finite number > 0, got inf"
    assert error_of(TrainerConfig(betas=[0.9, 1.0]), "trainer") == ("trainer.betas has 1.0: each item must be in "
                                                                    "[0, 1), got [0.9, 1.0]")
    assert error_of(TrainerConfig(betas=[0.9]), "trainer") == "trainer.betas must have 2 items, got [0.9]"
    assert error_of(TrainerConfig(dtype="float64"), "trainer").startswith("trainer.dtype='float64' is not supported")
    assert "trainer.parallel.dp must be > 0 or -1, got 0" in error_of(
        TrainerConfig(parallel=dataclasses.replace(TrainerConfig().parallel, dp=0)), "trainer")
    check_fields(TrainerConfig(), "trainer")  # the defaults pass


def test_rules():
    assert gt(0).error(0) and not gt(0).error(1e-9) and ge(0).error(-1) and not ge(0).error(0)
    assert between(0, 1, hi_open=True).error(1.0) and not between(0, 1, hi_open=True).error(0.0)
    assert gt(0, also=(-1,)).error(-1) is None and gt(0, also=(-1,)).error(-2)
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert ge(0).error(bad) and between(-5, 5).error(bad)
    assert gt(0).error(True), "a bool is not a number"
    assert OneOf(("a", "b")).error("c") == "is not supported; choose one of ['a', 'b']"
    assert Pattern(r"cpu|cuda(:\d+)?", "a device").error("cuda:1") is None
    assert Pattern(r"cpu|cuda(:\d+)?", "a device").error("cuda:-1") == "must be a device"
    assert Each(ge(0)).error({"a": 1.0, "b": -1.0}) == "has -1.0: each item must be >= 0"


def test_a_float_without_a_rule_must_still_be_finite():
    """A plugin's schema without a table: inf and nan are refused anyway (lists and dicts too)."""

    @dataclasses.dataclass(kw_only=True)
    class PluginSection:
        scale: float = 1.0
        weights: list = dataclasses.field(default_factory=lambda: [1.0])

    check_fields(PluginSection(), "env")
    assert error_of(PluginSection(scale=float("nan")), "env") == "env.scale must be a finite number, got nan"
    assert "env.weights" in error_of(PluginSection(weights=[1.0, float("inf")]), "env")


def test_limits_refuses_a_field_the_schema_lacks():
    with pytest.raises(TypeError, match="no such fields"):
        limits(TrainerConfig, learning_rate=gt(0))


def sglang_choices() -> dict[str, list[str]]:
    """SGLang's own lists, read from its source without importing it (no torch, no CUDA)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (the [sglang] extra)")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "arg_groups" / "choices.py"
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            out[node.targets[0].id] = [ast.literal_eval(e) for e in node.value.elts]
    return out


@pytest.mark.parametrize("ours, theirs", [
    ("QUANTIZATIONS", "QUANTIZATION_CHOICES"), ("ATTENTION_BACKENDS", "ATTENTION_BACKEND_CHOICES"),
    ("MOE_RUNNER_BACKENDS", "MOE_RUNNER_BACKEND_CHOICES"), ("FP8_GEMM_BACKENDS", "FP8_GEMM_RUNNER_BACKEND_CHOICES"),
    ("TRANSFER_BACKENDS", "DISAGG_TRANSFER_BACKEND_CHOICES")])
def test_sglang_choices_match_the_pinned_sglang(ours, theirs):
    assert sorted(getattr(sglang_checks, ours)) == sorted(sglang_choices()[theirs])


def test_preflight_collectives_match_the_bandwidth_judge():
    from workers.common.config.cluster import COLLECTIVES as RULE

    assert set(RULE.choices) == set(COLLECTIVES)
