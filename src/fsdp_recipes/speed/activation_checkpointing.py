"""Activation checkpointing: which decoder layers keep their activations for the backward and which recompute them.

The policy is this option's own setting, `activation_checkpointing_policy` (config/option_registry.py):
    none        every layer keeps its activations: no recompute, the most memory
    every_<k>   every k-th layer is checkpointed (transformers' `every_n_layers`), the others keep theirs
    ops         every layer checkpointed, but the attention outputs are saved (TRL's selective checkpointing, torch's
                create_selective_checkpoint_contexts): the rest of the layer is recomputed. SFTTrainer only
    full        every layer checkpointed: each keeps its input and recomputes the rest (TRL's default)
    auto        the planner picks the fastest of these that fits the GPU's memory within the gates' headroom: `make
                plan` prints it, and the launcher resolves it for the GPUs it finds before the ranks start
Unset, TrainingArguments' own fields decide as written (`activation_checkpointing`, `activation_checkpointing_kwargs`;
`gradient_checkpointing*` before transformers 5.23, patches/versions.py maps them). A policy is applied through those
same fields (`settle`, in the ranks before run_args.json records them): transformers' Trainer calls
`activation_checkpointing_enable(every_n_layers=...)`, TRL's SFTTrainer wraps it for `{selective: true}`. The run
report's speed_options records the policy that ran. `make plan` counts each policy's activations
(planning/memory_budget.py) and prints its choice (planning/checkpointing.py).
"""

from __future__ import annotations

import re

from fsdp_recipes.config.kind_registry import TRAINERS
from fsdp_recipes.errors import UserError

FIELDS = ("activation_checkpointing_policy", "activation_checkpointing", "activation_checkpointing_kwargs",
          "gradient_checkpointing", "gradient_checkpointing_kwargs")
SETTING = "activation_checkpointing_policy"
# auto's candidates, fastest first: less recompute is faster and keeps more (each saves more than the next)
CANDIDATES = ("none", "every_4", "every_2", "ops", "full")
EVERY = re.compile(r"every_([0-9]+)$")


def policy(cfg) -> str | None:
    return cfg.option("activation_checkpointing").activation_checkpointing_policy


def enabled(cfg) -> bool:
    return policy(cfg) is not None or checkpointed(cfg.training)


def checkpointed(training) -> bool:
    return bool(getattr(training, "activation_checkpointing", False) or
                getattr(training, "gradient_checkpointing", False))


def kwargs_of(training) -> dict:
    kwargs = getattr(training, "activation_checkpointing_kwargs", None) or \
        getattr(training, "gradient_checkpointing_kwargs", None) or {}
    return kwargs if isinstance(kwargs, dict) else {}


def written_policy(training) -> str:
    """The policy TrainingArguments' fields give as written (a recipe without activation_checkpointing_policy)."""
    if not checkpointed(training):
        return "none"
    kwargs = kwargs_of(training)
    if kwargs.get("selective"):
        return "ops"
    every = int(kwargs.get("every_n_layers", 1) or 1)
    return f"every_{every}" if every > 1 else "full"


def every(name: str) -> int:
    """How often a layer is checkpointed under `name`: 1 every layer, k every k-th, 0 none."""
    if name == "none":
        return 0
    match = EVERY.match(name)
    return int(match.group(1)) if match else 1


def check_config(cfg) -> None:
    name = policy(cfg)
    if name is None:
        return
    match = EVERY.match(name)
    if name not in ("none", "full", "ops", "auto") and not (match and int(match.group(1)) >= 2):
        raise UserError(f"{SETTING}: {name} is not a policy. Fix: one of none, every_2 (or every_<k>, k >= 2), ops, "
                        "full, auto.")
    if name == "ops" and not TRAINERS[cfg.trainer].selective_checkpointing:
        raise UserError(f"{SETTING}: ops is TRL's selective checkpointing, which only SFTTrainer applies; this "
                        f"recipe's trainer is {cfg.trainer}. Fix: full, every_2 or none.")


def launch_overrides(field, gpus: int, planner_pick) -> tuple[list[str], str | None]:
    """In the launcher, before the ranks start: `auto` becomes the planner's pick for the GPUs here
    (`planner_pick()`: planning/launch_pick.py, the recipe planned as `make plan` plans it); without GPUs, full,
    TRL's default (the planner plans GPU memory). Returns the override the ranks get and the line that says so."""
    if str(field(SETTING, "")) != "auto":
        return [], None
    if not gpus:
        return ["--" + SETTING, "full"], ("activation checkpointing: auto on a machine without GPUs -> full "
                                          "(TRL's default)")
    pick, why = planner_pick()
    return ["--" + SETTING, pick], f"activation checkpointing: auto -> {pick} ({why})"


def raise_auto() -> None:
    raise UserError(f"{SETTING}: auto is decided by the planner before the ranks start, which the launcher does "
                    "(python -m fsdp_recipes.launch.launcher, make finetune); a run started otherwise needs the pick. "
                    "Fix: launch through the launcher, or set the policy `make plan RECIPE=<recipe> GPUS=<n> "
                    "GPU=<model>` prints (\"-> pick <policy>\").")


def settle(cfg) -> None:
    """The policy onto TrainingArguments' fields (both spellings where the installed version has both)."""
    name = policy(cfg)
    if name is None:
        return
    if name == "auto":
        raise_auto()
    training = cfg.training
    on = name != "none"
    kwargs = {k: v for k, v in kwargs_of(training).items() if k not in ("every_n_layers", "selective")}
    if on:
        kwargs["use_reentrant"] = False  # selective checkpointing needs it; the pack's recipes all used it
        if every(name) > 1:
            kwargs["every_n_layers"] = every(name)
        if name == "ops":
            kwargs["selective"] = True
    for flag, args in (("activation_checkpointing", "activation_checkpointing_kwargs"),
                       ("gradient_checkpointing", "gradient_checkpointing_kwargs")):
        if hasattr(training, flag):
            setattr(training, flag, on)
            setattr(training, args, dict(kwargs) if on else None)


def setup_fields(name: str) -> dict:
    """planning/memory_budget.py's Setup fields for a policy."""
    return {"checkpointed": name != "none", "checkpoint_every": max(every(name), 1), "checkpoint_ops": name == "ops"}


def planner_setup(model_args, training) -> dict:
    return setup_fields(written_policy(training))


def planner_choices(cfg) -> tuple[dict[str, dict], str | None, str]:
    """`make plan`: the policies it compares (fastest first, as Setup fields), the recipe's pin (None for auto) and
    the line's label."""
    names = [n for n in CANDIDATES if n != "ops" or TRAINERS[cfg.trainer].selective_checkpointing]
    name = policy(cfg)
    pinned = None if name == "auto" else (name or written_policy(cfg.training))
    if pinned not in names:
        names.append(pinned) if pinned else None
    label = f"activation checkpointing ({SETTING}: {name or 'unset, ' + pinned + ' as TrainingArguments say'})"
    return {n: setup_fields(n) for n in names}, pinned, label


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    if str(field(SETTING, "")) == "auto":
        return ["--" + SETTING, "full"], "activation checkpointing: auto is make plan's pick for the full model -> full"
    return [], None


def prepare_trainer(trainer, cfg) -> dict:
    training = trainer.args
    return {"policy": written_policy(training), "kwargs": kwargs_of(training)}
