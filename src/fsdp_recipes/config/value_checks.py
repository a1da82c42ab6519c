"""Values the libraries accept silently, or refuse only inside every rank: checked once, in the launcher (and again
in each rank, where it costs nothing), before any process starts.

transformers' TrainingArguments and TRL's SFTConfig validate much themselves when the parser builds them
(run_config.parse_args turns that into one line); PEFT's LoraConfig validates when it is built, which only the ranks
did, so `lora_config` builds it here. What remains are ranges nothing checks: a negative learning rate reaches
torch's optimizer only after the model is loaded, a non-positive batch size or max_length fails deep in a data
loader, and a save_steps larger than max_steps means no checkpoint is ever written, with no error at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_recipes.config.argv import override
from fsdp_recipes.errors import UserError

if TYPE_CHECKING:
    from fsdp_recipes.config.run_config import RunConfig


def _fail(what: str, fix: str) -> None:
    raise UserError(f"{what}. Fix: {fix}.")


def lora_config(cfg: RunConfig):
    """PEFT's LoraConfig as the ranks build it (TRL's get_peft_config), so its own validation raises here."""
    from trl import get_peft_config

    try:
        return get_peft_config(cfg.model)
    except (ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _fail(f"invalid LoRA settings: {first}", "correct the lora_* settings in the recipe YAML or ARGS")


def check_output_dir(path: str) -> None:
    """output_dir must be a directory this user can create and write."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        _fail(f"output_dir {p} is a file, not a directory", "point output_dir at a directory (new or existing)")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        _fail(f"output_dir {p} cannot be created: {existing} is a file", "choose another output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        _fail(f"output_dir {p} is not writable ({existing} does not let this user write)",
              "choose an output_dir you can write, or fix its permissions")


def check_resume_kept(resume: str | None, output_dir: str, overwrite: bool) -> None:
    """--overwrite_output_dir empties output_dir before the run starts: a resume_from_checkpoint inside it would be
    removed first, and the run refused as "does not exist" once the earlier run was gone."""
    if overwrite and resume and Path(resume).resolve().is_relative_to(Path(output_dir).resolve()):
        _fail(f"resume_from_checkpoint {resume} lies in output_dir {output_dir}, which --overwrite_output_dir true "
              "empties before the run starts", "leave out --overwrite_output_dir (the same output_dir resumes its "
              "run), or copy the checkpoint out of output_dir first")


def check_training_values(t, eval_on: bool) -> None:
    """Ranges of SFTConfig fields that nothing checks before training starts."""
    if t.learning_rate <= 0:
        _fail(f"learning_rate is {t.learning_rate}; it must be positive", "set learning_rate to e.g. 2.0e-5 (full) "
              "or 2.0e-4 (LoRA)")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps") + (
            ("per_device_eval_batch_size",) if eval_on else ()):
        if getattr(t, name) < 1:
            _fail(f"{name} is {getattr(t, name)}; it must be at least 1", f"set {name} to 1 or more")
    if getattr(t, "max_length", None) is not None and t.max_length < 1:  # GRPOConfig has none
        _fail(f"max_length is {t.max_length}; it must be at least 1", "set max_length to the longest sample in tokens "
              "(or null for no truncation)")
    if t.max_steps == 0 or t.max_steps < -1:
        _fail(f"max_steps is {t.max_steps}: nothing would be trained", "set max_steps to a positive number, or -1 to "
              "train for num_train_epochs")
    if t.max_steps == -1 and t.num_train_epochs <= 0:
        _fail(f"num_train_epochs is {t.num_train_epochs} and max_steps is not set: nothing would be trained",
              "set num_train_epochs above 0, or max_steps")


def schedule_warnings(t) -> list[str]:
    """Settings that cannot take effect in a run of max_steps: warnings, not errors, because a short run of a
    recipe (`--max_steps 4` to try it) is their usual cause and is still a valid run."""
    steps = t.max_steps if t.max_steps > 0 else None
    if not steps:
        return []
    found = []
    # save/eval/logging `steps` under 1 are a fraction of the run (transformers' convention): they always fire.
    # transformers' DefaultFlowCallback still saves and evaluates at the last step (5.17-5.24); it does not log there.
    after = {"save_steps": f": the one checkpoint is the last step's (a preemption before step {steps} leaves none to "
                           "resume from)",
             "eval_steps": f": the one evaluation is the last step's, at step {steps}",
             "logging_steps": ", so it never fires"}
    for strategy, field in (("save_strategy", "save_steps"), ("eval_strategy", "eval_steps"),
                            ("logging_strategy", "logging_steps")):
        value = getattr(t, field)
        if str(getattr(getattr(t, strategy), "value", getattr(t, strategy))) == "steps" and value \
                and value >= 1 and value > steps:
            found.append(f"{field} is {value:g} but the run has only max_steps {steps}{after[field]}")
    if t.warmup_steps and t.warmup_steps >= 1 and t.warmup_steps >= steps:
        found.append(f"warmup_steps is {t.warmup_steps:g} and the run has {steps} steps: the learning rate never "
                     "leaves warmup")
    return found


def unused_lora_flags(argv: list[str], use_peft: bool) -> list[str]:
    """LoRA flags on the command line of a full fine-tuning run, which TRL reads only with use_peft: one warning
    (a script that switches use_peft keeps the rest; a user who meant LoRA learns it before the run)."""
    lora = sorted({a[2:].split("=")[0] for a in argv if a.startswith(("--lora_", "--use_rslora", "--use_dora"))})
    if use_peft or not lora:
        return []
    return [(f"{', '.join('--' + k for k in lora)} change nothing: this run fine-tunes every weight (use_peft "
             "false). Fix: --use_peft true to train a LoRA adapter, or leave them out")]


def epochs_ignored(argv: list[str], t) -> list[str]:
    """--num_train_epochs on the command line of a run whose max_steps (the recipe YAML's, usually) is set: the
    Trainer takes max_steps and ignores the epochs without a word (`--num_train_epochs 0.5` trained the recipe's 300
    steps). One warning naming both and the way to train by epochs."""
    given = override(argv, "num_train_epochs", None)
    if given is None or t.max_steps <= 0:
        return []
    where = "on the command line" if override(argv, "max_steps", None) is not None else "in the recipe YAML"
    return [f"--num_train_epochs {given} changes nothing: max_steps {t.max_steps} ({where}) decides the run's "
            f"length, so it trains {t.max_steps} steps. Fix: --max_steps -1 to train by epochs"]


def check_lora_values(model_args) -> None:
    if not model_args.use_peft:
        return
    if model_args.lora_r < 1:
        _fail(f"lora_r is {model_args.lora_r}; the LoRA rank must be at least 1", "set lora_r to e.g. 16")
    if model_args.lora_alpha <= 0:
        _fail(f"lora_alpha is {model_args.lora_alpha}; it must be positive (it scales the update by alpha / r)",
              "set lora_alpha to e.g. lora_r or 2 x lora_r")
    if not 0 <= model_args.lora_dropout < 1:
        _fail(f"lora_dropout is {model_args.lora_dropout}; it must be in [0, 1)", "set lora_dropout to e.g. 0.05")


def check_gate_values(pack) -> None:
    """The gates and warnings of metrics/gates.py are shares (0-1), not percentages: 40 would be a gate no run meets."""
    for name in ("mfu_min", "peak_memory_max_fraction", "memory_headroom_warning"):
        value = getattr(pack, name)
        if value is not None and not 0 <= value <= 1:
            _fail(f"{name} is {value}; it is a share between 0 and 1", f"write e.g. {name}: {min(value / 100, 1):g} "
                  "for a percentage")
    if pack.divergence_factor < 0 or 0 < pack.divergence_factor <= 1:
        _fail(f"divergence_factor is {pack.divergence_factor}; it must be above 1 (or 0: off)",
              "set it to e.g. 2 (the last loss above twice the first)")


def check_values(cfg: RunConfig) -> None:
    check_training_values(cfg.training, cfg.training.eval_strategy != "no")
    check_lora_values(cfg.model)
    if cfg.pack.preemption_grace_s < 0:
        _fail(f"preemption_grace_s is {cfg.pack.preemption_grace_s}", "set it to the seconds a checkpoint save needs")
    if (size := cfg.pack.eval_split_size) < 0 or (size >= 1 and size % 1):
        _fail(f"eval_split_size is {size:g}: give a share of the training rows below 1 (0.1 holds out 10%) or a "
              "whole number of rows", "correct it, or 0 for none")
    check_gate_values(cfg.pack)
    check_output_dir(cfg.training.output_dir)
    check_resume_kept(cfg.training.resume_from_checkpoint, cfg.training.output_dir, cfg.pack.overwrite_output_dir)
    lora_config(cfg)
