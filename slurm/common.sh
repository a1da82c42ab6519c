# shellcheck shell=bash
# Shared by slurm/fsdp_1node.sbatch and slurm/fsdp_multinode.sbatch (sourced, not run).
#
# Inputs (environment, exported by sbatch from the submitting shell):
#   RECIPE          recipe name under recipes/ or a recipe folder (default tiny-cpu-lora)
#   ARGS            recipe YAML (sft.yaml, dpo.yaml) overrides, shell-quoted: ARGS="--max_steps 20 --output_dir runs/x"
#                   (arguments after the script name on the sbatch line are appended to these)
#   PYTHON          interpreter with the pack installed (default: <repo>/.venv/bin/python, else python3)
#   FSDP_RECIPES_HOME  the repository (default: $SLURM_SUBMIT_DIR, i.e. submit from the repository root)

# absolute, for the per-node shells that srun starts (they source this file again)
COMMON="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"
export COMMON
EXIT_PREEMPTED=75  # fsdp_recipes.errors.EXIT_PREEMPTED: a checkpoint was saved, run again to resume

die() {
  echo "error: $*" >&2
  exit 2
}

say() {
  echo "[slurm] $*"
}

# cd to the repository, pick the interpreter, check the recipe; sets PACK_DIR PYTHON RECIPE OVERRIDES and
# exports what the per-node shells need.
fsdp_setup() {
  [ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job. Fix: submit with sbatch, e.g. RECIPE=tiny-cpu-lora sbatch $0"
  PACK_DIR="${FSDP_RECIPES_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}"
  cd "$PACK_DIR" || die "cannot cd to $PACK_DIR. Fix: set FSDP_RECIPES_HOME=<repo>."
  if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"; else PYTHON=python3; fi
  fi
  "$PYTHON" -c 'import fsdp_recipes' 2>/dev/null ||
    die "$PYTHON cannot import fsdp_recipes. Fix: make venv (or pip install -e .), or set PYTHON=<venv>/bin/python."
  RECIPE="${RECIPE:-tiny-cpu-lora}"
  "$PYTHON" -m fsdp_recipes.config.recipes check "$RECIPE" || exit 2  # prints its own one-line error
  # ARGS is split like a shell would (quotes kept), by Python's shlex rather than eval
  "$PYTHON" -c 'import shlex, sys; shlex.split(sys.argv[1])' "${ARGS:-}" 2>/dev/null ||
    die "ARGS has unbalanced quotes: ${ARGS:-}. Fix: ARGS=\"--field value ...\" with matched quotes."
  mapfile -d '' -t OVERRIDES < <("$PYTHON" -c \
    'import shlex, sys; sys.stdout.write("".join(a + "\0" for a in shlex.split(sys.argv[1])))' "${ARGS:-}")
  OVERRIDES+=("$@")
  export PYTHON RECIPE
}

# What the recipe's sharding was planned for: sets RECIPE_PROCS (accelerate num_processes, the shard group),
# RECIPE_FSDP (1 or 2) and RECIPE_GPUS (min_gpus; 0 = a CPU recipe). An override of min_gpus in ARGS wins.
recipe_info() {
  local info
  info="$("$PYTHON" - "$RECIPE" "${OVERRIDES[@]}" <<'PY'
import sys
from fsdp_recipes.config import recipes
recipe = recipes.load(sys.argv[1], sys.argv[2:])
fsdp = (recipe.accelerate.get("fsdp_config") or {}).get("fsdp_version", 1)
print(recipe.accelerate.get("num_processes", 1), fsdp, recipe.field("min_gpus", 0))
PY
)" || die "cannot read recipes/$RECIPE/accelerate.yaml or its trainer YAML (see above)."
  # shellcheck disable=SC2034  # read by the sbatch scripts that source this file
  read -r RECIPE_PROCS RECIPE_FSDP RECIPE_GPUS <<<"$info"
}

# NCCL for InfiniBand + NVLink nodes. Each is only a default: export your own value before sbatch to change it.
nccl_defaults() {
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"            # use InfiniBand between nodes
  export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PHB}"    # GPUDirect RDMA when NIC and GPU share a host bridge
  export NCCL_P2P_LEVEL="${NCCL_P2P_LEVEL:-NVL}"            # peer-to-peer inside a node over NVLink
  # a dead peer aborts the collective (and the job, via --kill-on-bad-exit) instead of hanging until walltime
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  # NCCL_SOCKET_IFNAME is site specific (e.g. ib0, eth0): set it yourself when NCCL picks the wrong interface
}

# One node's part of the job step (run by srun on every node). Exit 75 from the launcher (saved, preempted)
# becomes 0 plus a marker on the node: otherwise the first node to finish its save would count as a bad exit
# and --kill-on-bad-exit would kill the launchers that are still saving. The batch shell reads the marker.
node_launch() {
  local rc=0 is_host=0
  if [ -n "${FSDP_LAUNCH_BASE:-}" ]; then  # multi-node: machine rank from SLURM_NODEID
    # node 0 hosts the c10d store (is_host): no guessing from hostnames, which may be aliases or shared
    [ "$SLURM_NODEID" -eq 0 ] && is_host=1
    export FSDP_RECIPES_LAUNCH_ARGS="$FSDP_LAUNCH_BASE --machine_rank $SLURM_NODEID --rdzv_conf join_timeout=$RDZV_JOIN_TIMEOUT,is_host=$is_host"
  fi
  # Slurm signals every process of the step; the launcher passes them on. This shell must just not die of
  # them (a trap, not an ignore, so that the launcher starts with the default handlers).
  trap ':' USR1 TERM INT
  "$PYTHON" -m fsdp_recipes.launch.launcher "$@" || rc=$?
  if [ "$rc" -eq "$EXIT_PREEMPTED" ]; then
    touch "$(preempt_marker)"
    rc=0
  fi
  exit "$rc"
}

preempt_marker() {
  echo "${TMPDIR:-/tmp}/fsdp-recipes-preempted-${SLURM_JOB_ID}"
}

# Run the job step (srun ... node_launch) and act on how it ends. Slurm's `--signal=USR1@<grace>` reaches the
# step's processes, i.e. the pack's launcher, which saves a checkpoint and exits 75; we then requeue the job
# and the requeued run resumes from that checkpoint. The step runs in the background so that a SIGTERM to
# this batch shell (scancel, preemption) is noted while the step finishes its save, instead of killing us.
run_step() {
  local pid rc
  rm -f "$(preempt_marker)"
  trap 'say "batch shell got SIGTERM; waiting for the step to save and exit"' TERM
  # shellcheck disable=SC2016  # $0 and $@ belong to the per-node shell
  "$@" bash -c 'source "$0" && node_launch "$@"' "$COMMON" "$RECIPE" "${OVERRIDES[@]}" &
  pid=$!
  while true; do
    rc=0
    wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break  # still running: wait was interrupted by the trap
  done
  trap - TERM
  if [ -e "$(preempt_marker)" ]; then
    rm -f "$(preempt_marker)"
    say "preempted: checkpoint saved; requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) to resume"
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0
    fi
    # scancel'd (nothing to requeue), or Slurm's own preemption is already requeueing it
    say "scontrol requeue $SLURM_JOB_ID refused (see above); to resume, submit the same command again"
    exit "$EXIT_PREEMPTED"
  fi
  [ "$rc" -eq 0 ] || say "the step exited with code $rc"
  exit "$rc"
}
