#!/usr/bin/env bash
# Wheels for the lent GPU machine (the device tool: Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15,
# peft; no trl, datasets, liger-kernel, torchao or flash-attn; nothing can be downloaded there) into .whl/, which
# travels with a `run` call that names it in `carry`. See bench/README.md ("GPU ladder") for the run command.
#
#   bash scripts/device_wheels.sh            # here, on the CPU machine, in any directory
#
# What and why (versions are the ones this pack is tested with; pure-Python wheels unless said):
#   trl, datasets             missing there; datasets' own missing needs: dill, multiprocess (its other needs,
#                             pyarrow, pandas, xxhash, fsspec, huggingface-hub, tqdm, are in that image)
#   transformers 5.23, peft   the image has transformers 5.17; the pack is tested with 5.23 (same needs: tokenizers
#                             0.23, safetensors 0.8, huggingface-hub 1.3x are there)
#   liger-kernel 0.8.5        rung 2 (Triton kernels; triton is there)
#   torchao 0.18.0            rung 4 (float8); a cp310-abi3 manylinux wheel whose C++ extensions target torch 2.11
# flash-attn is not carried: PyPI has no wheel of it, and building it takes far longer than a 10-minute call.
# One version of each, --no-deps: pip on the GPU machine installs them with --no-index --no-deps.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

WHEELS=(
  trl==1.16.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  transformers==5.23.0
  peft==0.21.2
  liger-kernel==0.8.5
  torchao==0.18.0
)

# .whl/ must never be committed: ignore it in this clone only (not in .gitignore, which other clones share).
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

rm -rf .whl
mkdir -p .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"

count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "error: expected ${#WHEELS[@]} wheels in .whl, found $count" >&2
  exit 1
fi
ls -1 .whl
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "$count wheels, $((bytes / 1024 / 1024)) MiB in .whl (a run call carries at most 64 MiB in all)"
