"""Issue 43's CPU measurement: the default in 4 bits (recipes/smollm2-135m-qlora) against the default as it runs
(recipes/smollm2-135m-lora), the same schedule, on this machine.

    python -m bench.qlora_cpu --pairs 2 --steps 48      # ~25 minutes on 2 busy cores
    python -m bench.qlora_cpu --pairs 1 --steps 8 --prompts 16   # a quick look

Each run is `python -m fsdp_recipes.launch.launcher <recipe> --output_dir <tmp> --max_steps N`, what `make finetune
RECIPE=<recipe>` runs (the 4-bit arm with bitsandbytes on its PYTHONPATH, as make finetune gives it; the other arm
without, as a user has it). The arms alternate, 4bit, default, 4bit, default, ..., so that a busy patch of a shared
machine hits both alike; every figure is also taken as a ratio within its pair (4bit over default) and the median of
those ratios reported. Recorded per run: the held-out exact match on the recipe's 100 test questions (the summary's;
the 4-bit arm's merged model, its 4-bit base + adapter, and its base in 4 bits), training seconds per step
(train_time_s / steps), the whole command's seconds, each rank's peak host RSS (psutil, polled every 0.5 s over the
ranks' processes, so rank 0's merge at the end counts) and the run report's RSS at train start, and the 1-minute load
average before and after. Exact match gets a Wilson 95% interval; the two arms' trained models on the same questions
an exact McNemar test. Writes bench/results/qlora-cpu-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

from fsdp_recipes.api import mcnemar_exact, wilson

REPO = Path(__file__).resolve().parent.parent
ARMS = {"4bit": "smollm2-135m-qlora", "default": "smollm2-135m-lora"}
QLORA_SITE = Path(sys.executable).parent.parent / "qlora-site"  # make venv's bitsandbytes (the Makefile says why)


def rank_rss(launcher: subprocess.Popen, stop: threading.Event, peaks: dict) -> None:
    """Poll the launcher's process tree: the peak RSS of each rank (fsdp_recipes.train.entry) and of the launcher."""
    root = psutil.Process(launcher.pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                if p.pid == root.pid:
                    key = "launcher (checks, summary)"
                elif "fsdp_recipes.train.entry" in " ".join(p.cmdline()):  # a rank, or accelerate launch itself
                    rank = p.environ().get("RANK")
                    key = f"rank {rank}" if rank is not None else "accelerate launch"
                else:
                    continue
                peaks[key] = max(peaks.get(key, 0), p.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        stop.wait(0.5)


STEP_LINE = re.compile(r"^\[train\] step +(\d+)/\d+ .* ([\d,.]+) tokens/s", re.M)


def interval_rates(log: str) -> dict[int, float]:
    """{step: tokens/s over the logging interval that ends there}, from the console's step lines."""
    return {int(m.group(1)): float(m.group(2).replace(",", "")) for m in STEP_LINE.finditer(log)}


def run_arm(arm: str, steps: int, out: Path, prompts: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FSDP_RECIPES_SUMMARY_PROMPTS=str(prompts))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != QLORA_SITE]
    env["PYTHONPATH"] = os.pathsep.join([*([str(QLORA_SITE)] if arm == "4bit" else []), str(REPO / "src"), *inherited])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "fsdp_recipes.launch.launcher", ARMS[arm], "--output_dir", str(out),
           "--max_steps", str(steps)]
    peaks: dict[str, int] = {}
    stop = threading.Event()
    start = time.time()
    with open(out.parent / f"{arm}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        watcher = threading.Thread(target=rank_rss, args=(proc, stop, peaks), daemon=True)
        watcher.start()
        rc = proc.wait()
        stop.set()
        watcher.join()
    if rc:
        raise SystemExit(f"{arm} failed (exit {rc}):\n{(out.parent / f'{arm}.log').read_text()[-3000:]}")
    return collect(arm, out, peaks, round(time.time() - start, 1))


def collect(arm: str, out: Path, peaks: dict, command_s: float) -> dict:
    """One finished run's figures, from its folder and its console log (beside the folder)."""
    m = json.loads((out / "metrics.json").read_text())
    ev = m["eval"]
    samples = json.loads((out / "sample_generations.json").read_text())
    summary = [line for line in (out.parent / f"{arm}.log").read_text().splitlines()
               if line.startswith(("exact match", "4 bits", "== ", "[launch] recipe"))]
    return {"arm": arm, "recipe": ARMS[arm], "command_s": command_s,
            "interval_tokens_per_s": interval_rates((out.parent / f"{arm}.log").read_text()),
            "train_time_s": round(m["train_time_s"], 2), "steps": m["steps"],
            "s_per_step": round(m["train_time_s"] / m["steps"], 3), "time_to_first_step_s": m["time_to_first_step_s"],
            "final_loss": m["final_train_loss"], "mixed_precision": m["mixed_precision"],
            "peak_rss_bytes": peaks, "rss_at_train_start_bytes_per_rank":
                m["peak_memory"]["host_rss_at_train_start_bytes_per_rank"],
            "run_report_peak_rss_bytes": m["peak_memory"]["host_rss_bytes"],
            "param_shards": m["param_shards"], "held_out": ev["prompts"], "base_correct": ev["base_correct"],
            "trained_correct": ev["trained_correct"], "four_bit": ev.get("four_bit"),
            "right": [e["trained"] == e["expected"] for e in samples["examples"]],
            "right_4bit": [e.get("trained_4bit") == e["expected"] for e in samples["examples"]],
            "summary": summary}


def summarize(runs: list[dict]) -> dict:
    """Medians per arm, the 4bit/default ratio within each pair and their median, exact match with intervals, and
    the paired test of the two arms' trained models (first pair; repeated runs give the same answers)."""
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in ARMS}
    out = {}
    for arm, mine in by_arm.items():
        ranks = sorted({k for r in mine for k in r["peak_rss_bytes"] if k.startswith("rank")})
        first = mine[0]
        lo, hi = wilson(first["trained_correct"], first["held_out"])
        out[arm] = {"median_s_per_step": statistics.median(r["s_per_step"] for r in mine),
                    "median_command_s": statistics.median(r["command_s"] for r in mine),
                    "median_peak_rss_gib_per_rank": {k: round(statistics.median(
                        r["peak_rss_bytes"].get(k, 0) for r in mine) / 2**30, 3) for k in ranks},
                    "trained_correct": [r["trained_correct"] for r in mine], "base_correct": first["base_correct"],
                    "trained_wilson95": [round(lo, 4), round(hi, 4)],
                    "final_loss": [round(r["final_loss"], 4) for r in mine]}
        if arm == "4bit" and first.get("four_bit"):
            lo, hi = wilson(first["four_bit"]["adapted"]["correct"], first["held_out"])
            out[arm]["adapted_4bit_correct"] = [r["four_bit"]["adapted"]["correct"] for r in mine]
            out[arm]["adapted_4bit_wilson95"] = [round(lo, 4), round(hi, 4)]
            out[arm]["merged_same_answers_as_4bit"] = [r["four_bit"]["merged_same_answers"] for r in mine]
    pairs = sorted({r["pair"] for r in runs})
    ratios = {"s_per_step": [], "interval_time": [], "peak_rss_rank0": [], "peak_rss_rank1": []}
    for pair in pairs:
        q = next((r for r in runs if r["pair"] == pair and r["arm"] == "4bit"), None)
        d = next((r for r in runs if r["pair"] == pair and r["arm"] == "default"), None)
        if q and d:
            ratios["s_per_step"].append(q["s_per_step"] / d["s_per_step"])
            # each logging interval's time, 4 bits over the default's same interval (tokens/s the other way round)
            ratios["interval_time"] += [d["interval_tokens_per_s"][k] / q["interval_tokens_per_s"][k]
                                        for k in q["interval_tokens_per_s"] if k in d["interval_tokens_per_s"]]
            for rank in ("0", "1"):
                key = f"rank {rank}"
                if q["peak_rss_bytes"].get(key) and d["peak_rss_bytes"].get(key):
                    ratios[f"peak_rss_rank{rank}"].append(q["peak_rss_bytes"][key] / d["peak_rss_bytes"][key])
    out["ratio_4bit_over_default_per_pair"] = {k: [round(x, 3) for x in v] for k, v in ratios.items()}
    out["median_ratio_4bit_over_default"] = {k: round(statistics.median(v), 3) for k, v in ratios.items() if v}
    q, d = by_arm["4bit"][0], by_arm["default"][0]
    b = sum(y and not x for x, y in zip(q["right"], d["right"]))  # right only by the default
    c = sum(x and not y for x, y in zip(q["right"], d["right"]))  # right only in 4 bits
    out["paired_trained"] = {"only_default": b, "only_4bit": c, "mcnemar_exact_p": round(mcnemar_exact(b, c), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=100, help="held-out questions the summary scores (default all)")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(QLORA_SITE))  # the 4-bit arm needs bitsandbytes: fail here, not after the first run
    import accelerate
    import bitsandbytes  # noqa: F401
    import peft
    import torch
    import transformers
    import trl

    from bench.speed_vs_trl import cpu

    result = {"benchmark": "qlora_cpu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpu": cpu(),
              "host_ram_bytes": psutil.virtual_memory().total,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                           "peft": peft.__version__, "accelerate": accelerate.__version__,
                           "bitsandbytes": sys.modules["bitsandbytes"].__version__},
              "steps": args.steps, "pairs": args.pairs, "prompts": args.prompts, "runs": []}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"qlora-cpu-{stamp}.json"
    with tempfile.TemporaryDirectory(prefix="qlora-cpu-") as tmp:
        for pair in range(args.pairs):
            for arm in ARMS:
                out = Path(tmp) / f"{arm}-{pair}" / "run"
                out.parent.mkdir(parents=True)
                before = os.getloadavg()[0]
                r = run_arm(arm, args.steps, out, args.prompts)
                r.update(pair=pair, load_1min_before=round(before, 2), load_1min_after=round(os.getloadavg()[0], 2))
                result["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("right", "right_4bit")}), flush=True)
                if arm == "default":  # after each pair: a command stopped at its time budget keeps what finished
                    result["summary"] = summarize(result["runs"])
                    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
