"""The ranks' output: relayed to the terminal, and kept whole in `output_dir/logs/rank<N>.log`.

The launcher starts `accelerate launch` with torchrun's `--redirects 3 --log_dir <tmp>`: torchrun writes each rank's
stdout and stderr to files there (<tmp>/<run id>/attempt_<n>/<local rank>/stdout.log, stderr.log) beside its error
record (error.json, train/failure_record.py), and each rank writes its global rank into the same folder. This module
tails those files byte for byte (torchrun's own `--tee` reads them as text lines, which turns every progress-bar update
into a line of its own) and sends each rank's bytes to the terminal and to that rank's log. torchrun's and
accelerate's own output (start-up notes, the ChildFailedError page with its traceback) goes to `logs/launch.log`
only: the launcher prints its own one-line account of a failure (launch/explain_failure.py).

Until the launcher's checks pass, everything is held in memory: released (to the terminal and the logs) when they
pass, dropped when they fail, so a mistake is one line and the output_dir is not touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from fsdp_recipes.train.failure_record import DETAILS_FILE

LAUNCH_LOG = "launch.log"
RANK_FILE = "rank"  # written by each rank beside its error file (train/failure_record.py)
STREAMS = {"stdout.log": "stdout", "stderr.log": "stderr", DETAILS_FILE: None}  # details: the rank's log only


def log_name(rank: int | None) -> str:
    return LAUNCH_LOG if rank is None else f"rank{rank}.log"


class RankOutput:
    """Pumps the child's own stdout/stderr and tails the ranks' files (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, torchrun_logs: Path, poll_s: float = 0.1) -> None:
        self.lock = threading.Lock()
        self.held: list[tuple] = []  # (terminal stream or None, rank or None, bytes) until release()
        self.passing = self.dropped = False
        self.log_dir: Path | None = None
        self.log_failure: str | None = None  # why the logs stopped being written (e.g. no space left on device)
        self.files: dict[int | None, object] = {}
        self.torchrun_logs, self.poll_s = torchrun_logs, poll_s
        self.offsets: dict[Path, int] = {}
        self.stopping = threading.Event()
        self.pumps = [threading.Thread(target=self._pump, args=(pipe,), daemon=True) for pipe in (proc.stdout, proc.stderr)]
        self.tail = threading.Thread(target=self._tail, daemon=True)
        for t in (*self.pumps, self.tail):
            t.start()

    @staticmethod
    def _write(dst, chunk: bytes) -> None:
        try:
            if hasattr(dst, "buffer"):
                dst.buffer.write(chunk)
                dst.buffer.flush()
            else:  # a text-only stream (a test's capture)
                dst.write(chunk.decode(errors="replace"))
                dst.flush()
        except (OSError, ValueError):  # our own stdout is gone: the ranks go on regardless
            pass

    def _log(self, rank: int | None, chunk: bytes) -> None:
        if self.log_dir is None or self.log_failure:
            return
        try:
            f = self.files.get(rank)
            if f is None:
                f = self.files[rank] = open(self.log_dir / log_name(rank), "ab")
                f.write(f"==== launch at {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()}) ====\n".encode())
            f.write(chunk)
            f.flush()
        except OSError as err:  # a full disk, a quota: the terminal still gets everything; the launcher says so
            self.log_failure = f"{err.strerror or err}"
            self._close_files()

    def _close_files(self) -> None:
        for f in self.files.values():
            try:
                f.close()
            except OSError:  # the data it could not flush is lost either way; log_failure says so
                pass
        self.files.clear()

    def _route(self, terminal, rank: int | None, chunk: bytes) -> None:
        with self.lock:
            if self.passing:
                self._log(rank, chunk)
                if terminal is not None:
                    self._write(terminal, chunk)
            elif not self.dropped:
                self.held.append((terminal, rank, chunk))

    def _pump(self, pipe) -> None:
        """torchrun's and accelerate's own output: the launch log only."""
        fd = pipe.fileno()
        while chunk := os.read(fd, 65536):
            self._route(None, None, chunk)

    def _read_new(self) -> bool:
        """Route what the ranks wrote since the last call; whether there was anything."""
        got = False
        for path in sorted(self.torchrun_logs.glob("*/attempt_*/*/*.log")):
            if path.name not in STREAMS:
                continue
            stream = STREAMS[path.name]
            marker = path.parent / RANK_FILE
            try:
                rank = int(marker.read_text())
            except (OSError, ValueError):
                if not self.stopping.is_set():
                    continue  # wait for the rank to say which it is (its first act)
                rank = int(path.parent.name)  # it never did: its local rank
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            if chunk:
                got = True
                self.offsets[path] = offset + len(chunk)
                self._route({"stdout": sys.stdout, "stderr": sys.stderr}.get(stream), rank, chunk)
        return got

    def _tail(self) -> None:
        while not self.stopping.is_set():
            if not self._read_new():
                time.sleep(self.poll_s)
        self._read_new()

    def release(self, log_dir: Path | None) -> None:
        """The checks passed: write what was held, then pass output on as it comes. `log_dir`: where the logs go
        (created here), or None for none."""
        with self.lock:
            if log_dir is not None:
                try:
                    log_dir.mkdir(parents=True, exist_ok=True)
                    self.log_dir = log_dir
                except OSError as err:
                    self.log_failure = f"{err.strerror or err}"
            sys.stdout.flush()
            for terminal, rank, chunk in self.held:
                self._log(rank, chunk)
                if terminal is not None:
                    self._write(terminal, chunk)
            self.held.clear()
            self.passing = True

    def drop(self) -> None:
        with self.lock:
            self.held.clear()
            self.dropped = True

    def append(self, rank: int | None, text: str) -> None:
        """Add the launcher's own text to a log (a rank's traceback from its error record)."""
        with self.lock:
            self._log(rank, text.encode(errors="replace"))

    def join(self, timeout_s: float = 10.0) -> None:
        """Until the pipes close (bounded: a process the ranks left behind, a compile worker, may hold them open
        after torchrun has exited), then the ranks' files are read to their end."""
        for t in self.pumps:
            t.join(timeout_s)
        self.stopping.set()
        self.tail.join(timeout_s)

    def close(self) -> None:
        self.stopping.set()
        with self.lock:
            self._close_files()
