"""Which checkpoint a run resumes from, and whether it may: the launcher decides it before any rank starts (and
moves unreadable checkpoints aside, holding the output_dir's lock); every rank decides it again when it starts.

Light to import: the checkpoint modules it reads (transformers, torch) and TRL load when it runs, so that the rank
entry point can import it before its start gate.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.errors import UserError


def checkpoint_to_resume(cfg, settings: dict, say=None, move_unreadable: bool = False, accelerate: dict | None = None):
    """(checkpoint or None, what the command changes against it). An explicit resume_from_checkpoint wins; else, with
    auto_resume, the newest complete checkpoint that can be read: newer ones that cannot are skipped, and moved aside
    where `move_unreadable` (the launcher, which holds the output_dir's lock) once the resume passed its checks. The
    checkpoint must belong to this model and LoRA shape (checked before any weight is loaded) and to this command's
    `settings` (resume_settings.current).
    `say`: where the skipped checkpoints are told (None: nowhere). `cfg`: the parsed recipe (config/run_config.py
    RunConfig, a layer beside this one). `accelerate`: the recipe's accelerate config (the launcher's), whose
    fsdp_state_dict_type the checkpoint must have been saved with; None: accelerate's environment (in the ranks)."""
    from trl import get_peft_config

    from fsdp_recipes.checkpoint import markers as checkpoints
    from fsdp_recipes.checkpoint import resume_settings
    from fsdp_recipes.checkpoint.resume_check import checkpoint_step

    say = say or (lambda line: None)
    training, model_args = cfg.training, cfg.model
    resume = training.resume_from_checkpoint
    bad, then = [], ""
    if not resume and cfg.pack.auto_resume:
        for skipped in checkpoints.incomplete(training.output_dir):
            say(f"skipping {skipped}: incomplete (no {checkpoints.MARKER} marker)")
        latest, bad = checkpoints.usable(training.output_dir)
        then = f"resuming from {latest.name}" if latest else "no other complete checkpoint: starting from step 0"
        resume = str(latest) if latest else None
    elif resume and Path(resume).is_dir() and (why := checkpoints.unreadable(Path(resume))):
        raise UserError(f"resume_from_checkpoint {resume} cannot be read ({why}). Fix: point it at another "
                        f"checkpoint-N folder.")
    if not resume:
        set_aside(bad, then, say, checkpoints.move_aside if move_unreadable else None)
        return None, {}
    if not Path(resume).is_dir():
        raise UserError(f"resume_from_checkpoint {resume} does not exist. Fix: point it at a checkpoint-N folder.")
    now = checkpoints.identity(model_args.model_name_or_path, get_peft_config(model_args),
                               revision=getattr(model_args, "model_revision", None))
    checkpoints.check_compatible(Path(resume), now,
                                 explicit=bool(training.resume_from_checkpoint))
    checkpoints.check_state_dict_type(Path(resume), checkpoints.run_state_dict_type(accelerate),
                                      explicit=bool(training.resume_from_checkpoint))
    saved = checkpoints.saved_identity(Path(resume)) or {}
    changed = resume_settings.check(resume, checkpoint_step(resume), saved.get("settings"), settings,
                                    cfg.pack.override_resumed_settings)
    # moved once the resume is allowed: a refused command leaves output_dir as it was
    set_aside(bad, then, say, checkpoints.move_aside if move_unreadable else None)
    return resume, changed


def set_aside(bad: list, then: str, say, move_aside=None) -> None:
    """The newer complete checkpoints that cannot be read (`bad`, markers.usable's): told, and moved aside with
    `move_aside` (markers.move_aside, for the launcher, which holds the output_dir's lock). `then`: what the run does
    instead."""
    for ckpt, why in bad:
        if move_aside is not None:
            say(f"{ckpt} cannot be read ({why}); moved to {move_aside(ckpt).name}; {then}")
        else:
            say(f"skipping {ckpt}: cannot be read ({why}); {then}")
