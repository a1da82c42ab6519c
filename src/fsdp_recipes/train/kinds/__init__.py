"""Trainer kinds: one thin module each, on the rank lifecycle that train/entry.py runs for all of them, and one
registry, KINDS. Everything outside this folder asks the registry and the kind (`kinds.load(name)`), never a kind's
name.

The kinds' names, the TRL config class whose fields each kind's <kind>.yaml holds, and the kind's own argument
dataclass (cfg.kind_args: the sampling kinds' reward_funcs and generation_backend) are the registry in
config/kind_registry.py (the config layer needs them before any training code loads). A kind module provides
(TrainerKind below checks it when KINDS is built from those names, at import):
    trainer_class()                   TRL's trainer class (SFTTrainer, DPOTrainer, ...); entry.py adds the pack's hooks
    check_config(cfg)                 the kind's own settings, before anything loads (one-line errors)
    load_datasets(cfg)                (train, eval or None), with one-line errors for splits and columns
    check_data(cfg, splits, tokenizer)  the rows, in the launcher before any rank starts: errors with file and
                                      line; returns the warnings (tokenizer: None when the model is not local)
    REPORTED_LOGS                     the trainer's own log keys that the run report adds to metrics.json
    trainer_kwargs(cfg)               what the trainer takes besides model, args, data, peft_config and callbacks
                                      (the sampling kinds: the reward functions)
    extra_forwards(training)          forwards per trained token besides its own: "reference" (DPO, KTO; sampling
                                      kinds with a KL term), "generation" (sampling): FLOPs, MFU, `make plan`'s rows
    sequence_length(training)         `make plan`'s worst-case tokens of one trained sequence
    RESUME_SETTINGS                   the kind's settings a resume compares with its checkpoint's, like the
                                      learning rate (checkpoint/resume_settings.py)
    SEQUENCES_PER_ROW, ROWS           `make plan`: sequences per dataset row, and what to call a row
    SMOKE_DATA                        which of tiny_assets' datasets `make smoke` trains on
    describe_tokens                   how tokens/s and MFU count this kind's work (docs/run-report.md)
Optional, with the defaults of TrainerKind: SMOKE_SETTINGS (fields `make smoke` replaces: a sampling kind's reward),
generation_setup(cfg, capacity_gib) (`make plan`'s memory for sampling), settle_generation(cfg) (the sampling
backend for this machine, after check_config: not in `make data`), describe_generation(training) (the run's
first lines say how completions are sampled), check_learned(log_history, training) (a run whose rewards never varied
stops before its final save, in one line), count_prepared(trainer, prepared, counter) (counts the batch that exists
only after sampling), summary_lines(metrics) (the end-of-run summary's lines of the kind's own) and
eval_loss(run_args) (what TRL's eval loss of a run counts, said under it in the summary). A kind module may
name SHARED_WITH, a module whose members it takes where it defines none: the sampling kinds take sampling.py's.

Adding a kind: that module, its line in config/kind_registry.py, and recipes whose settings live in <kind>.yaml
(docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType

from fsdp_recipes.config.kind_registry import DEFAULT_TRAINER, TRAINERS

DEFAULT = DEFAULT_TRAINER


NOT_MEMBERS = ("name", "config_class", "module")  # TrainerKind's fields that the registry fills, not the module


def _no_check(*args, **kwargs) -> None:
    return None


def _nothing(*args, **kwargs) -> list:
    return []


def _no_setup(*args, **kwargs) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class TrainerKind:
    """What the launcher, checks, placement, planner, smoke run, resume comparison, console, summary and run report
    ask of a kind. Built from the kind's module by `from_module`: a missing required member fails there, when the
    registry is built, not in the middle of a run."""

    name: str
    trainer_class: Callable
    trainer_kwargs: Callable
    check_config: Callable
    load_datasets: Callable
    check_data: Callable
    sequence_length: Callable
    extra_forwards: Callable
    REPORTED_LOGS: tuple
    RESUME_SETTINGS: tuple
    SEQUENCES_PER_ROW: int
    ROWS: str
    SMOKE_DATA: str
    describe_tokens: str
    SMOKE_SETTINGS: dict = dataclasses.field(default_factory=dict)
    generation_setup: Callable = _no_setup
    settle_generation: Callable = _no_check
    describe_generation: Callable | None = None
    check_learned: Callable = _no_check
    count_prepared: Callable | None = None
    summary_lines: Callable = _nothing
    eval_loss: Callable | None = None  # None: the kind's own loss, on the eval split
    config_class: str = ""  # TRL's config class (config/kind_registry.py)
    module: ModuleType | None = None

    @classmethod
    def from_module(cls, name: str, module: ModuleType, config_class: str | None = None) -> TrainerKind:
        members = {}
        required = required_members()
        shared = getattr(module, "SHARED_WITH", None)  # a module whose members the kind takes where it has none
        for f in dataclasses.fields(cls):
            if f.name in NOT_MEMBERS:
                continue
            if hasattr(module, f.name):
                members[f.name] = getattr(module, f.name)
            elif shared is not None and hasattr(shared, f.name):
                members[f.name] = getattr(shared, f.name)
            elif f.name in required:
                raise TypeError(f"trainer kind {name} ({module.__name__}) lacks {f.name}: every kind provides "
                                f"{', '.join(required)} (fsdp_recipes/train/kinds/__init__.py)")
        return cls(name=name, config_class=config_class or TRAINERS[name].config_class, module=module, **members)

    def samples(self, training) -> bool:
        """The kind samples what it trains on (its forwards include generation): FLOPs, plan, summary."""
        return "generation" in self.extra_forwards(training)


def required_members() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainerKind) if f.name not in NOT_MEMBERS
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


KINDS: dict[str, TrainerKind] = {
    name: TrainerKind.from_module(name, importlib.import_module(f"{__name__}.{name}")) for name in TRAINERS
}


def load(kind: str) -> TrainerKind:
    return KINDS[kind]


def names() -> tuple[str, ...]:
    return tuple(KINDS)
