"""Recipes: `recipes/<name>/` folders holding a trainer YAML (`sft.yaml`, `dpo.yaml`, `grpo.yaml`: the trainer
kind's name), accelerate.yaml, launch.sh and README.md; and `Recipe`, one recipe loaded once.

    fsdp-recipes recipes list          # name, trainer and one-line description of each recipe
    fsdp-recipes recipes check NAME    # exit 2 with a clear line when NAME is not a recipe

A recipe names its trainer with the `trainer` field (default `sft`) and keeps its settings in `<trainer>.yaml`.
The launcher loads a recipe here once (`load`): the YAMLs as written, the command line's overrides, and later the
parsed configuration and the warnings its checks found; placement, the grace period, the smoke run, the parse
and the summary read that object instead of the files.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_recipes.config.accelerate_yaml import read_accelerate_config, take_wrap_override
from fsdp_recipes.config.argv import as_bool, as_int, override
from fsdp_recipes.config.kind_registry import DEFAULT_TRAINER, TRAINERS, trainer_kind
from fsdp_recipes.config.run_config import PATH_FIELDS, PackArguments, kinds_with_field
from fsdp_recipes.config.value_checks import check_training_values
from fsdp_recipes.config.yaml_keys import load_yaml, remembered_values
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.paths import cache_dir, expand, same_path_key

if TYPE_CHECKING:
    from fsdp_recipes.config.run_config import RunConfig

# Trainer kinds (config/kind_registry.py): a recipe's settings live in <kind>.yaml, fields of TRL's config class for
# that kind (docs/architecture.md, "Adding a trainer kind").
__all__ = ["DEFAULT_TRAINER", "TRAINERS"]
ACCELERATE_FILE = "accelerate.yaml"


def recipes_root() -> Path:
    return Path(os.environ.get("FSDP_RECIPES_DIR", "recipes"))


def trainer_files(path: Path) -> list[Path]:
    return [path / f"{kind}.yaml" for kind in TRAINERS if (path / f"{kind}.yaml").is_file()]


def is_recipe(path: Path) -> bool:
    return (path / ACCELERATE_FILE).is_file() and len(trainer_files(path)) == 1


def available(root: Path | None = None) -> list[str]:
    root = root or recipes_root()
    return sorted(p.name for p in root.iterdir() if is_recipe(p)) if root.is_dir() else []


def missing_files(path: Path) -> list[str]:
    missing = [] if (path / ACCELERATE_FILE).is_file() else [ACCELERATE_FILE]
    if not trainer_files(path):
        missing.append(" or ".join(f"{kind}.yaml" for kind in TRAINERS))
    return missing


def resolve(name_or_path: str) -> Path:
    """A recipe folder from a name under recipes/ or a path to a folder (a copied recipe, say)."""
    path = Path(name_or_path)
    if is_recipe(path):
        return path
    candidate = recipes_root() / name_or_path
    if is_recipe(candidate):
        return candidate
    for folder in (path, candidate):
        if folder.is_dir() and len(trainer_files(folder)) > 1:
            found = ", ".join(p.name for p in trainer_files(folder))
            raise UserError(f"{folder} holds {found}: a recipe trains with one trainer. Fix: keep one of them, and "
                            "make the other a recipe folder of its own.")
    if path.is_dir():
        raise UserError(f"{path} is not a recipe folder: missing {', '.join(missing_files(path))}. Fix: copy the "
                        f"missing file(s) from the recipe the folder came from (recipes/<name>/; `make help` lists "
                        f"them), or point at a recipe folder.")
    # a prefix names a family (mistral: six recipes): all of them; else the one closest spelling
    close = [n for n in available() if n.startswith(name_or_path)] or difflib.get_close_matches(
        name_or_path, available(), n=1)
    if close:
        raise UserError(f"unknown recipe '{name_or_path}'. Fix: did you mean "
                        f"{' or '.join(f'RECIPE={n}' for n in close)}? (all of them: `make help`)")
    if not available():  # run outside the project: names are looked up in ./recipes (or $FSDP_RECIPES_DIR)
        raise UserError(f"unknown recipe '{name_or_path}': no recipe folders in {recipes_root().resolve()}, where "
                        f"names are looked up. Fix: give the recipe's folder (path/to/recipes/{name_or_path}), run "
                        "from the project that holds recipes/, or set FSDP_RECIPES_DIR to that recipes/ folder.")
    raise UserError(f"unknown recipe '{name_or_path}'. Available: {', '.join(available())}. Fix: RECIPE=<one of "
                    "those> (see `make help`).")


def config_file(folder: Path) -> Path:
    """The recipe's trainer YAML (`sft.yaml`, `dpo.yaml`, ...)."""
    files = trainer_files(folder)
    if len(files) != 1:
        resolve(str(folder))  # says what is wrong
    return files[0]


@dataclasses.dataclass(frozen=True)
class EarlyFields:
    """The settings the launcher's first checks read before the full parse (which imports TRL's classes, while the
    ranks import): the YAML's values with the command line's on top, typed as that parse types them, paths expanded
    as it expands them (PATH_FIELDS); the pack's defaults are PackArguments' (config/run_config.py)."""

    model_name_or_path: str | None
    model_revision: str | None
    dataset_name: str | None
    output_dir: str | None
    continues_from: str | None
    min_gpus: int
    tiny_assets: bool
    smollm2_assets: bool
    addition_preferences: bool

    @classmethod
    def read(cls, field: Callable[[str, Any], Any]) -> EarlyFields:
        pack = {f.name: f.default for f in dataclasses.fields(PackArguments)}
        typed = {"bool": as_bool, "int": as_int}
        values = {}
        for f in dataclasses.fields(cls):
            value = field(f.name, pack.get(f.name))  # a bool default: a bare `--key` is True (config/argv.py)
            if value is None:  # `key:` left empty in the YAML: the full parse's default
                value = pack.get(f.name)
            convert = typed.get(str(f.type))
            values[f.name] = convert(f.name, value) if convert else (None if value is None else str(value))
            if f.name in PATH_FIELDS:
                values[f.name] = expand(values[f.name], f.name)
        return cls(**values)


@dataclasses.dataclass
class Recipe:
    """One recipe as loaded once by the launcher and shared by everything after it."""

    folder: Path
    trainer: str  # the trainer kind: a key of TRAINERS
    config_path: Path  # recipes/<name>/<trainer>.yaml
    raw: dict  # that YAML as written
    accelerate_path: Path  # the accelerate YAML the ranks launch with (make smoke: a scaled copy)
    accelerate: dict  # that YAML as written
    overrides: list[str]  # command-line fields, the user's last (they win)
    launch_options: list[str] = dataclasses.field(default_factory=list)  # `accelerate launch` options given there
    accelerate_written: dict = dataclasses.field(default_factory=dict)  # recipes/<name>/accelerate.yaml as written
    # the model the command line names instead of the trainer YAML's (None: the recipe's own): a wrap class the
    # recipe's accelerate YAML names for its own model then gives way to this one's (config/model_check.py)
    user_model: str | None = None
    cfg: RunConfig | None = None  # the resolved configuration, once the launcher's checks parsed it
    warnings: list[str] = dataclasses.field(default_factory=list)  # what the checks printed as warnings

    @property
    def name(self) -> str:
        return Path(os.path.abspath(self.folder)).name  # "." (the folder one stands in) has a name too

    def field(self, key: str, default: Any = None) -> Any:
        """A field as the run will see it before the full parse: the command line's value, else the YAML's."""
        return override(self.overrides, key, self.raw.get(key, default))

    def differing(self, settings: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{field: (its value now, the value in `settings`)} for each of `settings` the recipe sets otherwise."""
        now = {key: self.field(key) for key in settings}
        return {key: (now[key], value) for key, value in settings.items() if now[key] != value}

    @property
    def early(self) -> EarlyFields:
        """The settings the launcher reads before the full parse, typed (EarlyFields), as the overrides stand now."""
        return EarlyFields.read(self.field)

    def argv(self) -> list[str]:
        """The recipe as a parse reads it (config/run_config.py): the trainer YAML and the overrides."""
        return ["--config", str(self.config_path), *self.overrides]


def load(name_or_path: str | Path, overrides: list[str] = (), check_keys: bool = False) -> Recipe:
    """Find the recipe, read its trainer YAML and accelerate YAML (each once), check the trainer kind; an
    --fsdp_transformer_layer_cls_to_wrap among the overrides goes into the accelerate config and launch_options.
    `check_keys`: the launcher's, check_keys_early as well."""
    folder = resolve(str(name_or_path))
    path = config_file(folder)
    raw = load_yaml(path, "recipe config")
    kind = trainer_kind(raw, path, overrides)
    acc_path = folder / ACCELERATE_FILE
    written = read_accelerate_config(acc_path)
    overrides, acc, options = take_wrap_override(list(overrides), written, acc_path)
    if check_keys:
        check_keys_early(kind, raw, path, overrides)
    model = override(overrides, "model_name_or_path", None)
    own = raw.get("model_name_or_path")
    named_other = model is not None and (own is None or same_path_key(model) != same_path_key(str(own)))
    user_model = model if named_other else None
    return Recipe(folder, kind, path, raw, acc_path, acc, overrides, options, accelerate_written=written,
                  user_model=user_model)


def check_keys_early(kind: str, raw: dict, path: Path, overrides: list[str]) -> None:
    """A mistyped key or flag, a word where a number goes and a value out of its range (config/value_checks.py) are
    one line before the config classes' imports, where an earlier launch remembered the kind's fields
    (config/yaml_keys.py); otherwise the checks name them, the ranks started."""
    values = remembered_values(kind, raw, path, overrides, cache_dir(), functools.partial(kinds_with_field, but=kind))
    if values is None:
        return
    try:
        check_training_values(values, str(getattr(values, "eval_strategy", "no")) != "no")
    except (TypeError, AttributeError):  # a field that is no plain value here (a kind without it): the parser's turn
        pass


def describe(recipe: Path) -> str:
    """The recipe README's first paragraph after its title, on one line (its first line alone stopped mid-sentence
    where the paragraph wraps), markdown links as their text."""
    readme = recipe / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    paragraph = next((p for p in re.split(r"\n\s*\n", text) if p.strip() and not p.lstrip().startswith("#")), "")
    return re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", " ".join(paragraph.split()))


@cli
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["list"]:
        for name in available():
            folder = recipes_root() / name
            print(f"  {name:<26} {config_file(folder).stem:<4} {describe(folder)}")
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        resolve(argv[1])
        return 0
    usage = "usage: fsdp-recipes recipes list | check NAME"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n  list        the recipes here, with their trainer and what each is\n"
              "  check NAME  exit 0 where NAME is a recipe here, else one line naming the nearest")
        return 0
    raise UserError(f"{usage}. Fix: fsdp-recipes recipes list")


if __name__ == "__main__":
    sys.exit(main())
