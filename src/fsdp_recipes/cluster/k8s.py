"""Kubernetes: Kubeflow PyTorchJob, Kubeflow Trainer TrainJob and Run:ai manifests for a recipe, from one source.

    fsdp-recipes job --launcher k8s <recipe> --nodes N --gpus G [--out DIR] [--image IMG] [--pvc-checkpoints NAME] ...
    make k8s RECIPE=<recipe> NODES=N GPUS=G

Writes k8s/generated/<recipe>/ (or --out):
    pytorchjob.yaml        kubeflow.org/v1 PyTorchJob: 1 Master + N-1 Workers, restartPolicy ExitCode
    trainjob.yaml          trainer.kubeflow.org/v1alpha1 TrainJob on the torch-distributed runtime
    runai.yaml             run.ai/v2alpha1 TrainingWorkload (1 node) or DistributedWorkload (N nodes)
    runai-submit.sh        the same workload through the Run:ai CLI (runai training [pytorch] submit)
    pvc-checkpoints.yaml   the ReadWriteMany claim the checkpoints live on (skip it if the claim exists)
    priorityclass.yaml     a low, non-preempting PriorityClass (cluster admins apply it once, or pass your own)

Every output is built from manifests/pod.py's `workload()`; manifests/<platform>.py arranges it for each API.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from fsdp_recipes.cluster.job import Job
from fsdp_recipes.cluster.manifests.pod import CKPT_MOUNT, DATA_MOUNT, WORKDIR, to_yaml, workload
from fsdp_recipes.cluster.manifests.pytorchjob import pytorchjob
from fsdp_recipes.cluster.manifests.runai import runai_submit_script, runai_workload
from fsdp_recipes.cluster.manifests.storage import checkpoint_pvc, priority_class
from fsdp_recipes.cluster.manifests.trainjob import trainjob
from fsdp_recipes.config.preemption import scheduler_grace
from fsdp_recipes.errors import UserError

DESCRIPTION = "Kubernetes: Kubeflow PyTorchJob, TrainJob and Run:ai manifests (k8s/README.md)"
SIGNAL = signal.SIGTERM  # the kubelet's, terminationGracePeriodSeconds before its SIGKILL
OUTPUT_DIR = "k8s/generated"
RETRYABLE_EXIT = 138  # what k8s/entrypoint.sh turns the pack's preemption exit 75 into
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SUBMITTED = {  # --platform: which of the files `--submit` hands to the cluster
    "pytorchjob": ["pvc-checkpoints.yaml", "pytorchjob.yaml"],
    "trainjob": ["pvc-checkpoints.yaml", "trainjob.yaml"],
    "runai": ["runai-submit.sh"],
}


def grace_seconds(grace_s: int) -> int:
    return scheduler_grace(grace_s)


def add_arguments(p) -> None:
    p.add_argument("--name", help="job name (default ft-<recipe>)")
    p.add_argument("--image", default="fsdp-recipes:latest", help=f"an image holding this repository at {WORKDIR}")
    p.add_argument("--namespace", default="default")
    p.add_argument("--pvc-data", default="fsdp-data", help=f"existing claim mounted at {DATA_MOUNT}")
    p.add_argument("--pvc-checkpoints", default="fsdp-checkpoints", help=f"claim mounted at {CKPT_MOUNT}")
    p.add_argument("--checkpoint-size", default="1Ti", help="size requested by pvc-checkpoints.yaml")
    p.add_argument("--storage-class", default="", help="storageClassName of pvc-checkpoints.yaml (RWX)")
    p.add_argument("--priority-class", default="fsdp-finetune-low")
    p.add_argument("--trainjob-runtime", default="torch-distributed", help="ClusterTrainingRuntime of the TrainJob")
    p.add_argument("--shm-size", default="64Gi", help="size of the /dev/shm memory volume")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra env, e.g. NCCL_SOCKET_IFNAME=eth0"
    )
    p.add_argument("--platform", choices=sorted(SUBMITTED), default="pytorchjob", help="what --submit applies")


def check_name(value: str | None, flag: str, what: str) -> str:
    if not value:
        raise UserError(f"{what} is missing: {flag} is empty. Fix: {flag} <name of an existing PersistentVolumeClaim>.")
    if len(value) > 63 or not DNS_LABEL.match(value):
        raise UserError(
            f"{flag} '{value}' is not a valid Kubernetes name (lowercase letters, digits and '-', at most 63). "
            f"Fix: {flag} <a name like fsdp-checkpoints>."
        )
    return value


def check(job: Job) -> None:
    opts = job.options
    check_name(opts.pvc_checkpoints, "--pvc-checkpoints", "the output volume (checkpoint claim)")
    check_name(opts.pvc_data, "--pvc-data", "the data volume")
    check_name(opts.priority_class, "--priority-class", "the priority class")
    if opts.name:
        check_name(opts.name, "--name", "the job name")
    bad_env = [kv for kv in opts.env if "=" not in kv or not kv.split("=", 1)[0]]
    if bad_env:
        raise UserError(f"--env {bad_env[0]!r} is not KEY=VALUE. Fix: --env NCCL_SOCKET_IFNAME=eth0")


def render(job: Job) -> dict[str, str]:
    """File name -> text for every output."""
    w = workload(job)
    return {
        "pytorchjob.yaml": to_yaml(w, pytorchjob(w), "kubectl apply -f pytorchjob.yaml"),
        "trainjob.yaml": to_yaml(
            w, trainjob(w),
            f"kubectl apply -f trainjob.yaml. The runtime {w['runtime']} must give the pod "
            f"terminationGracePeriodSeconds >= {w['grace_s']}",
            "for the preemption checkpoint (see k8s/README.md).",
        ),
        "runai.yaml": to_yaml(w, runai_workload(w), "kubectl apply -f runai.yaml -n runai-<project>"),
        "runai-submit.sh": runai_submit_script(w),
        "pvc-checkpoints.yaml": to_yaml(w, checkpoint_pvc(w), "Create the checkpoint claim once."),
        "priorityclass.yaml": to_yaml(
            w, priority_class(w), "Cluster-scoped: a cluster admin applies it once (or pass --priority-class)."
        ),
    }


def submit_command(job: Job, out: Path) -> list[str]:
    files = SUBMITTED[job.options.platform]
    if files == ["runai-submit.sh"]:
        return ["bash", str(out / files[0])]
    return ["kubectl", "apply", *(a for name in files for a in ("-f", str(out / name)))]
