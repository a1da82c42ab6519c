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

from fsdp_recipes import dist, library_logs
from fsdp_recipes.checkpoint.resume_choice import checkpoint_to_resume
from fsdp_recipes.config import quantization
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, cli
from fsdp_recipes.patches import cpu_fsdp, guard
from fsdp_recipes.train import failure_record, float8, kinds, replica_model, start_gate
from fsdp_recipes.train.run_checks import parse_and_check


def make_trainer_class(kind: str = kinds.DEFAULT):
    spec = kinds.load(kind)
    base, count_prepared = spec.trainer_class(), spec.count_prepared

    class Reporting(base):
        """The kind's TRL trainer, feeding the run report's token counter and putting the report's live gauges
        into its logs.

        Gap it fills: Trainer's `include_num_input_tokens_seen` counts either padded or non-padding tokens,
        not both; the run report needs both (and the sequence count for the FLOPs formula).
        """

        token_counter = None
        run_report = None  # RunReportCallback: its tokens/s, MFU and peak memory go into every training log

        def log(self, logs, *args, **kwargs):
            # Here, not in the report's on_log: Trainer.log hands the logs to the `report_to` integrations
            # (TensorBoard, W&B, MLflow), which come before every callback the pack adds. A training log has the loss.
            if self.run_report is not None and "loss" in logs:
                logs.update(self.run_report.tracker_scalars(self.state.global_step))
            super().log(logs, *args, **kwargs)

        def _prepare_inputs(self, inputs):
            prepared = super()._prepare_inputs(inputs)
            if self.token_counter is not None and self.model.training and count_prepared is not None:
                count_prepared(self, prepared, self.token_counter)  # a sampling kind's batch exists only now
            return prepared

        def training_step(self, model, inputs, *args, **kwargs):
            if self.token_counter is not None and "input_ids" in inputs:  # SFT, DPO: the collated batch
                self.token_counter.add(inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            # Stop before the optimizer applies a NaN/inf gradient. The Trainer's default logging_nan_inf_filter
            # already reads this loss on every step (a device sync), and hides a NaN from the logged average.
            if not bool(loss.isfinite().all()):
                raise failure_record.NonFiniteLoss(f"the training loss was {float(loss.float().mean())} at step "
                                            f"{self.state.global_step + 1}")
            return loss

    Reporting.__name__ = Reporting.__qualname__ = f"Reporting{base.__name__}"
    return Reporting


def save_merged(base_path: str, adapter_dir: str, out_dir: str, model_args) -> None:
    """Rank 0: reload base + saved adapter with plain transformers/peft (no FSDP), merge, save. A 4-bit run's base is
    the 4-bit one dequantised to the compute dtype (config/quantization.py says why), not the original weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quantization.recorded(model_args):
        base = quantization.load_4bit(base_path, model_args, dequantise=True)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=model_args.dtype)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)


def build_trainer(cfg: RunConfig, peft_config, report, preemption, resume=None, settings: dict | None = None):
    """The kind's trainer with the pack's callbacks; the model is loaded by TRL with from_pretrained. `settings`:
    what each checkpoint records for a later resume to compare (resume_settings.current)."""
    training, model_args = cfg.training, cfg.model
    patch_peft_under_fsdp()

    kind = kinds.load(cfg.trainer)
    train_ds, eval_ds = kind.load_datasets(cfg)
    # an eval split found under another of its usual names (data/loading.py held_out): run_args.json says which
    if report is not None and "script_args" in report.resolved_args:  # bench/overhead.py reports no settings
        report.resolved_args["script_args"]["dataset_test_split"] = cfg.script.dataset_test_split
    from fsdp_recipes.data import loading

    if dist.rank() == 0 and not loading.is_local(cfg.script, cfg.mixture):  # the launcher read local data only
        for line in loading.NOTES + [f"warning: {w}" for w in loading.WARNINGS]:
            print(f"[train] {line}", flush=True)
    training.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training.model_init_kwargs or {}),
    }
    # QLoRA: the 4-bit base stored in the dtype FSDP gathers in (config/quantization.py)
    bnb = quantization.quantization_config(model_args, training)
    if bnb is not None:
        training.model_init_kwargs["quantization_config"] = bnb
    callbacks = pack_callbacks(cfg, peft_config, report, preemption, resume, settings)
    model = model_args.model_name_or_path  # a directory or a hub id: TRL loads it with from_pretrained
    # cpu_ram_efficient_loading: only each node's first rank reads the weights (replica_model.py)
    if replica_model.applies(training.model_init_kwargs):
        model = replica_model.empty_model(model, training.model_init_kwargs) or model
    trainer = make_trainer_class(cfg.trainer)(
        model=model,
        args=training,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        peft_config=peft_config,
        callbacks=callbacks,
        **kind.trainer_kwargs(cfg),  # GRPO: the reward functions
    )
    if bnb is not None:
        quantization.same_kernels_on_every_cpu(trainer.model)
    trainer.token_counter, trainer.run_report = report.tokens, report
    add_pack_hooks(trainer, cfg, report)
    from fsdp_recipes.data import length_report

    if dist.rank() == 0 and not length_report.measured_by_launcher(cfg):  # what max_length cuts, never silently
        for line in length_report.in_rank(cfg, (train_ds, eval_ds), trainer):
            print(f"[train] {line}", flush=True)
    return trainer


def patch_peft_under_fsdp() -> None:
    """The patches PEFT and FSDP1 need, before the trainer exists (patches/peft_fsdp.py, patches/optim_resume.py)."""
    from fsdp_recipes.patches.optim_resume import init_state_before_fsdp1_sharded_load
    from fsdp_recipes.patches.peft_fsdp import (
        keep_fsdp1_output_layer_in_root,
        load_adapter_through_fsdp1_root,
        strip_fsdp1_wrapper_names,
    )
    strip_fsdp1_wrapper_names()  # see peft_fsdp.py: without it FSDP1 saves empty adapters
    load_adapter_through_fsdp1_root()  # see peft_fsdp.py: without it an FSDP1 resume silently loads no adapter
    keep_fsdp1_output_layer_in_root()  # see peft_fsdp.py: TRL's fused LM head needs the head unsharded
    init_state_before_fsdp1_sharded_load()  # see optim_resume.py: without it FSDP1 sharded resumes lose AdamW


def pack_callbacks(cfg: RunConfig, peft_config, report, preemption, resume, settings: dict | None) -> list:
    """The pack's callbacks the trainer is built with: the run report, the checkpoint marker, preemption, the
    failure phase, the load checks and, on a resume, its checks."""
    training, model_args, pack = cfg.training, cfg.model, cfg.pack
    from fsdp_recipes.checkpoint.load_check import LoadCheckCallback, TiedEmbeddingsCheck
    from fsdp_recipes.checkpoint.markers import CompletionMarkerCallback, identity

    # Order matters: the report saves its counters into a checkpoint before the marker says it is complete.
    callbacks = [report, CompletionMarkerCallback(identity(model_args.model_name_or_path, peft_config, settings)),
                 preemption, failure_record.make_phase_callback(), TiedEmbeddingsCheck(report)]
    if pack.verify_loaded_weights and resume and peft_config is None:
        # A resumed full fine-tune trains on the checkpoint's weights, loaded before training begins: compared with
        # model_name_or_path's file, every trained weight would differ. (A LoRA resume keeps the base weights.)
        if report.is_main:
            print(f"[train] verify_loaded_weights: skipped, this run resumes full fine-tuning from {resume}: its "
                  f"weights are the checkpoint's, not those of {model_args.model_name_or_path}", flush=True)
    elif pack.verify_loaded_weights:
        callbacks.append(LoadCheckCallback(model_args.model_name_or_path, report))
    if resume:  # resume_check.py: the optimizer state (and a PEFT adapter) in memory must be the checkpoint's
        from fsdp_recipes.checkpoint.resume_check import ResumeCheckCallback
        from fsdp_recipes.checkpoint.resume_settings import ScheduleResync

        callbacks.append(ResumeCheckCallback(resume, report, peft=peft_config is not None))
        callbacks.append(ScheduleResync(training.learning_rate, report))  # this run's schedule from the checkpoint on
    return callbacks


def add_pack_hooks(trainer, cfg: RunConfig, report) -> None:
    """What the built trainer gets before train(): the console's lines, float8, and the callbacks that need its
    model (FSDP2's output layer and resharding, the memory probe)."""
    training, pack = cfg.training, cfg.pack
    from fsdp_recipes.patches.peft_fsdp import RestoreOutputEmbeddings, fsdp2_requested, hide_wrapped_output_layer
    from fsdp_recipes.train import console

    # one line per log instead of bars and dictionaries; a sampling kind's loss is no falling objective
    console.replace_progress_output(trainer, pack.divergence_factor if getattr(report, "loss_falls", True) else 0.0)
    if pack.float8:  # before train() hands the model to accelerate, which wraps it with FSDP
        float8.check_device()
        converted, linears = float8.convert(trainer.model)
        report.resolved_args["float8_linear_layers"] = {"converted": converted, "linear": linears}
        trainer.accelerator.print(f"[train] float8: {converted} of {linears} linear layers converted "
                                  f"(the LM head and layers with a dimension not a multiple of 16 are not)")
    if fsdp2_requested() and hide_wrapped_output_layer(trainer.model):  # see peft_fsdp.py
        trainer.add_callback(RestoreOutputEmbeddings(trainer.model))
    if fsdp2_requested():  # an evaluation leaves the root's bf16 copies in place of its weights: sharded_save.py
        from fsdp_recipes.checkpoint.sharded_save import ReshardAfterEvaluate

        trainer.add_callback(ReshardAfterEvaluate())
    if pack.measure_memory:
        from fsdp_recipes.metrics.memory_probe import MemoryProbeCallback

        trainer.add_callback(MemoryProbeCallback(trainer.model, training.output_dir, trainer.accelerator.process_index,
                                                 report.tokens))


def save_final(trainer, cfg: RunConfig, peft_config, report) -> None:
    """The final model or adapter, checked against the weights in memory (save_check.py), and optionally merged."""
    from fsdp_recipes.checkpoint.save_check import (
        save_state_dict,
        verified_line,
        verify_against_memory,
        verify_final_save,
        without_tied_copies,
    )
    from fsdp_recipes.checkpoint.sharded_save import reshard_fsdp2, save_full_model_distributed, trainable_state_dict
    from fsdp_recipes.dist import gather_objects
    from fsdp_recipes.metrics.rss_watch import RssRise

    training, model_args, pack = cfg.training, cfg.model, cfg.pack
    out = training.output_dir
    sharded = trainer.is_fsdp_enabled and "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
    check_kwargs, checked_in_save = {}, False
    if trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2:
        reshard_fsdp2(trainer.model)  # whatever ran last without a backward (sharded_save.py says why)
    with RssRise() as saving:  # each rank's host-memory rise while saving, then while checking (rss_watch.py)
        if not trainer.is_fsdp_enabled:
            trainer.save_model(out)
        elif peft_config is not None and trainer.accelerator.is_fsdp2:
            # LoRA under FSDP2, FULL or SHARDED: gather only the trainable tensors, one at a time. The Trainer's
            # FULL_STATE_DICT save gathers the whole model, frozen base included, on rank 0 to keep the adapter
            # (make bench-loading, 394 MiB model: rank 0 rose 183 MiB that way, 6 MiB this way).
            adapter = trainable_state_dict(trainer)
            save_state_dict(trainer, out, adapter)  # a copy: the check below reuses `adapter`
            check_kwargs = dict(full=adapter, gathered=True)
        elif not sharded or not trainer.accelerator.is_fsdp2:
            # FULL_STATE_DICT, and FSDP1 (flat parameters, no DTensors) in any case: gather on rank 0 as
            # Trainer.save_model does, save, and check against that same gathered copy. Gathering again for the
            # check held the model twice on rank 0 (make bench-loading, 394 MiB model: total RSS rose 561 MiB in it).
            full = without_tied_copies(trainer.accelerator.unwrap_model(trainer.model),
                                       trainer.accelerator.get_state_dict(trainer.model))
            save_state_dict(trainer, out, full)  # a copy: save_pretrained empties the dict it is given
            check_kwargs = dict(full=full, gathered=True)
        else:  # full fine-tuning, FSDP2, SHARDED_STATE_DICT: never gather the model
            report.final_save_check = save_full_model_distributed(trainer, out)  # checks each rank's shards
            checked_in_save = True  # on every rank (the result may be rank 0's only)
    with RssRise() as checking:
        if not checked_in_save:
            check = verify_final_save(trainer, out, **check_kwargs)  # rank 0; raises when incomplete
            compared_with = verify_against_memory(trainer.model, out, trainer.accelerator.is_main_process)
            report.final_save_check = check and {**check, "compared_with": compared_with}
    report.final_save_rss = gather_objects({"save": saving.rise_bytes, "check": checking.rise_bytes})
    if report.final_save_check:
        print(f"[train] {verified_line(report.final_save_check)}", flush=True)
    if peft_config is not None and pack.save_merged_model:
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            save_merged(model_args.model_name_or_path, training.output_dir,
                        os.path.join(training.output_dir, "merged"), model_args)
    trainer.accelerator.wait_for_everyone()


def import_training_stack() -> None:
    """What every rank imports anyway (4-5 s on 2 cores), done before the start gate so that it overlaps the
    launcher's checks. Importing has no side effects a failed check would have to undo."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    from trl import DPOTrainer, SFTTrainer  # noqa: F401  (trl imports lazily: this pulls in transformers' Trainer)

    from fsdp_recipes.checkpoint import markers  # noqa: F401
    from fsdp_recipes.metrics import run_report  # noqa: F401
    from fsdp_recipes.data import loading  # noqa: F401
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
    cpu_fsdp_active = cpu_fsdp.enable()  # before any accelerate state exists
    library_logs.divert(failure_record.details)  # before peft imports bitsandbytes
    import_training_stack()
    start_gate.wait()  # the launcher's checks passed (a no-op without the launcher)
    # idempotent: the launcher normally built the assets and ran these checks already
    cfg = parse_and_check(argv, quiet=True)
    # Parsing built TrainingArguments, which started the process group (accelerate's PartialState). Before anything
    # reads output_dir: on a node that does not share it, auto_resume would pick another checkpoint.
    from fsdp_recipes.checkpoint.shared_dir import check_output_dir_shared

    check_output_dir_shared(cfg.training.output_dir)

    from trl import get_peft_config

    from fsdp_recipes.checkpoint import resume_settings
    from fsdp_recipes.metrics.run_report import RunReportCallback
    from fsdp_recipes.train.preemption import PreemptionCallback

    is_main = dist.rank() == 0
    kind = kinds.load(cfg.trainer)
    if not is_main:
        quiet_replica(cfg)
    quiet_console(cfg)
    peft_config = get_peft_config(cfg.model)
    quantization.settle_storage(cfg.model, cfg.training)  # recorded as it will run
    # what this run's checkpoints record and a later resume or rerun compares with (checkpoint/resume_settings.py)
    settings = resume_settings.current(cfg, int(os.environ.get("WORLD_SIZE", "1")), kind.RESUME_SETTINGS)
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
    report.resolved_args["cpu_fsdp_adapter"] = cpu_fsdp_active
    report.resolved_args["resume_settings"] = settings
    if changed:
        report.resolved_args["resumed_with_changes"] = changed
    report.resolved_args["patches_applied"] = guard.APPLIED  # the list object: later patches show too
    preemption = PreemptionCallback(report)
    try:
        trainer = build_trainer(cfg, peft_config, report, preemption, resume, settings)
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
