"""How far a block of code raises this process's anonymous host memory (RssAnon) above where it started.

Why: `ru_maxrss` is the peak of the whole process, so after loading it no longer moves for a later, smaller
peak such as the final save. The final save is where a FULL_STATE_DICT gather can exhaust rank 0's host memory
(make bench-loading measures it), so the pack records each rank's rise during the save and during its completeness check. A thread
samples every `interval_s`; a peak shorter than that can be missed, so the figure is a lower bound.

Anonymous memory, not all of RSS: reading safetensors files maps them, and the mapped file pages count in RSS
although the kernel can drop them at any time (make bench-loading, 2026-11-22: the check of a 394 MiB model rose
264 MiB in RSS and 0 MiB in RssAnon). RssAnon is what an out-of-memory kill is about. Where /proc is missing
(not Linux), whole RSS from psutil.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

STATUS = Path("/proc/self/status")


def anon_rss_bytes() -> int:
    if STATUS.is_file():
        for line in STATUS.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # kB
    return psutil.Process().memory_info().rss


class RssRise:
    """`with RssRise() as r: ...` then `r.rise_bytes`: the highest RssAnon sampled inside the block minus that at entry."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.start = self.peak = 0
        self.rise_bytes: int | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, anon_rss_bytes())

    def __enter__(self) -> "RssRise":
        self.start = self.peak = anon_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss_bytes())
        self.rise_bytes = self.peak - self.start
