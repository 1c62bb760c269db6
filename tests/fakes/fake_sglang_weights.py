"""A fake SGLang 0.5.23 server whose TP ranks really receive weights over SGLang's group (gloo).

The HTTP side is tests/fakes/fake_sglang.FakeSGLang (same routes, same request schemas); the
weight routes fan out to one process per TP rank, as SGLang's TokenizerManager fans a control
request out to its schedulers and answers with the merged result. Each rank process mirrors
the pinned receive path (sglang 0.5.23; tests/unit/inference/test_sglang_weight_protocol.py checks that
the source still reads this way):

- join: ``WeightUpdater.init_weights_update_group``
  (srt/model_executor/model_runner_components/weight_updater.py): rank ``rank_offset + tp_rank``,
  the group made by ``init_custom_process_group`` (srt/utils/common.py), whose steps
  workers/weights/sglang/wire.open_update_group repeats;
- receive: ``WeightUpdater.receive_weights_from_distributed`` (same file): per tensor a
  ``torch.empty(shape, dtype)`` and an async ``broadcast(src=0)`` in the order of ``names``, then
  wait; ``load_format="flattened_bucket"``: ``_receive_bucketed_weights_from_distributed`` with
  ``FlattenedTensorBucket.empty`` (srt/weight_sync/tensor_bucket.py): one uint8 broadcast;
- session: ``SchedulerWeightUpdater.update_weights_from_distributed``
  (srt/managers/scheduler_components/weight_updater.py) refuses outside begin/end, records
  ``weight_version`` only on success; the model's ``load_weights`` copies into its parameters
  (an unknown name or a wrong shape fails the call, as a weight_loader's assert does);
- read back: ``get_weights_by_name`` answers rank 0's ``float32 tolist()[:truncate_size]``
  (TokenizerManager.get_weights_by_name, models/llama.py); unknown names -> HTTP 400.

Every rank holds the full tensors (a real TP rank keeps its shard; the bytes on the wire are
the same). ``/update_weights_from_disk`` loads the safetensors files of ``model_path``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import threading
from pathlib import Path
from typing import Optional

from aiohttp import web

from benchmarks.sglang_receive import receive_like_sglang  # noqa: F401  (tests import it from the fake)
from tests.fakes.fake_sglang import FakeSGLang, FakeSGLangConfig, serve_fake


def model_of(state: dict):
    """The rank's tensors as an nn.Module whose named_parameters() are the HF names (sharing storage),
    which is what a custom weight loader gets from SGLang: the model."""
    import torch

    root = torch.nn.Module()
    for name, t in state.items():
        mod = root
        *path, leaf = name.split(".")
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _rank_main(conn, tp_rank: int, state: dict, experts: Optional[list] = None) -> None:
    """One TP rank: obey commands from the server process until ``stop``. ``experts``: this rank holds only
    these routed experts, in SGLang's FusedMoE layout (tests/fakes/fake_sglang_moe.py); None: everything."""

    from workers.weights.sglang.wire import open_update_group

    # Each rank owns its memory: tensors handed to a spawned process arrive in shared memory
    # (torch's pickler), which would make every rank of a server one buffer.
    model = None
    if experts is not None:
        from tests.fakes.fake_sglang_moe import moe_rank

        state, model = moe_rank(state, experts)
    else:
        state = {n: t.clone() for n, t in state.items()}
    groups: dict = {}
    corrupt_next: list[str] = []  # fault injection: names to spoil after the next load, any kind (tests)
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                conn.send((True, "stopped"))
                return
            if cmd == "join":
                groups[args["group_name"]] = open_update_group(
                    backend=args["backend"], master_address=args["master_address"], master_port=args["master_port"],
                    world_size=args["world_size"], rank=args["rank_offset"] + tp_rank, group_name=args["group_name"],
                    timeout_s=args.get("timeout_s", 60.0))
                out = (True, "Succeeded to initialize custom process group.")
            elif cmd == "receive":
                got = receive_like_sglang(groups[args["group_name"]], args["names"], args["dtypes"], args["shapes"],
                                          args.get("load_format"))
                for n, t in got:  # load_weights
                    if n not in state or tuple(state[n].shape) != tuple(t.shape):
                        raise KeyError(f"cannot load {n} {tuple(t.shape)}")
                    state[n].copy_(t)
                    if n in corrupt_next:
                        corrupt_next.remove(n)
                        state[n].add_(1)
                out = (True, "Succeeded to update parameter online.")
            elif cmd == "tensor":  # update_weights_from_tensor with a --custom-weight-loader load_format
                import base64
                import importlib
                import pickle

                if args["load_format"] not in args["custom_weight_loader"]:
                    raise NotImplementedError(f"Unknown load_format={args['load_format']}")
                named = pickle.loads(base64.b64decode(args["serialized_named_tensors"][tp_rank]))  # its own entry
                module, _, fn = args["load_format"].rpartition(".")
                getattr(importlib.import_module(module), fn)(model if model is not None else model_of(state), named)
                out = (True, "Success")
            elif cmd == "get":
                t = state.get(args["name"])
                out = (t is not None, None if t is None else t.float().numpy().tolist()[:args["truncate_size"]])
            elif cmd == "load_disk":
                from safetensors.torch import load_file

                for f in sorted(Path(args["model_path"]).glob("*.safetensors")):
                    for n, t in load_file(f).items():
                        if n in state or experts is None:  # an EP rank loads only its own experts
                            state[n].copy_(t)
                        if n in corrupt_next:
                            corrupt_next.remove(n)
                            state[n].add_(1)
                out = (True, "Succeeded to update model weights.")
            elif cmd == "state":
                out = (True, {n: t.clone() for n, t in state.items()})
            elif cmd == "corrupt_next":
                corrupt_next.append(args["name"])
                out = (True, "armed")
            else:
                out = (False, f"unknown command {cmd}")
        except Exception as e:  # noqa: BLE001 - the answer carries it, as SGLang's {success: false, message}
            out = (False, f"{type(e).__name__}: {e}")
        conn.send(out)


class RankProcess:
    """The server's handle on one TP rank (a spawned process and its pipe)."""

    def __init__(self, ctx, tp_rank: int, state: dict, experts: Optional[list] = None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child, tp_rank, state, experts), daemon=True)
        self.proc.start()
        self.lock = threading.Lock()

    def call(self, cmd: str, args: Optional[dict] = None, timeout_s: float = 120.0):
        with self.lock:
            self.conn.send((cmd, args or {}))
            if not self.conn.poll(timeout_s):
                raise TimeoutError(f"fake rank did not answer {cmd} within {timeout_s}s")
            return self.conn.recv()


@dataclasses.dataclass
class FakeWeightsConfig(FakeSGLangConfig):
    tp_size: int = 2
    custom_weight_loader: list = dataclasses.field(default_factory=list)
    """--custom-weight-loader: import paths /update_weights_from_tensor may name as its load_format."""
    state: dict = dataclasses.field(default_factory=dict)
    """The served weights at start ({name: tensor}, inference dtype); every rank gets a copy."""
    ep_experts: list = dataclasses.field(default_factory=list)
    """Expert parallelism: per TP rank, the routed experts it holds (SGLang's FusedMoE layout); empty: every
    rank holds every tensor."""


class FakeSGLangWeights(FakeSGLang):
    def __init__(self, cfg: FakeWeightsConfig):
        super().__init__(cfg)
        ctx = mp.get_context("spawn")
        self.ranks = [RankProcess(ctx, r, cfg.state, cfg.ep_experts[r] if cfg.ep_experts else None)
                      for r in range(cfg.tp_size)]
        self.session = False
        r = self.app.router
        r.add_post("/begin_weight_update", self.begin)
        r.add_post("/end_weight_update", self.end)
        r.add_route("*", "/get_weights_by_name", self.get_weights)
        r.add_post("/update_weights_from_tensor", self.update_tensor)

    async def fan_out(self, cmd: str, args: Optional[dict] = None) -> tuple[bool, object]:
        """Every rank at once (a group call blocks until all members are in); merged like FanOutCommunicator."""
        results = await asyncio.gather(*(asyncio.to_thread(r.call, cmd, args) for r in self.ranks))
        bad = [m for ok, m in results if not ok]
        return (not bad, bad[0] if bad else results[0][1])

    def _answer(self, ok: bool, message) -> web.Response:
        return web.json_response({"success": ok, "message": str(message)}, status=200 if ok else 400)

    async def init_group(self, request: web.Request) -> web.Response:
        ok, msg = await self.fan_out("join", await self._body(request))
        return self._answer(ok, msg)

    async def begin(self, request: web.Request) -> web.Response:
        await self._body(request)
        if self.session:
            return self._answer(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = True
        return self._answer(True, "Success")

    async def end(self, request: web.Request) -> web.Response:
        await self._body(request)
        ok, self.session = self.session, False
        return self._answer(ok, "Success" if ok else "no weight-update session is open")

    async def update_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not self.session:
            return self._answer(False, "update_weights_from_distributed must run between begin_weight_update() "
                                       "and end_weight_update()")
        ok, msg = await self.fan_out("receive", body)
        if ok and body.get("weight_version") is not None:
            self.cfg.weight_version = str(body["weight_version"])
        return self._answer(ok, msg)

    async def update_tensor(self, request: web.Request) -> web.Response:
        """SchedulerWeightUpdater.update_weights_from_tensor: inside a session; every rank takes its own entry
        and runs the custom loader load_format names; the version is recorded on success."""
        body = await self._body(request)
        if not self.session:
            return self._answer(False, "update_weights_from_tensor must run between begin_weight_update() and "
                                       "end_weight_update()")
        ok, msg = await self.fan_out("tensor", dict(body, custom_weight_loader=self.cfg.custom_weight_loader))
        if ok and body.get("weight_version") is not None:
            self.cfg.weight_version = str(body["weight_version"])
        return self._answer(ok, msg)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ok, msg = await self.fan_out("load_disk", body)
        if ok and body.get("weight_version") is not None:
            self.cfg.weight_version = str(body["weight_version"])
        return web.json_response({"success": ok, "message": str(msg), "num_paused_requests": 0},
                                 status=200 if ok else 400)

    async def get_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ok, value = await asyncio.to_thread(self.ranks[0].call, "get", body)  # rank 0's answer
        if not ok:
            return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)
        return web.json_response(value)

    def corrupt_next(self, name: str) -> None:
        """Rank 0 spoils ``name`` right after its next load (a silent receive/load fault)."""
        self.ranks[0].call("corrupt_next", {"name": name})

    def rank_state(self, tp_rank: int) -> dict:
        return self.ranks[tp_rank].call("state")[1]

    def close(self) -> None:
        for r in self.ranks:
            with contextlib.suppress(Exception):
                r.call("stop", timeout_s=5)
            r.proc.join(timeout=5)
            if r.proc.is_alive():
                r.proc.kill()


@contextlib.asynccontextmanager
async def serve_fake_sglang_weights(cfg: FakeWeightsConfig, host: str = "127.0.0.1"):
    """Run a FakeSGLangWeights (and its rank processes) on a free loopback port; yields (url, server)."""
    async with serve_fake(FakeSGLangWeights(cfg), host) as url_and_fake:
        yield url_and_fake
