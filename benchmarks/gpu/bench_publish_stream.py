"""Publishing weights on one GPU: the streamed path (workers/trainer/weight_stream.py) against the old
full-state-dict path, on the loop's own model (FSDP plan, world 1, meta-device init).

    PYTHONPATH=$PWD python3 benchmarks/gpu/bench_publish_stream.py [--tiny] [--dir /dev/shm/x] [--out DIR]

Rows (each publishes weights step 1 through the filesystem transport into its own directory):
  stream     ``ModelWeights``: each full tensor gathered, cast to bf16, copied to the host and written
             as the publisher reaches it (what the trainer now runs);
  full_dict  ``full_state_dict(to_rank=None, dtype=bf16)`` first, then the same publisher (the old path).
Per row: seconds, GB/s, and on CUDA the peak device memory the publish added above the trained model
(``max_memory_allocated`` minus what was allocated before): stream ~ one tensor, full_dict ~ the
whole bf16 model. The two directories must be byte-identical (index, shards). Also the step-0 build:
host peak RSS and device memory after ``step0_model`` (meta device, filled tensor by tensor).
Writes publish_stream.json under --out. ``--tiny`` runs on the CPU in seconds (a smoke test).
"""
from __future__ import annotations

import argparse
import dataclasses
import filecmp
import json
import os
import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

import benchmarks.gpu.bench_trainer_step as b
from workers.trainer.loop import step0_model
from workers.trainer.weight_stream import ModelWeights
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.base import SoloPeers


def device_peak(fn, device: torch.device) -> tuple[float, int]:
    """(seconds fn took, device bytes it added at its peak; 0 off CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - base) if cuda else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE on the CPU (smoke test)")
    ap.add_argument("--dir", default="/dev/shm/slurmrl_publish_bench", help="scratch weights root (deleted)")
    ap.add_argument("--out", default="benchmarks/out/gpu/", help="directory for publish_stream.json")
    args = ap.parse_args()
    dims = b.world_of_one()
    cfg = b.run_config(argparse.Namespace(tiny=args.tiny, dtype="bfloat16", micro_batch_tokens=0, lr=1e-5),
                       replay=False, ac="none")
    t0 = time.perf_counter()
    model = step0_model(cfg, dims)
    init = {"seconds": time.perf_counter() - t0, "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            * 1024, "device_allocated_bytes": torch.cuda.memory_allocated() if dims.device.type == "cuda" else 0}
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    rows = []
    compute = torch.bfloat16
    for name in ("stream", "full_dict"):
        pub = FilesystemPublisher(root / name, peers=SoloPeers(), keep_last=2)
        if name == "stream":
            job = lambda: pub.publish(1, ModelWeights(model, dtype=compute))  # noqa: E731
        else:
            job = lambda: pub.publish(1, model.full_state_dict(to_rank=None, dtype=compute))  # noqa: E731
        seconds, added = device_peak(job, dims.device)
        pub.close()
        nbytes = ModelWeights(model, dtype=compute).nbytes
        rows.append({"row": name, "seconds": seconds, "gb_s": nbytes / seconds / 1e9, "weight_bytes": nbytes,
                     "device_peak_added_bytes": added})
        print(json.dumps(rows[-1]), flush=True)
    a, c = root / "stream" / "step_000001", root / "full_dict" / "step_000001"
    same = all(filecmp.cmp(a / f.name, c / f.name, shallow=False) for f in a.iterdir() if f.name != "STABLE")
    largest = max(m.nbytes for m in ModelWeights(model, dtype=compute).metas)
    print(json.dumps({"identical_dirs": same, "largest_tensor_bytes": largest, "init": init}), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "publish_stream.json" if not args.tiny else "publish_stream_tiny.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "config": dataclasses.asdict(cfg.model), "init": init,
                   "largest_tensor_bytes": largest, "identical_dirs": same, "rows": rows}, fh, indent=1)
    dist.destroy_process_group()
    assert same, "the streamed and the full-dict publish wrote different files"


if __name__ == "__main__":
    main()
