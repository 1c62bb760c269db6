"""A test-only weight transport, ``fake_copy``: proof that a transport is one new home.

Registered from the test tree only (import this module, or ``SLURMRL_PLUGINS=
tests.plugins.weights_plugin``, then ``weights=fake_copy`` or ``weights.transport=fake_copy``);
no project file names it. It moves real weights through its own code on all three sides
(weights_plugin_roles.py), in a layout of its own:

    run_dir/<weights.copy_dir>/v_000003/<i>.bin   raw bytes of the i-th tensor
                                /manifest.json     {version, digest, tensors: [{name, file, dtype,
                                                    shape, xxh3}]}
                                /COPIED            written last (the version is complete)
                                /APPLIED.json      the orchestrator's verdict on this version

Protocol for version V (T: trainer ranks, O: orchestrator, W: embedded inference workers):
  T  V = 0: through the filesystem transport (workers boot from run_dir/weights/step_0).
     V > 0: rank 0 writes every tensor to ``.v_V.tmp/``, manifest.json, COPIED, renames it to
     ``v_V`` and deletes copies older than the newest ``keep_last``; the other ranks only
     wait for rank 0 (a gather). Nobody on the trainer side waits for inference.
  O  each loop turn, if the newest ``v_V`` with COPIED is newer than what workers serve:
     pause every live worker -> ``/update_weights_from_disk`` {model_path: .../v_V,
     weight_version: V} -> continue -> compare every worker's ``weights_digest`` with the
     manifest's (always, not only with weights.verify) and write ``APPLIED.json``
     {version, ok, digests}. A refusal keeps the old version and is retried next turn.
  W  the receiver reads manifest.json, refuses a version without COPIED, a tensor whose
     bytes fail their xxh3 or that does not fit the model, and returns every tensor;
     a ``weights/step_N`` path (a revived worker) is read by the filesystem receiver.
Deadlines: the orchestrator's client timeout per call; nothing else waits.

This module is torch-free (the launcher imports it through SLURMRL_PLUGINS).
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import TRANSPORTS
from workers.weights.delta.config import DeltaWeightsConfig
from workers.weights.spec import TransportSpec, lazy

NAME = "fake_copy"
ROLES = "tests.plugins.weights_plugin_roles"


@dataclasses.dataclass(kw_only=True)
class FakeCopyWeightsConfig(DeltaWeightsConfig):
    """``weights=fake_copy``: filesystem fields (step 0 goes that way) plus the copy directory."""

    transport: str = NAME
    """``fake_copy``: this schema's transport."""
    copy_dir: str = "weights_copy"
    """Directory under run_dir that holds the copies (``v_<V>/``)."""


def check(cfg) -> None:
    """Plan-time: the copy directory is a plain relative name."""
    d = cfg.weights.copy_dir
    if not d or d.startswith("/") or ".." in d.split("/") or d == "weights":
        raise ValueError(f"weights.copy_dir={d!r} must be a relative directory under run_dir other than 'weights'")


SPEC = TRANSPORTS.register(TransportSpec(
    name=NAME, config=FakeCopyWeightsConfig, check=check, backends=("embedded",),
    summary="test-only: rank 0 copies raw tensors to run_dir/<copy_dir>/v_N; workers read them",
    publisher=lazy(f"{ROLES}:make_publisher"), coordinator=lazy(f"{ROLES}:FakeCopyCoordinator"),
    receiver=lazy(f"{ROLES}:make_receiver")), replace=True)
