"""What a weight transport is, for everyone who reaches one through ``TRANSPORTS`` (torch-free).

A transport is one package, ``workers/weights/<name>/``: its ``__init__`` holds the config
schema, the plan-time check, the protocol (who does what, in which order, who waits for whom,
deadlines) and registers a :class:`TransportSpec`; ``publisher.py`` (trainer side),
``receiver.py`` (inference side) and ``coordinator.py`` (orchestrator side) hold the code.

Nobody outside the transport's package names a transport: the trainer asks the spec for its
publisher, the orchestrator for its coordinator, the embedded inference worker for its
receiver, the launcher runs :func:`check_transport`. The spec's three factories import their
module only when called (:func:`lazy`), so the launcher, which reads this module and the
transports' ``__init__`` on the login node, never imports torch.

Every transport meets the same interfaces: ``WeightPublisher`` and ``WeightReceiver``
(workers/weights/base.py, torch) and ``WeightCoordinator`` (workers/weights/coordinator.py,
torch-free, as the orchestrator is).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from workers.common.config.ranges import check_fields
from workers.common.import_path import lazy  # noqa: F401  (transports build their specs with it)
from workers.common.registry import BACKENDS, TRANSPORTS, PluginSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransportSpec(PluginSpec):
    """One weight transport (``weights.transport``); register it with ``TRANSPORTS.register``."""

    publisher: Callable[..., Any]
    """``publisher(run_cfg, paths, topology, *, rank, world_size, device=None) -> WeightPublisher``:
    the trainer rank's side; every rank calls ``publish(version, state)`` (collective)."""
    coordinator: Callable[..., Any]
    """``coordinator(run_cfg, paths, *, log) -> WeightCoordinator``: the orchestrator's side
    (``start(clients)`` once the workers are ready, ``maybe_update(pool)`` every loop turn)."""
    receiver: Callable[..., Any]
    """``receiver(weights_cfg, *, device) -> WeightReceiver``: the embedded inference worker's
    side, behind SGLang's weight routes (workers/inference/embedded/weight_routes.py)."""
    update_line: Optional[Callable[[Any, float], str]] = None
    """``update_line(run_cfg, num_params) -> str``: the plan's line on what one update costs (bytes per
    inference GPU, seconds at ``cluster.nic_gb_s``), "" where it has nothing to say. Torch-free."""
    backends: Optional[tuple[str, ...]] = None
    """``inference.backend`` values whose servers this transport can update (checked at plan time);
    None: every backend (SGLang's ``/update_weights_from_disk``, which all of them serve). A backend
    that runs another's server unchanged (BackendSpec.serves_api_of) counts as that one."""


def check_transport(run_cfg: Any) -> None:
    """Plan-time (pure): every field in its range, the transport's own check (it may say why a backend is out), then
    whether it talks to ``inference.backend`` at all. Raises ValueError naming the key."""
    spec: TransportSpec = TRANSPORTS.get(run_cfg.weights.transport)
    check_fields(run_cfg.weights, "weights")  # every field in its range (rules beside the transport's schema)
    if spec.check is not None:
        spec.check(run_cfg)
    from workers.weights.lora_steps import check_serving  # LoRA mode: what the inference backend can serve

    check_serving(run_cfg)
    backend = BACKENDS.get(run_cfg.inference.backend)
    if spec.backends is not None and not {backend.name, *backend.serves_api_of} & set(spec.backends):
        raise ValueError(f"weights.transport={spec.name} cannot update inference.backend="
                         f"{run_cfg.inference.backend} servers; it talks to {list(spec.backends)}")



def lora_delivery_line(run_cfg: Any, adapter_params: float) -> str:
    """The plan's words on how a LoRA run's adapter (``adapter_params`` numbers per update, launcher/lora_plan.py
    counts them) reaches the servers, whatever the transport, and what that costs (workers/weights/lora_steps.py)."""
    from workers.weights.lora_steps import delivery_line

    return delivery_line(run_cfg, adapter_params)
