"""Files a run writes for people and tools to read: JSON written atomically (temp file + rename, so a reader
never sees half a file), and the timestamps used in records and file names.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path


def umask_mode(mode: int = 0o666) -> int:
    """`mode` as open() would create it under this process's umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write to a temp file in the same directory, then rename: readers never see half a file. The file gets the
    mode a plain open() would give it (mkstemp's is 0600, which locks teammates out of a shared run directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sets_sorted(value):
    """`value` with every set (PEFT's `target_modules`, ...) as a sorted list, for JSON: json's default=str would
    write a set's printed form, whose order varies between processes, so two runs with the same modules would read
    as different settings (`make report`)."""
    if isinstance(value, (set, frozenset)):
        return sorted((sets_sorted(v) for v in value), key=str)
    if isinstance(value, dict):
        return {k: sets_sorted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sets_sorted(v) for v in value]
    return value


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def file_stamp(iso: str) -> str:
    """now_iso() for a file name, to the minute in UTC: 2026-11-22T10:15:00+00:00 -> 2026-11-22T1015Z. Several
    benchmark runs on one day each keep their file."""
    return dt.datetime.fromisoformat(iso).astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
