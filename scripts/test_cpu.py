#!/usr/bin/env python
"""CPU-seconds per test file of a measured suite run, from what the run left in its --basetemp folder:

    make test PYTEST_ARGS="--basetemp=/tmp/run" && python scripts/test_cpu.py /tmp/run

The pytest workers' own (cpu-<worker>.log, their reaped fresh children included) and every forked process's
(fork-server-*.log: each fork with the children it reaped, named by the test that started it). On 2 cores the suite's
wall time is about its CPU-seconds / 2: these say where that goes. A fork started in a module fixture counts towards
the test that first asked for it.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^(?:exit \d+: )?([\d.]+) CPU-s, (\S+)")


def per_test(basetemp: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for log in [*basetemp.rglob("cpu-*.log"), *basetemp.rglob("fork-server-*.log")]:
        for line in log.read_text().splitlines():
            if m := LINE.match(line):
                seconds[m.group(2)] += float(m.group(1))
    return seconds


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    seconds = per_test(Path(argv[0]))
    per_file: dict[str, float] = defaultdict(float)
    for test, s in seconds.items():
        per_file[test.split("::")[0]] += s
    print(f"{sum(seconds.values()):8.1f}  CPU-s in all")
    for file, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"{s:8.1f}  {file}")
    print("\nlongest tests:")
    for test, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{s:8.1f}  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
