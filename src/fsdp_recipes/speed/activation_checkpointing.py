"""Activation checkpointing (TrainingArguments' `activation_checkpointing`, `gradient_checkpointing` in releases
before transformers 5.23; patches/versions.py maps the two): each decoder layer's activations recomputed in the
backward instead of kept. TRL's trainers turn it on by default; `make plan` counts what it saves
(planning/memory_budget.py) and `make plan --fit` says whether a recipe needs it.
"""

from __future__ import annotations

FIELDS = ("activation_checkpointing", "activation_checkpointing_kwargs",
          "gradient_checkpointing", "gradient_checkpointing_kwargs")


def enabled(cfg) -> bool:
    return checkpointed(cfg.training)


def checkpointed(training) -> bool:
    return bool(getattr(training, "activation_checkpointing", False) or
                getattr(training, "gradient_checkpointing", False))


def planner_setup(model_args, training) -> dict:
    return {"checkpointed": checkpointed(training)}


def prepare_trainer(trainer, cfg) -> dict:
    kwargs = getattr(cfg.training, "activation_checkpointing_kwargs", None) or \
        getattr(cfg.training, "gradient_checkpointing_kwargs", None) or {}
    return {"kwargs": kwargs if isinstance(kwargs, dict) else str(kwargs)}
