"""The library versions every patch in this folder was checked on: one table for the whole pack.

Each patch replaces a private function written for particular releases. `guard.target` refuses to apply a patch,
with one line, when an installed library is outside its range here (a signature can stay the same while the code
behind it changes), and when the function's signature changed. `make test-compat` runs the suite at both ends of
these ranges (docs/development.md, "Tested versions"); pyproject.toml allows exactly these ranges for the patched libraries
(tests/test_patches.py keeps the two equal), so a widened range must first pass `make test-compat`.

A version that needs a code path of its own gets it here, not spread over the pack: the renamed checkpointing
fields below (transformers 5.17), detected by the fields the installed release has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# The lower ends, torch 2.11 + transformers 5.17 (current CUDA images), passed the fast suite and the launch tests on
# 2026-11-24 (docs/development.md, "Tested versions"), once the final save called Trainer._save on the writing process
# only (checkpoint/save_check.py: 5.17's _save does not return early on the other ranks).
CHECKED = {
    "torch": ">=2.11,<2.16",
    "transformers": ">=5.17,<5.25",
    "trl": ">=1.16,<1.17",
    "peft": ">=0.21,<0.22",
    "accelerate": ">=1.15,<1.16",
}


def checked_on(*libraries: str) -> dict[str, str]:
    """The ranges of `libraries`, for a patch's `guard.target(..., checked_on=...)`."""
    return {lib: CHECKED[lib] for lib in libraries}


def installed(library: str) -> Version | None:
    try:
        return Version(version(library))
    except PackageNotFoundError:
        return None


def outside(ranges: dict[str, str]) -> list[str]:
    """`lib version` for every installed library of `ranges` outside its range (local builds such as 2.13.0+cpu
    and release candidates count as their release)."""
    found = []
    for lib, spec in ranges.items():
        have = installed(lib)
        if have is not None and not SpecifierSet(spec).contains(have, prereleases=True):
            found.append(f"{lib} {have}")
    return found


# transformers renamed gradient checkpointing: the recipes say `activation_checkpointing` (and `_kwargs`), the name of
# the newest releases, where the old name is deprecated; transformers 5.17 knows only `gradient_checkpointing` (5.23+
# has both names).
RENAMED_TRAINING_FIELDS = {"activation_checkpointing": "gradient_checkpointing",
                           "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


@dataclass
class NewTrainingFieldNames:
    """The new names, parsed by the pack when the installed SFTConfig lacks them (`new_training_field_names`)."""

    activation_checkpointing: bool = field(default=False, metadata={"help": "gradient_checkpointing, as newer "
                                                                             "transformers releases call it"})
    activation_checkpointing_kwargs: str | None = field(default=None, metadata={
        "help": "gradient_checkpointing_kwargs (a dict, or its JSON), as newer transformers releases call it"})


def new_training_field_names(config_class) -> type | None:
    """NewTrainingFieldNames when `config_class` (the installed TRL config of the run's kind) has only the old names,
    else None."""
    names = {f.name for f in fields(config_class)}
    return NewTrainingFieldNames if not set(RENAMED_TRAINING_FIELDS) & names else None


def apply_new_training_field_names(new: NewTrainingFieldNames, training, given: set[str]) -> None:
    """Copy the new names that the recipe or command line gave (`given`) onto the old SFTConfig's fields, and
    expose the new names on it too, so the rest of the pack reads `training.activation_checkpointing` everywhere."""
    for new_name, old_name in RENAMED_TRAINING_FIELDS.items():
        value = getattr(new, new_name)
        if new_name in given:
            if isinstance(value, str):  # from the command line: JSON, as transformers parses its own dict fields
                value = json.loads(value)
            setattr(training, old_name, value)
        object.__setattr__(training, new_name, getattr(training, old_name))
