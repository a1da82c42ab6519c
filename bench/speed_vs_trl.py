"""Issue 33's measurement: the default (`make finetune`'s recipe) against the plain TRL script, side by side.

    python -m bench.speed_vs_trl --pairs 2 --arms plain-trl,pack,pack-fp32,plain-trl-bf16   # quiet machine, ~25 min
    python -m bench.speed_vs_trl --pairs 1 --steps 12 --load 1  # the same with one busy process beside each run

Runs the arms in turn, pair after pair (plain-trl, pack, pack-..., then again), so a slow patch of the machine hits
every arm alike; records for each run the training time (on_train_begin to on_train_end for both), the final loss,
the held-out exact match, and the 1-minute load average before it. Prints medians and, per pair, plain-trl's time
over each arm's (above 1: the arm is faster). `--load N` keeps N busy-looping processes running during every run:
the pack's ranks use 1 thread each, the plain script torch's default (one per core). Writes
bench/results/speed-vs-trl-<UTC time>.json with the machine's CPU model and bf16 flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m-lora" / "launch.sh"
ARMS = {  # name -> the plain script's settings, or the default's launch.sh's
    "plain-trl": ["--precision", "fp32"],  # issue 33's baseline (bench/plain_trl_sft.py says why fp32)
    "plain-trl-bf16": ["--precision", "bf16"],
    "plain-trl-default": ["--precision", "default"],  # TRL's defaults untouched: the baseline on a GPU
    "pack": [],  # as `make finetune` runs it: cpu_bf16 auto
    "pack-fp32": ["--bf16", "false"],
}


def cpu() -> dict:
    """The CPU's model, cores, and the bf16 flags the launcher decides cpu_bf16 by."""
    from fsdp_recipes.api import cpu_bf16_flags

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return {"model": model or platform.processor(), "cores": os.cpu_count(), "bf16_flags": cpu_bf16_flags(info)}


def gpu() -> str | None:
    """The GPU both arms run on, when there is one (the pack places the default there, the plain script too)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def run_arm(arm: str, steps: int, out: Path) -> dict:
    if arm.startswith("plain-trl"):
        res = subprocess.run([sys.executable, "-m", "bench.plain_trl_sft", "--out", str(out), "--steps", str(steps),
                              *ARMS[arm]], capture_output=True, text=True, cwd=REPO)
        if res.returncode:
            raise SystemExit(f"{arm} failed:\n{res.stderr[-3000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])
    res = subprocess.run(["bash", str(RECIPE), "--output_dir", str(out), "--max_steps", str(steps),
                          "--logging_steps", str(min(4, steps)), *ARMS[arm]],  # the recipe's 4, or every step
                         capture_output=True, text=True, cwd=REPO)
    if res.returncode:
        raise SystemExit(f"{arm} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    m = json.loads((out / "metrics.json").read_text())
    losses = [h["loss"] for h in json.loads((out / "log_history.json").read_text())["log_history"] if "loss" in h]
    return {"arm": arm, "train_time_s": round(m["train_time_s"], 2), "steps": m["steps"],
            "final_loss": m["final_train_loss"], "losses": losses, "held_out_correct": m["eval"]["trained_correct"],
            "held_out": m["eval"]["prompts"], "mixed_precision": m["mixed_precision"],
            "console": [line for line in res.stdout.splitlines() if line.startswith(("[launch] recipe", "== "))]}


def summarize(runs: list[dict], arms: list[str]) -> dict:
    """Per arm: the median training time, every held-out score and final loss; for each arm after the first (the
    baseline, a plain-trl arm), the baseline's time over the arm's in the same pair, and the median of those ratios."""
    summary, base = {}, arms[0]
    key = base.replace("-", "_")  # speedup_over_plain_trl, as the results of 2026-11-26 name it
    plain = {r["pair"]: r["train_time_s"] for r in runs if r["arm"] == base}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        summary[arm] = {"median_train_time_s": statistics.median(r["train_time_s"] for r in mine),
                        "held_out_correct": [r["held_out_correct"] for r in mine],
                        "final_loss": [r["final_loss"] and round(r["final_loss"], 4) for r in mine]}
        if arm != base:
            ratios = [plain[r["pair"]] / r["train_time_s"] for r in mine if r["pair"] in plain]
            summary[arm][f"speedup_over_{key}_per_pair"] = [round(x, 3) for x in ratios]
            summary[arm][f"median_speedup_over_{key}"] = round(statistics.median(ratios), 3)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--arms", default="plain-trl,pack",
                    help=f"comma-separated, a plain-trl arm first (the baseline): {', '.join(ARMS)}")
    ap.add_argument("--load", type=int, default=0, help="busy-looping processes kept running during every run")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not arms[0].startswith("plain-trl") or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: a plain-trl arm first, then any of {', '.join(ARMS)}")
    result = {"benchmark": "speed_vs_trl", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpu": cpu(), "gpu": gpu(), "steps": args.steps, "load_processes": args.load, "runs": []}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    for pair in range(args.pairs):
        for arm in arms:
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
            try:
                load = os.getloadavg()[0]
                with tempfile.TemporaryDirectory() as tmp:
                    start = time.time()
                    r = run_arm(arm, args.steps, Path(tmp) / "run")
                r.update(pair=pair, load_1min_before=round(load, 2), command_s=round(time.time() - start, 1))
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
            result["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    summary = summarize(result["runs"], arms)
    result["summary"] = summary
    print(json.dumps(summary, indent=1))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"speed-vs-trl-{stamp}{'-load' if args.load else ''}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
