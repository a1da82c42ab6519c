"""metrics.json has one owner: `amend`. Every process that reports on a run -- rank 0's run report (provisional,
then final), the launcher (a failed rank, a grace period that ran out) and the end-of-run summary (`eval`) --
changes the file through it, so no writer can drop a field another one added, whatever the order.

`amend` holds an exclusive lock (flock on `.metrics.json.lock` beside it) while it reads the file, applies the
change and writes the result atomically (records.write_json_atomic). A change sees the current document ({} when
there is none) and returns the new one, or None to leave the file as it is.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes.records import write_json_atomic

NAME = "metrics.json"


def read(output_dir: str | Path) -> dict:
    path = Path(output_dir) / NAME
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def amend(output_dir: str | Path, change: Callable[[dict], dict | None]) -> dict | None:
    """Apply `change` to metrics.json under the lock; returns what was written (None: nothing was)."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        new = change(read(folder))
        if new is not None:
            write_json_atomic(folder / NAME, new)
        return new


def same_run(current: dict, started_at: str) -> dict:
    """What the file holds of the run that started at `started_at` ({} when it is an earlier run's report): a
    run's own report keeps the fields others added to it and drops an earlier run's."""
    return current if current.get("started_at") == started_at else {}
