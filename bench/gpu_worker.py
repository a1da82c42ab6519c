"""One rung of the GPU ladder (bench_gpu.py), run inside `accelerate launch`:

    accelerate launch --config_file <rung>.yaml -m bench.gpu_worker \
        --warmup 4 -- <the entry point's flags>

The entry point's trainer (run_config.parse_args + train/build.py trainer_for, as bench_overhead.py drives it), with the warm-up
steps excluded from the run report's clock and token counters. Every rung's change is a recipe setting: float8 is
the entry point's `--float8` (float8.py), regional compilation the rung's accelerate YAML (`dynamo_config`). Its
figures are the run's own metrics.json, which bench_gpu.py reads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

WARMUP_FILE = "bench_warmup.json"  # in the rung's output_dir: peaks up to the end of warm-up, graphs compiled by then


def worker(argv: list[str]) -> int:
    """One rung: the entry point's trainer, with warm-up excluded from the report's clock."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, required=True)
    split = argv.index("--")
    wargs = ap.parse_args(argv[:split])

    from fsdp_recipes.api import parse_args, run_report_for, set_up_process, trainer_for

    set_up_process()  # a no-op with a GPU
    import torch
    from transformers import TrainerCallback

    from fsdp_recipes.api import write_json_atomic

    cfg = parse_args(argv[split + 1:])
    from fsdp_recipes.api import settle_speed_options

    settle_speed_options(cfg)  # as the entry point does: the checkpointing policy onto TrainingArguments' fields
    training = cfg.training
    compiled = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() != "NO"  # set by the YAML's dynamo_config
    if compiled and training.use_liger_kernel:
        # Liger's RoPE runs behind @torch.compiler.disable (liger_kernel/backends/dispatch.py, 0.8.5): a graph break
        # inside every compiled layer, within the activation-checkpoint region dynamo must trace whole. Inductor
        # fuses RoPE itself, so the compiled rungs keep Liger's RMSNorm and SwiGLU and leave RoPE to the compiler.
        training.liger_kernel_config = {**(training.liger_kernel_config or {}), "rope": False}
    report = run_report_for(cfg, "bench-gpu")
    report.resolved_args["bench_worker"] = {**vars(wargs), "accelerate_dynamo": {
        k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_DYNAMO_")}}

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class ExcludeWarmup(TrainerCallback):
        """First in the callback list: restarts the report's clock and counters once the warm-up steps are done,
        and synchronizes before the report reads the clock at the end."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == wargs.warmup:
                sync()
                # The peaks so far include the model load, compilation and autotuning; reset here, the run report's
                # peaks cover the measured steps only. (peaks_so_far is a collective: every rank is at this step.)
                peaks = report.peaks_so_far()
                if report.is_main:
                    from torch._dynamo.utils import counters

                    write_json_atomic(Path(training.output_dir) / WARMUP_FILE, {
                        "device_allocated_bytes": int(peaks["allocated"]) if peaks["allocated"] >= 0 else None,
                        "device_reserved_bytes": int(peaks["reserved"]) if peaks["reserved"] >= 0 else None,
                        "host_rss_bytes": int(peaks["host_rss"]),
                        "compiled_graphs": counters["stats"]["unique_graphs"]})  # evidence that compile ran
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                report.train_start = time.time()
                report.tokens.reset()  # in place: the trainer holds this counter too

        def on_train_end(self, args, state, control, **kwargs):
            sync()

    try:
        trainer = trainer_for(cfg, report)
        trainer.callback_handler.callbacks.insert(0, ExcludeWarmup())
        trainer.train()
    except BaseException as err:
        report.finalize("failed", error=f"{type(err).__name__}: {err}")
        raise
    report.finalize("completed")
    if hasattr(trainer, "end"):
        trainer.end()
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
