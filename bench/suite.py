"""`make bench`: the pack's speed, measured. CPU part everywhere; the GPU part only where CUDA exists.

    python -m bench.suite [--results bench/results] [--quick]

Runs, in this order (each module's docstring says what it includes and excludes):

1. bench_overhead: the pack's training step against a bare PyTorch loop, 1 process and 2-process FSDP2.
2. bench_first_step: time to the first step of the default run, phase by phase.
3. bench_data: data preparation throughput, the entry point's path against TRL's default.
4. bench_gpu, only where torch sees a CUDA device: the GPU ladder (1B and 8B Mistral, rung by rung; see its
   docstring), which writes its own bench/results/bench-gpu-<device>-<date>T<HHMM>Z.json. It has never run on a GPU yet.

Writes bench/results/bench-cpu-<date>T<HHMM>Z.json (device, core count, load average before and after, versions, date,
every figure and every repetition) and its picture beside it (.png, bench_plot.py), and prints a markdown table.
Without a CUDA device it says the GPU table is pending, and it never prints a GPU figure it did not measure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

GPU_PENDING = "GPU table pending: no CUDA device here"
GPU_NO_DEVICE = "GPU table pending: torch reports CUDA available but sees no device"


def load_average() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def environment() -> dict:
    from fsdp_recipes.api import device_info, versions

    return {
        "device": {"type": "cpu", "name": device_info()["name"], "cores": os.cpu_count()},
        "host": platform.node(),
        "versions": versions(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def table(result: dict) -> str:
    """The markdown table of every headline figure; the JSON holds the repetitions behind each median."""
    from bench.overhead import describe

    lines = ["| benchmark | figure | value |", "|---|---|---:|"]
    ov = result.get("overhead")
    if ov:
        for name, layout in ov["layouts"].items():
            s = layout["summary"]
            what = f"overhead, {name} ({'FSDP2, ' if layout['fsdp'] else ''}{layout['torch_threads']} thread(s)/rank)"
            lines.append(f"| {what} | bare loop, median s/step | {s['median_step_s']['bare']:.3f} |")
            lines.append(f"| {what} | pack (SFTTrainer + callbacks), median s/step | {s['median_step_s']['pack']:.3f} |")
            lines.append(f"| {what} | pack overhead ({s['statistic']} - 1) | {s['overhead_pct']:+.1f}% |")
            lo, hi = s["overhead_pct_ci95"]
            lines.append(f"| {what} | 95% bootstrap interval; vs the {s['goal_pct']:.0f}% goal | "
                         f"{lo:+.1f}% to {hi:+.1f}%; {s['verdict']} |")
            lines.append(f"| {what} | per-repetition ratios | {', '.join(f'{r:.3f}' for r in s['per_rep_ratio'])} |")
            c = s["cpu_time"]
            if c:
                lines.append(f"| {what} | by CPU time: bare / pack median s/step; overhead, 95% interval | "
                             f"{c['median_step_s']['bare']:.3f} / {c['median_step_s']['pack']:.3f}; "
                             f"{describe(c)} |")
    fs = result.get("first_step")
    if fs:
        orders = list(fs["phases_s"])  # serial, overlap

        def both(value, fmt=".2f"):  # "serial / overlap"
            return " / ".join(format(value(o), fmt) for o in orders)

        lines.append(f"| time to first step | phase of rank 0's critical path | {' / '.join(orders)} |")
        for name in fs["phases_s"][orders[-1]]:
            lines.append(f"| time to first step | {name} | {both(lambda o: fs['phases_s'][o][name])} s |")
        lines.append(f"| time to first step | launcher's checks (its \"checks passed in\") | "
                     f"{both(lambda o: fs['probed_runs'][o]['launcher_checks_s'], '.1f')} s |")
        lines.append(f"| time to first step | first step ends (probed runs) | "
                     f"{both(lambda o: fs['first_step_end_s'][o])} s |")
        lines.append(f"| time to first step | whole command, unprobed | {both(lambda o: fs['unprobed_total_s'][o])} s |")
    data = result.get("data")
    if data:
        for key, v in data["summary"].items():
            if key.startswith("ratio"):
                lines.append(f"| data prep ({data['examples']:,} examples) | {key} | {v:.2f} |")
            else:
                lines.append(f"| data prep ({data['examples']:,} examples) | {key}: load + prepare, median "
                             f"examples/s | {v['median_examples_per_s']:,.0f} |")
    return "\n".join(lines)


def gpu_part(results: Path = Path("bench/results")) -> str:
    """The GPU ladder (bench_gpu.py) where torch sees a CUDA device: its table and the path of its JSON; else why
    not. Every GPU figure comes from a run of the ladder, none from here."""
    import torch

    if not torch.cuda.is_available():
        return GPU_PENDING
    if torch.cuda.device_count() == 0:
        return GPU_NO_DEVICE
    from bench import gpu as bench_gpu

    _, text, path = bench_gpu.run(["--results", str(results)])
    return f"{text}\nGPU ladder written to {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the plumbing (not for publishing)")
    args = ap.parse_args(argv)

    from bench import data as bench_data
    from bench import first_step as bench_first_step
    from bench import overhead as bench_overhead
    from fsdp_recipes.api import file_stamp, write_json_atomic

    result = {"benchmark": "cpu", "quick": args.quick, **environment(), "load_average_before": load_average()}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        work = Path(tmp)
        print("[bench] 1/3 pack overhead vs a bare loop", flush=True)
        quick_sizes = dict(batch=2, seq=16, warmup=1, steps=2, reps=1)
        result["overhead"] = bench_overhead.run(work / "overhead", quick_sizes if args.quick else None,
                                                shape=bench_overhead.QUICK_SHAPE if args.quick else
                                                bench_overhead.SHAPE)
        print("[bench] 2/3 time to first step of the default run", flush=True)
        result["first_step"] = bench_first_step.run(work / "first-step")
        print("[bench] 3/3 data preparation throughput", flush=True)
        result["data"] = bench_data.run(work / "data", **(dict(examples=500, reps=1) if args.quick else {}))
    result["duration_s"] = time.time() - t0
    result["load_average_after"] = load_average()
    result["gpu"] = gpu_part(args.results)
    path = args.results / f"bench-cpu-{file_stamp(result['date'])}{'-quick' if args.quick else ''}.json"
    write_json_atomic(path, result)
    from bench import plot as bench_plot

    picture = bench_plot.plot(result, path.with_suffix(".png"))
    print(f"\nCPU: {result['device']['name']}, {result['device']['cores']} cores; {result['date']}; load average "
          f"before {result['load_average_before']}, after {result['load_average_after']}")
    print(table(result))
    print(f"\n{result['gpu']}")
    print(f"written to {path} and {picture.name} ({result['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
