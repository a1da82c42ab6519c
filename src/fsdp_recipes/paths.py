"""Where the pack keeps generated assets, and how recipe YAML paths are expanded."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FSDP_RECIPES_CACHE"


def cache_dir() -> Path:
    """$FSDP_RECIPES_CACHE, else ~/.cache/fsdp_recipes. Exported so recipe YAMLs can say $FSDP_RECIPES_CACHE."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fsdp_recipes"
    path = Path(os.environ.setdefault(CACHE_ENV, str(default))).expanduser()
    return path


def expand(value: str | None) -> str | None:
    """Expand `~` and `$VARS` in a path-like recipe value (YAML has no such expansion; TRL's parser neither)."""
    if value is None:
        return None
    cache_dir()  # makes $FSDP_RECIPES_CACHE defined for the expansion below
    return os.path.expanduser(os.path.expandvars(value))
