"""``trainer.compile=layers`` (workers/trainer/compile.py) through the real trainer step, on gloo.

The compiled layers must give the step the eager layers give: the same loss, gradient norm,
synced gradients and AdamW-updated weights as the one-process fp32 reference that the eager
parity tests use (test_parity_fsdp / test_parity_mesh), with their tolerances. Compiled with
``aot_eager``: dynamo traces and AOT-autograd splits forward and backward exactly as for
inductor, but runs the traced aten graphs without generating C++ (seconds, not minutes, on CPU).
Covered: the FSDP plan at world 1 and 2 (micro-batches + full activation checkpointing:
the checkpoint wraps the compiled forward), the mesh plan at ep 2 (the all-to-all's host split
is a graph break, left there on purpose), Router Replay on everywhere (tcfg), and packing.
"""
from __future__ import annotations

import pytest
import torch

from tests.integration import test_parity_fsdp as fsdp
from tests.integration import test_parity_mesh as mesh
from tests.integration.step_parity import assert_step_matches
from tests.integration.test_parity_fsdp import refs, run_fsdp, trainer_cfg  # noqa: F401 (fixture)
from workers.common.config import TrainerConfig
from workers.trainer.compile import apply_compile, compiled, resolve


def test_auto_compiles_on_cuda_only_and_refuses_unknown_modes():
    assert resolve("auto", torch.device("cpu")) == "none"
    assert resolve("auto", torch.device("cuda", 0)) == "layers"
    assert resolve("layers", torch.device("cpu")) == "layers"
    assert TrainerConfig().compile == "auto"
    try:
        TrainerConfig(compile="model")
    except ValueError as e:
        assert "trainer.compile" in str(e) and "layers" in str(e)
    else:
        raise AssertionError("trainer.compile=model was accepted")


def test_compile_wraps_activation_checkpointing():
    """Compile after checkpointing: the compiled forward is the checkpoint wrapper (traced as one
    higher-order op), and checkpoint_mode still sees the checkpointing under it; applying twice is a no-op."""
    from workers.models.tiny_moe.model import build_model
    from workers.trainer.micro import apply_activation_checkpointing, checkpoint_mode

    model = build_model(fsdp.moe.CFG, 0)
    apply_activation_checkpointing(model.model.layers, "selective")
    apply_compile(model.model.layers, "layers", backend="aot_eager")
    first = [layer.forward for layer in model.model.layers]
    apply_compile(model.model.layers, "layers", backend="aot_eager")
    assert [layer.forward for layer in model.model.layers] == first
    assert all(compiled(layer) and checkpoint_mode(layer) == "selective" for layer in model.model.layers)
    assert not any(compiled(layer) for layer in build_model(fsdp.moe.CFG, 0).model.layers)


def test_fsdp_world1_compiled_matches_reference(tmp_path, refs):  # noqa: F811
    got = run_fsdp(tmp_path, "tiny_moe", 1, trainer_cfg("tiny_moe", compile="layers"), timeout_s=300)
    assert_step_matches(got, refs["tiny_moe"], weights="all", grad_names=False)


def test_fsdp_world2_compiled_micro_checkpointed_matches_reference(tmp_path, refs):  # noqa: F811
    """3 micro-batches per rank (one a padding micro-batch: other shapes, a recompile) and full
    checkpointing (the recompute runs the compiled forward again)."""
    cfg = trainer_cfg("tiny_moe", compile="layers", micro_batch_tokens=16, activation_checkpointing="full")
    got = run_fsdp(tmp_path, "tiny_moe", 2, cfg, timeout_s=300)
    assert got["num_micro"] == 3
    assert_step_matches(got, refs["tiny_moe"], weights="all", grad_names=False)


def test_fsdp_packed_compiled_matches_eager(tmp_path):
    """Packed rows (per-document attention, ctx.docs): compiled and eager give the same step."""
    eager = run_fsdp(tmp_path, "tiny_moe", 1, trainer_cfg("tiny_moe", pack_sequences=True, compile="none"))
    comp = run_fsdp(tmp_path, "tiny_moe", 1, trainer_cfg("tiny_moe", pack_sequences=True, compile="layers"),
                    timeout_s=300)
    for key in ("loss", "grad_norm", "aux_loss"):
        assert comp["stats"][key] == pytest.approx(eager["stats"][key], rel=1e-5, abs=1e-7), key
    for name, w in eager["weights"].items():
        assert float((comp["weights"][name] - w).abs().max()) < 1e-5, name


def test_mesh_ep2_compiled_matches_reference(tmp_path):
    """qwen3_moe at ep 2: expert-parallel dispatch inside the compiled layer (a graph break at
    the all-to-all's split sizes), gradients over the edp ranks, Router Replay on."""
    ref = mesh.reference("qwen3_moe")
    out = str(tmp_path / "got.pt")
    mesh.spawn(mesh._worker, 2, (1, 2, "qwen3_moe", out, {"compile": "layers"}), timeout_s=300)
    assert_step_matches(torch.load(out), ref, grad_names=False)
