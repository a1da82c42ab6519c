"""How the DPO demo's pair design was chosen without looking at the held-out questions: exact match on training
questions that no preference pair was built from (the default's train.jsonl rows 1,600 to 1,999; the SFT run may
have seen some of them, equally for every model compared).

    python -m bench.dpo_validation runs/smollm2-135m-lora/merged runs/a/merged runs/b/merged [--out FILE]

Prints and writes (bench/results/dpo-validation-<time>.json) each model's count; nothing here trains.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from fsdp_recipes.api import ADDITION_TRAIN_QUESTIONS, file_stamp, generate, now_iso, write_json_atomic

N = 400


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from fsdp_recipes.api import ensure_smollm2

    rows = [json.loads(line) for line in
            (ensure_smollm2(model=False, quiet=True)["data"] / "train.jsonl").read_text().splitlines()]
    rows = rows[ADDITION_TRAIN_QUESTIONS:ADDITION_TRAIN_QUESTIONS + N]
    prompts, expected = [r["prompt"] for r in rows], [r["completion"][-1]["content"] for r in rows]
    started = now_iso()
    results = []
    for model in args.models:
        t0 = time.time()
        answers = generate(str(model), prompts, batch_size=100)
        correct = sum(a == e for a, e in zip(answers, expected))
        over = sum(a.isdigit() and int(a) > int(e) for a, e in zip(answers, expected))
        under = sum(a.isdigit() and int(a) < int(e) for a, e in zip(answers, expected))
        results.append({"model": str(model), "correct": correct, "too_high": over, "too_low": under,
                        "not_a_number": N - correct - over - under, "seconds": round(time.time() - t0, 1)})
        print(f"{model}: {correct}/{N} ({over} too high, {under} too low)", flush=True)
    out = args.out or Path("bench/results") / f"dpo-validation-{file_stamp(started)}.json"
    write_json_atomic(out, {"started_at": started, "machine": platform.processor() or platform.machine(),
                            "questions": f"train.jsonl rows {ADDITION_TRAIN_QUESTIONS} to "
                                         f"{ADDITION_TRAIN_QUESTIONS + N - 1}",
                            "results": results})
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
