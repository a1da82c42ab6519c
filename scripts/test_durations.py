#!/usr/bin/env python
"""Seconds per test from a measured run, for tests/conftest.py's scheduling (longest first):

    pytest ... --junitxml=/tmp/junit.xml && python scripts/test_durations.py /tmp/junit.xml > tests/durations.json

Setup, call and teardown together (a module fixture's launch counts towards the first test that uses it); and, on
stderr, each file's seconds, the longest first.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def durations(junit_xml: str) -> dict[str, float]:
    out = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        # junit names tests/test_x.py::test_y as classname "tests.test_x", name "test_y[param]"
        module = case.get("classname", "").replace(".", "/") + ".py"
        out[f"{module}::{case.get('name')}"] = round(float(case.get("time") or 0), 1)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = durations(argv[0])
    per_file = defaultdict(float)
    for nodeid, s in seconds.items():
        per_file[nodeid.split("::")[0]] += s
    for file, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"{s:8.1f}  {file}", file=sys.stderr)
    print(json.dumps(dict(sorted(seconds.items())), indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
