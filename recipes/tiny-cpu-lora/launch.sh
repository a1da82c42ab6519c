#!/usr/bin/env bash
# Run this recipe: checks, `accelerate launch` with ./accelerate.yaml over ./sft.yaml, then a summary.
# Extra arguments override sft.yaml fields, e.g. ./launch.sh --max_steps 20 --output_dir runs/x
# Needs the pack installed (pip install fsdp-recipes, or pip install -e <repo>); the logic is shared there.
set -euo pipefail
exec python -m fsdp_recipes.launch "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" "$@"
