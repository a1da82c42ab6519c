#!/usr/bin/env bash
# Container command of every manifest under k8s/generated/ (PyTorchJob, TrainJob, Run:ai): one pod = one node.
#   bash k8s/entrypoint.sh <recipe> [--recipe_field value ...]
# It turns the platform's rendezvous variables into FSDP_RECIPES_LAUNCH_ARGS and runs recipes/<recipe>/launch.sh,
# the same launcher as on a workstation. The manifests set FSDP_NNODES and FSDP_GPUS_PER_NODE (known when they
# are generated); the platform sets the node rank and the rendezvous address:
#   Kubeflow Trainer TrainJob (torch runtime): PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
#   Kubeflow PyTorchJob, and Run:ai (which creates one): RANK (pod index, master 0), MASTER_ADDR, MASTER_PORT
# Exit code: the pack exits 75 after a preemption checkpoint; this script exits 138 instead (128 + SIGUSR1),
# the code Kubeflow's `restartPolicy: ExitCode` reserves for user-defined retryable failures (it treats 1-127
# as permanent), so the pod is recreated and auto_resume continues from the checkpoint.
set -euo pipefail

recipe="${1:?usage: k8s/entrypoint.sh <recipe> [--field value ...]}"
shift
nnodes="${FSDP_NNODES:-1}"
gpus="${FSDP_GPUS_PER_NODE:?FSDP_GPUS_PER_NODE is not set; the generated manifests set it}"
rank="${PET_NODE_RANK:-${RANK:-0}}"
addr="${PET_MASTER_ADDR:-${MASTER_ADDR:-localhost}}"
port="${PET_MASTER_PORT:-${MASTER_PORT:-29500}}"

if [ "$rank" -ge "$nnodes" ]; then
  echo "error: node rank $rank is outside the $nnodes node(s) this job was generated for." \
    "Fix: regenerate with make k8s NODES=<n>." >&2
  exit 2
fi
if [ "$nnodes" -gt 1 ]; then
  launch_args="--num_machines $nnodes --machine_rank $rank --main_process_ip $addr --main_process_port $port"
  launch_args+=" --num_processes $((nnodes * gpus)) --rdzv_backend c10d"
else
  launch_args="--num_processes $gpus"
fi
# Recipe-specific launch options chosen by the generator (e.g. the HSDP replicate size for this node count).
export FSDP_RECIPES_LAUNCH_ARGS="$launch_args ${FSDP_K8S_LAUNCH_EXTRA:-}"
echo "[k8s] node $rank of $nnodes, $gpus GPU(s) per node; accelerate launch options: $FSDP_RECIPES_LAUNCH_ARGS"

# A child plus `wait` instead of exec: the script must see the exit code to map it, and as PID 1 it must pass
# on the kubelet's SIGTERM (bash defers traps while a foreground child runs, but not during `wait`).
# The traps go in before the child starts, and a signal that lands before `child` is known is sent afterwards.
# SIGINT is passed on as SIGTERM: a background child of a non-interactive shell ignores SIGINT.
child=""
pending=""
# shellcheck disable=SC2329  # called from the trap strings, which shellcheck does not read
forward() { if [ -n "$child" ]; then kill -"$1" "$child" 2>/dev/null || true; else pending="$1"; fi; }
trap 'forward TERM' TERM INT
trap 'forward USR1' USR1
bash "recipes/$recipe/launch.sh" "$@" &
child=$!
if [ -n "$pending" ]; then kill -"$pending" "$child" 2>/dev/null || true; fi
rc=0
wait "$child" || rc=$?
# `wait` returns early (rc > 128) when a trapped signal arrives; wait again for the launcher's own exit code.
while kill -0 "$child" 2>/dev/null; do
  rc=0
  wait "$child" || rc=$?
done
if [ "$rc" -eq 75 ]; then
  echo "[k8s] preempted with a checkpoint saved: exiting 138 so the pod is retried and resumes" >&2
  exit 138
fi
exit "$rc"
