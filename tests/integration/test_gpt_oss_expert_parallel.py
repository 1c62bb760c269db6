"""Expert parallelism of the native GPT-OSS family under the mesh plan, on real gloo groups.

GPT-OSS's experts are fused stacks saved WHOLE (``experts.gate_up_proj [E, H, 2I]`` with interleaved
gate/up columns, biases, ``down_proj [E, I, H]``), so under ep > 1 each stack is a DTensor sharded on
its expert dim over the ep mesh (workers/models/blocks/moe_gpt_oss.py): every state path reads the
full logical stacks. The checkpoint is built by transformers (tiny GptOssConfig from our
``to_hf_config``; biases and sinks random, experts scaled so the clamps act) and loaded into our model.

- parity: world 1 (the plain model) against ep 2 (world 2), ep 2 x dp 2 (world 4, EP x FSDP) and
  ep 2 x tp 2; each batch rank runs its share of the rows (the loss is a weighted SUM, so the shares
  add up), Router Replay forces random experts (rows cross the all-to-all every way); the gathered
  logits, every full gradient by checkpoint name (``full_grad_dict``) and the global gradient norm
  (``clip_grad_norm_``) must be world 1's;
- checkpoint: an AdamW step at ep 2, saved through the trainer's Checkpointer (DCP), resumed on the
  FSDP plan at world 1 from other weights: the weights and both AdamW moments are the saved ones;
- publish: the step the trainer's stream (``ModelWeights``) publishes from an ep 2 run loads in
  transformers' ``GptOssForCausalLM.from_pretrained`` with no missing / unexpected keys and computes
  the ep 2 model's logits;
- step 0: the trainer's meta-build + materialize from ``model.path`` at ep 2 holds the checkpoint
  exactly, eager and with compiled layers, and computes world 1's logits and gradients.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.netutil import gloo_dims, run_ranks
from tests.integration.test_tp_native_families import GPT_OSS, LENGTH, _forward, _inputs, _loss, _randomise
from tests.models.parity import hf_reference, load_into
from workers.common.dtensor import full_tensor
from workers.common.protocol import step_name
from workers.common.registry import MODELS
from workers.trainer.checkpoint import Checkpointer
from workers.trainer.parallel.plans import shard
from workers.trainer.weight_stream import ModelWeights
from workers.weights.base import DistPeers
from workers.weights.filesystem.hf_layout import hf_files
from workers.weights.filesystem.publisher import FilesystemPublisher

ROWS = 4  # divisible by every layout's batch ranks (ep x dp)
SPEC = MODELS.get("gpt_oss")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers-built checkpoint directory, world-1 logits and gradients by checkpoint name)."""
    from transformers import CONFIG_MAPPING

    hf_config = SPEC.to_hf_config(GPT_OSS)
    _, directory = hf_reference(CONFIG_MAPPING["gpt_oss"](**hf_config), tmp_path_factory.mktemp("gpt_oss_ep"),
                                prepare=_randomise)
    model = load_into(SPEC.build(GPT_OSS), directory).train()
    inputs = _inputs(GPT_OSS, ROWS)
    logits = _forward(model, inputs)
    _loss(model, logits, inputs).backward()
    return directory, logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rows(inputs: dict, dims) -> dict:
    """This batch rank's contiguous share of the rows."""
    n = ROWS // dims.num_batch_shards
    return {k: v[dims.batch_rank * n:(dims.batch_rank + 1) * n] for k, v in inputs.items()}


def _sharded(directory, dims):
    return shard(SPEC, load_into(SPEC.build(GPT_OSS), directory).train(), dims)


def _parity_worker(rank, world, port, ep, tp, fixed, directory, out):
    """``fixed``: the fixed-capacity dispatch (workers/trainer/parallel/expert_exchange.py ``fixed_exchange``, the
    trainer's default) with room for every slot, instead of the exact one."""
    dims = gloo_dims(rank, world, port, ep=ep, tp=tp)
    try:
        model = _sharded(directory, dims)
        assert model.model.layers[0].mlp.experts.num_local == GPT_OSS.num_experts // ep
        if fixed:
            for layer in model.model.layers:
                layer.mlp.expert_parallel.capacity = ROWS * LENGTH * GPT_OSS.top_k
        inputs = _rows(_inputs(GPT_OSS, ROWS), dims)
        logits = _forward(model, inputs)
        _loss(model, logits, inputs).backward()
        parts = [None] * world
        dist.all_gather_object(parts, (dims.batch_rank, dims.tp_rank, logits.detach()))
        grads = model.full_grad_dict()
        norm = model.clip_grad_norm_(1e9)  # the global norm, each element counted once
        if fixed:
            flags = [layer.mlp.expert_parallel.overflow for layer in model.model.layers]  # None: never ran fixed
            assert all(f is not None and not bool(f) for f in flags), flags
        if rank == 0:
            shards = {}  # batch rank -> its rows' logits (vocabulary shards of the tp ranks concatenated)
            for b, t, part in sorted(parts, key=lambda p: p[:2]):
                shards.setdefault(b, {})[t] = part
            vocab = getattr(model, "vocab_sharded", False)
            logits = torch.cat([torch.cat(list(v.values()), dim=-1) if vocab else v[0] for v in shards.values()])
            torch.save({"logits": logits, "grads": grads, "norm": norm, "plan": type(model).__name__}, out)
    finally:
        dist.destroy_process_group()


LAYOUTS = [(2, 1, 2, False), (2, 1, 2, True), (2, 1, 4, False), (2, 2, 4, False)]
"""(ep, tp, world, fixed capacity): ep 2 (exact and fixed dispatch), ep 2 x dp 2 (EP x FSDP), ep 2 x tp 2."""


@pytest.mark.parametrize("ep,tp,world,fixed", LAYOUTS, ids=["ep2", "ep2-fixed", "ep2-dp2", "ep2-tp2"])
def test_expert_parallel_matches_one_process(reference, tmp_path, ep, tp, world, fixed):
    directory, logits, grads = reference
    out = str(tmp_path / "got.pt")
    run_ranks(_parity_worker, world, (ep, tp, fixed, directory, out), what=f"gpt_oss ep{ep} tp{tp} world {world}",
              timeout_s=300)
    got = torch.load(out)
    assert got["plan"].startswith("Mesh"), got["plan"]
    torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
    assert list(got["grads"]) == list(grads), "full_grad_dict: checkpoint names, in the model's order"
    for name, g in grads.items():
        assert got["grads"][name].shape == g.shape, name
        err = float((got["grads"][name] - g).abs().max())
        assert err <= 1e-6 + 1e-4 * float(g.abs().max()), f"{name}: gradient differs by {err:.3g}"
    want = float(torch.stack([g.norm() for g in grads.values()]).norm())
    assert got["norm"] == pytest.approx(want, rel=1e-5)


def _full_state(model, opt) -> dict:
    """Weights and both AdamW moments, gathered by parameter name (COLLECTIVE)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full_tensor(p.detach())
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{name}:{k}"] = full_tensor(opt.state[p][k])
    return out


def _checkpoint_worker(rank, world, port, ep, directory, run_dir, phase, out):
    dims = gloo_dims(rank, world, port, ep=ep)
    try:
        model = _sharded(directory, dims)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = Checkpointer(run_dir, rank=rank, world_size=world, every=0, keep=2)
        if phase == "save":
            inputs = _rows(_inputs(GPT_OSS, ROWS), dims)
            _loss(model, _forward(model, inputs), inputs).backward()
            opt.step()
            ckpt.save(1, model, opt)
        else:
            with torch.no_grad():  # other weights: only the checkpoint can make them right
                for p in model.parameters():
                    p.mul_(0.5)
            assert ckpt.load(model, opt) == 1
        state = _full_state(model, opt)
        if rank == 0:
            torch.save(state, out)
    finally:
        dist.destroy_process_group()


def test_checkpoint_saved_at_ep2_resumes_at_ep1(reference, tmp_path):
    directory = reference[0]
    run_dir = str(tmp_path / "run")
    got = {}
    for phase, ep, world in (("save", 2, 2), ("resume", 1, 1)):
        out = str(tmp_path / f"{phase}.pt")
        run_ranks(_checkpoint_worker, world, (ep, directory, run_dir, phase, out), what=f"{phase} at ep {ep}",
                  timeout_s=300)
        got[phase] = torch.load(out)
    saved, resumed = got["save"], got["resume"]
    assert list(resumed) == list(saved)
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    assert saved[stack].shape == (GPT_OSS.num_experts, GPT_OSS.hidden_size, 2 * GPT_OSS.expert_intermediate_size)
    for name, t in saved.items():
        assert torch.equal(resumed[name], t), name


def _publish_worker(rank, world, port, ep, directory, root, out):
    dims = gloo_dims(rank, world, port, ep=ep)
    try:
        model = _sharded(directory, dims)
        with torch.no_grad():  # a step that is not the source checkpoint: each expert moves by its own amount
            for name, p in model.named_parameters():
                if "experts" in name:
                    local = p.to_local()
                    local.add_(0.01 * (1 + dims.ep_rank))
        pub = FilesystemPublisher(Path(root), peers=DistPeers(), keep_last=2, hf=hf_files(GPT_OSS))
        pub.publish(1, ModelWeights(model, dtype=torch.float32, to_hf=SPEC.to_hf))
        pub.close()
        ids = _inputs(GPT_OSS, ROWS)["input_ids"]  # every rank the same rows (its own routing: transformers')
        logits = model(ids).logits.detach()
        if rank == 0:
            torch.save({"logits": logits, "ids": ids}, out)
    finally:
        dist.destroy_process_group()


def test_published_step_of_an_ep2_run_loads_in_transformers(reference, tmp_path):
    from transformers import GptOssForCausalLM

    directory = reference[0]
    root, out = tmp_path / "weights", str(tmp_path / "pub.pt")
    run_ranks(_publish_worker, 2, (2, directory, str(root), out), what="gpt_oss ep2 publish", timeout_s=300)
    step = root / step_name(1)
    assert json.loads((step / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    hf, info = GptOssForCausalLM.from_pretrained(step, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not problems, problems
    source = GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32)
    moved = hf.model.layers[0].mlp.experts.gate_up_proj - source.model.layers[0].mlp.experts.gate_up_proj
    half = GPT_OSS.num_experts // 2  # EP rank r's experts moved by 0.01 * (1 + r): each stack whole, in order
    assert torch.allclose(moved[:half], torch.full_like(moved[:half], 0.01), atol=1e-6)
    assert torch.allclose(moved[half:], torch.full_like(moved[half:], 0.02), atol=1e-6)
    want = torch.load(out)
    with torch.no_grad():
        got = hf.eval()(input_ids=want["ids"]).logits
    torch.testing.assert_close(got, want["logits"], rtol=1e-4, atol=1e-4)


def _step0_worker(rank, world, port, ep, directory, compile_mode, out):
    """The trainer's own step-0 path: ``model.path`` resolved as a user's run would be, the model built
    on the meta device, sharded at ep 2, each rank filling its experts from the checkpoint's full
    stacks; layers compiled or not (``trainer.compile``); then its share of the rows forward and back."""
    from tests.unit.launcher.test_generic_plan import resolved
    from workers.trainer.loop import step0_model

    dims = gloo_dims(rank, world, port, ep=ep)
    try:
        cfg = resolved(directory, f"trainer.num_ranks={world}", f"trainer.parallel.ep={ep}",
                       "trainer.dtype=float32", "trainer.master_dtype=float32", f"trainer.compile={compile_mode}")
        model = step0_model(cfg, dims)
        state = model.full_state_dict()
        inputs = _rows(_inputs(GPT_OSS, ROWS), dims)
        logits = _forward(model, inputs)
        _loss(model, logits, inputs).backward()
        parts = [None] * world
        dist.all_gather_object(parts, (dims.batch_rank, logits.detach()))
        grads = model.full_grad_dict()
        if rank == 0:
            torch.save({"state": state, "logits": torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]),
                        "grads": grads}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compile_mode", ["none", "layers"])
def test_step0_model_at_ep2_is_the_checkpoint(reference, tmp_path, compile_mode):
    """Compiled layers trace the local experts of the DTensor stacks (``local()``) like eager ones."""
    directory, logits, grads = reference
    out = str(tmp_path / "step0.pt")
    run_ranks(_step0_worker, 2, (2, directory, compile_mode, out), what="gpt_oss ep2 step0", timeout_s=500)
    got = torch.load(out)
    want = load_into(SPEC.build(GPT_OSS), directory).state_dict()
    assert list(got["state"]) == list(want)
    for name, t in want.items():
        assert torch.equal(got["state"][name], t), name
    torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        err = float((got["grads"][name] - g).abs().max())
        assert err <= 1e-6 + 1e-4 * float(g.abs().max()), f"{name}: gradient differs by {err:.3g}"
