"""What the routers chose during one trainer forward, for the loss: every routed layer's probabilities
(the DP-exact balance loss) and its own top-k (routing_disagreement under Router Replay), collected by
wrapping each router's ``route`` (any family) or, for the older parity tests, by hooks on ``mlp.gate``.
Its own module: the step (workers/trainer/step.py) only opens these contexts; how a router reports,
and why it must report the same way in a checkpoint's recompute, is this file's business."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from workers.models.blocks.decoder import CausalLM


@contextlib.contextmanager
def capture_routing(model, valid: torch.Tensor | None = None) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Collect every routed layer's ``(probs [B*T, E] with grad, own choice [B*T, k])``, in layer
    order, during one forward: the DP-exact balance loss needs the probabilities, and
    routing_disagreement the router's OWN top-k under Router Replay.

    ``valid`` ([B, T] bool): keep only the probability SUMS over the valid tokens, ``[E]`` with
    grad, reduced as each router runs. All the balance loss needs, and the [B*T, E] probabilities
    are then not held until the loss (at 131k tokens x 256 experts x 75 layers they would be 10 GB
    per row, kept even under full activation checkpointing). The weights stay on the router after
    the context closes, so a checkpointed layer's recompute in the backward reduces them again
    (the same ops as the forward, as non-reentrant and selective checkpointing require).

    Any family: the router of a routed layer (``routed = True``) is the first of its modules
    with ``route(x, forced, forced_mask) -> (indices, weights, probs)`` (tiny_moe's MoeBlock,
    blocks/router_sigmoid.py's SigmoidTopkRouter). Its ``route`` is wrapped on the instance
    (once; it stays: the trainer's model serves nothing else) and reports only while this
    context is open. Under replay the own choice is one more no-grad ``route`` without forcing,
    also when an activation-checkpointing recompute runs it, so the recompute replays exactly
    the forward's ops (selective checkpointing matches them one by one).

    Each router keeps its LAST result on the wrapper (``last``), and the list is filled when the
    context closes: the wrapper's code then does the same thing in the forward and in a
    checkpoint's recompute, so under trainer.compile both run the same compiled graph (a
    Python-list sink open in one and closed in the other made two graphs that save different
    tensors, which the checkpoint refuses).
    """
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    routers = [next((m for m in layer.modules() if callable(getattr(m, "route", None))), None)
               for layer in model.model.layers if getattr(layer, "routed", False)]
    routers = [r for r in routers if r is not None]
    weights = None if valid is None else valid.reshape(-1).to(torch.float32)[:, None]
    for r in routers:
        if not isinstance(r.__dict__.get("route"), _CapturingRoute):
            r.route = _CapturingRoute(type(r).route.__get__(r))
        r.route.last, r.route.weights = None, weights
    try:
        yield captured
    finally:  # weights stay: an activation-checkpointing recompute must run the same ops
        captured.extend(r.route.last for r in routers if r.route.last is not None)
        for r in routers:
            r.route.last = None


class _CapturingRoute:
    def __init__(self, route):
        self.route, self.last, self.weights = route, None, None

    def __call__(self, x, *args, **kwargs):
        idx, weights, probs = self.route(x, *args, **kwargs)
        forced = args[0] if args else kwargs.get("forced")
        if forced is None:
            own = idx
        else:
            with torch.no_grad():
                own = self.route(x, None, None)[0]
        kept = probs
        if self.weights is not None and self.weights.shape[0] == probs.shape[0]:
            kept = (probs.float() * self.weights).sum(0)  # also in a recompute (sink closed): same saved tensors
        self.last = (kept, own.detach())
        return idx, weights, probs


def stack_own(routers: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, int],
              device: torch.device) -> torch.Tensor:
    """``[B, T, L, k]`` own choices of the captured routers (``[B, T, 0, 0]`` for a dense model)."""
    b, t = shape
    if not routers:
        return torch.zeros(b, t, 0, 0, dtype=torch.long, device=device)
    return torch.stack([own.view(b, t, -1) for _, own in routers], dim=2)


@contextlib.contextmanager
def capture_gate_logits(model: CausalLM) -> Iterator[list[torch.Tensor]]:
    """Collect every MoE layer's router logits ``[B*T, E]`` (in layer order) during a forward.

    The loss needs router probabilities (for the DP-exact balance loss) and the router's
    own top-k (for routing_disagreement under replay); hooks get both from the one
    training forward instead of a second forward.
    """
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]  # dense layers have no router
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()
