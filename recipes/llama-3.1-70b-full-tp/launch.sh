#!/usr/bin/env bash
# Run this recipe: checks, `accelerate launch` with ./accelerate.yaml over its trainer YAML (./sft.yaml or
# ./dpo.yaml), then a summary. Extra arguments override that YAML's fields: ./launch.sh --max_steps 20 --output_dir runs/x
# FSDP_RECIPES_SMOKE=1 ./launch.sh runs it on CPU instead, with a tiny model of the same architecture.
# Needs the fsdp-recipes pack (not on PyPI) in the active Python environment (its `python`, else `python3`):
# pip install <fsdp_recipes-*.whl>
# (make wheel in a clone of the fsdp-recipes repository writes it to dist/) or pip install <that clone>.
# Written by the fsdp-recipes repository's scripts/sync_recipes.py, the same for every recipe.
set -euo pipefail
py=$(command -v python || command -v python3 || true)
if [ -z "$py" ] || ! "$py" -c "import fsdp_recipes" 2>/dev/null; then
  echo "error: the fsdp-recipes pack is not installed for ${py:-python or python3 (neither is on PATH)}. Fix: activate the environment that has it, or pip install <fsdp_recipes-*.whl> (make wheel in a clone of the fsdp-recipes repository writes it to dist/) or pip install <that clone>." >&2
  exit 2
fi
exec "$py" -m fsdp_recipes.launch.launcher "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" "$@"
