"""LoRA mode, orchestrator side: deliver each adapter step and sample from it only once confirmed.

Why confirmation: the worst LoRA RL bug users report is silent (verl #7495): the adapter never reached
the rollout engine, the engine answered as if it had, and rollouts sampled the initial policy for two
months of training. Here a version counts as delivered to a worker only when the worker proves it:

- embedded workers: ``/update_weights_from_disk`` of ``weights/step_V`` (an adapter directory) inside
  pause -> load -> continue (workers/weights/coordinator.swap_weights); the answer must carry
  ``adapter_digest`` equal to the trainer's (workers/weights/lora_steps.expected_digest): the engine
  computes it over the tensors it read and copied into its buffers, verified copy included;
- SGLang servers: SGLang's own ``/load_lora_adapter`` {lora_name: ``<adapter>@v<V>``, lora_path: the
  step dir}; its answer must be a success listing that name among ``loaded_adapters``. Requests then
  carry ``lora_path`` = that name (:class:`AdapterClient`), so every token of a request comes from one
  known version; the previous name is unloaded after the switch (SGLang waits for its requests).

A worker that does not confirm V (no digest, another digest, a refusal) is **quarantined**: it gets no
new groups, its groups in flight are cancelled and run elsewhere, and tokens it produced under V are
dropped (:meth:`LoraCoordinator.refuses`); it leaves quarantine when it confirms a later version. The
orchestrator's version moves to V only when at least one live worker confirmed it; every unconfirmed
delivery is an ERROR line and counts in ``weight_updates_unconfirmed`` (metrics.jsonl). When
:data:`MAX_UNCONFIRMED` published versions in a row are confirmed by no worker, the run stops with
:class:`AdapterNotDelivered` instead of training on samples of a policy nobody serves.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional, Sequence

from workers.weights.coordinator import WeightCoordinator, WeightUpdateError, swap_weights
from workers.weights.filesystem.layout import stable_versions
from workers.common.registry import speaks_sglang
from workers.weights.lora_steps import ADAPTERS_DIR, expected_digest, lora_mode

MAX_UNCONFIRMED = 3
"""Consecutive published versions confirmed by no worker before the run stops."""


class AdapterNotDelivered(RuntimeError):
    """Several adapter versions in a row reached no inference worker: sampling cannot follow training."""


class LoraCoordinator(WeightCoordinator):
    """Embedded workers: adapter steps through ``/update_weights_from_disk``, confirmed by digest."""

    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        mode = lora_mode(cfg)
        self.adapter = mode.adapters[0] if mode is not None else "default"
        self.quarantined: dict[int, int] = {}  # worker index -> the version it failed to confirm
        self.bad: set[tuple[int, int]] = set()  # (worker, version) pairs whose tokens are refused
        self.unconfirmed = 0  # deliveries a worker did not confirm (metrics: weight_updates_unconfirmed)
        self.streak = 0  # consecutive versions no worker confirmed

    # ---- what the loop asks ------------------------------------------------------------
    def samples_from(self, worker: int) -> bool:
        """May the loop start groups on ``worker`` (not quarantined)?"""
        return worker not in self.quarantined

    def refuses(self, worker: int, versions: Sequence[int]) -> bool:
        """Were any of these token versions produced by ``worker`` under a version it never confirmed?"""
        return any((worker, v) in self.bad for v in set(versions))

    def metrics(self) -> dict:
        return {"weight_updates_unconfirmed": self.unconfirmed, "inference_workers_quarantined": len(self.quarantined)}

    # ---- a worker coming back ------------------------------------------------------------
    async def revive(self, pool: Any, worker: int, current: Any) -> bool:
        """Dead ``worker`` answers again (workers/orchestrator/faults.py): it booted from the base (step 0) or
        its own newest adapter; deliver the current version to it and confirm it like an update before it
        is live (unconfirmed: live but quarantined, and said so)."""
        from workers.common.inference_client import InferenceError

        if pool.alive[worker] or not await pool.healthy(worker):
            return False
        version = self.version
        if version > 0:
            step = self.paths.weights(version)
            try:
                answer = await self.deliver_one(pool.clients[worker], str(step), version)
            except InferenceError as e:
                self.log.warning("revived worker %d refused adapter v%d: %s", worker, version, e)
                return False
            expected = await asyncio.to_thread(expected_digest, step)
            self.confirm_worker(worker, version, self.confirmed_by(answer, expected, version))
        pool.readmit(worker, version)
        return True

    async def deliver_one(self, client: Any, step: str, version: int) -> dict:
        """One worker's load of adapter step ``step`` outside a swap (it serves nothing yet)."""
        return await client.update_weights_from_disk(step, version, allow_rollback=True)

    def confirm_worker(self, worker: int, version: int, why: Optional[str]) -> bool:
        """Record one worker's confirmation of ``version`` (``why``: None when confirmed); True when confirmed."""
        if why is None:
            self.quarantined.pop(worker, None)
            return True
        self.unconfirmed += 1
        self.quarantined[worker] = version
        self.bad.add((worker, version))
        self.log.error("weights v%d NOT confirmed by inference worker %d: %s; not sampling from it (its tokens "
                       "under v%d are dropped) until it confirms a later version", version, worker, why, version)
        return False

    # ---- one update ----------------------------------------------------------------------
    async def maybe_update(self, pool: Any) -> None:
        newer = [v for v in stable_versions(self.paths.root / "weights") if v > self.version]
        untried = [v for v in newer if v not in self.retry.refused]
        if not untried or not self.retry.due(untried[0], context=tuple(pool.live())):
            return
        newest = untried[0]
        step = self.paths.weights(newest)
        expected = await asyncio.to_thread(expected_digest, step)
        live = pool.live()
        clients = [pool.clients[w] for w in live]
        try:
            answers, seconds = await self.deliver(clients, str(step), newest, pool)
        except WeightUpdateError as e:
            wait = self.retry.failed(newest, content=e.content, context=tuple(pool.live()))
            self.log.warning("%s; %s", e, f"v{newest} will not be tried again (refused for its content)"
                             if e.content else f"retrying v{newest} in {wait:.1f}s")
            await pool.check_live()
            return
        self.confirm(newest, live, answers, expected, seconds)

    async def deliver(self, clients: Sequence[Any], step: str, version: int, pool: Any
                      ) -> tuple[list[Optional[dict]], float]:
        """Send the step; per client its answer (None: left behind, marked dead meanwhile)."""
        swap = await swap_weights(clients, version, lambda c: c.update_weights_from_disk(step, version),
                                  gone=getattr(pool, "gone", None))
        return swap.answers, swap.seconds

    def confirmed_by(self, answer: Optional[dict], expected: Optional[str], version: int) -> Optional[str]:
        """None when ``answer`` confirms ``version``, else why not."""
        got = (answer or {}).get("adapter_digest")
        if expected is None:
            return f"the trainer's digest of step {version} is unreadable"
        if got is None:
            return "the worker answered without an adapter_digest (the adapter was not loaded)"
        return None if got == expected else f"adapter digest {got} != the trainer's {expected}"

    def confirm(self, version: int, live: list[int], answers: list[Optional[dict]], expected: Optional[str],
                seconds: float) -> None:
        ok, bad = [], []
        for w, answer in zip(live, answers):
            if answer is None:
                continue  # left behind: it loads the current version when it comes back (revive)
            why = self.confirmed_by(answer, expected, version)
            (ok if self.confirm_worker(w, version, why) else bad).append((w, why))
        self.update_s = seconds
        if not ok and not bad:  # every worker left during the delivery: nothing was refused, try again later
            self.retry.failed(version, content=False, context=tuple(live))
            return
        if ok:
            self.version, self.streak = version, 0
            self.retry.succeeded(version)
            return
        self.retry.refused.add(version)  # the next version is delivered afresh
        self.streak += 1
        if self.streak >= MAX_UNCONFIRMED:
            raise AdapterNotDelivered(
                f"adapter versions {version - self.streak + 1}..{version} were confirmed by no inference worker "
                f"(last: {bad[0][1] if bad else 'no live worker'}); rollouts would sample a policy the trainer "
                f"no longer has, so the run stops")


class SGLangLoraCoordinator(LoraCoordinator):
    """SGLang servers: ``/load_lora_adapter`` by name, requests switched to the new name, old unloaded.

    Several adapters (``trainer.lora.adapters``): a version is every adapter's PEFT directory
    (``step_V/adapters/<name>/``), each loaded as ``<name>@v<V>``; a server confirms V only when its
    answers list all of them (a server serving some adapters at V and others at V-1 would sample a policy
    the trainer never had), and a request naming adapter ``a`` is sent as ``a@v<V>`` of the version the
    coordinator serves now."""

    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        mode = lora_mode(cfg)
        self.adapters: tuple[str, ...] = mode.adapters if mode is not None else (self.adapter,)
        self.served: Optional[int] = None  # the version requests name now (None: the base, step 0)
        self.pool_clients: list[Any] = []
        self._unloads: set[asyncio.Task] = set()

    @property
    def loaded(self) -> Optional[str]:
        """The name a request of the (first) adapter carries now (None: the base)."""
        return None if self.served is None else self.name(self.served)

    def name(self, version: int, adapter: Optional[str] = None) -> str:
        return f"{adapter or self.adapter}@v{version}"

    def step_dirs(self, step: str) -> dict[str, str]:
        """Adapter name -> the PEFT directory SGLang loads from step dir ``step``."""
        if len(self.adapters) == 1:
            return {self.adapter: step}
        return {a: str(Path(step) / ADAPTERS_DIR / a) for a in self.adapters}

    def request_adapter(self, adapter: Optional[str] = None) -> tuple[Optional[str], int]:
        """(lora_path to send, its version) for a request of ``adapter`` (None: the run's single adapter)
        starting now; ValueError for a name the run does not train (it would sample another policy)."""
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"request for LoRA adapter {adapter!r}: this run trains {list(self.adapters)} "
                             f"(trainer.lora.adapters)")
        return (None if self.served is None else self.name(self.served, adapter)), self.version

    async def load_all(self, client: Any, step: str, version: int) -> dict:
        """Load every adapter of step ``step`` into one server; one answer for the lot (the last success,
        or the first failure, after unloading what this call had loaded: a retry loads afresh)."""
        answer: dict = {"success": False, "error_message": "no adapter to load"}
        done: list[str] = []
        for adapter, path in self.step_dirs(step).items():
            try:
                answer = await client.load_lora_adapter(self.name(version, adapter), path)
            except Exception as e:  # noqa: BLE001 - InferenceError or a transport error: this server refused
                answer = {"success": False, "error_message": f"{self.name(version, adapter)}: {e}"}
            if not answer.get("success"):
                for name in done:
                    await self._unload(client, name)
                return answer
            done.append(self.name(version, adapter))
        return answer

    async def deliver(self, clients: Sequence[Any], step: str, version: int, pool: Any
                      ) -> tuple[list[Optional[dict]], float]:
        import time

        t0 = time.perf_counter()
        answers = await asyncio.gather(*(self.load_all(c, step, version) for c in clients))
        return list(answers), time.perf_counter() - t0

    async def deliver_one(self, client: Any, step: str, version: int) -> dict:
        """A revived server: the current adapters under their names (dropped first if they survived a hiccup)."""
        for adapter in self.adapters:
            try:
                await client.unload_lora_adapter(self.name(version, adapter))
            except Exception:  # noqa: BLE001 - not loaded: the usual case after a restart
                pass
        return await self.load_all(client, step, version)

    def confirmed_by(self, answer: Optional[dict], expected: Optional[str], version: int) -> Optional[str]:
        if not (answer or {}).get("success"):
            return f"/load_lora_adapter failed: {(answer or {}).get('error_message')}"[:300]
        loaded = (answer or {}).get("loaded_adapters") or {}
        missing = [self.name(version, a) for a in self.adapters if self.name(version, a) not in loaded]
        if missing:
            return f"/load_lora_adapter answered success but {', '.join(missing)} not among its loaded adapters"
        return None

    def confirm(self, version: int, live: list[int], answers: list[Optional[dict]], expected: Optional[str],
                seconds: float) -> None:
        before = self.version
        super().confirm(version, live, answers, expected, seconds)
        if self.version == version:
            old, self.served = self.served, version
            if old is not None and before != version:
                for adapter in self.adapters:
                    self._unload_later(self.name(old, adapter))

    async def _unload(self, client: Any, name: str) -> None:
        try:
            await client.unload_lora_adapter(name)
        except Exception as e:  # noqa: BLE001 - an adapter left loaded costs memory, not correctness
            self.log.warning("could not unload adapter %s from %s: %s", name, getattr(client, "base_url", "?"), e)

    def _unload_later(self, name: str) -> None:
        """SGLang's unload waits for the name's requests to finish: in the background."""
        async def unload():
            for c in self.pool_clients:
                await self._unload(c, name)
        task = asyncio.ensure_future(unload())
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def maybe_update(self, pool: Any) -> None:
        self.pool_clients = pool.live_clients()
        await super().maybe_update(pool)


class AdapterClient:
    """A generation client whose requests carry the adapter the SGLang coordinator serves now (SGLang's
    ``lora_path``) and whose results are tagged with that adapter's version: one request, one version.
    Several adapters: the request's own ``lora_path`` (an adapter name, set by
    workers/orchestrator/adapters.NamedAdapterClient) becomes that adapter's loaded name."""

    def __init__(self, inner: Any, coordinator: SGLangLoraCoordinator):
        self.inner, self.coordinator = inner, coordinator

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, input_ids, **kw):
        extra = dict(kw.get("extra") or {})
        name, version = self.coordinator.request_adapter(extra.pop("lora_path", None))
        if name is not None:
            extra["lora_path"] = name
        kw["extra"] = extra or None  # step 0: the base serves every adapter (each B is zero)
        result = await self.inner.generate(input_ids, **kw)
        result.token_versions = [version] * len(result.output_ids)
        result.weight_version = version
        return result


def make_lora_coordinator(cfg: Any, paths: Any, *, log: Any) -> LoraCoordinator:
    return (SGLangLoraCoordinator if speaks_sglang(cfg) else LoraCoordinator)(cfg, paths, log=log)
