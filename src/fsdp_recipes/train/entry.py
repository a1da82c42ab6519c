"""The rank entry point: one lifecycle for every trainer kind, driven by a recipe YAML (config/run_config.py).

    accelerate launch --config_file recipes/<name>/accelerate.yaml \\
        -m fsdp_recipes.train.entry --config recipes/<name>/sft.yaml [--any_field value ...]

Parse, start gate, load, build, callbacks, preemption, final-save check, report: the same for SFT and DPO. What
differs (TRL's trainer class, the data and its checks, the logs the report keeps) is the kind's module in
train/kinds/, chosen by the recipe's `trainer` field.
"""

from __future__ import annotations

import os
import sys
import time

from fsdp_recipes import dist, library_logs, speed
from fsdp_recipes.checkpoint.resume_choice import checkpoint_to_resume
from fsdp_recipes.checkpoint.shared_dir import check_output_dir_shared
from fsdp_recipes.config.mesh import launched_mesh
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, cli
from fsdp_recipes.patches import cpu_fsdp, guard
from fsdp_recipes.train import failure_record, kinds, start_gate
from fsdp_recipes.train.run_checks import parse_and_check


def import_training_stack() -> None:
    """What every rank imports anyway (4-5 s on 2 cores), done before the start gate so that it overlaps the
    launcher's checks. Importing has no side effects a failed check would have to undo."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    from trl import DPOTrainer, SFTTrainer  # noqa: F401  (trl imports lazily: this pulls in transformers' Trainer)

    from fsdp_recipes.checkpoint import markers  # noqa: F401
    from fsdp_recipes.data import loading  # noqa: F401
    from fsdp_recipes.metrics import run_report  # noqa: F401
    from fsdp_recipes.train import preemption  # noqa: F401


def quiet_replica(cfg: RunConfig) -> None:
    """On every rank but 0: no progress bars, no library warnings, transformers' log at errors only. The ranks run
    the same code, so rank 0 already shows each of these once; N copies of a warning tell the user nothing more.
    Errors still show on every rank. `log_level_replica` is moved from transformers' default (warning) to error
    unless the recipe set it to something else."""
    import warnings

    import datasets
    import transformers

    warnings.filterwarnings("ignore")
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    if cfg.training.log_level_replica == "warning":  # SFTConfig's default: the Trainer applies it at init
        cfg.training.log_level_replica = "error"


def quiet_console(cfg: RunConfig) -> None:
    """What a person reading the console cannot act on stays in the rank's log (train/console.py)."""
    import torch

    from fsdp_recipes.train import console

    console.keep_upstream_warnings_in_log()
    console.no_loading_bars()
    if not torch.accelerator.is_available():  # pinning needs one: without, torch warns for every dataloader
        cfg.training.dataloader_pin_memory = False


@cli
def main(argv: list[str] | None = None) -> int:
    """Every exception is written to torchrun's error file for this rank (failure_record.py). Under the launcher, which
    prints one line for the first failing rank and appends the traceback to this rank's log, the rank then exits
    without printing it; run directly, it raises as usual (a UserError is one `error:` line)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        failure_record.mark_rank()  # first: the launcher holds this rank's output until it knows which rank it is
        failure_record.die_with_parent()  # torchrun is the parent: a rank must not outlive it (nor the launcher)
    try:
        return run(argv)
    except (SystemExit, KeyboardInterrupt):  # the start gate's exits; Ctrl-C is the run report's "interrupted"
        raise
    except BaseException as err:
        failure_record.record(err)
        if not start_gate.under_launcher():
            raise
        return 2 if failure_record.STATE["phase"] == "setup" else 1


ENDED: list = []  # the trainers of runs that are over, freed by the process's exit, never by Python


def run(argv: list[str] | None = None) -> int:
    code, trainer = train_once(argv)
    if trainer is not None and hasattr(trainer, "end"):  # transformers >= 5.18: ends trackers and the process group
        trainer.end()
    # Kept to the exit (exit_without_teardown): freeing a DDP model's reducer frees the gloo process group, whose
    # destructor joins gloo's worker threads, and once one never returned: a completed DDP run's rank hung there
    # (bench/compare.py's ddp launch, 2026-11-27, torch 2.13.0): the teardown exit_without_teardown skips, met early
    ENDED.append(trainer)
    return code


def train_once(argv: list[str] | None = None) -> tuple[int, object]:
    """One run on this rank, up to its report: (exit code, the trainer of a completed run, else None). It leaves
    the process group up, so that one process can train several runs in turn (scripts/arch_matrix.py); `run` ends it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    library_logs.divert(failure_record.details)  # before peft imports bitsandbytes (tensor_parallel imports it)
    from fsdp_recipes.train import tensor_parallel

    tensor_parallel.set_up_process()  # a tp mesh's FSDP is transformers', not accelerate's (its docstring)
    cpu_fsdp_active = cpu_fsdp.enable()  # before any accelerate state exists
    import_training_stack()
    marks = {"imports_done": time.time()}
    start_gate.wait()  # the launcher's checks passed (a no-op without the launcher)
    marks["through_gate"] = time.time()
    # idempotent: the launcher normally built the assets and ran these checks already
    cfg = parse_and_check(argv, quiet=True)
    marks["configured"] = time.time()
    # Parsing built TrainingArguments, which started the process group (accelerate's PartialState). Before anything
    # reads output_dir: on a node that does not share it, auto_resume would pick another checkpoint.

    check_output_dir_shared(cfg.training.output_dir)

    from trl import get_peft_config

    from fsdp_recipes.checkpoint import resume_settings
    from fsdp_recipes.metrics.run_report import RunReportCallback
    from fsdp_recipes.train.build import build_trainer  # its imports need the rank set up (cpu_fsdp, the logs)
    from fsdp_recipes.train.final_save import save_final
    from fsdp_recipes.train.preemption import PreemptionCallback

    is_main = dist.rank() == 0
    kind = kinds.load(cfg.trainer)
    if not is_main:
        quiet_replica(cfg)
    quiet_console(cfg)
    peft_config = get_peft_config(cfg.model)
    speed.settle(cfg)  # recorded as it will run (a 4-bit base's storage dtype)
    # what this run's checkpoints record and a later resume or rerun compares with (checkpoint/resume_settings.py)
    settings = resume_settings.current(cfg, int(os.environ.get("WORLD_SIZE", "1")), kind.RESUME_SETTINGS,
                                       speed.resume_settings(), mesh=launched_mesh())
    resume, changed = checkpoint_to_resume(cfg, settings, say=(lambda line: print(f"[train] {line}", flush=True))
                                           if is_main else None)
    if resume and is_main:
        print(f"[train] resuming from {resume}", flush=True)
    report = RunReportCallback(
        cfg.training.output_dir, cfg.resolved(peft_config),
        cfg.pack.recipe_name, resume_from=resume, prometheus_textfile=cfg.pack.prometheus_textfile,
        trainer=cfg.trainer, reported_logs=kind.REPORTED_LOGS, extra_forwards=kind.extra_forwards(cfg.training),
        loss_falls=not kind.samples(cfg.training),  # a sampling kind's loss is no falling objective
    )
    for name, at in marks.items():
        report.mark(name, at)
    report.resolved_args["cpu_fsdp_adapter"] = cpu_fsdp_active
    report.resolved_args["resume_settings"] = settings
    if changed:
        report.resolved_args["resumed_with_changes"] = changed
    report.resolved_args["patches_applied"] = guard.APPLIED  # the list object: later patches show too
    preemption = PreemptionCallback(report)
    try:
        trainer = build_trainer(cfg, peft_config, report, preemption, resume, settings)
        report.mark("trainer_built")
        if is_main and kind.describe_generation is not None:
            print(f"[train] {cfg.trainer}: {kind.describe_generation(cfg.training)}", flush=True)
        trainer.train(resume_from_checkpoint=resume)
        if preemption.preempted:
            report.finalize("preempted", error=f"stopped by a signal (rank 0 saw: {preemption.signal_received})")
            trainer.accelerator.print(
                f"[train] preempted: checkpoint saved at step {trainer.state.global_step}; "
                f"relaunch the same command to resume (exit code {EXIT_PREEMPTED})"
            )
            return EXIT_PREEMPTED, None
        kind.check_learned(trainer.state.log_history, cfg.training)  # GRPO: rewards that never varied taught nothing
        save_final(trainer, cfg, peft_config, report)
    except KeyboardInterrupt as err:
        report.finalize("interrupted", error=str(err) or "KeyboardInterrupt")
        return EXIT_INTERRUPTED, None
    except BaseException as err:  # UserError included: the report records why the run stopped
        # Only once this run has trained: a failure before its first optimizer step (a mistake in the command
        # that resumes an output_dir) leaves the previous run's report as it was.
        if failure_record.STATE["phase"] == "training":
            report.finalize("failed", error=f"{type(err).__name__}: {err}")
        raise
    if report.finalize("completed") is not None:
        trainer.accelerator.print(f"[train] run report written to {cfg.training.output_dir}/metrics.json")
    return 0, trainer


def exit_without_teardown(code: int) -> None:
    """End a rank whose run is over: the atexit handlers run as usual (logging, trackers, test probes), then the
    process exits without interpreter finalization.

    Gap it fills: in finalization, Python frees what is still alive (the FSDP modules and DeviceMesh keep the
    process group's C++ objects alive past `destroy_process_group`), and a gloo worker thread torn down there can
    abort the process ("terminate called without an active exception", SIGABRT; pytorch PR 179291). CI saw it
    twice, on rank 1, after a completed run whose final save was verified. Everything the run writes is on disk by
    now, so nothing is lost by skipping that teardown."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
