"""The generic path's torch model: transformers' own modeling code behind our CausalLM contract.

:class:`HfCausalLM` holds the modules of the ``AutoModelForCausalLM`` that transformers builds for
``model.path`` under THEIR OWN names (it registers the HF model's children, not the HF model), so
its ``state_dict`` is the checkpoint's: loading, publishing and every weight transport see Hugging
Face names with no map. A tied head is not registered twice (the embedding is the head), as
``save_pretrained`` writes it. What the rest of the system relies on, and how it is met here:

- ``forward(input_ids, position_ids, attention_mask, cache, logits_mask, score, segment_ids)`` as
  workers/models/blocks/decoder.py ``CausalLM.forward``: transformers' base model gives the final
  hidden states (``last_hidden_state``, after its final norm); our head scores them, with the fused
  log-prob head (workers/models/blocks/logprobs.py) where the head is a plain matrix (no bias, no
  logit scaling or soft-capping, which :meth:`head` applies as transformers does). Routing is empty
  (``routed_experts [B, T, 0, 0]``): Router Replay (``forced_experts``) and context parallelism
  (``cp``) are refused. ``segment_ids`` (packed rows) are emulated the way transformers packs:
  no padding mask and positions that restart at 0 in every sample, from which its mask builder
  (``masking_utils.find_packed_sequence_indices``) keeps attention inside each sample.
- ``model.layers``: the decoder layers (the ModuleList of the class transformers names in
  ``_no_split_modules``), for FSDP2 (one unit per layer), activation checkpointing and per-layer
  compile (workers/trainer/parallel/fsdp.py, micro.py, compile.py). Where transformers' base model is not
  called ``model`` with a ``layers`` list (GPT-2's ``transformer.h``), ``model`` is an unregistered
  alias, so parameter names do not change.
- ``new_cache()``: an :class:`HfKVCache`, the engine's KVCache (rows leave, prefills join, left
  padding trimmed: workers/models/blocks/cache.py) whose per-layer keys and values are handed to
  transformers as a ``DynamicCache`` for each forward and read back after it.

Built on the meta device with REAL buffers (:func:`params_on_meta`): the trainer shards a meta model
and fills it from the checkpoint, but a rotary embedding's ``inv_freq`` is a non-persistent buffer
no checkpoint holds, so the values computed at construction are kept and put back by ``to_empty``.
"""
from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks.cache import KVCache
from workers.models.blocks.decoder import ModelOutput
from workers.models.blocks.logprobs import Scoring, score_head

STATIC_UNSUPPORTED = ("the generic transformers path keeps transformers' KV cache (no static slots, no CUDA graphs); "
                      "inference.static_cache=off, or inference=sglang_node for SGLang")
SELF_CHECK_TOLERANCE = 1e-3
"""Largest |our logits - transformers' logits| / max |logit| the engine accepts at start (:meth:`HfCausalLM.self_check`)."""


@contextlib.contextmanager
def params_on_meta():
    """Parameters registered while open go to the meta device (nothing allocated, no init cost);
    buffers stay where they are made, with their values (a rotary ``inv_freq``)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def hf_config(model_cfg):
    """transformers' config of ``model_cfg.path`` (read locally), as the run computes it: stored
    quantization dropped (block FP8 is dequantised on load), the chosen attention kernel."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config._attn_implementation = model_cfg.attn_implementation
    return config


def decoder_layers(hf) -> nn.ModuleList:
    """The decoder's layer list: the ModuleList of the class transformers keeps whole (``_no_split_modules``)."""
    kinds = set(getattr(hf, "_no_split_modules", None) or ())
    lists = [m for m in hf.base_model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    found = [m for m in lists if type(m[0]).__name__ in kinds]
    if not found:
        raise ValueError(f"{type(hf).__name__}: no decoder layer list (no ModuleList of {sorted(kinds) or '?'} "
                         f"in its base model): the generic path cannot shard or checkpoint it per layer")
    return max(found, key=len)


class HfCausalLM(nn.Module):
    """A transformers causal LM with :class:`~workers.models.blocks.decoder.CausalLM`'s interface."""

    static_cache_unsupported = STATIC_UNSUPPORTED
    """Read by the embedded engine (workers/inference/embedded/static_cache.py): dynamic engine only."""

    def __init__(self, cfg, hf: nn.Module):
        super().__init__()
        self.config = cfg
        if hf._parameters:
            raise ValueError(f"{type(hf).__name__} holds parameters outside its submodules: not supported")
        head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
        self.tied = head is not None and head.weight is embed.weight
        for name, child in hf.named_children():
            if not (self.tied and child is head):
                self.add_module(name, child)
        # Unregistered references (object.__setattr__: no second name for any parameter).
        object.__setattr__(self, "hf", hf)
        object.__setattr__(self, "embed", embed)
        object.__setattr__(self, "out", head)
        layers = decoder_layers(hf)
        base = self._modules.get("model")
        if base is not None and getattr(base, "layers", None) is layers:
            pass
        elif base is not None:
            object.__setattr__(base, "layers", layers)
        else:
            object.__setattr__(self, "model", types.SimpleNamespace(layers=layers))
        self._cache_kw = "cache" if "cache" in inspect.signature(hf.base_model.forward).parameters else "past_key_values"
        text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        self.logit_ops = tuple((op, float(v)) for op in ("logit_scale", "logits_scaling", "final_logit_softcapping")
                               if (v := getattr(text, op, None)) is not None and not (op != "final_logit_softcapping"
                                                                                     and float(v) == 1.0))
        self.plain_head = not self.logit_ops and getattr(head, "bias", None) is None
        self._buffers_at_build = {n: b.detach().clone() for n, b in self.named_buffers() if b.device.type != "meta"}

    # ---- what the trainer and the engine call ---------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True):
        """Allocate every tensor on ``device`` uninitialised, then put back the buffers computed at
        build time (the rotary tables no checkpoint holds)."""
        super().to_empty(device=device, recurse=recurse)
        with torch.no_grad():
            for name, value in self._buffers_at_build.items():
                owner, _, attr = name.rpartition(".")
                buf = self.get_submodule(owner)._buffers[attr] if owner else self._buffers[attr]
                buf.copy_(value.to(buf.device))
        return self

    def _apply(self, fn, recurse: bool = True):
        """After a conversion (``to``, ``to_empty``) the tied head of transformers' class (not one of our
        modules) points at the converted embedding again, so its own forward (:meth:`self_check`) runs."""
        super()._apply(fn, recurse)
        if self.tied:
            self.out.weight = self.embed.weight
        return self

    def train(self, mode: bool = True):
        """Always evaluation mode: transformers' dropout (Phi-2's ``resid_pdrop``, ...) would make the
        trainer's function differ from the engine's, and RL's importance ratios compare the two."""
        return super().train(False)

    @property
    def num_routed_layers(self) -> int:
        return 0

    def new_cache(self) -> "HfKVCache":
        return HfKVCache(len(self.model.layers))

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.tied else self.out.weight

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states, as the transformers class computes them after its lm_head."""
        logits = F.linear(h, self.head_weight(), None if self.tied else self.out.bias)
        for op, value in self.logit_ops:
            if op == "logit_scale":  # Cohere
                logits = logits * value
            elif op == "logits_scaling":  # Granite
                logits = logits / value
            else:  # Gemma 2 / 3 soft-capping
                logits = torch.tanh(logits / value) * value
        return logits

    def forward(self, input_ids: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                forced_experts: Optional[torch.Tensor] = None, forced_mask: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None, logits_mask: Optional[torch.Tensor] = None,
                cp: Optional[Any] = None, score: Optional[Scoring] = None) -> ModelOutput:
        """The contract of ``CausalLM.forward`` (see the module docstring for what differs)."""
        if forced_experts is not None:
            raise ValueError("the generic transformers path has no router to replay (trainer.router_replay=false)")
        if cp is not None:
            raise ValueError("the generic transformers path has no context parallelism (trainer.parallel.cp=1)")
        b, t = input_ids.shape
        dev = input_ids.device
        mask, hf_cache = attention_mask, None
        if segment_ids is not None:  # packed rows: transformers' own packing (positions restart per sample)
            assert cache is None and position_ids is not None, "packing is for full-sequence forwards with positions"
            mask = None
        elif cache is not None:
            if getattr(cache, "static", False) or not isinstance(cache, HfKVCache):
                raise ValueError(STATIC_UNSUPPORTED)
            valid = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
            past = cache.length
            mask = valid if cache.key_mask is None else torch.cat([cache.key_mask, valid], dim=1)
            cache.key_mask = mask
            if position_ids is None:
                position_ids = torch.arange(past, past + t, device=dev).expand(b, t)
            hf_cache = cache.to_hf()
        elif mask is not None and bool(mask.all()):
            mask = None  # no padding: plain causal attention (sdpa's is_causal path)
        kwargs = {self._cache_kw: hf_cache, "use_cache": hf_cache is not None}
        h = self.hf.base_model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                               **kwargs).last_hidden_state
        if hf_cache is not None:
            cache.from_hf(hf_cache)
        if logits_mask is not None:
            h = h[logits_mask]
        logits = logp = entropy = head_loss = None
        if score is None:
            logits = self.head(h)
        else:
            assert logits_mask is not None, "score needs logits_mask (which positions predict its targets)"
            logp, entropy, head_loss = score_head(h, score, self.head,
                                                  weight=self.head_weight() if self.plain_head else None)
        return ModelOutput(logits=logits, aux_loss=h.new_zeros((), dtype=torch.float32),
                           expert_load=torch.zeros(0, 0, device=dev),
                           routed_experts=torch.zeros(b, t, 0, 0, dtype=torch.long, device=dev),
                           logp=logp, entropy=entropy, head_loss=head_loss)

    @torch.no_grad()
    def self_check(self, length: int = 8) -> float:
        """Our logits against the transformers class's own forward on a probe; ValueError when they
        differ (a logit transform after lm_head this path does not know). The embedded engine runs it
        once its first weights are loaded: trainer and engine share :meth:`head`, so this guards both."""
        ids = (torch.arange(length, device=self.embed.weight.device)[None] * 7 + 3) % self.config.vocab_size
        ours = self(ids).logits.float()
        theirs = self.hf(input_ids=ids).logits.float()
        scale = float(theirs.abs().max().clamp_min(1e-6))
        err = float((ours - theirs).abs().max()) / scale
        if not err <= SELF_CHECK_TOLERANCE:
            raise ValueError(f"{type(self.hf).__name__}: the generic path's logits differ from transformers' own "
                             f"forward by {err:.3g} (relative; tolerance {SELF_CHECK_TOLERANCE}): its head does "
                             f"something after lm_head this path does not reproduce; use inference=sglang_node and a "
                             f"native family, or open an issue with the architecture name")
        return err


class HfKVCache(KVCache):
    """The engine's dynamic KVCache (``[B, H, T, D]`` keys and values per layer, ``key_mask`` for left
    padding) handed to transformers as a ``DynamicCache`` for one forward and read back after it."""

    def to_hf(self):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        if self.keys[0] is not None:
            for k, v in zip(self.keys, self.values):
                layer = DynamicLayer()
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
                cache.layers.append(layer)
        return cache

    def from_hf(self, cache) -> None:
        from transformers.cache_utils import DynamicLayer

        layers = list(cache.layers)
        bad = [type(x).__name__ for x in layers if type(x) is not DynamicLayer or x.keys is None or x.keys.dim() != 4]
        if len(layers) != self.num_layers or bad:
            raise ValueError(f"the generic path's engine keeps one key/value pair per layer; this model's cache has "
                             f"{len(layers)} layers for {self.num_layers} decoder layers ({sorted(set(bad))}): serve it "
                             f"with inference=sglang_node")
        self.keys = [x.keys for x in layers]
        self.values = [x.values for x in layers]


def build(model_cfg, *, device=None, dtype=None) -> HfCausalLM:
    """The model with uninitialised parameters on ``device`` (``"meta"``: none allocated), buffers computed."""
    from transformers import AutoModelForCausalLM

    from workers.common.dtypes import torch_dtype

    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    with params_on_meta():
        hf = AutoModelForCausalLM.from_config(hf_config(model_cfg), dtype=dtype or torch.float32)
    model = HfCausalLM(model_cfg, hf.eval())
    if str(device) != "meta":
        model.to_empty(device=device or "cpu")
    return model


def init(model_cfg, dtype) -> HfCausalLM:
    """Step-0 weights: the checkpoint of ``model_cfg.path``, streamed in tensor by tensor, on the CPU."""
    from workers.models.hf_checkpoint import load_pretrained

    return load_pretrained(build(model_cfg, device="meta", dtype=dtype), model_cfg)


def not_built(model_cfg, name: str) -> bool:
    """Checkpoint tensors transformers itself drops on load (its class's ``_keys_to_ignore_on_load_unexpected``,
    and rotary ``inv_freq`` tables older checkpoints carry): skipped, not refused."""
    import re

    from workers.models.hf_generic.hf_source import causal_lm_classes
    import transformers

    cls = getattr(transformers, model_cfg.architecture, None) or getattr(
        transformers, causal_lm_classes().get(model_cfg.model_type, ""), None)
    patterns = list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())
    # whole name components only: GPT-2's "attn.bias" (an old causal-mask buffer) is not "c_attn.bias"
    return name.endswith(".inv_freq") or any(re.search(p if p.startswith("^") else r"(^|\.)" + p + "$", name)
                                             for p in patterns)
