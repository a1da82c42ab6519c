"""A job that spans nodes needs an output_dir every node sees: checked at start, before anything is read from it.

Why: checkpoints, the completion markers, the resume choice (every rank picks the newest complete checkpoint in
output_dir), the final save and its check (every rank reads the files rank 0 wrote) all assume one directory. With a
node-local output_dir (a path on each node's own disk) the ranks of different nodes pick different checkpoints to
resume, or the final-save check fails on a node that sees no files, late and with a confusing message. Nothing
upstream checks it.

How: global rank 0 writes a file with a random token into output_dir; the token travels to every rank through the
process group (gather_objects, which also orders the write before any read); the first rank of each node reads the
file and compares; every rank learns which nodes could not. Only when the job spans more than one node (WORLD_SIZE >
LOCAL_WORLD_SIZE): ranks on one node share its filesystem.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from fsdp_recipes.dist import gather_objects, initialized
from fsdp_recipes.errors import EXIT_USER_ERROR, UserError

MARKER_PREFIX = ".shared-dir-check-"  # one file per run: the name holds the token, no stale file can match


def spans_nodes(env: Mapping[str, str] = os.environ) -> bool:
    """More ranks in the job than on this node (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE)."""
    world = int(env.get("WORLD_SIZE", "1"))
    return world > int(env.get("LOCAL_WORLD_SIZE", str(world)))


def marker(output_dir: str | Path, token: str) -> Path:
    return Path(output_dir) / f"{MARKER_PREFIX}{token}"


def publish(output_dir: str | Path) -> str:
    """Rank 0: write a fresh token into output_dir; returns it."""
    token = secrets.token_hex(16)
    path = marker(output_dir, token)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    return token


def read_marker(output_dir: str | Path, token: str) -> str | None:
    """What this node reads in rank 0's marker file; None when it is not there."""
    try:
        return marker(output_dir, token).read_text()
    except OSError:
        return None


def can_see(token: str, read: Callable[[], str | None], wait_s: float = 5.0, poll_s: float = 0.25) -> bool:
    """Whether `read()` returns rank 0's token within `wait_s` seconds. The wait covers network filesystems that
    show another client's new file with a delay (NFS attribute caching); a node-local directory never shows it."""
    deadline = time.monotonic() + wait_s
    while True:
        if read() == token:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def first_blind(reports: list[tuple[str, bool]]) -> str | None:
    """From every rank's (hostname, saw rank 0's file): the first host that did not, else None."""
    return next((host for host, seen in reports if not seen), None)


def message(output_dir: str | Path, hostname: str) -> str:
    return (f"output_dir {output_dir} is not shared between the nodes (node {hostname} cannot see rank 0's files). "
            "Fix: put output_dir on a filesystem every node mounts (NFS, Lustre, a PVC with ReadWriteMany)")


def check_output_dir_shared(output_dir: str | Path, env: Mapping[str, str] = os.environ,
                            read: Callable[[str], str | None] | None = None, hostname: str | None = None,
                            wait_s: float = 5.0) -> None:
    """Stop a multi-node job whose output_dir is not shared. A collective: every rank calls it, once the process
    group exists. Rank 0 and the first rank of each node that cannot see the file raise UserError (one `error:`
    line in each of those nodes' logs); the other ranks exit with the same code, silently.
    `read(token)` and `hostname` replace the file read and this host's name (tests)."""
    if not spans_nodes(env) or not initialized():
        return
    rank, local_rank = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    hostname = hostname or socket.gethostname()
    read = read or (lambda token: read_marker(output_dir, token))
    token, unwritable = None, None
    if rank == 0:
        try:
            token = publish(output_dir)
        except OSError as err:
            unwritable = f"{type(err).__name__}: {err}"
    token, unwritable = gather_objects((token, unwritable))[0]  # every rank: rank 0's, after rank 0 wrote it
    if unwritable:
        stop(rank == 0, f"rank 0 cannot write to output_dir {output_dir} ({unwritable}). Fix: point output_dir at a "
                        "writable directory on a filesystem every node mounts")
    seen = can_see(token, lambda: read(token), wait_s) if local_rank == 0 else True
    reports = gather_objects((hostname, seen))
    if rank == 0:  # every rank has read (or given up) before the gather above returned
        marker(output_dir, token).unlink(missing_ok=True)
    outcome = decide(output_dir, reports, rank, seen, hostname)
    if outcome is not None:
        stop(*outcome)


def decide(output_dir: str | Path, reports: list[tuple[str, bool]], rank: int, seen: bool,
           hostname: str) -> tuple[bool, str] | None:
    """None when every node saw the file; else (whether this rank prints the line, the line). Rank 0 names the
    first node that could not see; such a node's first rank names itself; every other rank stays quiet."""
    blind = first_blind(reports)
    if blind is None:
        return None
    return rank == 0 or not seen, message(output_dir, blind if seen else hostname)


def stop(say: bool, text: str) -> None:
    """UserError (the `error:` line, exit 2) where the line should show, else the same exit code without it."""
    if say:
        raise UserError(text)
    raise SystemExit(EXIT_USER_ERROR)
