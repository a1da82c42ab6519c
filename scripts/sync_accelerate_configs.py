#!/usr/bin/env python
"""Write recipes/<name>/accelerate.yaml from accelerate_configs/<base> + the overrides in recipes.yaml.

    python scripts/sync_accelerate_configs.py          # rewrite the recipe copies
    python scripts/sync_accelerate_configs.py --check  # exit 1 when a copy differs (used by the tests)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "accelerate_configs"


def render(name: str, spec: dict) -> str:
    config = yaml.safe_load((SHARED / spec["base"]).read_text())
    for dotted, value in (spec.get("set") or {}).items():
        *parents, key = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    header = (
        f"# Generated from accelerate_configs/{spec['base']} by scripts/sync_accelerate_configs.py;\n"
        f"# edit accelerate_configs/ (or its recipes.yaml entry for {name}), not this copy.\n"
    )
    return header + yaml.safe_dump(config, sort_keys=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    manifest = yaml.safe_load((SHARED / "recipes.yaml").read_text())
    stale = []
    for name, spec in manifest.items():
        target = ROOT / "recipes" / name / "accelerate.yaml"
        text = render(name, spec)
        if target.exists() and target.read_text() == text:
            continue
        if args.check:
            stale.append(str(target.relative_to(ROOT)))
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}. Fix: python scripts/sync_accelerate_configs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
