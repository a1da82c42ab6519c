"""One rung of the GPU ladder (bench_gpu.py), run inside `accelerate launch`:

    accelerate launch --config_file <rung>.yaml -m fsdp_recipes.bench_gpu_worker \
        --warmup 4 --compile none|inductor|aot_eager --float8 false|true -- <the entry point's flags>

The entry point's trainer (train_sft.parse_args + build_trainer, as bench_overhead.py drives it), plus what the
entry point has no flag for (regional torch.compile, torchao float8), with the warm-up steps excluded from the run
report's clock and token counters. Its figures are the run's own metrics.json, which bench_gpu.py reads.
"""

from __future__ import annotations

import argparse
import sys
import time


def worker(argv: list[str]) -> int:
    """One rung: the entry point's trainer, plus compile/float8, with warm-up excluded from the report's clock."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--compile", choices=["none", "inductor", "aot_eager"], default="none")
    ap.add_argument("--float8", default="false")
    split = argv.index("--")
    wargs = ap.parse_args(argv[:split])

    from fsdp_recipes import cpu_fsdp

    cpu_fsdp.enable()  # a no-op with a GPU
    import torch
    from transformers import TrainerCallback
    from trl import get_peft_config

    from fsdp_recipes import train_sft
    from fsdp_recipes.preemption import PreemptionCallback
    from fsdp_recipes.run_report import COUNTS, RunReportCallback

    script, training, model_args, mixture, pack = train_sft.parse_args(argv[split + 1:])
    peft_config = get_peft_config(model_args)
    report = RunReportCallback(training.output_dir, train_sft.resolved_args(script, training, model_args, mixture,
                                                                            pack, peft_config), "bench-gpu")
    report.resolved_args["bench_worker"] = vars(wargs)

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class ExcludeWarmup(TrainerCallback):
        """First in the callback list: restarts the report's clock and counters once the warm-up steps are done,
        and synchronizes before the report reads the clock at the end."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == wargs.warmup:
                sync()
                report.train_start = time.time()
                for k in COUNTS:  # in place: the trainer holds this counter too
                    setattr(report.tokens, k, 0)

        def on_train_end(self, args, state, control, **kwargs):
            sync()

    try:
        trainer = train_sft.build_trainer(script, training, model_args, mixture, pack, peft_config, report,
                                          PreemptionCallback())
        model = trainer.model
        if wargs.float8 == "true":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        if wargs.compile != "none":
            for layer in model.model.layers:  # compiled in place: FSDP2 still finds MistralDecoderLayer to wrap
                layer.compile(backend=wargs.compile)
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
