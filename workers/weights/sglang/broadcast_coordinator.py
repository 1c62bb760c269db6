"""Broadcast into SGLang servers, orchestrator side: join, then pause -> receive -> verify -> continue.

``start``: wait for trainer rank 0's ``group.json``; POST ``/init_weights_update_group`` to every
server at once, server i at ``rank_offset = 1 + (TP ranks of servers 0..i-1)`` (the trainer is rank
0; a server spanning several nodes contributes all its TP ranks; prefill and decode servers alike).

``maybe_update`` when ``offer.json`` names a new version V:
  1. ``/pause_generation`` in_place on every server (requests keep their KV cache and wait);
  2. write ``request.json`` (trainer rank 0 starts streaming);
  3. on every server at once: ``/begin_weight_update``, then one ``/update_weights_from_distributed``
     per batch (wire.plan_batches over group.json: the trainer's order), ``weight_version``
     and ``flush_cache`` on the last batch only (the label flips once every tensor is in), then
     ``/end_weight_update``. A server that answers a batch with an error still gets the remaining
     batches posted: the group is one collective, a missing receiver would stall everyone;
  4. verify: for the tensors in the trainer's ``samples.json``, ``/get_weights_by_name`` on every
     server must equal what the trainer sent, exactly (bf16 -> float32 is exact);
  5. ``verdict.json`` {version, ok, why}; not ok: the trainer publishes ``weights/step_V`` and every
     server loads it with ``/update_weights_from_disk`` (still paused);
  6. ``/continue_generation`` on every server that paused, whatever happened.
With weights.delta and an offer of a patch (and no server known to lack its base): steps 3-4 become
``/begin_weight_update`` -> ``/update_weights_from_tensor`` (trainer rank 0's descriptor, patch.json, for
every TP rank; load_format = the patch loader) -> ``/end_weight_update``, then every rank's verdict
file (patch_loader.py writes one per rank; all must say ok) instead of the read-back.
Every call has the deadline ``weights.broadcast_timeout_s``; failures name the server.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional, Sequence

from workers.common.protocol import latest_stable_step, wait_for
from workers.weights.broadcast.handshake import Handshake
from workers.weights.broadcast.join import join_announced_group
from workers.weights.sglang.wire import metas_from, plan_batches
from workers.weights.coordinator import WeightCoordinator, WeightUpdateError

SAMPLES_FILE, VERDICT_FILE = "samples.json", "verdict.json"  # the trainer's names for them (broadcast_publisher.py)
PATCH_FILE, VERDICTS_DIR = "patch.json", "loader_verdicts"


async def patch_all(client: Any, entry: str, tp: int, loader: str, version: int, timeout_s: float) -> Optional[str]:
    """weights.delta on one server: begin -> /update_weights_from_tensor (the descriptor for each of its
    ``tp`` ranks; ``loader`` applies it) -> end; returns the first failure (None: the call was taken)."""
    failure: Optional[str] = None
    for step in ("begin", "patch", "end"):
        try:
            if step == "begin":
                await client.begin_weight_update(timeout_s=timeout_s)
            elif step == "patch":
                await client.update_weights_from_tensor(serialized_named_tensors=[entry] * tp, load_format=loader,
                                                        weight_version=version, flush_cache=True, timeout_s=timeout_s)
            else:
                await client.end_weight_update(timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001 - the rest must still run (the trainer's broadcast waits for every rank)
            failure = failure or f"{step}: {e}"
    return failure


async def receive_all(client: Any, group: dict, batches: list, version: int, timeout_s: float) -> Optional[str]:
    """begin -> every batch -> end on one server; returns the first failure (None: all taken)."""
    failure: Optional[str] = None
    try:
        await client.begin_weight_update(timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - the batches must still be posted (the senders wait for every rank)
        failure = f"begin_weight_update: {e}"
    for b in batches:
        last = b.index == len(batches) - 1
        try:
            await client.update_weights_from_distributed(
                **b.body(group_name=group["group_name"], load_format=group["load_format"]),
                weight_version=version if last else None, flush_cache=last, timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001
            failure = failure or f"batch {b.index}: {e}"
    try:
        await client.end_weight_update(timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001
        failure = failure or f"end_weight_update: {e}"
    return failure


async def read_back(clients: Sequence[Any], samples: dict) -> list[str]:
    """Every sampled tensor from every server vs. what the trainer sent; returns the mismatches."""
    rows, bad = int(samples["rows"]), []
    for name, want in samples["expected"].items():
        got = await asyncio.gather(*(c.get_weights_by_name(name, truncate_size=rows) for c in clients),
                                   return_exceptions=True)
        bad += [f"{c.base_url}: {name} " + (f"unreadable ({g})" if isinstance(g, BaseException) else "differs")
                for c, g in zip(clients, got) if isinstance(g, BaseException) or g != want]
    return bad


class SGLangBroadcastCoordinator(WeightCoordinator):
    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        self.handshake = Handshake(paths.root)
        self.group: Optional[dict] = None
        self.batches: list = []
        self.requested_version = 0
        self.clients: list = []
        self.need_full = False  # weights.delta: a server may lack the last version, the next goes whole
        self.last_refusal = ""  # why the last refused update was refused (logged; kept for tests and status)

    async def start(self, clients: Sequence[Any]) -> None:
        info = await join_announced_group(self.handshake, self.cfg, clients)
        self.group, self.clients = info, list(clients)
        self.batches = plan_batches(metas_from(info), int(info["bucket_bytes"]))
        self.log.info("%d SGLang servers joined weight group %s (%s, world %d, %d batches of %s)", len(clients),
                      info["group_name"], info["backend"], info["world_size"], len(self.batches), info["load_format"])

    async def maybe_update(self, pool: Any) -> None:
        offer = self.handshake.offered()
        if self.group is None or offer is None or offer["version"] <= self.requested_version:
            return
        v = self.requested_version = offer["version"]
        t0 = time.perf_counter()
        timeout = self.cfg.weights.broadcast_timeout_s
        paused = await asyncio.gather(*(c.pause_generation(mode="in_place") for c in self.clients),
                                      return_exceptions=True)
        as_patch = bool(offer.get("delta")) and not self.need_full
        try:
            self.handshake.request(v, "delta" if as_patch else "full")
            if as_patch:
                why = await self._patch(v, timeout)
                self.verified += not why  # every touched tensor's sum64 checked by every server rank
            else:
                failures = await asyncio.gather(*(receive_all(c, self.group, self.batches, v, timeout)
                                                  for c in self.clients))
                why = "; ".join(f"{c.base_url}: {f}" for c, f in zip(self.clients, failures) if f)
            if not why and not as_patch:
                samples = await asyncio.to_thread(wait_for, lambda: self._samples(v), timeout_s=timeout,
                                                  what=f"{self.handshake.dir}/{SAMPLES_FILE} v{v}", peer="trainer rank 0")
                bad = await read_back(self.clients, samples)
                why = "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
                self.verified += bool(samples["expected"]) and not bad
            self.handshake.write_marker(VERDICT_FILE, {"version": v, "ok": not why, "why": why or None})
            if why:
                self.mismatched += 1
                self.last_refusal = f"v{v}: {why}"
                self.log.error("weights v%d through SGLang's group refused (%s): loading weights/step_%d instead",
                               v, why, v)
                await self._from_disk(v, timeout)
            self.update_s, self.version = time.perf_counter() - t0, v
            self.need_full = False  # every server holds v (the patch, the broadcast or the step on disk)
        except WeightUpdateError as e:
            self.log.warning("%s", e)
            self.need_full = True
        finally:
            await asyncio.gather(*(c.continue_generation() for c, p in zip(self.clients, paused)
                                   if not isinstance(p, BaseException)), return_exceptions=True)

    async def _patch(self, version: int, timeout_s: float) -> str:
        """weights.delta: hand every server rank the trainer's descriptor (patch.json), let their loaders
        receive and apply the broadcast patch, then read every rank's verdict; returns why it failed ("")."""
        from workers.weights.coordinator import receiver_rank_counts
        from workers.weights.sglang.wire import DELTA_LOADER

        patch = await asyncio.to_thread(wait_for, lambda: self._marker(PATCH_FILE, version), timeout_s=timeout_s,
                                        what=f"{self.handshake.dir}/{PATCH_FILE} v{version}", peer="trainer rank 0")
        counts = receiver_rank_counts(self.cfg)
        failures = await asyncio.gather(*(patch_all(c, patch["entry"], tp, DELTA_LOADER, version, timeout_s)
                                          for c, tp in zip(self.clients, counts)))
        why = [f"{c.base_url}: {f}" for c, f in zip(self.clients, failures) if f]
        verdicts = self.handshake.dir / VERDICTS_DIR
        try:
            got = await asyncio.to_thread(wait_for, lambda: (lambda fs: fs if len(fs) >= sum(counts) else None)(
                sorted(verdicts.glob(f"v{version}.*.json"))), timeout_s=timeout_s,
                what=f"{sum(counts)} loader verdicts in {verdicts}", peer="SGLang servers (custom weight loader)")
        except Exception as e:  # noqa: BLE001 - missing verdicts: refused (the step comes from disk)
            return "; ".join(why + [str(e)])
        for f in got:
            v = json.loads(f.read_text())
            if not v.get("ok"):
                why.append(f"{f.name}: {v.get('message')}")
        return "; ".join(why[:5])

    def _marker(self, name: str, version: int) -> Optional[dict]:
        got = self.handshake.read_marker(name)
        return got if got is not None and got.get("version") == version else None

    def _samples(self, version: int) -> Optional[dict]:
        got = self.handshake.read_marker(SAMPLES_FILE)
        return got if got is not None and got.get("version") == version else None

    async def _from_disk(self, version: int, timeout_s: float) -> None:
        """The fallback: the trainer writes weights/step_V on our verdict; every server loads it."""
        root = self.paths.root / "weights"
        await asyncio.to_thread(wait_for, lambda: (latest_stable_step(root) or -1) >= version, timeout_s=timeout_s,
                                what=f"{self.paths.weights(version)}/STABLE", peer="trainer (filesystem fallback)")
        path = str(self.paths.weights(version))
        results = await asyncio.gather(*(c.update_weights_from_disk(path, version, timeout_s=timeout_s)
                                         for c in self.clients), return_exceptions=True)
        failed = [f"{c.base_url}: {r}" for c, r in zip(self.clients, results) if isinstance(r, BaseException)]
        if failed:
            raise WeightUpdateError(f"weights v{version} from {path} failed on " + "; ".join(failed))
        self.fallbacks += 1
