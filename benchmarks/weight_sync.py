"""``python -m benchmarks.weight_sync``: both weight transports against raw baselines, same run.

For model-shaped states (bf16 matrices, fp32 norms, ~260 tensors of varied sizes: embed,
head, attention, router and 8 experts per layer) of ~100 MB and ~1 GB:

- filesystem: ``FilesystemPublisher.publish`` (shards + per-tensor xxh3 + index + STABLE +
  fsyncs + renames) then ``DiskReader.load`` (read + verify every checksum into the staging
  buffer), vs raw: one ``os.write`` of the same bytes + fsync, then ``readinto`` a
  preallocated buffer. On /dev/shm (tmpfs: what the page cache can do) and on a temp dir
  of the local disk; there, both the raw file and the shards are evicted from the page
  cache after fsync (posix_fadvise DONTNEED), so reads come from the disk, as a reader on
  another node would read from Lustre.
- broadcast: 1 trainer sender and 2 inference receivers as processes on gloo: the sender's
  ``BucketSender.send`` (pack, checksum, header, data per bucket) until every receiver's
  ``BroadcastReceiver.receive`` has verified every bucket, vs raw: ``dist.broadcast`` of
  one flat uint8 tensor of the same size in the same world.
- sglang: the same processes and bytes through SGLang's own protocol (:class:`SGLangBench`):
  rank 0 runs the trainer's ``SGLangSender``, the receivers SGLang 0.5.23's receive path as the
  fake server's ranks mirror it (``receive_like_sglang``: one flattened uint8 bucket per call),
  in a group made the way SGLang makes it; interleaved with the other two. The table shows its
  GB/s and, in the summary, its ratio to the bucket protocol. Not timed: SGLang's one HTTP call
  per batch (a few ms each).

Applying into a model (a copy per tensor) is not timed for either transport. Each number
is the best of ``--reps`` runs, raw and transport interleaved (the table also shows the
ratio of medians); ``serial_hash_s`` is what hashing the whole state on one thread costs,
to show it is not what makes it slow. Prints a table, writes
benchmarks/results/weight_sync.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.local_ranks import exit_rank
from benchmarks.sglang_receive import receive_like_sglang
from workers.common.ports import free_port
from workers.weights.base import SoloPeers, TensorMeta, assign_shares
from workers.weights.broadcast.publisher import BucketSender, join_as_sender
from workers.weights.broadcast.receiver import BroadcastReceiver
from workers.weights.sglang.broadcast_publisher import SGLangSender
from workers.weights.sglang.wire import open_update_group, plan_batches
from workers.weights.checksums import state_hashes, tensor_hash
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.stream import DictStream
from workers.weights.filesystem.receiver import DiskReader
from benchmarks.record import results_dir

RESULTS = results_dir()
SIZES_MB = (100, 1024)
RAW_CHUNK = 64 << 20  # the raw baseline's syscall size (dd bs=64M); ours is shards.CHUNK (4 MiB)
SGLANG_FORMAT = "flattened_bucket"


def model_shapes(target_bytes: int, *, vocab: int = 32000, layers: int = 8, experts: int = 8) -> list:
    """(name, shape, dtype) of an MoE decoder whose bf16 matrices total about ``target_bytes``."""
    # params ~= 2*V*H + L*(4 + 3E + E/H... )H^2: solve (4 + 3E) L H^2 + 2 V H = target / 2 for H.
    a, b, c = (4 + 3 * experts) * layers, 2 * vocab, -target_bytes / 2
    h = -int(-(-b + (b * b - 4 * a * c) ** 0.5) / (2 * a) // 64) * 64  # rounded up: at least the target
    out = [("model.embed_tokens.weight", (vocab, h), torch.bfloat16)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), torch.float32), (p + "post_attention_layernorm.weight", (h,),
                                                                        torch.float32)]
        out += [(p + f"self_attn.{x}_proj.weight", (h, h), torch.bfloat16) for x in "qkvo"]
        out.append((p + "mlp.gate.weight", (experts, h), torch.bfloat16))
        for e in range(experts):
            out += [(p + f"mlp.experts.{e}.{x}_proj.weight", (h, h), torch.bfloat16) for x in ("gate", "up", "down")]
    return out + [("model.norm.weight", (h,), torch.float32), ("lm_head.weight", (vocab, h), torch.bfloat16)]


def make_state(target_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.empty(s, dtype=d).normal_(0, 0.02, generator=g) for n, s, d in model_shapes(target_bytes)}


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache (no-op on tmpfs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write_read(path: Path, src: torch.Tensor, dst: torch.Tensor, cold: bool) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    view = memoryview(src.numpy())
    while len(view):  # one 1 GiB write is ~6x slower here than 64 MiB ones
        view = view[os.write(fd, view[:RAW_CHUNK]):]
    os.fsync(fd)
    os.close(fd)
    if cold:
        evict(path)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(dst.numpy())
        while len(view):
            view = view[f.readinto(view[:RAW_CHUNK]):]
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def bench_fs(state, where: Path, reps: int, threads: int) -> dict:
    cold = not str(where).startswith("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="weight_sync_", dir=where))
    total = nbytes(state)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    dst = torch.ones(total, dtype=torch.uint8)  # preallocated and touched: the raw read's best case
    pub = FilesystemPublisher(root / "weights", peers=SoloPeers(), keep_last=2)
    reader = DiskReader(num_threads=threads)
    raw, fs, pub_s, load_s = [], [], [], []
    try:
        for v in range(reps + 1):  # the first round warms allocators and the staging buffer
            pub.wait_pruned()  # the background retention pass must not slow the raw baseline
            r = raw_write_read(root / "raw.bin", flat, dst, cold)
            t0 = time.perf_counter()
            pub.publish(v, state)
            t1 = time.perf_counter()
            step = root / "weights" / f"step_{v:06d}"
            if cold:
                for f in step.iterdir():
                    evict(f)
            t2 = time.perf_counter()
            loaded = reader.load(step)
            t3 = time.perf_counter()
            if v:
                raw.append(r), fs.append(t1 - t0 + t3 - t2), pub_s.append(t1 - t0), load_s.append(t3 - t2)
        exact = state_hashes(loaded.state) == state_hashes(state)
    finally:
        pub.close(), reader.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"where": str(where), "cold_reads": cold, "raw_s": raw, "transport_s": fs, "publish_s": pub_s,
            "load_s": load_s, "bit_exact": exact}


def _bcast_main(rank: int, world: int, port: int, target: int, reps: int, bucket_mb: int, lone_mb, out,
                sglang_port: int) -> None:
    """A broadcast rank's process: the rank, its result flushed through the queue, then exit_rank
    (no interpreter teardown: workers/common/rank_exit.py says why)."""
    _bcast_rank(rank, world, port, target, reps, bucket_mb, lone_mb, out, sglang_port)
    out.close()
    out.join_thread()
    exit_rank(0)


def _bcast_rank(rank: int, world: int, port: int, target: int, reps: int, bucket_mb: int, lone_mb, out,
                sglang_port: int) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("raw", store), rank=rank, world_size=world, timeout=timeout)
    shapes = model_shapes(target)
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in shapes)
    state = make_state(target) if rank == 0 else None
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()]) if rank == 0 else torch.ones(
        total, dtype=torch.uint8)
    if rank == 0:
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        group = join_as_sender(store, rank=0, num_senders=1, world_size=world, share=assign_shares(metas, 1)[0],
                               group_name="bench", backend="gloo", device=torch.device("cpu"), timeout_s=300,
                               bucket_bytes=bucket_mb << 20, where=f"127.0.0.1:{port}",
                               lone_bytes=None if lone_mb is None else int(lone_mb * (1 << 20)))
        sender = BucketSender(group)
        store.set("bench/hashes", json.dumps(state_hashes(state)))
    else:
        receiver = BroadcastReceiver(master_address="127.0.0.1", master_port=port, rank=rank, world_size=world,
                                     group_name="bench", backend="gloo", timeout_s=300)
    sglang = SGLangBench(rank, world, sglang_port, shapes, bucket_mb)
    raw, tr, sg = [], [], []
    for v in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(flat, 0)
        dist.barrier()
        t1 = time.perf_counter()
        if rank == 0:
            sender.send(v, DictStream(state))
        else:
            got, _, _ = receiver.receive(v)
        dist.barrier()
        t2 = time.perf_counter()
        got_sglang = sglang.run(state)
        dist.barrier()
        t3 = time.perf_counter()
        if v:
            raw.append(t1 - t0), tr.append(t2 - t1), sg.append(t3 - t2)
    exact = exact_sglang = True
    if rank:
        want = json.loads(store.get("bench/hashes"))
        exact, exact_sglang = state_hashes(got) == want, state_hashes(got_sglang) == want
    out.put({"rank": rank, "raw_s": raw, "transport_s": tr, "sglang_s": sg, "bit_exact": exact,
             "sglang_bit_exact": exact_sglang, "buckets": len(sender.mine) if rank == 0 else None,
             "sglang_batches": len(sglang.batches)})
    dist.barrier()
    dist.destroy_process_group()


def bench_broadcast(target: int, reps: int, bucket_mb: int, lone_mb=None, receivers: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    out, port, sglang_port, world = ctx.Queue(), free_port(), free_port(), 1 + receivers
    procs = [ctx.Process(target=_bcast_main, args=(r, world, port, target, reps, bucket_mb, lone_mb, out, sglang_port))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    results.sort(key=lambda r: r["rank"])
    common = {"world": world, "senders": 1, "receivers": receivers, "bucket_mb": bucket_mb, "raw_s": results[0]["raw_s"]}
    bucket = dict(common, lone_mb=lone_mb, buckets=results[0]["buckets"], transport_s=results[0]["transport_s"],
                  bit_exact=all(r["bit_exact"] for r in results))
    sglang = dict(common, format=SGLANG_FORMAT, buckets=results[0]["sglang_batches"],
                  transport_s=results[0]["sglang_s"], bit_exact=all(r["sglang_bit_exact"] for r in results))
    return {"bucket": bucket, "sglang": sglang}


class SGLangBench:
    """One rank of the SGLang group: rank 0 sends, the others receive every batch."""

    def __init__(self, rank: int, world: int, port: int, shapes: list, bucket_mb: int, fmt: str = SGLANG_FORMAT):
        self.rank, self.fmt = rank, fmt
        metas = [TensorMeta(n, str(d).replace("torch.", ""), tuple(s),
                            torch.Size(s).numel() * torch.empty((), dtype=d).element_size()) for n, s, d in shapes]
        self.batches = plan_batches(metas, bucket_mb << 20)
        self.pg = open_update_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=world,
                                    rank=rank, group_name="bench_sglang", timeout_s=300)
        self.sender = SGLangSender(self.pg, self.batches, load_format=fmt, device=torch.device("cpu"),
                                   timeout_s=300) if rank == 0 else None

    def run(self, state) -> dict:
        """Rank 0: send ``state``; others: receive it (returned {name: tensor} for the exactness check)."""
        if self.rank == 0:
            self.sender.send(DictStream(state), set(), 0)
            return {}
        got = {}
        for b in self.batches:
            body = b.body(group_name="bench_sglang", load_format=self.fmt)
            got.update(receive_like_sglang(self.pg, body["names"], body["dtypes"], body["shapes"], body["load_format"]))
        return got


def summarize(row: dict, total: int) -> dict:
    """Best of the runs for each side (the 2 cores here are shared: interference only ever
    adds time, to either side), plus the medians for reference."""
    raw, tr = min(row["raw_s"]), min(row["transport_s"])
    med_raw, med_tr = statistics.median(row["raw_s"]), statistics.median(row["transport_s"])
    return dict(row, bytes=total, raw_best_s=raw, transport_best_s=tr, raw_gbps=total / raw / 1e9,
                transport_gbps=total / tr / 1e9, ratio=raw / tr, raw_median_s=med_raw, transport_median_s=med_tr,
                ratio_of_medians=med_raw / med_tr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="hash threads (weights.num_hash_threads)")
    ap.add_argument("--bucket-mb", type=int, default=64, help="weights.bucket_size_mb")
    ap.add_argument("--lone-mb", type=float, default=16, help="weights.lone_tensor_mb")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="a directory on a real disk")
    ap.add_argument("--out", default=str(RESULTS / "weight_sync.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    rows = []
    for mb in args.sizes_mb:
        state = make_state(mb << 20)
        total = nbytes(state)
        t0 = time.perf_counter()
        for t in state.values():
            tensor_hash(t)
        serial_hash_s = time.perf_counter() - t0
        base = {"size_mb": mb, "num_tensors": len(state), "serial_hash_s": serial_hash_s}
        for where in ("/dev/shm", args.disk_dir):
            rows.append(summarize({"transport": "filesystem", **base, **bench_fs(state, Path(where), args.reps,
                                                                                   args.threads)}, total))
        del state
        both = bench_broadcast(mb << 20, args.reps, args.bucket_mb, args.lone_mb)
        rows.append(summarize({"transport": "broadcast", **base, **both["bucket"]}, total))
        rows.append(summarize({"transport": "sglang", **base, **both["sglang"]}, total))
    print(f"\n{'transport':10} {'MB':>6} {'tensors':>7} {'where':22} {'raw s':>7} {'raw GB/s':>8} {'ours s':>7} "
          f"{'GB/s':>6} {'ratio':>6} {'med.ratio':>9} {'hash1t s':>8} exact")
    for r in rows:
        where = r["where"] if r["transport"] == "filesystem" else f"gloo 1 -> {r['receivers']}, {r['buckets']} " + (
            "buckets" if r["transport"] == "broadcast" else "calls")
        print(f"{r['transport']:10} {r['bytes'] / 1e6:6.0f} {r['num_tensors']:7} {where:22} {r['raw_best_s']:7.3f} "
              f"{r['raw_gbps']:8.2f} {r['transport_best_s']:7.3f} {r['transport_gbps']:6.2f} {r['ratio']:6.2f} "
              f"{r['ratio_of_medians']:9.2f} {r['serial_hash_s']:8.3f} {r['bit_exact']}")
    big = max(args.sizes_mb)
    pick = lambda t, shm, key="ratio": [r[key] for r in rows if r["transport"] == t and r["size_mb"] == big  # noqa: E731
                                        and (t != "filesystem" or r["where"].startswith("/dev/shm") == shm)][0]
    summary = {"size_mb": big, "fs_vs_raw": pick("filesystem", True), "fs_vs_raw_disk": pick("filesystem", False),
               "broadcast_vs_raw": pick("broadcast", True), "sglang_vs_raw": pick("sglang", True),
               "sglang_gbps": pick("sglang", True, "transport_gbps"), "bucket_gbps": pick("broadcast", True, "transport_gbps"),
               "all_bit_exact": all(r["bit_exact"] for r in rows), "seconds": time.perf_counter() - t_start}
    print(f"\nfs_vs_raw = {summary['fs_vs_raw']:.2f} (/dev/shm), {summary['fs_vs_raw_disk']:.2f} ({args.disk_dir}, "
          f"cold reads); broadcast_vs_raw = {summary['broadcast_vs_raw']:.2f} ({big} MB; target >= 0.8 each); "
          f"took {summary['seconds']:.0f}s")
    summary["sglang_vs_bucket"] = summary["sglang_gbps"] / summary["bucket_gbps"]
    print(f"SGLang protocol {summary['sglang_gbps']:.2f} GB/s vs bucket protocol {summary['bucket_gbps']:.2f} GB/s "
          f"= {summary['sglang_vs_bucket']:.2f}x (same bytes, same processes; sglang_vs_raw = "
          f"{summary['sglang_vs_raw']:.2f})")
    meta = {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
            "machine": platform.machine(), "load_average": os.getloadavg(), "reps": args.reps,
            "hash_threads": args.threads,
            "time": datetime.datetime.now().isoformat(timespec="seconds")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
