"""SGLang's weight-receive protocol, read from the pinned sglang's own source.

workers/weights/sglang/wire.py (our sender) and tests/fakes/fake_sglang_weights.py (the
fake's rank processes) follow sglang 0.5.23's receive path. Each test here reads one step of that
path out of the installed package (``ast`` + text, no import: sglang's import pulls CUDA-side
modules) and fails when a version bump changes it: the rank arithmetic, the group's rendezvous, the
per-tensor and flattened receives, the begin/end session, the read-back, and which model classes
can be read back. CI installs the pinned version (``make install-sglang``); a missing sglang fails.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.inference.test_fake_sglang_schema import sglang_root
from workers.common.registry import MODELS
from workers.weights.sglang.wire import FORMATS, WEIGHTS_BY_NAME_ARCHITECTURES


def function_source(rel: str, name: str, cls: str | None = None) -> str:
    """Source of function ``name`` (in class ``cls``) of sglang/``rel``, whitespace squeezed."""
    path = sglang_root() / rel
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if cls is not None and not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        body = node.body if cls is not None else [node]
        for f in body:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name:
                return re.sub(r"\s+", " ", ast.get_source_segment(text, f))
    raise AssertionError(f"sglang/{rel} has no {cls + '.' if cls else ''}{name}: the receive path moved")


UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"


def test_each_server_rank_joins_at_rank_offset_plus_tp_rank():
    src = function_source(UPDATER, "init_weights_update_group", "WeightUpdater")
    assert "rank = rank_offset + self.tp_rank" in src
    assert "init_custom_process_group( backend=backend, init_method=na.to_tcp(), world_size=world_size, " \
           "rank=rank, group_name=group_name," in src


def test_the_group_is_made_the_way_open_update_group_makes_it():
    src = function_source("srt/utils/common.py", "init_custom_process_group")
    for step in ("rendezvous(init_method, rank, world_size, timeout=timeout)", "store.set_timeout(timeout)",
                 "store = PrefixStore(group_name, store)",
                 "_new_process_group_helper( world_size, rank, [], backend, store, group_name=group_name,",
                 "_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}"):
        assert step in src, step


def test_per_tensor_receive_is_one_broadcast_from_rank_0_per_name_in_order():
    src = function_source(UPDATER, "receive_weights_from_distributed", "WeightUpdater")
    assert "for name, dtype, shape in zip(names, dtypes, shapes):" in src
    assert "weight = torch.empty(shape, dtype=target_dtype, device=self.device)" in src
    assert "torch.distributed.broadcast( weight, src=0, group=self._model_update_group[group_name], " \
           "async_op=True, )" in src
    assert 'if load_format == "flattened_bucket":' in src
    assert {"flattened_bucket", "per_tensor"} == set(FORMATS)


def test_flattened_receive_is_one_uint8_broadcast_of_aligned_tensors():
    src = function_source(UPDATER, "_receive_bucketed_weights_from_distributed", "WeightUpdater")
    assert "FlattenedTensorBucket.empty(names, dtypes, shapes, self.device)" in src
    assert "torch.distributed.broadcast( flattened_tensor, src=0, group=self._model_update_group[group_name], )" in src
    empty = function_source("srt/weight_sync/tensor_bucket.py", "empty", "FlattenedTensorBucket")
    assert "size = shape.numel() * dtype.itemsize" in empty and "offset += size" in empty
    assert "if offset % dtype.itemsize:" in empty  # why our batches keep one dtype
    assert "torch.empty(offset, dtype=torch.uint8, device=device)" in empty


def test_updates_run_inside_a_begin_end_session_and_set_the_version_on_success():
    src = function_source("srt/managers/scheduler_components/weight_updater.py", "update_weights_from_distributed")
    assert "if self._session is None:" in src and "begin_weight_update() and end_weight_update()" in src
    assert "if success: " in src and "self.record_weight_version_after_update(recv_req.weight_version)" in src
    http = (sglang_root() / "srt/entrypoints/http_server.py").read_text()
    for route in ("/begin_weight_update", "/end_weight_update", "/get_weights_by_name"):
        assert f'"{route}"' in http, route


def test_read_back_is_rank_0s_float32_rows():
    src = function_source("srt/managers/tokenizer_control_mixin.py", "get_weights_by_name")
    assert "all_parameters = [r.parameter for r in results]" in src and "return all_parameters[0]" in src
    llama = function_source("srt/models/llama.py", "get_weights_by_name", "LlamaForCausalLM")
    assert "return weight.cpu().to(torch.float32).numpy().tolist()[:truncate_size]" in llama


def classes_with_read_back() -> set[str]:
    """Model classes of sglang/srt/models that have get_weights_by_name (own or inherited by name)."""
    bases: dict[str, list[str]] = {}
    own: set[str] = set()
    for f in (sglang_root() / "srt" / "models").glob("*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                if any(isinstance(s, ast.FunctionDef) and s.name == "get_weights_by_name" for s in node.body):
                    own.add(node.name)

    def has(name: str, seen: frozenset = frozenset()) -> bool:
        return name in own or any(has(b, seen | {name}) for b in bases.get(name, ()) if b not in seen)
    return {c for c in bases if has(c)}


def test_read_back_architectures_match_the_model_classes():
    readable = classes_with_read_back()
    ours = {a for name in MODELS.names() for a in (MODELS.get(name).hf_architectures or ())}
    assert set(WEIGHTS_BY_NAME_ARCHITECTURES) == ours & readable, sorted(ours & readable)



def test_servers_are_single_replica_as_the_update_requires():
    """SGLang refuses updates from distributed with data-parallel replicas (dp_size > 1); our
    servers express attention DP as --attn-dp-size, never --dp-size."""
    src = function_source("srt/managers/tokenizer_control_mixin.py", "update_weights_from_distributed")
    assert "assert get_parallel().dp_size == 1" in src
    from workers.inference.sglang import args

    text = Path(args.__file__).read_text()
    assert '"attn-dp-size"' in text and '"dp-size"' not in text


# --- the custom weight loader that applies sparse patches (workers/weights/sglang/patch_loader.py)

def test_update_from_tensor_calls_a_custom_loader_named_by_load_format():
    """The hook: --custom-weight-loader lists import paths; /update_weights_from_tensor whose load_format is one
    of them calls it as ``loader(model, named_tensors)`` on every rank, each unpickling its own entry."""
    src = function_source(UPDATER, "update_weights_from_tensor", "WeightUpdater")
    assert "elif load_format in self.custom_weight_loaders: custom_loader = dynamic_import(load_format) " \
           "custom_loader(self.get_model(), named_tensors)" in src
    assert "(name, _unwrap_tensor(tensor, tp_rank=tp_rank, device=infered_device))" in src
    unwrap = function_source(UPDATER, "_unwrap_tensor")
    assert "return tensor.to(device)" in unwrap  # a plain CPU tensor (our descriptor) arrives as itself
    runner = (sglang_root() / "srt/model_executor/model_runner.py").read_text()
    assert "custom_weight_loaders=get_model().custom_weight_loader" in runner
    fields = (sglang_root() / "srt/arg_groups/fields/model.py").read_text()
    assert re.search(r"custom_weight_loader: A\[\s*Optional\[List\[str\]\]", fields)
    sched = function_source("srt/managers/scheduler_components/weight_updater.py", "update_weights_from_tensor")
    assert "if self._session is None:" in sched and "self.tp_worker.deserialize_own_rank(" in sched
    assert "self.record_weight_version_after_update(recv_req.weight_version)" in sched


def test_a_plain_pickled_cpu_tensor_passes_sglangs_safe_unpickler():
    """Our descriptor travels as a standard-pickled uint8 CPU tensor (no CUDA IPC, no shared memory)."""
    text = (sglang_root() / "srt/utils/common.py").read_text()
    for allowed in ('("torch._utils", "_rebuild_tensor_v2")', '("torch.storage", "UntypedStorage")'):
        assert allowed in text, allowed
    src = function_source("srt/managers/tp_worker.py", "deserialize_own_rank", "BaseTpWorker")
    assert "serialized_named_tensors[get_parallel().tp_rank]" in src


def test_the_loader_finds_sglangs_update_group_by_name_and_fused_moe_keeps_its_maps():
    """The patch is broadcast on the group /init_weights_update_group made (registered under its name by
    _new_process_group_helper); experts land through FusedMoE's own global -> local map, EPLB copies
    through logical_to_all_physical, and w13 holds gate rows then up rows (w1, then w3)."""
    src = function_source("srt/utils/common.py", "init_custom_process_group")
    assert "group_name=group_name" in src
    layer = "srt/layers/moe/fused_moe_triton/layer.py"
    mapping = function_source(layer, "_map_global_expert_id_to_local_expert_id", "FusedMoE")
    assert "start_idx = self._expert_storage_rank * self._num_local_routed" in mapping
    loader = function_source(layer, "weight_loader", "FusedMoE")
    assert "global_expert_location_metadata.logical_to_all_physical( self.layer_id, expert_id, " in loader
    text = (sglang_root() / layer).read_text()
    assert "self.moe_tp_size" in text and "uses_expert_location" in text
    w13 = function_source(layer, "_load_w13", "FusedMoE")
    assert 'switch_w13 = getattr( _weight_layout_method(self), "load_up_proj_weight_first", False, )' in w13
    assert '(switch_w13 and shard_id == "w1") or (not switch_w13 and shard_id == "w3")' in w13
    assert "start = shard_size" in w13
    meta = (sglang_root() / "srt/eplb/expert_location.py").read_text()
    assert "def get_global_expert_location_metadata" in meta
