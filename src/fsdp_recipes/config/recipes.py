"""Finding recipes: `recipes/<name>/` folders holding sft.yaml, accelerate.yaml, launch.sh and README.md.

    python -m fsdp_recipes.config.recipes list          # name and one-line description of each recipe
    python -m fsdp_recipes.config.recipes check NAME    # exit 2 with a clear line when NAME is not a recipe
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fsdp_recipes.errors import UserError, cli

RECIPE_FILES = ("sft.yaml", "accelerate.yaml")


def recipes_root() -> Path:
    return Path(os.environ.get("FSDP_RECIPES_DIR", "recipes"))


def is_recipe(path: Path) -> bool:
    return all((path / f).is_file() for f in RECIPE_FILES)


def available(root: Path | None = None) -> list[str]:
    root = root or recipes_root()
    return sorted(p.name for p in root.iterdir() if is_recipe(p)) if root.is_dir() else []


def resolve(name_or_path: str) -> Path:
    """A recipe folder from a name under recipes/ or a path to a folder (a copied recipe, say)."""
    path = Path(name_or_path)
    if is_recipe(path):
        return path
    candidate = recipes_root() / name_or_path
    if is_recipe(candidate):
        return candidate
    names = ", ".join(available()) or "none found under ./recipes"
    if path.is_dir():
        missing = [f for f in RECIPE_FILES if not (path / f).is_file()]
        raise UserError(f"{path} is not a recipe folder: missing {', '.join(missing)}.")
    raise UserError(f"unknown recipe '{name_or_path}'. Available: {names}. Fix: RECIPE=<one of those> (see `make help`).")


def describe(recipe: Path) -> str:
    """The first sentence-line of the recipe README after its title."""
    readme = recipe / "README.md"
    if readme.is_file():
        for line in readme.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                return line.strip()
    return ""


@cli
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["list"]:
        for name in available():
            print(f"  {name:<24} {describe(recipes_root() / name)}")
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        resolve(argv[1])
        return 0
    raise UserError("usage: python -m fsdp_recipes.config.recipes list | check NAME")


if __name__ == "__main__":
    sys.exit(main())
