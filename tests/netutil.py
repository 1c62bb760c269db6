"""Small helpers shared by tests that start real servers and process groups."""
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out on ``host`` (free now; tests bind it right away)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gloo_dims(rank: int, world: int, port: int, *, tp: int = 1, ep: int = 1, cp: int = 1):
    """Join a real gloo group of ``world`` processes on ``port`` and return the trainer's
    ParallelDims over it (dp = world / (tp * ep * cp)); the caller destroys the process group."""
    import torch
    import torch.distributed as dist

    from workers.trainer.parallel import ParallelDims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dims = ParallelDims(rank=rank, world_size=world, dp=world // (tp * ep * cp), tp=tp, ep=ep, cp=cp, backend="gloo",
                        device=torch.device("cpu"), group=dist.group.WORLD)
    dims.groups = dims.new_groups()
    return dims


def run_ranks(worker, world: int, args: tuple, *, what: str, timeout_s: float = 180.0) -> None:
    """Run ``worker(rank, world, port, *args)`` in ``world`` forked processes (a free port for their
    gloo group) and wait, with a deadline that names ``what``; a rank's exception fails the call."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{what} ({world} ranks) did not finish in {timeout_s}s")
