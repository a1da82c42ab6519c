"""The settings a checkpoint fixes, compared with the command that resumes it; and the learning rate put back in
step with the schedule the command asks for.

Gap this fills: the Trainer resumes whatever the command says. The optimizer's `load_state_dict` puts back the
checkpoint's learning rate, weight decay and betas, and the scheduler's its base learning rate, so a resume with
`--learning_rate 1e-5` trains on the old schedule while run_args.json records 1e-5 (transformers 5.23). And the
first step after a resume runs at the learning rate the *old* schedule set for it: continuing a finished cosine run
to a larger max_steps made that step's learning rate 0.

So a resume compares SETTINGS (saved in each checkpoint's identity file, markers.py) with the command's:
- the run length (max_steps, or num_train_epochs without it) may grow: the schedule is then the new length's, from
  the checkpoint's step on; it may not end before the checkpoint;
- OVERRIDABLE settings that differ stop the resume in one line, unless `override_resumed_settings` is set: then
  they apply from the next step on (the learning rate through ScheduleResync below, the rest because the Trainer
  reads them from the new arguments) and the run report lists them (`resumed_with_changes`);
- FIXED settings never change on resume: the optimizer state is AdamW's moments for those hyper-parameters, and the
  weights belong to that model and precision (the model and LoRA shape are checked before any weight loads,
  markers.check_compatible);
- EVAL_ROWS, the settings that decide which rows are held out (data/loading.py held_out), are OVERRIDABLE: another
  value carves another eval split, so rows the first part trained on would be scored as held out. Refused like the
  learning rate, saying so; under the override the summary does not call the scored rows held out
  (`eval_rows_changed`, which evaluation/scoring.py reads from run_args.json's `resumed_with_changes`).
"""

from __future__ import annotations

import dataclasses
import warnings
from enum import Enum
from pathlib import Path

from transformers import TrainerCallback

from fsdp_recipes.checkpoint import fingerprint
from fsdp_recipes.errors import UserError

OVERRIDABLE = (
    # the schedule (ScheduleResync applies a new one)
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
    # the batch and the data: which rows a step sees. The global batch, not its factors: a sharded checkpoint resumes
    # on another number of processes with the per-device batch that keeps it (docs/checkpoints.md)
    "global_batch", "max_length", "max_grad_norm",
)
# What decides the eval rows (data/loading.py held_out; TRL's DatasetMixtureConfig for a `datasets:` mixture): the
# data and its splits, eval_split_size and the seed that chooses the carved rows (which also orders the batches)
# and the local data files' contents (LOCAL_DATA): a file shuffled or rewritten in place carves other rows by index
LOCAL_DATA = "local_data"  # {path: fingerprint} of the local data paths (checkpoint/fingerprint.py data_fingerprint)
EVAL_ROWS = ("seed", "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "eval_split_size",
             "datasets", "test_split_size", LOCAL_DATA)
OVERRIDABLE = (*OVERRIDABLE, *EVAL_ROWS)
# dataset_test_split as the recipe names it: the launcher compares after its checks loaded the data, and loading sets
# the field to the split it found under one of the usual names (data/loading.py EVAL_NAMES) when `test` is missing;
# any of those names finds the same split of the data's own (never training rows), so they compare equal
USUAL_EVAL_NAMES = ("test", "validation", "valid", "eval", "dev")
FIXED = ("optim", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "dtype", "bf16", "fp16", "trainer",
         "mesh")
# The mesh of a run that splits layers (tp) or rows (cp): {"tp": 2, "dp_shard": 2}, {"tp": 1, "dp_shard": 2, "cp": 2}
# (cp and dp_replicate when above 1); None without either. A tensor-parallel checkpoint resumes at another dp_shard:
# DCP reshards the weights and AdamW's state, and every tp group keeps its ranks' RNG streams (rng_state_<rank>.pth:
# group g is ranks g*tp..g*tp+tp-1 at any dp_shard, and a group the checkpoint did not have starts its ranks alike),
# so the group's ranks still draw the same dropout masks. Another tp size would mix the streams of different groups
# in one (silently other training, not a failure), and a checkpoint without tp resumed with it (or the reverse) has
# the other path's files (checkpoint/tensor_parallel_state.py): the mesh's tp is FIXED, refused in one line.
# Another cp size (cp 1 included) resumes: the checkpoint is FSDP's at any cp (its FSDP shards over dp_shard x cp, and
# DCP reshards a sharded one, as at another number of processes), a cp group's ranks read the same rows whatever their
# RNG streams (accelerate's loader shards the seeded order over the data-parallel ranks), and each rank draws dropout
# for its own tokens. What a step reads may not change silently: the global batch counts the data-parallel ranks,
# processes / (tp x cp) (config/mesh.py data_parallel_size), and another one beside another mesh is refused in one
# line naming both meshes and the per-device batch that keeps it (other_rows).
MESH = "mesh"
# how many ranks read rows of their own (the global batch's divisor): not compared, the refusal's fix reads it
DATA_PARALLEL = "data_parallel_ranks"
LENGTH = ("max_steps", "num_train_epochs")
OPTIONS_FIXED = "fixed_by_options"  # the settings' entry naming the speed options' fixed settings (speed/)
NOT_COMPARED = (OPTIONS_FIXED, DATA_PARALLEL)


def current(cfg, world_size: int, kind_settings: tuple[str, ...] = (), option_settings: tuple[str, ...] = (),
            mesh=None) -> dict:
    """This command's values of every compared setting, JSON-ready (saved into each checkpoint's identity). `cfg`:
    the parsed recipe (config/run_config.RunConfig, a layer beside this one).
    `kind_settings`: the trainer kind's own (train/kinds/<kind>.py RESUME_SETTINGS), compared like OVERRIDABLE;
    `option_settings`: the speed options' (speed.resume_settings(): 4-bit loading's layout), FIXED like the dtype;
    `mesh`: the run's device mesh (config/mesh.py Mesh, or None), recorded when it splits layers or rows (MESH
    above)."""
    t = cfg.training
    # the rows of a step: a tp group's ranks share theirs, and so do a cp group's (config/mesh.py data_parallel_size)
    data_parallel = world_size if mesh is None else mesh.data_parallel_size(world_size)
    values = {"global_batch": t.per_device_train_batch_size * t.gradient_accumulation_steps * data_parallel,
              "dataset_name": cfg.script.dataset_name, "dtype": cfg.model.dtype, "trainer": cfg.trainer,
              OPTIONS_FIXED: list(option_settings), MESH: recorded_mesh(mesh), DATA_PARALLEL: data_parallel,
              LOCAL_DATA: fingerprint.data_fingerprint(local_data_paths(cfg))}
    sources = (t, cfg.model, getattr(cfg, "kind_args", None), *getattr(cfg, "option_args", ()),
               getattr(cfg, "script", None), getattr(cfg, "pack", None), getattr(cfg, "mixture", None))
    for name in (*OVERRIDABLE, *FIXED, *LENGTH, *kind_settings, *option_settings):
        if name not in values:
            # the trainer config's, the model's, a kind's own (reward_funcs), a speed option's own
            # (config/option_registry.py), the data's (TRL's ScriptArguments and DatasetMixtureConfig, PackArguments)
            value = next((getattr(source, name) for source in sources if source is not None and hasattr(source, name)),
                         None)
            if name == "dataset_test_split" and value in USUAL_EVAL_NAMES:
                value = "test"
            if name == "datasets":  # a mixture's sources (TRL's DatasetConfig dataclasses)
                value = [dataclasses.asdict(d) if dataclasses.is_dataclass(d) else d for d in value or []] or None
            value = value.value if isinstance(value, Enum) else value  # lr_scheduler_type: SchedulerType.COSINE
            values[name] = value if isinstance(value, (int, float, str, bool, type(None), list, dict)) else str(value)
    return values


def local_data_paths(cfg) -> list[str]:
    """The data paths a run reads that may be local: dataset_name, and a `datasets:` mixture's paths, data_dirs and
    data_files (TRL's DatasetConfig). fingerprint.data_fingerprint keeps the local ones."""
    script, mixture = getattr(cfg, "script", None), getattr(cfg, "mixture", None)
    paths = [getattr(script, "dataset_name", None)]
    for source in getattr(mixture, "datasets", None) or []:
        get = source.get if isinstance(source, dict) else lambda k, s=source: getattr(s, k, None)
        files = get("data_files")
        files = list(files.values()) if isinstance(files, dict) else files
        paths += [get("path"), *([get("data_dir")] if get("data_dir") and get("path") else []),
                  *(files if isinstance(files, list) else [files])]
    flat = []
    for p in paths:
        flat += p if isinstance(p, list) else [p]
    return [str(p) for p in flat if isinstance(p, (str, Path))]


def recorded_mesh(mesh) -> dict | None:
    """A checkpoint's record of `mesh` (MESH above): tp and dp_shard, then cp and dp_replicate where above 1."""
    if mesh is None or mesh.tp == mesh.cp == 1:
        return None
    return {"tp": mesh.tp, "dp_shard": mesh.dp_shard, **({"cp": mesh.cp} if mesh.cp > 1 else {}),
            **({"dp_replicate": mesh.dp_replicate} if mesh.dp_replicate > 1 else {})}


def length(settings: dict) -> tuple[str, float]:
    """The run's length as the Trainer reads it: max_steps when positive, else the epochs."""
    if (settings.get("max_steps") or 0) > 0:
        return "max_steps", settings["max_steps"]
    return "num_train_epochs", settings.get("num_train_epochs")


def changes(saved: dict, now: dict) -> dict[str, list]:
    """{name: [saved, now]} for every compared setting that differs (the length excluded)."""
    return {k: [saved[k], now.get(k)] for k in saved
            if k not in LENGTH and k not in NOT_COMPARED and k in now and differs(k, saved[k], now[k])}


def differs(name: str, saved, now) -> bool:
    if name == LOCAL_DATA:  # the same path, other contents (another path is another dataset_name, compared as such)
        return bool(fingerprint.same_paths_changed(saved, now))
    if name == MESH:  # another dp_shard resumes (MESH above): only the tp size is fixed
        return tp_of(saved) != tp_of(now)
    return saved != now


def tp_of(mesh: dict | None) -> int:
    return (mesh or {}).get("tp", 1)


def mesh_described(mesh: dict | None, without: str = "tensor parallel") -> str:
    return f"the mesh {shown(MESH, mesh)}" if mesh else f"a mesh without {without}"


def is_fixed(name: str, now: dict) -> bool:
    """A setting that can never change on resume: FIXED, or one a speed option fixes."""
    return name in FIXED or name in (now.get(OPTIONS_FIXED) or ())


def described(diff: dict[str, list]) -> str:
    return ", ".join(f"the local data: {fingerprint.data_changed(old, new)} in place" if k == LOCAL_DATA else
                     f"{k} {shown(k, old)} -> {shown(k, new)}" for k, (old, new) in diff.items())


def shown(name: str, value) -> str:
    if name == MESH:  # tp 2 x dp_shard 2; dp_shard 2 x cp 2
        return " x ".join(f"{k} {v}" for k, v in value.items() if k != "tp" or v > 1) if value else "without tp or cp"
    return repr(value)


def refuse_another_mesh(checkpoint: str, saved: dict | None, now: dict | None) -> None:
    """A tensor-parallel checkpoint resumes at its own tp size only (MESH above says why)."""
    if tp_of(saved) > 1 and tp_of(now) > 1:
        why = ("its tp groups' RNG streams (rng_state_<rank>.pth) would mix in groups of another size, whose ranks "
               "must draw the same dropout masks")
    else:
        why = (f"its state is the {'tensor-parallel' if tp_of(saved) > 1 else 'FSDP'} path's, which the other path "
               "does not read")
    fix = (f"parallelism_config_tp_size {saved['tp']} (dp_shard may change, with a per_device_train_batch_size that "
           "keeps the global batch)" if tp_of(saved) > 1 else "no parallelism_config_tp_size, as it was saved")
    raise UserError(f"cannot resume from {checkpoint} on {mesh_described(now)}: it was saved on "
                    f"{mesh_described(saved)}, and {why}. Fix: relaunch with {fix}, or a new --output_dir to start "
                    "over.")


def other_rows(saved: dict, now: dict, diff: dict[str, list]) -> tuple[str, str] | None:
    """(why, fix) of a global batch changed beside the mesh (another cp or dp_shard; MESH above), naming both meshes
    and the per-device batch that keeps the rows of a step; None for another change. A checkpoint without
    DATA_PARALLEL was saved before a cp mesh was recorded (its `null` may be cp's, its global batch every rank's):
    its meshes are not named."""
    if "global_batch" not in diff or DATA_PARALLEL not in saved or saved.get(MESH) == now.get(MESH):
        return None
    (was, asked), ranks = diff["global_batch"], now.get(DATA_PARALLEL)
    why = (f"it was saved on {mesh_described(saved[MESH], 'tp or cp')}, {was} rows a step, and a step on "
           f"{mesh_described(now.get(MESH), 'tp or cp')} reads {asked} (per_device_train_batch_size x "
           f"gradient_accumulation_steps x the {ranks} data-parallel ranks, processes / (tp x cp)), so the run "
           "would go on with other steps than it was saved with")
    if ranks and was % ranks == 0:
        fix = (f"Fix: relaunch with per_device_train_batch_size x gradient_accumulation_steps = {was // ranks} "
               "(the same rows a step), or a new --output_dir")
    else:
        fix = (f"Fix: relaunch on a mesh whose data-parallel ranks divide {was} (no per-device batch keeps {was} rows "
               f"a step over {ranks}), or a new --output_dir")
    return why, fix


def eval_rows_changed(changed: dict | None) -> dict[str, list]:
    """Of a resume's changes (check's "changed", run_args.json's resumed_with_changes), those that chose other eval
    rows: {name: [saved, now]}."""
    return {k: v for k, v in ((changed or {}).get("changed") or {}).items() if k in EVAL_ROWS}


def check(checkpoint: str, step: int, saved: dict | None, now: dict, override: bool) -> dict:
    """Refuse a resume that would silently ignore the command (one line), else what changed, for the report:
    {"changed": {...}, "length": [saved, now]} (empty when nothing did)."""
    if not saved:  # a checkpoint from before settings were saved, or from something else
        return {}
    fix = "Fix: resume with the checkpoint's values, or use a new --output_dir"
    diff = changes(saved, now)
    if MESH in diff:
        refuse_another_mesh(checkpoint, *diff[MESH])
    fixed = {k: v for k, v in diff.items() if is_fixed(k, now)}
    if fixed:
        raise UserError(f"cannot resume from {checkpoint} with {described(fixed)}: the checkpoint's optimizer state "
                        f"and weights belong to the old value, so it cannot change on resume. {fix}.")
    name, total = length(now)
    if name == "max_steps" and total < step:
        raise UserError(f"cannot resume from {checkpoint}: it is at step {step}, past max_steps {total}. Fix: "
                        f"--max_steps {step} or more, or a new --output_dir.")
    if LOCAL_DATA in diff and not override:
        raise UserError(f"cannot resume from {checkpoint}: {fingerprint.data_changed(*diff[LOCAL_DATA])} in place "
                        "since it was saved, so the resumed steps would read other rows than the ones it counts as "
                        "trained, and rows it trained on could be scored as held out. Fix: put the data back as it "
                        "was, or use a new --output_dir, or --override_resumed_settings true to go on (the summary "
                        "then scores no rows as held out).")
    if diff and not override:
        rows, batch = eval_rows_changed({"changed": diff}), other_rows(saved, now, diff)
        why = (f"{described(rows)} chooses other eval rows than the first part held out, so rows it trained on would "
               "be scored as held out" if rows else batch[0] if batch else
               "the checkpoint holds the old ones and the run would keep some of them while its report said otherwise")
        if batch and not rows:
            fix = batch[1]
        raise UserError(f"cannot resume from {checkpoint} with other settings ({described(diff)}): {why}. "
                        f"{fix}, or --override_resumed_settings true to apply the new values from step {step + 1}"
                        + (" (the summary then scores no rows as held out)" if rows else "") + ".")
    report = {"checkpoint": str(checkpoint), "step": step}
    if diff:
        report["changed"] = diff
    if length(saved) != (name, total):
        report["length"] = [list(length(saved)), [name, total]]
    return report if len(report) > 2 else {}


class ScheduleResync(TrainerCallback):
    """After a resume: the scheduler's base learning rate is this run's, and the optimizer's learning rate is the one
    this run's schedule sets for the checkpoint's step, not the one the checkpoint's own schedule left there.

    With unchanged settings this recomputes the value that was loaded (the same schedule at the same step), so an
    exact resume stays exact. Only LambdaLR schedules (every `lr_scheduler_type` but reduce_lr_on_plateau) are
    resynced; another scheduler keeps what it loaded, and metrics.json's resume_check says so."""

    def __init__(self, learning_rate: float, report=None):
        self.learning_rate, self.report = learning_rate, report

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's AcceleratedScheduler wraps it
        if scheduler is None or not hasattr(scheduler, "lr_lambdas"):
            self._record(f"not resynced: {type(scheduler).__name__} is not a LambdaLR")
            return
        scheduler.base_lrs = [self.learning_rate for _ in scheduler.base_lrs]
        for group in scheduler.optimizer.param_groups:
            group["initial_lr"] = self.learning_rate
        # step() recomputes every group's rate at last_epoch + 1 from base_lrs and the lambdas (public API only):
        # one step back first, so that it lands on the checkpoint's step
        scheduler.last_epoch -= 1
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": no optimizer step yet
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            scheduler.step()
        self._record(scheduler.get_last_lr()[0])

    def _record(self, value) -> None:
        """metrics.json's resume_check: the learning rate the first resumed step runs at."""
        if self.report is not None:
            self.report.resume_check = {**(self.report.resume_check or {}), "learning_rate_after_resume": value}
