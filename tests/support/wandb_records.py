"""An offline wandb run read back: the records of its run-*.wandb file.

wandb 0.31 keeps no Python reader of its own files. The file is a LevelDB-style log: a 7-byte
header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks (crc32 u32, length u16,
type u8: 1 full, 2 first, 3 middle, 4 last; a block's tail under 7 bytes is padding), each record
a wandb_internal_pb2.Record.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER, CHUNK = 32768, 7, 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    out, parts, pos = [], [], HEADER
    while pos + CHUNK <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + CHUNK])
        if n == 0 and kind == 0:  # the rest of the block is padding
            pos += left
            continue
        parts.append(data[pos + CHUNK:pos + CHUNK + n])
        pos += CHUNK + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def history(run_dir: Path) -> list[dict]:
    """Each logged step of the one offline run under `run_dir`: {key: value} (values as JSON)."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in r.history.item} for r in records(path) if r.WhichOneof("record_type") == "history"]


def config(run_dir: Path) -> dict:
    """The run's config as wandb recorded it at init."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            return {item.key: json.loads(item.value_json) for item in r.run.config.update
                    if not item.key.startswith("_")}
    raise AssertionError(f"{path}: no run record")
