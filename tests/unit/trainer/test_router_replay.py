"""Router Replay: forced experts are really used, gate weights still learn, unreported
positions are recomputed (or masked), packing keeps replay aligned, and a multi-turn
episode sampled by the real engine is replayed position for position."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from workers.common.config import TrainerConfig
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.trainer.batch import BatchFormatError, RolloutBatch, load_batch
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.router_replay import MISALIGNED_DISAGREEMENT, expert_load_metrics, mask_unreported
from workers.trainer.parallel.fsdp import FsdpTrainerModel, unsharded
from workers.trainer.step import backward_step, forward_rows
from workers.trainer.loss import loss_relevant_inputs, routing_disagreement

CFG = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=64)
ONE = ParallelDims(rank=0, world_size=1, dp=1, backend="gloo", device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def trainer_model(seed: int = 3) -> FsdpTrainerModel:
    return unsharded(build_model(CFG, seed), ONE)


def other_experts(routed: torch.Tensor) -> torch.Tensor:
    """A different expert set per slot: shift every id by one (still k distinct experts)."""
    return (routed + 1) % CFG.num_experts


def test_forced_experts_are_used_and_the_router_still_learns():
    model = trainer_model()
    ids = torch.randint(0, CFG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    free = model(ids)
    forced = other_experts(free.routed_experts)
    out = model(ids, forced_experts=forced)
    assert torch.equal(out.routed_experts, forced)
    assert float((out.logits - free.logits).detach().abs().max()) > 1e-3, "changing the forced experts must change the output"
    same = model(ids, forced_experts=free.routed_experts)  # replaying its own choice changes nothing
    assert torch.allclose(same.logits, free.logits, atol=1e-6)
    out.logits.square().sum().backward()
    for layer in model.model.layers:  # gate weights come from the trainer's router: it gets gradient
        assert float(layer.mlp.gate.weight.grad.abs().sum()) > 0


def test_unreported_positions_route_themselves():
    model = trainer_model()
    ids = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    free = model(ids)
    forced = other_experts(free.routed_experts)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[:, :3] = False  # e.g. a prefix-cache hit the engine did not report
    out = model(ids, forced_experts=forced, forced_mask=mask)
    assert torch.equal(out.routed_experts[:, 3:], forced[:, 3:])
    assert torch.equal(out.routed_experts[:, :3, 0], free.routed_experts[:, :3, 0])  # layer 0 sees the same input
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    kept = mask_unreported(loss_mask, mask)  # token t is predicted from position t-1
    assert kept.int().tolist() == [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 0]]


def _episode(engine: InferenceEngine, prompt: list[int], observation: list[int]) -> dict:
    """Two model turns with an env observation between, assembled as episodes.py does:
    each call reports rows from 0; earlier rows are kept and only the new ones appended."""
    history, routed, logprobs, loss = list(prompt), [], [0.0] * len(prompt), [0] * len(prompt)
    for turn in range(2):
        if turn:
            history += observation
            logprobs += [0.0] * len(observation)
            loss += [0] * len(observation)
        out = engine.generate([GenRequest(input_ids=list(history), temperature=1.0, max_new_tokens=5,
                                          return_routed_experts=True)])[0]
        history += out.output_ids
        logprobs += out.logprobs
        loss += [1] * len(out.output_ids)
        done = sum(r.shape[0] for r in routed)
        routed.append(out.routed_experts[done: len(history) - 1].numpy())
    return {"ids": history, "logprobs": logprobs, "loss": loss, "routed": np.concatenate(routed)}


def _rows(episodes: list[dict]) -> RolloutBatch:
    t = max(len(e["ids"]) for e in episodes)
    b = len(episodes)
    ids, attn, loss = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.bool), torch.zeros(b, t, dtype=torch.bool)
    lp, routed = torch.zeros(b, t), torch.zeros(b, t, CFG.num_layers, CFG.top_k, dtype=torch.long)
    rmask = torch.zeros(b, t, dtype=torch.bool)
    for i, e in enumerate(episodes):
        n = len(e["ids"])
        ids[i, :n], attn[i, :n], loss[i, :n] = torch.tensor(e["ids"]), True, torch.tensor(e["loss"]).bool()
        lp[i, :n] = torch.tensor(e["logprobs"])
        routed[i, : n - 1], rmask[i, : n - 1] = torch.from_numpy(e["routed"]).long(), True
    return RolloutBatch(input_ids=ids, attention_mask=attn, loss_mask=loss, inference_logprobs=lp,
                        advantages=torch.zeros(b), rewards=torch.zeros(b), token_versions=torch.zeros(b, t, dtype=torch.int32),
                        routed_experts=routed, routed_mask=rmask, meta={"temperature": 1.0, "step": 0})


def test_multi_turn_episode_from_the_engine_replays_position_for_position():
    engine = InferenceEngine(build_model(CFG, 3), max_batch_size=4, seed=0).start()
    try:
        episodes = [_episode(engine, [1, 5 + i, 6, 2], [2, 9, 10 + i]) for i in range(3)]
    finally:
        engine.shutdown()
    batch = _rows(episodes)
    assert all(e["routed"].shape[0] == len(e["ids"]) - 1 for e in episodes)
    model = trainer_model(3)
    slots = loss_relevant_inputs(batch.loss_mask) & batch.routed_mask
    for pack in (False, True):
        with torch.no_grad():
            fwd = forward_rows(model, batch, replay=True, pack=pack)
        lm = batch.loss_mask
        assert float((fwd.logp - batch.inference_logprobs)[lm].abs().max()) < 1e-4  # fp32 engine == trainer
        assert torch.equal(fwd.routed[batch.routed_mask], batch.routed_experts[batch.routed_mask])
        assert routing_disagreement(fwd.own, batch.routed_experts, slots)[0] == 0
    # prompt rows unreported (a prefix cache): recomputed, and the result is unchanged
    cached = RolloutBatch(**{**batch.__dict__, "routed_mask": batch.routed_mask & (torch.arange(batch.input_ids.shape[1]) >= 4)})
    with torch.no_grad():
        fwd = forward_rows(model, cached, replay=True, pack=False)
    assert float((fwd.logp - batch.inference_logprobs)[batch.loss_mask].abs().max()) < 1e-4
    # rows shifted by one position: not silent, the disagreement says so
    shifted = torch.roll(batch.routed_experts, 1, dims=1)
    with torch.no_grad():
        fwd = forward_rows(model, RolloutBatch(**{**batch.__dict__, "routed_experts": shifted}), replay=True, pack=False)
    d, s = routing_disagreement(fwd.own, shifted, slots)
    assert d / s > MISALIGNED_DISAGREEMENT


def test_replay_unreported_mask_drops_loss_tokens_and_counts_them():
    engine = InferenceEngine(build_model(CFG, 3), max_batch_size=4, seed=1).start()
    try:
        batch = _rows([_episode(engine, [1, 7, 8, 2], [2, 11]) for _ in range(2)])
    finally:
        engine.shutdown()
    batch.routed_mask[:, 5] = False  # one unreported position inside the first turn
    stats = backward_step(trainer_model(3), batch, TrainerConfig(router_replay=True, replay_unreported="mask"), ONE)
    assert stats["replay_unreported_tokens"] == int(batch.loss_mask[:, 6].sum())
    assert stats["routing_disagreement"] == 0 and stats["mismatch_kl"] < 1e-8
    assert {"expert_load_max", "expert_load_max_l0", "expert_load_min_l1"} <= stats.keys()


def test_expert_load_metrics_per_layer():
    m = expert_load_metrics(torch.tensor([[10.0, 10.0], [30.0, 0.0]]))
    assert m == {"expert_load_max_l0": 1.0, "expert_load_min_l0": 1.0, "expert_load_max_l1": 2.0,
                 "expert_load_min_l1": 0.0, "expert_load_max": 2.0}


def test_load_batch_refuses_routing_on_pad_positions(tmp_path):
    b, t = 2, 6
    attn = np.zeros((b, t), np.uint8)
    attn[:, :4] = 1
    routed_mask = attn.copy()
    routed_mask[1, 5] = 1  # a routing row beyond the sequence: would replay onto a pad
    arrays = dict(input_ids=np.zeros((b, t), np.int64), attention_mask=attn, loss_mask=np.zeros((b, t), np.uint8),
                  inference_logprobs=np.zeros((b, t), np.float32), advantages=np.zeros(b, np.float32),
                  rewards=np.zeros(b, np.float32), token_versions=np.zeros((b, t), np.int32),
                  routed_experts=np.zeros((b, t, CFG.num_layers, CFG.top_k), np.uint8), routed_mask=routed_mask)
    save_file(arrays, str(tmp_path / "batch.safetensors"))
    (tmp_path / "meta.json").write_text('{"step": 0, "temperature": 1.0}')
    with pytest.raises(BatchFormatError, match="routed_mask marks pad position 5 of row 1"):
        load_batch(tmp_path, step=0, num_layers=CFG.num_layers, top_k=CFG.top_k, num_experts=CFG.num_experts)
