"""Parity of the parallel trainer: every (TP, EP, DP) computes the one-process step.

Same tiny_moe weights, same batch: each layout runs as real gloo processes
(torch.multiprocessing spawn, a free port each), shards the model with the plan the trainer picks
for it (ModelSpec.shard: FSDP2 at tp = ep = 1, else workers/trainer/parallel/mesh.py), takes its row
shard, runs the trainer's
``backward_step`` (forward with Router Replay, vocab-parallel log-probs, loss with global
normalisers, backward, grad sync, clip) and one AdamW step; rank 0 gathers the FULL HF
gradient and weight dicts. The reference is the plain ``TinyMoeForCausalLM`` with the loss
functions called directly (no sharded code at all). They agree to float32 rounding: the
layouts sum the same terms in other orders (split GEMMs, all-reduces, the k-slot sum).

The vocabulary (15) is not a multiple of tp=2, so the padded vocab-parallel head is
covered; the batch's forced experts put tokens on every expert, so EP dispatch moves rows
both ways. qwen3_moe runs the same layouts: per-head q/k norms inside the TP region (their
gradient summed over TP), head_dim apart from hidden/heads, a dense layer (TP MLP) between MoE
layers, raw softmax gate weights (norm_topk_prob off).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from workers.common.config import TrainerConfig
from workers.common.registry import MODELS
from workers.models.deepseek_v3.config import DeepseekV3Config
from workers.models.glm_moe_dsa.config import GlmMoeDsaConfig
from workers.models.nemotron_h.config import NemotronHConfig
from workers.models.qwen3_moe.config import Qwen3MoeConfig
from workers.models.tiny_moe.model import TinyMoeConfig
from workers.trainer.batch import RolloutBatch
from workers.trainer.loss import load_balance_loss, policy_loss, router_stats, token_logprobs
from tests.integration.step_parity import assert_step_matches, step_and_save, weight_error
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.objective import aggregation
from workers.trainer.routing_capture import capture_gate_logits
from workers.models.blocks.experts import checkpoint_named

CFG = TinyMoeConfig(vocab_size=15, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=32)
QWEN3 = Qwen3MoeConfig(name="q", vocab_size=15, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=12,
                       num_experts=4, top_k=2, expert_intermediate_size=16, dense_intermediate_size=24,
                       mlp_only_layers=[1], norm_topk_prob=False, max_position_embeddings=32)
DSV3 = DeepseekV3Config(name="d", vocab_size=15, hidden_size=32, num_layers=3, num_heads=4, num_experts=4, top_k=2,
                        expert_intermediate_size=16, num_shared_experts=1, num_dense_layers=1, dense_intermediate_size=24,
                        num_expert_groups=2, topk_groups=1, routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=32)
GLM5 = GlmMoeDsaConfig(**{f.name: getattr(DSV3, f.name) for f in dataclasses.fields(DSV3) if f.name != "family"},
                       family="glm_moe_dsa", num_indexer_heads=2, indexer_head_dim=8, index_topk=4)
NEMOTRON = NemotronHConfig(name="n", vocab_size=15, hidden_size=32, num_layers=4, hybrid_override_pattern="ME*-",
                           num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
                           mamba_head_dim=8, ssm_state_size=16, mamba_n_groups=2, num_experts=4, top_k=2,
                           expert_intermediate_size=24, shared_expert_intermediate_size=40, moe_latent_size=16,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=32)
CONFIGS = {"tiny_moe": CFG, "qwen3_moe": QWEN3, "deepseek_v3": DSV3, "glm_moe_dsa": GLM5, "nemotron_h": NEMOTRON}
SEED = 7
START_METHOD = "fork"


def build_model(cfg, seed: int):
    """The family's full model with the seeded init (what every rank starts from)."""
    return MODELS.get(cfg.family).build(cfg).init_weights(seed)


def make_batch(rows: int = 8, length: int = 10, seed: int = 0, model: str = "tiny_moe") -> RolloutBatch:
    cfg = CONFIGS[model]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, length + 1, (rows,), generator=g)
    attn = torch.arange(length)[None] < lengths[:, None]
    prompt = torch.randint(2, 4, (rows,), generator=g)
    loss = attn & (torch.arange(length)[None] >= prompt[:, None])
    ids = torch.randint(0, cfg.vocab_size, (rows, length), generator=g) * attn
    logp = torch.where(loss, -torch.log(torch.tensor(15.0)) + 0.3 * torch.randn(rows, length, generator=g), 0.0)
    logp[0, 4] = -0.2  # far off: exercises the ratio mask
    layers = cfg.num_routed_layers
    experts = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k]
                           for _ in range(rows * length * layers)]).view(rows, length, layers, cfg.top_k)
    routed_mask = attn.clone()
    routed_mask[torch.arange(rows), lengths - 1] = False  # the last token has no routing
    adv = torch.randn(rows, length, generator=g) * loss
    return RolloutBatch(input_ids=ids, attention_mask=attn, loss_mask=loss, inference_logprobs=logp.float(),
                        advantages=adv, rewards=torch.zeros(rows), token_versions=torch.zeros(rows, length, dtype=torch.int32),
                        routed_experts=experts * routed_mask[..., None, None], routed_mask=routed_mask,
                        meta={"temperature": 0.9, "step": 0})


def tcfg(**kw) -> TrainerConfig:
    return TrainerConfig(lr=1e-2, grad_clip=0.05, aux_loss_coef=0.1, router_replay=True, **kw)


def reference(batch: RolloutBatch, cfg: TrainerConfig, model_name: str = "tiny_moe") -> dict:
    """One-process step with the plain model and the loss functions (no trainer step code)."""
    mcfg = CONFIGS[model_name]
    model = build_model(mcfg, SEED)
    with capture_gate_logits(model) as gates:
        out = model(batch.input_ids, attention_mask=batch.attention_mask, forced_experts=batch.routed_experts,
                    forced_mask=batch.routed_mask)
    logp, entropy = token_logprobs(out.logits, batch.input_ids, batch.temperature)
    prob_sums, counts = router_stats(gates, out.routed_experts, batch.attention_mask, mcfg.num_experts)
    token_weight, norm = aggregation(batch.loss_mask, cfg.loss_agg)  # the recipe knobs (objective.py)
    pg, _ = policy_loss(logp, batch.inference_logprobs, batch.advantages, batch.loss_mask,
                        num_loss_tokens=float(norm), ratio_cap=cfg.ratio_cap,
                        ratio_mask_low=cfg.ratio_mask_low, ratio_mask_high=cfg.ratio_mask_high,
                        ratio_level=cfg.ratio_level, token_weight=token_weight, clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high)
    aux = load_balance_loss(prob_sums, counts, float(batch.attention_mask.sum()), mcfg.top_k)
    loss = pg + cfg.aux_loss_coef * aux
    loss.backward()
    grads = checkpoint_named(model, {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                                     for n, p in model.named_parameters()})  # HF names, as full_grad_dict
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas)).step()
    return {"loss": loss.item(), "grad_norm": norm, "grads": grads, "weights": model.state_dict()}


def _worker(rank: int, world: int, port: int, tp: int, ep: int, cfg: TrainerConfig, out: str, model_name: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, tp=tp, ep=ep)
    try:
        full = build_model(CONFIGS[model_name], SEED)
        apply_activation_checkpointing(full.model.layers, cfg.activation_checkpointing)
        from workers.trainer.parallel.plans import shard

        model = shard(MODELS.get(full.config.family), full, dims)  # the trainer's plan for (tp, ep)
        step_and_save(model, dims, make_batch(model=model_name), cfg, out)
    finally:
        dist.destroy_process_group()


def run_layout(tmp_path, tp: int, ep: int, dp: int, cfg: TrainerConfig, timeout_s: float = 120.0,
               model: str = "tiny_moe") -> dict:
    out = str(tmp_path / f"{model}_tp{tp}_ep{ep}_dp{dp}.pt")
    run_ranks(_worker, tp * ep * dp, (tp, ep, cfg, out, model), what=f"layout tp{tp} ep{ep} dp{dp}",
              timeout_s=timeout_s, start_method=START_METHOD)
    return torch.load(out)


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]


_REFS: dict[str, dict] = {}


def reference_step(model: str) -> dict:
    """The one-process reference of ``model`` (computed once per module run)."""
    if model in _REFS:
        return _REFS[model]
    torch.set_num_threads(1)
    batch, cfg = make_batch(model=model), tcfg()
    r = reference(batch, cfg, model)
    # the reference's grads are pre-clip; the trainer reports post-clip ones
    scale = min(1.0, cfg.grad_clip / (r["grad_norm"] + 1e-6))
    assert scale < 1.0, "pick grad_clip below the norm so clipping is exercised"
    r["clipped"] = {n: g * scale for n, g in r["grads"].items()}
    _REFS[model] = r
    return r


CASES = [("tiny_moe",) + lay for lay in LAYOUTS] + [("qwen3_moe", 2, 1, 1), ("qwen3_moe", 1, 2, 1), ("qwen3_moe", 2, 2, 1)]


@pytest.mark.parametrize("model,tp,ep,dp", CASES, ids=[f"{m}-tp{a}-ep{b}-dp{c}" for m, a, b, c in CASES])
def test_layout_matches_one_process_reference(tmp_path, model, tp, ep, dp):
    ref = reference_step(model)
    got = run_layout(tmp_path, tp, ep, dp, tcfg(), model=model)
    assert_step_matches(got, ref)


def test_recipe_knobs_at_dp2_match_one_process_reference(tmp_path):
    """Per-sequence loss aggregation (each row's token mean, averaged over the GLOBAL row count) and
    PPO clipping against the inference log-probs: the dp 2 step equals the one-process step."""
    cfg = tcfg(loss_agg="seq_mean_token_mean", clip_low=0.2, clip_high=0.28)
    ref = reference(make_batch(), cfg)
    scale = min(1.0, cfg.grad_clip / (ref["grad_norm"] + 1e-6))
    ref["clipped"] = {n: g * scale for n, g in ref["grads"].items()}
    assert ref["loss"] != pytest.approx(reference_step("tiny_moe")["loss"]), "the knobs change the loss"
    got = run_layout(tmp_path, 1, 1, 2, cfg)
    assert got["stats"]["clip_frac"] > 0, "some tokens are clipped"
    assert_step_matches(got, ref)


def test_packed_and_unreplayed_forward_match_too(tmp_path):
    """(2, 2, 1) with sequence packing (per-document attention) and log-probs scored 5 positions at a
    time over the vocab-parallel head gives the unpacked step; without replay it routes itself."""
    base = run_layout(tmp_path, 2, 2, 1, tcfg())
    packed = run_layout(tmp_path, 2, 2, 1, tcfg(pack_sequences=True, logprob_chunk_tokens=5))
    assert packed["stats"]["loss"] == pytest.approx(base["stats"]["loss"], rel=1e-5)
    for name, g in base["grads"].items():
        assert float((packed["grads"][name] - g).abs().max()) <= 1e-6 + 1e-4 * float(g.abs().max()), name
    free = run_layout(tmp_path, 2, 2, 1, TrainerConfig(router_replay=False))
    one = run_layout(tmp_path, 1, 1, 1, TrainerConfig(router_replay=False))
    assert free["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-5, abs=1e-7)
    assert free["stats"]["routing_disagreement"] == pytest.approx(one["stats"]["routing_disagreement"])


def test_micro_batches_and_activation_checkpointing_on_the_tp_ep_plan(tmp_path):
    """tp2 x ep2 with a 16-token budget (3 micro-batches on one EP rank, 2 + a padding one on the
    other: the empty micro-batch still joins every all-to-all) and every layer recomputed."""
    ref = reference_step("tiny_moe")
    got = run_layout(tmp_path, 2, 2, 1, tcfg(micro_batch_tokens=16, activation_checkpointing="full"))
    assert got["stats"]["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert got["stats"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for name, w in ref["weights"].items():
        assert weight_error(got["weights"][name], w, ref["clipped"][name]) < 1e-5, name
