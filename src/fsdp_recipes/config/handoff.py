"""The recipe as the launcher read it, handed to its ranks in one file: `RunConfig.settings`, the recipe's YAML with
the command line's values in (config/run_config.py). The ranks build their configuration from it and read neither
the YAML nor the command line again, so what the launcher checked is what they train with.

    accelerate launch ... -m fsdp_recipes.train.entry --recipe_settings <file>   # what the launcher starts
    accelerate launch ... -m fsdp_recipes.train.entry --config <sft.yaml> [--field value ...]   # by hand: as before
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_recipes.errors import UserError
from fsdp_recipes.records import write_json_atomic

FLAG = "--recipe_settings"


def rank_argv(path: Path) -> list[str]:
    """The entry point's arguments that hand it the settings written to `path`."""
    return [FLAG, str(path)]


def write(settings: dict, path: Path) -> None:
    """Before the ranks pass their start gate. A value JSON cannot hold fails here, in the launcher, not in a rank."""
    write_json_atomic(path, json.loads(json.dumps(settings)))  # write_json_atomic would str() what JSON cannot hold


def take(argv: list[str]) -> tuple[dict, str, list[str]] | None:
    """(settings, the file's path, the rest of argv) where argv hands settings over (rank_argv), else None."""
    if argv[:1] != [FLAG]:
        return None
    if len(argv) < 2:
        raise UserError(f"{FLAG} needs the file the launcher wrote. Fix: start the ranks with the launcher, or give "
                        "--config <recipe>/sft.yaml.")
    try:
        settings = json.loads(Path(argv[1]).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{FLAG} {argv[1]} cannot be read ({err}). Fix: start the ranks with the launcher, or give "
                        "--config <recipe>/sft.yaml.") from None
    return settings, argv[1], argv[2:]
