"""Parallel dimensions of the trainer (TP x CP x EP x DP) and the process groups that realise them.

Rank layout, TP innermost (TP traffic is per layer and latency bound: keep it on NVLink),
then CP (context parallel: two all-to-alls per attention/Mamba layer, also NVLink-bound), then
EP, then DP::

    rank = ((dp_rank * ep + ep_rank) * cp + cp_rank) * tp + tp_rank      world = tp * cp * ep * dp

Under the FSDP plan (tp = ep = 1) that is ``rank = dp_rank * cp + cp_rank``: a dp x cp mesh whose
cp ranks hold the same rows (each a contiguous chunk of every sequence: workers/trainer/
parallel/context.py) and whose FSDP shard group is ALL ranks (the flattened dp x cp mesh, as
torchtitan's dp_shard_cp): every rank's loss is its own tokens' share of the global loss, so the
gradient reduce-scatter sums the cp ranks' contributions like the dp ranks'. The mesh plan
(tp or ep > 1) keeps the same rank order on its DeviceMesh ``(ep, dp_shard, cp, tp)``.

Groups (each rank belongs to one of every kind; size-1 groups are None, collectives on
them are no-ops, so tp = ep = 1 runs the same code without communication):
  ``tp``     same (dp, ep, cp): holds one copy of the data, splits the matmuls;
  ``cp``     same (dp, ep, tp): the same rows, each rank a chunk of every sequence; all-to-all;
  ``ep``     same (dp, cp, tp): different rows of the batch, disjoint experts; all-to-all;
  ``dp``     same (ep, tp): replicas of the same expert shard (and their cp ranks): expert
             gradients sum here;
  ``batch``  same tp (all ep x dp x cp): every rank with distinct TOKENS: dense gradients, token
             counts and loss statistics sum here (TP ranks hold duplicates and must not);
  ``mp``     same (dp, cp) (all tp x ep): the shards of one full model: the global grad norm.

Rendezvous protocol (trainer rank 0 <-> ranks 1..N-1), every wait has a deadline:
  1. rank 0 opens a TCPStore on ``master_addr:master_port`` (topology);
  2. every rank connects and sets ``slurmrl/joined/<rank>``;
  3. rank 0 polls until all N keys exist; on the deadline it raises naming the ranks that
     never joined; a rank that cannot reach rank 0's store raises naming rank 0;
  4. ``init_process_group`` (gloo on CPU, NCCL with CUDA) on that store, then the
     subgroups, created in the same order on every rank (``new_group`` is collective).
The explicit store (rather than ``init_method="tcp://..."``, which it is equivalent to)
exists only for step 3: torch's own message says "1/2 clients joined", not *which*.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from workers.common.topology import Topology

JOIN_KEY = "slurmrl/joined/{rank}"
GROUP_KINDS = ("tp", "cp", "ep", "dp", "batch", "mp")
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


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
    """The whole trainer (barrier); None without a process group."""
    tp: int = 1
    ep: int = 1
    cp: int = 1
    """Context-parallel ranks per sequence (workers/trainer/parallel/context.py)."""
    groups: dict[str, Optional[dist.ProcessGroup]] = dataclasses.field(default_factory=dict)
    """Subgroups by kind (GROUP_KINDS); missing or None: size 1 (or no process group)."""

    def __post_init__(self) -> None:
        for key in ("tp", "ep", "dp", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer {key}({getattr(self, key)}) must be >= 1")
        if self.tp * self.cp * self.ep * self.dp != self.world_size:
            cp = f"cp({self.cp}) * " if self.cp != 1 else ""
            raise ValueError(f"tp({self.tp}) * {cp}ep({self.ep}) * dp({self.dp}) = "
                             f"{self.tp * self.cp * self.ep * self.dp} != trainer world size({self.world_size})")
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)

    # -- coordinates --------------------------------------------------------------------
    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def ep_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.ep)

    @property
    def batch_rank(self) -> int:
        """Which of the ``num_batch_shards`` row shards of a batch this rank trains on (its cp peers too)."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def num_batch_shards(self) -> int:
        return self.dp * self.ep

    def rank_of(self, *, dp_rank: int, ep_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((dp_rank * self.ep + ep_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` as a list of global ranks (all of them, not only this rank's)."""
        coords = list(itertools.product(range(self.dp), range(self.ep), range(self.cp), range(self.tp)))
        key = {"tp": lambda d, e, c, t: (d, e, c), "cp": lambda d, e, c, t: (d, e, t),
               "ep": lambda d, e, c, t: (d, c, t), "dp": lambda d, e, c, t: (e, t),
               "batch": lambda d, e, c, t: (t,), "mp": lambda d, e, c, t: (d, c)}[kind]
        out: dict[tuple, list[int]] = {}
        for d, e, c, t in coords:
            out.setdefault(key(d, e, c, t), []).append(self.rank_of(dp_rank=d, ep_rank=e, tp_rank=t, cp_rank=c))
        return [sorted(v) for _, v in sorted(out.items())]

    def get_group(self, kind: str) -> Optional[dist.ProcessGroup]:
        assert kind in GROUP_KINDS, kind
        return self.groups.get(kind)

    # -- setup / teardown -------------------------------------------------------------
    @classmethod
    def init(cls, topology: Topology, *, timeout_s: float, tp: int = 1, ep: int = 1, cp: int = 1) -> "ParallelDims":
        """Rendezvous with the other trainer ranks and create the process groups.

        ``timeout_s`` bounds the rendezvous and every later collective (a rank that died
        mid-step turns into an error on its peers within that time, not a hang).
        """
        world = topology.world_size
        if world % (tp * ep * cp):
            raise ValueError(f"tp({tp}) * cp({cp}) * ep({ep}) = {tp * ep * cp} does not divide trainer world size({world})")
        cuda = torch.cuda.is_available()
        backend = "nccl" if cuda else "gloo"
        device = torch.device("cuda", topology.rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dims = cls(rank=topology.rank, world_size=world, dp=world // (tp * ep * cp), tp=tp, ep=ep, cp=cp,
                   backend=backend, device=device)
        store = _rendezvous(topology, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=store, rank=topology.rank, world_size=world, timeout=timeout)
        dims.group = dist.group.WORLD
        dims.groups = dims.new_groups(timeout)
        return dims

    def new_groups(self, timeout: Optional[datetime.timedelta] = None) -> dict[str, Optional[dist.ProcessGroup]]:
        """Create every subgroup (collective: all ranks call this, same order); keep this rank's."""
        mine: dict[str, Optional[dist.ProcessGroup]] = {}
        for kind in GROUP_KINDS:
            for ranks in self.group_ranks(kind):
                if len(ranks) == 1:
                    pg = None
                elif len(ranks) == self.world_size:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    mine[kind] = pg
        return mine

    def destroy(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None
        self.groups = {}

    # -- collectives (no-ops without a group, so unit code can run on a bare object) ---
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: str = "batch") -> torch.Tensor:
        """In-place all-reduce (``sum`` or ``max``) over ``group`` (default: every rank holding
        distinct rows, i.e. what a batch statistic sums over); returns ``tensor``."""
        pg = self.get_group(group)
        if pg is not None:
            dist.all_reduce(tensor, op=_OPS[op], group=pg)
        return tensor

    def barrier(self) -> None:
        if self.group is not None and self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter], group: str = "batch") -> None:
        """Sum gradients over ``group`` in one flat bucket (the tiny model fits one easily).

        Parameters no rank used (an expert nobody routed to) get zero gradients, as DDP
        does, so every rank steps the same parameter set and replicas never diverge. The
        loss is already normalised by GLOBAL token counts, so SUM (not mean) is right.
        """
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.get_group(group) is None or not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.all_reduce(flat, group=group)
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
