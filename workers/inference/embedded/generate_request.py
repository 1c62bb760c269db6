"""SGLang's ``/generate`` body -> the embedded engine's requests, accepting what SGLang accepts.

Why: the embedded server must work behind SGLang's own router (smg), which forwards the
client's body plus fields of its own (``background``, routing and PD hints, ...), and behind
any SGLang client. The reference is SGLang's request contract (sglang/api/v1 GenerateRequest,
GenerateReqInput in srt/managers/io_struct.py and SamplingParams.verify), without importing
sglang here:
  - top level: unknown keys are IGNORED (SGLang's contract: "unknown keys ignored"); known
    fields that only steer SGLang's scheduler, logging, LoRA-free routing or PD transfer are
    type-checked like SGLang does and ignored; fields whose effect the engine cannot give
    (text, embeddings, media, hidden states, top logprobs, LoRA, constrained decoding ...)
    are refused when set, naming the field, because ignoring them would return a silently
    different answer;
  - sampling_params: unknown keys are REFUSED (SGLang: "unknown keys rejected"); values
    outside SGLang's own ranges are refused with SGLang's range; values inside them that the
    engine cannot honour (min_p > 0, penalties ...) are refused as unsupported, since the returned
    logprobs would be wrong; detokenizer-only options are ignored.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from typing import Any, Callable, Optional, Sequence

from workers.inference.embedded.engine import GenRequest
from workers.inference.embedded.parsing import BadRequest, _int

log = logging.getLogger("slurmrl.inference")
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"


def _is(types) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return v is None or (isinstance(v, types) and not (isinstance(v, bool) and bool not in types))
    return check


def _or_list(types) -> Callable[[Any], bool]:
    one = _is(types)
    return lambda v: one(v) or (isinstance(v, list) and all(one(x) for x in v))


STR, INT, BOOL, DICT = (str,), (int,), (bool,), (dict,)
IGNORED = {  # SGLang fields with no effect on a token-id engine: checked like SGLang, then ignored
    "return_text_in_logprobs": _is(BOOL), "require_reasoning": _is(BOOL), "return_prompt_token_ids": _is(BOOL),
    "log_metrics": _is(BOOL), "no_logs": _is(BOOL), "background": _is(BOOL), "return_bytes": _is(BOOL),
    "routed_dp_rank": _is(INT), "disagg_prefill_dp_rank": _is(INT), "data_parallel_rank": _is(INT),
    "priority": _is(INT), "max_thinking_tokens": _is(INT), "routing_key": _is(STR), "conversation_id": _is(STR),
    "extra_key": _or_list(STR), "cache_salt": _or_list(STR), "custom_labels": _is(DICT),
    "bootstrap_host": _or_list(STR), "bootstrap_port": _or_list(INT), "bootstrap_room": _or_list(INT),
    "bootstrap_pair_key": _or_list(STR), "decode_tp_size": _or_list(INT), "modalities": _or_list(STR),
    "external_trace_header": _is(DICT), "received_time": _is((int, float)), "http_worker_ipc": _is(STR),
    "return_sampling_mask": _or_list(BOOL), "kv_hints": lambda v: True, "images_config": _is(DICT),
    "mm_hashes": lambda v: v is None or isinstance(v, list),  # only meaningful with media (refused below)
    "model": _is(STR),  # not SGLang's: smg adds the model id it routed by
}
REFUSED = {  # field -> why it cannot be ignored when set (null, false and empty are fine)
    "text": "the embedded engine has no tokenizer; send input_ids",
    "input_embeds": "the embedded engine takes token ids only",
    "image_data": "the embedded model is text-only", "video_data": "the embedded model is text-only",
    "audio_data": "the embedded model is text-only",
    "token_ids_logprob": "logprobs of chosen token ids are not computed by the embedded engine",
    "return_hidden_states": "hidden states are not returned by the embedded engine",
    "return_entropy": "entropies are not returned by the embedded engine",
    "return_indexer_topk": "the embedded model has no indexer",
    "lora_path": "the embedded engine has no LoRA adapters", "lora_id": "the embedded engine has no LoRA adapters",
    "custom_logit_processor": "custom logit processors are not enabled",
    "session_params": "sessions are not supported by the embedded engine",
    "session_id": "sessions are not supported by the embedded engine",
}
_warned: set[str] = set()


def _unset(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == "" or (isinstance(v, list) and all(_unset(x) for x in v))


def _float(v: Any, f: str, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{f}: expected a finite number, got {v!r}"[:300])
    return float(v)


def _neutral(f: str, v: Any, neutral: Any, valid: bool, rng: str) -> None:
    if not valid:
        raise BadRequest(f"{f}={v!r} must be in {rng} (as in SGLang)")
    if v != neutral:
        raise BadRequest(f"{f}={v!r} is not supported by the embedded engine (only {neutral!r}): the returned "
                         f"logprobs would not be the sampler's")


def parse_sampling(sp: Any, field: str, vocab_size: int, max_len: int) -> dict:
    """One SGLang SamplingParams object -> GenRequest keyword arguments."""
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest(f"{field}: expected an object, got {type(sp).__name__}")
    out: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": 128, "stop_token_ids": ()}
    for key, v in sp.items():
        f = f"{field}.{key}"
        if key == "temperature":
            out[key] = _float(v, f, 1.0)
            if out[key] < 0:
                raise BadRequest(f"{f}: expected a number >= 0, got {v!r}")
        elif key == "max_new_tokens":
            out[key] = max_len if v is None else _int(v, f, 0)  # None: until the context is full
        elif key == "stop_token_ids":
            if v is not None and not isinstance(v, list):
                raise BadRequest(f"{f}: expected a list of token ids")
            out[key] = tuple(_int(t, f"{f}[{i}]", 0, vocab_size - 1) for i, t in enumerate(v or []) if t is not None)
        elif key == "top_p":  # both engines sample within the nucleus
            out[key] = _float(v, f, 1.0)
            if not 0 < out[key] <= 1:
                raise BadRequest(f"{f}={v!r} must be in (0, 1] (as in SGLang)")
        elif key in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            default = {"repetition_penalty": 1.0}.get(key, 0.0)
            x = _float(v, f, default)
            valid, rng = {"min_p": (0 <= x <= 1, "[0, 1]"),
                          "repetition_penalty": (0 < x <= 2, "(0, 2]")}.get(key, (-2 <= x <= 2, "[-2, 2]"))
            _neutral(f, x, default, valid, rng)
        elif key == "top_k":
            k = TOP_K_ALL if v is None else _int(v, f)
            _neutral(f, TOP_K_ALL if k == -1 or k >= vocab_size else k, TOP_K_ALL, k == -1 or k >= 1,
                     "-1 or >= 1")
        elif key in ("min_new_tokens", "n", "beam_width"):
            n = {"min_new_tokens": 0}.get(key, 1) if v is None else _int(v, f, 0 if key == "min_new_tokens" else 1)
            _neutral(f, n, 0 if key == "min_new_tokens" else 1, True, "")
        elif key in ("stop", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
                     "sampling_seed", "watermark", "choice"):
            if not (_unset(v) or (key == "watermark" and isinstance(v, dict) and not v.get("enabled"))):
                raise BadRequest(f"{f}={v!r:.100} is not supported by the embedded engine (token ids in, token ids "
                                 f"out, one seeded sampler per server)")
        elif key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if v is not None and not isinstance(v, bool):
                raise BadRequest(f"{f}: expected true/false, got {v!r}"[:300])
        elif key == "stream_interval":
            if v is not None:
                _int(v, f, 1)
        elif key != "custom_params":  # read only by custom logit processors (refused at the top level)
            raise BadRequest(f"{f}: unknown sampling parameter (SGLang refuses unknown keys too)")
    return out


@dataclasses.dataclass(frozen=True)
class ParsedGenerate:
    reqs: list[GenRequest]
    is_batch: bool
    return_logprob: list[bool]
    """Per request (SGLang takes a bool or one per prompt)."""
    stream: bool


def _per_prompt(body: dict, key: str, n: int, default: Any) -> list:
    v = body.get(key)
    if isinstance(v, list):
        if len(v) != n:
            raise BadRequest(f"{key}: {len(v)} entries for {n} prompts")
        return [default if x is None else x for x in v]
    return [default if v is None else v] * n


def _adapters(body: dict, n: int, served: Optional[Sequence[str]]) -> list[Optional[str]]:
    """SGLang's ``lora_path`` (one name, or one per prompt) checked against the adapters the engine
    serves (``base``: none); every prompt None when not set."""
    names = _per_prompt(body, "lora_path", n, None)
    for x in names:
        if x is not None and (not isinstance(x, str) or (x not in served and x != "base")):
            raise BadRequest(f"lora_path: {x!r:.100} is not an adapter this server serves: {list(served)} or 'base'")
    return names


def parse_generate(body: Any, *, vocab_size: int, max_len: int,
                   adapters: Optional[Sequence[str]] = None) -> ParsedGenerate:
    """SGLang GenerateReqInput -> the engine's requests. Raises BadRequest naming the field.
    ``adapters``: the LoRA adapters' names the engine serves (None: no LoRA, ``lora_path`` refused)."""
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    for key, why in REFUSED.items():
        if key == "lora_path" and adapters is not None:
            continue
        if not _unset(body.get(key)):
            raise BadRequest(f"{key}: {why}")
    for key, ok in IGNORED.items():
        if key in body and not ok(body[key]):
            raise BadRequest(f"{key}: {body[key]!r:.100} has the wrong type for SGLang's {key}")
    unknown = sorted(set(body) - set(IGNORED) - set(REFUSED) - {
        "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid", "stream",
        "return_routed_experts", "routed_experts_start_len"})
    for key in unknown:
        if key not in _warned:  # SGLang ignores unknown keys; say so once, in case it is a typo
            _warned.add(key)
            log.warning("/generate: ignoring unknown field %r (as SGLang does)", key[:100])
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream: expected true/false, got {stream!r}"[:300])
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids: expected a non-empty list of token ids (or a list of such lists)")
    is_batch = isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    n = len(prompts)
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != n:
            raise BadRequest(f"sampling_params: {len(sps)} entries for {n} prompts")
        params = [parse_sampling(sp, f"sampling_params[{i}]", vocab_size, max_len) for i, sp in enumerate(sps)]
    else:
        params = [parse_sampling(sps, "sampling_params", vocab_size, max_len)] * n
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rids, str) and not is_batch:
        rids = [rids]
    elif not (isinstance(rids, list) and len(rids) == n and all(isinstance(r, str) for r in rids)):
        raise BadRequest(f"rid: expected {'a list of ' + str(n) + ' strings' if is_batch else 'a string'}")
    logprob = _per_prompt(body, "return_logprob", n, False)
    for x in logprob:
        if not isinstance(x, bool):
            raise BadRequest(f"return_logprob: expected true/false (or one per prompt), got {x!r}"[:300])
    for x in _per_prompt(body, "logprob_start_len", n, -1):
        _int(x, "logprob_start_len", -1)  # input logprobs: not computed here
    for x in _per_prompt(body, "top_logprobs_num", n, 0):
        if _int(x, "top_logprobs_num", 0) != 0:
            raise BadRequest("top_logprobs_num: top logprobs are not supported by the embedded engine")
    routed = body.get("return_routed_experts") or False
    if not isinstance(routed, bool):
        raise BadRequest(f"return_routed_experts: expected true/false, got {routed!r}"[:300])
    start = _int(body.get("routed_experts_start_len") or 0, "routed_experts_start_len", 0)
    lora = _adapters(body, n, adapters) if adapters is not None else [None] * n
    reqs = []
    for i, (p, sp, rid) in enumerate(zip(prompts, params, rids)):
        f = f"input_ids[{i}]" if is_batch else "input_ids"
        if not isinstance(p, list) or not p:
            raise BadRequest(f"{f}: expected a non-empty list of token ids")
        if len(p) >= max_len:
            raise BadRequest(f"{f}: prompt of {len(p)} tokens leaves no room to generate "
                             f"(the engine's limit: {max_len} positions, model.max_position_embeddings or the "
                             f"static engine's inference.max_seq_len)")
        toks = [_int(t, f"{f}[{j}]", 0, vocab_size - 1) for j, t in enumerate(p)]
        reqs.append(GenRequest(input_ids=toks, rid=rid, return_routed_experts=routed, routed_experts_start_len=start,
                               adapter=lora[i], **sp))
    return ParsedGenerate(reqs=reqs, is_batch=is_batch, return_logprob=logprob, stream=stream)
