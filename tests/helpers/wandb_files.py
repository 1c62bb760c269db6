"""Read back what the real wandb package wrote offline: the ``run-<id>.wandb`` transaction log of an
``offline-run-*`` directory (wandb's record framing: a 7-byte ``:W&B`` header, then 32 KiB blocks of
records, each ``crc32c (4) | length (2, LE) | kind (1: full, 2: first, 3: middle, 4: last)``, whose
payloads are ``wandb_internal_pb2.Record`` protobufs). wandb's own Python reader left the package
when its core moved to Go, so the tests parse the framing here and the records with wandb's protos."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def payloads(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:4]!r})")
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's trailer is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + HEADER])
        if kind == 0:  # zeros at the end of a block or of the file
            pos += left
            continue
        payload = data[pos + HEADER: pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            out.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            out.append(pending + payload)
            pending = b""
    return out


def read_run(run_dir: Path) -> dict:
    """{"run": the run record, "history": [{key: value}], "config": {key: value}} of one offline run dir."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = Path(run_dir).glob("run-*.wandb")
    out: dict = {"run": None, "history": [], "config": {}}
    for raw in payloads(log):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = rec.run
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
    return out
