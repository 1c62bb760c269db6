"""Weight sync on GPU: the filesystem transport against the raw bandwidths under it (issue 11, item 4).

Measured in one run, on the GPU model's bf16 state dict:
- staging: device->host as ``publish_step`` does it (``.cpu()`` per tensor, pageable) vs into a
  pinned buffer, and host->device as ``update_weights_from_disk`` does it (``param.copy_`` from
  pageable tensors) vs from pinned memory; plus one plain pinned copy of the same byte count
  each way (the PCIe ceiling) and a device-to-device copy (HBM ceiling);
- xxh64 checksum throughput (publish and load hash every tensor);
- the transport: ``publish_step`` (D2H + hash + safetensors write + fsync + rename) and
  ``load_step`` (read + verify) on the disk under the working tree and on /dev/shm, and the
  embedded engine's whole ``update_weights_from_disk`` (load + copy into the GPU model);
- raw files of the same size: write+fsync and read (after dropping the page cache when the
  kernel lets us; ``read_cache_dropped`` says whether it did).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.gpu.common import free_cuda, init_on_device, presets, sync
from workers.inference.embedded.engine import InferenceEngine
from workers.weights.checksums import tensor_hash
from workers.weights.filesystem.publisher import publish_step
from workers.weights.filesystem.receiver import load_step


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=False, timeout=120)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _df(path: Path) -> str:
    try:
        return subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"df failed: {e}"


def raw_file_bandwidth(root: Path, buf: torch.Tensor) -> dict:
    """Write ``buf`` (host uint8) to one file with fsync, read it back; GB/s each way."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "raw.bin"
    data = buf.numpy()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    dropped = _drop_caches()
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        n = f.readinto(memoryview(torch.empty_like(buf).numpy()))
    read_s = time.perf_counter() - t0
    path.unlink()
    return {"bytes": int(buf.numel()), "write_fsync_gbps": _gbps(buf.numel(), write_s), "read_gbps": _gbps(n, read_s),
            "write_s": write_s, "read_s": read_s, "read_cache_dropped": dropped}


def staging(state: dict[str, torch.Tensor], device: torch.device) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res: dict = {"bytes": nbytes}
    cuda = device.type == "cuda"
    # D2H as publish_step does it.
    cpu_state = {}
    s = _timed(lambda: cpu_state.update({n: t.detach().contiguous().cpu() for n, t in state.items()}), device)
    res["d2h_pageable_per_tensor_gbps"] = _gbps(nbytes, s)
    # D2H into one pinned buffer, per tensor, non-blocking.
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def d2h_pinned():
        off = 0
        for t in state.values():
            b = t.numel() * t.element_size()
            pinned[off: off + b].copy_(t.detach().contiguous().view(-1).view(torch.uint8), non_blocking=True)
            off += b

    d2h_pinned()  # warm
    res["d2h_pinned_per_tensor_gbps"] = _gbps(nbytes, _timed(d2h_pinned, device))
    # Plain pinned copies of the same byte count: the link's ceiling.
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_buf.copy_(pinned)
    res["d2h_pinned_plain_gbps"] = _gbps(nbytes, _timed(lambda: pinned.copy_(dev_buf, non_blocking=True), device))
    res["h2d_pinned_plain_gbps"] = _gbps(nbytes, _timed(lambda: dev_buf.copy_(pinned, non_blocking=True), device))
    # H2D as update_weights_from_disk does it: param.copy_(pageable tensor).
    s = _timed(lambda: [state[n].copy_(cpu_state[n]) for n in state], device)
    res["h2d_pageable_per_tensor_gbps"] = _gbps(nbytes, s)

    def h2d_pinned():
        off = 0
        for t in state.values():
            b = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(pinned[off: off + b], non_blocking=True)
            off += b

    res["h2d_pinned_per_tensor_gbps"] = _gbps(nbytes, _timed(h2d_pinned, device))
    if cuda:
        other = torch.empty_like(dev_buf)
        s = _timed(lambda: other.copy_(dev_buf), device)
        res["d2d_copy_gbps_read_plus_write"] = 2 * _gbps(nbytes, s)
        del other
    # Checksums: both ends hash every tensor (xxh64, one core).
    s = time.perf_counter()
    for t in cpu_state.values():
        tensor_hash(t)
    res["xxh64_gbps"] = _gbps(nbytes, time.perf_counter() - s)
    del dev_buf
    return res, cpu_state, pinned


def transport(root: Path, state: dict[str, torch.Tensor], engine: InferenceEngine, device) -> dict:
    if root.exists():
        shutil.rmtree(root)
    pub = publish_step(root, 1, state, keep_last=2)
    step_dir = root / "step_000001" if (root / "step_000001").exists() else next(root.glob("step_*"))
    dropped = _drop_caches()
    t0 = time.perf_counter()
    loaded = load_step(step_dir)
    load_s = time.perf_counter() - t0
    nbytes = pub["bytes"]
    del loaded
    dropped_again = _drop_caches()
    t0 = time.perf_counter()
    engine.update_weights_from_disk(str(step_dir), 1)
    sync(device)
    update_s = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": nbytes, "publish_s": pub["seconds"], "publish_gbps": _gbps(nbytes, pub["seconds"]),
            "load_step_s": load_s, "load_step_gbps": _gbps(nbytes, load_s), "load_cache_dropped": dropped,
            "engine_update_s": update_s, "engine_update_cache_dropped": dropped_again, "engine_update_gbps": _gbps(nbytes, update_s)}


def run(args: argparse.Namespace, device: torch.device) -> dict:
    moe, _ = presets(args.tiny)
    model = init_on_device(moe, device, torch.bfloat16, seed=0)
    state = dict(model.state_dict())
    engine_model = init_on_device(moe, device, torch.bfloat16, seed=1)
    engine = InferenceEngine(engine_model, max_batch_size=8, seed=0)  # not started: loads happen inline
    res, cpu_state, pinned = staging(state, device)
    print(f"  staging: d2h pageable {res['d2h_pageable_per_tensor_gbps']:.1f} GB/s, pinned "
          f"{res['d2h_pinned_per_tensor_gbps']:.1f} (plain {res['d2h_pinned_plain_gbps']:.1f}); h2d pageable "
          f"{res['h2d_pageable_per_tensor_gbps']:.1f}, pinned {res['h2d_pinned_per_tensor_gbps']:.1f} "
          f"(plain {res['h2d_pinned_plain_gbps']:.1f}); xxh64 {res['xxh64_gbps']:.1f} GB/s", flush=True)
    roots = {"disk": Path(args.scratch) / "wsync", "shm": Path("/dev/shm") / f"slurmrl_wsync_{os.getpid()}"}
    out = {"staging": res, "filesystems": {k: _df(v.parent) for k, v in roots.items()}}
    flat = pinned if pinned.numel() else torch.empty(0, dtype=torch.uint8)
    for name, root in roots.items():
        if name == "shm" and not Path("/dev/shm").is_dir():
            out[name] = {"skipped": "no /dev/shm"}
            continue
        raw = raw_file_bandwidth(root, flat)
        t = transport(root, state, engine, device)
        t["raw"] = raw
        t["publish_vs_raw_write"] = t["publish_gbps"] / raw["write_fsync_gbps"]
        t["load_vs_raw_read"] = t["load_step_gbps"] / raw["read_gbps"]
        out[name] = t
        shutil.rmtree(root, ignore_errors=True)
        print(f"  {name}: publish {t['publish_gbps']:.2f} GB/s (raw write+fsync {raw['write_fsync_gbps']:.2f}), "
              f"load {t['load_step_gbps']:.2f} GB/s (raw read {raw['read_gbps']:.2f}), engine update "
              f"{t['engine_update_s']:.2f}s", flush=True)
    ok = all(torch.equal(engine_model.state_dict()[n], state[n]) for n in state)
    out["engine_weights_equal_after_update"] = ok
    del model, engine_model, engine, state, cpu_state, pinned
    free_cuda()
    return out
