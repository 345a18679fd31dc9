"""Tasks from files: JSONL, Parquet, CSV, or a folder written by `datasets.save_to_disk`.

    rows = open_rows("data/train.jsonl")          # len(rows); rows[i] -> dict (one task)
    check_fields(rows, ["question", "answer"])     # DatasetError naming file, row and field
    train, held_out = split(len(rows), fraction=0.1, seed=0)   # row indices, disjoint
    order = EpochOrder(train, seed=0)
    order.at(step, k)                              # the k tasks of step `step` (row indices)

Reading: a JSONL file is indexed once (the byte offset of each line: 8 bytes per row) and each
row is parsed when a step asks for it, so a file of millions of rows is never held whole; a
Parquet file is read one row group at a time (the last one kept); a `datasets` folder is
memory-mapped Arrow; a CSV is read once into an Arrow table (columnar, far smaller than Python
dicts; a quoted field may hold a newline, so lines are not rows).

Order: the train rows are dealt in epochs; epoch e is a permutation of them drawn from
(seed, e) alone, and step s takes positions s*k .. s*k+k-1 of the endless sequence of epochs:
every row once per epoch, and a resumed run continues exactly where it stopped (the order is a
function of the seed and the step, nothing else).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from tracetrain.types import UsageError

FORMATS = (".jsonl", ".parquet", ".csv")


class DatasetError(UsageError):
    """A dataset file that cannot be used; the message names the file (and the row and field)."""


class TaskRows:
    """Random access to a dataset's rows as dicts; `name` is the path shown in errors."""

    name: str

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> dict:
        raise NotImplementedError


class JsonlRows(TaskRows):
    """One JSON object per non-empty line; lines indexed by byte offset, parsed on demand."""

    CHUNK = 1 << 24

    def __init__(self, path: Path):
        self.name, self.path = str(path), path
        self._file = path.open("rb")
        self._lock = threading.Lock()
        ends, pos = [], 0
        while chunk := self._file.read(self.CHUNK):  # newlines found by numpy, not a Python loop
            ends.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + pos)
            pos += len(chunk)
        ends = np.concatenate(ends + [np.array([pos], dtype=np.int64)])  # the last line may lack "\n"
        starts = np.concatenate([[0], ends[:-1] + 1])
        self.offsets = starts[ends > starts].astype(np.int64)  # empty lines are no rows
        self.lines = (np.flatnonzero(ends > starts) + 1).astype(np.int64)  # 1-based line numbers

    def __len__(self) -> int:
        return len(self.offsets)

    def line(self, i: int) -> bytes:
        with self._lock:
            self._file.seek(int(self.offsets[i]))
            return self._file.readline()

    def __getitem__(self, i: int) -> dict:
        return self._parse(self.line(i), int(self.lines[i]))

    def _parse(self, text: bytes, line: int) -> dict:
        try:
            row = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise DatasetError(f"{self.name}: line {line} is not JSON ({e})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{self.name}: line {line} is a {type(row).__name__}, not an object")
        return row

    def __iter__(self):
        """Every row in file order, read sequentially (the field check's pass)."""
        with self.path.open("rb") as f:
            for n, text in enumerate(f, 1):
                if text.strip(b"\n"):
                    yield self._parse(text, n)


class ParquetRows(TaskRows):
    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.name = str(path)
        self.file = pq.ParquetFile(path)
        sizes = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._group: tuple[int, list[dict]] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> dict:
        g = int(np.searchsorted(self.starts, i, side="right")) - 1
        with self._lock:
            if self._group is None or self._group[0] != g:
                self._group = (g, self.file.read_row_group(g).to_pylist())
            return self._group[1][i - int(self.starts[g])]


class ArrowRows(TaskRows):
    """A pyarrow Table, or a `datasets.Dataset` (memory-mapped)."""

    def __init__(self, name: str, table: Any):
        self.name, self.table = name, table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict:
        if hasattr(self.table, "slice"):
            return self.table.slice(i, 1).to_pylist()[0]
        return dict(self.table[i])


def open_rows(path: str | Path) -> TaskRows:
    """The rows of a dataset file or `datasets` folder (DatasetError when it is neither)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
            raise DatasetError(f"{path}: a folder, but not one written by datasets.save_to_disk")
        try:
            import datasets
        except ImportError:
            raise DatasetError(f"{path}: reading a datasets folder needs `pip install datasets`") from None
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise DatasetError(f"{path}: holds splits {sorted(loaded)}; name one folder "
                               f"({path}/{next(iter(loaded))})")
        return ArrowRows(str(path), loaded)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return JsonlRows(path)
        if suffix == ".parquet":
            return ParquetRows(path)
        if suffix == ".csv":
            import pyarrow.csv as pacsv

            return ArrowRows(str(path), pacsv.read_csv(path))
    except DatasetError:
        raise
    except Exception as e:  # pyarrow's and the OS's errors: name the file
        raise DatasetError(f"{path}: not readable as {suffix[1:]} ({type(e).__name__}: {e})") from None
    raise DatasetError(f"{path}: unknown format {suffix!r}; tasks come from {', '.join(FORMATS)} "
                       "files or a datasets.save_to_disk folder")


def check_fields(rows: TaskRows, fields: Sequence[str]) -> None:
    """DatasetError naming the file, the row (1-based) and the field of the first row that lacks
    one of `fields` (or is not an object)."""
    if not fields:
        return
    each = iter(rows) if hasattr(type(rows), "__iter__") else (rows[i] for i in range(len(rows)))
    for i, row in enumerate(each):
        missing = [f for f in fields if row.get(f) is None]
        if missing:
            raise DatasetError(f"{rows.name}: row {i + 1} has no field {missing[0]!r} "
                               f"(the task needs {', '.join(map(repr, fields))})")


def split(n: int, *, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held_out) row indices: round(fraction * n) rows held out, drawn from `seed`; both
    ascending. fraction 0: every row trains."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the held-out fraction must be in [0, 1), got {fraction}")
    held = round(fraction * n)
    perm = np.random.Generator(np.random.PCG64([seed, 0x5EED])).permutation(n)
    return np.sort(perm[held:]), np.sort(perm[:held])


class EpochOrder:
    """Endless epochs over `indices`; epoch e is a permutation drawn from (seed, e)."""

    def __init__(self, indices: Sequence[int] | np.ndarray, *, seed: int, shuffle: bool = True):
        self.indices = np.asarray(indices, dtype=np.int64)
        if self.indices.size == 0:
            raise DatasetError("no rows to train on (the split left none)")
        self.seed, self.shuffle = seed, shuffle
        self._epoch: tuple[int, np.ndarray] | None = None

    def epoch(self, e: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != e:
            order = self.indices
            if self.shuffle:
                order = order[np.random.Generator(np.random.PCG64([self.seed, e])).permutation(order.size)]
            self._epoch = (e, order)
        return self._epoch[1]

    def at(self, step: int, k: int) -> list[int]:
        """Row indices of step `step`'s k tasks: positions step*k .. step*k+k-1."""
        n, out = self.indices.size, []
        for p in range(step * k, step * k + k):
            out.append(int(self.epoch(p // n)[p % n]))
        return out


class TaskData:
    """A run's tasks from files: the train rows dealt by EpochOrder, and the eval rows (a file of
    their own, or a held-out share of the train file, or none)."""

    def __init__(self, train: TaskRows, *, eval_rows: TaskRows | None = None, eval_fraction: float = 0.0,
                 split_seed: int = 0, seed: int = 0, shuffle: bool = True,
                 fields: Sequence[str] = ()):
        check_fields(train, fields)
        if eval_rows is not None:
            check_fields(eval_rows, fields)
        self.train_rows, self.eval_rows = train, eval_rows
        train_idx, held = split(len(train), fraction=eval_fraction, seed=split_seed)
        if eval_rows is None and eval_fraction:
            self.eval_rows, self.eval_idx = train, held
        else:
            self.eval_idx = None if eval_rows is None else np.arange(len(eval_rows))
        self.order = EpochOrder(train_idx, seed=seed, shuffle=shuffle)

    def train_tasks(self, step: int, k: int) -> list[dict]:
        """Step `step`'s k tasks (EpochOrder.at)."""
        return [self.train_rows[i] for i in self.order.at(step, k)]

    def eval_tasks(self, n: int) -> list[dict] | None:
        """The first n eval rows (the same every pass); None when there are none."""
        if self.eval_rows is None or len(self.eval_idx) == 0:
            return None
        return [self.eval_rows[int(i)] for i in self.eval_idx[:n]]
