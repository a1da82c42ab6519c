"""The run's output_dir: locked for this run, and what the command does with a run it holds already (continue,
resume, refuse, replace: checkpoint/previous_run.py), before any rank starts."""

from __future__ import annotations

import shlex
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in the checks, while the ranks
# import the same in parallel; checkpoint/'s readers of the folder import torch, so inside the functions below.
from fsdp_recipes.checkpoint import output_lock, resume_choice
from fsdp_recipes.config.job import first_node, job_processes
from fsdp_recipes.config.mesh import mesh_of
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.launch import smoke
from fsdp_recipes.launch.lines import say
from fsdp_recipes.metrics import metrics_file
from fsdp_recipes.train import kinds


def lock_output_dir(recipe: Recipe, held: ExitStack, output_dir: str | None = None) -> str | None:
    """Lock output_dir for this run, held until the launcher exits: before the ranks start where the recipe or
    the command names it, so that a busy folder is one line at once (issue 42: lock mistakes within 5 s), else
    (`output_dir`: TrainingArguments' default, once parsed) in finished_run. The folder locked, or None. On a
    multi-node job the first node's launcher locks."""
    out = output_dir or recipe.early.output_dir
    if not out or not first_node():
        return None
    lock = output_lock.OutputLock(out, shlex.join(["launch", recipe.name, *recipe.overrides]))
    if output_dir is None:  # before the checks: a folder that cannot be made is theirs to name (config/value_checks)
        try:
            lock.acquire()
        except OSError:
            return None
        held.callback(lock.release)
    else:
        held.enter_context(lock)
    if lock.note:
        say(f"warning: {lock.note}")
    return out


def holds_finished_run(recipe: Recipe) -> bool:
    """The output_dir that the recipe or the command names holds a finished run (metrics.json `completed`): the ranks
    then start once the checks pass, not while they run. The same command again ends at "already complete", with no
    process started and stopped; another one is refused, or continues the run once checked. A smoke run replaces
    its finished run (finished_run), so its ranks start early as ever."""
    out = recipe.early.output_dir
    if not out or smoke.active():
        return False
    try:
        return metrics_file.read(out).get("status") == "completed"
    except (OSError, AttributeError):  # unreadable, or not a report: finished_run says what it is
        return False


@dataclass
class Found:
    """What output_dir holds and what this command does with it, read once under the lock (finished_run) and passed
    on to claim_output_dir."""
    previous: object  # checkpoint/previous_run.py Previous, or None for an empty folder
    now: dict  # resume_settings.current of this command
    replaces: bool  # the command empties the folder first (--overwrite_output_dir, a smoke run)
    done: str | None  # the "already complete" line, or None to go on
    accelerate: dict | None = None  # the recipe's accelerate config: the state dict type a resume must match


def finished_run(recipe: Recipe, cfg: RunConfig, held: ExitStack, locked: str | None = None) -> Found:
    """Lock output_dir for this run where lock_output_dir could not yet, and decide, reading only, what the command
    does with a finished run the folder holds (checkpoint/previous_run.py): the "already complete" line, a one-line
    refusal (other settings), or None to go on. Before the checks read the model and the data, so that a finished
    run is said as soon as the recipe is parsed; every node decides alike (read-only)."""
    from fsdp_recipes.checkpoint import previous_run

    out = cfg.training.output_dir
    previous_run.check_named(out)  # before it is locked or read
    if locked is None or Path(out).resolve() != Path(locked).resolve():  # the lock first: the folder is read under it
        lock_output_dir(recipe, held, out)
    previous, now = previous_run.read(Path(out)), resume_settings_now(recipe, cfg)
    previous_run.check_not_anothers(out, previous, cfg.model.model_name_or_path)
    if cfg.pack.overwrite_output_dir:  # but never over this job's own run (previous_run.requeued)
        replace = not previous_run.requeued(previous, now)
    else:  # a finished smoke run is scratch: the next one replaces it (an unfinished one is resumed, as any run)
        replace = smoke.active() and previous is not None and previous.status == "completed"
    if replace:
        return Found(previous, now, True, None, recipe.accelerate)
    resumes = cfg.pack.auto_resume or bool(cfg.training.resume_from_checkpoint)
    return Found(previous, now, False, previous_run.decide(out, previous, now, cfg.pack.override_resumed_settings,
                                                           resumes, previous_run.trained(cfg.model)),
                 recipe.accelerate)


def resume_settings_now(recipe: Recipe, cfg: RunConfig) -> dict:
    from fsdp_recipes.checkpoint import resume_settings

    return resume_settings.current(cfg, job_processes(recipe.accelerate), kinds.load(cfg.trainer).RESUME_SETTINGS,
                                   mesh=mesh_of(recipe.accelerate, recipe.accelerate_path))


def claim_output_dir(cfg: RunConfig, found: Found) -> None:
    """Once the checks passed (finished_run `found` the folder and decided to go on, and holds the lock): apply
    --overwrite_output_dir, then choose the checkpoint to resume: refused when incompatible, skipped (and moved aside)
    when unreadable. On a multi-node job the first node's launcher changes the folder; the others only check the
    resume."""
    from fsdp_recipes.checkpoint import previous_run, resume_settings

    out, first, previous, now = cfg.training.output_dir, first_node(), found.previous, found.now
    if found.replaces:
        if not first:
            return  # the first node is emptying output_dir: there is nothing of the old run to resume
        # an explicit resume_from_checkpoint (elsewhere: config/value_checks.check_resume_kept) is checked before the
        # folder is emptied, so that its refusal (not found, another model, other settings) leaves the run there
        resume, changed = (resume_choice.checkpoint_to_resume(cfg, now, say=say, accelerate=found.accelerate)
                           if cfg.training.resume_from_checkpoint else (None, {}))
        reads = [cfg.script.dataset_name, cfg.model.model_name_or_path]  # a folder the run reads is never emptied
        if removed := previous_run.clear(out, previous, keep=[path for path in reads if path]):
            say(f"{'overwrite_output_dir' if cfg.pack.overwrite_output_dir else 'smoke run'}: {removed}")
    else:
        resume, changed = resume_choice.checkpoint_to_resume(cfg, now, say=say, move_unreadable=first,
                                                             accelerate=found.accelerate)
        if cfg.pack.overwrite_output_dir and first:  # finished_run kept this job's own run
            say(f"overwrite_output_dir: kept the run that Slurm job {previous.job[0]} left in {out} before its requeue "
                f"(the flag replaces what a job finds at its first start): "
                + (f"resuming from {resume}" if resume else "starting at step 0"))
    if first:
        superseded(out, resume)
    if not found.replaces and resume is None and previous is not None and previous.status != "completed":
        say(f"{out} holds an unfinished run ({previous.status or 'no report'}, {previous.steps or 0} steps) with no "
            "checkpoint this command resumes: it starts at step 0, and its report replaces that run's")
    if changed.get("length"):
        (_, was), (name, now_len) = changed["length"]
        say(f"continuing {resume} to {name} {now_len} (it was trained toward {was}): the learning-rate schedule is "
            f"the new length's from its step on")
    if changed.get("changed"):
        moved = resume_settings.eval_rows_changed(changed)
        say(f"override_resumed_settings: resuming {resume} with {resume_settings.described(changed['changed'])}; the "
            f"new values apply from step {changed['step'] + 1} (run_args.json: resumed_with_changes)"
            + ("; the eval rows are chosen again, so the summary calls none of them held out" if moved else ""))


def superseded(output_dir: str, resume: str | None) -> None:
    """Complete checkpoints of this output_dir past the step this run starts from (auto_resume false, or an older
    resume_from_checkpoint) are moved aside: the Trainer would save into those folders while their old
    completion marker still stood, and a kill mid-save would leave a mixed folder that looked complete."""
    from fsdp_recipes.checkpoint import markers, resume_check

    start = resume_check.checkpoint_step(resume) if resume else 0
    for ckpt in markers.checkpoint_dirs(output_dir):
        if markers.is_complete(ckpt) and markers.step_of(ckpt) > start:
            moved = markers.move_aside(ckpt, "superseded")
            say(f"{ckpt.name} is past step {start}, where this run starts: moved to {moved.name} (kept, not resumed)")

