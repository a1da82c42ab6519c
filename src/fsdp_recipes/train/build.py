"""The trainer a rank trains with: the kind's TRL trainer (train/kinds/) with the pack's hooks, callbacks and speed
options, its model loaded by TRL with from_pretrained (or built by a speed option, speed/).

For a program that drives training itself (bench/, a notebook), in a process accelerate launched:
    set_up_process()                      # before any accelerate state: FSDP on CPU over gloo where asked
    cfg = run_config.parse_args(argv)
    report = run_report_for(cfg)          # metrics.json and run_args.json, as a launched run writes them
    trainer = trainer_for(cfg, report)    # what the entry point builds
    trainer.train()
"""

from __future__ import annotations

from fsdp_recipes import dist, speed
from fsdp_recipes.checkpoint.load_check import LoadCheckCallback, TiedEmbeddingsCheck
from fsdp_recipes.checkpoint.markers import CompletionMarkerCallback, identity
from fsdp_recipes.checkpoint.resume_check import ResumeCheckCallback
from fsdp_recipes.checkpoint.resume_settings import ScheduleResync
from fsdp_recipes.checkpoint.sharded_save import ReshardAfterEvaluate
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.data import length_report, loading
from fsdp_recipes.metrics import expert_load
from fsdp_recipes.metrics.memory_probe import MemoryProbeCallback
from fsdp_recipes.metrics.run_report import RunReportCallback
from fsdp_recipes.patches import cpu_fsdp
from fsdp_recipes.patches.optim_resume import init_state_before_fsdp1_sharded_load
from fsdp_recipes.patches.peft_fsdp import (
    RestoreOutputEmbeddings,
    fsdp2_requested,
    keep_fsdp1_output_layer_in_root,
    load_adapter_through_fsdp1_root,
    prepare_wrapped_embeddings_for_fsdp2,
    strip_fsdp1_wrapper_names,
)
from fsdp_recipes.patches.resume_at_end import no_step_past_max_steps
from fsdp_recipes.speed import context_parallel
from fsdp_recipes.train import console, failure_record, kinds, tensor_parallel
from fsdp_recipes.train.preemption import PreemptionCallback


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

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            no_step_past_max_steps(self)  # resumed at its last step, it trains none past it (resume_at_end.py)

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


def build_trainer(cfg: RunConfig, peft_config, report, preemption, resume=None, settings: dict | None = None):
    """The kind's trainer with the pack's callbacks; the model is loaded by TRL with from_pretrained. `settings`:
    what each checkpoint records for a later resume to compare (resume_settings.current)."""
    training, model_args = cfg.training, cfg.model
    patch_peft_under_fsdp()

    kind = kinds.load(cfg.trainer)
    train_ds, eval_ds = kind.load_datasets(cfg)
    report.mark("data_loaded")
    # an eval split found under another of its usual names (data/loading.py held_out): run_args.json says which
    if report is not None and "script_args" in report.resolved_args:  # bench/overhead.py reports no settings
        report.resolved_args["script_args"]["dataset_test_split"] = cfg.script.dataset_test_split
    if dist.rank() == 0 and not loading.is_local(cfg.script, cfg.mixture):  # the launcher read local data only
        for line in loading.NOTES + [f"warning: {w}" for w in loading.WARNINGS]:
            print(f"[train] {line}", flush=True)
    training.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training.trust_remote_code,
        "dtype": model_args.dtype,
        **(training.model_init_kwargs or {}),
        **tensor_parallel.model_init_kwargs(cfg, resume),  # a tp mesh: transformers shards at load time
        **speed.model_init_kwargs(cfg),  # the attention kernel, a 4-bit base's BitsAndBytesConfig: theirs win
    }
    callbacks = pack_callbacks(cfg, peft_config, report, preemption, resume, settings)
    # a directory or a hub id, which TRL loads with from_pretrained; or the model an option builds instead (RAM-
    # efficient loading: every rank but each node's first starts empty)
    model = speed.load_model(model_args.model_name_or_path, training.model_init_kwargs)
    trainer = make_trainer_class(cfg.trainer)(
        model=model,
        args=training,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        peft_config=peft_config,
        callbacks=callbacks,
        **kind.trainer_kwargs(cfg),  # GRPO: the reward functions
    )
    trainer.token_counter, trainer.run_report = report.tokens, report
    tensor_parallel.prepare_trainer(trainer)  # a LoRA adapter on a tp x dp_shard mesh: equal over dp
    add_pack_hooks(trainer, cfg, report)
    if dist.rank() == 0 and not length_report.measured_by_launcher(cfg):  # what max_length cuts, never silently
        for line in length_report.in_rank(cfg, (train_ds, eval_ds), trainer):
            print(f"[train] {line}", flush=True)
    return trainer


def patch_peft_under_fsdp() -> None:
    """The patches PEFT and FSDP1 need, before the trainer exists (patches/peft_fsdp.py, patches/optim_resume.py)."""
    strip_fsdp1_wrapper_names()  # see peft_fsdp.py: without it FSDP1 saves empty adapters
    load_adapter_through_fsdp1_root()  # see peft_fsdp.py: without it an FSDP1 resume silently loads no adapter
    keep_fsdp1_output_layer_in_root()  # see peft_fsdp.py: TRL's fused LM head needs the head unsharded
    init_state_before_fsdp1_sharded_load()  # see optim_resume.py: without it FSDP1 sharded resumes lose AdamW


def pack_callbacks(cfg: RunConfig, peft_config, report, preemption, resume, settings: dict | None) -> list:
    """The pack's callbacks the trainer is built with: the run report, the checkpoint marker, preemption, the
    failure phase, the load checks and, on a resume, its checks."""
    training, model_args, pack = cfg.training, cfg.model, cfg.pack
    # Order matters: the report saves its counters into a checkpoint before the marker says it is complete.
    callbacks = [report, CompletionMarkerCallback(identity(model_args.model_name_or_path, peft_config, settings,
                                                           revision=model_args.model_revision)),
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

        callbacks.append(ResumeCheckCallback(resume, report, peft=peft_config is not None))
        callbacks.append(ScheduleResync(training.learning_rate, report))  # this run's schedule from the checkpoint on
    return callbacks


def add_pack_hooks(trainer, cfg: RunConfig, report) -> None:
    """What the built trainer gets before train(): the console's lines, the speed options, and the callbacks that
    need its model (FSDP2's output layer and resharding, the memory probe)."""
    training, pack = cfg.training, cfg.pack
    # one line per log instead of bars and dictionaries; a sampling kind's loss is no falling objective
    console.replace_progress_output(trainer, pack.divergence_factor if getattr(report, "loss_falls", True) else 0.0)
    # before train() hands the model to accelerate, which wraps it with FSDP (an option may convert its layers)
    report.resolved_args["speed_options"] = speed.prepare_trainer(trainer, cfg)
    if cp_form := context_parallel.install(trainer):  # a cp mesh: the ring on CUDA, the all-to-all form elsewhere
        report.resolved_args["context_parallel"] = cp_form
    if fsdp2_requested() and prepare_wrapped_embeddings_for_fsdp2(trainer.model):  # see peft_fsdp.py
        trainer.add_callback(RestoreOutputEmbeddings(trainer.model))
    if fsdp2_requested():  # an evaluation leaves the root's bf16 copies in place of its weights: sharded_save.py

        trainer.add_callback(ReshardAfterEvaluate())
    # a mixture of experts: the tokens each expert receives, counted by hooks on the routers (metrics/expert_load.py)
    expert_load.attach(trainer, report)
    if pack.measure_memory:
        trainer.add_callback(MemoryProbeCallback(trainer.model, training.output_dir, trainer.accelerator.process_index,
                                                 report.tokens))


def set_up_process() -> bool:
    """Before any accelerate state exists: accelerate's FSDP path on CPU over gloo, where the launch asked for FSDP
    and there is no GPU (patches/cpu_fsdp.py); a tp mesh first (train/tensor_parallel.py). Whether FSDP on CPU
    applied."""
    tensor_parallel.set_up_process()
    return cpu_fsdp.enable()


def run_report_for(cfg: RunConfig, report_name: str | None = None):
    """The run report (metrics.json, run_args.json) of a run of `cfg`, named `report_name` (the recipe's name)."""
    from trl import get_peft_config

    return RunReportCallback(cfg.training.output_dir, cfg.resolved(get_peft_config(cfg.model)),
                             report_name or cfg.pack.recipe_name, trainer=cfg.trainer)


def trainer_for(cfg: RunConfig, report):
    """The trainer the entry point builds for `cfg`, reporting to `report` (run_report_for), with the preemption
    callback."""
    from trl import get_peft_config

    return build_trainer(cfg, get_peft_config(cfg.model), report, PreemptionCallback())
