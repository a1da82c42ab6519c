"""One run at a time in an output_dir.

Two runs writing one output_dir both report "completed" and leave one's adapter beside the other's report. The
launcher holds an exclusive `flock` on `<output_dir>/.fsdp-recipes.lock` from its checks to its summary (on a
multi-node job, the first node's launcher); a second launcher refuses in one line naming the holder. The kernel drops
the lock when its process dies, however it dies, so a lock file left by a killed run is no lock: the next run takes
it and says whose it was. (On a file system without locks, NFS mounted with `nolock`, the run goes on unlocked and
says so.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from fsdp_recipes.errors import UserError

LOCK_FILE = ".fsdp-recipes.lock"


class OutputLock:
    def __init__(self, output_dir: str | Path, command: str) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.command = command
        self.fd: int | None = None
        self.note: str | None = None  # a line for the user: a dead run's lock taken over, or no lock possible
        self.made_the_folder = False

    def acquire(self) -> OutputLock:
        self.made_the_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by another run ({describe(holder)}); two runs in one "
                            f"output_dir would mix their checkpoints and reports. Fix: wait for that run to end, or "
                            f"use another --output_dir.") from None
        except OSError as err:  # ENOLCK: no locks on this file system
            self.note = f"cannot lock {self.path} ({err.strerror}): nothing stops a second run in this output_dir"
            os.close(fd)
            return self
        previous = self._holder(fd)
        if previous.get("pid") and not previous.get("released_at"):  # its release may also have met a full disk
            self.note = (f"took over the lock of a run that is gone and did not record its release "
                         f"({describe(previous)})")
        self.fd = fd
        try:
            self._write({"pid": os.getpid(), "host": socket.gethostname(), "started_at": _now(),
                         "command": self.command})
        except OSError:  # a full disk: the lock holds all the same, only its holder goes unnamed
            pass
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        if not self._remove_the_empty_folder_it_made():
            try:
                self._write({**self._holder(self.fd), "released_at": _now()})
            except OSError:  # a full disk: the lock itself still goes with the descriptor
                pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def _remove_the_empty_folder_it_made(self) -> bool:
        """A run refused or stopped before it wrote anything leaves no empty folder behind (while the lock is
        still held, so no other run can have started in it)."""
        if not self.made_the_folder:
            return False
        try:
            if [p.name for p in self.path.parent.iterdir()] != [LOCK_FILE]:
                return False
            self.path.unlink()
            self.path.parent.rmdir()
        except OSError:
            return False
        return True

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _write(self, info: dict) -> None:
        data = (json.dumps(info) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            holder = json.loads(os.pread(fd, 65536, 0) or b"{}")
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started_at')}: "
            f"{holder.get('command', '?')}")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
