"""Held-out exact match of each stage, with its interval, and each stage against the one before it on the same rows
(a paired test), from the runs' sample_generations.json: the first run's base model, then each run's trained model.

    python -m bench.paired_stages runs/smollm2-135m-lora runs/smollm2-135m-kto [--json OUT]

Wilson's score interval (95%) for each stage's share correct; for two stages, the exact McNemar test: of the rows
where exactly one of the two is right (b: only the earlier, c: only the later), a two-sided binomial test of b
against c with p = 1/2. A change between stages is one only where that p-value is small; the counts say how many
answers each side fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

Z95 = 1.959964


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion (Wilson 1927; as in statsmodels' proportion_confint, method wilson)."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: twice the smaller binomial tail of b + c trials at p = 1/2, at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def stage_answers(runs: list[dict]) -> tuple[list[str], dict[str, list[bool]]]:
    """(the prompts, {stage: [right?] per prompt}): the first run's `base` answers, then each run's `trained`
    answers, the stage named as the run's last stage (`sft`, `kto`, ...; its sample_generations.json keeps those two
    answers per prompt; a name already taken gets the run's position). Right means equal to the expected answer, as
    the summary scores (answers are stored stripped). Every run must hold the same prompts in the same order."""
    prompts = [r["prompt"] for r in runs[0]["examples"]]
    out = {}
    for i, samples in enumerate(runs):
        if [r["prompt"] for r in samples["examples"]] != prompts:
            raise SystemExit(f"run {i + 1} scored other prompts, or in another order, than run 1: no paired test")
        names = [s["stage"] for s in samples.get("stages", [])] or ["base", "trained"]
        keys = [("base", names[0]), ("trained", names[-1])] if i == 0 else [("trained", names[-1])]
        for key, name in keys:
            name = f"{name} (run {i + 1})" if name in out else name
            out[name] = [r[key] == r["expected"] for r in samples["examples"]]
    return prompts, out


def report(runs: list[dict]) -> dict:
    prompts, stages = stage_answers(runs)
    n = len(prompts)
    result = {"n": n, "stages": [], "paired": []}
    for name, right in stages.items():
        lo, hi = wilson(sum(right), n)
        result["stages"].append({"stage": name, "correct": sum(right), "wilson95": [round(lo, 4), round(hi, 4)]})
    names = list(stages)
    for before, after in zip(names, names[1:]):
        b = sum(x and not y for x, y in zip(stages[before], stages[after]))
        c = sum(y and not x for x, y in zip(stages[before], stages[after]))
        result["paired"].append({"from": before, "to": after, "only_before": b, "only_after": c,
                                 "mcnemar_exact_p": round(mcnemar_exact(b, c), 4)})
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="run folders, the earliest stage's first")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = report([json.loads((run / "sample_generations.json").read_text()) for run in args.runs])
    for s in result["stages"]:
        lo, hi = wilson(s["correct"], result["n"])
        print(f"{s['stage']:<8} {s['correct']}/{result['n']}  (Wilson 95% {100 * lo:.1f}-{100 * hi:.1f}%)")
    for p in result["paired"]:
        print(f"{p['from']} -> {p['to']}: right only before {p['only_before']}, only after {p['only_after']}, "
              f"exact McNemar p = {p['mcnemar_exact_p']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
