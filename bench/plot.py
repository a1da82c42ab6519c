"""One picture of a `make bench` run, next to its JSON: bench-cpu-<date>T<HHMM>Z.png (and bench-gpu-*.png for
the GPU ladder, `plot_gpu_ladders`: tokens/s per GPU of every rung, with MFU, peak memory and the speed-up).

    python -m bench.plot bench/results/bench-cpu-2026-11-22T1346Z.json   # re-plot a stored run

Three panels, each a comparison the run measured side by side:
1. pack overhead against the bare loop, per layout: the median's overhead with its 95% bootstrap interval (wall
   clock and, where recorded, CPU time), each repetition's ratio as a dot, the 5% goal as a line;
2. time to first step, rank 0's critical path phase by phase in both start orders (serial above, overlap below),
   with the launcher's checks drawn where they run;
3. data preparation, examples/s of each path, packing off and on.
The interval is recomputed from the stored step times (`bench_overhead.summarize`), so files written before it
existed plot the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.ladder_goals import GOAL_SPEEDUP, ladder_title
from bench.overhead import summarize

# Phases of bench_first_step.phases() grouped by what they are, in critical-path order (the names' first words).
PHASE_GROUPS = (
    ("launcher", ("launcher:",)),
    ("accelerate + torchrun start", ("accelerate launch",)),
    ("rank: start + imports", ("rank: interpreter", "rank: imports")),
    ("rank: gate", ("rank: waits",)),
    ("rank: recipe, model, LoRA", ("rank: builds", "rank: run report", "rank: SFTTrainer start", "rank: model load",
                                   "rank: LoRA", "rank: rest of")),
    ("rank: dataset preparation", ("rank: dataset preparation",)),
    ("rank: FSDP wrap + first step", ("rank: Trainer.train", "rank: first step")),
)


def grouped_phases(phases: dict[str, float]) -> list[tuple[str, float]]:
    out = []
    for group, prefixes in PHASE_GROUPS:
        out.append((group, sum(v for k, v in phases.items() if k.startswith(prefixes))))
    assert abs(sum(v for _, v in out) - sum(phases.values())) < 1e-9, "a phase fell outside PHASE_GROUPS"
    return out


def plot_overhead(ax, overhead: dict) -> None:
    rows = []  # (label, summary of one clock, per-repetition ratios or None)
    for name, layout in overhead["layouts"].items():
        s = summarize(layout)
        where = f"{name}{', FSDP2' if layout.get('fsdp') else ''}"
        rows.append((f"{where}, wall clock", s, s["per_rep_ratio"]))
        if s["cpu_time"]:
            rows.append((f"{where}, CPU time", s["cpu_time"], None))
    for y, (label, s, reps) in enumerate(rows):
        lo, hi = s["overhead_pct_ci95"]
        mid = s["overhead_pct"]
        ax.errorbar(mid, y, xerr=[[mid - lo], [hi - mid]], fmt="o", color="C0", capsize=4)
        if reps:
            ax.plot([100 * (r - 1) for r in reps], [y + 0.2] * len(reps), ".", color="C7")
        ax.annotate(f"{mid:+.1f}% [{lo:+.1f}, {hi:+.1f}]", (mid, y - 0.3), ha="center", fontsize=8)
    goal = rows[0][1]["goal_pct"] if rows else 5.0
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(goal, color="C3", ls="--", lw=1, label=f"goal: < {goal:.0f}%")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(-0.8, len(rows) - 0.4)
    ax.invert_yaxis()
    paired = all(layout.get("design") == "paired" for layout in overhead["layouts"].values())
    ax.set(xlabel="pack step time vs bare loop (%); dot: median with 95% interval, grey: repetitions",
           title="Pack overhead per training step" + (" (each pack step paired with a bare step)" if paired else
                                                      " (separate runs per side)"))
    ax.legend(loc="lower right", fontsize=8)


def plot_first_step(ax, first_step: dict) -> None:
    orders = list(first_step["phases_s"])  # serial, overlap
    for y, order in enumerate(orders):
        left = 0.0
        for i, (group, seconds) in enumerate(grouped_phases(first_step["phases_s"][order])):
            ax.barh(y, seconds, left=left, height=0.5, color=f"C{i}", label=group if y == 0 else None)
            left += seconds
        ax.annotate(f"{left:.2f} s", (left, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
        run = first_step["probed_runs"][order]
        if order != "serial" and run.get("launcher_checks_done_s") is not None:
            # the launcher's checks, overlapping the ranks' start and imports
            start = run["launcher_starts_ranks_s"]
            end = run["launcher_checks_done_s"]
            ax.barh(y + 0.36, end - start, left=start, height=0.08, color="black")
            ax.annotate(f"launcher's checks, while the ranks start ({end - start:.1f} s)", (end, y + 0.36),
                        xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(orders)), orders)
    ax.set(xlabel="seconds from the command's start until rank 0's first step ends",
           title="Time to first step of the default run, by phase")
    ax.set_ylim(len(orders) - 0.4, -0.5)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.22))


def plot_data(ax, data: dict) -> None:
    paths = [k for k in ("pack", "trl_default", "trl_recipe_length") if k in data["summary"]]
    width = 0.8 / len(paths)
    for j, path in enumerate(paths):
        for i, suffix in enumerate(("", "_packing")):
            value = data["summary"][path + suffix]["median_examples_per_s"]
            bars = ax.bar(i + (j - (len(paths) - 1) / 2) * width, value, width, color=f"C{j}",
                          label=path if i == 0 else None)
            ax.bar_label(bars, labels=[f"{value:,.0f}"], fontsize=7)
    ax.set_xticks([0, 1], ["packing off", "packing on"])
    ax.set(ylabel="examples/s (load + prepare, median)",
           title=f"Data preparation, {data['examples']:,} examples")
    ax.legend(fontsize=8)


def draw_panels(path: Path, items: list, draw, width: float, height: float, title: str, color: str = "black") -> Path:
    """One panel per item, top to bottom, `draw(ax, item)` on each, the title above, saved to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display in CI or on a login node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(max(1, len(items)), 1, figsize=(width, height * max(1, len(items))), squeeze=False)
    for ax, item in zip(axes[:, 0], items):
        draw(ax, item)
    fig.suptitle(title, fontsize=10, color=color)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot(result: dict, path: Path) -> Path:
    panels = [(plot_overhead, "overhead"), (plot_first_step, "first_step"), (plot_data, "data")]
    panels = [(f, result[key]) for f, key in panels if result.get(key)]
    title = (f"make bench, {result['device']['name']} ({result['device']['cores']} cores), {result['date']}"
             f"{' (quick: plumbing only)' if result.get('quick') else ''}")
    return draw_panels(path, panels, lambda ax, panel: panel[0](ax, panel[1]), 10, 4.6, title)


def plot_ladder(ax, lad: dict, plumbing: bool) -> None:
    """One ladder: tokens/s per GPU of every rung, MFU and peak memory written on the bar, and what did not run."""
    rungs = lad["rungs"]
    base = next((r for r in rungs if r["id"] == "0" and r["status"] == "measured"), None)
    top = max((r["figures"]["tokens_per_s_per_gpu"] for r in rungs if r["status"] == "measured"), default=1.0)
    for y, r in enumerate(rungs):
        if r["status"] != "measured":
            detail = (r.get("reason") or r.get("error") or "")[:70]
            ax.annotate(f"{r['status']}: {detail}", (0, y), xytext=(4, 0), textcoords="offset points", va="center",
                        fontsize=7, color="C7")
            continue
        f = r["figures"]
        tps = f["tokens_per_s_per_gpu"]
        ax.barh(y, tps, color="C0" if r["id"] != "0" else "C7")
        mem = (f"{f['peak_allocated_gib']:.1f} GiB" if f["peak_allocated_gib"] is not None
               else f"host RSS {f['host_rss_gib']:.2f} GiB")
        parts = [f"{tps:,.0f}", f"MFU {100 * f['mfu']:.1f}%" if f["mfu"] is not None else "MFU n/a", mem]
        if base:
            parts.append(f"{tps / base['figures']['tokens_per_s_per_gpu']:.2f}x rung 0")
        ax.annotate(", ".join(parts), (tps, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    if base:  # the goal: the tuned defaults at least 1.5 x the baseline's tokens/s
        goal = GOAL_SPEEDUP * base["figures"]["tokens_per_s_per_gpu"]
        ax.axvline(goal, color="C3", ls="--", lw=1, label=f"goal: {GOAL_SPEEDUP}x rung 0")
        ax.legend(loc="upper right", fontsize=7)
        top = max(top, goal)
    ax.set_xlim(0, top * 1.6)  # room for the labels
    ax.set_yticks(range(len(rungs)), [f"{r['id']}: {r['name']}"[:48] for r in rungs], fontsize=8)
    ax.invert_yaxis()
    unit = "process" if plumbing else "GPU"
    ax.set(xlabel=f"tokens/s per {unit} (non-padding)", title=f"{ladder_title(lad)}, {lad['processes']} {unit}(s)")


def plot_gpu_ladders(result: dict, path: Path) -> Path:
    """The picture of a bench_gpu.py run: one panel per ladder (size x method x GPUs), rungs top to bottom."""
    warning = " - PLUMBING RUN ON CPU: NOT A BENCHMARK" if result["plumbing_only"] else ""
    return draw_panels(path, result["ladders"], lambda ax, lad: plot_ladder(ax, lad, result["plumbing_only"]), 11, 3.6,
                       f"make bench-gpu, {result['device'].get('name', '')}, {result['date']}{warning}",
                       "C3" if warning else "black")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench-cpu-*.json or bench-gpu-*.json files")
    for src in ap.parse_args(argv).results:
        result = json.loads(src.read_text())
        draw = plot_gpu_ladders if result.get("benchmark") == "gpu-ladder" else plot
        print(f"[bench-plot] {draw(result, src.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
