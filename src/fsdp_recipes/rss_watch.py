"""How far a block of code raises this process's host memory (RSS) above where it started.

Why: `ru_maxrss` is the peak of the whole process, so after loading it no longer moves for a later, smaller
peak such as the final save. The final save is where a FULL_STATE_DICT gather can exhaust rank 0's host memory
(issue 3), so the pack records each rank's rise during the save and during its completeness check. A thread
samples RSS (psutil) every `interval_s`; a peak shorter than that can be missed, so the figure is a lower bound.
"""

from __future__ import annotations

import threading

import psutil


class RssRise:
    """`with RssRise() as r: ...` then `r.rise_bytes`: the highest RSS sampled inside the block minus RSS at entry."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.start = self.peak = 0
        self.rise_bytes: int | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> "RssRise":
        self.start = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.rise_bytes = self.peak - self.start
