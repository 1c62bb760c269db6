"""Filesystem transport with sparse patches into SGLang servers, orchestrator side: every rank pulls its share.

Why its own coordinator: FilesystemCoordinator asks every server to ``/update_weights_from_disk`` the newest
step, and with ``weights.delta`` most steps are patch steps, which are not Hugging Face directories: SGLang
cannot load them (it was asked to, and refused every patch). Here a patch step is handed to the servers as
a descriptor naming it, through ``/update_weights_from_tensor`` with load_format = our custom weight loader
(workers/weights/sglang/patch_loader.py, ``--custom-weight-loader``); each TP rank reads from
shared storage only the parts of the tensors it holds (its routed experts and every non-expert tensor:
workers/weights/sglang/patch_pull.py), applies them verified by sum64, and writes a verdict.

For the newest STABLE step V above what the servers serve, on every live server at once, inside one
pause (in_place) -> continue (workers/weights/coordinator.swap_weights):
  * V is a full step (an anchor): ``/update_weights_from_disk`` of it;
  * V is a patch step on the chain anchor A -> A+1 -> ... -> V (base pointers, every step STABLE):
    a server known to hold a version h of that chain pulls the patches after h; any other (fresh,
    revived, refused earlier, holding something else) first loads A from disk, then pulls A+1..V.
    Pulling: ``/begin_weight_update`` -> one ``/update_weights_from_tensor`` per version (one descriptor
    entry per TP rank, ``weight_version`` set) -> ``/end_weight_update``; then every rank's verdict
    (``run_dir/weights_pull/verdicts/<server>/v<V>.*.json``, deadline orchestrator.weight_update_timeout_s);
  * a refused or failed pull (a rank that did not hold the base, a corrupt part, a layout it cannot
    patch): the server loads A from disk and pulls A+1..V once more (a rank that lacked the base is
    fixed by that, without materialising the model anywhere); refused again, V is resolved into a
    self-contained HF directory (``run_dir/weights_pull/resolved/step_V``,
    ``python -m workers.weights.filesystem.resolve`` in a subprocess, once per version: the model is
    read once, outside the orchestrator's memory) and that server loads it from disk.
The descriptor entry is a pickled uint8 tensor (SGLang 0.5.23 calls ``.to(device)`` on every entry before
the loader sees it: weight_updater._unwrap_tensor), so the first pull imports torch in the orchestrator.
What each server holds is tracked per server URL (``held``); a server that failed is forgotten, so its
next update starts from the anchor; one revived by the pool loads the anchor and pulls up to the current
version right away (:meth:`revive`).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from workers.common.protocol import STABLE, step_name, wait_for
from workers.weights.coordinator import WeightCoordinator, WeightUpdateError, swap_weights
from workers.weights.delta import FORMAT as PATCH_FORMAT
from workers.weights.filesystem.layout import INDEX, stable_versions
from workers.weights.filesystem.reanchor import Reanchor

PULL_DIR = "weights_pull"
"""Under run_dir: ``verdicts/<server>/`` (the loaders' verdicts) and ``resolved/step_V`` (fallback steps)."""


def read_step(step_dir: Path) -> Optional[dict]:
    """A STABLE step's index.json, None when it is not there (pruned, unstable or unreadable)."""
    try:
        if not (step_dir / STABLE).is_file():
            return None
        index = json.loads((step_dir / INDEX).read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def patch_chain(weights_root: Path, version: int) -> tuple[int, list[int]]:
    """(anchor A, [A+1 .. version] as the base pointers give them) of patch step ``version``; (version, [])
    for a full step. WeightUpdateError when a step of the chain is missing or is not what it should be."""
    index = read_step(weights_root / step_name(version))
    if index is None:
        raise WeightUpdateError(f"weights step {version} is gone or unreadable under {weights_root}")
    if index.get("format") != PATCH_FORMAT:
        return version, []
    anchor, chain, cur = index.get("anchor"), [version], index
    while cur.get("base") != anchor:
        base = cur.get("base")
        if not isinstance(base, int) or not isinstance(anchor, int) or not anchor < base < chain[-1]:
            raise WeightUpdateError(f"weights step {chain[-1]}: base {base!r} is not on its chain to anchor {anchor!r}")
        cur = read_step(weights_root / step_name(base))
        if cur is None or cur.get("format") != PATCH_FORMAT or cur.get("anchor") != anchor:
            raise WeightUpdateError(f"weights step {base} (on the chain of {version}) is gone or not a patch step "
                                    f"of anchor {anchor}")
        chain.append(base)
    if read_step(weights_root / step_name(anchor)) is None:
        raise WeightUpdateError(f"anchor weights step {anchor} of step {version} is gone or unreadable")
    return anchor, chain[::-1]


class FilesystemSGLangCoordinator(WeightCoordinator):
    """weights.transport=filesystem, weights.delta=true, SGLang servers (module docstring)."""

    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        self.held: dict[str, int] = {}  # server URL -> the version it holds for certain
        self.ranks: dict[str, int] = {}  # server URL -> TP ranks (one loader verdict each)
        self.slot: dict[str, int] = {}  # server URL -> its verdict directory's number
        self._resolving = asyncio.Lock()  # servers falling back at once resolve the step once
        self._refused: list[str] = []  # servers that refused a pulled patch during the current update
        self.reanchor = Reanchor(paths.root / "weights", self.retry, enabled=True, log=log)  # a refused step: a full one

    @property
    def timeout_s(self) -> float:
        return float(self.cfg.orchestrator.weight_update_timeout_s)

    async def start(self, clients: Sequence[Any]) -> None:
        """Servers boot at version 0 (``--weight-version 0``, the run's initial checkpoint = step 0)."""
        from workers.weights.coordinator import receiver_rank_counts

        counts = receiver_rank_counts(self.cfg)
        for i, (c, tp) in enumerate(zip(clients, counts)):
            self.held[c.base_url], self.ranks[c.base_url], self.slot[c.base_url] = 0, tp, i

    async def revive(self, pool: Any, worker: int, current) -> bool:
        """A revived server loads a full step (the current one when it is full, else its chain's anchor: SGLang
        cannot load a patch step), then pulls the patches up to the current version at once (its samples
        would be stale until the next version otherwise); if that fails it catches up at the next version."""
        client = pool.clients[worker]
        self.held.pop(client.base_url, None)
        root = self.paths.root / "weights"

        def full_current() -> tuple[int, Optional[str]]:
            version, path = current()
            if path is None:
                return version, None
            try:
                anchor, _ = patch_chain(root, version)
            except WeightUpdateError:
                return version, None
            return anchor, str(root / step_name(anchor))
        if not await pool.try_revive(worker, full_current):
            return False
        (loaded, path), (version, _) = full_current(), current()
        if path is None:
            return True
        self.held[client.base_url] = loaded
        if loaded != version:
            try:
                anchor, chain = await asyncio.to_thread(patch_chain, root, version)
                self._refused = []
                await swap_weights([client], version, lambda c: self._bring(c, version, anchor, chain))
            except WeightUpdateError as e:
                self.log.warning("revived %s stays at v%d until the next version: %s", client.base_url, loaded, e)
        return True

    async def maybe_update(self, pool: Any) -> None:
        root = self.paths.root / "weights"
        self.reanchor.forget_rewritten()
        newer = [v for v in stable_versions(root) if v > self.version]
        untried = [v for v in newer if v not in self.retry.refused]
        if not untried or not self.retry.due(untried[0], context=tuple(pool.live())):
            return
        v = untried[0]
        self.reanchor.trying(v)
        try:
            anchor, chain = await asyncio.to_thread(patch_chain, root, v)
            live = pool.live_clients()
            self._refused = []
            swap = await swap_weights(live, v, lambda c: self._bring(c, v, anchor, chain),
                                      gone=getattr(pool, "gone", None))
            self.update_s, self.version = swap.seconds, v
            if chain:  # per update, as the other coordinators count: verified by every rank's sum64, or not
                self.verified += not self._refused
                self.mismatched += bool(self._refused)
                self.fallbacks += bool(self._refused)
            self.retry.succeeded(v)
            for c in swap.left:
                self.held.pop(c.base_url, None)
        except WeightUpdateError as e:
            wait = self.retry.failed(v, content=e.content, context=tuple(pool.live()))
            if e.content:
                self.refused += 1
                self.reanchor.refused(v, str(e))
            self.log.warning("%s; retrying v%d in %.1fs", e, v, wait)
            await pool.check_live()

    async def _bring(self, client: Any, version: int, anchor: int, chain: list[int]) -> dict:
        """One server to ``version``: from disk (a full step), or pulled patches (from what it holds, else after
        loading the anchor), falling back to the resolved step; returns SGLang's success answer."""
        url, root = client.base_url, self.paths.root / "weights"
        held = self.held.pop(url, None)  # known again only once this ends well
        if held == version:
            pass  # it took this version in an earlier try that failed elsewhere
        elif not chain:
            await client.update_weights_from_disk(str(root / step_name(version)), version, timeout_s=self.timeout_s)
        else:
            await self._patch(client, version, anchor, chain, held)
        self.held[url] = version
        return {"success": True}

    async def _patch(self, client: Any, version: int, anchor: int, chain: list[int], held: Optional[int]) -> None:
        """Pull the patches after what the server holds (after the anchor, loaded first, when it holds nothing
        of this chain). A refusal loads the anchor and pulls the chain once more (a server that did not hold
        the base: cheap, the anchor is on disk anyway); refused again, the resolved step is loaded."""
        url, anchor_dir = client.base_url, str(self.paths.root / "weights" / step_name(anchor))
        fresh = not (held is not None and (held == anchor or held in chain))  # the anchor is loaded just now
        if fresh:
            await client.update_weights_from_disk(anchor_dir, anchor, timeout_s=self.timeout_s)
            held = anchor
        todo = chain[chain.index(held) + 1:] if held != anchor else chain
        why = await self._pull(client, todo, anchor, held)
        if not why:
            return
        self._refused.append(url)
        if not fresh:  # it did not start from a freshly loaded anchor: start there
            self.log.warning("weights v%d: %s refused the pulled patch (%s): loading anchor v%d, pulling again",
                             version, url, why, anchor)
            await client.update_weights_from_disk(anchor_dir, anchor, timeout_s=self.timeout_s)
            why = await self._pull(client, chain, anchor, anchor)
            if not why:
                return
        self.log.error("weights v%d: %s refused the pulled patch on its anchor (%s): loading the resolved step",
                       version, url, why)
        await client.update_weights_from_disk(await self._resolved(version), version, timeout_s=self.timeout_s)

    async def _pull(self, client: Any, versions: list[int], anchor: int, base: int) -> str:
        """begin -> one descriptor per version, the first on ``base`` (stopping at the first refusal) -> end;
        returns why it failed ("")."""
        from workers.weights.sglang.patch_loader import descriptor_tensor
        from workers.weights.sglang.wire import DELTA_LOADER

        url, tp = client.base_url, self.ranks.get(client.base_url, 1)
        verdicts = self.paths.root / PULL_DIR / "verdicts" / str(self.slot.get(url, 0))
        root = self.paths.root / "weights"
        why = ""
        for f in verdicts.glob("v*.json"):  # the previous pull's (kept until now for a look; not piling up)
            f.unlink()
        await client.begin_weight_update(timeout_s=self.timeout_s)
        try:
            for v in versions:
                desc = {"format": PATCH_FORMAT, "version": v, "base": base, "anchor": anchor,
                        "step_dir": str(root / step_name(v)), "verdict_dir": str(verdicts)}
                entry = await asyncio.to_thread(descriptor_tensor, desc)  # SGLang calls .to(device) on each entry
                try:
                    await client.update_weights_from_tensor(serialized_named_tensors=[entry] * tp,
                                                            load_format=DELTA_LOADER, weight_version=v,
                                                            flush_cache=v == versions[-1], timeout_s=self.timeout_s)
                except Exception as e:  # noqa: BLE001 - refused or unreachable: the fallback decides
                    why = f"v{v}: {e}"
                    break
                why = await self._verdicts(verdicts, v, tp)  # the loader never raises: its verdicts say
                if why:
                    break
                base = v
        finally:
            await client.end_weight_update(timeout_s=self.timeout_s)
        return why

    async def _verdicts(self, verdicts: Path, version: int, tp: int) -> str:
        """Every rank's verdict on ``version`` (the loader writes one each); returns the refusals ("": all ok)."""
        try:
            files = await asyncio.to_thread(
                wait_for, lambda: (lambda fs: fs if len(fs) >= tp else None)(sorted(verdicts.glob(f"v{version}.*.json"))),
                timeout_s=self.timeout_s, what=f"{tp} loader verdicts on v{version} in {verdicts}",
                peer="SGLang server ranks (custom weight loader)")
        except Exception as e:  # noqa: BLE001 - a missing verdict is a refusal
            return str(e)
        got = [json.loads(f.read_text()) for f in files]
        bad = [f"{f.name}: {g.get('message')}" for f, g in zip(files, got) if not g.get("ok")]
        return "; ".join(bad[:3])

    async def _resolved(self, version: int) -> str:
        """``run_dir/weights_pull/resolved/step_V``: patch step V made a full HF directory (once per version)."""
        async with self._resolving:
            return await self._resolve(version)

    async def _resolve(self, version: int) -> str:
        out = self.paths.root / PULL_DIR / "resolved" / step_name(version)
        if (out / STABLE).is_file():
            return str(out)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workers.weights.filesystem.resolve", str(self.paths.weights(version)), str(tmp),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise WeightUpdateError(f"weights v{version}: resolving the patch step into a full directory failed: "
                                    f"{err.decode(errors='replace').strip()[-500:]}")
        (tmp / STABLE).touch()
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        for old in out.parent.glob("step_*"):  # only the newest fallback is kept
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        return str(out)
