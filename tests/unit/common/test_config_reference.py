"""docs/config.md is what the config dataclasses render (workers/common/config/reference.py).

Why a test: the reference is generated, so a schema change (a new field, a new default, a new
range, an edited docstring) without regenerating it leaves the docs wrong; this fails then and
says the command that refreshes it.
"""
import dataclasses

from workers.common.config import TrainerConfig
from workers.common.config.reference import COMMAND, OUT, field_docs, render


def test_docs_config_md_is_current():
    assert OUT.exists(), f"{OUT} is missing; run {COMMAND}"
    assert OUT.read_text() == render(), f"docs/config.md is stale; run {COMMAND}"


def test_every_trainer_key_is_listed_with_its_docstring_and_range():
    text = render()
    docs = field_docs(TrainerConfig)
    for f in dataclasses.fields(TrainerConfig):
        if dataclasses.is_dataclass(f.default_factory) or f.name == "parallel":
            continue
        assert f"| `trainer.{f.name}` |" in text, f"trainer.{f.name} missing from the reference"
        assert f.name in docs, f"trainer.{f.name} has no docstring in its schema"
    assert "| `trainer.lr` | float | `" in text and "| > 0 |" in text
    assert "| `trainer.parallel.tp` |" in text  # nested sections are flattened to full keys


def test_plugin_sections_list_each_entry_schema():
    text = render()
    for heading in ("### `DatasetConfig`", "### `EmbeddedInferenceConfig`", "### `BroadcastWeightsConfig`",
                    "### `Qwen3MoeConfig`"):
        assert heading in text
    assert "| `env.reward_fn` |" in text and "| `model.path` |" in text
