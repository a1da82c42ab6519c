"""Start the ranks while the launcher still checks the recipe; they wait at a gate before touching anything.

The gap this fills: the launcher's one-process checks (a mistake is one line, not a traceback per rank) need
torch, transformers, peft and TRL, and so does every rank. Run one after the other, the default run spent 3.4 s
importing in the launcher, 0.9 s checking, and then 4.6 s importing again in the ranks before anything else
(`make bench`, 2026-11-22). Neither accelerate nor torchrun can hold spawned workers back until a condition holds,
so the launcher starts `accelerate launch` first, in a session of its own, with its output held back, and checks
while the ranks import; each rank then waits here, before it parses its arguments, builds assets, loads data or
writes anything. Passed checks open the gate and release the held output. Failed ones kill the whole session and
drop its output, so a mistake is still one line and nothing ran.

Launcher side: `Gate` (the file, its state, the environment the child needs). Rank side: `wait()`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

FILE_ENV = "FSDP_RECIPES_START_GATE"
PID_ENV = "FSDP_RECIPES_START_GATE_PID"
OPEN, ABORT = "open", "abort"


class Gate:
    """A file in a private temporary directory: missing while closed, then OPEN or ABORT (written atomically)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fsdp-recipes-gate-"))
        self.path = self.dir / "gate"

    def env(self) -> dict[str, str]:
        return {FILE_ENV: str(self.path), PID_ENV: str(os.getpid())}

    def _write(self, state: str) -> None:
        tmp = self.dir / f"gate.{state}"
        tmp.write_text(state)
        os.replace(tmp, self.path)

    def open(self) -> None:
        self._write(OPEN)

    def abort(self) -> None:
        self._write(ABORT)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def state(path: str) -> str | None:
    try:
        return Path(path).read_text() or None
    except FileNotFoundError:
        return None


def under_launcher() -> bool:
    """Whether this rank was started by the pack's launcher (which prints its failures, launch/explain_failure.py)."""
    return bool(os.environ.get(FILE_ENV))


def wait(poll_s: float = 0.02) -> float:
    """Block until the launcher's checks passed; seconds waited. A no-op without the launcher (a direct
    `accelerate launch`, the benchmarks). Exits quietly when the checks failed or the launcher is gone: the
    launcher prints the reason, once."""
    path = os.environ.get(FILE_ENV)
    if not path:
        return 0.0
    import psutil

    launcher = int(os.environ.get(PID_ENV, "0"))
    t0 = time.time()
    while (s := state(path)) != OPEN:
        if s == ABORT:
            os._exit(1)  # the launcher kills this session anyway; no traceback, no atexit handlers
        if launcher and not psutil.pid_exists(launcher):
            sys.exit("[train] the launcher exited before its checks finished; nothing was run")
        time.sleep(poll_s)
    return time.time() - t0
