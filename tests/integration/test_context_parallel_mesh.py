"""Context parallelism inside the mesh plan (cp x tp x ep, workers/trainer/parallel/mesh.py) equals one process.

Each layout runs as real gloo processes: the seeded full model, the mesh plan over a DeviceMesh
(ep, dp_shard, cp, tp), each rank's row shard split over its cp group by the trainer's own
``backward_step`` (workers/trainer/parallel/context.py), one AdamW step; rank 0 gathers the full
HF gradients and weights and compares them, the loss and the gradient norm with the one-process
float32 reference of tests/integration/test_parity_mesh.py. Router Replay is on (the batch forces
random experts), so the routing per position must be exact on every cp rank for the numbers to
agree. Under tp the attention heads are split first and Ulysses' all-to-all runs over the cp group
on the heads left (qwen3_moe: 4 heads, 2 KV heads -> 2 and 1 per TP rank, the KV head repeated
for cp 2; deepseek_v3: MLA with 4 heads); under ep the MoE tokens of each cp rank go through the
unchanged EP all-to-all. glm_moe_dsa adds the DSA indexer (replicated over tp, its keys gathered
over cp), nemotron_h the Mamba-2 scan (replicated over tp, heads split over cp).
"""
from __future__ import annotations

import pytest
import torch

from tests.integration import test_parity_mesh as mesh
from tests.integration.step_parity import assert_step_matches

# (family, dp, cp, tp, ep): world = dp * cp * tp * ep
CASES = [("qwen3_moe", 1, 2, 2, 1), ("qwen3_moe", 1, 2, 1, 2), ("deepseek_v3", 1, 2, 2, 1), ("deepseek_v3", 1, 2, 1, 2),
         ("glm_moe_dsa", 1, 2, 2, 1), ("nemotron_h", 1, 2, 1, 2), ("qwen3_moe", 1, 2, 2, 2),
         ("qwen3_moe", 1, 4, 2, 1)]  # 2 heads left after tp 2, cp 4: keys/values gathered over cp instead
# micro-batches of 16 tokens with full activation checkpointing (the recompute replays the all-to-alls
# of both kinds), and packed rows (per-document attention over the whole rows after the all-to-all)
CASES += [("deepseek_v3", 1, 2, 2, 1, mesh.MICRO_AC), ("qwen3_moe", 1, 2, 1, 2, {**mesh.MICRO_AC, "pack_sequences": True}),
          ("glm_moe_dsa", 1, 2, 1, 2, mesh.MICRO_AC)]  # DSA's per-chunk checkpoints nested in the layer's


@pytest.mark.parametrize("model,dp,cp,tp,ep,extra", [c if len(c) == 6 else (*c, None) for c in CASES],
                         ids=[f"{c[0]}-dp{c[1]}-cp{c[2]}-tp{c[3]}-ep{c[4]}" + ("-" + "-".join(c[5]) if len(c) == 6 else "")
                              for c in CASES])
def test_cp_in_the_mesh_plan_matches_one_process_reference(tmp_path, model, dp, cp, tp, ep, extra):
    torch.set_num_threads(1)
    ref = mesh.reference(model)
    out = str(tmp_path / "got.pt")
    mesh.spawn(mesh._worker, dp * cp * tp * ep, (tp, ep, model, out, extra, 0.0, cp))
    assert_step_matches(torch.load(out), ref)


RESUMES = [("deepseek_v3", (1, 1, 2, 2), (1, 2, 1, 1)), ("qwen3_moe", (1, 2, 1, 2), (2, 1, 1, 1))]


@pytest.mark.parametrize("model,saved,resumed", RESUMES, ids=[f"{m}-{s}-to-{r}" for m, s, r in RESUMES])
def test_a_checkpoint_saved_with_cp_resumes_at_another_layout(tmp_path, model, saved, resumed):
    """(dp, tp, ep, cp): saved at ep 2 x cp 2 resumed at tp 2, saved at tp 2 x cp 2 resumed at dp 2
    (the FSDP plan): DCP reshards the cp ranks' shards like any other dimension's."""
    mesh.check_resume(tmp_path, model, saved, resumed)
