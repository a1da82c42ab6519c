"""One way for a test to derive a recipe: a copy of a recipe folder with some fields changed, so that no test file
carries its own copy-and-edit helper."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from conftest import REPO
from fsdp_recipes.config.recipes import config_file

# SFTConfig fields another kind's config lacks (or, for a sampling kind, would have to divide by num_generations)
SFT_ONLY = ("packing", "dataset_text_field")


def recipe_variant(parent: Path, name: str = "my-recipe", base: str = "tiny-cpu-lora", *, trainer: str | None = None,
                   drop: tuple[str, ...] = (), accelerate: dict | None = None, **fields) -> Path:
    """recipes/<base> copied to parent/<name>, its trainer YAML with `fields` set and `drop` removed. `trainer`: the
    YAML becomes <trainer>.yaml with `trainer: <trainer>` (SFT-only fields dropped). `accelerate`: keys of
    accelerate.yaml to set, `fsdp_config.<key>` reaching into fsdp_config. An existing folder is returned as it is
    (a test's second call shares the first's)."""
    dst = parent / name
    if dst.exists():
        return dst
    shutil.copytree(REPO / "recipes" / base, dst)
    source = config_file(dst)
    raw = yaml.safe_load(source.read_text())
    if trainer is not None:
        source.unlink()
        drop = (*drop, *SFT_ONLY)
        source = dst / f"{trainer}.yaml"
        raw["trainer"] = trainer
    for key in drop:
        raw.pop(key, None)
    raw.update(fields)
    source.write_text(yaml.safe_dump(raw))
    if accelerate:
        acc = yaml.safe_load((dst / "accelerate.yaml").read_text())
        for key, value in accelerate.items():
            section, _, leaf = key.rpartition(".")
            (acc.setdefault(section, {}) if section else acc)[leaf] = value
        (dst / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    return dst
