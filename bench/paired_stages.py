"""Held-out exact match of each stage, with its interval, and each stage against the one before it on the same rows
(a paired test), from the runs' sample_generations.json: the first run's base model, then each run's trained model.

    python -m bench.paired_stages runs/smollm2-135m-lora runs/smollm2-135m-kto [--json OUT]

Wilson's score interval (95%) for each stage's share correct; for two stages, the exact McNemar test: of the rows
where exactly one of the two is right (b: only the earlier, c: only the later), a two-sided binomial test of b
against c with p = 1/2. A change between stages is one only where that p-value is small; the counts say how many
answers each side fixed. The statistics are the package's (fsdp_recipes/evaluation/intervals.py), which the end-of-run
summary reports with; this script pairs stages across runs' sample_generations.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdp_recipes.api import paired, wilson


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
        change = paired(stages[before], stages[after])
        result["paired"].append({"from": before, "to": after, "only_before": change["right_only_before"],
                                 "only_after": change["right_only_after"],
                                 "mcnemar_exact_p": round(change["mcnemar_exact_p"], 4)})
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
