"""Trainer kinds: one thin module each, on the rank lifecycle that train/entry.py runs for all of them.

A kind module provides:
    trainer_class()                   TRL's trainer class (SFTTrainer, DPOTrainer, GRPOTrainer); entry.py adds the pack's hooks
    check_config(cfg)                 the kind's own settings, before anything loads (one-line errors)
    load_datasets(cfg)                (train, eval or None), with one-line errors for splits and columns
    check_data(cfg, splits, tokenizer)  the rows, in the launcher before any rank starts: errors with file and
                                      line; returns the warnings (tokenizer: None when the model is not local)
    REPORTED_LOGS                     the trainer's own log keys that the run report adds to metrics.json
    trainer_kwargs(cfg)               what the trainer takes besides model, args, data, peft_config and callbacks
                                      (GRPO: the reward functions)
    extra_forwards(training)          forwards per trained token besides its own: "reference" (DPO; GRPO with a
                                      KL term), "generation" (GRPO's sampling): FLOPs, MFU, `make plan`'s rows
    sequence_length(training)         `make plan`'s worst-case tokens of one trained sequence
    RESUME_SETTINGS                   the kind's settings a resume compares with its checkpoint's, like the
                                      learning rate (checkpoint/resume_settings.py)
    SEQUENCES_PER_ROW, ROWS           `make plan`: sequences per dataset row, and what to call a row
    SMOKE_DATA                        which of tiny_assets' datasets `make smoke` trains on
    describe_tokens                   how tokens/s and MFU count this kind's work (docs/run-report.md)
Optional: SMOKE_SETTINGS (fields `make smoke` replaces: GRPO's reward), describe_generation(training) (GRPO: the
run's first lines say how completions are sampled; `make plan` then counts the sampling's memory) and
check_learned(log_history, ...) (GRPO: a run whose rewards never varied stops before its final save, in one line).

Adding a kind: that module, a line in config/recipes.py TRAINERS (the TRL config class), and recipes whose
settings live in <kind>.yaml (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load(kind: str) -> ModuleType:
    return importlib.import_module(f"fsdp_recipes.train.kinds.{kind}")
