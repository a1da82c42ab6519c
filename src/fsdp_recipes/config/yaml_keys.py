"""Recipe YAML and command-line keys: read a YAML file, and name a key or flag that no config class knows
(with the closest known one), so a typo is one line rather than a traceback from every rank.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import yaml

from fsdp_recipes.errors import UserError


def load_yaml(path: str | Path, what: str = "config") -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}. Fix: check the path (recipes live in recipes/<name>/).")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"malformed YAML in {path}{where}: {problem}. Fix: correct the YAML syntax there.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a YAML mapping of `key: value` lines, not {type(data).__name__}.")
    return data



def known_fields(dataclass_types) -> set[str]:
    return {f.name for dc in dataclass_types for f in dataclasses.fields(dc)}



def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean `{close[0]}`?" if close else "remove it, or see `--help` for the valid keys"



def check_known_keys(config: dict, dataclass_types, path: str | Path) -> None:
    """Every key must be a field of one of the parser's dataclasses (or TRL's `env`)."""
    known = known_fields(dataclass_types) | {"env"}
    for key in config:
        if key not in known:
            raise UserError(f"unknown config key `{key}` in {path}. Fix: {_suggest(key, known)}")



def check_known_flags(argv: list[str], dataclass_types) -> None:
    """Command-line overrides must name fields too (`--no_<bool field>` included, as HfArgumentParser allows)."""
    known = known_fields(dataclass_types) | {"config", "help", "h"}
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0]
        if key not in known and not (key.startswith("no_") and key[3:] in known):
            raise UserError(f"unknown command-line flag `--{key}`. Fix: {_suggest(key, known)}")
