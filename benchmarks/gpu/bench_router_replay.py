"""Router Replay at the GPU model size (issue 11, item 5).

Method (the production path end to end):
1. One set of master weights (fp32). Inference holds a bf16 copy, and optionally an fp8 one
   (attention and expert projections through ``torch._scaled_mm``, e4m3 with per-row
   activation and per-output-channel weight scales; router and lm_head stay bf16).
2. The embedded engine samples ``num_prompts`` completions (temperature 1, KV cache) and
   returns per-token log-probs and the experts every position was routed to.
3. The trainer scores the same tokens with one full-sequence forward, in fp32 and in bf16,
   without and with Router Replay (``forced_experts`` = inference's routing).
4. ``mismatch KL`` = mean k3 over completion tokens (``policy_loss`` statistics of
   workers/trainer/loss.py, the trainer's own metric); reduction = 1 - kl_replay / kl_no_replay.
   ``routing_disagreement``: (token, layer) slots whose expert set differs between trainer
   (no replay) and inference.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu.bench_inference import engine_generate, prompts
from benchmarks.gpu.common import free_cuda, init_on_device, presets
from workers.trainer.loss import own_topk, policy_loss, routing_disagreement, token_logprobs

E4M3_MAX = 448.0


class Fp8Linear(nn.Module):
    """y = x W^T with x, W quantised to float8 e4m3 (rowwise scales), bf16 out, via torch._scaled_mm."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX  # [N, 1]
        self.register_buffer("w8", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("w_scale", scale.t().contiguous())  # [1, N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        m = x2.shape[0]
        pad = (-m) % 16
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        xs = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        x8 = (x2 / xs).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(x8, self.w8.t(), scale_a=xs, scale_b=self.w_scale, out_dtype=torch.bfloat16)
        return y[:m].reshape(*shape[:-1], -1)


def to_fp8(model) -> nn.Module:
    for layer in model.model.layers:
        att = layer.self_attn
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(att, n, Fp8Linear(getattr(att, n)))
        layer.mlp.experts = Fp8Experts(layer.mlp.experts)
    return model


class Fp8Experts(nn.Module):
    """A MoE block's stacked SwiGLU experts with every projection an :class:`Fp8Linear` (the block's
    per-expert loop calls ``expert``; no grouped GEMM: ``grouped_ok`` is False)."""

    def __init__(self, stacked):
        super().__init__()
        inter = stacked.intermediate_size

        def fp8(w):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            lin.weight.data.copy_(w)
            return Fp8Linear(lin)
        gu, down = stacked.gate_up_proj.detach(), stacked.down_proj.detach()
        self.gate = nn.ModuleList(fp8(gu[e, :inter]) for e in range(len(gu)))
        self.up = nn.ModuleList(fp8(gu[e, inter:]) for e in range(len(gu)))
        self.down = nn.ModuleList(fp8(down[e]) for e in range(len(down)))

    def grouped_ok(self, rows) -> bool:
        return False

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.down[e](F.silu(self.gate[e](x)) * self.up[e](x))


def fp8_check(device) -> float:
    """Relative error of Fp8Linear against a float64 reference on random data (expect ~3e-2)."""
    lin = nn.Linear(1024, 512, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(100, 1024, device=device, dtype=torch.bfloat16)
    ref = x.double() @ lin.weight.double().t()
    y = Fp8Linear(lin)(x).double()
    return float((y - ref).norm() / ref.norm())


def rollouts(model, cfg, n: int, plen: int, new: int) -> dict:
    ps = prompts(cfg.vocab_size, n, plen, seed=11)
    ps = [p[:plen // 2] for p in ps]  # equal prompt lengths: rows need no padding
    outs, wall, _ = engine_generate(model, ps, new, temperature=1.0, routed=True, seed=3)
    ids = torch.tensor([p + o.output_ids for p, o in zip(ps, outs)])
    t = ids.shape[1]
    inf_lp = torch.zeros(ids.shape)
    loss_mask = torch.zeros(ids.shape, dtype=torch.bool)
    routed = torch.zeros(ids.shape[0], t, cfg.num_layers, cfg.top_k, dtype=torch.long)
    routed_mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, (p, o) in enumerate(zip(ps, outs)):
        inf_lp[i, len(p):] = torch.tensor(o.logprobs)
        loss_mask[i, len(p):] = True
        r = o.routed_experts.long()  # positions [0, seqlen-1)
        routed[i, : r.shape[0]] = r
        routed_mask[i, : r.shape[0]] = True
    return {"input_ids": ids, "inference_logprobs": inf_lp, "loss_mask": loss_mask, "routed": routed,
            "routed_mask": routed_mask, "engine_wall_s": wall}


@torch.no_grad()
def score(trainer, batch: dict, device, replay: bool) -> dict:
    ids = batch["input_ids"].to(device)
    gates: list[torch.Tensor] = []  # every layer's router logits, as the trainer's hooks collect them
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, o: gates.append(o)) for layer in trainer.model.layers]
    try:
        out = trainer(ids, forced_experts=batch["routed"].to(device) if replay else None,
                      forced_mask=batch["routed_mask"].to(device) if replay else None)
    finally:
        for h in hooks:
            h.remove()
    logp, _ = token_logprobs(out.logits, ids, 1.0)
    lm = batch["loss_mask"].to(device)
    _, st = policy_loss(logp, batch["inference_logprobs"].to(device), torch.zeros(ids.shape[0], device=device), lm,
                        num_loss_tokens=float(lm.sum()), ratio_cap=2.0, ratio_mask_low=0.2, ratio_mask_high=5.0)
    slots = batch["routed_mask"].to(device) & torch.cat([lm[:, 1:], torch.zeros_like(lm[:, :1])], 1)
    own = own_topk(gates, trainer.config.top_k, tuple(ids.shape))
    d, s = routing_disagreement(own, batch["routed"].to(device), slots)
    return {"mismatch_kl": st.k3_sum / max(st.num_tokens, 1), "ratio_min": st.ratio_min, "ratio_max": st.ratio_max,
            "masked_frac": st.num_masked / max(st.num_tokens, 1), "routing_disagreement": d / max(s, 1)}


def run(args: argparse.Namespace, device: torch.device) -> dict:
    moe, _ = presets(args.tiny)
    n, plen, new = (8, 16, 16) if args.tiny else (64, 128, 256)
    master = init_on_device(moe, device, torch.float32, seed=0).eval()
    trainers = {"fp32": master, "bf16": init_on_device(moe, device, torch.float32, seed=0).to(torch.bfloat16).eval()}
    inference = {"bf16": init_on_device(moe, device, torch.float32, seed=0).to(torch.bfloat16).eval()}
    res: dict = {"config": {"num_prompts": n, "prompt_len": plen // 2, "new_tokens": new, "temperature": 1.0}}
    if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        try:
            res["fp8_linear_rel_err_vs_fp64"] = fp8_check(device)
            inference["fp8"] = to_fp8(init_on_device(moe, device, torch.float32, seed=0).to(torch.bfloat16).eval())
        except Exception as e:  # noqa: BLE001 - report, do not fail the other measurements
            res["fp8_skipped"] = f"{type(e).__name__}: {e}"[:500]
    else:
        res["fp8_skipped"] = "needs CUDA torch._scaled_mm (fp8 tensor cores)"
    for iname, imodel in inference.items():
        batch = rollouts(imodel, moe, n, plen, new)
        for tname, tmodel in trainers.items():
            no = score(tmodel, batch, device, replay=False)
            rr = score(tmodel, batch, device, replay=True)
            key = f"inference_{iname}__trainer_{tname}"
            res[key] = {"kl_no_replay": no["mismatch_kl"], "kl_replay": rr["mismatch_kl"],
                        "reduction": 1 - rr["mismatch_kl"] / no["mismatch_kl"] if no["mismatch_kl"] > 0 else None,
                        "routing_disagreement_no_replay": no["routing_disagreement"],
                        "no_replay": no, "replay": rr, "engine_wall_s": batch["engine_wall_s"]}
            print(f"  router replay {key}: kl {no['mismatch_kl']:.3e} -> {rr['mismatch_kl']:.3e} "
                  f"(reduction {res[key]['reduction'] if res[key]['reduction'] is None else round(res[key]['reduction'], 3)}), "
                  f"routing disagreement {no['routing_disagreement']:.3f}", flush=True)
    del master, trainers, inference
    free_cuda()
    return res
