"""Speed and memory options: one module each, one registry, OPTIONS. Everything outside this folder asks the
registry (the functions below run every option's hook in turn), never an option's settings by name.

The options' names and their own argument dataclasses are the registry in config/option_registry.py (the recipe's
parse needs the dataclasses before any training code loads). An option module provides (SpeedOption below checks it
when OPTIONS is built from those names, at import):
    FIELDS                          the recipe settings it owns (TRL's, transformers', accelerate's or its own):
                                    named nowhere else in the package (tests/test_speed_options.py greps)
    enabled(cfg)                    whether the recipe turns it on
Optional, with the defaults of SpeedOption:
    check_config(cfg)               before any process starts, again in every rank, and in `make plan`: no device,
                                    no weights (a setting it cannot take with the others: one line)
    check_installed(cfg)            the same places but `make plan` (which plans for another machine): the
                                    packages it needs are installed here
    check_accelerate(acc, path)     the accelerate YAML alone, in the launcher's first checks and `make plan`
    check_launch(cfg, acc, path)    the launcher only, before the ranks work: the accelerate YAML, the devices
                                    without importing torch (nvidia-smi)
    check_model(model, acc, path)   the launcher, against a meta-device copy of the model
    check_model_config(cfg, config) `make plan` and the option's own check_config: the settings against the model's
                                    transformers config (YaRN against its trained length)
    launch_overrides(field, gpus, planner_pick)  the launcher, before the ranks start: (overrides, line) for a setting
                                    the planner decides (planner_pick() -> (choice, why), planning/launch_pick.py)
    smoke(field, gpus)              `make smoke`: (overrides, note) where the option cannot run on this machine;
                                    field(name, default) reads the recipe's setting (config/recipes.py Recipe)
    settle(cfg)                     in the ranks, before run_args.json records the settings as they will run
    model_init_kwargs(cfg)          what from_pretrained gets (TRL's model_init_kwargs)
    load_model(path, init_kwargs)   a model object to give TRL instead of the path, or None (the path)
    prepare_trainer(trainer, cfg)   what it does to the built trainer before train(): returns what the run report
                                    records under the option's name (None: nothing), and prints its line
    planner_setup(model_args, training)  `make plan`: fields of planning/memory_budget.py's Setup it decides
    planner_settings(cfg)           `make plan`: the same, from the option's own settings (the parsed recipe)
    planner_shape(model, model_args)     `make plan`: fields of its ModelShape it decides (a meta-device model)
    planner_note(cfg, config)       `make plan`: a line about what it does to the plan (None: nothing to say)
    planner_choices(cfg)            `make plan`: alternatives it compares by memory ({name: Setup fields}, fastest
                                    first), the recipe's pin (None: the planner picks) and the line's label
    RESUME_SETTINGS                 settings a resume must keep equal to the checkpoint's (checkpoint/resume_settings)

Adding an option: that module, its line in config/option_registry.py (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType

from fsdp_recipes import registry
from fsdp_recipes.config.option_registry import OPTIONS as REGISTERED
from fsdp_recipes.registry import members_of


def _nothing(*args, **kwargs) -> None:
    return None


def _no_fields(*args, **kwargs) -> dict:
    return {}


def _no_choices(*args, **kwargs) -> tuple[dict, None, str]:
    return {}, None, ""


def _no_smoke(*args, **kwargs) -> tuple[list[str], str | None]:
    return [], None


@dataclasses.dataclass(frozen=True)
class SpeedOption:
    """What the launcher, the ranks, the planner and the smoke run ask of an option. Built from the option's module
    by `from_module`: a missing required member fails there, when the registry is built, not in a run."""

    name: str
    FIELDS: tuple
    enabled: Callable
    check_config: Callable = _nothing
    check_installed: Callable = _nothing
    check_accelerate: Callable = _nothing
    check_launch: Callable = _nothing
    check_model: Callable = _nothing
    check_model_config: Callable = _nothing
    smoke: Callable = _no_smoke
    launch_overrides: Callable = _no_smoke
    settle: Callable = _nothing
    model_init_kwargs: Callable = _no_fields
    load_model: Callable = _nothing
    prepare_trainer: Callable = _nothing
    planner_setup: Callable = _no_fields
    planner_settings: Callable = _no_fields
    planner_shape: Callable = _no_fields
    planner_note: Callable = _nothing
    planner_choices: Callable = _no_choices
    RESUME_SETTINGS: tuple = ()
    module: ModuleType | None = None

    @classmethod
    def from_module(cls, name: str, module: ModuleType) -> SpeedOption:
        members = members_of(cls, module, "speed option", name, "fsdp_recipes/speed/__init__.py")
        for member in ("FIELDS", "RESUME_SETTINGS"):
            value = members.get(member, ())
            if not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
                raise TypeError(f"speed option {name} ({module.__name__}): {member} must be a tuple of setting names")
        return cls(name=name, module=module, **members)


OPTIONS: dict[str, SpeedOption] = {
    name: SpeedOption.from_module(name, importlib.import_module(f"{__name__}.{name}")) for name in REGISTERED
}


def register(name: str, module: ModuleType) -> SpeedOption:
    """An option whose module lives outside this folder (a site's own kernel), checked as the pack's own are; its
    own settings, if any, need their dataclass in config/option_registry.py's OPTIONS too."""
    return registry.register(OPTIONS, SpeedOption, name, module)


def names() -> tuple[str, ...]:
    return tuple(OPTIONS)


def each(hook: str, *args) -> None:
    """Every option's `hook`, in the registry's order (a check raises its one line)."""
    for option in OPTIONS.values():
        getattr(option, hook)(*args)


def merged(hook: str, *args) -> dict:
    """Every option's `hook` returns fields; all of them, a later option's winning."""
    fields = {}
    for option in OPTIONS.values():
        fields.update(getattr(option, hook)(*args))
    return fields


def active(cfg) -> list[SpeedOption]:
    """The options the recipe turns on, in the registry's order."""
    return [option for option in OPTIONS.values() if option.enabled(cfg)]


def check_config(cfg, installed: bool = True) -> None:
    """Every option's settings; with `installed`, also that what it needs is installed on this machine."""
    for option in OPTIONS.values():
        option.check_config(cfg)
        if installed:
            option.check_installed(cfg)


def check_accelerate(acc: dict, path) -> None:
    each("check_accelerate", acc, path)


def check_launch(cfg, acc: dict, path) -> None:
    each("check_launch", cfg, acc, path)


def check_model(model, acc: dict, path) -> None:
    each("check_model", model, acc, path)


def check_model_config(cfg, config) -> None:
    each("check_model_config", cfg, config)


def planner_notes(cfg, config) -> list[str]:
    """The enabled options' lines for `make plan`."""
    return [note for option in active(cfg) if (note := option.planner_note(cfg, config))]


def smoke(field, gpus: int) -> tuple[list[str], list[str]]:
    """Every option's overrides for a smoke run on this machine, and the lines that say why. `field(name, default)`:
    the recipe's setting as the run will see it (config/recipes.py Recipe.field)."""
    overrides, notes = [], []
    for option in OPTIONS.values():
        more, note = option.smoke(field, gpus)
        overrides += more
        if note:
            notes.append(note)
    return overrides, notes


def launch_overrides(field, gpus: int, planner_pick) -> tuple[list[str], list[str]]:
    """Every option's overrides for the ranks that the planner decides on this machine, and the lines that say so."""
    overrides, notes = [], []
    for option in OPTIONS.values():
        more, note = option.launch_overrides(field, gpus, planner_pick)
        overrides += more
        if note:
            notes.append(note)
    return overrides, notes


def settle(cfg) -> None:
    each("settle", cfg)


def model_init_kwargs(cfg) -> dict:
    return merged("model_init_kwargs", cfg)


def load_model(path: str, init_kwargs: dict):
    """The model object an option builds in place of TRL's from_pretrained(path), else the path."""
    for option in OPTIONS.values():
        model = option.load_model(path, init_kwargs)
        if model is not None:
            return model
    return path


def prepare_trainer(trainer, cfg) -> dict:
    """Each enabled option applied to the built trainer; what the run report records, by option."""
    recorded = {}
    for option in active(cfg):
        record = option.prepare_trainer(trainer, cfg)
        if record is not None:
            recorded[option.name] = record
    return recorded


def planner_setup(model_args, training, cfg=None) -> dict:
    """Setup fields from TrainingArguments' settings, and with the parsed recipe `cfg` from the options' own."""
    return {**merged("planner_setup", model_args, training), **(merged("planner_settings", cfg) if cfg else {})}


def planner_shape(model, model_args) -> dict:
    return merged("planner_shape", model, model_args)


def planner_choices(cfg) -> tuple[dict, str | None, str]:
    """The one option's alternatives the planner chooses between (activation checkpointing's policies), or none."""
    for option in OPTIONS.values():
        choices = option.planner_choices(cfg)
        if choices[0]:
            return choices
    return {}, None, ""


def resume_settings() -> tuple[str, ...]:
    return tuple(name for option in OPTIONS.values() for name in option.RESUME_SETTINGS)
