"""Parallel dimensions of the trainer and the process group that realises them.

For now the only dimension is data parallel: ``dp == world_size`` (tp = ep = 1). The
object still carries the degrees so the loop never reads ``world_size`` for a meaning
that will later split (rows are sharded over ``dp``, not over the world).

Rendezvous protocol (trainer rank 0 <-> ranks 1..N-1), every wait has a deadline:
  1. rank 0 opens a TCPStore on ``master_addr:master_port`` (topology);
  2. every rank connects and sets ``slurmrl/joined/<rank>``;
  3. rank 0 polls until all N keys exist; on the deadline it raises naming the ranks that
     never joined; a rank that cannot reach rank 0's store raises naming rank 0;
  4. ``init_process_group`` (gloo on CPU, NCCL with CUDA) on that store.
The explicit store (rather than ``init_method="tcp://..."``, which it is equivalent to)
exists only for step 3: torch's own message says "1/2 clients joined", not *which*.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from workers.common.topology import Topology

JOIN_KEY = "slurmrl/joined/{rank}"


class RendezvousError(RuntimeError):
    """The trainer ranks could not form their process group; the message names the peer."""


@dataclasses.dataclass
class ParallelDims:
    rank: int
    world_size: int
    dp: int
    backend: str
    device: torch.device
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self) -> None:
        if self.dp != self.world_size:
            raise ValueError(f"dp({self.dp}) != trainer world size({self.world_size}): only data parallel is implemented")
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank

    # -- setup / teardown -------------------------------------------------------------
    @classmethod
    def init(cls, topology: Topology, *, timeout_s: float) -> "ParallelDims":
        """Rendezvous with the other trainer ranks and create the process group.

        ``timeout_s`` bounds the rendezvous and every later collective (a rank that died
        mid-step turns into an error on its peers within that time, not a hang).
        """
        cuda = torch.cuda.is_available()
        backend = "nccl" if cuda else "gloo"
        device = torch.device("cuda", topology.rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        store = _rendezvous(topology, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=store, rank=topology.rank, world_size=topology.world_size, timeout=timeout)
        return cls(rank=topology.rank, world_size=topology.world_size, dp=topology.world_size, backend=backend,
                   device=device, group=dist.group.WORLD)

    def destroy(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None

    # -- collectives (no-ops without a group, so unit code can run on a bare object) ---
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``sum`` or ``max``) over the dp group; returns ``tensor``."""
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.group is not None and self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum gradients over dp ranks in one flat bucket (the tiny model fits one easily).

        Parameters no rank used (an expert nobody routed to) get zero gradients, as DDP
        does, so every rank steps the same parameter set and replicas never diverge. The
        loss is already normalised by GLOBAL token counts, so SUM (not mean) is right.
        """
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def _rendezvous(topology: Topology, timeout_s: float) -> dist.Store:
    addr, port, rank, world = topology.master_addr, topology.master_port, topology.rank, topology.world_size
    where = f"tcp://{addr}:{port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(addr, port, None, rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, dist.DistError) as e:
        if rank == 0:
            raise RendezvousError(f"trainer rank 0 cannot listen on {where} (MASTER_ADDR/MASTER_PORT) for the trainer "
                                  f"rendezvous: {_first_line(e)}. Is the port taken by another run?") from e
        raise RendezvousError(f"trainer rank {rank} could not reach trainer rank 0 at {where} within {timeout_s:.0f}s: "
                              f"is trainer rank 0 running? see its log ({_first_line(e)})") from e
    store.set(JOIN_KEY.format(rank=rank), str(time.time()))
    if rank == 0:
        keys = [JOIN_KEY.format(rank=r) for r in range(world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise RendezvousError(f"trainer ranks {missing} of world {world} did not join the rendezvous at {where} "
                                      f"within {timeout_s:.0f}s: did they start? see their logs")
            time.sleep(0.05)
    return store


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
