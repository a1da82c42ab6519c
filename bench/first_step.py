"""Benchmark: time to the first optimizer step of the default run, broken down by phase.

    python -m bench.first_step       # part of `make bench`

Runs the default recipe's real command, unmodified:

    python -m fsdp_recipes.launch.launcher tiny-cpu-lora --max_steps 1 --eval_strategy no --save_merged_model false \\
        --output_dir <tmp>

with the tiny assets already built (the first ever run also builds them, ~2 s, reported as `assets_build_s` when
this benchmark had to build them) and an empty datasets cache (so the data is really loaded and tokenized, as in
a first run; a repeated run reuses datasets' cached Arrow files).

It runs the command in both start orders, side by side: `overlap` (the default: the launcher starts the ranks, then
checks the recipe while they import; they wait at start_gate.py's gate) and `serial` (FSDP_RECIPES_OVERLAP_CHECKS=0:
check, then start the ranks, the order before the gate). Phases of rank 0's critical path come from clocks, not
estimates, and add up to the end of its first step:

- the launcher until it starts `accelerate launch` (its line "starting N process(es)"): interpreter start and
  imports, then, in the serial order only, all of its checks;
- `accelerate launch` + torchrun until the rank processes exist (their creation time, read with psutil while the
  run goes on);
- inside rank 0, from its process creation: interpreter start, imports, the wait at the gate for the launcher's
  checks, the configuration and checks, dataset loading (these from the run report's `startup_s`), model load, LoRA wrap, dataset preparation (TRL's
  `_prepare_dataset`), the rest of the SFTTrainer construction, the FSDP wrap + optimizer
  (`Trainer._prepare_for_training`), and the first step itself.

The launcher's own clocks are recorded beside them: its first output line and its "checks passed in X s".

The in-rank clocks come from a probe that wraps those functions with timers: `FSDP_RECIPES_BENCH_PROBE=<file>`
plus a generated `sitecustomize.py` on PYTHONPATH (in a temp dir) make each rank call `install_probe()` at start-up.
Nothing in the pack's code changes; the probe imports torch/transformers/TRL/PEFT/accelerate/datasets up front to
reach the functions it wraps, so the "imports" phase is exactly those imports, which the entry point would
otherwise do a little later. The end-to-end time is measured without the probe too (`unprobed_total_s`), to show
what the probe costs. Separately, `python -X importtime` lists the slowest imports of the entry point.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROBE_ENV = "FSDP_RECIPES_BENCH_PROBE"
SITECUSTOMIZE = f"""import os
if os.environ.get("{PROBE_ENV}") and "LOCAL_RANK" in os.environ:
    from bench.first_step import install_probe
    install_probe()
"""


# ---- the probe, inside each rank ---------------------------------------------------------------------------------

def install_probe() -> None:
    """Wrap the phases of the entry point with clocks; rank 0 writes them as JSON when the process exits."""
    import atexit

    import psutil

    marks: dict[str, float] = {"process_created": psutil.Process().create_time(), "probe_start": time.time()}
    import accelerate  # noqa: F401  the imports the entry point needs, timed as one phase
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import trl
    import trl.trainer.sft_trainer as sft_mod

    marks["imports_done"] = time.time()

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            marks.setdefault(f"{label}_start", time.time())
            try:
                return original(*args, **kwargs)
            finally:
                marks.setdefault(f"{label}_end", time.time())

        setattr(owner, name, wrapper)

    # The pack's own phases (the gate, the parse, the data) are in its run report (metrics.json startup_s); the
    # probe times what happens inside the libraries.
    timed(sft_mod, "create_model_from_path", "model_load")
    timed(sft_mod, "get_peft_model", "peft_wrap")
    timed(trl.SFTTrainer, "_prepare_dataset", "dataset_prep")  # called for train (and eval): first start, last end
    timed(trl.SFTTrainer, "__init__", "sft_trainer_init")
    timed(transformers.Trainer, "_prepare_for_training", "fsdp_wrap_and_optimizer")
    handler = transformers.trainer_callback.CallbackHandler
    for event, label in (("on_train_begin", "train_begin"), ("on_step_end", "first_step_end")):
        timed(handler, event, label)

    def dump() -> None:
        if os.environ.get("RANK", "0") == "0":
            Path(os.environ[PROBE_ENV]).write_text(json.dumps(marks))

    atexit.register(dump)


# ---- the driver --------------------------------------------------------------------------------------------------

ORDERS = {"overlap": {}, "serial": {"FSDP_RECIPES_OVERLAP_CHECKS": "0"}}


def launch_cmd(out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "fsdp_recipes.launch.launcher", "tiny-cpu-lora", "--max_steps", "1", "--eval_strategy", "no",
            "--save_merged_model", "false", "--output_dir", str(out_dir)]


def run_default(work: Path, probe: bool, order: str = "overlap") -> dict:
    """One launch of the default command; line arrival times and the ranks' creation times."""
    out_dir = work / f"run-{order}{'-probe' if probe else ''}"
    # A fresh datasets cache: a first run of the default prepares its data (datasets would otherwise reuse the
    # tokenized Arrow files of an earlier run with the same fingerprint and skip the work).
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_CACHE=str(work / f"hf-datasets-{order}-{probe}"),
               **ORDERS[order])
    env.pop("MASTER_PORT", None)
    marks_file = work / f"probe-{order}.json"
    if probe:
        (work / "site").mkdir(exist_ok=True)
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"), env.get("PYTHONPATH")]))
        env[PROBE_ENV] = str(marks_file)
    t0 = time.time()
    proc = subprocess.Popen(launch_cmd(out_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    ranks: dict[int, float] = {}

    def watch() -> None:  # the rank processes' creation times (psutil), polled while the run goes on
        import psutil

        parent = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                for child in parent.children(recursive=True):
                    cmd = child.cmdline()
                    # the ranks run `python -m fsdp_recipes.train.entry`; the accelerate CLI's own command names the
                    # module too, after `launch`
                    if "fsdp_recipes.train.entry" in cmd and "launch" not in cmd:
                        ranks.setdefault(child.pid, child.create_time())
            except psutil.Error:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    lines = []
    for line in proc.stdout:
        lines.append((time.time() - t0, line.rstrip("\n")))
    rc = proc.wait()
    total = time.time() - t0
    watcher.join()
    if rc != 0:
        tail = "\n".join(text for _, text in lines[-15:])
        raise RuntimeError(f"the default run ({order}) failed with code {rc}:\n{tail}")
    line_at = lambda pattern: next(t for t, text in lines if re.search(pattern, text))  # noqa: E731
    checks = next(float(m.group(1)) for _, text in lines if (m := re.search(r"checks passed in ([\d.]+)s", text)))
    metrics = json.loads((out_dir / "metrics.json").read_text())
    res = {
        "order": order,
        "total_s": total,
        "launcher_first_output_s": line_at(r"^\[launch\]"),
        "launcher_starts_ranks_s": line_at(r"^\[launch\].*starting \d+ process"),
        "launcher_checks_s": checks,
        "launcher_checks_done_s": line_at("checks passed in"),
        "ranks_created_s": sorted(c - t0 for c in ranks.values()),
        "time_to_first_step_s_from_run_report": metrics["time_to_first_step_s"],
        "run_report_wall_clock_s": metrics["wall_clock_s"],
    }
    if probe:
        m = json.loads(marks_file.read_text())
        res["rank0_marks_s"] = {k: v - t0 for k, v in m.items()}
        # rank 0's start-up as its run report gives it, from the same process creation time
        res["rank0_marks_s"].update({k: res["rank0_marks_s"]["process_created"] + v
                                     for k, v in metrics["startup_s"].items()})
    return res


def phases(run: dict) -> dict[str, float]:
    """Consecutive phases (seconds) of rank 0's critical path; they add up to the first step's end."""
    m = run["rank0_marks_s"]
    points = [
        ("launcher: python start, imports (serial: and all its checks), until it starts `accelerate launch`",
         run["launcher_starts_ranks_s"]),
        ("accelerate launch + torchrun start the ranks", m["process_created"]),
        ("rank: interpreter start", m["probe_start"]),
        ("rank: imports (torch, transformers, trl, peft, accelerate, datasets)", m["imports_done"]),
        ("rank: waits at the gate for the launcher's checks", m["through_gate"]),
        ("rank: builds its configuration from the launcher's reading, checks", m["configured"]),
        ("rank: run report set-up, dataset load", m["data_loaded"]),
        ("rank: SFTTrainer start to model load", m["model_load_start"]),
        ("rank: model load (from_pretrained)", m["model_load_end"]),
        ("rank: LoRA wrap (get_peft_model)", m["peft_wrap_end"]),
        ("rank: dataset preparation (tokenize, template, truncate)", m["dataset_prep_end"]),
        ("rank: rest of SFTTrainer construction", m["sft_trainer_init_end"]),
        ("rank: Trainer.train until FSDP wrap + optimizer are done", m["fsdp_wrap_and_optimizer_end"]),
        ("rank: first step (forward, backward, optimizer, callbacks)", m["first_step_end_end"]),
    ]
    out, prev = {}, 0.0
    for name, t in points:
        out[name] = t - prev
        prev = t
    return out


IMPORT_ORDER = ("torch", "transformers", "datasets", "accelerate", "peft", "trl", "trl.trainer.sft_trainer",
                "fsdp_recipes.train.entry", "fsdp_recipes.metrics.run_report")


def slowest_imports() -> dict:
    """`python -X importtime` of what a rank imports, one package after the other: what each one adds."""
    code = "; ".join(f"import {m}" for m in IMPORT_ORDER)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True)
    wall = time.time() - t0
    added: dict[str, float] = {}
    for line in p.stderr.splitlines():
        # "import time: self [us] | cumulative [us] | package"; the statements above are the unindented entries
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S+)$", line)
        if m and m.group(2) in IMPORT_ORDER:
            added[m.group(2)] = int(m.group(1)) / 1e6
    return {"wall_s": wall, "in_order_cumulative_s": added,
            "note": "each figure is what that import adds after the ones before it; -X importtime inflates them"}


def run(work: Path) -> dict:
    """Both start orders, probed and not, interleaved: serial, overlap, serial, overlap."""
    from fsdp_recipes.api import ensure_tiny_assets

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ensure_tiny_assets(quiet=True)
    assets = time.time() - t0
    probed, plain = {}, {}
    for order in ("serial", "overlap"):
        probed[order] = run_default(work, probe=True, order=order)
    for order in ("serial", "overlap"):
        plain[order] = run_default(work, probe=False, order=order)
    first_step = {o: r["rank0_marks_s"]["first_step_end_end"] for o, r in probed.items()}
    return {
        "command": "python " + " ".join(launch_cmd(Path("<tmp>"))[1:]),
        "orders": {o: ORDERS[o] for o in ORDERS},
        "assets_build_s": assets if assets > 0.5 else 0.0,
        "probed_runs": probed,
        "phases_s": {o: phases(r) for o, r in probed.items()},
        "first_step_end_s": first_step,
        "overlap_saves_s": first_step["serial"] - first_step["overlap"],
        "unprobed_total_s": {o: r["total_s"] for o, r in plain.items()},
        "unprobed_runs": plain,
        "imports": slowest_imports(),
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as tmp:
        res = run(Path(tmp))
    for order, ph in res["phases_s"].items():
        print(f"{order}:")
        for name, s in ph.items():
            print(f"{s:7.2f} s  {name}")
    print("first step ends at " + ", ".join(f"{s:.2f} s ({o})" for o, s in res["first_step_end_s"].items())
          + "; whole command unprobed " + ", ".join(f"{s:.2f} s ({o})" for o, s in res["unprobed_total_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
