"""Built-in collective benchmark over torch.distributed, for clusters without nccl-tests.

Measures the same four collectives as nccl-tests, with its conventions, so the numbers and
thresholds mean the same: float32 buffers of ``size`` bytes from min_bytes to max_bytes by
size_factor; all_reduce sums a buffer of S bytes, all_gather gathers S bytes in total (S/n
per rank), alltoall exchanges an S-byte buffer in n chunks, sendrecv sends S bytes to the
next rank of a ring and receives from the previous one. Time per iteration is the slowest
rank's mean over num_iters after num_warmup_iters; busbw uses bandwidth.py's factors. After
timing, each size runs once on known data and counts the elements that differ (#wrong).

NCCL on GPUs (one process per GPU, ``cuda:local_rank``), gloo on CPU: the same code, so CI
runs it. Processes meet through a torch FileStore on the shared run directory (no port to
choose before the job's ports are known); every node spawns its local processes, global
rank = node_rank * nprocs + local_rank. Rank 0 writes the results as JSON.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.common.rank_exit import rank_entry
from workers.preflight.bandwidth import COLLECTIVES, CollectiveResult, Measurement, SizeRow, busbw

ELEMENT = 4  # float32, nccl-tests' default type


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 0 < min_bytes({min_bytes}) <= max_bytes({max_bytes}) and size_factor({factor}) >= 2")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _ops(collective: str, count: int, n: int, rank: int, device: torch.device) -> tuple[Callable, Callable[[], int]]:
    """(op to time, validate() -> wrong elements) for one collective on ``count`` elements."""
    chunk = count // n
    if collective == "all_reduce":
        buf = torch.ones(count, device=device)

        def validate() -> int:
            buf.fill_(rank + 1)
            dist.all_reduce(buf)
            return int((buf != n * (n + 1) / 2).sum())
        return (lambda: dist.all_reduce(buf)), validate
    if collective == "all_gather":
        send = torch.ones(chunk, device=device)
        recv = torch.empty(chunk * n, device=device)
        parts = list(recv.chunk(n))
        gather = ((lambda: dist.all_gather_into_tensor(recv, send)) if device.type == "cuda"
                  else (lambda: dist.all_gather(parts, send)))

        def validate() -> int:
            send.fill_(rank)
            gather()
            want = torch.arange(n, device=device, dtype=recv.dtype).repeat_interleave(chunk)
            return int((recv != want).sum())
        return gather, validate
    if collective == "alltoall":
        send = torch.ones(chunk * n, device=device)
        recv = torch.empty(chunk * n, device=device)

        def validate() -> int:
            send.copy_((rank * n + torch.arange(n, device=device, dtype=send.dtype)).repeat_interleave(chunk))
            dist.all_to_all_single(recv, send)
            want = (torch.arange(n, device=device, dtype=recv.dtype) * n + rank).repeat_interleave(chunk)
            return int((recv != want).sum())
        return (lambda: dist.all_to_all_single(recv, send)), validate
    if collective == "sendrecv":
        send = torch.ones(count, device=device)
        recv = torch.empty(count, device=device)
        nxt, prv = (rank + 1) % n, (rank - 1) % n

        def ring() -> None:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                work.wait()

        def validate() -> int:
            send.fill_(rank)
            ring()
            return int((recv != prv).sum())
        return ring, validate
    raise ValueError(f"unknown collective {collective!r}; choose from {list(COLLECTIVES)}")


def measure(collective: str, sizes: list[int], *, iters: int, warmup: int, device: torch.device) -> CollectiveResult:
    """Run on every rank of the default group; every rank returns the same result."""
    n, rank = dist.get_world_size(), dist.get_rank()
    tool = f"torch-{dist.get_backend()}"
    result = CollectiveResult(collective=collective, tool=tool, num_ranks=n)
    if collective == "sendrecv" and n < 2:
        result.skipped = "needs 2 or more ranks"
        return result
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for size in sizes:
        count = max(n, size // ELEMENT // n * n)  # all_gather/alltoall split evenly into n chunks
        op, validate = _ops(collective, count, n, rank, device)
        for _ in range(warmup):
            op()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        sync()
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        wrong = torch.tensor([validate()], dtype=torch.int64, device=device)
        dist.all_reduce(wrong)
        seconds = float(elapsed.item())
        nbytes = count * ELEMENT
        algbw = nbytes / seconds / 1e9
        result.rows.append(SizeRow(size_bytes=nbytes, count=count, dtype="float",
                                   redop="sum" if collective == "all_reduce" else "none", root=-1,
                                   out_of_place=Measurement(time_us=seconds * 1e6, algbw_gbps=algbw,
                                                            busbw_gbps=busbw(collective, algbw, n),
                                                            wrong=int(wrong.item()))))
    return result


def _worker(local_rank: int, node_rank: int, nprocs: int, num_nodes: int, store: str, out: str, spec: dict) -> None:
    rank, world = node_rank * nprocs + local_rank, num_nodes * nprocs
    use_cuda = spec["device"] == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    try:
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        results = [measure(c, spec["sizes"], iters=spec["iters"], warmup=spec["warmup"], device=device)
                   for c in spec["collectives"]]
        if rank == 0:
            tmp = Path(out).with_suffix(".tmp")
            tmp.write_text(json.dumps({"results": [r.to_dict() for r in results]}, indent=1) + "\n")
            tmp.replace(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_node(*, node_rank: int, num_nodes: int, nprocs: int, store: str, out: str, collectives: list[str],
             sizes: list[int], iters: int, warmup: int, device: str, timeout_s: float) -> None:
    """Spawn this node's ``nprocs`` ranks and wait for them (raises if one fails)."""
    spec = dict(collectives=collectives, sizes=sizes, iters=iters, warmup=warmup, device=device, timeout_s=timeout_s)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_entry, args=(_worker, node_rank, nprocs, num_nodes, store, out, spec), nprocs=nprocs,
                       start_method="spawn", join=True)


def read_results(path: Path) -> list[CollectiveResult]:
    return [CollectiveResult.from_dict(r) for r in json.loads(Path(path).read_text())["results"]]
