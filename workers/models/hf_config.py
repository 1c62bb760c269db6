"""config.json <-> ``model.*`` for the families whose checkpoints are Hugging Face ones.

A checkpoint directory's config.json is the family's truth (``model.path`` in, every published
step out), so each buildable family declares one :class:`HfConfigMap`: which config.json key
holds which of its fields, which keys must hold one value because the family implements only
that (``attention_bias: false``), and which keys do not change the function the weights compute
(token ids, dtype, training-only knobs). Anything else is refused, naming the key: a config the
family cannot reproduce exactly must never be trained as if it could.

Rotary settings come in two spellings: transformers 5 writes ``rope_parameters`` ({rope_type,
rope_theta}); older checkpoints (Qwen3-30B-A3B, SmolLM2) write ``rope_theta`` and
``rope_scaling: null``. Both are read; both are written, so either generation of readers
(transformers, SGLang) finds its key. Only the default rotary embedding is implemented.

Torch-free (the launcher calls it on the login node).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

INERT = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "initializer_range", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward", "architectures", "model_type",
    "tokenizer_class"})
"""Keys that change nothing our forward computes (ids, storage dtype, bookkeeping)."""


@dataclasses.dataclass(frozen=True)
class HfConfigMap:
    family: str
    architecture: str
    """config.json ``architectures[0]`` written (and the one read, see ``ModelSpec.hf_architectures``)."""
    model_type: str
    fields: Mapping[str, str]
    """config.json key -> our field (values copied as they are)."""
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """config.json key -> the only value implemented (written as is; another value is refused)."""
    inert: frozenset = frozenset()
    """Family keys (besides :data:`INERT`) that do not change the function, read and dropped."""
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Other spellings of a key in ``fields`` (transformers 5 writes ``num_local_experts``)."""
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """config.json key -> the value transformers assumes when the key is absent (the family's config class)."""
    extra: Optional[Callable[[Any], dict]] = None
    """Derived keys written besides ``fields`` (e.g. Llama's ``head_dim`` = hidden / heads)."""

    def to_hf(self, m) -> dict:
        """The config.json dict of ``m`` (a family config): architecture, model type, every field."""
        out: dict[str, Any] = {"architectures": [self.architecture], "model_type": self.model_type}
        for key, name in self.fields.items():
            value = getattr(m, name)
            out[key] = list(value) if isinstance(value, (list, tuple)) else value
        out.update(self.fixed)
        if self.extra is not None:
            out.update(self.extra(m))
        theta = float(m.rope_theta)
        out.update(rope_theta=theta, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": theta})
        return out

    def from_hf(self, config: Mapping[str, Any], *, where: str = "config.json") -> dict:
        """``{our field: value}`` from a config.json dict; ValueError naming a key we do not implement."""
        d = {self.aliases.get(k, k): v for k, v in config.items()}
        arch = d.get("architectures")
        if arch is not None and list(arch) != [self.architecture]:
            raise ValueError(f"{where}: architectures={arch} is not {self.family}'s [{self.architecture!r}]")
        if d.get("model_type", self.model_type) != self.model_type:
            raise ValueError(f"{where}: model_type={d['model_type']!r} is not {self.family}'s {self.model_type!r}")
        out: dict[str, Any] = {}
        theta = _rope_theta(d, where)
        if theta is not None:
            out["rope_theta"] = theta
        for key, value in d.items():
            if key in self.fields:
                out[self.fields[key]] = list(value) if isinstance(value, (list, tuple)) else value
            elif key in self.fixed:
                if value != self.fixed[key]:
                    raise ValueError(f"{where}: {key}={value!r} is not implemented by model family {self.family} "
                                     f"(only {key}={self.fixed[key]!r})")
            elif key not in INERT and key not in self.inert:
                raise ValueError(f"{where}: key {key!r} (= {value!r}) is not implemented by model family "
                                 f"{self.family}; it reads {sorted(self.fields)}")
        for key, value in self.defaults.items():
            if key in self.fields and key not in d:
                out[self.fields[key]] = value
        missing = sorted(k for k in self.fields if self.fields[k] not in out)
        if missing:
            raise ValueError(f"{where}: model family {self.family} needs key(s) {missing}")
        return out


def _rope_theta(d: dict, where: str) -> Optional[float]:
    """The rotary base from either spelling (popped from ``d``); refuses any rotary scaling."""
    params = d.pop("rope_parameters", None)
    scaling = d.pop("rope_scaling", None)
    theta = d.pop("rope_theta", None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"{where}: rope_scaling={scaling!r} is not implemented (only the default rotary embedding)")
    if params is not None:
        extra = sorted(set(params) - {"rope_type", "rope_theta"})
        if params.get("rope_type", "default") != "default" or extra:
            raise ValueError(f"{where}: rope_parameters={params!r} is not implemented (only "
                             f"{{'rope_type': 'default', 'rope_theta': ...}})")
        if theta is not None and float(theta) != float(params["rope_theta"]):
            raise ValueError(f"{where}: rope_theta={theta} disagrees with rope_parameters.rope_theta={params['rope_theta']}")
        theta = params.get("rope_theta", theta)
    return None if theta is None else float(theta)
