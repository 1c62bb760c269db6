"""Records of a user's dataset (env=dataset): reading, checking, splitting, and a resumable order.

Formats (``env.path``):
  * ``.jsonl``: one JSON object per line (blank lines skipped);
  * ``.parquet``: read with pyarrow, only when it is installed (``pip install pyarrow``);
  * a directory: every ``.jsonl`` / ``.parquet`` file in it, in name order (shards).

Every record remembers where it came from (``file``, ``line``: 1-based line of a jsonl file,
1-based row of a parquet file), so a bad row is reported as ``train.jsonl line 7``.

Order (:class:`DataOrder`): epoch ``e`` visits every record once in a permutation seeded by
``(seed, e)``; the position is ``(epoch, index)``. It is a pure function of the number of
records drawn, which is what makes a restarted orchestrator resume exactly: it replays the
draws the ledger counts (workers/orchestrator/loop.py ``resume_from_ledger``) and lands on the
same position, so no sample is skipped or repeated.

Torch-free and role-free: the launcher calls :func:`load_records` at plan time to refuse a
missing file or a row without a needed key before anything is submitted.
"""
from __future__ import annotations

import dataclasses
import json
import random
import string
from pathlib import Path
from typing import Any, Iterable, Optional

SUFFIXES = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class Record:
    fields: dict
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.file} line {self.line}"


def data_files(path: str, key: str = "env.path") -> list[Path]:
    """The files behind ``path`` (a file or a directory of shards); ValueError naming ``key``."""
    try:
        return _data_files(path, key)
    except OSError as e:  # a directory we may not list, a path we may not reach
        raise ValueError(f"{key}={path!r} cannot be read: {e.strerror or e} (check its permissions for this "
                         f"user, and on a cluster for the job's user)") from None


def _data_files(path: str, key: str) -> list[Path]:
    p = Path(path)
    if not path:
        raise ValueError(f"{key} is required: a .jsonl or .parquet file, or a directory of them")
    if not p.is_absolute():
        raise ValueError(f"{key}={path!r} must be an absolute path (the orchestrator does not run in this "
                         f"directory); did you mean {str(p.resolve())!r}?")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ValueError(f"{key}={path!r} is a directory without .jsonl or .parquet files")
        return files
    if not p.exists():
        raise ValueError(f"{key}={path!r} does not exist")
    if p.suffix not in SUFFIXES:
        raise ValueError(f"{key}={path!r}: unsupported file type {p.suffix!r}; use one of {list(SUFFIXES)}")
    return [p]


def _read_jsonl(f: Path) -> Iterable[Record]:
    with open(f, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f} line {n} is not valid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{f} line {n} is a JSON {type(obj).__name__}, not an object")
            yield Record(obj, str(f), n)


def _read_parquet(f: Path) -> Iterable[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{f} is a parquet file but pyarrow is not installed; install it with: pip install pyarrow "
                         f"(or convert the data to .jsonl)") from None
    for n, row in enumerate(pq.read_table(str(f)).to_pylist(), start=1):
        yield Record(row, str(f), n)


def load_records(path: str, *, key: str = "env.path") -> list[Record]:
    """Every record under ``path``; ValueError for a missing/empty/unreadable source."""
    records: list[Record] = []
    for f in data_files(path, key):
        try:
            records.extend(_read_parquet(f) if f.suffix == ".parquet" else _read_jsonl(f))
        except OSError as e:  # unreadable for this user, a directory named like a data file
            raise ValueError(f"{key}={path!r}: {f} cannot be read: {e.strerror or e} (check its permissions for "
                             f"this user, and on a cluster for the job's user)") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{key}={path!r}: {f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not records:
        raise ValueError(f"{key}={path!r} holds no records")
    return records


def template_fields(template: str) -> list[str]:
    """The record fields a ``str.format`` template names (``"Q: {question}"`` -> ["question"])."""
    try:
        return [name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as e:
        raise ValueError(f"env.prompt_template={template!r} is not a valid format string: {e}") from None


def check_keys(records: list[Record], needed: dict[str, str]) -> None:
    """Every record has every needed field; ``needed`` maps field -> the config key that asks for it."""
    for r in records:
        for field, key in needed.items():
            if field not in r.fields:
                raise ValueError(f"{r.where} has no field {field!r} ({key}); its fields: {sorted(r.fields)}")


def prompt_text(record: Record, *, prompt_key: str, template: str) -> str:
    """The user message of ``record``: the template filled with its fields, else its ``prompt_key``."""
    if template:
        return template.format(**record.fields)
    return str(record.fields[prompt_key])


def split(records: list[Record], *, fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, eval): ``fraction`` of the records held out, chosen by ``seed`` (same every run)."""
    if fraction <= 0:
        return records, []
    n_eval = max(1, round(len(records) * fraction))
    if n_eval >= len(records):
        raise ValueError(f"env.eval_fraction({fraction}) leaves no training records out of {len(records)}")
    held = set(random.Random(f"eval-split:{seed}").sample(range(len(records)), n_eval))
    return ([r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held])


class DataOrder:
    """Seeded shuffled epochs over ``n`` records; ``num_epochs`` 0 = forever.

    ``next()`` returns (epoch, index, record number). Past the last epoch it goes on with the
    next one and counts those draws in ``draws_over`` (a few extra groups replace stale-dropped
    ones; the plan already refused a run whose batches need more than num_epochs epochs).
    """

    def __init__(self, n: int, *, seed: int, shuffle: bool = True, num_epochs: int = 0):
        assert n > 0
        self.n, self.seed, self.shuffle, self.num_epochs = n, seed, shuffle, num_epochs
        self.epoch, self.index = 0, 0
        self.drawn = 0
        self._perm: Optional[list[int]] = None

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(f"data-order:{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[int, int, int]:
        if self._perm is None:
            self._perm = self._order(self.epoch)
        pos = (self.epoch, self.index, self._perm[self.index])
        self.index += 1
        self.drawn += 1
        if self.index == self.n:
            self.epoch, self.index, self._perm = self.epoch + 1, 0, None
        return pos

    @property
    def draws_over(self) -> int:
        return max(0, self.drawn - self.n * self.num_epochs) if self.num_epochs else 0

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "drawn": self.drawn}
