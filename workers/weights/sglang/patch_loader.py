"""Sparse patches applied INSIDE an SGLang server: the custom weight loader SGLang calls by import path.

The extension point (pinned sglang 0.5.23; tests/unit/inference/test_sglang_weight_protocol.py re-reads it):
the server is started with ``--custom-weight-loader`` naming :data:`wire.DELTA_LOADER`
(args.weight_loader_args); ``/update_weights_from_tensor`` {serialized_named_tensors, load_format}
whose load_format is one of those names runs, on every TP rank, ``dynamic_import(load_format)(model,
named_tensors)`` (model_runner_components/weight_updater.py) between /begin_weight_update and
/end_weight_update. Each rank unpickles only its own entry of serialized_named_tensors, but the request
itself reaches every rank of a server through its TP CPU group (so a per-rank entry saves no bytes).

What travels: ``named_tensors[0]`` is ``(DESCRIPTOR, uint8 JSON)``: {format, version, anchor,
group_name, payload_bytes, manifest_bytes, checksum, verdict_dir, shapes}; the patch itself (the
trainer's safetensors blob + manifest JSON {"parts", "sums"}: delta_wire.py's payload) either follows
inline as ``(PAYLOAD, uint8)`` (small patches, tests) or is broadcast by trainer rank 0 on SGLang's own
weight-update group named ``group_name`` (formed by /init_weights_update_group; found in torch's
process-group registry), so it moves at NCCL speed, like SGLang's own update_weights_from_distributed.
With ``weights.transport=filesystem`` the descriptor instead names a patch step on shared storage
{format, version, base, anchor, step_dir, verdict_dir} and each rank PULLS from it only the parts of the
tensors it holds (:func:`pull_patch`; workers/weights/sglang/patch_pull.py: one pread per entry), so
an EP rank reads its own experts' patches plus the non-expert tensors, not the whole patch; its verdict
adds ``bytes_read``.

Where each HF tensor lands (:class:`Targets`): a routed expert ``...mlp.experts.{e}.{gate,up,down}_proj``
is a slice of its FusedMoE stacks ``w13_weight [E_local, 2I, H]`` (gate rows first, then up) and
``w2_weight [E_local, H, I]``; logical expert e lives in the local slots the module's own maps give
(EP: ``_map_global_expert_id_to_local_expert_id``; EPLB: every physical copy of e on this rank). Other
tensors land in the parameter of the same name, or as row ranges of SGLang's fused ones (qkv_proj,
gate_up_proj, fused_qkv_a_proj_with_mqa). Only tensors a rank holds WHOLE are patched (expert TP = 1,
attention DP = TP): then every touched tensor's sum64 is checked after the in-place apply
(workers/weights/delta/apply.apply_parts: one index_copy_ per stack, never a loop over experts) and
anything else refuses the whole patch, naming the tensor (quantized params, TP-split tensors).

Never raises into SGLang (an exception would take the scheduler down): the outcome is written to
``verdict_dir/v{version}.{host}.{pid}.json`` {ok, message, changed, bytes_read}, which the orchestrator reads; a
refusal leaves the weights as they were and the orchestrator loads the version from disk.
"""
from __future__ import annotations

import functools
import json
import os
import re
import socket
import weakref
from typing import Any, Callable, Mapping, Optional

import torch

DESCRIPTOR = "slurmrl.delta"
PAYLOAD = "slurmrl.delta.payload"
EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                    r"\.weight$")
W13_PIECE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
FUSED_ROWS = (("q_proj", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
              ("k_proj", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
              ("v_proj", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
              ("gate_proj", "gate_up_proj", ("gate_proj", "up_proj")),
              ("up_proj", "gate_up_proj", ("gate_proj", "up_proj")),
              ("q_a_proj", "fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa")),
              ("kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa")))
"""HF pieces SGLang concatenates by rows into one parameter (the piece, the fused name, the order)."""


class Refused(Exception):
    """This rank cannot apply the patch; nothing was changed."""


def eplb_copies(module, expert: int) -> list[int]:
    """Physical expert ids of logical ``expert`` (EPLB's placement when the module uses it, else itself)."""
    if getattr(module, "uses_expert_location", False):
        try:
            from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
        except ImportError:  # not inside an SGLang server
            return [expert]
        meta = get_global_expert_location_metadata()
        if meta is not None:
            return list(meta.logical_to_all_physical(module.layer_id, expert))
    return [expert]


@functools.lru_cache(maxsize=1)
def _layout_method():
    """SGLang's ``_weight_layout_method`` when running inside a server (imported once), else None."""
    try:
        from sglang.srt.layers.moe.fused_moe_triton.layer import _weight_layout_method
    except Exception:  # noqa: BLE001 - not inside an SGLang server (or no GPU build of it)
        return None
    return _weight_layout_method


def up_rows_first(module) -> bool:
    """Does this FusedMoE keep up_proj rows before gate_proj rows in w13 (its layout method's
    ``load_up_proj_weight_first``: trtllm cutlass kernels)? SGLang's own rule (FusedMoE._load_w13)."""
    layout = _layout_method() if hasattr(module, "quant_method") else None  # a real FusedMoE has one
    if layout is None:
        return bool(getattr(module, "load_up_proj_weight_first", False))
    return bool(getattr(layout(module), "load_up_proj_weight_first", False))


class Targets:
    """HF tensor name -> the contiguous views of this rank's parameters it lands in (first: primary)."""

    def __init__(self, model, shapes: Mapping[str, list[int]], *, copies: Callable[[Any, int], list[int]] = eplb_copies):
        self.model, self.shapes, self.copies = model, shapes, copies
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())

    def views(self, name: str) -> list[torch.Tensor]:
        """Every place ``name`` lives on this rank ([] : an expert this rank does not hold)."""
        shape = tuple(self.shapes.get(name, ()))
        p = self.params.get(name)
        if p is not None:
            return [self._check(name, p.data, shape)]
        m = EXPERT.match(name)
        if m is not None:
            return self._expert(name, m)
        prefix, _, leaf = name.rpartition(".")
        mod, _, piece = prefix.rpartition(".")
        for part, fused, order in FUSED_ROWS:
            if piece == part and f"{mod}.{fused}.{leaf}" in self.params:
                return [self._rows(name, self.params[f"{mod}.{fused}.{leaf}"].data, mod, order, piece, leaf, shape)]
        raise Refused(f"tensor {name} has no parameter of that name or a known fusion of it in this model")

    def _expert(self, name: str, m: re.Match) -> list[torch.Tensor]:
        module = self.modules.get(m["module"])
        if module is None or not hasattr(module, "w13_weight"):
            raise Refused(f"expert tensor {name}: no fused MoE module {m['module']} in this model")
        if getattr(module, "moe_tp_size", 1) != 1:
            raise Refused(f"expert tensor {name} is split over {module.moe_tp_size} MoE TP ranks here (patches apply "
                          f"to tensors a rank holds whole: run with ep == tp)")
        out = []
        for phys in self.copies(module, int(m["expert"])):
            local = module._map_global_expert_id_to_local_expert_id(phys)
            if local < 0 or local >= module.w13_weight.shape[0]:
                continue
            if m["proj"] in W13_PIECE:
                w13 = module.w13_weight.data[local]
                half = w13.shape[0] // 2
                k = W13_PIECE[m["proj"]] ^ int(up_rows_first(module))
                view = w13[k * half:(k + 1) * half]
            else:
                view = module.w2_weight.data[local]
            out.append(self._check(name, view, tuple(self.shapes.get(name, view.shape))))
        return out

    def _rows(self, name, fused: torch.Tensor, mod, order, piece, leaf, shape) -> torch.Tensor:
        sizes = []
        for p in order:
            s = self.shapes.get(f"{mod}.{p}.{leaf}")
            if s is None:
                raise Refused(f"tensor {name}: the shape of its sibling {mod}.{p}.{leaf} was not announced")
            sizes.append(int(s[0]))
        if sum(sizes) != fused.shape[0]:
            raise Refused(f"tensor {name} is a TP shard of {mod} here ({fused.shape[0]} rows held of {sum(sizes)}): "
                          f"patches apply to tensors a rank holds whole")
        start = sum(sizes[:order.index(piece)])
        return self._check(name, fused[start:start + sizes[order.index(piece)]], shape)

    @staticmethod
    def _check(name: str, view: torch.Tensor, shape: tuple) -> torch.Tensor:
        if shape and tuple(view.shape) != tuple(shape):
            raise Refused(f"tensor {name} is held as {list(view.shape)} here, published {list(shape)}: a TP shard "
                          f"or another layout (patches apply to tensors a rank holds whole)")
        if not view.is_floating_point() or view.element_size() < 2 or not view.is_contiguous():
            raise Refused(f"tensor {name} is held as {view.dtype} (quantized or not contiguous): cannot patch it")
        return view


_STATE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
"""Per model: {"anchor": the full version the digests were computed under, "sums": {name: sum64}}. Keyed by the
model object itself, weakly: an ``id()`` key outlived its model, and a new model given the freed id inherited
stale sums (a test saw a patch refused that way when two models lived one after the other in one process)."""


def apply_patch(model, desc: Mapping[str, Any], raw: bytes, *, copies=eplb_copies) -> int:
    """Decode, map and apply one patch to ``model`` (verified, or rolled back); returns elements changed."""
    from workers.weights.delta.patch import decode

    mlen = int(desc["manifest_bytes"])
    meta = json.loads(raw[len(raw) - mlen:].decode())
    parts = decode(raw[:len(raw) - mlen], meta["parts"], dtypes=meta["dtypes"], where=f"patch v{desc['version']}")
    targets = Targets(model, desc.get("shapes", {}), copies=copies)
    views = {name: targets.views(name) for name in parts}
    expected = {n: int(v, 16) for n, v in meta["sums"].items()}
    return apply_views(model, desc, views, parts, expected, meta["dtypes"])


def pull_patch(model, desc: Mapping[str, Any], *, copies=eplb_copies) -> tuple[int, int]:
    """weights.transport=filesystem: read from ``desc["step_dir"]`` only the parts of the tensors this rank
    holds (workers/weights/sglang/patch_pull.py) and apply them; returns (elements changed, bytes read)."""
    from pathlib import Path

    from workers.weights.sglang.patch_pull import read_held_parts, read_patch_index

    step_dir = Path(desc["step_dir"])
    index = read_patch_index(step_dir, int(desc["version"]), int(desc["base"]))
    tensors = index["tensors"]
    targets = Targets(model, {n: m["shape"] for n, m in tensors.items()}, copies=copies)
    views = {n: targets.views(n) for n, m in tensors.items() if m["parts"]}  # refuses what it cannot map
    held = [n for n, v in views.items() if v]
    parts, nread = read_held_parts(step_dir, index, held)
    expected = {n: int(tensors[n]["sum64"], 16) for n in held}
    changed = apply_views(model, dict(desc, anchor=index["anchor"]), views, parts, expected,
                          {n: tensors[n]["dtype"] for n in held})
    return changed, nread


def apply_views(model, desc: Mapping[str, Any], views: Mapping[str, list[torch.Tensor]], parts, expected, dtypes) -> int:
    """Apply ``parts`` to the tensors of this rank they map to (``views``: Targets.views per name; [] not
    held), verified by every touched tensor's sum64, then copy into EPLB's replicas; returns elements changed.

    The sum64 of each touched tensor is computed once and carried from patch to patch (an O(changed) update);
    the carried value is dropped when the anchor changes or, where the descriptor names its ``base``, when this
    rank did not apply that base itself through this loader (it was loaded from disk since: the weights moved
    without the loader seeing it)."""
    from workers.weights.delta.apply import apply_parts
    from workers.weights.delta.sum64 import tensor_sum64
    from workers.weights.shards import dtype_from_name

    state = _STATE.setdefault(model, {"anchor": None, "version": None, "sums": {}})
    if state["anchor"] != desc["anchor"] or ("base" in desc and state.get("version") != desc["base"]):
        state.update(anchor=desc["anchor"], sums={})
    params, replicas = {}, []
    for name in parts:
        vs = views.get(name) or []
        if vs:
            params[name] = vs[0]
            replicas += [(v, vs[0]) for v in vs[1:]]
    mine = {n: p for n, p in parts.items() if n in params}
    for n in mine:
        if n not in state["sums"]:
            state["sums"][n] = tensor_sum64(params[n].to(dtype_from_name(dtypes[n])))
    state["sums"] = apply_parts(params, mine, state["sums"], expected, where=f"patch v{desc['version']}")
    state["version"] = desc["version"]
    for dst, src in replicas:  # EPLB's redundant copies of an expert on this rank
        dst.copy_(src)
    return sum(p.count for ps in mine.values() for p in ps)


def _process_group(name: str):
    from torch.distributed.distributed_c10d import _world

    for pg, n in _world.pg_names.items():
        if n == name:
            return pg
    raise Refused(f"no weight-update group {name!r} in this server (/init_weights_update_group first)")


def receive_payload(desc: Mapping[str, Any], device) -> bytes:
    """The patch broadcast by trainer rank 0 on SGLang's weight-update group (src 0, as SGLang's own)."""
    import torch.distributed as dist

    from workers.weights.checksums import buffer_checksum

    buf = torch.empty(int(desc["payload_bytes"]), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0, group=_process_group(desc["group_name"]))
    if buffer_checksum(buf) != desc["checksum"]:
        raise Refused(f"patch v{desc['version']} fails its checksum (corrupt in transit)")
    return bytes(buf.cpu().numpy())


def descriptor_tensor(desc: Mapping[str, Any]) -> str:
    """One TP rank's entry of /update_weights_from_tensor's serialized_named_tensors: base64 of a standard
    pickle of ``[(DESCRIPTOR, uint8 JSON)]`` (a plain CPU tensor: SGLang's SafeUnpickler takes it)."""
    import base64
    import pickle

    blob = torch.frombuffer(bytearray(json.dumps(desc).encode()), dtype=torch.uint8)
    return base64.b64encode(pickle.dumps([(DESCRIPTOR, blob)])).decode()


def _verdict(desc: Optional[Mapping[str, Any]], ok: bool, message: str, changed: int = 0, bytes_read: int = 0) -> None:
    if not desc or not desc.get("verdict_dir"):
        return
    os.makedirs(desc["verdict_dir"], exist_ok=True)
    path = os.path.join(desc["verdict_dir"], f"v{desc['version']}.{socket.gethostname()}.{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"ok": ok, "message": message, "changed": changed, "bytes_read": bytes_read}, f)
    os.replace(path + ".tmp", path)


def load_patch(model, named_tensors) -> None:
    """SGLang's custom-loader entry point: ``(model, [(name, tensor), ...])`` (module docstring)."""
    desc = None
    try:
        tensors = dict(named_tensors)
        if DESCRIPTOR not in tensors:
            raise Refused(f"no {DESCRIPTOR!r} entry: this loader takes slurmrl patches only")
        desc = json.loads(bytes(tensors[DESCRIPTOR].cpu().numpy()).decode())
        if desc.get("step_dir"):  # weights.transport=filesystem: pull this rank's share from shared storage
            with torch.no_grad():
                changed, nread = pull_patch(model, desc)
            _verdict(desc, True, f"applied patch v{desc['version']}: {changed} elements, {nread} bytes read",
                     changed, nread)
            return
        payload = tensors.get(PAYLOAD)
        if payload is not None:
            raw = bytes(payload.cpu().numpy())
        else:
            raw = receive_payload(desc, next(model.parameters()).device)
        with torch.no_grad():
            changed = apply_patch(model, desc, raw)
        _verdict(desc, True, f"applied patch v{desc['version']}: {changed} elements", changed)
    except Exception as e:  # noqa: BLE001 - never into SGLang's scheduler: the verdict carries it
        _verdict(desc, False, f"{type(e).__name__}: {e}"[:2000])
