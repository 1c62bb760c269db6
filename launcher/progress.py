"""One progress line per trainer step, read from run_dir/metrics.jsonl as it grows."""
from __future__ import annotations

import json
import os
from typing import Optional

from workers.common.logs import step_label
from workers.common.protocol import RunPaths


def format_step(rec: dict, num_steps: int) -> str:
    def g(key, fmt, default="-"):
        v = rec.get(key)
        return default if v is None else format(v, fmt)

    evals = f" | eval {g('eval/reward', '.3f')}" if "eval/reward" in rec else ""
    return (f"{step_label(rec['step'], num_steps)} | reward {g('reward_mean', '.3f')}{evals} | "
            f"staleness max {g('max_staleness', 'd')} | dropped {g('samples_dropped_stale', 'd')} | "
            f"kl {g('mismatch_kl', '.1e')} | {g('tokens_per_s', '.0f')} tok/s train, "
            f"{g('inference_tokens_per_s', '.0f')} tok/s infer | idle {g('trainer_idle_frac', '.0%')} | "
            f"{g('step_time_s', '.2f')} s")


class ProgressPrinter:
    def __init__(self, paths: RunPaths, num_steps: int):
        self.paths, self.num_steps = paths, num_steps
        self.offset = 0
        self.records: list[dict] = []
        self.inode: Optional[int] = None  # metrics.jsonl is replaced (not appended) when a trainer resumes
        self.rewound = False

    def poll(self) -> None:
        try:
            with open(self.paths.metrics, "r") as fh:
                inode = os.fstat(fh.fileno()).st_ino
                if self.inode is not None and inode != self.inode:  # a resumed trainer rewound the file
                    self.offset, self.records = 0, []
                    self.rewound = True
                self.inode = inode
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind("\n") + 1]  # never parse a half-written line
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            if line.strip():
                rec = json.loads(line)
                self.records.append(rec)
                if not self.rewound:  # records kept by a rewind were printed before
                    print(format_step(rec, self.num_steps), flush=True)
        if self.rewound:
            self.rewound = False
            print(f"[slurmrl] trainer resumed from a checkpoint: metrics continue after step "
                  f"{len(self.records)}", flush=True)

    def summary(self) -> str:
        r = [x["reward_mean"] for x in self.records if "reward_mean" in x]
        if len(r) < 2:
            return f"{len(self.records)} steps recorded"
        k = min(5, len(r))
        return (f"{len(r)} steps: reward first{k} {sum(r[:k]) / k:.3f} -> last{k} {sum(r[-k:]) / k:.3f}, "
                f"max staleness {max(x.get('max_staleness', 0) for x in self.records)}")
