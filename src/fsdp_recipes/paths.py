"""Where the pack keeps generated assets, and how recipe YAML paths are expanded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fsdp_recipes.errors import UserError

CACHE_ENV = "FSDP_RECIPES_CACHE"


def cache_dir() -> Path:
    """$FSDP_RECIPES_CACHE, else ~/.cache/fsdp_recipes. Exported so recipe YAMLs can say $FSDP_RECIPES_CACHE."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fsdp_recipes"
    path = Path(os.environ.setdefault(CACHE_ENV, str(default))).expanduser()
    return path


def in_pack_cache(path: str) -> bool:
    """Whether `path` lies in the pack's cache, where the checks build the tiny and SmolLM2 assets it names."""
    return Path(path).absolute().is_relative_to(cache_dir().absolute())


def same_path_key(path: str) -> str:
    """A recipe path as comparable text: `$FSDP_RECIPES_CACHE/...` and `~/...` as the YAML writes them, expanded and
    normalised, an unset variable left as it is (a comparison, not a path to open: expand() refuses those)."""
    return os.path.normpath(os.path.expanduser(os.path.expandvars(path)))


def expand(value: str | None, what: str = "a recipe path") -> str | None:
    """Expand `~` and `$VARS` in a path-like recipe value (YAML has no such expansion; TRL's parser neither).

    os.path.expandvars leaves an unset variable as it is, so `$SLURM_JOB_ID.prom` outside Slurm would name a file
    `$SLURM_JOB_ID.prom`: that is refused here instead of written."""
    if value is None:
        return None
    cache_dir()  # makes $FSDP_RECIPES_CACHE defined for the expansion below
    out = os.path.expanduser(os.path.expandvars(value))
    unset = re.search(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", out)
    if unset:
        raise UserError(f"{what} {value} uses ${unset.group(1)}, which is not set here. "
                        f"Fix: export {unset.group(1)} before launching, or write the path out.")
    return out
